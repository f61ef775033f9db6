# Helpers shared by the packaging test scripts (cmake -P). Each one checks something and stops
# the test with FATAL_ERROR, saying what was wrong, when it does not hold.

# Runs a command; stops with its output when it fails, shows it anyway with SHOW_OUTPUT.
function(packaging_run)
  cmake_parse_arguments(PARSE_ARGV 0 arg "SHOW_OUTPUT" "WORKING_DIRECTORY" "")
  set(where "")
  if(arg_WORKING_DIRECTORY)
    set(where WORKING_DIRECTORY ${arg_WORKING_DIRECTORY})
  endif()
  list(JOIN arg_UNPARSED_ARGUMENTS " " shown)
  message(STATUS "running: ${shown}")
  execute_process(COMMAND ${arg_UNPARSED_ARGUMENTS} ${where}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${shown}\n${out}")
  endif()
  if(arg_SHOW_OUTPUT)
    message(STATUS "output:\n${out}")
  endif()
endfunction()

# Runs a command and stores its standard output, stripped, in `out_var`; stops when it fails.
function(packaging_capture out_var)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE error
                  OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc EQUAL 0)
    list(JOIN ARGN " " shown)
    message(FATAL_ERROR "failed (${rc}): ${shown}\n${error}")
  endif()
  set(${out_var} "${out}" PARENT_SCOPE)
endfunction()

# Runs a command and stores all it printed (standard output and error) in `out_var`; stops with
# that output when it fails.
function(packaging_capture_all out_var)
  list(JOIN ARGN " " shown)
  message(STATUS "running: ${shown}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${shown}\n${out}")
  endif()
  set(${out_var} "${out}" PARENT_SCOPE)
endfunction()

