// Autograd of the fused ops, registered for the Autograd key in C++ (torchvision's pattern);
// Python registers the fake kernels that torch.compile traces with (dpcuda/ops.py).
//
// Why C++ and not torch.library.register_autograd: that path runs a Python autograd.Function
// around every call, measured at about 60 us per op on the CPU machines (forward + backward),
// which alone made the fused 784-256-10 step slower than torch eager on the CPU and would make
// a GPU step CPU-bound. The formulas are the same; only the host overhead differs.
#include <ATen/ATen.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/core/Reduction.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>
#include <torch/version.h>

#include <initializer_list>
#include <mutex>

#include "aten_activation.h"
#include "checks.h"
#include "dispatch.h"
#include "label_errors.h"

namespace dpcuda {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---------------------------------------------------------------------------------------------
// Backward formulas autograd can differentiate, for create_graph=True (gradient penalties,
// Hessian-vector products). The fused backward kernels are opaque to autograd: a graph built
// through them would have wrong second derivatives with no error. So when grad mode is on inside
// a backward (which happens exactly when the caller asked for create_graph), the op's forward is
// recomputed from the saved inputs with the ATen ops it stands in for (linear + the activation,
// cross_entropy) and differentiated by torch's own autograd (a reentrant torch::autograd::grad
// with create_graph): the graph of the gradients is torch's, to any order, Inf and NaN
// included. First-order calls keep the fused kernels.

// Inputs that only a create_graph backward reads are kept in saved_data, not
// save_for_backward: that would make a first-order backward fail when they are modified in place
// after the forward, which torch's own ops allow (linear does not save its bias, log_softmax
// saves its output, not the logits). Their version is checked where they are read.
void keep_for_double_backward(AutogradContext* ctx, const std::string& name, const Tensor& t) {
  if (!t.defined()) return;
  ctx->saved_data[name] = t;
  ctx->saved_data[name + "_version"] = static_cast<int64_t>(t._version());
}

Tensor kept_for_double_backward(AutogradContext* ctx, const std::string& name, const char* op) {
  if (!ctx->saved_data.count(name)) return Tensor();
  const Tensor t = ctx->saved_data[name].toTensor();
  TORCH_CHECK(t._version() == ctx->saved_data[name + "_version"].toInt(),
              "one of the variables needed for the double backward (create_graph=True) of "
              "dpcuda::", op, ", its ", name, ", has been modified by an inplace operation since "
              "the forward");
  return t;
}

// What a loss op's create_graph backward reads: its inputs and arguments.
void keep_loss_inputs(AutogradContext* ctx, const Tensor& logits, const Tensor& labels,
                      double scale, double label_smoothing, int64_t ignore_index) {
  keep_for_double_backward(ctx, "logits", logits);
  keep_for_double_backward(ctx, "labels", labels);
  ctx->saved_data["scale"] = scale;
  ctx->saved_data["label_smoothing"] = label_smoothing;
  ctx->saved_data["ignore_index"] = ignore_index;
}

variable_list torch_full_backward(const Tensor& grad_out, const Tensor& input,
                                  const Tensor& weight, const Tensor& bias, Activation act,
                                  std::array<bool, 3> mask) {
  const Tensor y = aten_activation(
      at::linear(input, weight, bias.defined() ? c10::optional<Tensor>(bias) : c10::nullopt),
      act);
  const std::array<Tensor, 3> args = {input, weight, bias};
  std::vector<Tensor> wrt;
  for (int i = 0; i < 3; ++i) {
    if (mask[i]) wrt.push_back(args[i]);
  }
  variable_list out(4);
  if (wrt.empty()) return out;
  const variable_list grads = torch::autograd::grad({y}, wrt, {grad_out}, /*retain_graph=*/true,
                                                    /*create_graph=*/true, /*allow_unused=*/true);
  for (int i = 0, k = 0; i < 3; ++i) {
    if (mask[i]) out[i] = grads[k++];
  }
  return out;
}

// The vector-Jacobian product of `scale * cross_entropy(logits, labels, reduction)` with
// `grad`, as torch's autograd computes it, differentiable: the loss ops' create_graph path. The
// inputs and arguments are those keep_loss_inputs kept.
Tensor torch_loss_vjp(AutogradContext* ctx, const char* op, int64_t reduction,
                      const Tensor& grad) {
  const Tensor logits = kept_for_double_backward(ctx, "logits", op);
  const Tensor labels = kept_for_double_backward(ctx, "labels", op);
  const Tensor loss =
      at::cross_entropy_loss(logits, labels, c10::nullopt, reduction,
                             ctx->saved_data["ignore_index"].toInt(),
                             ctx->saved_data["label_smoothing"].toDouble())
          .to(grad.scalar_type()) *
      ctx->saved_data["scale"].toDouble();
  return torch::autograd::grad({loss}, {logits}, {grad}, /*retain_graph=*/true,
                               /*create_graph=*/true)[0];
}

// scale * d(per-row softmax cross-entropy) / d logits, in the accumulation type (float for half
// logits) and then in the kernel gradient's dtype: softmax minus the smoothed target, 0 on
// ignored rows. Labels are in range: the forward checked them.
Tensor differentiable_loss_grad(const Tensor& logits, const Tensor& labels, double scale,
                                double label_smoothing, int64_t ignore_index,
                                at::ScalarType dtype) {
  const auto acc = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t classes = logits.size(1);
  const Tensor valid = labels.ne(ignore_index);
  const Tensor safe = at::where(valid, labels, at::zeros_like(labels));
  const Tensor target = at::one_hot(safe, classes).to(acc) * (1.0 - label_smoothing) +
                        label_smoothing / static_cast<double>(classes);
  const Tensor g = (at::softmax(logits, 1, acc) - target) * valid.unsqueeze(1).to(acc);
  return (g * scale).to(dtype);
}

thread_local const GradientsInto* t_gradients_into = nullptr;

// A destination is for a parameter: it is used only where the node's tensor is a leaf (under
// autocast the node sees a cast copy, whose gradient goes on to the cast's node; it is then
// computed as usual), and must have exactly its shape, dtype and device and be contiguous; any
// other is an error in the caller, named here before any work.
Tensor checked_into(const Tensor& into, const Tensor& like, const char* name) {
  if (!into.defined() || !like.is_leaf()) return Tensor();
  TORCH_CHECK_VALUE(!into.requires_grad(), name, " must not require grad");
  TORCH_CHECK_VALUE(into.sizes() == like.sizes(), name, " must have shape ", like.sizes(),
                    ", got ", into.sizes());
  TORCH_CHECK_VALUE(into.scalar_type() == like.scalar_type(), name, " must have dtype ",
                    like.scalar_type(), ", got ", into.scalar_type());
  TORCH_CHECK_VALUE(into.device() == like.device(), name, " must be on ", like.device(),
                    ", got ", into.device());
  TORCH_CHECK_VALUE(into.is_contiguous(), name, " must be contiguous");
  return into;
}

// The backward node of full_forward, written as torch's generated nodes are (a Node whose saved
// tensors are members) and not as a torch::autograd::Function: a Function's per-call bookkeeping
// (a context with a string-keyed map of IValues, the metadata of every input and output, sets
// of the non-differentiable outputs) cost about 1.7 us of a 7 us forward of a small layer on
// the CPU machine, more than torch's own linear spends on its two nodes (issue #27).
struct FullForwardBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable input, weight, saved;  // saved: out or pre, or undefined
  Activation act = Activation::kNone;
  bool has_bias = false;
  // The bias is read only by a create_graph backward: kept with its version, not saved, so
  // that a first-order backward allows it to be modified in place (as torch's linear does).
  Tensor bias;
  int64_t bias_version = 0;
  // DataParallel's destinations of the weight's and the bias's gradients (t_gradients_into),
  // and the weight itself, whose .grad decides whether its destination is used.
  bool into = false;
  Tensor weight_itself, grad_weight_into, grad_bias_into;

