// What the emulated runtime (runtime.cpp) and the block runner (block.cpp) share.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>

namespace dpcuda {
namespace emu {

// Runs every block of the grid on the calling thread (a stream's worker); false when a misuse
// was found and reported.
bool run_grid(dim3 grid, dim3 block, const std::function<void()>& body, const char* site,
              uint64_t seed);

}  // namespace emu
}  // namespace dpcuda
