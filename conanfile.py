"""Conan 2 recipe for cudamem, a header-only C++20 library for CUDA memory.

    conan create . -s compiler.cppstd=20        # builds the package and runs test_package/

Consumers write `requires("cudamem/0.1.0")`, use CMakeDeps, and in CMake
`find_package(cudamem CONFIG REQUIRED)` + `target_link_libraries(app PRIVATE cudamem::cudamem)`.

System requirement: the CUDA Toolkit (12.x or 13.x: nvcc, the CUDA runtime) is not a Conan
package. It is found on the consumer's machine by CMake's FindCUDAToolkit (CUDAToolkit_ROOT, nvcc
on PATH, or /usr/local/cuda), through a CMake module this package ships (see package_info).
"""
import os
import re

from conan import ConanFile
from conan.errors import ConanInvalidConfiguration
from conan.tools.build import check_min_cppstd
from conan.tools.files import copy, load
from conan.tools.layout import basic_layout

required_conan_version = ">=2.0"


class CudamemConan(ConanFile):
    name = "cudamem"
    description = ("Header-only C++20 RAII wrappers and stream-ordered memory resources for CUDA, "
                   "with diagnostics that explain out-of-memory errors")
    license = "MIT"
    topics = ("cuda", "gpu", "memory", "memory-resource", "raii", "header-only")
    package_type = "header-library"
    settings = "os", "arch", "compiler", "build_type"
    exports_sources = "include/*", "LICENSE", "cmake/cudamem-conan-cuda.cmake"
    no_copy_source = True

    # Where package() puts the CMake module that adds the CUDA runtime and C++20 to the target.
    _cuda_module = os.path.join("share", "cudamem", "cudamem-conan-cuda.cmake")

    def set_version(self):
        # One place holds the version: include/cudamem/version.hpp (CMake reads it too).
        header = load(self, os.path.join(self.recipe_folder, "include", "cudamem", "version.hpp"))
        parts = [re.search(rf"#define CUDAMEM_VERSION_{part} (\d+)", header).group(1)
                 for part in ("MAJOR", "MINOR", "PATCH")]
        self.version = ".".join(parts)

    def layout(self):
        basic_layout(self, src_folder=".")

    def requirements(self):
        # GSL 4 is what cudamem is tested with; it uses only what every 4.x release has.
        self.requires("ms-gsl/[>=4.0.0 <5]")

    def package_id(self):
        self.info.clear()

    def validate(self):
        check_min_cppstd(self, 20)
        if self.settings.os not in ("Linux", "Windows"):
            raise ConanInvalidConfiguration(
                f"{self.ref}: the CUDA Toolkit exists for Linux and Windows only")

    def package(self):
        copy(self, "LICENSE", self.source_folder, os.path.join(self.package_folder, "licenses"))
        copy(self, "*.hpp", os.path.join(self.source_folder, "include"),
             os.path.join(self.package_folder, "include"))
        copy(self, "cudamem-conan-cuda.cmake", os.path.join(self.source_folder, "cmake"),
             os.path.join(self.package_folder, os.path.dirname(self._cuda_module)))

    def package_info(self):
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
        self.cpp_info.set_property("cmake_file_name", "cudamem")
        self.cpp_info.set_property("cmake_target_name", "cudamem::cudamem")
        # cpp_info can name only Conan packages; the module links the system's CUDA::cudart
        # and asks for C++20, as cudamem's own installed CMake config does.
        self.cpp_info.set_property("cmake_build_modules", [self._cuda_module])
