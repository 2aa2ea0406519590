// ATen adapters of the replica all-reduce (dpcuda::all_reduce_) and of the reduction fused with
// SGD (dpcuda::reduce_sgd_): argument checks, then the algorithms themselves — which replica
// reduces which range, in which phase — over the CPU kernels (threads over shards and blocks)
// or the CUDA kernels (one stream per device, peer reads, events between the phases).
//
//   one_shot  every replica reads every peer's whole buffer and reduces it into a scratch
//             buffer; after a barrier each copies its scratch over its own buffer.
//   two_shot  replica k owns shard k: it reduces shard k of every peer (reduce-scatter, with
//             the SGD step fused in for reduce_sgd_) and, after a barrier, every replica copies
//             the other shards from their owners (all-gather).
//   ring      a pipelined chain: replica r adds its chunk to the partial sum of replicas
//             0..r-1, chunk after chunk; the last replica's result is then copied to all.
// All three compute each element as acc = x[0]; acc += x[1]; ...; acc /= R (mean), so they
// give the same bits on every replica.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

#include "../cpu/all_reduce.h"
#include "checks.h"

#ifdef DPCUDA_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>

#include <mutex>
#include <set>

#include "../kernels/all_reduce/all_reduce.h"
#include "cuda_types.h"
#endif

namespace dpcuda {
namespace {

using at::Tensor;

constexpr int kMaxReplicas = 16;
// Buffers up to this size use one_shot under "auto": one phase of reads beats two phases of
// half the traffic while launch and synchronisation dominate.
constexpr int64_t kOneShotMaxBytes = 256 * 1024;
// Elements per unit of CPU work, and the most chunks the ring pipelines a buffer into.
constexpr int64_t kPiece = 1 << 16;
constexpr int64_t kMaxRingChunks = 8;

enum class Algorithm { kOneShot, kTwoShot, kRing };

// "auto": on the CPU (replicas in one shared memory) two-shot, whose shards take one pass that
// reads every buffer once and writes every buffer once (measured fastest at every size by
// benchmarks/bench_allreduce.py); on CUDA one-shot for small buffers, two-shot for large ones.
Algorithm parse_algorithm(c10::string_view name, int64_t bytes, int64_t replicas, bool cpu) {
  if (name == "one_shot") return Algorithm::kOneShot;
  if (name == "two_shot") return Algorithm::kTwoShot;
  if (name == "ring") return Algorithm::kRing;
  TORCH_CHECK_VALUE(name == "auto", "algorithm must be one of auto, one_shot, two_shot, ring; ",
                    "got '", std::string(name), "'");
  if (cpu) return Algorithm::kTwoShot;
  return bytes <= kOneShotMaxBytes || replicas == 1 ? Algorithm::kOneShot : Algorithm::kTwoShot;
}

bool parse_mean(c10::string_view op) {
  TORCH_CHECK_VALUE(op == "sum" || op == "mean", "op must be sum or mean; got '",
                    std::string(op), "'");
  return op == "mean";
}

// A list of replica buffers: 1 to 16 dense tensors of one dtype and size, all on the CPU or
// all on CUDA devices, no two sharing memory.
void check_replicas(const std::vector<Tensor>& ts, const char* name, const Tensor* like) {
  TORCH_CHECK_VALUE(!ts.empty(), name, " must hold at least one tensor");
  TORCH_CHECK_VALUE(ts.size() <= kMaxReplicas, name, " holds ", ts.size(),
                    " tensors; at most ", kMaxReplicas, " replicas are supported");
  const Tensor& ref = like ? *like : ts[0];
  for (size_t i = 0; i < ts.size(); ++i) {
    const Tensor& t = ts[i];
    TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), name, "[", i, "] has dtype ",
                     t.scalar_type(), ", expected ", ref.scalar_type());
    TORCH_CHECK_VALUE(t.numel() == ref.numel(), name, "[", i, "] has ", t.numel(),
                      " elements, expected ", ref.numel());
    TORCH_CHECK_VALUE(t.is_contiguous(), name, "[", i, "] must be contiguous");
    TORCH_CHECK_VALUE(t.device().type() == ref.device().type(), name, "[", i, "] is on ",
                      t.device(), " but ", name, "[0] is on ", ref.device(),
                      "; replicas must all be on the CPU or all on CUDA devices");
    const auto* a = static_cast<const char*>(t.data_ptr());
    for (size_t j = 0; j < i; ++j) {
      const auto* b = static_cast<const char*>(ts[j].data_ptr());
      const int64_t bytes = t.numel() * t.element_size();
      TORCH_CHECK_VALUE(t.numel() == 0 || a + bytes <= b || b + bytes <= a || t.device() != ts[j].device(),
                        name, "[", i, "] and ", name, "[", j, "] share memory; every replica ",
                        "needs its own buffer");
    }
  }
}

