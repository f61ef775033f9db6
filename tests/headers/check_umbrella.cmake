# Fails when include/cudamem/cudamem.hpp misses a public header, or includes one of those it
# leaves out on purpose: the CCCL interop headers (thrust's and libcu++'s headers cost a
# translation unit more than all of cudamem: bench/compile_time.py) and the NCCL ones (they need
# NCCL, which cudamem does not).
cmake_minimum_required(VERSION 3.25)  # IN_LIST
set(left_out cudamem/thrust_allocator.hpp cudamem/exec_policy.hpp cudamem/cccl_span.hpp
             cudamem/cccl_resource.hpp cudamem/nccl.hpp cudamem/nccl_pool.hpp)
file(READ ${UMBRELLA} umbrella_text)
file(GLOB headers RELATIVE ${INCLUDE_DIR} ${INCLUDE_DIR}/cudamem/*.hpp)
set(missing)
set(checked 0)
foreach(header IN LISTS headers)
  if(header STREQUAL "cudamem/cudamem.hpp")
    continue()
  endif()
  string(FIND "${umbrella_text}" "#include <${header}>" at)
  if(header IN_LIST left_out)
    if(NOT at EQUAL -1)
      list(APPEND included_by_mistake ${header})
    endif()
    continue()
  endif()
  math(EXPR checked "${checked} + 1")
  if(at EQUAL -1)
    list(APPEND missing ${header})
  endif()
endforeach()
if(missing)
  message(FATAL_ERROR "cudamem.hpp does not include: ${missing}")
endif()
if(included_by_mistake)
  message(FATAL_ERROR "cudamem.hpp includes ${included_by_mistake}, which it leaves out on "
                      "purpose (see this file's first lines)")
endif()
message(STATUS "cudamem.hpp includes all ${checked} public headers but the ones it leaves out: ${left_out}")
