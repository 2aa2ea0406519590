// Helpers of the emulation tests: device buffers, a fresh emulated machine per case, and the
// rule that a case passes only if the emulator reported nothing it did not expect.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "check.h"
#include "emu/emu.h"

namespace emu_test {

#define CUDA_OK(expr) CHECK((expr) == cudaSuccess)

// A device buffer of n elements on the current device.
template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t n = 0;
  explicit DeviceBuffer(size_t count) : n(count) {
    CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&ptr), count * sizeof(T)));
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(ptr); }
  void upload(const std::vector<T>& host) {
    CUDA_OK(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(n);
    CUDA_OK(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
};

inline dpcuda::emu::Config config(int devices = 1, uint64_t seed = 1, int max_delay_us = 0) {
  dpcuda::emu::Config c;
  c.devices = devices;
  c.seed = seed;
  c.max_delay_us = max_delay_us;
  return c;
}

// A stream on each of the machine's D devices, and peer access enabled wherever the machine
// allows it (the hardware's limit of 8 peers per device applies; the rest is staged by the
// schedules): readable[d][e] says whether device d's kernels may read device e's memory.
inline std::vector<cudaStream_t> open_devices(int D, std::vector<std::vector<bool>>* readable) {
  readable->assign(D, std::vector<bool>(D, false));
  std::vector<cudaStream_t> streams(D);
  for (int d = 0; d < D; ++d) {
    CUDA_OK(cudaSetDevice(d));
    CUDA_OK(cudaStreamCreate(&streams[d]));
    for (int e = 0; e < D; ++e) {
      int can = 0;
      CUDA_OK(cudaDeviceCanAccessPeer(&can, d, e));
      if (can) (*readable)[d][e] = cudaDeviceEnablePeerAccess(e, 0) == cudaSuccess;
    }
    (void)cudaGetLastError();
  }
  return streams;
}

// Byte buffers on the devices: bytes[d] on device d (none where 0); ptrs[d] is null there.
struct PerDevice {
  std::vector<std::unique_ptr<DeviceBuffer<char>>> buffers;
  std::vector<void*> ptrs;
};

inline PerDevice per_device(const std::vector<size_t>& bytes) {
  PerDevice out;
  out.ptrs.assign(bytes.size(), nullptr);
  for (size_t d = 0; d < bytes.size(); ++d) {
    if (bytes[d] == 0) continue;
    CUDA_OK(cudaSetDevice(static_cast<int>(d)));
    out.buffers.push_back(std::make_unique<DeviceBuffer<char>>(bytes[d]));
    out.ptrs[d] = out.buffers.back()->ptr;
  }
  return out;
}

// Fails the case for every report of the emulator (a misuse nobody asked for).
inline void expect_no_reports(const char* where) {
  for (const std::string& r : dpcuda::emu::reports()) {
    std::printf("%s: unexpected emulator report: %s\n", where, r.c_str());
    dpcuda_test::fail();
  }
}

// Checks that some report contains `text`.
inline void expect_report(const char* text, const char* where) {
  for (const std::string& r : dpcuda::emu::reports()) {
    if (r.find(text) != std::string::npos) return;
  }
  std::printf("%s: expected an emulator report containing \"%s\"; got %zu reports\n", where, text,
              dpcuda::emu::reports().size());
  dpcuda_test::fail();
}

// The replica counts a test runs: all of `all`, or with `--replicas LIST` (comma-separated,
// each one of `all`) those alone (the sanitizer builds run a few, CMakeLists.txt). Bad
// arguments print the usage and exit 2.
inline std::vector<int> replicas(int argc, char** argv, const std::vector<int>& all) {
  if (argc == 1) return all;
  const auto usage = [&] {
    std::string counts;
    for (int r : all) counts += (counts.empty() ? "" : ",") + std::to_string(r);
    std::fprintf(stderr, "usage: %s [--replicas LIST]: LIST, comma-separated, of %s\n", argv[0],
                 counts.c_str());
    std::exit(2);
  };
  if (argc != 3 || std::string(argv[1]) != "--replicas") usage();
  std::vector<int> wanted;
  const std::string list = argv[2];
  for (size_t at = 0; at <= list.size();) {
    const size_t end = std::min(list.find(',', at), list.size());
    const std::string item = list.substr(at, end - at);
    int r = 0;
    if (item.empty() || item.size() > 3 ||
        item.find_first_not_of("0123456789") != std::string::npos ||
        std::find(all.begin(), all.end(), r = std::stoi(item)) == all.end()) {
      usage();
    }
    wanted.push_back(r);
    at = end + 1;
  }
  return wanted;
}

inline bool has(const std::vector<int>& counts, int r) {
  return std::find(counts.begin(), counts.end(), r) != counts.end();
}

inline int finish(const char* name) {
  const int failures = dpcuda_test::failures();
  std::printf("%s: %s (%d failures)\n", name, failures ? "FAILED" : "passed", failures);
  return failures ? 1 : 0;
}

}  // namespace emu_test
