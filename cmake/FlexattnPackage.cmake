# CPack: `cpack -G DEB` in a build folder makes flexattn_<version>_<arch>.deb of what
# `cmake --install` installs (the library, the public headers, the CMake and pkg-config files and
# the flexattn tool) under /usr. Made from a shared build (the `shared` preset), the package
# depends on the shared libraries it links (libfmt, libgomp; found by dpkg-shlibdeps); from a
# static one, also on libfmt-dev, which find_package(flexattn) then needs. CUDA, NVRTC and cuDNN
# are opened at run time, so they are no dependency.
set(CPACK_PACKAGE_NAME flexattn)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
  "Scaled-dot-product attention with user-defined score modifiers and masks")
set(CPACK_PACKAGE_CONTACT "flexattn developers")
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION libdevel)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
if(NOT BUILD_SHARED_LIBS)
  set(CPACK_DEBIAN_PACKAGE_DEPENDS libfmt-dev)
endif()
include(CPack)
