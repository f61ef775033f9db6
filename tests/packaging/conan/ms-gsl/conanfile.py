"""A stand-in for ConanCenter's ms-gsl recipe, for machines that cannot reach ConanCenter (CI):
it packages the Microsoft GSL headers already installed on this machine, under the same name,
CMake file name and target as the real recipe, so cudamem's conanfile.py resolves against it.

    CUDAMEM_GSL_INCLUDE_DIR=/usr/include conan create . --version 4.0.0

The version must be the installed GSL's; the packaging test passes the one CMake found.
"""
import os

from conan import ConanFile
from conan.errors import ConanException
from conan.tools.files import copy


class MsGslFromThisMachine(ConanFile):
    name = "ms-gsl"
    description = "Microsoft GSL headers copied from this machine (cudamem's packaging test)"
    license = "MIT"
    package_type = "header-library"

    def package_id(self):
        self.info.clear()

    def package(self):
        include_dir = os.environ.get("CUDAMEM_GSL_INCLUDE_DIR", "/usr/include")
        if not os.path.isfile(os.path.join(include_dir, "gsl", "gsl")):
            raise ConanException(f"no <gsl/gsl> under {include_dir}: set CUDAMEM_GSL_INCLUDE_DIR "
                                 "to the include directory of an installed Microsoft GSL")
        copy(self, "*", os.path.join(include_dir, "gsl"),
             os.path.join(self.package_folder, "include", "gsl"))

    def package_info(self):
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
        self.cpp_info.set_property("cmake_file_name", "Microsoft.GSL")
        self.cpp_info.set_property("cmake_target_name", "Microsoft.GSL::GSL")
