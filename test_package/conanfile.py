"""Conan's check of the cudamem package: a .cpp (host compiler) and a .cu (nvcc) program built
against it and run. On a machine with a GPU both must print "OK"; on one without, the no-device
message and exit code 69. Anything else fails `conan create`."""
import io
import os

from conan import ConanFile
from conan.errors import ConanException
from conan.tools.build import can_run
from conan.tools.cmake import CMake, CMakeDeps, CMakeToolchain, cmake_layout

EXIT_NO_DEVICE = 69


class CudamemTestConan(ConanFile):
    settings = "os", "arch", "compiler", "build_type"

    def requirements(self):
        self.requires(self.tested_reference_str)

    def layout(self):
        cmake_layout(self)

    def generate(self):
        toolchain = CMakeToolchain(self)
        # compiler.cppstd=20 would become CMAKE_CXX_STANDARD 20 + CMAKE_CXX_STANDARD_REQUIRED in
        # the toolchain. CMake uses CXX_STANDARD for .cu files that have no CUDA_STANDARD, and a
        # CMake that does not know nvcc 13's C++20 (Debian's 3.25) then stops while enabling CUDA
        # ("requires the language dialect CUDA20"). cudamem::cudamem asks for C++20 itself, and
        # CMakeLists.txt gives the .cu file its C++20.
        toolchain.blocks.remove("cppstd")
        toolchain.user_presets_path = False  # write nothing into the source tree
        toolchain.generate()
        CMakeDeps(self).generate()

    def build(self):
        cmake = CMake(self)
        cmake.configure()
        cmake.build()

    def test(self):
        if not can_run(self):
            return
        for program in ("test_package_cpp", "test_package_cu"):
            output = io.StringIO()
            path = os.path.join(self.cpp.build.bindir, program)
            code = self.run(path, stdout=output, ignore_errors=True, env="conanrun")
            text = output.getvalue()
            self.output.info(text.rstrip())
            if code == 0 and f"{program}: OK" in text:
                continue
            if code == EXIT_NO_DEVICE and "no usable CUDA device" in text:
                self.output.warning(f"{program}: no CUDA device here; built and ran up to that")
                continue
            raise ConanException(f"{program} exited {code}, expected 0 (GPU) or "
                                 f"{EXIT_NO_DEVICE} (no device):\n{text}")
