# Detects the CUDA toolkit and cuDNN headers. Sets FLEXATTN_HAVE_CUDA and FLEXATTN_HAVE_CUDNN.
# AUTO builds what is found; ON fails when it is missing; OFF skips it.
set(FLEXATTN_HAVE_CUDA OFF)
set(FLEXATTN_HAVE_CUDNN OFF)

if(NOT FLEXATTN_ENABLE_CUDA STREQUAL "OFF")
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND AND TARGET CUDA::nvrtc AND TARGET CUDA::cuda_driver)
    set(FLEXATTN_HAVE_CUDA ON)
  elseif(FLEXATTN_ENABLE_CUDA STREQUAL "ON")
    message(FATAL_ERROR "FLEXATTN_ENABLE_CUDA=ON but the CUDA toolkit (with NVRTC) was not found")
  endif()
endif()

if(FLEXATTN_HAVE_CUDA AND NOT FLEXATTN_ENABLE_CUDNN STREQUAL "OFF")
  # cuDNN is loaded at run time (dlopen); only its headers are needed to build.
  find_path(FLEXATTN_CUDNN_INCLUDE_DIR cudnn.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
  if(FLEXATTN_CUDNN_INCLUDE_DIR)
    set(FLEXATTN_HAVE_CUDNN ON)
  elseif(FLEXATTN_ENABLE_CUDNN STREQUAL "ON")
    message(FATAL_ERROR "FLEXATTN_ENABLE_CUDNN=ON but cudnn.h was not found")
  endif()
elseif(FLEXATTN_ENABLE_CUDNN STREQUAL "ON")
  message(FATAL_ERROR "FLEXATTN_ENABLE_CUDNN=ON needs CUDA")
endif()

message(STATUS "flexattn: CUDA engine ${FLEXATTN_HAVE_CUDA}, cuDNN engine ${FLEXATTN_HAVE_CUDNN}")