# An installed prefix must hold the headers and the package config under `config_dir`, and no
# file in it may name a directory of the machine that built it (`forbidden_paths`): the tree
# must work wherever it is copied to.
function(packaging_check_installed_tree prefix config_dir forbidden_paths)
  foreach(required include/cudamem/cudamem.hpp include/cudamem/version.hpp
                   ${config_dir}/cudamemConfig.cmake ${config_dir}/cudamemConfigVersion.cmake
                   ${config_dir}/cudamemTargets.cmake)
    if(NOT EXISTS ${prefix}/${required})
      message(FATAL_ERROR "installed tree lacks ${required}")
    endif()
  endforeach()
  packaging_check_version_file(${prefix}/${config_dir}/cudamemConfigVersion.cmake)
  file(GLOB_RECURSE installed LIST_DIRECTORIES false ${prefix}/*)
  list(LENGTH installed count)
  foreach(file IN LISTS installed)
    file(READ ${file} contents)
    foreach(path IN LISTS forbidden_paths)
      string(FIND "${contents}" "${path}" at)
      if(NOT at EQUAL -1)
        message(FATAL_ERROR "installed file ${file} contains the build machine's path ${path}")
      endif()
    endforeach()
  endforeach()
  message(STATUS "installed tree: ${count} files, none names ${forbidden_paths}")
endfunction()

# The version file answers as find_package would ask it: SameMajorVersion (an older request of
# the same major version is compatible, the next major is not) and ARCH_INDEPENDENT (a consumer
# with another pointer size is not turned away: nothing in a header-only package depends on it).
function(packaging_check_version_file version_file)
  file(STRINGS ${version_file} version_line REGEX "^set\\(PACKAGE_VERSION \"[0-9.]+\"\\)")
  string(REGEX MATCH "([0-9]+)\\.([0-9]+)\\.([0-9]+)" installed "${version_line}")
  set(major ${CMAKE_MATCH_1})
  math(EXPR next_major "${major} + 1")
  foreach(request "${major}.0;TRUE;8" "${installed};TRUE;4" "${next_major}.0;FALSE;8")
    list(GET request 0 PACKAGE_FIND_VERSION)
    list(GET request 1 expected)
    list(GET request 2 CMAKE_SIZEOF_VOID_P)
    string(REPLACE "." ";" parts "${PACKAGE_FIND_VERSION}")
    list(GET parts 0 PACKAGE_FIND_VERSION_MAJOR)
    unset(PACKAGE_VERSION_COMPATIBLE)
    unset(PACKAGE_VERSION_UNSUITABLE)
    include(${version_file})
    if(PACKAGE_VERSION_UNSUITABLE OR NOT "${PACKAGE_VERSION_COMPATIBLE}" STREQUAL "${expected}")
      message(FATAL_ERROR "cudamemConfigVersion.cmake (${installed}): a request for "
        "${PACKAGE_FIND_VERSION} from a ${CMAKE_SIZEOF_VOID_P}-byte-pointer project answered "
        "compatible=${PACKAGE_VERSION_COMPATIBLE} unsuitable=${PACKAGE_VERSION_UNSUITABLE}, "
        "expected compatible=${expected}")
    endif()
  endforeach()
endfunction()

# vcpkg_cmake_config_fixup, the part that concerns a header-only package: the config files move
# from `from` to `to` (vcpkg wants share/<port>), an emptied parent named "cmake" goes, and
# the generated code that finds the prefix from the file's own location climbs as many levels
# as `to` is deep.
function(packaging_vcpkg_config_fixup prefix from to)
  file(GLOB config_files ${prefix}/${from}/*)
  file(MAKE_DIRECTORY ${prefix}/${to})
  file(COPY ${config_files} DESTINATION ${prefix}/${to})
  file(REMOVE_RECURSE ${prefix}/${from})
  get_filename_component(parent ${prefix}/${from} DIRECTORY)
  get_filename_component(parent_name ${parent} NAME)
  file(GLOB left_in_parent ${parent}/*)
  if(parent_name STREQUAL "cmake" AND NOT left_in_parent)
    file(REMOVE_RECURSE ${parent})
  endif()

  string(REGEX MATCHALL "[^/]+" to_parts "${to}")
  list(LENGTH to_parts depth)
  set(climb_dirs "")
  set(climb_steps "get_filename_component(_IMPORT_PREFIX \"\${CMAKE_CURRENT_LIST_FILE}\" PATH)")
  foreach(level RANGE 1 ${depth})
    string(APPEND climb_dirs "../")
    string(APPEND climb_steps "\nget_filename_component(_IMPORT_PREFIX \"\${_IMPORT_PREFIX}\" PATH)")
  endforeach()
  file(GLOB moved ${prefix}/${to}/*.cmake)
  foreach(file IN LISTS moved)
    file(READ ${file} contents)
    # configure_package_config_file's @PACKAGE_INIT@
    string(REGEX REPLACE "get_filename_component\\(PACKAGE_PREFIX_DIR \"\\\${CMAKE_CURRENT_LIST_DIR}/[./]*\" ABSOLUTE\\)"
           "get_filename_component(PACKAGE_PREFIX_DIR \"\${CMAKE_CURRENT_LIST_DIR}/${climb_dirs}\" ABSOLUTE)"
           contents "${contents}")
    # install(EXPORT)'s targets file
    string(REGEX REPLACE "get_filename_component\\(_IMPORT_PREFIX \"\\\${CMAKE_CURRENT_LIST_FILE}\" PATH\\)(\nget_filename_component\\(_IMPORT_PREFIX \"\\\${_IMPORT_PREFIX}\" PATH\\))*"
           "${climb_steps}" contents "${contents}")
    file(WRITE ${file} "${contents}")
  endforeach()
endfunction()

# cudamem pulled into a consumer's build (add_subdirectory, FetchContent) must add no targets of
# its own beyond the library (no tests, examples, benchmarks, header checks) and no install
# rules: installing the consumer, which installs nothing itself, must leave the prefix empty.
function(packaging_check_embedded consumer_build install_prefix)
  packaging_target_names(${consumer_build} targets)
  foreach(wanted consumer_cu consumer_cpp consumer_compiled cudamem_compiled)
    if(NOT wanted IN_LIST targets)
      message(FATAL_ERROR "the target list lacks ${wanted}: ${targets}")
    endif()
  endforeach()
  foreach(target IN LISTS targets)
    if(NOT target MATCHES "^consumer_(cpp|cu|compiled)$|^cudamem(_compiled)?$")
      message(FATAL_ERROR "the consumer's build has a target it did not ask for: ${target}")
    endif()
  endforeach()
  if(EXISTS ${consumer_build}/CTestTestfile.cmake OR EXISTS ${consumer_build}/cudamem/CTestTestfile.cmake
     OR EXISTS ${consumer_build}/_deps/cudamem-build/CTestTestfile.cmake)
    message(FATAL_ERROR "the consumer's build has cudamem's tests (a CTestTestfile.cmake)")
  endif()
  packaging_run(${CMAKE_COMMAND} --install ${consumer_build} --prefix ${install_prefix})
  file(GLOB_RECURSE installed ${install_prefix}/*)
  if(installed)
    message(FATAL_ERROR "installing the consumer installed cudamem's files: ${installed}")
  endif()
  message(STATUS "embedded cudamem: no tests, examples, benchmarks or install rules")
endfunction()

# Asks CMake's file API, before a project is configured in `build_dir`, for its code model.
function(packaging_request_codemodel build_dir)
  file(MAKE_DIRECTORY ${build_dir}/.cmake/api/v1/query)
  file(TOUCH ${build_dir}/.cmake/api/v1/query/codemodel-v2)
endfunction()

# The names of all targets in the configured project in `build_dir` (all directories, so a
# subproject's targets are included), from the code model the file API wrote.
function(packaging_target_names build_dir out_var)
  file(GLOB codemodel ${build_dir}/.cmake/api/v1/reply/codemodel-v2-*.json)
  if(NOT codemodel)
    message(FATAL_ERROR "no code model in ${build_dir} (packaging_request_codemodel not called?)")
  endif()
  file(READ ${codemodel} json)
  string(JSON target_count LENGTH "${json}" configurations 0 targets)
  set(names "")
  math(EXPR last "${target_count} - 1")
  foreach(i RANGE ${last})
    string(JSON name GET "${json}" configurations 0 targets ${i} name)
    list(APPEND names ${name})
  endforeach()
  set(${out_var} ${names} PARENT_SCOPE)
endfunction()

# Runs one consumer program. Two outcomes are right: exit 0 with "<name>: OK" (a GPU), or exit
# 69 with cudamem's no-device message (no GPU). Both must print the version. Anything else
# fails the test.
function(packaging_run_consumer program name expected_version)
  execute_process(COMMAND ${program} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  message(STATUS "${name} exited ${rc}:\n${out}")
  string(FIND "${out}" "${name}: cudamem ${expected_version}\n" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${name} did not print the version ${expected_version}")
  endif()
  if(rc EQUAL 0)
    set(expected "${name}: OK")
  elseif(rc EQUAL 69)
    set(expected "${name}: no usable CUDA device")
  else()
    message(FATAL_ERROR "${name} exited ${rc}: neither 0 (GPU) nor 69 (no device)")
  endif()
  string(FIND "${out}" "${expected}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${name} exited ${rc} but did not print \"${expected}\"")
  endif()
endfunction()

# A header-only install (the README's, the vcpkg port's, one of a tree that did not build the C
# library) holds no compiled library: the C library and its package config come only when it
# was built (-DCUDAMEM_BUILD_C_API=ON, or the default AUTO with the tests, then cmake --build).
function(packaging_check_no_c_library prefix)
  file(GLOB_RECURSE compiled ${prefix}/*cudamem_c*)
  if(compiled)
    message(FATAL_ERROR "a header-only install holds the C library: ${compiled}")
  endif()
endfunction()

# An install of a tree that built the C library holds all of it: the library (its versioned
# file and the link a linker looks for), its header, and its own package, whose generated file
# names the library (the consumer's find_package(cudamem_c) then proves the names resolve).
function(packaging_check_c_library prefix)
  file(GLOB library_files ${prefix}/lib*/libcudamem_c.so.*)
  file(GLOB library_link ${prefix}/lib*/libcudamem_c.so)
  file(GLOB package_config ${prefix}/lib*/cmake/cudamem_c/cudamem_cConfig.cmake)
  if(NOT library_files OR NOT library_link OR NOT package_config
     OR NOT EXISTS ${prefix}/include/cudamem_c.h)
    file(GLOB_RECURSE installed ${prefix}/*cudamem_c*)
    message(FATAL_ERROR "the install lacks part of the C library (libcudamem_c.so.*, "
      "libcudamem_c.so, include/cudamem_c.h, lib/cmake/cudamem_c/cudamem_cConfig.cmake); "
      "it holds: ${installed}")
  endif()
  message(STATUS "the C library is installed: ${library_files}; ${package_config}")
endfunction()
