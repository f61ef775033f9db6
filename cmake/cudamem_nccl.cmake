# NCCL for cudamem's own NCCL targets (tests/nccl, examples/nccl_allreduce, bench/nccl): found
# where it is, never required. cudamem::cudamem does not link NCCL; a user who includes
# <cudamem/nccl.hpp> links the NCCL their communicators come from, as they already do.
#
# Where it looks for the library, first hit wins (nccl.h is then taken from beside it only):
#   1. CUDAMEM_NCCL_ROOT (cache variable): an NCCL with include/nccl.h and lib/libnccl.so*;
#      set, it must be there (a configure error otherwise, not a silent fallback)
#   2. NCCL_ROOT / NCCL_HOME in the environment, and the CUDA Toolkit's directories
#   3. the usual system places (/usr/lib/x86_64-linux-gnu, /usr/local/lib, ...)
#   4. the nvidia-nccl-cu12/-cu13 Python package of `python3` (pip install nvidia-nccl-cu13),
#      which ships only libnccl.so.2, no libnccl.so
# Sets CUDAMEM_NCCL_FOUND, CUDAMEM_NCCL_VERSION, CUDAMEM_NCCL_NOT_FOUND (why not, when not) and,
# when found, the INTERFACE target cudamem_nccl (nccl.h's directory, the library). NCCL 2.19
# or newer is needed: ncclCommRegister and ncclMemAlloc.

set(CUDAMEM_NCCL_ROOT "" CACHE PATH
    "An NCCL installation for cudamem's NCCL tests, example and benchmark (empty: search)")

# A new CUDAMEM_NCCL_ROOT is searched anew (the results of a search are cached).
if(NOT "${CUDAMEM_NCCL_ROOT}" STREQUAL "${_CUDAMEM_NCCL_ROOT_SEARCHED}")
  unset(CUDAMEM_NCCL_LIBRARY CACHE)
  unset(CUDAMEM_NCCL_INCLUDE_DIR CACHE)
  set(_CUDAMEM_NCCL_ROOT_SEARCHED "${CUDAMEM_NCCL_ROOT}" CACHE INTERNAL "")
endif()

set(CUDAMEM_NCCL_FOUND OFF)
set(CUDAMEM_NCCL_NOT_FOUND "")

# The Python package's directory, asked of python3 itself (its site-packages may be anywhere).
set(_cudamem_nccl_python_dir "")
if(NOT CUDAMEM_NCCL_ROOT)
  find_program(CUDAMEM_PYTHON3 python3)
  if(CUDAMEM_PYTHON3)
    execute_process(
      COMMAND ${CUDAMEM_PYTHON3} -c
              "import nvidia.nccl as n; print(next(iter(n.__path__)))"
      OUTPUT_VARIABLE _cudamem_nccl_python_dir OUTPUT_STRIP_TRAILING_WHITESPACE
      ERROR_QUIET RESULT_VARIABLE _cudamem_nccl_python_rc)
    if(NOT _cudamem_nccl_python_rc EQUAL 0)
      set(_cudamem_nccl_python_dir "")
    endif()
  endif()
endif()

# The library first, then nccl.h beside it (its prefix's include/): a header of one NCCL and
# the library of another (a toolkit's nccl.h on the include path, pip's libnccl.so.2) would
# compile and then misbehave.
if(CUDAMEM_NCCL_ROOT)
  find_library(CUDAMEM_NCCL_LIBRARY NAMES nccl libnccl.so.2
               PATHS ${CUDAMEM_NCCL_ROOT}/lib ${CUDAMEM_NCCL_ROOT}/lib64 NO_DEFAULT_PATH)
else()
  set(_cudamem_nccl_library_hints)
  foreach(_dir IN ITEMS $ENV{NCCL_ROOT} $ENV{NCCL_HOME} ${CUDAToolkit_LIBRARY_ROOT})
    list(APPEND _cudamem_nccl_library_hints ${_dir}/lib ${_dir}/lib64)
  endforeach()
  list(APPEND _cudamem_nccl_library_hints ${CUDAToolkit_LIBRARY_DIR})
  # The given places, the toolkit and the system first; the Python package last (PATHS are
  # searched after the default places).
  find_library(CUDAMEM_NCCL_LIBRARY NAMES nccl libnccl.so.2
               HINTS ${_cudamem_nccl_library_hints} PATHS ${_cudamem_nccl_python_dir}/lib)