// ---------------------------------------------------------------------------------------------
// CPU

template <typename T>
std::vector<T*> pointers(const std::vector<Tensor>& ts) {
  std::vector<T*> p;
  for (const Tensor& t : ts) p.push_back(t.data_ptr<T>());
  return p;
}

// The ranges of [begin, end) cut into pieces of kPiece elements.
void add_pieces(int64_t begin, int64_t end, std::vector<std::pair<int64_t, int64_t>>* out) {
  for (int64_t b = begin; b < end; b += kPiece) out->emplace_back(b, std::min(end, b + kPiece));
}

// The two-shot work list: every replica's shard cut into pieces.
template <typename T>
std::vector<std::pair<int64_t, int64_t>> shard_pieces(int64_t n, int replicas) {
  std::vector<std::pair<int64_t, int64_t>> pieces;
  for (int k = 0; k < replicas; ++k) {
    int64_t b, e;
    cpu::shard_range(n, replicas, k, 16 / sizeof(T), &b, &e);
    add_pieces(b, e, &pieces);
  }
  return pieces;
}

template <typename T>
void cpu_all_reduce(const std::vector<Tensor>& ts, bool mean, Algorithm algo) {
  const int R = static_cast<int>(ts.size());
  const int64_t n = ts[0].numel();
  if (n == 0 || R == 1) return;  // x / 1 == x: a single replica's mean is itself
  std::vector<T*> bufs = pointers<T>(ts);
  std::vector<const T*> in(bufs.begin(), bufs.end());
  if (algo == Algorithm::kTwoShot) {
    // Shards are disjoint, so each piece is read from every replica and written to every
    // replica in one go: the reduce-scatter and the all-gather of each shard share a pass.
    const auto pieces = shard_pieces<T>(n, R);
    at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t lo, int64_t hi) {
      for (int64_t p = lo; p < hi; ++p) {
        cpu::reduce_range<T>(in.data(), R, bufs.data(), R, pieces[p].first, pieces[p].second,
                             mean);
      }
    });
  } else if (algo == Algorithm::kOneShot) {
    const Tensor scratch = at::empty({R, n}, ts[0].options());
    T* base = scratch.data_ptr<T>();
    std::vector<std::pair<int64_t, int64_t>> pieces;
    add_pieces(0, n, &pieces);
    const int64_t np = static_cast<int64_t>(pieces.size());
    at::parallel_for(0, R * np, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t w = lo; w < hi; ++w) {
        T* out = base + (w / np) * n;
        cpu::reduce_range<T>(in.data(), R, &out, 1, pieces[w % np].first,
                             pieces[w % np].second, mean);
      }
    });
    at::parallel_for(0, R * np, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t w = lo; w < hi; ++w) {
        const auto [b, e] = pieces[w % np];
        std::copy(base + (w / np) * n + b, base + (w / np) * n + e, bufs[w / np] + b);
      }
    });
  } else {
    const int64_t chunks = std::min<int64_t>(kMaxRingChunks, std::max<int64_t>(1, n / kPiece));
    auto chunk = [&](int64_t c, int64_t* b, int64_t* e) {
      cpu::shard_range(n, static_cast<int>(chunks), static_cast<int>(c), 16 / sizeof(T), b, e);
    };
    // Reduce: at step s, replica r (1..R-1) adds chunk s - (r - 1) to replica r-1's partial.
    for (int64_t s = 0; s < chunks + R - 2; ++s) {
      at::parallel_for(1, R, 1, [&](int64_t lo, int64_t hi) {
        for (int64_t r = lo; r < hi; ++r) {
          const int64_t c = s - (r - 1);
          if (c < 0 || c >= chunks) continue;
          int64_t b, e;
          chunk(c, &b, &e);
          cpu::chain_accumulate<T>(bufs[r - 1], bufs[r], b, e, r == R - 1 && mean ? R : 0);
        }
      });
    }
    // Broadcast: every other replica copies the last replica's result.
    at::parallel_for(0, (R - 1) * chunks, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t w = lo; w < hi; ++w) {
        int64_t b, e;
        chunk(w % chunks, &b, &e);
        std::copy(bufs[R - 1] + b, bufs[R - 1] + e, bufs[w / chunks] + b);
      }
    });
  }
}

