# vcpkg port of cudamem: a header-only library, so one release configuration is all there is.
# The CUDA Toolkit is not built by vcpkg: the `cuda` dependency is vcpkg's port that finds the
# toolkit installed on the system and fails early with instructions when there is none.
set(VCPKG_BUILD_TYPE release)

# Upstream: vcpkg_from_github with the release tag and its SHA512. For a local overlay port
# (`vcpkg install cudamem --overlay-ports=<cudamem>/ports`), set CUDAMEM_SOURCE_DIR in the
# environment to a cudamem checkout and the release download is skipped.
if(DEFINED ENV{CUDAMEM_SOURCE_DIR})
  set(SOURCE_PATH "$ENV{CUDAMEM_SOURCE_DIR}")
else()
  vcpkg_from_github(
    OUT_SOURCE_PATH SOURCE_PATH
    REPO cudamem/cudamem
    REF "v${VERSION}"
    SHA512 0  # replaced by the release archive's SHA512 when the port is submitted
    HEAD_REF main
  )
endif()

vcpkg_cmake_configure(
  SOURCE_PATH "${SOURCE_PATH}"
  OPTIONS
    -DCUDAMEM_BUILD_TESTS=OFF
    -DCUDAMEM_BUILD_EXAMPLES=OFF
    -DCUDAMEM_BUILD_BENCHMARKS=OFF
    -DCUDAMEM_INSTALL=ON
)
vcpkg_cmake_install()
# cudamem installs its package config to share/cmake/cudamem; vcpkg wants share/cudamem.
vcpkg_cmake_config_fixup(CONFIG_PATH share/cmake/cudamem)

# The licence goes where vcpkg wants it; the copy cudamem installs for other users is dropped.
file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/share/doc")
vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