  std::string name() const override { return "FullForwardBackward"; }

  // Both lock the node, as torch's generated nodes do: a backward of a retained graph on
  // another thread must not read what a finished backward releases.
  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    input.reset_data();
    weight.reset_data();
    saved.reset_data();
    bias = Tensor();
    weight_itself = grad_weight_into = grad_bias_into = Tensor();
  }

  variable_list apply(variable_list&& grads) override;
};

// A node as torch's generated code makes one. Torch 2.13 holds nodes by c10::intrusive_ptr
// where 2.11 holds them by std::shared_ptr with a deleter that frees long chains without deep
// recursion; both CI builds (torch 2.11 and the CPU-only 2.13) compile this, and Node::getptr()
// gives the node's own pointer in either.
template <class T>
auto make_node() {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
  return c10::make_intrusive<T>();
#else
  return std::shared_ptr<T>(new T(), torch::autograd::deleteNode);
#endif
}

const char* activation_name(Activation act) {
  static const char* const kNames[] = {"none", "relu", "gelu", "gelu_tanh",
                                       "silu", "sigmoid", "tanh"};
  return kNames[static_cast<int>(act)];
}

variable_list FullForwardBackward::apply(variable_list&& grads) {
  std::lock_guard<std::mutex> lock(mutex_);
  variable_list result(3);
  const Tensor& grad_out = grads[0];
  if (!grad_out.defined()) return result;
  const Tensor x = input.unpack();
  const Tensor w = weight.unpack();
  Tensor kept = saved.unpack(getptr());
  const std::array<bool, 3> mask = {task_should_compute_output(0),
                                    task_should_compute_output(1),
                                    has_bias && task_should_compute_output(2)};
  if (at::GradMode::is_enabled()) {
    TORCH_CHECK(!bias.defined() || bias._version() == bias_version,
                "one of the variables needed for the double backward (create_graph=True) of "
                "dpcuda::full_forward, its bias, has been modified by an inplace operation "
                "since the forward");
    variable_list g = torch_full_backward(grad_out, x, w, bias, act, mask);
    g.resize(3);
    return g;
  }
  const c10::string_view activation = activation_name(act);
  // Where the graph is not kept, the node's references to what it saved (its saved variable
  // and this call's tensor) are handed to the CPU kernel, which drops them after its
  // activation pass, before the GEMMs (SavedReleasedAfterPass): a pre-activation is then freed
  // where torch's GeluBackward/SiluBackward frees its input; a layer's output stays with whoever
  // holds it. Elsewhere (CUDA, a kernel that fails first) the engine releases them after this
  // call, as it would in any case. (A node called by hand inside another backward follows that
  // backward's retain_graph.)
  const bool hand_over = kept.defined() && !torch::autograd::get_current_graph_task_keep_graph();
  Tensor s = kept.defined() ? std::move(kept) : at::empty({0}, grad_out.options());
  // Grad mode is off: nothing here is recorded, so the ops are called below autograd, straight
  // to their kernels (through the autograd keys they would take the boxed fallback that only
  // says they have no formula, a boxing of every argument per call).
  at::AutoDispatchBelowADInplaceOrView below;
  if (into) {
    // The gradients go straight into the caller's destinations. Autograd gets fresh views of
    // them, held by nothing else, which AccumulateGrad makes .grad without a copy when .grad
    // is None (and adds, as any gradient, when it is not).
    // Only onto a .grad that is not there yet: where the parameter holds one (accumulation
    // over micro-batches, a retained graph, a second node of the same forward), the
    // destination may be that very .grad, which AccumulateGrad then adds to; so this
    // gradient takes the usual path and is added to it.
    Tensor dw = grad_weight_into;
    Tensor db = grad_bias_into;
    if (dw.defined() && weight_itself.grad().defined()) dw = Tensor();
    if (db.defined() && (!bias.defined() || bias.grad().defined())) db = Tensor();
    const Tensor none = at::empty({0}, grad_out.options());
    const std::array<bool, 3> into_mask = {mask[0], mask[1] && dw.defined(),
                                           mask[2] && db.defined()};
    Tensor w_out = into_mask[1] ? dw : none;
    Tensor b_out = into_mask[2] ? db : none;
    const bool second_call = (mask[1] && !into_mask[1]) || (mask[2] && !into_mask[2]);
    Tensor gi;
    {
      // (not where the second call below reads `s` again)
      SavedReleasedAfterPass handed(hand_over && !second_call ? &s : nullptr, &saved);
      gi = call_full_backward_into(grad_out, x, w, s, activation, into_mask, w_out, b_out);
    }
    // What has no destination (a gradient the caller did not place) is computed as usual.
    Tensor gw = into_mask[1] ? dw.view(dw.sizes()) : Tensor();
    Tensor gb = into_mask[2] ? db.view(db.sizes()) : Tensor();
    if (second_call) {
      auto rest = call_full_backward(grad_out, x, w, s, activation,
                                     {false, mask[1] && !into_mask[1],
                                      mask[2] && !into_mask[2]});
      if (mask[1] && !into_mask[1]) gw = std::get<1>(rest);
      if (mask[2] && !into_mask[2]) gb = std::get<2>(rest);
    }
    return {mask[0] ? gi : Tensor(), gw, gb};
  }
  SavedReleasedAfterPass handed(hand_over ? &s : nullptr, &saved);
  auto [gi, gw, gb] = call_full_backward(grad_out, x, w, s, activation, mask);
  return {mask[0] ? gi : Tensor(), mask[1] ? gw : Tensor(), mask[2] ? gb : Tensor()};
}