template <typename T>
void cpu_sgd(const std::vector<Tensor>& grads, const std::vector<Tensor>& params,
             const std::vector<Tensor>& momenta, cpu::Sgd sgd) {
  const int R = static_cast<int>(params.size());
  const int64_t n = params[0].numel();
  std::vector<std::pair<int64_t, int64_t>> pieces;
  add_pieces(0, n, &pieces);
  const int64_t np = static_cast<int64_t>(pieces.size());
  at::parallel_for(0, R * np, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t r = w / np;
      cpu::sgd_range<T>(grads[r].data_ptr<T>(), params[r].data_ptr<T>(),
                        momenta.empty() ? nullptr : momenta[r].data_ptr<T>(),
                        pieces[w % np].first, pieces[w % np].second, sgd);
    }
  });
}

template <typename T>
void cpu_reduce_sgd(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                    const std::vector<Tensor>& momenta, bool mean, Algorithm algo,
                    cpu::Sgd sgd) {
  const int R = static_cast<int>(params.size());
  const int64_t n = params[0].numel();
  if (n == 0) return;
  if (algo != Algorithm::kTwoShot) {
    cpu_all_reduce<T>(grads, mean, algo);
    cpu_sgd<T>(grads, params, momenta, sgd);
    return;
  }
  std::vector<const T*> g;
  for (const Tensor& t : grads) g.push_back(t.data_ptr<T>());
  std::vector<T*> p = pointers<T>(params);
  std::vector<T*> m = pointers<T>(momenta);
  const auto pieces = shard_pieces<T>(n, R);
  at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w) {
      cpu::reduce_sgd_range<T>(g.data(), R, p.data(), R, m.data(), static_cast<int>(m.size()),
                               pieces[w].first, pieces[w].second, mean, sgd);
    }
  });
}

void all_reduce_cpu(at::TensorList tensors, c10::string_view op, c10::string_view algorithm) {
  const std::vector<Tensor> ts = tensors.vec();
  check_replicas(ts, "tensors", nullptr);
  check_cpu_dtype(ts[0], "tensors");
  const bool mean = parse_mean(op);
  const Algorithm algo = parse_algorithm(algorithm, ts[0].nbytes(), ts.size(), true);
  AT_DISPATCH_FLOATING_TYPES(ts[0].scalar_type(), "all_reduce_cpu",
                             [&] { cpu_all_reduce<scalar_t>(ts, mean, algo); });
}

void check_sgd_args(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                    const std::vector<Tensor>& momenta, double lr, double momentum,
                    double weight_decay) {
  check_replicas(params, "params", nullptr);
  check_replicas(grads, "grads", &params[0]);
  TORCH_CHECK_VALUE(grads.size() == params.size(), "grads holds ", grads.size(),
                    " tensors but params holds ", params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK_VALUE(grads[i].device() == params[i].device(), "grads[", i, "] is on ",
                      grads[i].device(), " but params[", i, "] is on ", params[i].device());
  }
  TORCH_CHECK_VALUE(lr >= 0.0, "lr must be non-negative, got ", lr);
  TORCH_CHECK_VALUE(momentum >= 0.0, "momentum must be non-negative, got ", momentum);
  TORCH_CHECK_VALUE(weight_decay >= 0.0, "weight_decay must be non-negative, got ",
                    weight_decay);
  if (momentum != 0.0) {
    TORCH_CHECK_VALUE(momenta.size() == params.size(), "momentum_buffers must hold one buffer ",
                      "per replica when momentum is not 0; got ", momenta.size());
    check_replicas(momenta, "momentum_buffers", &params[0]);
    for (size_t i = 0; i < params.size(); ++i) {
      TORCH_CHECK_VALUE(momenta[i].device() == params[i].device(), "momentum_buffers[", i,
                        "] must be on ", params[i].device());
    }
  }
}

