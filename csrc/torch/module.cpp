// The op schemas, declared once, and the Python module dpcuda._C: capability queries and an
// eager fast path into the same ops. Every tensor operation is a torch.ops.dpcuda op so that
// torch.compile sees it; the fast path only enters the dispatcher from C++, skipping the ~6 us
// of Python that a torch.ops call costs (measured on the CPU machines), and dpcuda/ops.py uses
// it only outside torch.compile tracing.
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <atomic>

#include "dispatch.h"
#include "label_errors.h"
#include "model_walk.h"
#include "unchanged.h"
#ifdef DPCUDA_WITH_CUDA
#include "cublaslt.h"
#include "kernel_image.h"
#endif

TORCH_LIBRARY(dpcuda, m) {
  // act(input @ weight.T + bias). Returns (output, pre_activation); the second is empty unless
  // the activation's derivative needs the pre-activation (gelu, gelu_tanh, silu).
  m.def("full_forward(Tensor input, Tensor weight, Tensor? bias, str activation)"
        " -> (Tensor, Tensor)");
  // Gradients of full_forward. `saved` is the forward's output for relu, sigmoid and tanh, its
  // pre-activation for gelu, gelu_tanh and silu, and unused for none. output_mask selects
  // (grad_input, grad_weight, grad_bias); unselected outputs are empty.
  m.def("full_backward(Tensor grad_output, Tensor input, Tensor weight, Tensor saved,"
        " str activation, bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  // full_backward writing grad_weight and grad_bias into the caller's tensors (a gradient
  // buffer's views) instead of new ones; returns grad_input. An output the mask leaves out is
  // not written (pass an empty tensor). Used by the autograd node of full_forward when the
  // forward was given destinations (dpcuda._C.full_forward_into).
  m.def("full_backward_into(Tensor grad_output, Tensor input, Tensor weight, Tensor saved,"
        " str activation, bool[3] output_mask, Tensor(a!) grad_weight, Tensor(b!) grad_bias)"
        " -> Tensor");
  // Softmax cross-entropy: per-row loss and, when compute_grad, d loss / d logits, both
  // multiplied by scale. Rows labelled ignore_index count zero.
  m.def("loss_grad(Tensor logits, Tensor labels, float scale, float label_smoothing,"
        " int ignore_index, bool compute_grad) -> (Tensor, Tensor)");
  // F.cross_entropy with class-index labels on top of loss_grad, reduction "mean", "sum" or
  // "none", as one autograd node.
  m.def("softmax_cross_entropy(Tensor logits, Tensor labels, str reduction,"
        " float label_smoothing, int ignore_index) -> Tensor");
  // In-place all-reduce over replica buffers (CPU, or CUDA devices that may repeat): every
  // tensor ends with the sum (op "sum") or mean ("mean") of all, the same bits on every replica
  // whatever the algorithm ("auto", "one_shot", "two_shot", "ring").
  m.def("all_reduce_(Tensor(a!)[] tensors, str op, str algorithm) -> ()");
  // What a data-parallel step checks before its update, in one op (one kernel on CUDA):
  // float64 [loss (the sum of its elements, in float64), 1 if grad holds a NaN or an Inf else
  // 0, label_flag's value, how many elements of labels (int64) are not ignore_index (0 without
  // labels)], on grad's device; label_flag (the CUDA loss kernel's bad-label flag) set back to
  // 0 if clear_flag.
  // DataParallel's op: workspace holds int32 zeros of dpcuda._C._step_status_ints() elements
  // on grad's device when first used, and is left zero by each call; one stream at a time may
  // use it (a workspace that is not zero gives no record: its values are then undefined).
  m.def("step_status(Tensor grad, Tensor loss, Tensor(a!)? label_flag, Tensor(b!) workspace,"
        " bool clear_flag, Tensor? labels=None, int ignore_index=-100) -> Tensor");
  // The gradient reduction fused with SGD (torch.optim.SGD's update, dampening 0): grads are
  // reduced (sum or mean) and every replica's params and momentum buffers updated identically.
  // With two_shot each replica updates only its shard and the gather moves updated weights.
  // grads may be overwritten with the reduced gradient. status: none, or one step_status record
  // per replica on its device, which the update obeys where it runs (on CUDA, in the kernels:
  // no host read): nothing is updated when a record says NaN/Inf or a bad label; scaled_by > 0
  // says the losses and gradients were scaled by 1 / scaled_by labels, and the reduced gradient
  // is multiplied by scaled_by / (the labels the records count) before the step; loss_out (a
  // float64 scalar on params[0]'s device) receives the step's loss: the records' losses summed
  // in replica order, times that factor (NaN when no row counts).
  m.def("reduce_sgd_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] momentum_buffers,"
        " float lr, float momentum, float weight_decay, bool mean, str algorithm,"
        " Tensor[]? status=None, float scaled_by=0.0, Tensor(d!)? loss_out=None) -> ()");
  // The gradient reduction fused with dpcuda.optim's update (ZeRO-1 in one process): grads
  // (one full buffer per replica) reduced in the fixed order, each replica updating the shard
  // it owns (the two_shot split) with its own state shards (state1..3: empty, or one shard per
  // replica; roles as optim_update_'s), every replica's params ending with the same weights.
  // hyper: groups x replicas float64 arrays (hyper[g * R + r] on replica r's device); segments:
  // (begin, end, group) triples covering the buffers in order. grads may be overwritten with
  // the reduced gradient (one_shot, ring). gather=False (every buffer on one device): only
  // params[0] takes the new weights; the caller copies them to the other replicas before they
  // are read (DataParallel does at every forward), which saves the writes of R - 1 replicas.
  // max_norm: clipping by the global norm, as torch's clip_grad_norm_(max_norm) before the
  // update (csrc/kernels/optim/clip.h), with the norm written to `norm` (one element of the
  // params' dtype) where given; each owner's shard of grads then holds the reduced gradient.
  // status, scaled_by, loss_out: step records the update obeys on the device, as reduce_sgd_'s
  // (no weight or state written when a record says skip, the norm then NaN; grads are scratch
  // either way, as above; the reduced gradient times the
  // records' fix before clipping and the update; the step's loss into loss_out).
  m.def("reduce_update_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] state1,"
        " Tensor(d!)[] state2, Tensor(e!)[] state3, Tensor[] hyper, int[] segments,"
        " str optimizer, bool mean, str algorithm, bool gather=True, float? max_norm=None,"
        " Tensor(f!)? norm=None, Tensor[]? status=None, float scaled_by=0.0,"
        " Tensor(g!)? loss_out=None) -> ()");
  // dpcuda.optim's update of params on one device (CPU or one CUDA device; one kernel per 24
  // tensors there): optimizer "sgd" (state1: momentum buffers, or none) or "adam" (state1:
  // exp_avg, state2: exp_avg_sq, state3: max_exp_avg_sq or none), with the hyperparameters read
  // from `hyper` (float64, csrc/kernels/optim/update.h's layout) on the params' device.
  m.def("optim_update_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] state1,"
        " Tensor(c!)[] state2, Tensor(d!)[] state3, Tensor hyper, str optimizer) -> ()");
  // The bookkeeping around a reduce_update_ that a step keeps on the device (DataParallel's
  // non-blocking and graphed steps; csrc/kernels/optim/counts.h), one kernel each on CUDA.
  // update_hyper_, before the update: hyper (groups x 16 float64 rows) completed from the
  // counts: base (a graph's copy of the host's rows) copied over it first where given; "adam":
  // each row's step slot = counts[first[g]] + 1 (counts: each parameter's step count, float32;
  // first: int64, the parameter whose count stands for group g); "sgd": where counts (each
  // group's momentum begun, float32 0 or 1) is given, the first-step flag added to the rows
  // whose momentum has not begun.
  m.def("update_hyper_(Tensor(a!) hyper, Tensor? base, Tensor? counts, Tensor? first,"
        " str optimizer) -> ()");
  // update_counts_, after the update, from the replicas' step_status records (none: the update
  // applied): the update applied unless a record says NaN/Inf or a bad label; "adam": every
  // count + 1 where it applied; "sgd": every count 1 where it applied; ring and slot given:
  // the records into row `slot` of ring (slots x replicas x 4 float64), slot (one int64)
  // advanced modulo the slots.
  m.def("update_counts_(Tensor[] status, Tensor(a!)? counts, Tensor(b!)? ring,"
        " Tensor(c!)? slot, str optimizer) -> ()");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dpcuda's compiled kernels; the ops are registered under torch.ops.dpcuda";
  dpcuda::register_model_walk(m);
  dpcuda::register_unchanged(m);
  m.def("_record_function_observed", []() { return at::hasCallbacks(); },
        "Whether any RecordFunction callback is registered, global or on this thread (a "
        "profiler, an execution-trace observer): else a record_function records nothing");
  m.def("built_with_cuda", []() {
#ifdef DPCUDA_WITH_CUDA
    return true;
#else
    return false;
#endif
  });
  m.def("_step_status_ints", &dpcuda::step_status_workspace_ints,
        "The int32 elements of step_status's workspace on a CUDA device (0: none needed)");
  m.def("_take_label_error", []() -> py::object {
    const dpcuda::LabelError e = dpcuda::take_label_error();
    if (!e.raised) {
      return py::none();
    }
    return py::make_tuple(e.position, e.label, e.classes, e.ignore_index);
  }, "The (position, label, classes, ignore_index) of the last bad-label ValueError this thread "
     "raised since the last call, or None; forgets them");
  m.def("_defer_label_checks", &dpcuda::defer_label_checks,
        "Turns the CUDA loss adapter's own label check off on this thread (the kernel still "
        "flags bad labels); returns the previous setting");
  m.def("_set_bfloat16_forward_route", &dpcuda::set_bfloat16_forward_route,
        "Tests and benchmarks: the CPU bfloat16 full_forward computes its activation by "
        "dpcuda's pass (1), by ATen's kernel (0), or as measured best per activation (-1); "
        "gelu's is ATen's whatever is set; returns the previous setting");
  m.def("_set_float_bias_route", &dpcuda::set_float_bias_route,
        "Tests and benchmarks: the CPU float full_forward with an activation adds its bias in "
        "the GEMM (addmm, 1), in dpcuda's pass after mm (0), or by the layer's size as "
        "measured (-1: addmm from 64K output elements); returns the previous setting");
  m.def("_set_bfloat16_g_layout", &dpcuda::set_bfloat16_g_layout,
        "Tests and benchmarks: the CPU bfloat16 full_backward over a column-major (transposed) "
        "upstream gradient writes g row-major (0), column-major (1), or by the layer's size as "
        "measured (-1: column-major from 2048 columns up to 32 rows); returns the previous "
        "setting");
  m.def("_bfloat16_gemm_spreads_nan", &dpcuda::bfloat16_gemm_spreads_nan,
        "Whether torch's bfloat16 GEMM writes NaN into a row next to one holding a NaN (probed "
        "once); g then takes the upstream gradient's layout");
  m.def("_bfloat16_g_by_columns_for_tests", &dpcuda::bfloat16_g_by_columns_for_tests,
        py::arg("row_stride"), py::arg("col_stride"), py::arg("rows"), py::arg("cols"),
        py::arg("relu") = false,
        "Tests only: whether the CPU bfloat16 full_backward writes g column-major for an "
        "upstream gradient of these strides (row, column) and shape (rows, columns), relu's or "
        "another activation's");
  m.def("_saved_released_for_tests", &dpcuda::SavedReleasedAfterPass::released_for_tests,
        "Tests only: on this thread, how many times the CPU full_backward has dropped the "
        "autograd node's references to its saved tensor after its activation pass (where the "
        "graph is not kept), and how many of those freed its memory");
  m.def("_read_cpu_labels_for_tests", &dpcuda::read_cpu_labels_for_tests,
        "Tests only: the loss's autograd node reads CPU labels as it reads labels on a GPU "
        "(a copy in host memory, checked there); returns the previous setting");
#ifdef DPCUDA_WITH_CUDA
  // The TORCH_CUDA_ARCH_LIST the CUDA kernels were built for.
  m.def("_cuda_archs", []() { return std::string(dpcuda::cuda_archs()); });
  m.def("_set_cublaslt", &dpcuda::set_cublaslt,
        "Whether the CUDA full_forward and full_backward use cuBLASLt with one-kernel "
        "algorithms for small GEMMs (the backward's with the bias gradient) where cuBLASLt has "
        "them (default on; DPCUDA_CUBLASLT=0 turns it off); returns the previous setting");
  m.def("_cublaslt_calls", &dpcuda::cublaslt_calls,
        "How many of those GEMMs have run in this process");
  m.def("_label_error_flag", [](int64_t device) {
    return dpcuda::label_error_flag(static_cast<c10::DeviceIndex>(device));
  });
#endif
  // How many threads an at::parallel_for over n items runs on inside this extension: a build
  // check, since torch's OpenMP builds inline at::parallel_for and compile it serial unless the
  // extension itself is built with -fopenmp.
  m.def("_parallel_threads", [](int64_t n) {
    std::atomic<uint64_t> seen{0};
    at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
      seen.fetch_or(uint64_t(1) << (at::get_thread_num() % 64));
    });
    return __builtin_popcountll(seen.load());
  });
  m.def("full_forward", [](const at::Tensor& input, const at::Tensor& weight,
                           const c10::optional<at::Tensor>& bias, const std::string& activation) {
    return std::get<0>(dpcuda::call_full_forward(input, weight, bias, activation));
  }, py::call_guard<py::gil_scoped_release>());
  // full_forward whose autograd node's (first-order) backward writes the weight's and the
  // bias's gradients into grad_weight and grad_bias (None: as usual) and hands autograd views
  // of them, which it makes .grad without a copy when .grad is None (dpcuda.parallel's flat
  // gradient buffer, with no zeroing and no accumulation kernels).
  m.def("full_forward_into",
        [](const at::Tensor& input, const at::Tensor& weight,
           const c10::optional<at::Tensor>& bias, const std::string& activation,
           const c10::optional<at::Tensor>& grad_weight,
           const c10::optional<at::Tensor>& grad_bias) {
          const dpcuda::GradientsInto into(grad_weight, grad_bias);
          return std::get<0>(dpcuda::call_full_forward(input, weight, bias, activation));
        },
        py::call_guard<py::gil_scoped_release>());
  m.def("softmax_cross_entropy",
        [](const at::Tensor& logits, const at::Tensor& labels, const std::string& reduction,
           double label_smoothing, int64_t ignore_index) {
          return dpcuda::call_softmax_cross_entropy(logits, labels, reduction, label_smoothing,
                                                    ignore_index);
        },
        py::call_guard<py::gil_scoped_release>());
}
