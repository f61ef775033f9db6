# Settings for every target cudamem builds for itself (tests, examples, benchmarks).
# Consumers never see these: they apply to our own targets only.

# Debian's CMake 3.25 does not know that nvcc 13 speaks C++20 (its CMAKE_CUDA_COMPILE_FEATURES
# stop at cuda_std_17, and CUDA_STANDARD 20 is refused), so there the flag is passed by hand;
# newer CMakes get the ordinary property.
# (CXX_STANDARD is not set either: CMake would carry it over to CUDA and fail the same way;
# C++20 for host code comes from cudamem's own `cxx_std_20` compile feature.)
function(cudamem_project_target target)
  set_target_properties(${target} PROPERTIES CXX_EXTENSIONS OFF CUDA_EXTENSIONS OFF)
  if("cuda_std_20" IN_LIST CMAKE_CUDA_COMPILE_FEATURES)
    set_target_properties(${target} PROPERTIES CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON)
  else()
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>)
  endif()
  target_link_libraries(${target} PRIVATE cudamem::cudamem)
  # Warnings are on in our own builds, and errors with CUDAMEM_WARNINGS_AS_ERRORS (CI and
  # developers). Host code gets -Wpedantic; code nvcc compiles gets the same through -Xcompiler
  # except -Wpedantic, which fires on nvcc's generated stubs (line directives, empty
  # translation-unit pieces) that we do not control.
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic>
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
  if(CUDAMEM_WARNINGS_AS_ERRORS)
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX>:-Werror>
      $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings -Xcompiler=-Werror>)
  endif()
  if(CUDAMEM_SANITIZE)
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all>)
    target_link_options(${target} PRIVATE -fsanitize=address,undefined)
  endif()
endfunction()
