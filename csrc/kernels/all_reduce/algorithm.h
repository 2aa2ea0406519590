// The all-reduce algorithms and the chunking they share on every backend (the CUDA schedules in
// schedule.h, the CPU ones in csrc/cpu/all_reduce.h). Plain C++: nvcc, g++ and the emulation
// all include it.
#pragma once

#include <cstdint>

namespace dpcuda {

enum class AllReduceAlgorithm { kOneShot, kTwoShot, kRing };

// The most chunks the ring cuts a buffer into, and the fewest elements per chunk.
constexpr int64_t kRingMaxChunks = 8;
constexpr int64_t kRingMinChunk = 1 << 16;

inline int64_t ring_chunks(int64_t n) {
  const int64_t c = n / kRingMinChunk;
  return c < 1 ? 1 : (c > kRingMaxChunks ? kRingMaxChunks : c);
}

}  // namespace dpcuda
