// The emulated execution model itself, on kernels written here: built-in variables in three
// dimensions, per-block shared memory and barriers, every warp shuffle with its mask and width
// rules, the hardware's launch limits, streams and events across devices, peer access, and the
// misuses that must be reported instead of hanging (a barrier split by an exit, a shuffle whose
// mask names a lane that exited or does not take part).
#include <cstdint>
#include <random>
#include <vector>

#include "emu_test.h"
#include "kernels/launch.cuh"

using dpcuda::cuda::launch;
using emu_test::DeviceBuffer;

namespace {

__global__ void index_kernel(int* out) {
  const int block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int threads = blockDim.x * blockDim.y * blockDim.z;
  out[block * threads + thread] = block * 10000 + thread;
}

// A shared-memory tree sum over the block: every level needs its barrier.
__global__ void block_sum_kernel(const float* in, float* out) {
  __shared__ float buf[256];
  const int t = threadIdx.x;
  buf[t] = in[blockIdx.x * 256 + t];
  __syncthreads();
  for (int stride = 128; stride > 0; stride >>= 1) {
    if (t < stride) buf[t] += buf[t + stride];
    __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = buf[0];
}

__global__ void shuffle_kernel(const int* in, int* out, int width) {
  const int t = threadIdx.x;
  const int v = in[t];
  out[0 * 64 + t] = __shfl_xor_sync(0xffffffffu, v, 5, width);
  out[1 * 64 + t] = __shfl_down_sync(0xffffffffu, v, 3, width);
  out[2 * 64 + t] = __shfl_up_sync(0xffffffffu, v, 3, width);
  out[3 * 64 + t] = __shfl_sync(0xffffffffu, v, 6, width);
  double d = v;
  for (int offset = 16; offset > 0; offset >>= 1) d += __shfl_xor_sync(0xffffffffu, d, offset);
  out[4 * 64 + t] = static_cast<int>(d);
}

__global__ void split_barrier_kernel(int* out) {
  if (threadIdx.x >= 16) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void shuffle_exited_lane_kernel(int* out) {
  if (threadIdx.x == 31) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, static_cast<int>(threadIdx.x), 1);
}

__global__ void shuffle_outside_mask_kernel(int* out) {
  if (threadIdx.x < 16) {
    out[threadIdx.x] = __shfl_sync(0x0000ffffu, static_cast<int>(threadIdx.x), 20);
  }
}

__global__ void add_kernel(float* x, const float* y, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    x[i] += y[i];
  }
}

__global__ void empty_kernel() {}

void test_builtins() {
  dpcuda::emu::reset(emu_test::config(1, 3));
  const dim3 grid(3, 2, 2), block(4, 3, 2);
  const int n = 3 * 2 * 2 * 4 * 3 * 2;
  DeviceBuffer<int> out(n);
  CUDA_OK(launch(index_kernel, grid, block, 0, nullptr, out.ptr));
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<int> got = out.download();
  for (int b = 0; b < 12; ++b)
    for (int t = 0; t < 24; ++t) CHECK(got[b * 24 + t] == b * 10000 + t);
  emu_test::expect_no_reports("builtins");
}

void test_barriers_and_shared() {
  for (uint64_t seed : {1, 2, 3}) {
    dpcuda::emu::reset(emu_test::config(1, seed));
    const int blocks = 5;
    std::vector<float> host(blocks * 256);
    std::mt19937 rng(static_cast<unsigned>(seed));
    for (auto& v : host) v = static_cast<float>(rng() % 1000);
    DeviceBuffer<float> in(host.size()), out(blocks);
    in.upload(host);
    CUDA_OK(launch(block_sum_kernel, dim3(blocks), dim3(256), 0, nullptr, in.ptr, out.ptr));
    const std::vector<float> got = out.download();
    for (int b = 0; b < blocks; ++b) {
      float want = 0;
      for (int t = 0; t < 256; ++t) want += host[b * 256 + t];
      CHECK(got[b] == want);  // integers: exact in any order
    }
    emu_test::expect_no_reports("barriers");
  }
}

void test_shuffles() {
  for (int width : {32, 16, 8, 4, 2, 1}) {
    dpcuda::emu::reset(emu_test::config(1, static_cast<uint64_t>(width)));
    std::vector<int> host(64);
    for (int i = 0; i < 64; ++i) host[i] = i * 7 + 1;
    DeviceBuffer<int> in(64), out(5 * 64);
    in.upload(host);
    CUDA_OK(launch(shuffle_kernel, dim3(1), dim3(64), 0, nullptr, in.ptr, out.ptr, width));
    const std::vector<int> got = out.download();
    for (int t = 0; t < 64; ++t) {
      const int lane = t % 32, warp = t - lane, seg = lane & ~(width - 1), pos = lane % width;
      const int x = lane ^ 5;
      const int want_xor = x < seg + width ? host[warp + x] : host[t];
      const int want_down = pos + 3 < width ? host[t + 3] : host[t];
      const int want_up = pos >= 3 ? host[t - 3] : host[t];
      const int want_sync = host[warp + seg + (6 % width)];
      int want_sum = 0;
      for (int l = 0; l < 32; ++l) want_sum += host[warp + l];
      CHECK(got[0 * 64 + t] == want_xor);
      CHECK(got[1 * 64 + t] == want_down);
      CHECK(got[2 * 64 + t] == want_up);
      CHECK(got[3 * 64 + t] == want_sync);
      CHECK(got[4 * 64 + t] == want_sum);
    }
    emu_test::expect_no_reports("shuffles");
  }
}

void test_launch_limits() {
  dpcuda::emu::reset(emu_test::config());
  const struct {
    dim3 grid, block;
    size_t shared;
    cudaError_t want;
  } cases[] = {
      {dim3(1), dim3(1025), 0, cudaErrorInvalidConfiguration},
      {dim3(1), dim3(32, 33), 0, cudaErrorInvalidConfiguration},
      {dim3(1), dim3(1, 1, 65), 0, cudaErrorInvalidConfiguration},
      {dim3(1, 65536), dim3(32), 0, cudaErrorInvalidConfiguration},
      {dim3(1, 1, 65536), dim3(32), 0, cudaErrorInvalidConfiguration},
      {dim3(0), dim3(32), 0, cudaErrorInvalidConfiguration},
      {dim3(1), dim3(0), 0, cudaErrorInvalidConfiguration},
      {dim3(1), dim3(32), 48 * 1024 + 1, cudaErrorInvalidValue},
      {dim3(1), dim3(1024), 48 * 1024, cudaSuccess},
      {dim3(1), dim3(1, 1, 64), 0, cudaSuccess},
  };
  for (const auto& c : cases) {
    const cudaError_t err = launch(empty_kernel, c.grid, c.block, c.shared, nullptr);
    CHECK(err == c.want);
    CHECK(cudaGetLastError() == c.want);
    CHECK(cudaGetLastError() == cudaSuccess);  // a launch error is not sticky
  }
  CUDA_OK(cudaDeviceSynchronize());
  emu_test::expect_no_reports("limits");
}

void test_misuse_reported() {
  {
    dpcuda::emu::reset(emu_test::config());
    DeviceBuffer<int> out(32);
    CUDA_OK(launch(split_barrier_kernel, dim3(1), dim3(32), 0, nullptr, out.ptr));
    CHECK(cudaDeviceSynchronize() == cudaErrorLaunchFailure);
    emu_test::expect_report("split between a barrier and an exit", "split barrier");
  }
  {
    dpcuda::emu::reset(emu_test::config());
    DeviceBuffer<int> out(32);
    CUDA_OK(launch(shuffle_exited_lane_kernel, dim3(1), dim3(32), 0, nullptr, out.ptr));
    CHECK(cudaDeviceSynchronize() == cudaErrorLaunchFailure);
    emu_test::expect_report("lane 31", "shuffle with an exited lane");
  }
  {
    dpcuda::emu::reset(emu_test::config());
    DeviceBuffer<int> out(32);
    CUDA_OK(launch(shuffle_outside_mask_kernel, dim3(1), dim3(32), 0, nullptr, out.ptr));
    CHECK(cudaDeviceSynchronize() == cudaErrorLaunchFailure);
    emu_test::expect_report("not in the mask", "shuffle outside the mask");
  }
}

void test_streams_events_peers() {
  dpcuda::emu::Config c = emu_test::config(2, 9, 200);
  c.peer = {{false, true}, {true, false}};
  dpcuda::emu::reset(c);
  const int n = 4096;
  CUDA_OK(cudaSetDevice(0));
  DeviceBuffer<float> x0(n);
  CUDA_OK(cudaSetDevice(1));
  DeviceBuffer<float> x1(n);
  x1.upload(std::vector<float>(n, 2.0f));
  CUDA_OK(cudaSetDevice(0));
  x0.upload(std::vector<float>(n, 1.0f));
  cudaStream_t s0, s1;
  cudaEvent_t e1;
  CUDA_OK(cudaStreamCreate(&s0));
  CUDA_OK(cudaSetDevice(1));
  CUDA_OK(cudaStreamCreate(&s1));
  CUDA_OK(cudaEventCreateWithFlags(&e1, cudaEventDisableTiming));
  // Device 1 adds to its buffer; device 0 waits for that and then reads it over peer access.
  CUDA_OK(launch(add_kernel, dim3(4), dim3(128), 0, s1, x1.ptr, x1.ptr, n));
  CUDA_OK(cudaEventRecord(e1, s1));
  CUDA_OK(cudaSetDevice(0));
  // A launch onto another device's stream and an event on another device's stream are invalid.
  CHECK(launch(add_kernel, dim3(1), dim3(32), 0, s1, x0.ptr, x0.ptr, n) ==
        cudaErrorInvalidResourceHandle);
  CHECK(cudaEventRecord(e1, s0) == cudaErrorInvalidResourceHandle);
  (void)cudaGetLastError();
  CUDA_OK(cudaDeviceEnablePeerAccess(1, 0));
  CHECK(cudaDeviceEnablePeerAccess(1, 0) == cudaErrorPeerAccessAlreadyEnabled);
  (void)cudaGetLastError();
  CUDA_OK(cudaStreamWaitEvent(s0, e1, 0));
  CUDA_OK(launch(add_kernel, dim3(4), dim3(128), 0, s0, x0.ptr, x1.ptr, n));
  CUDA_OK(cudaStreamSynchronize(s0));
  for (float v : x0.download()) CHECK(v == 5.0f);
  // Without peer access (1 -> 0 not enabled) the kernel faults, as on hardware.
  CUDA_OK(cudaSetDevice(1));
  CUDA_OK(launch(add_kernel, dim3(4), dim3(128), 0, s1, x1.ptr, x0.ptr, n));
  CHECK(cudaStreamSynchronize(s1) == cudaErrorIllegalAddress);
  emu_test::expect_report("without peer access", "peer access");
  CUDA_OK(cudaEventDestroy(e1));
  CUDA_OK(cudaSetDevice(0));

  // A device maps at most 8 peers; peer pairs the matrix denies are unsupported.
  dpcuda::emu::Config many = emu_test::config(10);
  many.peer.assign(10, std::vector<bool>(10, true));
  many.peer[0][9] = false;
  dpcuda::emu::reset(many);
  CHECK(cudaDeviceEnablePeerAccess(9, 0) == cudaErrorPeerAccessUnsupported);
  for (int p = 1; p <= 8; ++p) CUDA_OK(cudaDeviceEnablePeerAccess(p, 0));
  many.peer[0][9] = true;
  dpcuda::emu::reset(many);
  for (int p = 1; p <= 8; ++p) CUDA_OK(cudaDeviceEnablePeerAccess(p, 0));
  CHECK(cudaDeviceEnablePeerAccess(9, 0) == cudaErrorTooManyPeers);
  (void)cudaGetLastError();
}

}  // namespace

int main() {
  test_builtins();
  test_barriers_and_shared();
  test_shuffles();
  test_launch_limits();
  test_misuse_reported();
  test_streams_events_peers();
  return emu_test::finish("test_emulation_model");
}
