// cudamem/detail/compiled.hpp — where the code of cudamem's heaviest classes is compiled: in
// every translation unit that includes their headers (header-only, the default), or once, in
// the `cudamem::compiled` library (compiled mode).
//
//   # CMake: link the library instead of the header-only target; nothing else changes
//   target_link_libraries(app PRIVATE cudamem::compiled)   # defines CUDAMEM_COMPILED for app
//
// Why. A header-only library compiles what a class does wherever the class is used: a
// translation unit that makes a vm_pool_resource parses, analyses and compiles all of it, its
// free-range trees, growth thread and driver layer with it (bench/compile_time.py: ~12x the
// time of a file with cuda_runtime.h alone, under nvcc). Most of that is the same work in every
// file. In compiled mode these classes' headers declare what a user calls and hold the object's
// state as opaque, correctly sized storage; their code (a `*_core.hpp` beside their parts) is
// compiled once into the library, and a file that uses them costs about what one that uses a
// device_buffer does.
//
// Contract
// - Header-only (CUDAMEM_COMPILED not defined): every header is complete; nothing to link but
//   CUDA. This is the default and what the package managers' packages are.
// - Compiled (CUDAMEM_COMPILED defined, as linking cudamem::compiled does): the classes below
//   are declared only, and their definitions come from the library. Every translation unit of
//   a program must agree (mixing the two modes is an ODR violation: the library's definitions
//   and a header-only unit's inline ones would both exist).
// - The classes: pool_resource, vm_pool_resource, vm_resource. Each holds its state in place
//   (no extra allocation or indirection per call); the size is checked where the state is
//   defined.
// - The out-of-memory report (detail/report/oom_throw.hpp): throw_out_of_memory,
//   rethrow_out_of_memory, format_bytes, and the advice device_resource and pinned_resource
//   add to a report. device_resource.hpp and pinned_resource.hpp then no longer bring in
//   out_of_memory.hpp: a file that catches `out_of_memory` or reads a report includes
//   <cudamem/out_of_memory.hpp> (or memory_report.hpp) itself.
// - Behaviour, errors and performance are the same in both modes: the code is the same, only
//   where it is compiled differs.
#pragma once

/// Whether the definitions of the compiled classes are in the headers (1) or in the library (0).
/// CUDAMEM_COMPILED_SOURCE is defined by the library's own source file, which includes them.
#if defined(CUDAMEM_COMPILED) && !defined(CUDAMEM_COMPILED_SOURCE)
#define CUDAMEM_DEFINITIONS_IN_HEADERS 0
#else
#define CUDAMEM_DEFINITIONS_IN_HEADERS 1
#endif

/// Marks an out-of-class definition of a compiled class's member: inline in header-only mode
/// (defined in every unit that includes it), a plain definition in the library.
#if defined(CUDAMEM_COMPILED)
#define CUDAMEM_DEFINITION
#else
#define CUDAMEM_DEFINITION inline
#endif
