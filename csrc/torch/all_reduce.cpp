// ATen adapters of the replica all-reduce (dpcuda::all_reduce_) and of the reduction fused with
// SGD (dpcuda::reduce_sgd_): argument checks, dtype dispatch, the pointers, the current streams,
// device guards, peer access and scratch memory from the caching allocator. The algorithms
// themselves are torch-free: csrc/cpu/all_reduce.h on the CPU (threads over shards, through
// at::parallel_for), csrc/kernels/all_reduce/schedule.h on CUDA devices (streams, events, peer
// reads or staged copies), where the CPU emulation tests them. Every algorithm computes each
// element as acc = x[0]; acc += x[1]; ...; acc /= R (mean), so all give the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "../cpu/all_reduce.h"
#include "checks.h"

#ifdef DPCUDA_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/PeerToPeerAccess.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdlib>
#include <mutex>
#include <set>

#include "../kernels/all_reduce/schedule.h"
#include "cuda_types.h"
#include "kernel_image.h"
#endif

namespace dpcuda {
namespace {

using at::Tensor;

using Algorithm = AllReduceAlgorithm;

constexpr int kMaxReplicas = 16;
// Buffers up to this size use one_shot under "auto": one phase of reads beats two phases of
// half the traffic while launch and synchronisation dominate.
constexpr int64_t kOneShotMaxBytes = 256 * 1024;

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
    for (size_t j = 0; j < i; ++j) {
      TORCH_CHECK_VALUE(!overlap(t, ts[j]), name, "[", i, "] and ", name, "[", j,
                        "] share memory; every replica needs its own buffer");
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

const cpu::ParallelFor& torch_threads() {
  static const cpu::ParallelFor parallel =
      [](int64_t begin, int64_t end, const std::function<void(int64_t, int64_t)>& body) {
        at::parallel_for(begin, end, 1, body);
      };
  return parallel;
}

std::vector<Tensor> as_float(const std::vector<Tensor>& ts) {
  std::vector<Tensor> f;
  f.reserve(ts.size());
  for (const Tensor& t : ts) f.push_back(t.to(at::kFloat));
  return f;
}

// The CPU algorithms' scratch, as a tensor that lives for the call.
Tensor cpu_scratch(Algorithm algo, const std::vector<Tensor>& ts) {
  const int64_t n = cpu::all_reduce_scratch(algo, static_cast<int>(ts.size()), ts[0].numel());
  return at::empty({n}, ts[0].options());
}

void all_reduce_cpu(at::TensorList tensors, c10::string_view op, c10::string_view algorithm) {
  const std::vector<Tensor> ts = tensors.vec();
  check_replicas(ts, "tensors", nullptr);
  if (is_half_type(ts[0])) {
    // bfloat16/half on the CPU: the float algorithm on float copies, each result rounded once
    // (as the CUDA kernels accumulate in float).
    std::vector<Tensor> f = as_float(ts);
    all_reduce_cpu(f, op, algorithm);
    for (size_t i = 0; i < ts.size(); ++i) ts[i].copy_(f[i]);
    return;
  }
  check_cpu_dtype(ts[0], "tensors");
  const bool mean = parse_mean(op);
  const Algorithm algo = parse_algorithm(algorithm, ts[0].nbytes(), ts.size(), true);
  const Tensor scratch = cpu_scratch(algo, ts);
  AT_DISPATCH_FLOATING_TYPES(ts[0].scalar_type(), "all_reduce_cpu", [&] {
    cpu::all_reduce<scalar_t>(pointers<scalar_t>(ts).data(), static_cast<int>(ts.size()),
                              ts[0].numel(), mean, algo, scratch.data_ptr<scalar_t>(),
                              torch_threads());
  });
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

// The step_status record: [loss, NaN/Inf, bad label, rows counted] (csrc/kernels/all_reduce).
constexpr int64_t kRecord = 4;

// status: none, or one step_status record per replica on its device; scaled_by and loss_out
// need them. loss_out shares memory with none of the call's tensors (the kernels write it
// while other blocks read and write those).
// others: the call's other tensors (momentum buffers, state shards, ...) by name.
using NamedLists = std::vector<std::pair<const char*, const std::vector<Tensor>*>>;
void check_status_records(const std::vector<Tensor>& status, const std::vector<Tensor>& params,
                          const std::vector<Tensor>& grads, const NamedLists& others,
                          double scaled_by, const c10::optional<Tensor>& loss_out) {
  TORCH_CHECK_VALUE(status.empty() || status.size() == params.size(), "status must be empty or ",
                    "hold one step_status record per replica (", params.size(), "); got ",
                    status.size());
  for (size_t i = 0; i < status.size(); ++i) {
    const Tensor& s = status[i];
    TORCH_CHECK_VALUE(s.scalar_type() == at::kDouble && s.dim() == 1 &&
                          s.numel() == kRecord && s.is_contiguous(),
                      "status[", i, "] must be a step_status record (", kRecord,
                      " contiguous float64), got ", s.scalar_type(), " of shape ", s.sizes());
    TORCH_CHECK_VALUE(s.device() == params[i].device(), "status[", i, "] is on ", s.device(),
                      " but params[", i, "] is on ", params[i].device());
  }
  TORCH_CHECK_VALUE(std::isfinite(scaled_by) && scaled_by >= 0.0,
                    "scaled_by must be a non-negative number of rows, got ", scaled_by);
  TORCH_CHECK_VALUE(scaled_by == 0.0 || !status.empty(), "scaled_by needs status records");
  if (loss_out.has_value() && loss_out->defined()) {
    TORCH_CHECK_VALUE(!status.empty(), "loss_out needs status records");
    TORCH_CHECK_VALUE(loss_out->scalar_type() == at::kDouble && loss_out->numel() == 1,
                      "loss_out must be one float64, got ", loss_out->scalar_type(), " of ",
                      loss_out->numel(), " elements");
    TORCH_CHECK_VALUE(loss_out->device() == params[0].device(), "loss_out is on ",
                      loss_out->device(), " but params[0] is on ", params[0].device());
    TORCH_CHECK_VALUE(params[0].numel() > 0, "loss_out needs parameters to update (params ",
                      "are empty)");
    NamedLists lists = {{"status", &status}, {"params", &params}, {"grads", &grads}};
    lists.insert(lists.end(), others.begin(), others.end());
    for (const auto& list : lists) {
      for (size_t i = 0; i < list.second->size(); ++i) {
        TORCH_CHECK_VALUE(!overlap(*loss_out, (*list.second)[i]), "loss_out shares memory with ",
                          list.first, "[", i, "]");
      }
    }
  }
}

// What the records say, read on the host (the CPU's records are in host memory), as the CUDA
// kernels read them: skip, the gradient's factor, the step's loss.
struct HostVerdict {
  bool skip = false;
  double fix = 1.0;
  double loss = 0.0;
};

HostVerdict read_records(const std::vector<Tensor>& records, double scaled_by) {
  HostVerdict v;
  double rows = 0.0;
  for (const Tensor& s : records) {
    const double* r = s.data_ptr<double>();
    v.skip = v.skip || r[1] != 0.0 || r[2] != 0.0;
    v.loss += r[0];
    rows += r[3];
  }
  if (scaled_by > 0.0) {
    if (rows > 0.0) {
      v.fix = scaled_by / rows;
      v.loss *= v.fix;
    } else {
      v.loss = std::nan("");
    }
  }
  return v;
}

void reduce_sgd_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                    double lr, double momentum, double weight_decay, bool mean,
                    c10::string_view algorithm, c10::optional<at::TensorList> status,
                    double scaled_by, const c10::optional<Tensor>& loss_out) {
  const std::vector<Tensor> p = params.vec(), g = grads.vec();
  const std::vector<Tensor> m = momentum != 0.0 ? momentum_buffers.vec() : std::vector<Tensor>();
  const std::vector<Tensor> records = status.has_value() ? status->vec() : std::vector<Tensor>();
  check_sgd_args(p, g, m, lr, momentum, weight_decay);
  check_status_records(records, p, g, {{"momentum_buffers", &m}}, scaled_by, loss_out);
  (void)parse_algorithm(algorithm, p[0].nbytes(), p.size(), true);  // checked before any write
  if (!is_half_type(p[0])) check_cpu_dtype(p[0], "params");
  const HostVerdict v = read_records(records, scaled_by);
  if (loss_out.has_value() && loss_out->defined()) loss_out->fill_(v.loss);
  if (v.skip) return;  // a NaN/Inf gradient or a bad label: no update
  if (v.fix != 1.0) {
    // The CUDA kernels' order: the fixed-order sum (or mean; in float for the half types),
    // rounded to the buffer type, times fix, rounded again; then the step on replica 0's
    // buffers, copied to the others.
    const bool half = is_half_type(p[0]);
    Tensor acc = half ? g[0].to(at::kFloat) : g[0].clone();
    for (size_t r = 1; r < g.size(); ++r) acc.add_(half ? g[r].to(at::kFloat) : g[r]);
    if (mean) acc.div_(static_cast<double>(g.size()));
    Tensor reduced = acc.to(p[0].scalar_type());
    reduced = (half ? reduced.to(at::kFloat) : reduced).mul_(v.fix).to(p[0].scalar_type());
    std::vector<Tensor> m0;
    if (!m.empty()) m0.push_back(m[0]);
    reduce_sgd_cpu({p[0]}, {reduced}, m0, lr, momentum, weight_decay, false, algorithm,
                   c10::nullopt, 0.0, c10::nullopt);
    for (size_t r = 1; r < p.size(); ++r) p[r].copy_(p[0]);
    for (size_t r = 1; r < m.size(); ++r) m[r].copy_(m[0]);
    return;
  }
  if (is_half_type(p[0])) {
    std::vector<Tensor> fp = as_float(p), fm = as_float(m);
    reduce_sgd_cpu(fp, as_float(g), fm, lr, momentum, weight_decay, mean, algorithm,
                   c10::nullopt, 0.0, c10::nullopt);
    for (size_t i = 0; i < p.size(); ++i) p[i].copy_(fp[i]);
    for (size_t i = 0; i < m.size(); ++i) m[i].copy_(fm[i]);
    return;
  }
  check_cpu_dtype(p[0], "params");
  const Algorithm algo = parse_algorithm(algorithm, p[0].nbytes(), p.size(), true);
  const Tensor scratch = cpu_scratch(algo, p);
  AT_DISPATCH_FLOATING_TYPES(p[0].scalar_type(), "reduce_sgd_cpu", [&] {
    std::vector<scalar_t*> mp = pointers<scalar_t>(m);
    cpu::reduce_sgd<scalar_t>(pointers<scalar_t>(p).data(), pointers<scalar_t>(g).data(),
                              m.empty() ? nullptr : mp.data(), static_cast<int>(p.size()),
                              p[0].numel(), mean, algo, {lr, momentum, weight_decay},
                              scratch.data_ptr<scalar_t>(), torch_threads());
  });
}

// ---------------------------------------------------------------------------------------------
// The reduction fused with dpcuda.optim's update (reduce_update_)

// The two_shot shard of replica k (the elements whose state replica k keeps).
int64_t shard_size(int64_t n, int replicas, int k, int64_t elem_size) {
  int64_t b, e;
  cpu::shard_range(n, replicas, k, 16 / elem_size, &b, &e);
  return e - b;
}

struct UpdateArgs {
  optim::Kind kind;
  std::vector<cpu::UpdateSegment> segments;
  int groups;
};

// params and grads: one full buffer per replica; stateX: empty or one shard per replica (the
// two_shot split's, on the replica's device); hyper: groups * R float64 arrays, hyper[g * R + r]
// on replica r's device; segments: (begin, end, group) triples covering [0, n) in order.
UpdateArgs check_update_args(const std::vector<Tensor>& p, const std::vector<Tensor>& g,
                             const std::vector<Tensor>& s1, const std::vector<Tensor>& s2,
                             const std::vector<Tensor>& s3, const std::vector<Tensor>& hyper,
                             at::IntArrayRef segments, c10::string_view optimizer) {
  UpdateArgs out;
  TORCH_CHECK_VALUE(optimizer == "sgd" || optimizer == "adam", "optimizer must be sgd or adam ",
                    "(adamw is adam with the decoupled flag); got '", std::string(optimizer),
                    "'");
  out.kind = optimizer == "sgd" ? optim::Kind::kSgd : optim::Kind::kAdam;
  check_replicas(p, "params", nullptr);
  check_replicas(g, "grads", &p[0]);
  const int R = static_cast<int>(p.size());
  TORCH_CHECK_VALUE(g.size() == p.size(), "grads holds ", g.size(), " tensors but params holds ",
                    p.size());
  for (int r = 0; r < R; ++r) {
    TORCH_CHECK_VALUE(g[r].device() == p[r].device(), "grads[", r, "] is on ", g[r].device(),
                      " but params[", r, "] is on ", p[r].device());
  }
  const int64_t n = p[0].numel();
  const bool adam = out.kind == optim::Kind::kAdam;
  auto check_state = [&](const std::vector<Tensor>& s, const char* name, bool required) {
    if (s.empty()) {
      TORCH_CHECK_VALUE(!required, name, " must hold one shard per replica for this optimizer");
      return;
    }
    TORCH_CHECK_VALUE(static_cast<int>(s.size()) == R, name, " holds ", s.size(),
                      " shards but there are ", R, " replicas");
    for (int r = 0; r < R; ++r) {
      const int64_t want = shard_size(n, R, r, p[0].element_size());
      TORCH_CHECK_TYPE(s[r].scalar_type() == p[0].scalar_type(), name, "[", r, "] has dtype ",
                       s[r].scalar_type(), ", expected ", p[0].scalar_type());
      TORCH_CHECK_VALUE(s[r].numel() == want && s[r].is_contiguous(), name, "[", r,
                        "] must be replica ", r, "'s shard: ", want,
                        " contiguous elements, got ", s[r].numel());
      TORCH_CHECK_VALUE(s[r].device() == p[r].device(), name, "[", r, "] is on ",
                        s[r].device(), " but params[", r, "] is on ", p[r].device());
    }
  };
  check_state(s1, "state1", adam);
  check_state(s2, "state2", adam);
  check_state(s3, "state3", false);
  TORCH_CHECK_VALUE(adam || s2.empty(), "state2 must be empty for sgd");
  TORCH_CHECK_VALUE(adam || s3.empty(), "state3 must be empty for sgd");
  TORCH_CHECK_VALUE(!hyper.empty() && hyper.size() % R == 0, "hyper must hold groups x ", R,
                    " float64 arrays (one per group and replica), got ", hyper.size());
  out.groups = static_cast<int>(hyper.size() / R);
  for (size_t i = 0; i < hyper.size(); ++i) {
    const Tensor& h = hyper[i];
    const size_t r = i % R;
    TORCH_CHECK_VALUE(h.scalar_type() == at::kDouble && h.dim() == 1 &&
                          h.numel() == optim::kHyper && h.is_contiguous(),
                      "hyper[", i, "] must be a contiguous float64 tensor of ",
                      int(optim::kHyper), " values");
    TORCH_CHECK_VALUE(h.device() == p[r].device(), "hyper[", i, "] is on ", h.device(),
                      " but params[", r, "] is on ", p[r].device());
  }
  TORCH_CHECK_VALUE(segments.size() % 3 == 0 && !segments.empty(),
                    "segments must be (begin, end, group) triples, got ", segments.size(),
                    " values");
  int64_t covered = 0;
  for (size_t i = 0; i < segments.size(); i += 3) {
    const int64_t b = segments[i], e = segments[i + 1], grp = segments[i + 2];
    TORCH_CHECK_VALUE(b == covered && e >= b, "segments[", i / 3, "] = (", b, ", ", e, ", ",
                      grp, ") must start where the segments before it end (", covered,
                      ") and not end before it starts");
    TORCH_CHECK_VALUE(grp >= 0 && grp < out.groups, "segments[", i / 3, "] names group ", grp,
                      " but hyper holds ", out.groups, " group(s) of ", R, " arrays");
    out.segments.push_back({b, e, static_cast<int>(grp)});
    covered = e;
  }
  TORCH_CHECK_VALUE(covered == n, "segments cover [0, ", covered, ") but the buffers have ", n,
                    " elements");
  // No two buffers of the call share memory: a gradient, a weight or a state shard that
  // aliases another would be read after it was written.
  check_disjoint({{"params", &p}, {"grads", &g}, {"state1", &s1}, {"state2", &s2},
                  {"state3", &s3}});
  if (at::GradMode::is_enabled()) {
    for (int r = 0; r < R; ++r) {
      TORCH_CHECK(!p[r].requires_grad(), "params[", r, "] requires grad: call reduce_update_ "
                  "under torch.no_grad(), as an optimizer's step() does");
    }
  }
  return out;
}

// reduce_update_'s clipping arguments: max_norm finite and >= 0 (torch's clip_grad_norm_ with
// max_norm 0 zeroes the gradient); norm (given only with max_norm) one element of the params'
// dtype on params[0]'s device, sharing memory with no other argument (it is written before the
// update reads them).
void check_clip_args(const std::vector<Tensor>& p, const std::vector<Tensor>& g,
                     const std::vector<Tensor>& s1, const std::vector<Tensor>& s2,
                     const std::vector<Tensor>& s3, const std::vector<Tensor>& h,
                     const c10::optional<double>& max_norm, const c10::optional<Tensor>& norm) {
  if (max_norm.has_value()) {
    TORCH_CHECK_VALUE(std::isfinite(*max_norm) && *max_norm >= 0.0,
                      "max_norm must be a finite number >= 0, got ", *max_norm);
  }
  if (!norm.has_value()) return;
  TORCH_CHECK_VALUE(max_norm.has_value(), "norm is written only when max_norm is given");
  const Tensor& t = *norm;
  TORCH_CHECK_VALUE(t.numel() == 1 && t.is_contiguous(), "norm must be a one-element tensor, "
                    "got shape ", t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == p[0].scalar_type(), "norm has dtype ", t.scalar_type(),
                   ", expected the params' ", p[0].scalar_type());
  TORCH_CHECK_VALUE(t.device() == p[0].device(), "norm is on ", t.device(),
                    " but params[0] is on ", p[0].device());
  // (norm against each other argument only: the groups' hyper arrays may repeat one tensor)
  for (const auto& [name, list] : std::vector<std::pair<const char*, const std::vector<Tensor>*>>{
           {"params", &p}, {"grads", &g}, {"state1", &s1}, {"state2", &s2}, {"state3", &s3},
           {"hyper", &h}}) {
    for (size_t i = 0; i < list->size(); ++i) {
      TORCH_CHECK_VALUE(!overlap(t, (*list)[i]), "norm and ", name, "[", i, "] share memory");
    }
  }
}

template <typename H>
void round_to(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(static_cast<H>(x[i]));
}

// reduce_update_'s step records (status, scaled_by, loss_out: as reduce_sgd_'s), checked.
std::vector<Tensor> check_update_records(const c10::optional<at::TensorList>& status,
                                         const std::vector<Tensor>& p,
                                         const std::vector<Tensor>& g,
                                         const std::vector<Tensor>& s1,
                                         const std::vector<Tensor>& s2,
                                         const std::vector<Tensor>& s3,
                                         const std::vector<Tensor>& h, double scaled_by,
                                         const c10::optional<Tensor>& loss_out,
                                         const c10::optional<Tensor>& norm) {
  std::vector<Tensor> records = status.has_value() ? status->vec() : std::vector<Tensor>();
  const std::vector<Tensor> n = norm.has_value() ? std::vector<Tensor>{*norm} : std::vector<Tensor>();
  check_status_records(records, p, g,
                       {{"state1", &s1}, {"state2", &s2}, {"state3", &s3}, {"hyper", &h},
                        {"norm", &n}},
                       scaled_by, loss_out);
  return records;
}

void reduce_update_cpu(at::TensorList params, at::TensorList grads, at::TensorList state1,
                       at::TensorList state2, at::TensorList state3, at::TensorList hyper,
                       at::IntArrayRef segments, c10::string_view optimizer, bool mean,
                       c10::string_view algorithm, bool gather, c10::optional<double> max_norm,
                       const c10::optional<Tensor>& norm, c10::optional<at::TensorList> status,
                       double scaled_by, const c10::optional<Tensor>& loss_out) {
  const std::vector<Tensor> p = params.vec(), g = grads.vec(), s1 = state1.vec(),
                            s2 = state2.vec(), s3 = state3.vec(), h = hyper.vec();
  const UpdateArgs a = check_update_args(p, g, s1, s2, s3, h, segments, optimizer);
  check_clip_args(p, g, s1, s2, s3, h, max_norm, norm);
  const std::vector<Tensor> records =
      check_update_records(status, p, g, s1, s2, s3, h, scaled_by, loss_out, norm);
  (void)parse_algorithm(algorithm, p[0].nbytes(), p.size(), true);  // checked before any write
  if (!is_half_type(p[0])) check_cpu_dtype(p[0], "params");
  const HostVerdict v = read_records(records, scaled_by);
  if (loss_out.has_value() && loss_out->defined()) loss_out->fill_(v.loss);
  if (v.skip) {
    // a NaN/Inf gradient or a bad label: no update; the norm of a skipped step is NaN
    if (norm.has_value()) norm->fill_(std::nan(""));
    return;
  }
  const int R = static_cast<int>(p.size());
  const int64_t n = p[0].numel();
  std::vector<const double*> hp;
  for (int grp = 0; grp < a.groups; ++grp) hp.push_back(h[grp * R].data_ptr<double>());
  // The records' fix (scaled_by): the reduced gradient, rounded to the buffer type, times fix,
  // rounded again (in float for the half types), as the CUDA kernels apply it.
  auto apply_fix = [&](const Tensor& reduced) {
    if (v.fix == 1.0) return;
    if (is_half_type(reduced)) {
      reduced.copy_(reduced.to(at::kFloat).mul_(v.fix));
    } else {
      reduced.mul_(v.fix);
    }
  };
  if (is_half_type(p[0])) {
    // bfloat16/half: the gradients all-reduced as all_reduce_ does it (float accumulation, one
    // rounding), then the update in float on float copies of replica 0's weights and the whole
    // state (one shard: the float buffers' split differs from the half ones'), each stored
    // value rounded once, as the CUDA kernels compute it.
    all_reduce_cpu(g, mean ? "mean" : "sum", algorithm);
    apply_fix(g[0]);
    auto whole = [](const std::vector<Tensor>& s) {
      return s.empty() ? std::vector<Tensor>() : std::vector<Tensor>{at::cat(s).to(at::kFloat)};
    };
    std::vector<Tensor> fp{p[0].to(at::kFloat)}, fg{g[0].to(at::kFloat)}, f1 = whole(s1),
                        f2 = whole(s2), f3 = whole(s3);
    auto ptr = [](std::vector<Tensor>& s) { return s.empty() ? nullptr : s[0].data_ptr<float>(); };
    float* a1 = ptr(f1);
    float* a2 = ptr(f2);
    float* a3 = ptr(f3);
    float* pp = fp[0].data_ptr<float>();
    float* gp = fg[0].data_ptr<float>();
    // Clipping: the norm's chunks follow the half buffers' split (as the CUDA kernels take
    // them), and the clipped gradient is rounded to the half type, as they store it.
    float norm_value = 0.0f;
    cpu::Clip<float> clip{max_norm.value_or(0.0), &norm_value, R,
                          static_cast<int64_t>(16 / p[0].element_size()),
                          p[0].scalar_type() == at::kHalf ? &round_to<at::Half>
                                                          : &round_to<at::BFloat16>};
    cpu::reduce_update<float>(&pp, &gp, {f1.empty() ? nullptr : &a1, f2.empty() ? nullptr : &a2,
                                         f3.empty() ? nullptr : &a3},
                              1, n, false, true, Algorithm::kTwoShot, a.kind, a.segments.data(),
                              static_cast<int>(a.segments.size()), hp.data(), nullptr,
                              torch_threads(), true, max_norm.has_value() ? &clip : nullptr);
    if (norm.has_value()) norm->fill_(norm_value);
    for (int r = 0; r < (gather ? R : 1); ++r) p[r].copy_(fp[0]);
    auto split_back = [&](const std::vector<Tensor>& s, const std::vector<Tensor>& f) {
      int64_t at = 0;
      for (const Tensor& shard : s) {
        shard.copy_(f[0].narrow(0, at, shard.numel()));
        at += shard.numel();
      }
    };
    if (!s1.empty()) split_back(s1, f1);
    if (!s2.empty()) split_back(s2, f2);
    if (!s3.empty()) split_back(s3, f3);
    return;
  }
  const Algorithm algo = parse_algorithm(algorithm, p[0].nbytes(), R, true);
  // With a fix the gradients are reduced first (every replica's buffer holds the sum), the fix
  // applied to replica 0's, and each shard updated from it.
  const bool reduced = v.fix != 1.0;
  if (reduced) {
    all_reduce_cpu(g, mean ? "mean" : "sum", algorithm);
    apply_fix(g[0]);
  }
  const Tensor scratch = cpu_scratch(algo, g);
  AT_DISPATCH_FLOATING_TYPES(p[0].scalar_type(), "reduce_update_cpu", [&] {
    std::vector<scalar_t*> a1 = pointers<scalar_t>(s1), a2 = pointers<scalar_t>(s2),
                           a3 = pointers<scalar_t>(s3);
    cpu::Clip<scalar_t> clip{max_norm.value_or(0.0),
                             norm.has_value() ? norm->data_ptr<scalar_t>() : nullptr};
    cpu::reduce_update<scalar_t>(pointers<scalar_t>(p).data(), pointers<scalar_t>(g).data(),
                                 {a1.empty() ? nullptr : a1.data(),
                                  a2.empty() ? nullptr : a2.data(),
                                  a3.empty() ? nullptr : a3.data()},
                                 R, n, mean && !reduced, reduced, algo, a.kind,
                                 a.segments.data(), static_cast<int>(a.segments.size()),
                                 hp.data(), scratch.data_ptr<scalar_t>(), torch_threads(), gather,
                                 max_norm.has_value() ? &clip : nullptr);
  });
}

// ---------------------------------------------------------------------------------------------
// CUDA

#ifdef DPCUDA_WITH_CUDA

// Whether kernels on `device` may read `peer`'s memory. Peer access is enabled through torch's
// allocator (at::cuda::get_p2p_access), which also maps its own segments for the peer, as
// expandable segments and cudaMallocAsync need; any failure (more than 8 peers, say) means
// staged copies instead. DPCUDA_P2P=0 forces staging where peer access is reported but broken.
bool peer_readable(int device, int peer) {
  if (device == peer) return true;
  static const bool disabled = [] {
    const char* v = std::getenv("DPCUDA_P2P");
    return v != nullptr && std::string(v) == "0";
  }();
  if (disabled) return false;
  // torch caches a pair as accessible before it enables it: a pair whose enabling failed once
  // would be reported accessible on every later call, so the failures are remembered here.
  static std::mutex mutex;
  static std::set<std::pair<int, int>> refused;
  const std::lock_guard<std::mutex> lock(mutex);
  if (refused.count({device, peer})) return false;
  try {
    return at::cuda::get_p2p_access(static_cast<c10::DeviceIndex>(device),
                                    static_cast<c10::DeviceIndex>(peer));
  } catch (const c10::Error&) {
    (void)cudaGetLastError();  // no sticky error left for the next launch to misreport
    refused.insert({device, peer});
    return false;
  }
}

// The schedule's view of a call: each device's current stream, which device may read which, and
// the scratch it needs, allocated on each device from the caching allocator (on that device's
// current stream, which is the stream the schedule uses there).
struct CudaCall {
  cuda::AllReducePlan plan;
  std::vector<Tensor> scratch;
  std::vector<void*> scratch_ptrs;

  CudaCall(const std::vector<Tensor>& ts, Algorithm algo) {
    std::vector<int> device;
    int max_device = 0;
    for (const Tensor& t : ts) {
      device.push_back(t.get_device());
      max_device = std::max(max_device, device.back());
    }
    const size_t slots = static_cast<size_t>(max_device) + 1;
    std::vector<cudaStream_t> stream(slots, nullptr);
    std::vector<std::vector<bool>> readable(slots, std::vector<bool>(slots, false));
    for (int d : device) {
      stream[d] = at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(d)).stream();
      for (int e : device) readable[d][e] = peer_readable(d, e);
    }
    plan = cuda::plan_all_reduce(device, stream, readable, algo, ts[0].numel(),
                                 static_cast<size_t>(ts[0].element_size()));
    scratch.resize(slots);
    scratch_ptrs.assign(slots, nullptr);
    for (size_t d = 0; d < slots; ++d) {
      if (plan.scratch_bytes[d] == 0) continue;
      scratch[d] = at::empty({static_cast<int64_t>(plan.scratch_bytes[d])},
                             ts[0].options().dtype(at::kByte).device(
                                 at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(d))));
      scratch_ptrs[d] = scratch[d].data_ptr();
    }
  }
};

template <typename T>
using CT = typename CudaType<T>::type;

template <typename T>
cuda::ScheduleReplicas<CT<T>> replicas_of(const std::vector<Tensor>& ts) {
  cuda::ScheduleReplicas<CT<T>> r;
  for (const Tensor& t : ts) {
    r.data.push_back(reinterpret_cast<CT<T>*>(t.data_ptr<T>()));
    r.device.push_back(t.get_device());
  }
  return r;
}

void all_reduce_cuda(at::TensorList tensors, c10::string_view op, c10::string_view algorithm) {
  const std::vector<Tensor> ts = tensors.vec();
  check_replicas(ts, "tensors", nullptr);
  check_cuda_dtype(ts[0], "tensors");
  const bool mean = parse_mean(op);
  const Algorithm algo = parse_algorithm(algorithm, ts[0].nbytes(), ts.size(), false);
  const c10::cuda::CUDAGuard guard(ts[0].device());
  for (const Tensor& t : ts) check_kernel_image(t.device().index());
  const CudaCall call(ts, algo);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, ts[0].scalar_type(),
                                  "all_reduce_cuda", [&] {
    check_cuda(cuda::all_reduce<CT<scalar_t>>(call.plan, replicas_of<scalar_t>(ts),
                                              call.scratch_ptrs, mean),
               "all_reduce");
  });
}

