// ATen adapter of dpcuda's optimizer update (dpcuda::optim_update_) and of the fused update's
// bookkeeping on the device (dpcuda::update_hyper_, dpcuda::update_counts_: csrc/kernels/optim/
// counts.h): argument checks, dtype dispatch and the pointers. The element formulas are
// csrc/kernels/optim/update.h, shared by the CPU loops (csrc/cpu/optim.h, threads over pieces of
// every tensor) and the CUDA kernel (csrc/kernels/optim: one launch per kOptimMaxTensors
// tensors, on the current stream), so both give the same bits. The hyperparameters are a
// float64 tensor of optim::kHyper values on the tensors' device, which the kernels read:
// dpcuda/optim.py writes it before each update.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "../cpu/optim.h"
#include "checks.h"

#ifdef DPCUDA_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "../kernels/optim/optim.h"
#include "cuda_types.h"
#include "kernel_image.h"
#endif

namespace dpcuda {
namespace {

using at::Tensor;

optim::Kind parse_optimizer(c10::string_view name) {
  if (name == "sgd") return optim::Kind::kSgd;
  TORCH_CHECK_VALUE(name == "adam", "optimizer must be sgd or adam (adamw is adam with the ",
                    "decoupled flag); got '", std::string(name), "'");
  return optim::Kind::kAdam;
}

// The state lists the optimizer takes: SGD state1 (momentum buffers) or none; Adam state1
// (exp_avg) and state2 (exp_avg_sq), and state3 (max_exp_avg_sq) or none.
struct Lists {
  std::vector<Tensor> params, grads, state1, state2, state3;
};

void check_list(const std::vector<Tensor>& ts, const char* name, const Lists& l, bool used) {
  if (!used) {
    TORCH_CHECK_VALUE(ts.empty(), name, " must be empty for this optimizer, got ", ts.size(),
                      " tensors");
    return;
  }
  TORCH_CHECK_VALUE(ts.size() == l.params.size(), name, " holds ", ts.size(),
                    " tensors but params holds ", l.params.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    const Tensor& t = ts[i];
    const Tensor& p = l.params[i];
    TORCH_CHECK_TYPE(t.scalar_type() == p.scalar_type(), name, "[", i, "] has dtype ",
                     t.scalar_type(), " but params[", i, "] has ", p.scalar_type());
    TORCH_CHECK_VALUE(t.sizes() == p.sizes(), name, "[", i, "] has shape ", t.sizes(),
                      " but params[", i, "] has ", p.sizes());
    TORCH_CHECK_VALUE(t.device() == p.device(), name, "[", i, "] is on ", t.device(),
                      " but params[", i, "] is on ", p.device());
    TORCH_CHECK_VALUE(t.is_contiguous(), name, "[", i, "] must be contiguous");
    TORCH_CHECK_VALUE(!t.is_same(p), name, "[", i, "] is params[", i, "] itself");
  }
}

Lists check_args(at::TensorList params, at::TensorList grads, at::TensorList state1,
                 at::TensorList state2, at::TensorList state3, const Tensor& hyper,
                 optim::Kind kind) {
  Lists l{params.vec(), grads.vec(), state1.vec(), state2.vec(), state3.vec()};
  TORCH_CHECK_VALUE(!l.params.empty(), "params must hold at least one tensor");
  const Tensor& p0 = l.params[0];
  for (size_t i = 0; i < l.params.size(); ++i) {
    const Tensor& p = l.params[i];
    TORCH_CHECK_TYPE(p.scalar_type() == p0.scalar_type(), "params[", i, "] has dtype ",
                     p.scalar_type(), " but params[0] has ", p0.scalar_type());
    TORCH_CHECK_VALUE(p.device() == p0.device(), "params[", i, "] is on ", p.device(),
                      " but params[0] is on ", p0.device(), "; one call updates one device");
    TORCH_CHECK_VALUE(p.is_contiguous(), "params[", i, "] must be contiguous");
  }
  check_list(l.grads, "grads", l, true);
  const bool adam = kind == optim::Kind::kAdam;
  check_list(l.state1, "state1", l, adam || !l.state1.empty());
  check_list(l.state2, "state2", l, adam);
  check_list(l.state3, "state3", l, adam && !l.state3.empty());
  TORCH_CHECK_VALUE(hyper.scalar_type() == at::kDouble && hyper.dim() == 1 &&
                        hyper.numel() == optim::kHyper && hyper.is_contiguous(),
                    "hyper must be a contiguous float64 tensor of ", int(optim::kHyper),
                    " values, got ", hyper.scalar_type(), " of shape ", hyper.sizes());
  TORCH_CHECK_VALUE(hyper.device() == p0.device(), "hyper is on ", hyper.device(),
                    " but params are on ", p0.device());
  // Every buffer the update reads or writes is its own (the loops take them as __restrict__).
  check_disjoint({{"params", &l.params}, {"grads", &l.grads}, {"state1", &l.state1},
                  {"state2", &l.state2}, {"state3", &l.state3}});
  // As torch's in-place ops on a leaf that requires grad: the update runs under no_grad
  // (torch.optim's step() does).
  if (at::GradMode::is_enabled()) {
    for (size_t i = 0; i < l.params.size(); ++i) {
      TORCH_CHECK(!l.params[i].requires_grad(), "params[", i, "] requires grad: call ",
                  "optim_update_ under torch.no_grad(), as an optimizer's step() does");
    }
  }
  return l;
}

// ---------------------------------------------------------------------------------------------
// CPU

// The fewest elements a thread is handed (a smaller update runs on one thread).
constexpr int64_t kGrain = 1 << 14;

template <typename T>
T* ptr_or_null(const std::vector<Tensor>& ts, size_t i) {
  return ts.empty() ? nullptr : ts[i].template data_ptr<T>();
}

template <typename T>
void update_cpu(optim::Kind kind, const double* hyper, const Lists& l) {
  // The tensors' elements as one index space [0, total), split evenly over torch's threads
  // (whatever the tensors' sizes, each thread gets its share); each thread updates the parts
  // of the tensors its range covers.
  std::vector<int64_t> start{0};
  for (const Tensor& p : l.params) start.push_back(start.back() + p.numel());
  at::parallel_for(0, start.back(), kGrain, [&](int64_t lo, int64_t hi) {
    size_t i = std::upper_bound(start.begin(), start.end(), lo) - start.begin() - 1;
    for (; i < l.params.size() && start[i] < hi; ++i) {
      const int64_t b = std::max(lo, start[i]) - start[i];
      const int64_t e = std::min(hi, start[i + 1]) - start[i];
      if (e <= b) continue;
      const cpu::OptimTensor<T> t{l.params[i].template data_ptr<T>(),
                                  l.grads[i].template data_ptr<T>(), ptr_or_null<T>(l.state1, i),
                                  ptr_or_null<T>(l.state2, i), ptr_or_null<T>(l.state3, i)};
      cpu::optim_update<T>(kind, hyper, t, b, e);
    }
  });
}

std::vector<Tensor> as_float(const std::vector<Tensor>& ts) {
  std::vector<Tensor> f;
  for (const Tensor& t : ts) f.push_back(t.to(at::kFloat));
  return f;
}

void optim_update_cpu(at::TensorList params, at::TensorList grads, at::TensorList state1,
                      at::TensorList state2, at::TensorList state3, const Tensor& hyper,
                      c10::string_view optimizer) {
  const optim::Kind kind = parse_optimizer(optimizer);
  const Lists l = check_args(params, grads, state1, state2, state3, hyper, kind);
  const double* h = hyper.data_ptr<double>();
  if (is_half_type(l.params[0])) {
    // bfloat16/half: the float loops on float copies, each stored value rounded once, as the
    // CUDA kernel computes them in float.
    Lists f{as_float(l.params), as_float(l.grads), as_float(l.state1), as_float(l.state2),
            as_float(l.state3)};
    update_cpu<float>(kind, h, f);
    for (size_t i = 0; i < l.params.size(); ++i) l.params[i].copy_(f.params[i]);
    for (size_t i = 0; i < l.state1.size(); ++i) l.state1[i].copy_(f.state1[i]);
    for (size_t i = 0; i < l.state2.size(); ++i) l.state2[i].copy_(f.state2[i]);
    for (size_t i = 0; i < l.state3.size(); ++i) l.state3[i].copy_(f.state3[i]);
    return;
  }
  check_cpu_dtype(l.params[0], "params");
  AT_DISPATCH_FLOATING_TYPES(l.params[0].scalar_type(), "optim_update_cpu", [&] {
    update_cpu<scalar_t>(kind, h, l);
  });
}

// ---------------------------------------------------------------------------------------------
// The fused update's bookkeeping (csrc/kernels/optim/counts.h): the same checks for both
// backends, then the CPU loops or one CUDA launch.

constexpr int64_t kStatus = optim::kStatusRecord;

template <typename T>
T* data_or_null(const c10::optional<Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

int64_t numel_or_zero(const c10::optional<Tensor>& t) { return t.has_value() ? t->numel() : 0; }

void check_on(const Tensor& t, const char* name, const Tensor& ref, const char* ref_name) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), name, " is on ", t.device(), " but ", ref_name,
                    " is on ", ref.device());
}

