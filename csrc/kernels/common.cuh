// Shared helpers of the torch-free CUDA kernels: the accumulation type of each storage type and
// conversions to and from it. Launchers return cudaError_t; the adapters turn errors into
// exceptions, so nothing here prints and carries on.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>

namespace dpcuda {
namespace cuda {

// Half types accumulate in float; float64 stays in double so gradcheck sees full precision.
template <typename T> struct AccType { using type = float; };
template <> struct AccType<double> { using type = double; };
template <typename T> using acc_t = typename AccType<T>::type;

template <typename T>
__device__ __forceinline__ acc_t<T> to_acc(T v) { return static_cast<acc_t<T>>(v); }
template <>
__device__ __forceinline__ float to_acc<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_acc<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T>
__device__ __forceinline__ T from_acc(acc_t<T> v) { return static_cast<T>(v); }
template <>
__device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Products and sums rounded one at a time, never contracted into a fused multiply-add. nvcc
// contracts a * b + c into an FMA by default (-fmad=true); the CPU kernels are built with
// -ffp-contract=off. The SGD update goes through these, so that CPU and CUDA give the same bits
// for float and double (the rule: every product and every sum rounded to nearest, in the order
// the formula is written; checked in the SASS by scripts/check_kernel_resources.py).
#if defined(DPCUDA_EMULATE)
__device__ __forceinline__ float mul_rn(float a, float b) { return a * b; }
__device__ __forceinline__ double mul_rn(double a, double b) { return a * b; }
__device__ __forceinline__ float add_rn(float a, float b) { return a + b; }
__device__ __forceinline__ double add_rn(double a, double b) { return a + b; }
#else
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
#endif

#if defined(DPCUDA_EMULATE)
__device__ __forceinline__ bool is_finite(float v) { return std::isfinite(v); }
__device__ __forceinline__ bool is_finite(double v) { return std::isfinite(v); }
#else
__device__ __forceinline__ bool is_finite(float v) { return isfinite(v); }
__device__ __forceinline__ bool is_finite(double v) { return isfinite(v); }
#endif

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Applies the macro M to every storage type the kernels are built for (explicit instantiations).
#define DPCUDA_FOR_EACH_TYPE(M) M(float) M(double) M(__half) M(__nv_bfloat16)

// Grids are capped so a huge tensor gets a grid-stride loop instead of a needlessly large grid.
// The emulation tests lower the cap, so that small tensors run the grid-stride paths too.
constexpr int64_t kMaxGridX = 65535LL * 16;
inline std::atomic<int64_t>& grid_cap() {
  static std::atomic<int64_t> cap{kMaxGridX};
  return cap;
}
inline int64_t max_grid_x() { return grid_cap().load(std::memory_order_relaxed); }

}  // namespace cuda
}  // namespace dpcuda
