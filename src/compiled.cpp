// src/compiled.cpp — the cudamem::compiled library: the code of the classes that
// detail/compiled.hpp lists, compiled once here instead of in every file that uses them.
//
//   target_link_libraries(app PRIVATE cudamem::compiled)  # the headers then declare, this defines
//
// Built with CUDAMEM_COMPILED (the library's public definition) and CUDAMEM_COMPILED_SOURCE
// (here only): each header below then includes its `*_core.hpp`, whose member definitions
// are plain (not inline) definitions, emitted in this file alone.
#define CUDAMEM_COMPILED_SOURCE

#include <cudamem/device_resource.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/pinned_resource.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/vm_pool_resource.hpp>
#include <cudamem/vm_resource.hpp>