// full_forward with its backward node: the kernels below autograd, then the node, its edges
// to the inputs and what it saves (as torch's generated VariableType code builds a node).
std::tuple<Tensor, Tensor> full_forward_node(const Tensor& input, const Tensor& weight,
                                             const c10::optional<Tensor>& bias,
                                             c10::string_view activation) {
  const Activation act = check_activation(activation);
  Tensor out, pre;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    std::tie(out, pre) = call_full_forward(input, weight, bias, activation);
  }
  const bool has_bias = bias.has_value() && bias->defined();
  const auto node = make_node<FullForwardBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(input, weight, bias));
  node->act = act;
  node->has_bias = has_bias;
  if (has_bias) {
    node->bias = *bias;
    node->bias_version = static_cast<int64_t>(bias->_version());
  }
  if (const GradientsInto* into = t_gradients_into) {
    node->into = true;
    // The weight itself, whose .grad the backward looks at (a saved variable may hand back a
    // copy under saved-tensor hooks, with no .grad).
    node->weight_itself = weight;
    node->grad_weight_into = checked_into(into->weight, weight, "grad_weight");
    node->grad_bias_into = has_bias ? checked_into(into->bias, *bias, "grad_bias") : Tensor();
  }
  // The layer's output gets the node; the pre-activation is what the backward reads, not a
  // result of the layer (no gradient flows into it).
  torch::autograd::set_history(out, node);
  node->input = torch::autograd::SavedVariable(input, false);
  node->weight = torch::autograd::SavedVariable(weight, false);
  const Saved kind = saved_for_backward(act);
  if (kind == Saved::kOutput) {
    node->saved = torch::autograd::SavedVariable(out, true);
  } else if (kind == Saved::kPreActivation) {
    node->saved = torch::autograd::SavedVariable(pre, false);
  }
  return {out, pre};
}

