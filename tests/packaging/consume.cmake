# One packaging test: get cudamem one way (MODE), build the consumer project in a fresh
# directory, run its consumers, and check what must (not) be there. Run by ctest in two steps,
#   cmake -D MODE=... -D STEP=build -D <the variables below> -P consume.cmake
#   cmake -D MODE=... -D STEP=run   -D WORK_DIR=... -D EXPECTED_VERSION=... -P consume.cmake
# because only the second touches the GPU: the build runs in parallel with everything, the run
# holds the GPU tests' lock (tests/CMakeLists.txt) so that its context cannot take memory that
# a GPU test is measuring.
#
# STEP             build            get cudamem, configure and build the consumers
#                  run              run the consumers built by the build step (consumers.txt)
#
# MODE             install          `cmake --install` the developer build tree, find_package
#                                   (and find_package(cudamem_c) when that tree built the C
#                                   library: then it must be installed, else it must not)
#                  install_defaults `cmake -S . -B build && cmake --install build`: default
#                                   options (tests on), nothing built; the install skips the
#                                   C library with one status line, find_package
#                  install_c_api    -DCUDAMEM_BUILD_C_API=ON: installing before building must
#                                   fail saying to build first, and install nothing of it;
#                                   then build, install, find_package(cudamem) and
#                                   find_package(cudamem_c), and a C program
#                  vcpkg            the steps of ports/cudamem/portfile.cmake, then find_package
#                  add_subdirectory the source tree, add_subdirectory
#                  fetchcontent     a tarball of the source tree, FetchContent
# SOURCE_DIR       cudamem's source tree
# BUILD_TREE       the developer build tree (MODE=install)
# WORK_DIR         scratch directory, emptied first
# GENERATOR, CUDA_COMPILER, CUDA_ARCHITECTURES, PREFIX_PATH (where GSL is), EXPECTED_VERSION
cmake_minimum_required(VERSION 3.25)
include(${CMAKE_CURRENT_LIST_DIR}/packaging_checks.cmake)

set(consumer_build ${WORK_DIR}/consumer-build)
if(STEP STREQUAL "run")
  foreach(var WORK_DIR EXPECTED_VERSION)
    if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
      message(FATAL_ERROR "consume.cmake: ${var} is not set")
    endif()
  endforeach()
  file(STRINGS ${WORK_DIR}/consumers.txt consumers)
  foreach(consumer IN LISTS consumers)
    packaging_run_consumer(${consumer_build}/${consumer} ${consumer} ${EXPECTED_VERSION})
  endforeach()
  message(STATUS "packaging ${MODE}: consumers ran as expected")
  return()
elseif(NOT STEP STREQUAL "build")
  message(FATAL_ERROR "consume.cmake: STEP must be build or run, not '${STEP}'")
endif()

foreach(var MODE SOURCE_DIR WORK_DIR GENERATOR CUDA_COMPILER EXPECTED_VERSION)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "consume.cmake: ${var} is not set")
  endif()
endforeach()

file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
set(consumer_args -DCMAKE_BUILD_TYPE=Release)
set(consumers consumer_cpp consumer_cu)
set(prefix_path ${PREFIX_PATH})
# Lists (search paths, architectures) cannot pass through execute_process's argument list
# intact, so they go to the configure steps in initial-cache files (cmake -C).
file(WRITE ${WORK_DIR}/dependencies.cmake "set(CMAKE_PREFIX_PATH \"${PREFIX_PATH}\" CACHE PATH \"\")\n")

if(MODE STREQUAL "install")
  set(prefix ${WORK_DIR}/prefix)
  packaging_run(${CMAKE_COMMAND} --install ${BUILD_TREE} --prefix ${prefix})
  packaging_check_installed_tree(${prefix} share/cmake/cudamem "${SOURCE_DIR};${BUILD_TREE}")
  # The developer tree installs the C library exactly when it has built it.
  file(GLOB built_c_library ${BUILD_TREE}/capi/libcudamem_c.so.*)
  if(built_c_library)
    packaging_check_c_library(${prefix})
    list(APPEND consumer_args -DCUDAMEM_CONSUME_C_API=ON)
    list(APPEND consumers consumer_c)
  else()
    packaging_check_no_c_library(${prefix})
  endif()
  list(PREPEND prefix_path ${prefix})
  list(APPEND consumer_args -DCUDAMEM_CONSUME=find_package)

