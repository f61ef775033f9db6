# The Conan test: `conan create` of cudamem's conanfile.py, which builds and runs test_package/.
# ConanCenter cannot be reached here, so the ms-gsl requirement is first satisfied by a local
# recipe (tests/packaging/conan/ms-gsl) that packages the GSL headers of this machine.
# Everything Conan writes stays under WORK_DIR: its home (CONAN_HOME), profiles, package cache
# and the test_package build. Without conan the test prints SKIPPED and ctest reports it so.
#
#   cmake -D SOURCE_DIR=... -D WORK_DIR=... -D GSL_INCLUDE_DIR=... -D GSL_VERSION=...
#         -D CUDA_COMPILER=... -D CUDA_ARCHITECTURES=... -D EXPECTED_VERSION=... -P conan.cmake
cmake_minimum_required(VERSION 3.25)
include(${CMAKE_CURRENT_LIST_DIR}/packaging_checks.cmake)

# `conan` on PATH, or the module of a pip install whose scripts directory is not on PATH.
find_program(conan_program conan)
find_program(python_program NAMES python3 python)
set(CONAN "")
foreach(candidate "${conan_program}" "${python_program};-m;conans.conan")
  if(candidate MATCHES "^;|NOTFOUND")
    continue()
  endif()
  # Also rules out a pyenv shim for a Python version that does not have conan.
  execute_process(COMMAND ${candidate} --version RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
  if(rc EQUAL 0)
    set(CONAN "${candidate}")
    break()
  endif()
endforeach()
if(NOT CONAN)
  message("SKIPPED: conan is not installed (python3 -m pip install conan), "
          "so the Conan package was not tested")
  return()
endif()

file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
set(ENV{CONAN_HOME} ${WORK_DIR}/conan-home)
set(ENV{CUDAMEM_GSL_INCLUDE_DIR} ${GSL_INCLUDE_DIR})
if(CUDA_ARCHITECTURES)
  set(ENV{CUDAARCHS} "${CUDA_ARCHITECTURES}")  # the default for CMAKE_CUDA_ARCHITECTURES
endif()

packaging_run(${CONAN} profile detect --force)
set(conan_settings
  -s compiler.cppstd=20 -s build_type=Release
  -c tools.cmake.cmaketoolchain:generator=Ninja
  "-c" "tools.build:compiler_executables={'cuda': '${CUDA_COMPILER}'}"
  # test_package's build goes here, not into the source tree
  -c tools.cmake.cmake_layout:test_folder=${WORK_DIR}/test_package-build)

packaging_run(${CONAN} create ${SOURCE_DIR}/tests/packaging/conan/ms-gsl --version ${GSL_VERSION})
packaging_run(${CONAN} create ${SOURCE_DIR} ${conan_settings} SHOW_OUTPUT)

# The package holds the headers, the licence and the CUDA module, and nothing else.
execute_process(COMMAND ${CONAN} list "cudamem/${EXPECTED_VERSION}:*" --format=json
                RESULT_VARIABLE rc OUTPUT_VARIABLE listing ERROR_VARIABLE error)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "conan list failed: ${error}")
endif()
# {"Local Cache": {"cudamem/V": {"revisions": {RREV: {"packages": {PACKAGE_ID: ...}}}}}}
string(JSON recipe_revision MEMBER "${listing}" "Local Cache" "cudamem/${EXPECTED_VERSION}" revisions 0)
string(JSON package_id MEMBER "${listing}" "Local Cache" "cudamem/${EXPECTED_VERSION}" revisions
       ${recipe_revision} packages 0)
packaging_capture(package_dir ${CONAN} cache path
                  "cudamem/${EXPECTED_VERSION}#${recipe_revision}:${package_id}")
foreach(required include/cudamem/cudamem.hpp include/cudamem/version.hpp licenses/LICENSE
                 share/cudamem/cudamem-conan-cuda.cmake)
  if(NOT EXISTS ${package_dir}/${required})
    message(FATAL_ERROR "the Conan package lacks ${required}")
  endif()
endforeach()

# conan create must have left the source tree's test_package/ as it was.
file(GLOB test_package_files RELATIVE ${SOURCE_DIR}/test_package ${SOURCE_DIR}/test_package/*)
list(SORT test_package_files)
if(NOT test_package_files STREQUAL "CMakeLists.txt;conanfile.py;test_package.cpp;test_package.cu")
  message(FATAL_ERROR "conan create wrote into the source tree's test_package/: ${test_package_files}")
endif()
message(STATUS "conan: cudamem/${EXPECTED_VERSION} created, test_package built and ran")