void reduce_sgd_cuda(at::TensorList params, at::TensorList grads,
                     at::TensorList momentum_buffers, double lr, double momentum,
                     double weight_decay, bool mean, c10::string_view algorithm,
                     c10::optional<at::TensorList> status, double scaled_by,
                     const c10::optional<Tensor>& loss_out) {
  const std::vector<Tensor> p = params.vec(), g = grads.vec();
  const std::vector<Tensor> m = momentum != 0.0 ? momentum_buffers.vec() : std::vector<Tensor>();
  const std::vector<Tensor> st = status.has_value() ? status->vec() : std::vector<Tensor>();
  check_sgd_args(p, g, m, lr, momentum, weight_decay);
  check_status_records(st, p, g, {{"momentum_buffers", &m}}, scaled_by, loss_out);
  double* loss_ptr = loss_out.has_value() && loss_out->defined()
                         ? loss_out->data_ptr<double>()
                         : nullptr;
  std::vector<const double*> records;
  for (const Tensor& s : st) records.push_back(s.data_ptr<double>());
  check_cuda_dtype(p[0], "params");
  const Algorithm algo = parse_algorithm(algorithm, p[0].nbytes(), p.size(), false);
  const cuda::SgdArgs sgd{lr, momentum, weight_decay};
  const c10::cuda::CUDAGuard guard(p[0].device());
  for (const Tensor& t : p) check_kernel_image(t.device().index());
  const CudaCall call(g, algo);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p[0].scalar_type(),
                                  "reduce_sgd_cuda", [&] {
    check_cuda(cuda::reduce_sgd<CT<scalar_t>>(call.plan, replicas_of<scalar_t>(g),
                                              replicas_of<scalar_t>(p).data,
                                              replicas_of<scalar_t>(m).data, sgd, mean,
                                              call.scratch_ptrs, records, scaled_by, loss_ptr),
               "reduce_sgd");
  });
}