void reduce_sgd_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                    double lr, double momentum, double weight_decay, bool mean,
                    c10::string_view algorithm) {
  const std::vector<Tensor> p = params.vec(), g = grads.vec();
  const std::vector<Tensor> m = momentum != 0.0 ? momentum_buffers.vec() : std::vector<Tensor>();
  check_sgd_args(p, g, m, lr, momentum, weight_decay);
  check_cpu_dtype(p[0], "params");
  const Algorithm algo = parse_algorithm(algorithm, p[0].nbytes(), p.size(), true);
  AT_DISPATCH_FLOATING_TYPES(p[0].scalar_type(), "reduce_sgd_cpu", [&] {
    cpu_reduce_sgd<scalar_t>(p, g, m, mean, algo, {lr, momentum, weight_decay});
  });
}

// ---------------------------------------------------------------------------------------------
// CUDA

#ifdef DPCUDA_WITH_CUDA

// Whether kernels on `device` may read `peer`'s memory, enabling peer access the first time.
bool peer_readable(int device, int peer) {
  if (device == peer) return true;
  static std::mutex mutex;
  static std::set<std::pair<int, int>> enabled, refused;
  const std::lock_guard<std::mutex> lock(mutex);
  if (enabled.count({device, peer})) return true;
  if (refused.count({device, peer})) return false;
  int can = 0;
  check_cuda(cudaDeviceCanAccessPeer(&can, device, peer), "cudaDeviceCanAccessPeer");
  if (can) {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    const cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
    } else {
      check_cuda(err, "cudaDeviceEnablePeerAccess");
    }
    enabled.insert({device, peer});
    return true;
  }
  refused.insert({device, peer});
  return false;
}

// The devices of a call, each with its current stream, and a barrier between them: after
// barrier(), work queued on any device's stream runs after everything queued so far on all.
struct Devices {
  std::vector<int> ids;  // distinct devices, in order of first appearance
  std::vector<at::cuda::CUDAStream> streams;

  explicit Devices(const std::vector<Tensor>& ts) {
    for (const Tensor& t : ts) {
      const int d = t.get_device();
      if (std::find(ids.begin(), ids.end(), d) == ids.end()) {
        ids.push_back(d);
        streams.push_back(at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(d)));
      }
    }
  }
  at::cuda::CUDAStream stream_of(int device) const {
    return streams[std::find(ids.begin(), ids.end(), device) - ids.begin()];
  }
  void barrier() const {
    if (ids.size() < 2) return;
    std::vector<at::cuda::CUDAEvent> events(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) events[i].record(streams[i]);
    for (size_t i = 0; i < ids.size(); ++i) {
      for (size_t j = 0; j < ids.size(); ++j) {
        if (i != j) events[j].block(streams[i]);
      }
    }
  }
};

template <typename T>
using CT = typename CudaType<T>::type;

// The range [begin, end) of every replica's buffer as kernels on `device` may read it: the
// buffer itself when it is local or peer-readable, else a staged copy in `device`'s memory
// (offset so that the same element indices apply). Staging tensors are kept in `keep`.
template <typename T>
cuda::Replicas<const CT<T>> readable_from(int device, const std::vector<Tensor>& ts,
                                          int64_t begin, int64_t end, const Devices& devs,
                                          std::vector<Tensor>* keep) {
  cuda::Replicas<const CT<T>> r{};
  for (size_t i = 0; i < ts.size(); ++i) {
    const auto* p = reinterpret_cast<const CT<T>*>(ts[i].data_ptr<T>());
    if (!peer_readable(device, ts[i].get_device())) {
      const Tensor staged = at::empty({std::max<int64_t>(1, end - begin)},
                                      ts[i].options().device(at::Device(at::kCUDA, device)));
      check_cuda(cudaMemcpyPeerAsync(staged.data_ptr<T>(), device, ts[i].data_ptr<T>() + begin,
                                     ts[i].get_device(), (end - begin) * sizeof(T),
                                     devs.stream_of(device)),
                 "staged peer copy");
      keep->push_back(staged);
      p = reinterpret_cast<const CT<T>*>(staged.data_ptr<T>()) - begin;
    }
    r.ptr[i] = p;
  }
  return r;
}