elseif(MODE STREQUAL "install_defaults")
  # What a user who installs cudamem like any header-only library types: no options at all.
  # The options' defaults are those of a top-level project (tests, examples, benchmarks on), so
  # the configure finds what the tests need (PREFIX_PATH) and the CUDA compiler.
  set(cudamem_build ${WORK_DIR}/cudamem-build)
  set(prefix ${WORK_DIR}/prefix)
  packaging_run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${cudamem_build} -G ${GENERATOR}
    -DCMAKE_CUDA_COMPILER=${CUDA_COMPILER} -C ${WORK_DIR}/dependencies.cmake)
  packaging_capture_all(install_output
                        ${CMAKE_COMMAND} --install ${cudamem_build} --prefix ${prefix})
  string(REGEX MATCHALL "Skipping libcudamem_c" skip_notes "${install_output}")
  list(LENGTH skip_notes skip_note_count)
  string(REGEX MATCH "-- Skipping libcudamem_c[^\n]*" skipped "${install_output}")
  if(NOT skip_note_count EQUAL 1 OR NOT skipped MATCHES "run cmake --build .* first\\.$")
    message(FATAL_ERROR "the install did not say once, in one line, that it skipped the "
                        "unbuilt C library and how to build it:\n${install_output}")
  endif()
  message(STATUS "the install said: ${skipped}")
  packaging_check_installed_tree(${prefix} share/cmake/cudamem "${SOURCE_DIR};${cudamem_build}")
  packaging_check_no_c_library(${prefix})
  list(PREPEND prefix_path ${prefix})
  list(APPEND consumer_args -DCUDAMEM_CONSUME=find_package)

elseif(MODE STREQUAL "install_c_api")
  # The C library asked for by name, alone: what the README says to do for C and ctypes.
  set(cudamem_build ${WORK_DIR}/cudamem-build)
  set(prefix ${WORK_DIR}/prefix)
  packaging_run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${cudamem_build} -G ${GENERATOR}
    -DCMAKE_BUILD_TYPE=Release -C ${WORK_DIR}/dependencies.cmake -DCUDAMEM_BUILD_TESTS=OFF
    -DCUDAMEM_BUILD_EXAMPLES=OFF -DCUDAMEM_BUILD_BENCHMARKS=OFF -DCUDAMEM_BUILD_C_API=ON)
  # Bad order: installing before building stops with one sentence saying to build first, and
  # leaves nothing of the C library (no package config naming a missing library).
  execute_process(COMMAND ${CMAKE_COMMAND} --install ${cudamem_build} --prefix ${prefix}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  string(REGEX REPLACE "[ \n]+" " " out_joined "${out}")  # CMake wraps its messages
  if(rc EQUAL 0 OR
     NOT out_joined MATCHES "libcudamem_c was asked for .* run cmake --build .* first")
    message(FATAL_ERROR "cmake --install before cmake --build exited ${rc} without saying to "
                        "build first:\n${out}")
  endif()
  message(STATUS "installing before building: CMake said\n${out}")
  packaging_check_no_c_library(${prefix})
  file(REMOVE_RECURSE ${prefix})
  packaging_run(${CMAKE_COMMAND} --build ${cudamem_build})
  packaging_run(${CMAKE_COMMAND} --install ${cudamem_build} --prefix ${prefix})
  packaging_check_installed_tree(${prefix} share/cmake/cudamem "${SOURCE_DIR};${cudamem_build}")
  packaging_check_c_library(${prefix})
  list(PREPEND prefix_path ${prefix})
  list(APPEND consumer_args -DCUDAMEM_CONSUME=find_package -DCUDAMEM_CONSUME_C_API=ON)
  list(APPEND consumers consumer_c)

elseif(MODE STREQUAL "vcpkg")
  # What ports/cudamem/portfile.cmake makes vcpkg do, step by step (vcpkg itself is not
  # available here). vcpkg_cmake_configure: a release-only configure with the port's options.
  # The options are read from the portfile, so the test and the port cannot drift apart.
  set(packages ${WORK_DIR}/packages)
  file(STRINGS ${SOURCE_DIR}/ports/cudamem/portfile.cmake port_options REGEX "^ +-DCUDAMEM_")
  list(TRANSFORM port_options STRIP)
  if(NOT "-DCUDAMEM_BUILD_TESTS=OFF" IN_LIST port_options)
    message(FATAL_ERROR "the portfile does not turn the tests off: ${port_options}")
  endif()
  packaging_run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/port-build -G ${GENERATOR}
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=${packages} -C ${WORK_DIR}/dependencies.cmake
    ${port_options})
  # With everything off, configuring must not have needed the CUDA compiler.
  file(STRINGS ${WORK_DIR}/port-build/CMakeCache.txt cuda_compiler_line REGEX "^CMAKE_CUDA_COMPILER:")
  if(cuda_compiler_line)
    message(FATAL_ERROR "the port's configure enabled CUDA: ${cuda_compiler_line}")
  endif()
  # vcpkg_cmake_install
  packaging_run(${CMAKE_COMMAND} --build ${WORK_DIR}/port-build --target install)
  # vcpkg_cmake_config_fixup(CONFIG_PATH share/cmake/cudamem)
  packaging_vcpkg_config_fixup(${packages} share/cmake/cudamem share/cudamem)
  # the portfile's clean-up, vcpkg_install_copyright and the usage file
  file(REMOVE_RECURSE ${packages}/share/doc)
  file(COPY_FILE ${SOURCE_DIR}/LICENSE ${packages}/share/cudamem/copyright)
  file(COPY_FILE ${SOURCE_DIR}/ports/cudamem/usage ${packages}/share/cudamem/usage)
  packaging_check_installed_tree(${packages} share/cudamem "${SOURCE_DIR};${WORK_DIR}/port-build")
  packaging_check_no_c_library(${packages})  # the port packages the headers, as it always did
  # vcpkg's toolchain puts installed/<triplet> on CMAKE_PREFIX_PATH; find_package then looks in
  # <prefix>/share/cudamem.
  list(PREPEND prefix_path ${packages})
  list(APPEND consumer_args -DCUDAMEM_CONSUME=find_package)

