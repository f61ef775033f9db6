# Paying for a feature belongs to the file that uses it. Compiles paid_where_used/owners.cpp (a
# file that declares buffers over the default resource and over one it is given) and fails if it
# includes the report's formatting (memory_report.hpp, its text, NVML's loader) or if its object
# holds the whole report's code (before the report was compiled where it is formatted, the
# default resource's failure path brought NVML's holders into every such object). The control,
# report.cpp (memory_report.hpp), must hold them: the check sees them where they are used.
# (The copy stager is a template compiled only where a copy is staged, copy_stager.hpp says why;
# an unused non-template inline function leaves no symbol either, so objects cannot tell that
# apart, and bench/compile_time.py measures it instead.)
#   cmake -DCXX=g++ -DNM=nm -DINCLUDES="-I...;-I..." -DSOURCE_DIR=... -DBINARY_DIR=... -P this
cmake_minimum_required(VERSION 3.25)
set(whole_report "find_holders|memory_report::to_text")

function(compile name)
  execute_process(COMMAND ${CXX} -std=c++20 -O0 -g0 ${INCLUDES} -MD -MF ${BINARY_DIR}/${name}.d
                          -c ${SOURCE_DIR}/${name}.cpp -o ${BINARY_DIR}/${name}.o
                  RESULT_VARIABLE failed ERROR_VARIABLE errors)
  if(failed)
    message(FATAL_ERROR "${name}.cpp does not compile:\n${errors}")
  endif()
  execute_process(COMMAND ${NM} -C ${BINARY_DIR}/${name}.o OUTPUT_VARIABLE symbols
                  RESULT_VARIABLE failed)
  if(failed)
    message(FATAL_ERROR "${NM} could not read ${name}.o")
  endif()
  file(READ ${BINARY_DIR}/${name}.d includes)
  set(${name}_symbols "${symbols}" PARENT_SCOPE)
  set(${name}_includes "${includes}" PARENT_SCOPE)
endfunction()

compile(owners)
foreach(header IN ITEMS cudamem/memory_report.hpp cudamem/detail/nvml/nvml.hpp
                        cudamem/detail/report/text.hpp)
  string(FIND "${owners_includes}" "${header}" at)
  if(NOT at EQUAL -1)
    message(FATAL_ERROR "owners.cpp includes ${header}: a file that declares a buffer must not "
                        "pay for formatting out-of-memory reports")
  endif()
endforeach()
foreach(pattern IN ITEMS ${whole_report})
  if(owners_symbols MATCHES "(${pattern})[^\n]*")
    message(FATAL_ERROR "owners.cpp's object holds ${CMAKE_MATCH_0}: code it does not use")
  endif()
endforeach()

compile(report)
foreach(pattern IN ITEMS find_holders "memory_report::to_text")
  if(NOT report_symbols MATCHES "${pattern}")
    message(FATAL_ERROR "report.cpp's object holds no ${pattern}: the check above would not "
                        "see it either")
  endif()
endforeach()
message(STATUS "owners.cpp compiles none of the whole report; report.cpp does")
