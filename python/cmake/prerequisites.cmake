# What building libcudamem_c for the Python package needs from the machine, checked before
# anything is compiled: the CUDA Toolkit (12.5 or newer) and Microsoft GSL. Each one that is
# missing stops the build with one sentence saying what to install, instead of CMake's generic
# "Could not find a package configuration file" and its search paths.
#
# Included by python/CMakeLists.txt (the build scikit-build-core runs) and by check/, the
# project the build backend (_build/cudamem_backend.py) configures first, with CMake's output
# kept to itself: the sentence is also written to ${CMAKE_BINARY_DIR}/cudamem-missing.txt, and
# the backend prints that file alone. Needs no language enabled.

# Stops with the sentence its arguments make together, and leaves it where the build backend
# finds it.
function(cudamem_python_missing)
  string(CONCAT sentence ${ARGN})
  file(WRITE ${CMAKE_BINARY_DIR}/cudamem-missing.txt "${sentence}\n")
  message(FATAL_ERROR "${sentence}")
endfunction()

file(REMOVE ${CMAKE_BINARY_DIR}/cudamem-missing.txt)
find_package(CUDAToolkit QUIET)
if(NOT CUDAToolkit_FOUND)
  cudamem_python_missing(
    "cudamem: the CUDA Toolkit (12.5 or newer, with nvcc) was not found, and building "
    "cudamem's library needs it: install it from NVIDIA and put its bin/ on PATH, or set "
    "CUDAToolkit_ROOT to where it is (CUDAToolkit_ROOT=/usr/local/cuda-13.0 pip install "
    "./python).")
elseif(CUDAToolkit_VERSION VERSION_LESS 12.5)
  cudamem_python_missing(
    "cudamem: the CUDA Toolkit found (${CUDAToolkit_VERSION}, ${CUDAToolkit_BIN_DIR}) is "
    "older than 12.5, which cudamem needs (cudaGetDriverEntryPointByVersion): install a newer "
    "one and put its bin/ on PATH, or set CUDAToolkit_ROOT to it.")
endif()
find_package(Microsoft.GSL CONFIG QUIET)
if(NOT Microsoft.GSL_FOUND)
  cudamem_python_missing(
    "cudamem: Microsoft GSL was not found, and building cudamem's library needs its headers: "
    "install it (Debian/Ubuntu: sudo apt-get install libmsgsl-dev, or the ms-gsl package of "
    "Conan or vcpkg), or point CMAKE_PREFIX_PATH at a copy (CMAKE_PREFIX_PATH=/path/to/gsl "
    "pip install ./python, where /path/to/gsl holds share/cmake/Microsoft.GSL).")
endif()
