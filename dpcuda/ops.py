"""The fused ops: Python wrappers over torch.ops.dpcuda.*, and their fake (meta) kernels,
registered with torch.library so the ops trace under torch.compile. Their autograd formulas are
registered in C++ (csrc/torch/autograd.cpp), where the host overhead per call is a fraction of
a Python autograd.Function's.

    full_forward(x, weight, bias=None, activation="relu")      act(x @ weight.T + bias)
    full_backward(grad_output, x, weight, saved, activation, output_mask)
    loss_grad(logits, labels, scale=None, ...)                  (loss, d loss / d logits)
    softmax_cross_entropy(logits, labels, reduction="mean", ...)   differentiable
"""

import math

import torch
from torch.overrides import has_torch_function
from torch.utils.flop_counter import register_flop_formula

from . import _C  # loads the library that registers torch.ops.dpcuda.*
from .reference import ACTIVATIONS

__all__ = ["ACTIVATIONS", "full_forward", "full_backward", "loss_grad", "softmax_cross_entropy",
           "saved_for_backward"]

# What the backward of each activation needs: its output (relu, sigmoid, tanh: the derivative
# is a function of it), its pre-activation (the smooth ones), or nothing (none).
_SAVES_OUTPUT = ("relu", "sigmoid", "tanh")
_SAVES_PRE = ("gelu", "gelu_tanh", "silu")
_REDUCTIONS = ("mean", "sum", "none")


def saved_for_backward(activation):
    """"output", "pre" or None: which tensor full_backward takes as `saved` for `activation`."""
    check_activation(activation)
    if activation in _SAVES_OUTPUT:
        return "output"
    if activation in _SAVES_PRE:
        return "pre"
    return None


def check_activation(activation):
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(
            f"activation must be one of {', '.join(ACTIVATIONS)}; got {activation!r}")


_ACTIVATION_SET = frozenset(ACTIVATIONS)
_is_compiling = torch.compiler.is_compiling  # (dynamo knows the function, whatever its name)


def _eager(*tensors):
    """Whether a call may take _C's fast path into the same op: not while torch.compile traces
    (it must see torch.ops.dpcuda.*) and not for tensors or modes that override torch functions,
    which only the torch.ops entry hands to __torch_function__."""
    return not _is_compiling() and not has_torch_function(tensors)


def _check_tensor(value, name):
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _one_device_type(ref, name, unread=(), **others):
    """A meta tensor among real ones would send the call here, where nothing is computed: a
    silent wrong result. Every tensor must be on ref's device type; those named in `unread`
    (that the kernel does not read: saved for "none", an output the mask leaves out) may lie on
    any device, as the real kernels allow, only not meta among real ones or real among meta."""
    for other, value in others.items():
        for i, t in enumerate(value if isinstance(value, (list, tuple)) else [value]):
            if t is None:
                continue
            if other in unread:
                wrong = (t.device.type == "meta") != (ref.device.type == "meta")
            else:
                wrong = t.device.type != ref.device.type
            if wrong:
                where = f"{other}[{i}]" if isinstance(value, (list, tuple)) else other
                raise ValueError(f"{where} is on {t.device} but {name} is on {ref.device}")


# ---------------------------------------------------------------------------------------------
# full_forward

@torch.library.register_fake("dpcuda::full_forward")
def _full_forward_fake(input, weight, bias, activation):
    _one_device_type(input, "x", weight=weight, bias=bias)
    torch._check(weight.dim() == 2, lambda: "weight must have shape (out_features, in_features)")
    torch._check(input.dim() >= 1 and input.shape[-1] == weight.shape[1],
                 lambda: f"input must have {weight.shape[1]} features in its last dimension")
    shape = (*input.shape[:-1], weight.shape[0])
    pre = input.new_empty(shape) if activation in _SAVES_PRE else input.new_empty((0,))
    return input.new_empty(shape), pre


