# Runs `planted_bugs MODE` under compute-sanitizer's TOOL and checks the report:
#   cmake -D SANITIZER=... -D TOOL=memcheck|initcheck -D CHILD=... -D MODE=... -D EXPECT=...
#         -P check_report.cmake
# EXPECT is a regex the report must contain (a planted bug: the tool must name it, and count
# at least one error), or CLEAN (a correct program: 0 errors, and with memcheck 0 leaks).
# Prints the report either way. "SKIPPED: ..." when there is no sanitizer or no device, or when
# the mode itself skips (it needs two GPUs).
cmake_minimum_required(VERSION 3.25)
if(SANITIZER STREQUAL "")
  message("SKIPPED: compute-sanitizer not found")
  return()
endif()

execute_process(COMMAND ${CHILD} correct RESULT_VARIABLE probe OUTPUT_VARIABLE probe_out
                ERROR_VARIABLE probe_out)
if(probe EQUAL 69)
  message("SKIPPED: no usable CUDA device (${probe_out})")
  return()
endif()

set(options --tool ${TOOL} --error-exitcode 99)
if(TOOL STREQUAL "memcheck")
  list(APPEND options --leak-check full)
endif()
execute_process(COMMAND ${SANITIZER} ${options} ${CHILD} ${MODE}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
message("compute-sanitizer ${options} planted_bugs ${MODE} exited ${rc}:\n${out}")
if(out MATCHES "SKIPPED: ([^\n]*)")
  message("SKIPPED: planted_bugs ${MODE}: ${CMAKE_MATCH_1}")  # e.g. a mode that needs 2 GPUs
  return()
endif()

# A planted bug may end the program (memcheck stops a faulting kernel, and the context is lost
# after it); a correct program must run to its end.
if(EXPECT STREQUAL "CLEAN" AND NOT out MATCHES "planted_bugs ${MODE}: done")
  message(FATAL_ERROR "planted_bugs ${MODE} did not run to its end")
endif()
string(REGEX MATCH "ERROR SUMMARY: ([0-9]+) error" summary "${out}")
if(summary STREQUAL "")
  message(FATAL_ERROR "no ERROR SUMMARY in the report")
endif()
set(errors ${CMAKE_MATCH_1})
if(EXPECT STREQUAL "CLEAN")
  if(NOT errors EQUAL 0 OR NOT rc EQUAL 0)
    message(FATAL_ERROR "a correct program: expected 0 errors and exit 0, got ${errors} and ${rc}")
  endif()
  if(out MATCHES "Leaked [0-9]+ bytes")
    message(FATAL_ERROR "a correct program leaked")
  endif()
else()
  if(errors EQUAL 0)
    message(FATAL_ERROR "the planted bug was not reported (0 errors)")
  endif()
  if(NOT out MATCHES "${EXPECT}")
    message(FATAL_ERROR "the report does not contain \"${EXPECT}\"")
  endif()
endif()
message(STATUS "planted_bugs ${MODE} under ${TOOL}: as expected (${errors} errors)")