class LossGrad : public torch::autograd::Function<LossGrad> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& logits, const Tensor& labels,
                               double scale, double label_smoothing, int64_t ignore_index,
                               bool compute_grad) {
    Tensor loss, grad;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      std::tie(loss, grad) =
          call_loss_grad(logits, labels, scale, label_smoothing, ignore_index, compute_grad);
    }
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({grad});
    keep_loss_inputs(ctx, logits, labels, scale, label_smoothing, ignore_index);
    ctx->saved_data["compute_grad"] = compute_grad;
    ctx->mark_non_differentiable({grad});
    return {loss, grad};
  }

  // The forward kernel already computed d loss / d logits; the chain rule only scales each row
  // by the incoming gradient of that row's loss.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(ctx->saved_data["compute_grad"].toBool(),
                "loss_grad was called with compute_grad=False, so it cannot be differentiated; "
                "call it with compute_grad=True");
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    const auto saved = ctx->get_saved_variables();
    if (at::GradMode::is_enabled()) {
      return {torch_loss_vjp(ctx, "loss_grad", at::Reduction::None, grads[0]), Tensor(),
              Tensor(), Tensor(), Tensor(), Tensor()};
    }
    const Tensor& grad = saved[0];
    const Tensor grad_logits = grads[0].to(grad.scalar_type()).unsqueeze(1) * grad;
    return {grad_logits, Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

// Whether a call needs the autograd node: grad mode on and an input that requires grad. When
// not, the kernels are called directly: apply() costs several microseconds even then.
bool needs_node(std::initializer_list<const Tensor*> inputs) {
  if (!at::GradMode::is_enabled()) return false;
  for (const Tensor* t : inputs) {
    if (t->defined() && t->requires_grad()) return true;
  }
  return false;
}

// Forward-mode AD (a tangent on an input) and torch.func transforms cannot go through a C++
// autograd::Function: torch refuses it ("cannot use C++ torch::autograd::Function with
// functorch transforms") because functorch lifts only Python ones. There the ops compute the
// same math with ATen ops, which every transform understands (grad, jvp, vjp, vmap, hessian,
// forward AD): slower, as torch's unfused layers are, and differentiable to any order.
bool needs_composite(std::initializer_list<const Tensor*> inputs) {
  // functorch includes its front-mode key in the thread's dispatch keys while a transform is on.
  if (c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode)) {
    return true;
  }
  for (const Tensor* t : inputs) {
    if (t->defined() && t->_fw_grad(0).defined()) return true;
  }
  return false;
}

