// Maps ATen's scalar types to the CUDA types the torch-free kernels are compiled for (the two
// have the same size and layout, so pointers are reinterpreted, never converted), and turns the
// kernels' cudaError_t into an exception.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace dpcuda {

template <typename T> struct CudaType { using type = T; };
template <> struct CudaType<c10::Half> { using type = __half; };
template <> struct CudaType<c10::BFloat16> { using type = __nv_bfloat16; };

static_assert(sizeof(c10::Half) == sizeof(__half), "Half layout");
static_assert(sizeof(c10::BFloat16) == sizeof(__nv_bfloat16), "BFloat16 layout");

inline void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "dpcuda: ", what, " failed: ", cudaGetErrorString(err));
}

}  // namespace dpcuda