void check_counts(const c10::optional<Tensor>& counts, const Tensor& ref, const char* ref_name) {
  if (!counts.has_value()) return;
  TORCH_CHECK_TYPE(counts->scalar_type() == at::kFloat, "counts must be float32, got ",
                   counts->scalar_type());
  TORCH_CHECK_VALUE(counts->dim() == 1 && counts->is_contiguous(),
                    "counts must be a contiguous 1-D tensor, got shape ", counts->sizes());
  check_on(*counts, "counts", ref, ref_name);
}

void check_update_hyper(const Tensor& hyper, const c10::optional<Tensor>& base,
                        const c10::optional<Tensor>& counts, const c10::optional<Tensor>& first,
                        optim::Kind kind) {
  TORCH_CHECK_TYPE(hyper.scalar_type() == at::kDouble, "hyper must be float64, got ",
                   hyper.scalar_type());
  TORCH_CHECK_VALUE(hyper.dim() == 2 && hyper.size(1) == optim::kHyper && hyper.is_contiguous(),
                    "hyper must be a contiguous (groups, ", int(optim::kHyper), ") tensor, got ",
                    "shape ", hyper.sizes());
  const int64_t groups = hyper.size(0);
  if (base.has_value()) {
    TORCH_CHECK_TYPE(base->scalar_type() == at::kDouble, "base must be float64, got ",
                     base->scalar_type());
    TORCH_CHECK_VALUE(base->sizes() == hyper.sizes() && base->is_contiguous(), "base must be ",
                      "contiguous with hyper's shape ", hyper.sizes(), ", got ", base->sizes());
    check_on(*base, "base", hyper, "hyper");
    TORCH_CHECK_VALUE(!overlap(*base, hyper), "base and hyper share memory");
  }
  check_counts(counts, hyper, "hyper");
  if (counts.has_value()) {
    TORCH_CHECK_VALUE(!overlap(*counts, hyper), "counts and hyper share memory");
  }
  if (kind == optim::Kind::kAdam) {
    TORCH_CHECK_VALUE(counts.has_value() && first.has_value(), "optimizer 'adam' needs counts ",
                      "(each parameter's step count) and first (a parameter per group)");
    TORCH_CHECK_VALUE(counts->numel() > 0 || groups == 0, "counts is empty: optimizer 'adam' ",
                      "reads each group's step count there");
    TORCH_CHECK_TYPE(first->scalar_type() == at::kLong, "first must be int64, got ",
                     first->scalar_type());
    TORCH_CHECK_VALUE(first->dim() == 1 && first->numel() == groups && first->is_contiguous(),
                      "first must be a contiguous 1-D tensor of one index per group (", groups,
                      "), got shape ", first->sizes());
    check_on(*first, "first", hyper, "hyper");
    TORCH_CHECK_VALUE(!overlap(*first, hyper), "first and hyper share memory");
  } else {
    TORCH_CHECK_VALUE(!first.has_value(), "first is Adam's; optimizer 'sgd' takes none");
    TORCH_CHECK_VALUE(!counts.has_value() || counts->numel() == groups, "counts must hold one ",
                      "flag per group (", groups, ") for optimizer 'sgd', got ",
                      counts->numel());
  }
}

