// cudamem/version.hpp — the library's version. CMake reads the project version from the
// three macros below, so they are the one place it is written.
//
//   #if CUDAMEM_VERSION >= CUDAMEM_MAKE_VERSION(0, 2, 0)
//   ...
//   #endif
//   std::puts(CUDAMEM_VERSION_STRING);   // "0.1.0"
#pragma once

/// The major version number.
#define CUDAMEM_VERSION_MAJOR 0
/// The minor version number.
#define CUDAMEM_VERSION_MINOR 1
/// The patch version number.
#define CUDAMEM_VERSION_PATCH 0

/// A version as one number, comparable with CUDAMEM_VERSION: 0.2.0 is 200.
#define CUDAMEM_MAKE_VERSION(major, minor, patch) ((major) * 10000 + (minor) * 100 + (patch))
/// This version as one number (CUDAMEM_MAKE_VERSION of the three above).
#define CUDAMEM_VERSION \
  CUDAMEM_MAKE_VERSION(CUDAMEM_VERSION_MAJOR, CUDAMEM_VERSION_MINOR, CUDAMEM_VERSION_PATCH)

#define CUDAMEM_DETAIL_STRINGIZE(x) #x
#define CUDAMEM_DETAIL_EXPAND_STRINGIZE(x) CUDAMEM_DETAIL_STRINGIZE(x)
/// This version as a string literal, "major.minor.patch".
#define CUDAMEM_VERSION_STRING                                  \
  CUDAMEM_DETAIL_EXPAND_STRINGIZE(CUDAMEM_VERSION_MAJOR)        \
  "." CUDAMEM_DETAIL_EXPAND_STRINGIZE(CUDAMEM_VERSION_MINOR) "." \
      CUDAMEM_DETAIL_EXPAND_STRINGIZE(CUDAMEM_VERSION_PATCH)