template <typename T>
cuda::Replicas<CT<T>> writable(std::initializer_list<const Tensor*> ts) {
  cuda::Replicas<CT<T>> r{};
  int i = 0;
  for (const Tensor* t : ts) r.ptr[i++] = reinterpret_cast<CT<T>*>(t->data_ptr<T>());
  return r;
}

template <typename T>
cuda::Replicas<CT<T>> writable_all(const std::vector<Tensor>& ts) {
  cuda::Replicas<CT<T>> r{};
  for (size_t i = 0; i < ts.size(); ++i) r.ptr[i] = reinterpret_cast<CT<T>*>(ts[i].data_ptr<T>());
  return r;
}

// dst[begin, end) = src[begin, end), queued on dst's device stream.
template <typename T>
void copy_range(const Tensor& dst, const Tensor& src, int64_t begin, int64_t end,
                const Devices& devs) {
  if (end <= begin || dst.data_ptr() == src.data_ptr()) return;
  check_cuda(cudaMemcpyPeerAsync(dst.data_ptr<T>() + begin, dst.get_device(),
                                 src.data_ptr<T>() + begin, src.get_device(),
                                 (end - begin) * sizeof(T), devs.stream_of(dst.get_device())),
             "peer copy");
}

cuda::SgdArgs sgd_args(double lr, double momentum, double weight_decay) {
  return {static_cast<float>(lr), static_cast<float>(momentum), static_cast<float>(weight_decay),
          lr, momentum, weight_decay};
}

// The two-shot algorithm, for a plain all-reduce (params empty) or fused with SGD.
template <typename T>
void cuda_two_shot(const std::vector<Tensor>& grads, const std::vector<Tensor>& params,
                   const std::vector<Tensor>& momenta, bool mean, const cuda::SgdArgs* sgd,
                   const Devices& devs, std::vector<Tensor>* keep) {
  const int R = static_cast<int>(grads.size());
  const int64_t n = grads[0].numel();
  const int64_t align = 16 / sizeof(T);
  for (int k = 0; k < R; ++k) {
    int64_t b, e;
    cpu::shard_range(n, R, k, align, &b, &e);
    const int d = grads[k].get_device();
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(d));
    const auto in = readable_from<T>(d, grads, b, e, devs, keep);
    const cudaStream_t stream = devs.stream_of(d);
    if (sgd) {
      const bool use_m = !momenta.empty();
      check_cuda(cuda::reduce_sgd_range<CT<T>>(in, R, writable<T>({&params[k]}), 1,
                                               use_m ? writable<T>({&momenta[k]})
                                                     : cuda::Replicas<CT<T>>{},
                                               use_m ? 1 : 0, b, e, mean, *sgd, stream),
                 "reduce_sgd launch");
    } else {
      check_cuda(cuda::reduce_range<CT<T>>(in, R, writable<T>({&grads[k]}), 1, b, e, mean,
                                           stream),
                 "reduce launch");
    }
  }
  devs.barrier();
  const std::vector<Tensor>& out = sgd ? params : grads;
  for (int j = 0; j < R; ++j) {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(out[j].get_device()));
    for (int k = 0; k < R; ++k) {
      if (k == j) continue;
      int64_t b, e;
      cpu::shard_range(n, R, k, align, &b, &e);
      copy_range<T>(out[j], out[k], b, e, devs);
      if (sgd && !momenta.empty()) copy_range<T>(momenta[j], momenta[k], b, e, devs);
    }
  }
}