using NamedWritten = std::vector<std::pair<const char*, const std::vector<Tensor>*>>;

// The records and the ring of update_counts_, checked.
void check_update_counts(const std::vector<Tensor>& status, const c10::optional<Tensor>& counts,
                         const c10::optional<Tensor>& ring, const c10::optional<Tensor>& slot) {
  TORCH_CHECK_VALUE(ring.has_value() == slot.has_value(), "ring and slot go together: got ",
                    ring.has_value() ? "a ring without a slot" : "a slot without a ring");
  const Tensor* ref = !status.empty() ? &status[0] : counts.has_value() ? &*counts
                      : ring.has_value() ? &*ring : nullptr;
  std::vector<Tensor> counts_list, ring_list, slot_list;
  for (size_t i = 0; i < status.size(); ++i) {
    const Tensor& r = status[i];
    TORCH_CHECK_VALUE(r.scalar_type() == at::kDouble && r.dim() == 1 && r.numel() == kStatus &&
                          r.is_contiguous(),
                      "status[", i, "] must be a step_status record (", kStatus, " contiguous ",
                      "float64), got ", r.scalar_type(), " of shape ", r.sizes());
    TORCH_CHECK_VALUE(r.device() == ref->device(), "status[", i, "] is on ", r.device(),
                      " but status[0] is on ", ref->device());
  }
  if (counts.has_value()) {
    check_counts(counts, *ref, status.empty() ? "counts" : "status[0]");
    counts_list.push_back(*counts);
  }
  if (ring.has_value()) {
    TORCH_CHECK_VALUE(!status.empty(), "a ring needs status records to write");
    TORCH_CHECK_TYPE(ring->scalar_type() == at::kDouble, "ring must be float64, got ",
                     ring->scalar_type());
    TORCH_CHECK_VALUE(ring->dim() == 3 && ring->size(0) > 0 &&
                          ring->size(1) == static_cast<int64_t>(status.size()) &&
                          ring->size(2) == kStatus && ring->is_contiguous(),
                      "ring must be a contiguous (slots, ", status.size(), ", ", kStatus,
                      ") tensor with at least one slot, got shape ", ring->sizes());
    TORCH_CHECK_TYPE(slot->scalar_type() == at::kLong, "slot must be int64, got ",
                     slot->scalar_type());
    TORCH_CHECK_VALUE(slot->numel() == 1, "slot must be one int64, got ", slot->numel(),
                      " elements");
    check_on(*ring, "ring", *ref, "status[0]");
    check_on(*slot, "slot", *ref, "status[0]");
    ring_list.push_back(*ring);
    slot_list.push_back(*slot);
  }
  // What the call writes is its own: it shares memory with no other tensor of the call (the
  // records, only read, may share theirs).
  check_disjoint({{"counts", &counts_list}, {"ring", &ring_list}, {"slot", &slot_list}});
  for (const auto& [name, list] : NamedWritten{{"counts", &counts_list}, {"ring", &ring_list},
                                               {"slot", &slot_list}}) {
    for (const Tensor& w : *list) {
      for (size_t i = 0; i < status.size(); ++i) {
        TORCH_CHECK_VALUE(!overlap(w, status[i]), name, " and status[", i, "] share memory; ",
                          "what the call writes must be its own");
      }
    }
  }
}

