# Part of the Conan package (see conanfile.py): CMakeDeps makes cudamem::cudamem from the
# recipe, which can only name Conan packages, then includes this module. It adds what the
# recipe cannot say, so the target means the same as the one cudamemConfig.cmake exports:
# the CUDA runtime of the system's CUDA Toolkit, dlopen's library (for NVML), and C++20.
find_package(CUDAToolkit REQUIRED)
if(NOT TARGET cudamem::cudamem)
  message(FATAL_ERROR "cudamem-conan-cuda.cmake: expected CMakeDeps to define cudamem::cudamem")
endif()
target_link_libraries(cudamem::cudamem INTERFACE CUDA::cudart ${CMAKE_DL_LIBS})  # dl: NVML
target_compile_features(cudamem::cudamem INTERFACE cxx_std_20)
# CUDA 13 keeps CCCL (thrust, CUB, libcu++) in <toolkit>/include/cccl, which nvcc searches by
# itself and a C++ compiler does not; cudamem.hpp includes thrust and CCCL interop headers.
foreach(_cudamem_dir IN LISTS CUDAToolkit_INCLUDE_DIRS)
  if(EXISTS "${_cudamem_dir}/cccl/thrust")
    target_include_directories(cudamem::cudamem SYSTEM INTERFACE
      "$<$<COMPILE_LANGUAGE:CXX>:${_cudamem_dir}/cccl>")
  endif()
endforeach()