endif()
if(CUDAMEM_NCCL_LIBRARY)
  # <prefix>/lib[64]/libnccl.so -> <prefix>/include; Debian's /usr/lib/<triplet>/ -> /usr/include
  get_filename_component(_cudamem_nccl_libdir ${CUDAMEM_NCCL_LIBRARY} DIRECTORY)
  get_filename_component(_cudamem_nccl_prefix ${_cudamem_nccl_libdir} DIRECTORY)
  get_filename_component(_cudamem_nccl_prefix2 ${_cudamem_nccl_prefix} DIRECTORY)
  find_path(CUDAMEM_NCCL_INCLUDE_DIR nccl.h
            PATHS ${_cudamem_nccl_prefix}/include ${_cudamem_nccl_prefix2}/include NO_DEFAULT_PATH)
endif()
if(CUDAMEM_NCCL_ROOT AND (NOT CUDAMEM_NCCL_INCLUDE_DIR OR NOT CUDAMEM_NCCL_LIBRARY))
  message(FATAL_ERROR "CUDAMEM_NCCL_ROOT=${CUDAMEM_NCCL_ROOT} has no lib/libnccl.so* with an "
                      "include/nccl.h beside it; clear CUDAMEM_NCCL_ROOT to search elsewhere")
endif()

if(NOT CUDAMEM_NCCL_INCLUDE_DIR OR NOT CUDAMEM_NCCL_LIBRARY)
  if(CUDAMEM_NCCL_LIBRARY)
    string(CONCAT CUDAMEM_NCCL_NOT_FOUND "NCCL not usable (${CUDAMEM_NCCL_LIBRARY} has no "
           "include/nccl.h beside it; set CUDAMEM_NCCL_ROOT to an NCCL with both)")
  else()
    string(CONCAT CUDAMEM_NCCL_NOT_FOUND "NCCL not found (no libnccl.so* in the system or "
           "toolkit directories, nor in python3's nvidia-nccl package: pip install "
           "nvidia-nccl-cu13, or set CUDAMEM_NCCL_ROOT)")
  endif()
else()
  file(STRINGS ${CUDAMEM_NCCL_INCLUDE_DIR}/nccl.h _cudamem_nccl_version_lines
       REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) +[0-9]+")
  set(_nccl_MAJOR 0)
  set(_nccl_MINOR 0)
  set(_nccl_PATCH 0)
  foreach(_line IN LISTS _cudamem_nccl_version_lines)
    string(REGEX MATCH "NCCL_([A-Z]+) +([0-9]+)" _ "${_line}")
    set(_nccl_${CMAKE_MATCH_1} ${CMAKE_MATCH_2})
  endforeach()
  set(CUDAMEM_NCCL_VERSION ${_nccl_MAJOR}.${_nccl_MINOR}.${_nccl_PATCH})
  if(CUDAMEM_NCCL_VERSION VERSION_LESS 2.19)
    string(CONCAT CUDAMEM_NCCL_NOT_FOUND "NCCL ${CUDAMEM_NCCL_VERSION} at "
           "${CUDAMEM_NCCL_INCLUDE_DIR} is older than 2.19 (no ncclCommRegister, ncclMemAlloc)")
  else()
    set(CUDAMEM_NCCL_FOUND ON)
    add_library(cudamem_nccl INTERFACE)
    # -I, not -isystem: CUDA 13 toolkits ship an nccl.h of their own, and nvcc searches its
    # toolkit's include directory before every -isystem one, so the header would not match
    # the library found here. (nccl.h compiles clean under our warnings.)
    target_include_directories(cudamem_nccl INTERFACE ${CUDAMEM_NCCL_INCLUDE_DIR})
    target_link_libraries(cudamem_nccl INTERFACE ${CUDAMEM_NCCL_LIBRARY})
    message(STATUS "cudamem: NCCL ${CUDAMEM_NCCL_VERSION}: ${CUDAMEM_NCCL_LIBRARY}")
  endif()
endif()
if(NOT CUDAMEM_NCCL_FOUND)
  message(STATUS "cudamem: ${CUDAMEM_NCCL_NOT_FOUND}; the NCCL tests, example and benchmark "
                 "are not built (ctest reports them skipped)")
endif()
