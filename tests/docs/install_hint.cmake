# `./run docs` on a machine without Doxygen, run by a user who is not root: it must stop with
# exit code 2 and the exact command that installs Doxygen, before it writes anything.
# The machine is faked with a PATH that has what `run` needs before its check (dirname, nproc,
# python3 where there is one) and an `id` that says "uid 1000"; no doxygen.
#   cmake -D SOURCE_DIR=<repository> -D WORK_DIR=<scratch directory> -P install_hint.cmake
set(bin ${WORK_DIR}/bin)
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${bin})
foreach(tool dirname nproc)
  find_program(tool_path NAMES ${tool} REQUIRED NO_CACHE)
  file(CREATE_LINK ${tool_path} ${bin}/${tool} SYMBOLIC)
  unset(tool_path)
endforeach()
# (A machine without python3 is told to install it too: the input filter is a Python script.)
set(packages "doxygen")
find_program(python3_path NAMES python3 NO_CACHE)
if(python3_path)
  file(CREATE_LINK ${python3_path} ${bin}/python3 SYMBOLIC)
else()
  set(packages "doxygen python3")
endif()
file(WRITE ${bin}/id "#!/bin/sh\necho 1000\n")
file(CHMOD ${bin}/id PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ GROUP_EXECUTE
     WORLD_READ WORLD_EXECUTE)
find_program(bash NAMES bash REQUIRED NO_CACHE)

execute_process(
  COMMAND ${CMAKE_COMMAND} -E env PATH=${bin} BUILD_DIR=${WORK_DIR}/build
          ${bash} ${SOURCE_DIR}/run docs
  RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(command "sudo apt-get install -y ${packages}")
set(expected "run: install them with:  ${command}\n")
if(NOT status EQUAL 2 OR NOT err MATCHES "missing packages: ${packages}\n" OR
   NOT err MATCHES "${expected}$")
  message(FATAL_ERROR "expected exit code 2 and, last, \"${expected}\"; got exit code ${status}:\n"
                      "stdout: ${out}\nstderr: ${err}")
endif()
if(EXISTS ${WORK_DIR}/build)
  message(FATAL_ERROR "./run docs wrote ${WORK_DIR}/build before stopping for Doxygen")
endif()
message(STATUS "./run docs without Doxygen, not root: exit 2 and \"${command}\"")