void update_hyper_cpu(const Tensor& hyper, const c10::optional<Tensor>& base,
                      const c10::optional<Tensor>& counts, const c10::optional<Tensor>& first,
                      c10::string_view optimizer) {
  const optim::Kind kind = parse_optimizer(optimizer);
  check_update_hyper(hyper, base, counts, first, kind);
  const int64_t n = numel_or_zero(counts);
  if (first.has_value()) {
    const int64_t* f = first->data_ptr<int64_t>();
    for (int64_t g = 0; g < first->numel(); ++g) {
      TORCH_CHECK_INDEX(f[g] >= 0 && f[g] < n, "first[", g, "] = ", f[g], " is not an index ",
                        "of counts (", n, " elements)");
    }
  }
  cpu::update_hyper(kind, hyper.data_ptr<double>(), hyper.size(0), data_or_null<double>(base),
                    data_or_null<float>(counts), n, data_or_null<int64_t>(first));
}

void update_counts_cpu(at::TensorList status, const c10::optional<Tensor>& counts,
                       const c10::optional<Tensor>& ring, const c10::optional<Tensor>& slot,
                       c10::string_view optimizer) {
  const optim::Kind kind = parse_optimizer(optimizer);
  const std::vector<Tensor> records = status.vec();
  check_update_counts(records, counts, ring, slot);
  std::vector<const double*> ptrs;
  for (const Tensor& r : records) ptrs.push_back(r.data_ptr<double>());
  cpu::update_counts(kind, ptrs.data(), static_cast<int>(ptrs.size()),
                     data_or_null<float>(counts), numel_or_zero(counts),
                     data_or_null<double>(ring), ring.has_value() ? ring->size(0) : 0,
                     data_or_null<int64_t>(slot));
}

// ---------------------------------------------------------------------------------------------
// CUDA

#ifdef DPCUDA_WITH_CUDA
template <typename T>
using CT = typename CudaType<T>::type;

template <typename T>
CT<T>* cuda_ptr(const std::vector<Tensor>& ts, size_t i) {
  return ts.empty() ? nullptr : reinterpret_cast<CT<T>*>(ts[i].data_ptr<T>());
}