std::tuple<Tensor, Tensor> composite_full_forward(const Tensor& input, const Tensor& weight,
                                                  const c10::optional<Tensor>& bias,
                                                  c10::string_view activation) {
  const Activation act = check_activation(activation);
  const Tensor z = at::linear(input, weight, bias);
  const Tensor pre = saved_for_backward(act) == Saved::kPreActivation
                         ? z
                         : at::empty({0}, input.options());
  return {aten_activation(z, act), pre};
}

// The loss in the accumulation type (float for half logits), as the kernel returns it.
std::tuple<Tensor, Tensor> composite_loss_grad(const Tensor& logits, const Tensor& labels,
                                               double scale, double label_smoothing,
                                               int64_t ignore_index, bool compute_grad) {
  const auto acc = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const Tensor losses = at::cross_entropy_loss(logits.to(acc), labels, c10::nullopt,
                                               at::Reduction::None, ignore_index,
                                               label_smoothing) * scale;
  const Tensor grad = compute_grad ? differentiable_loss_grad(logits, labels, scale,
                                                              label_smoothing, ignore_index,
                                                              logits.scalar_type())
                                   : at::empty({0}, logits.options());
  return {losses, grad};
}

std::tuple<Tensor, Tensor> full_forward_autograd(const Tensor& input, const Tensor& weight,
                                                 const c10::optional<Tensor>& bias,
                                                 c10::string_view activation) {
  const Tensor no_bias;
  if (needs_composite({&input, &weight, bias.has_value() ? &*bias : &no_bias})) {
    return composite_full_forward(input, weight, bias, activation);
  }
  if (!needs_node({&input, &weight, bias.has_value() ? &*bias : &no_bias})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return call_full_forward(input, weight, bias, activation);
  }
  return full_forward_node(input, weight, bias, activation);
}