def _check_grads_into(grads_into):
    """(weight's, bias's) destinations: each None or a tensor, and two that do not overlap."""
    if not isinstance(grads_into, (tuple, list)) or len(grads_into) != 2:
        raise TypeError("_grads_into must be a pair (grad_weight, grad_bias), each a tensor or "
                        f"None; got {type(grads_into).__name__}"
                        f"{f' of {len(grads_into)}' if isinstance(grads_into, (tuple, list)) else ''}")
    for name, t in zip(("grad_weight", "grad_bias"), grads_into):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"_grads_into's {name} must be a tensor or None, got "
                            f"{type(t).__name__}")
    w, b = grads_into
    if w is not None and b is not None and w.device == b.device and w.numel() and b.numel():
        wa, ba = w.data_ptr(), b.data_ptr()
        if wa < ba + b.numel() * b.element_size() and ba < wa + w.numel() * w.element_size():
            raise ValueError("_grads_into's grad_weight and grad_bias overlap in memory")
    return tuple(grads_into)


def full_forward(x, weight, bias=None, activation="relu", *, _grads_into=None):
    """act(x @ weight.T + bias) in one op; x is (..., in), weight (out, in) as in nn.Linear.

    Differentiable in x, weight and bias; the backward is full_backward.

    _grads_into is dpcuda.parallel's, not an API: a pair (weight's, bias's; either None) of
    tensors that the first-order backward writes those gradients into, which autograd then
    makes .grad without a copy (the flat gradient buffer). It is right only where each
    destination gets one gradient per backward (DataParallel gives a layer's destinations to
    one call per step, never to a shared parameter, and sets .grad to None first; where a
    parameter already has a .grad the usual path is taken). Eager mode only (ignored otherwise).
    """
    # The common call first: tensors, a known activation, eager mode and no overrides go
    # straight to _C with the checks below in one test. They cost about 2% of a 16-wide layer's
    # step at batch 32 (issue #27, the bfloat16 "none" layer without bias against torch eager in
    # bench_sweep.py's rounds, 2026-11-30: 1.004-1.013 with them, 1.017-1.020 with this path,
    # 1.026-1.037 calling _C directly).
    if (_grads_into is None and isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
            and type(activation) is str and activation in _ACTIVATION_SET
            and (_eager(x, weight) if bias is None
                 else isinstance(bias, torch.Tensor) and _eager(x, weight, bias))):
        return _C.full_forward(x, weight, bias, activation)
    grads_into = _grads_into
    _check_tensor(x, "x")
    _check_tensor(weight, "weight")
    if bias is not None:
        _check_tensor(bias, "bias")
    check_activation(activation)
    if grads_into is not None:
        grads_into = _check_grads_into(grads_into)
    if _eager(x, weight) if bias is None else _eager(x, weight, bias):
        if grads_into is not None:
            return _C.full_forward_into(x, weight, bias, activation, *grads_into)
        return _C.full_forward(x, weight, bias, activation)
    return torch.ops.dpcuda.full_forward(x, weight, bias, activation)[0]


# ---------------------------------------------------------------------------------------------
# full_backward

@torch.library.register_fake("dpcuda::full_backward")
def _full_backward_fake(grad_output, input, weight, saved, activation, output_mask):
    _one_device_type(grad_output, "grad_output", ("saved",) if activation == "none" else (),
                     x=input, weight=weight, saved=saved)
    # (each gradient left out an empty tensor of its own, as the kernels return: no aliasing)
    return (input.new_empty(input.shape) if output_mask[0] else grad_output.new_empty((0,)),
            weight.new_empty(weight.shape) if output_mask[1] else grad_output.new_empty((0,)),
            weight.new_empty((weight.shape[0],)) if output_mask[2]
            else grad_output.new_empty((0,)))


@torch.library.register_fake("dpcuda::full_backward_into")
def _full_backward_into_fake(grad_output, input, weight, saved, activation, output_mask,
                             grad_weight, grad_bias):
    unread = [n for n, read in (("saved", activation != "none"), ("grad_weight", output_mask[1]),
                                ("grad_bias", output_mask[2])) if not read]
    _one_device_type(grad_output, "grad_output", unread, x=input, weight=weight, saved=saved,
                     grad_weight=grad_weight, grad_bias=grad_bias)
    return input.new_empty(input.shape) if output_mask[0] else grad_output.new_empty((0,))


