#include "optim.h"

#include "../launch.cuh"

namespace dpcuda {
namespace cuda {
namespace {

// One block: the rows, the counts and a ring row are a few hundred values at most.
constexpr int kThreads = 128;
static_assert(optim::kStatusRecord == kRecord, "a step_status record's doubles");

__global__ void update_hyper_kernel(optim::Kind kind, double* hyper, int64_t groups,
                                    const double* base, const float* counts, int64_t n,
                                    const int64_t* first) {
  for (int64_t g = threadIdx.x; g < groups; g += blockDim.x) {
    optim::complete_row(kind, hyper + g * optim::kHyper,
                        base != nullptr ? base + g * optim::kHyper : nullptr, counts, n, first,
                        g);
  }
}

__global__ void update_counts_kernel(optim::Kind kind, const __grid_constant__ CountRecords
                                     records, float* counts, int64_t n, double* ring,
                                     int64_t slots, int64_t* slot) {
  const bool applied = optim::update_applied(records.ptr, records.n);
  for (int64_t i = threadIdx.x; counts != nullptr && i < n; i += blockDim.x) {
    counts[i] = optim::advanced_count(kind, counts[i], applied);
  }
  if (ring == nullptr) return;
  const int64_t s = optim::ring_slot(*slot, slots);
  double* row = ring + s * records.n * kRecord;
  for (int i = threadIdx.x; i < records.n * kRecord; i += blockDim.x) {
    row[i] = records.ptr[i / kRecord][i % kRecord];
  }
  // Every thread has read the slot before it moves on.
  __syncthreads();
  if (threadIdx.x == 0) *slot = (s + 1) % slots;
}

}  // namespace

cudaError_t update_hyper(optim::Kind kind, double* hyper, int64_t groups, const double* base,
                         const float* counts, int64_t n, const int64_t* first,
                         cudaStream_t stream) {
  if (groups <= 0) return cudaSuccess;
  if (kind == optim::Kind::kAdam && (counts == nullptr || first == nullptr)) {
    return cudaErrorInvalidValue;
  }
  return launch(update_hyper_kernel, dim3(1), dim3(kThreads), 0, stream, kind, hyper, groups,
                base, counts, n, first);
}

cudaError_t update_counts(optim::Kind kind, const CountRecords& records, float* counts,
                          int64_t n, double* ring, int64_t slots, int64_t* slot,
                          cudaStream_t stream) {
  if (records.n < 0 || records.n > kMaxReplicas) return cudaErrorInvalidValue;
  if (ring != nullptr && (slot == nullptr || slots <= 0 || records.n == 0)) {
    return cudaErrorInvalidValue;
  }
  if ((counts == nullptr || n <= 0) && ring == nullptr) return cudaSuccess;
  return launch(update_counts_kernel, dim3(1), dim3(kThreads), 0, stream, kind, records,
                counts, n, ring, slots, slot);
}

}  // namespace cuda
}  // namespace dpcuda