std::tuple<Tensor, Tensor> loss_grad_autograd(const Tensor& logits, const Tensor& labels,
                                              double scale, double label_smoothing,
                                              int64_t ignore_index, bool compute_grad) {
  if (needs_composite({&logits})) {
    return composite_loss_grad(logits, labels, scale, label_smoothing, ignore_index,
                               compute_grad);
  }
  if (!needs_node({&logits})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return call_loss_grad(logits, labels, scale, label_smoothing, ignore_index, compute_grad);
  }
  auto out = LossGrad::apply(logits, labels, scale, label_smoothing, ignore_index, compute_grad);
  return {out[0], out[1]};
}

void check_reduction(c10::string_view reduction) {
  TORCH_CHECK_VALUE(reduction == "mean" || reduction == "sum" || reduction == "none",
                    "reduction must be one of mean, sum, none; got '", std::string(reduction),
                    "'");
}

// The rows that count towards "mean": as F.cross_entropy, those not labelled ignore_index.
Tensor valid_count(const Tensor& labels, int64_t ignore_index) {
  return labels.ne(ignore_index).sum();
}

// The same count read from host memory, for labels that live there as plain tensors (not fake,
// functional or other subclass-like tensors, which have no data to read): it turns the mean
// into a scale the kernel applies, saving four small ops per step. Labels on a GPU keep the
// tensor count, which needs no synchronisation.
c10::optional<int64_t> host_valid_count(const Tensor& labels, int64_t ignore_index) {
  if (!labels.is_cpu() || at::isTensorSubclassLike(labels) || !labels.is_contiguous()) {
    return c10::nullopt;
  }
  const int64_t* y = labels.const_data_ptr<int64_t>();
  int64_t count = 0;
  for (int64_t r = 0, n = labels.numel(); r < n; ++r) count += y[r] != ignore_index;
  return count;
}

// Casts only when needed: a no-op .to() returns its input, which an op below autograd must
// never do (torch.library.opcheck's schema test enforces it).
Tensor as_dtype(const Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype ? t : t.to(dtype);
}

Tensor reduce_losses(const Tensor& losses, const Tensor& count, c10::string_view reduction,
                     at::ScalarType dtype) {
  if (reduction == "none") return as_dtype(losses, dtype);
  if (reduction == "sum") return as_dtype(losses.sum(), dtype);
  return as_dtype(losses.sum().div(count), dtype);
}

// softmax_cross_entropy without autograd (inference, and what torch.compile traces).
Tensor softmax_cross_entropy_forward(const Tensor& logits, const Tensor& labels,
                                     c10::string_view reduction, double label_smoothing,
                                     int64_t ignore_index) {
  check_reduction(reduction);
  const Tensor losses = std::get<0>(
      call_loss_grad(logits, labels, 1.0, label_smoothing, ignore_index, false));
  const Tensor count = reduction == "mean" ? valid_count(labels, ignore_index) : Tensor();
  return reduce_losses(losses, count, reduction, logits.scalar_type());
}

// Turns the loss adapter's own label check off for its scope when the labels were checked
// already (defer_label_checks; restored on exit, exceptions included).
class LabelsChecked {
 public:
  explicit LabelsChecked(bool checked) : active_(checked), previous_(false) {
    if (active_) previous_ = defer_label_checks(true);
  }
  ~LabelsChecked() {
    if (active_) defer_label_checks(previous_);
  }
  LabelsChecked(const LabelsChecked&) = delete;
  LabelsChecked& operator=(const LabelsChecked&) = delete;