template <typename T>
void cuda_all_reduce(const std::vector<Tensor>& ts, bool mean, Algorithm algo) {
  const int R = static_cast<int>(ts.size());
  const int64_t n = ts[0].numel();
  if (n == 0 || R == 1) return;
  const Devices devs(ts);
  std::vector<Tensor> keep;  // scratch and staging, alive until every kernel is queued
  if (devs.ids.size() == 1 && algo != Algorithm::kRing) {
    // Replicas sharing one device: one kernel reads every buffer once and writes every buffer
    // once (2 R S bytes), which one-shot and two-shot both come down to on a single device.
    const c10::cuda::CUDAGuard guard(ts[0].device());
    cuda::Replicas<const CT<T>> in{};
    for (int r = 0; r < R; ++r) in.ptr[r] = reinterpret_cast<const CT<T>*>(ts[r].data_ptr<T>());
    check_cuda(cuda::reduce_range<CT<T>>(in, R, writable_all<T>(ts), R, 0, n, mean,
                                         devs.streams[0]),
               "reduce launch");
    return;
  }
  devs.barrier();  // every replica's buffer is complete before any peer reads it
  if (algo == Algorithm::kTwoShot) {
    cuda_two_shot<T>(ts, {}, {}, mean, nullptr, devs, &keep);
  } else if (algo == Algorithm::kOneShot) {
    std::vector<Tensor> scratch;
    for (int r = 0; r < R; ++r) {
      const int d = ts[r].get_device();
      const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(d));
      scratch.push_back(at::empty_like(ts[r]));
      const auto in = readable_from<T>(d, ts, 0, n, devs, &keep);
      check_cuda(cuda::reduce_range<CT<T>>(in, R, writable<T>({&scratch[r]}), 1, 0, n, mean,
                                           devs.stream_of(d)),
                 "reduce launch");
    }
    devs.barrier();  // nobody overwrites a buffer a peer may still be reading
    for (int r = 0; r < R; ++r) {
      const c10::cuda::CUDAGuard guard(ts[r].device());
      copy_range<T>(ts[r], scratch[r], 0, n, devs);
    }
    keep.insert(keep.end(), scratch.begin(), scratch.end());
  } else {
    // The chain, chunk by chunk: replica r waits for replica r-1's chunk c, adds its own and
    // hands the partial (in the accumulation type) on; events order the devices.
    using A = std::conditional_t<std::is_same<T, double>::value, double, float>;
    const auto acc_dtype = std::is_same<T, double>::value ? at::kDouble : at::kFloat;
    const int64_t chunks = std::min<int64_t>(kMaxRingChunks, std::max<int64_t>(1, n / kPiece));
    std::vector<Tensor> work;
    for (int r = 0; r < R; ++r) work.push_back(at::empty({n}, ts[r].options().dtype(acc_dtype)));
    std::vector<at::cuda::CUDAEvent> done(static_cast<size_t>(R * chunks));
    for (int64_t c = 0; c < chunks; ++c) {
      int64_t b, e;
      cpu::shard_range(n, static_cast<int>(chunks), static_cast<int>(c), 16 / sizeof(T), &b, &e);
      for (int r = 1; r < R; ++r) {
        const int d = ts[r].get_device();
        const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(d));
        const auto stream = devs.stream_of(d);
        if (r > 1) done[(r - 1) * chunks + c].block(stream);
        const int prev = ts[r - 1].get_device();
        const CT<T>* prev_x = nullptr;
        const A* prev_acc = nullptr;
        if (r == 1) {
          prev_x = readable_from<T>(d, {ts[0]}, b, e, devs, &keep).ptr[0];
        } else if (peer_readable(d, prev)) {
          prev_acc = work[r - 1].data_ptr<A>();
        } else {
          const Tensor staged = at::empty({n}, work[r].options());
          check_cuda(cudaMemcpyPeerAsync(staged.data_ptr<A>() + b, d, work[r - 1].data_ptr<A>() + b,
                                         prev, (e - b) * sizeof(A), stream),
                     "staged peer copy");
          keep.push_back(staged);
          prev_acc = staged.data_ptr<A>();
        }
        const bool last = r == R - 1;
        check_cuda(cuda::chain_accumulate<CT<T>, A>(
                       prev_x, prev_acc, reinterpret_cast<const CT<T>*>(ts[r].data_ptr<T>()),
                       work[r].data_ptr<A>(),
                       last ? reinterpret_cast<CT<T>*>(ts[r].data_ptr<T>()) : nullptr, b, e,
                       last && mean ? R : 0, stream),
                   "chain launch");
        done[r * chunks + c].record(stream);
      }
      for (int j = 0; j < R - 1; ++j) {
        const c10::cuda::CUDAGuard guard(ts[j].device());
        done[(R - 1) * chunks + c].block(devs.stream_of(ts[j].get_device()));
        copy_range<T>(ts[j], ts[R - 1], b, e, devs);
      }
    }
    keep.insert(keep.end(), work.begin(), work.end());
  }
  devs.barrier();  // no device reuses a buffer or scratch before every peer is done with it
}