void reduce_update_cuda(at::TensorList params, at::TensorList grads, at::TensorList state1,
                        at::TensorList state2, at::TensorList state3, at::TensorList hyper,
                        at::IntArrayRef segments, c10::string_view optimizer, bool mean,
                        c10::string_view algorithm, bool gather, c10::optional<double> max_norm,
                        const c10::optional<Tensor>& norm, c10::optional<at::TensorList> status,
                        double scaled_by, const c10::optional<Tensor>& loss_out) {
  const std::vector<Tensor> p = params.vec(), g = grads.vec(), s1 = state1.vec(),
                            s2 = state2.vec(), s3 = state3.vec(), h = hyper.vec();
  const UpdateArgs a = check_update_args(p, g, s1, s2, s3, h, segments, optimizer);
  check_clip_args(p, g, s1, s2, s3, h, max_norm, norm);
  const std::vector<Tensor> st =
      check_update_records(status, p, g, s1, s2, s3, h, scaled_by, loss_out, norm);
  std::vector<const double*> records;
  for (const Tensor& x : st) records.push_back(x.data_ptr<double>());
  double* loss_ptr = loss_out.has_value() && loss_out->defined()
                         ? loss_out->data_ptr<double>()
                         : nullptr;
  check_cuda_dtype(p[0], "params");
  const size_t R = p.size();
  for (size_t r = 1; r < R && !gather; ++r) {
    TORCH_CHECK_VALUE(p[r].device() == p[0].device(), "gather=False needs every replica on one "
                      "device, but params[", r, "] is on ", p[r].device(), " and params[0] on ",
                      p[0].device());
  }
  const Algorithm algo = parse_algorithm(algorithm, p[0].nbytes(), R, false);
  const c10::cuda::CUDAGuard guard(p[0].device());
  for (const Tensor& t : p) check_kernel_image(t.device().index());
  const CudaCall call(g, algo);
  std::vector<std::vector<const double*>> hp(R);
  for (size_t r = 0; r < R; ++r) {
    for (int grp = 0; grp < a.groups; ++grp) hp[r].push_back(h[grp * R + r].data_ptr<double>());
  }
  std::vector<cuda::UpdateSegment> seg;
  for (const cpu::UpdateSegment& x : a.segments) seg.push_back({x.begin, x.end, x.group});
  // Clipping's workspace on every device of the call (on its current stream, as the scratch).
  std::vector<Tensor> workspace;
  std::vector<void*> workspace_ptrs(call.scratch_ptrs.size(), nullptr);
  if (max_norm.has_value()) {
    const int64_t bytes = static_cast<int64_t>(cuda::clip_workspace_bytes(call.plan));
    for (int d : call.plan.devices) {
      workspace.push_back(at::empty({bytes}, p[0].options().dtype(at::kByte).device(
                                                 at::Device(at::kCUDA,
                                                            static_cast<c10::DeviceIndex>(d)))));
      workspace_ptrs[d] = workspace.back().data_ptr();
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p[0].scalar_type(),
                                  "reduce_update_cuda", [&] {
    cuda::ClipArgs<CT<scalar_t>> clip;
    clip.max_norm = max_norm.value_or(0.0);
    clip.workspace = workspace_ptrs;
    clip.norm_out = norm.has_value()
                        ? reinterpret_cast<CT<scalar_t>*>(norm->data_ptr<scalar_t>())
                        : nullptr;
    cuda::UpdateState<CT<scalar_t>> state{replicas_of<scalar_t>(s1).data,
                                          replicas_of<scalar_t>(s2).data,
                                          replicas_of<scalar_t>(s3).data};
    check_cuda(cuda::reduce_update<CT<scalar_t>>(call.plan, replicas_of<scalar_t>(g),
                                                 replicas_of<scalar_t>(p).data, state, a.kind,
                                                 seg, hp, mean, call.scratch_ptrs, gather,
                                                 max_norm.has_value() ? &clip : nullptr,
                                                 records, scaled_by, loss_ptr),
               "reduce_update");
  });
}

#endif  // DPCUDA_WITH_CUDA

// step_status: what a step checks before its update, as float64 [loss (the sum of its
// elements: a replica's per-row losses, or their sum), 1 if grad holds a NaN or an Inf else 0,
// the bad-label flag, the labels that are not ignore_index] on grad's device; the flag set back
// to 0 if clear_flag.
void check_status_args(const Tensor& grad, const Tensor& loss,
                       const c10::optional<Tensor>& label_flag,
                       const c10::optional<Tensor>& labels) {
  TORCH_CHECK_VALUE(grad.dim() == 1 && grad.is_contiguous(),
                    "grad must be a contiguous 1-D tensor, got shape ", grad.sizes());
  const auto dt = grad.scalar_type();
  TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kDouble || dt == at::kHalf ||
                        dt == at::kBFloat16,
                    "grad must be float32, float64, float16 or bfloat16, got ", dt);
  TORCH_CHECK_VALUE(at::isFloatingType(loss.scalar_type()),
                    "loss must be floating point, got ", loss.scalar_type());
  check_same_device(loss, "loss", grad, "grad");
  if (label_flag.has_value() && label_flag->defined()) {
    TORCH_CHECK_VALUE(label_flag->scalar_type() == at::kInt && label_flag->numel() == 1,
                      "label_flag must be one int32, got ", label_flag->scalar_type(), " of ",
                      label_flag->numel(), " elements");
    check_same_device(*label_flag, "label_flag", grad, "grad");
  }
  if (labels.has_value() && labels->defined()) {
    TORCH_CHECK_VALUE(labels->scalar_type() == at::kLong, "labels must be int64 class indices, ",
                      "got ", labels->scalar_type());
    check_same_device(*labels, "labels", grad, "grad");
  }
}