def full_backward(grad_output, x, weight, saved=None, activation="relu",
                  output_mask=(True, True, True)):
    """(grad_input, grad_weight, grad_bias) of full_forward, in one call.

    `saved` is the forward's output for relu/sigmoid/tanh and its pre-activation for
    gelu/gelu_tanh/silu (see saved_for_backward); unused for "none". Entries of output_mask
    that are False come back as None and are not computed.
    """
    _check_tensor(grad_output, "grad_output")
    _check_tensor(x, "x")
    _check_tensor(weight, "weight")
    check_activation(activation)
    if saved is None:
        if saved_for_backward(activation) is not None:
            raise ValueError(f"saved is required for activation {activation!r}: pass the "
                             f"forward's {saved_for_backward(activation)}")
        saved = grad_output.new_empty((0,))
    mask = [bool(m) for m in output_mask]
    if len(mask) != 3:
        raise ValueError(f"output_mask must have 3 entries, got {len(mask)}")
    outs = torch.ops.dpcuda.full_backward(grad_output, x, weight, saved, activation, mask)
    return tuple(o if m else None for o, m in zip(outs, mask))


# ---------------------------------------------------------------------------------------------
# FLOPs for torch.utils.flop_counter.FlopCounterMode: the layer's GEMMs, counted as torch counts
# nn.Linear's (2 * rows * in * out a GEMM; the activation and the bias are not counted)

def _gemm_flops(input_shape, weight_shape):
    rows = math.prod(input_shape[:-1])
    return 2 * rows * weight_shape[0] * weight_shape[1]


@register_flop_formula(torch.ops.dpcuda.full_forward)
def _full_forward_flops(input_shape, weight_shape, *args, out_shape=None, **kwargs):
    return _gemm_flops(input_shape, weight_shape)


@register_flop_formula([torch.ops.dpcuda.full_backward, torch.ops.dpcuda.full_backward_into])
def _full_backward_flops(grad_output_shape, input_shape, weight_shape, saved_shape, activation,
                         output_mask, *args, out_shape=None, **kwargs):
    return _gemm_flops(input_shape, weight_shape) * (int(bool(output_mask[0]))
                                                     + int(bool(output_mask[1])))


# ---------------------------------------------------------------------------------------------
# loss_grad and softmax_cross_entropy

def _loss_dtype(logits):
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


@torch.library.register_fake("dpcuda::loss_grad")
def _loss_grad_fake(logits, labels, scale, label_smoothing, ignore_index, compute_grad):
    _one_device_type(logits, "logits", labels=labels)
    torch._check(logits.dim() == 2, lambda: "logits must have shape (batch, classes)")
    torch._check(labels.dim() == 1 and labels.shape[0] == logits.shape[0],
                 lambda: "labels must have shape (batch,)")
    loss = logits.new_empty((logits.shape[0],), dtype=_loss_dtype(logits))
    grad = logits.new_empty(logits.shape) if compute_grad else logits.new_empty((0,))
    return loss, grad


def _check_loss_args(logits, labels, label_smoothing, ignore_index):
    _check_tensor(logits, "logits")
    _check_tensor(labels, "labels")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
        raise TypeError(f"labels must be integer class indices, got dtype {labels.dtype}")
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    return labels.long()


def loss_grad(logits, labels, scale=None, label_smoothing=0.0, ignore_index=-100):
    """Softmax cross-entropy loss and its gradient from one pass over (batch, classes) logits.

    Returns (loss, grad_logits): loss = scale * sum of the per-row losses, and grad_logits its
    gradient. scale=None means the mean over the rows whose label is not ignore_index; the
    data-parallel layer passes 1 / global_batch so that replicas normalise by the global batch.
    """
    labels = _check_loss_args(logits, labels, label_smoothing, ignore_index)
    if scale is None:
        count = int((labels != ignore_index).sum())
        scale = 1.0 / max(count, 1)
    losses, grad = torch.ops.dpcuda.loss_grad(logits, labels, float(scale),
                                              float(label_smoothing), ignore_index, True)
    return losses.sum(), grad