template <typename T>
void cuda_reduce_sgd(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                     const std::vector<Tensor>& momenta, bool mean, Algorithm algo,
                     const cuda::SgdArgs& sgd) {
  const int R = static_cast<int>(params.size());
  const int64_t n = params[0].numel();
  if (n == 0) return;
  const Devices devs(params);
  if (algo != Algorithm::kTwoShot) {
    cuda_all_reduce<T>(grads, mean, algo);
    for (int r = 0; r < R; ++r) {
      const c10::cuda::CUDAGuard guard(params[r].device());
      check_cuda(cuda::sgd_range<CT<T>>(
                     reinterpret_cast<const CT<T>*>(grads[r].data_ptr<T>()),
                     reinterpret_cast<CT<T>*>(params[r].data_ptr<T>()),
                     momenta.empty() ? nullptr : reinterpret_cast<CT<T>*>(momenta[r].data_ptr<T>()),
                     n, sgd, devs.stream_of(params[r].get_device())),
                 "sgd launch");
    }
    return;
  }
  std::vector<Tensor> keep;
  if (devs.ids.size() == 1) {
    const c10::cuda::CUDAGuard guard(params[0].device());
    cuda::Replicas<const CT<T>> in{};
    for (int r = 0; r < R; ++r) {
      in.ptr[r] = reinterpret_cast<const CT<T>*>(grads[r].data_ptr<T>());
    }
    check_cuda(cuda::reduce_sgd_range<CT<T>>(in, R, writable_all<T>(params), R,
                                             writable_all<T>(momenta),
                                             static_cast<int>(momenta.size()), 0, n, mean, sgd,
                                             devs.streams[0]),
               "reduce_sgd launch");
    return;
  }
  devs.barrier();
  cuda_two_shot<T>(grads, params, momenta, mean, &sgd, devs, &keep);
  devs.barrier();
}

void all_reduce_cuda(at::TensorList tensors, c10::string_view op, c10::string_view algorithm) {
  const std::vector<Tensor> ts = tensors.vec();
  check_replicas(ts, "tensors", nullptr);
  check_cuda_dtype(ts[0], "tensors");
  const bool mean = parse_mean(op);
  const Algorithm algo = parse_algorithm(algorithm, ts[0].nbytes(), ts.size(), false);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, ts[0].scalar_type(),
                                  "all_reduce_cuda",
                                  [&] { cuda_all_reduce<scalar_t>(ts, mean, algo); });
}

void reduce_sgd_cuda(at::TensorList params, at::TensorList grads,
                     at::TensorList momentum_buffers, double lr, double momentum,
                     double weight_decay, bool mean, c10::string_view algorithm) {
  const std::vector<Tensor> p = params.vec(), g = grads.vec();
  const std::vector<Tensor> m = momentum != 0.0 ? momentum_buffers.vec() : std::vector<Tensor>();
  check_sgd_args(p, g, m, lr, momentum, weight_decay);
  check_cuda_dtype(p[0], "params");
  const Algorithm algo = parse_algorithm(algorithm, p[0].nbytes(), p.size(), false);
  const cuda::SgdArgs sgd = sgd_args(lr, momentum, weight_decay);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p[0].scalar_type(),
                                  "reduce_sgd_cuda",
                                  [&] { cuda_reduce_sgd<scalar_t>(p, g, m, mean, algo, sgd); });
}

#endif  // DPCUDA_WITH_CUDA

}  // namespace

TORCH_LIBRARY_IMPL(dpcuda, CPU, m) {
  m.impl("all_reduce_", &all_reduce_cpu);
  m.impl("reduce_sgd_", &reduce_sgd_cpu);
}

#ifdef DPCUDA_WITH_CUDA
TORCH_LIBRARY_IMPL(dpcuda, CUDA, m) {
  m.impl("all_reduce_", &all_reduce_cuda);
  m.impl("reduce_sgd_", &reduce_sgd_cuda);
}
#endif

}  // namespace dpcuda
