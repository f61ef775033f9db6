# The README's install section, run as it is written: its commands are read from README.md
# itself (the ```sh block under "### After `cmake --install`"), so the documentation and this
# test cannot drift apart. They run in a fresh directory where `cudamem` is cudamem's source
# tree and `app` is the README's own complete consumer (its ```cmake block after "A complete
# consumer"), with tests/packaging/readme_app's main.cpp and kernels.cu; $HOME is a directory of
# the test's own. Then the installed prefix is checked (headers and package config, no compiled
# library, no path of this machine), an unwritable prefix must fail with CMake's own error, and
# (STEP=run, under the GPU lock) the app runs.
#
#   cmake -D STEP=build -D SOURCE_DIR=... -D WORK_DIR=... -D GENERATOR=... -D CUDA_COMPILER=...
#         -D CUDA_ARCHITECTURES=... -D PREFIX_PATH=... -P readme.cmake
#   cmake -D STEP=run -D WORK_DIR=... -D EXPECTED_VERSION=... -P readme.cmake
#
# The environment stands for what a user's machine has on its own: CMAKE_PREFIX_PATH (where GSL
# is, when not in a system directory), CUDACXX (nvcc), CUDAARCHS and CMAKE_GENERATOR.
cmake_minimum_required(VERSION 3.25)
include(${CMAKE_CURRENT_LIST_DIR}/packaging_checks.cmake)

if(STEP STREQUAL "run")
  packaging_run_consumer(${WORK_DIR}/app-build/app app ${EXPECTED_VERSION})
  message(STATUS "packaging readme: the app ran as expected")
  return()
elseif(NOT STEP STREQUAL "build")
  message(FATAL_ERROR "readme.cmake: STEP must be build or run, not '${STEP}'")
endif()
foreach(var SOURCE_DIR WORK_DIR GENERATOR CUDA_COMPILER)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "readme.cmake: ${var} is not set")
  endif()
endforeach()

# The text of the first ```<fence> block after `marker` in README.md.
function(readme_block marker fence out_var)
  file(READ ${SOURCE_DIR}/README.md readme)
  string(FIND "${readme}" "${marker}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "README.md has no \"${marker}\": the install section moved or changed")
  endif()
  string(SUBSTRING "${readme}" ${at} -1 rest)
  string(FIND "${rest}" "\n```${fence}\n" open)
  if(open EQUAL -1)
    message(FATAL_ERROR "README.md has no ```${fence} block after \"${marker}\"")
  endif()
  string(LENGTH "\n```${fence}\n" skip)
  math(EXPR open "${open} + ${skip}")
  string(SUBSTRING "${rest}" ${open} -1 rest)
  string(FIND "${rest}" "\n```\n" close)
  if(close EQUAL -1)
    message(FATAL_ERROR "README.md: the ```${fence} block after \"${marker}\" does not end")
  endif()
  math(EXPR close "${close} + 1")  # keep the last line's newline
  string(SUBSTRING "${rest}" 0 ${close} block)
  set(${out_var} "${block}" PARENT_SCOPE)
endfunction()

readme_block("### After `cmake --install`" "sh" commands)
readme_block("A complete consumer, used by all the paths below:" "cmake" consumer)
foreach(expected "cmake -S cudamem -B cudamem-build" "cmake --install cudamem-build"
                 "cmake -S app -B app-build" "cmake --build app-build")
  string(FIND "${commands}" "${expected}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "the README's install commands no longer say \"${expected}\" "
                        "(readme.cmake lays out cudamem/ and app/ for them):\n${commands}")
  endif()
endforeach()
string(FIND "${consumer}" "find_package(cudamem CONFIG REQUIRED)" at)
if(at EQUAL -1)
  message(FATAL_ERROR "the README's consumer does not find_package(cudamem):\n${consumer}")
endif()

file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR}/home ${WORK_DIR}/app)
file(CREATE_LINK ${SOURCE_DIR} ${WORK_DIR}/cudamem SYMBOLIC)
file(WRITE ${WORK_DIR}/app/CMakeLists.txt "${consumer}")
file(COPY ${CMAKE_CURRENT_LIST_DIR}/readme_app/main.cpp ${CMAKE_CURRENT_LIST_DIR}/readme_app/kernels.cu
     DESTINATION ${WORK_DIR}/app)
file(WRITE ${WORK_DIR}/readme-install.sh "${commands}")

set(ENV{HOME} ${WORK_DIR}/home)
string(REPLACE ";" ":" prefix_path "${PREFIX_PATH}")
set(ENV{CMAKE_PREFIX_PATH} "${prefix_path}")
set(ENV{CUDACXX} ${CUDA_COMPILER})
set(ENV{CMAKE_GENERATOR} ${GENERATOR})
if(CUDA_ARCHITECTURES)
  set(ENV{CUDAARCHS} "${CUDA_ARCHITECTURES}")
endif()
find_program(bash_program bash REQUIRED)
message(STATUS "the README's install commands, as written:\n${commands}")
packaging_run(${bash_program} -e -x readme-install.sh WORKING_DIRECTORY ${WORK_DIR} SHOW_OUTPUT)

# What the install put under the prefix: the headers and the package config, nothing compiled
# (the C library only when asked for), and no path of this machine.
set(prefix ${WORK_DIR}/home/.local)
packaging_check_installed_tree(${prefix} share/cmake/cudamem
  "${SOURCE_DIR};${WORK_DIR}/cudamem;${WORK_DIR}/cudamem-build")
packaging_check_no_c_library(${prefix})
if(NOT EXISTS ${WORK_DIR}/app-build/app)
  message(FATAL_ERROR "the README's commands did not build app-build/app")
endif()

# Bad input: a prefix that cannot be written. CMake's own error, and a failed command.
set(unwritable /proc/cudamem-readme-prefix)
execute_process(COMMAND ${CMAKE_COMMAND} --install cudamem-build --prefix ${unwritable}
                WORKING_DIRECTORY ${WORK_DIR} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE out)
if(rc EQUAL 0 OR NOT out MATCHES "cannot (make|create) directory")
  message(FATAL_ERROR "cmake --install to ${unwritable} exited ${rc} without CMake's "
                      "error \"cannot make directory\":\n${out}")
endif()
message(STATUS "an unwritable prefix: CMake said\n${out}")
message(STATUS "packaging readme: installed and built as the README says (STEP=run runs the app)")
