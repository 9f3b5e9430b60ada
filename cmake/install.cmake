# `cmake --install <build> --prefix <prefix>`: the C++ package, for engines that
# write find_package(epx) and link epx::epx (docs/api.md, "C++ (CMake)").
#
#   lib/libepx.a, lib/libepx_reference.a    the library and the CPU reference
#                                           model it links (epx::epx, epx::ref)
#   include/epx/*.hpp                       the public headers
#   lib/libepx_nvshmem.so                   the NVSHMEM module, where built
#   lib/libnccl-net-epxloop.so              the loopback GIN plugin
#   lib/cmake/epx/                          epxConfig.cmake, its version file
#                                           and the exported targets
#
# Included from the top-level CMakeLists.txt after every target exists.
include(CMakePackageConfigHelpers)

set(EPX_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/epx" CACHE STRING
    "Where epxConfig.cmake goes, relative to the install prefix")

# epx::epx, with what linking it statically needs: epx::ref (a private
# dependency of a static library still lands on the consumer's link line) and
# epx::nccl (the NCCL that epxConfig.cmake points at).
set_target_properties(epx_reference PROPERTIES EXPORT_NAME ref)
set_target_properties(epx_nccl PROPERTIES EXPORT_NAME nccl)
install(TARGETS epx epx_reference epx_nccl EXPORT epxTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/epx DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.hpp")
install(EXPORT epxTargets NAMESPACE epx:: DESTINATION ${EPX_INSTALL_CMAKEDIR})

# The modules libepx and NCCL load at run time, beside the static libraries.
# Copied as built: the NVSHMEM module's RUNPATH already names NVSHMEM's host
# library and NCCL, and an install(TARGETS) rule would make CMake pad the
# build tree's RUNPATH for the rewrite (a trailing empty entry, which the
# loader reads as the current directory). A consumer's executable finds
# libepx_nvshmem.so through EPX_NVSHMEM_MODULE, a copy beside it, or this
# directory on its own RUNPATH (libepx's loader tries the bare name last);
# epxConfig.cmake sets epx_NVSHMEM_MODULE and epx_RUNTIME_DIR for that.
if(TARGET epx_nvshmem)
  install(PROGRAMS $<TARGET_FILE:epx_nvshmem> DESTINATION ${CMAKE_INSTALL_LIBDIR})
endif()
install(PROGRAMS $<TARGET_FILE:epx_gin_loopback> DESTINATION ${CMAKE_INSTALL_LIBDIR})

# What epxConfig.cmake records of this build (cmake/epxConfig.cmake.in).
if(TARGET epx_nvshmem)
  set(EPX_CONFIG_NVSHMEM_MODULE "${CMAKE_INSTALL_LIBDIR}/libepx_nvshmem.so")
else()
  set(EPX_CONFIG_NVSHMEM_MODULE "")
endif()
set(EPX_CONFIG_GIN_PLUGIN "${CMAKE_INSTALL_LIBDIR}/libnccl-net-epxloop.so")
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/epxConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/epxConfig.cmake
  INSTALL_DESTINATION ${EPX_INSTALL_CMAKEDIR})
# 0.x: a minor version may change the API, so only the same 0.y satisfies a request.
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/epxConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/epxConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/epxConfigVersion.cmake
        DESTINATION ${EPX_INSTALL_CMAKEDIR})