elseif(MODE STREQUAL "add_subdirectory")
  list(APPEND consumer_args -DCUDAMEM_CONSUME=add_subdirectory -DCUDAMEM_SOURCE_DIR=${SOURCE_DIR})
  list(APPEND consumers consumer_compiled)  # compiled mode: cudamem is part of the build

elseif(MODE STREQUAL "fetchcontent")
  # A release tarball holds what a consumer needs: no tests, examples or benchmarks, so this
  # also proves the library configures without them.
  set(archive ${WORK_DIR}/cudamem-${EXPECTED_VERSION}.tar.gz)
  set(staging ${WORK_DIR}/cudamem-${EXPECTED_VERSION})
  file(MAKE_DIRECTORY ${staging})
  file(COPY ${SOURCE_DIR}/CMakeLists.txt ${SOURCE_DIR}/LICENSE ${SOURCE_DIR}/cmake
       ${SOURCE_DIR}/include ${SOURCE_DIR}/src DESTINATION ${staging})
  packaging_run(${CMAKE_COMMAND} -E tar czf ${archive} cudamem-${EXPECTED_VERSION}
                WORKING_DIRECTORY ${WORK_DIR})
  file(REMOVE_RECURSE ${staging})
  file(SHA256 ${archive} archive_sha256)
  list(APPEND consumer_args -DCUDAMEM_CONSUME=fetchcontent -DCUDAMEM_ARCHIVE=${archive}
       -DCUDAMEM_ARCHIVE_SHA256=${archive_sha256})
  list(APPEND consumers consumer_compiled)

else()
  message(FATAL_ERROR "consume.cmake: unknown MODE '${MODE}'")
endif()

# --- the consumer ------------------------------------------------------------------------------
file(WRITE ${WORK_DIR}/consumer.cmake "set(CMAKE_PREFIX_PATH \"${prefix_path}\" CACHE PATH \"\")\n")
if(CUDA_ARCHITECTURES)
  file(APPEND ${WORK_DIR}/consumer.cmake
       "set(CMAKE_CUDA_ARCHITECTURES \"${CUDA_ARCHITECTURES}\" CACHE STRING \"\")\n")
endif()
packaging_request_codemodel(${consumer_build})
packaging_run(${CMAKE_COMMAND} -S ${CMAKE_CURRENT_LIST_DIR}/consumer -B ${consumer_build}
  -G ${GENERATOR} -DCMAKE_CUDA_COMPILER=${CUDA_COMPILER} -C ${WORK_DIR}/consumer.cmake
  ${consumer_args})
packaging_run(${CMAKE_COMMAND} --build ${consumer_build})
list(JOIN consumers "\n" consumer_lines)
file(WRITE ${WORK_DIR}/consumers.txt "${consumer_lines}\n")  # what STEP=run runs

if(MODE STREQUAL "add_subdirectory" OR MODE STREQUAL "fetchcontent")
  packaging_check_embedded(${consumer_build} ${WORK_DIR}/consumer-install)
endif()

message(STATUS "packaging ${MODE}: consumers built (STEP=run runs them)")