def softmax_cross_entropy(logits, labels, reduction="mean", label_smoothing=0.0,
                          ignore_index=-100):
    """Drop-in for torch.nn.functional.cross_entropy with class-index labels, differentiable.

    logits is (batch, classes) or (classes,) with a scalar label. The loss and the gradient
    come from one kernel; the backward only scales the saved gradient.
    """
    labels = _check_loss_args(logits, labels, label_smoothing, ignore_index)
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(_REDUCTIONS)}; got {reduction!r}")
    unbatched = logits.dim() == 1
    if unbatched:
        logits, labels = logits[None], labels.reshape(1)
    if _eager(logits, labels):
        out = _C.softmax_cross_entropy(logits, labels, reduction, float(label_smoothing),
                                       ignore_index)
    else:
        out = torch.ops.dpcuda.softmax_cross_entropy(logits, labels, reduction,
                                                     float(label_smoothing), ignore_index)
    return out[0] if unbatched and reduction == "none" else out


# The in-place collectives return nothing and change no metadata: their fake kernels compute
# nothing (they only check that no meta tensor hides among real ones), so they can be traced by
# torch.compile and run on meta tensors.
@torch.library.register_fake("dpcuda::all_reduce_")
def _all_reduce_fake(tensors, op, algorithm):
    if tensors:
        _one_device_type(tensors[0], "tensors[0]", tensors=tensors)
    return None


@torch.library.register_fake("dpcuda::step_status")
def _step_status_fake(grad, loss, label_flag, workspace, clear_flag, labels=None,
                      ignore_index=-100):
    _one_device_type(grad, "grad", loss=loss, label_flag=label_flag, workspace=workspace,
                     labels=labels)
    return grad.new_empty((4,), dtype=torch.float64)


@torch.library.register_fake("dpcuda::reduce_sgd_")
def _reduce_sgd_fake(params, grads, momentum_buffers, lr, momentum, weight_decay, mean,
                     algorithm, status=None, scaled_by=0.0, loss_out=None):
    if not params:
        raise ValueError("params must hold at least one tensor")
    _one_device_type(params[0], "params[0]", params=params, grads=grads,
                     momentum_buffers=momentum_buffers, status=status or [], loss_out=loss_out)
    return None


@torch.library.register_fake("dpcuda::optim_update_")
def _optim_update_fake(params, grads, state1, state2, state3, hyper, optimizer):
    if not params:
        raise ValueError("params must hold at least one tensor")
    _one_device_type(params[0], "params[0]", params=params, grads=grads, state1=state1,
                     state2=state2, state3=state3, hyper=hyper)
    return None


@torch.library.register_fake("dpcuda::update_hyper_")
def _update_hyper_fake(hyper, base, counts, first, optimizer):
    _one_device_type(hyper, "hyper", base=base, counts=counts, first=first)
    return None


@torch.library.register_fake("dpcuda::update_counts_")
def _update_counts_fake(status, counts, ring, slot, optimizer):
    ref = status[0] if status else counts if counts is not None else ring
    if ref is not None:
        _one_device_type(ref, "status[0]" if status else "counts" if counts is not None
                         else "ring", status=status, counts=counts, ring=ring, slot=slot)
    return None


@torch.library.register_fake("dpcuda::reduce_update_")
def _reduce_update_fake(params, grads, state1, state2, state3, hyper, segments, optimizer, mean,
                        algorithm, gather=True, max_norm=None, norm=None):
    if not params:
        raise ValueError("params must hold at least one tensor")
    _one_device_type(params[0], "params[0]", params=params, grads=grads, state1=state1,
                     state2=state2, state3=state3, hyper=hyper)
    return None