Tensor step_status_cpu(const Tensor& grad, const Tensor& loss,
                       const c10::optional<Tensor>& label_flag, Tensor& workspace,
                       bool clear_flag, const c10::optional<Tensor>& labels,
                       int64_t ignore_index) {
  check_status_args(grad, loss, label_flag, labels);
  // The CPU uses none of it, but takes what CUDA takes.
  TORCH_CHECK_VALUE(workspace.scalar_type() == at::kInt, "workspace must be int32, got ",
                    workspace.scalar_type());
  Tensor out = at::empty({kRecord}, grad.options().dtype(at::kDouble));
  double* o = out.data_ptr<double>();
  o[0] = loss.to(at::kDouble).sum().item<double>();
  // A sum is finite when every element is (a NaN or an Inf carries through every addition);
  // only a sum that is not, which finite elements can also give by overflowing, pays for the
  // exact test (one pass, not two and a mask: 14 us against 290 for 203,530 floats here).
  const bool half = grad.scalar_type() == at::kHalf || grad.scalar_type() == at::kBFloat16;
  const double sum = (half ? grad.sum(at::kFloat) : grad.sum()).item<double>();
  o[1] = !std::isfinite(sum) && !at::isfinite(grad).all().item<bool>() ? 1.0 : 0.0;
  const bool has_flag = label_flag.has_value() && label_flag->defined();
  o[2] = has_flag ? static_cast<double>(label_flag->item<int>()) : 0.0;
  if (has_flag && clear_flag) label_flag->zero_();
  o[3] = labels.has_value() && labels->defined()
             ? static_cast<double>(labels->ne(ignore_index).sum().item<int64_t>())
             : 0.0;
  return out;
}

