# Install rules for C and C++ users (issue 15, item 7), all in the component "dev":
#   include/tqkv/*.h                        the public headers (not cuda*.h: the library holds no kernels)
#   lib/libtqkv.a, lib/libtqkv.so           the C API and the C++ library (src/capi/CMakeLists.txt)
#   lib/cmake/tqkv/                         find_package(tqkv): tqkv::tqkv (shared), tqkv::tqkv_static
#   lib/pkgconfig/tqkv.pc                   pkg-config --cflags --libs tqkv (--static for libtqkv.a)
# tests/install/run.sh installs into a temporary prefix and builds a C and a CMake consumer.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(_tqkv_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/tqkv)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/tqkv DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        COMPONENT dev FILES_MATCHING PATTERN "*.h" PATTERN "cuda*.h" EXCLUDE)
install(TARGETS tqkv_static tqkv_shared EXPORT tqkvTargets COMPONENT dev
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT tqkvTargets NAMESPACE tqkv:: DESTINATION ${_tqkv_cmake_dir} COMPONENT dev)

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/tqkvConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/cmake/tqkvConfig.cmake INSTALL_DESTINATION ${_tqkv_cmake_dir})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/cmake/tqkvConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/cmake/tqkvConfig.cmake ${PROJECT_BINARY_DIR}/cmake/tqkvConfigVersion.cmake
        DESTINATION ${_tqkv_cmake_dir} COMPONENT dev)

# pkg-config: relocatable (paths from the .pc file's own place), so `cmake --install --prefix`
# may pick the prefix after configuring.
file(RELATIVE_PATH TQKV_PC_TO_PREFIX /prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig /prefix)
configure_file(${PROJECT_SOURCE_DIR}/cmake/tqkv.pc.in ${PROJECT_BINARY_DIR}/cmake/tqkv.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/cmake/tqkv.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig COMPONENT dev)