void optim_update_cuda(at::TensorList params, at::TensorList grads, at::TensorList state1,
                       at::TensorList state2, at::TensorList state3, const Tensor& hyper,
                       c10::string_view optimizer) {
  const optim::Kind kind = parse_optimizer(optimizer);
  const Lists l = check_args(params, grads, state1, state2, state3, hyper, kind);
  check_cuda_dtype(l.params[0], "params");
  const c10::cuda::CUDAGuard guard(l.params[0].device());
  check_kernel_image(l.params[0].device().index());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, l.params[0].scalar_type(),
                                  "optim_update_cuda", [&] {
    // One launch per kOptimMaxTensors tensors, in order, on one stream.
    for (size_t start = 0; start < l.params.size(); start += cuda::kOptimMaxTensors) {
      cuda::OptimTable<CT<scalar_t>> table{};
      const size_t stop = std::min(l.params.size(), start + cuda::kOptimMaxTensors);
      for (size_t i = start; i < stop; ++i) {
        const int k = static_cast<int>(i - start);
        table.param[k] = cuda_ptr<scalar_t>(l.params, i);
        table.grad[k] = cuda_ptr<scalar_t>(l.grads, i);
        table.state1[k] = cuda_ptr<scalar_t>(l.state1, i);
        table.state2[k] = cuda_ptr<scalar_t>(l.state2, i);
        table.state3[k] = cuda_ptr<scalar_t>(l.state3, i);
        table.n[k] = l.params[i].numel();
      }
      table.count = static_cast<int>(stop - start);
      check_cuda(cuda::optim_update<CT<scalar_t>>(kind, hyper.data_ptr<double>(), table, stream),
                 "optim_update");
    }
  });
}

void update_hyper_cuda(const Tensor& hyper, const c10::optional<Tensor>& base,
                       const c10::optional<Tensor>& counts, const c10::optional<Tensor>& first,
                       c10::string_view optimizer) {
  const optim::Kind kind = parse_optimizer(optimizer);
  check_update_hyper(hyper, base, counts, first, kind);
  const c10::cuda::CUDAGuard guard(hyper.device());
  check_kernel_image(hyper.device().index());
  // (first's values are not read here: an index outside counts makes the kernel write a NaN
  // step, so the update writes NaN)
  check_cuda(cuda::update_hyper(kind, hyper.data_ptr<double>(), hyper.size(0),
                                data_or_null<double>(base), data_or_null<float>(counts),
                                numel_or_zero(counts), data_or_null<int64_t>(first),
                                at::cuda::getCurrentCUDAStream()),
             "update_hyper");
}

void update_counts_cuda(at::TensorList status, const c10::optional<Tensor>& counts,
                        const c10::optional<Tensor>& ring, const c10::optional<Tensor>& slot,
                        c10::string_view optimizer) {
  const optim::Kind kind = parse_optimizer(optimizer);
  const std::vector<Tensor> records = status.vec();
  check_update_counts(records, counts, ring, slot);
  TORCH_CHECK_VALUE(static_cast<int64_t>(records.size()) <= cuda::kMaxReplicas, "status holds ",
                    records.size(), " records; a CUDA device takes at most ", cuda::kMaxReplicas,
                    " (one per replica)");
  if (records.empty() && !counts.has_value()) return;  // (nothing to write: no ring either)
  const Tensor& ref = !records.empty() ? records[0] : *counts;
  const c10::cuda::CUDAGuard guard(ref.device());
  check_kernel_image(ref.device().index());
  cuda::CountRecords r{};
  r.n = static_cast<int>(records.size());
  for (size_t i = 0; i < records.size(); ++i) r.ptr[i] = records[i].data_ptr<double>();
  check_cuda(cuda::update_counts(kind, r, data_or_null<float>(counts), numel_or_zero(counts),
                                 data_or_null<double>(ring), ring.has_value() ? ring->size(0) : 0,
                                 data_or_null<int64_t>(slot), at::cuda::getCurrentCUDAStream()),
             "update_counts");
}
#endif  // DPCUDA_WITH_CUDA

}  // namespace

TORCH_LIBRARY_IMPL(dpcuda, CPU, m) {
  m.impl("optim_update_", &optim_update_cpu);
  m.impl("update_hyper_", &update_hyper_cpu);
  m.impl("update_counts_", &update_counts_cpu);
}

#ifdef DPCUDA_WITH_CUDA
TORCH_LIBRARY_IMPL(dpcuda, CUDA, m) {
  m.impl("optim_update_", &optim_update_cuda);
  m.impl("update_hyper_", &update_hyper_cuda);
  m.impl("update_counts_", &update_counts_cuda);
}
#endif

}  // namespace dpcuda