#ifdef DPCUDA_WITH_CUDA
static_assert(kRecord == cuda::kRecord, "one record layout for the CPU and CUDA");

Tensor step_status_cuda(const Tensor& grad, const Tensor& loss,
                        const c10::optional<Tensor>& label_flag, Tensor& workspace,
                        bool clear_flag, const c10::optional<Tensor>& labels,
                        int64_t ignore_index) {
  check_status_args(grad, loss, label_flag, labels);
  check_cuda_dtype(grad, "grad");
  TORCH_CHECK_VALUE(workspace.scalar_type() == at::kInt && workspace.is_contiguous() &&
                        workspace.numel() >= cuda::step_status_workspace(),
                    "workspace must be a contiguous int32 tensor of at least ",
                    cuda::step_status_workspace(), " elements (zeros when first used)");
  check_same_device(workspace, "workspace", grad, "grad");
  const c10::cuda::CUDAGuard guard(grad.device());
  check_kernel_image(grad.device().index());
  // float and double losses are read as they are; a half one is widened first (one launch).
  // An empty loss sums to 0, as on the CPU: one zero (a null pointer would say "no loss").
  const Tensor l =
      loss.numel() == 0
          ? at::zeros({1}, loss.options().dtype(loss.scalar_type() == at::kDouble ? at::kDouble
                                                                                  : at::kFloat))
          : (loss.scalar_type() == at::kDouble ? loss : loss.to(at::kFloat)).contiguous();
  Tensor out = at::empty({kRecord}, grad.options().dtype(at::kDouble));
  const bool has_labels = labels.has_value() && labels->defined();
  const Tensor y = has_labels ? labels->contiguous() : Tensor();
  const int64_t* y_ptr = has_labels ? y.data_ptr<int64_t>() : nullptr;
  const int64_t y_n = has_labels ? y.numel() : 0;
  int* flag = label_flag.has_value() && label_flag->defined() ? label_flag->data_ptr<int>()
                                                              : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(),
                                  "step_status_cuda", [&] {
    const auto* g = reinterpret_cast<const CT<scalar_t>*>(grad.data_ptr<scalar_t>());
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    const cudaError_t err =
        l.scalar_type() == at::kDouble
            ? cuda::step_status<CT<scalar_t>, double>(g, grad.numel(), l.data_ptr<double>(),
                                                      l.numel(), y_ptr, y_n, ignore_index,
                                                      flag, clear_flag,
                                                      workspace.data_ptr<int>(),
                                                      out.data_ptr<double>(), stream)
            : cuda::step_status<CT<scalar_t>, float>(g, grad.numel(), l.data_ptr<float>(),
                                                     l.numel(), y_ptr, y_n, ignore_index,
                                                     flag, clear_flag,
                                                     workspace.data_ptr<int>(),
                                                     out.data_ptr<double>(), stream);
    check_cuda(err, "step_status launch");
  });
  return out;
}
#endif  // DPCUDA_WITH_CUDA

}  // namespace

int64_t step_status_workspace_ints() {
#ifdef DPCUDA_WITH_CUDA
  return cuda::step_status_workspace();
#else
  return 0;
#endif
}

TORCH_LIBRARY_IMPL(dpcuda, CPU, m) {
  m.impl("all_reduce_", &all_reduce_cpu);
  m.impl("reduce_sgd_", &reduce_sgd_cpu);
  m.impl("reduce_update_", &reduce_update_cpu);
  m.impl("step_status", &step_status_cpu);
}

#ifdef DPCUDA_WITH_CUDA
TORCH_LIBRARY_IMPL(dpcuda, CUDA, m) {
  m.impl("all_reduce_", &all_reduce_cuda);
  m.impl("reduce_sgd_", &reduce_sgd_cuda);
  m.impl("reduce_update_", &reduce_update_cuda);
  m.impl("step_status", &step_status_cuda);
}
#endif

}  // namespace dpcuda