 private:
  bool active_;
  bool previous_;
};

// One autograd node for the loss and its reduction: the forward keeps loss_grad's gradient and
// the backward scales it once. Written in C++ because each Python-side tensor op costs several
// microseconds of host time, more than the whole kernel on a small batch.
class SoftmaxCrossEntropy : public torch::autograd::Function<SoftmaxCrossEntropy> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& logits, const Tensor& labels,
                               c10::string_view reduction, double label_smoothing,
                               int64_t ignore_index, bool compute_grad) {
    check_reduction(reduction);
    ctx->set_materialize_grads(false);
    at::AutoDispatchBelowADInplaceOrView below;
    // Labels on a GPU (up to 65536, in an eager call): read into host memory once. The adapter
    // would synchronise to check them anyway (a bad label raises from this call); this one
    // synchronisation also gives the count of rows, so the mean becomes the kernel's scale
    // below, with no count or division on the device. Checked here, so the
    // adapter's own check is off for the call.
    const Tensor host_labels = labels_read_for_check(logits, labels, label_smoothing);
    if (host_labels.defined()) check_labels(host_labels, logits.size(1), ignore_index);
    const LabelsChecked checked(host_labels.defined());
    // The rows that count (labels not ignore_index), counted in host memory where the labels
    // are there; on the device otherwise.
    const Tensor& readable = host_labels.defined() ? host_labels : labels;
    const auto host_count = labels.scalar_type() == at::kLong
                                ? host_valid_count(readable, ignore_index)
                                : c10::nullopt;
    // Where some rows are ignored, the backward keeps the incoming gradient off them (torch's
    // ignored rows never see it: a NaN or Inf coming in must not reach them through 0 * g).
    const Tensor kept = host_count && *host_count == readable.numel()
                            ? Tensor()
                            : labels.ne(ignore_index);
    if (reduction == "mean" && host_count && *host_count > 0) {
      // Mean as a scaled sum: the kernel's loss and gradient already carry 1 / count.
      auto [losses, grad] = call_loss_grad(logits, labels, 1.0 / static_cast<double>(*host_count),
                                           label_smoothing, ignore_index, compute_grad);
      ctx->save_for_backward({grad, Tensor(), kept});
      keep_loss_inputs(ctx, logits, labels, 1.0 / static_cast<double>(*host_count),
                       label_smoothing, ignore_index);
      ctx->saved_data["reduction"] = std::string("sum");
      return {as_dtype(losses.sum(), logits.scalar_type())};
    }
    auto [losses, grad] = call_loss_grad(logits, labels, 1.0, label_smoothing, ignore_index,
                                         compute_grad);
    const Tensor count = reduction != "mean" ? Tensor()
                         : kept.defined()    ? kept.sum()
                                             : valid_count(labels, ignore_index);
    ctx->save_for_backward({grad, count, kept});
    keep_loss_inputs(ctx, logits, labels, 1.0, label_smoothing, ignore_index);
    ctx->saved_data["reduction"] = std::string(reduction);
    return {reduce_losses(losses, count, reduction, logits.scalar_type())};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    const auto saved = ctx->get_saved_variables();
    const std::string reduction = ctx->saved_data["reduction"].toStringRef();
    if (at::GradMode::is_enabled()) {
      const int64_t r = reduction == "none"  ? at::Reduction::None
                        : reduction == "sum" ? at::Reduction::Sum
                                             : at::Reduction::Mean;
      return {torch_loss_vjp(ctx, "softmax_cross_entropy", r, grads[0]), Tensor(), Tensor(),
              Tensor(), Tensor(), Tensor()};
    }
    const Tensor& grad = saved[0];
    const Tensor g = as_dtype(grads[0], grad.scalar_type());
    const Tensor& kept = saved[2];
    Tensor grad_logits = reduction == "none" ? g.unsqueeze(1) * grad
                         : reduction == "sum" ? grad * g
                                              : grad * (g / saved[1]);
    if (kept.defined()) {
      // Ignored rows: torch's gradient there is 0 whatever comes in (also for a mean over no
      // rows, where g / 0 is NaN), except where the logits make log_softmax NaN and the
      // kernel's gradient is NaN already: grad * 0 keeps exactly those.
      grad_logits = at::where(kept.unsqueeze(1), grad_logits, grad * 0);
    }
    return {grad_logits, Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

Tensor softmax_cross_entropy_autograd(const Tensor& logits, const Tensor& labels,
                                      c10::string_view reduction, double label_smoothing,
                                      int64_t ignore_index) {
  if (needs_composite({&logits})) {
    check_reduction(reduction);
    const int64_t r = reduction == "none"  ? at::Reduction::None
                      : reduction == "sum" ? at::Reduction::Sum
                                           : at::Reduction::Mean;
    return at::cross_entropy_loss(logits, labels, c10::nullopt, r, ignore_index,
                                  label_smoothing);
  }
  if (!needs_node({&logits})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return softmax_cross_entropy_forward(logits, labels, reduction, label_smoothing,
                                         ignore_index);
  }
  // Whether a gradient will be wanted is known here, before apply() turns grad mode off.
  const bool compute_grad = at::GradMode::is_enabled() && logits.requires_grad();
  return SoftmaxCrossEntropy::apply(logits, labels, reduction, label_smoothing, ignore_index,
                                    compute_grad)[0];
}

}  // namespace

GradientsInto::GradientsInto(const c10::optional<at::Tensor>& weight,
                             const c10::optional<at::Tensor>& bias)
    : weight(weight.has_value() ? *weight : at::Tensor()),
      bias(bias.has_value() ? *bias : at::Tensor()),
      previous_(t_gradients_into) {
  t_gradients_into = this;
}

GradientsInto::~GradientsInto() { t_gradients_into = previous_; }

const GradientsInto* GradientsInto::current() { return t_gradients_into; }

namespace {
thread_local SavedReleasedAfterPass* t_saved_released = nullptr;
thread_local std::pair<int64_t, int64_t> t_released_count = {0, 0};
}  // namespace

SavedReleasedAfterPass::SavedReleasedAfterPass(at::Tensor* saved,
                                               torch::autograd::SavedVariable* node_saved)
    : saved_(saved), node_saved_(node_saved), previous_(t_saved_released) {
  t_saved_released = this;
}

SavedReleasedAfterPass::~SavedReleasedAfterPass() { t_saved_released = previous_; }

void SavedReleasedAfterPass::release(const at::Tensor& saved) {
  SavedReleasedAfterPass* const current = t_saved_released;
  if (!current || !current->saved_ || !current->saved_->defined() ||
      !current->saved_->is_same(saved)) {
    return;
  }
  at::Tensor* const mine = current->saved_;
  current->saved_ = nullptr;
  current->node_saved_->reset_data();  // (under the node's lock: the node's apply holds it)
  const bool last = mine->use_count() == 1 && mine->storage().use_count() == 1;
  mine->reset();  // (`saved` may be this very tensor: not read after this)
  ++t_released_count.first;
  if (last) ++t_released_count.second;
}

std::pair<int64_t, int64_t> SavedReleasedAfterPass::released_for_tests() {
  return t_released_count;
}

TORCH_LIBRARY_IMPL(dpcuda, CompositeExplicitAutograd, m) {
  m.impl("softmax_cross_entropy", &softmax_cross_entropy_forward);
}

TORCH_LIBRARY_IMPL(dpcuda, Autograd, m) {
  m.impl("full_forward", &full_forward_autograd);
  m.impl("loss_grad", &loss_grad_autograd);
  m.impl("softmax_cross_entropy", &softmax_cross_entropy_autograd);
}

}  // namespace dpcuda
