"""Drop-in modules over the fused ops.

    FusedLinear(in, out, bias=True, activation="relu")   nn.Linear + activation in one op
    FusedMLP([784, 256, 10], activation="relu")          no activation after the last layer
    FusedMLP.to_sequential() / FusedMLP.from_sequential() the equivalent nn.Sequential (shared
                                                          parameters, its state_dict keys)
    SoftmaxCrossEntropyLoss(...)                          nn.CrossEntropyLoss
    fuse(module)                                          nn.Linear + activation -> FusedLinear
"""

import math
import warnings

import torch
from torch import nn

from . import ops

__all__ = ["FusedLinear", "FusedMLP", "SoftmaxCrossEntropyLoss", "fuse"]


class FusedLinear(nn.Module):
    """act(x @ weight.T + bias) with nn.Linear's parameters, initialisation and state_dict keys,
    so it loads an nn.Linear state_dict as it is."""

    def __init__(self, in_features, out_features, bias=True, activation="relu", device=None,
                 dtype=None):
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        ops.check_activation(activation)
        self.in_features = in_features
        self.out_features = out_features
        self.activation = activation
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty((out_features, in_features), **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        """nn.Linear's initialisation (Kaiming-uniform weight, uniform bias)."""
        # The same initialisation as nn.Linear.reset_parameters.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = self.in_features
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_linear(cls, linear, activation="none"):
        """A FusedLinear that shares linear's parameters (no copy)."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        ops.check_activation(activation)
        module.in_features = linear.in_features
        module.out_features = linear.out_features
        module.activation = activation
        module.weight = linear.weight
        if linear.bias is not None:
            module.bias = linear.bias
        else:
            module.register_parameter("bias", None)
        return module

    # Set by dpcuda.parallel.DataParallel around its own forward only: where the backward writes
    # the weight's and bias's gradients (views of the replica's flat gradient buffer).
    _grads_into = None

    def forward(self, input):
        """act(input @ weight.T + bias) in one fused op (dpcuda.ops.full_forward)."""
        into = self._grads_into
        if into is not None:
            # Once per step: a layer called twice in one forward gets its second call's
            # gradients the usual way, and autograd sums the two into .grad.
            # (straight into __dict__: nn.Module.__setattr__ costs microseconds a call)
            self.__dict__["_grads_into"] = None
        return ops.full_forward(input, self.weight, self.bias, self.activation, _grads_into=into)

    def extra_repr(self):
        """The sizes, the bias and the activation, as nn.Linear's repr shows them."""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, activation={self.activation!r}")


class FusedMLP(nn.Module):
    """A stack of FusedLinear layers of the given sizes: `activation` after every layer but the
    last. FusedMLP([784, 256, 10]) is Linear(784, 256) + relu, then Linear(256, 10)."""

    def __init__(self, sizes, activation="relu", bias=True, device=None, dtype=None):
        super().__init__()
        sizes = list(sizes)
        if len(sizes) < 2 or not all(isinstance(s, int) and s > 0 for s in sizes):
            raise ValueError(f"sizes must list at least two positive ints, got {sizes!r}")
        ops.check_activation(activation)
        self.sizes = sizes
        self.layers = nn.ModuleList(
            FusedLinear(a, b, bias=bias, activation=activation if i + 2 < len(sizes) else "none",
                        device=device, dtype=dtype)
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])))

    def forward(self, x):
        """The layers in turn: the hidden ones with the activation, the last without."""
        for layer in self.layers:
            x = layer(x)
        return x

    def to_sequential(self):
        """The same network as nn.Sequential(nn.Linear, activation, ..., nn.Linear), sharing this
        module's parameters: its state_dict keys are nn.Sequential's ("0.weight", "2.weight",
        ...), so it loads and saves what a plain PyTorch model of this shape does."""
        modules = []
        for layer in self.layers:
            linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                               device="meta")
            linear.weight = layer.weight
            if layer.bias is not None:
                linear.bias = layer.bias
            modules.append(linear)
            if layer.activation != "none":
                modules.append(_ACTIVATION_MODULES[layer.activation]())
        return nn.Sequential(*modules)

    @classmethod
    def from_sequential(cls, sequential):
        """A FusedMLP sharing the parameters of an nn.Sequential of nn.Linear layers with one
        activation module (ReLU, GELU, SiLU, Sigmoid, Tanh; the same after every layer but the
        last) between them: FusedMLP([...]).to_sequential() and back."""
        if not isinstance(sequential, nn.Sequential):
            raise TypeError(f"sequential must be an nn.Sequential, got "
                            f"{type(sequential).__name__}")
        children = list(sequential)
        linears = children[0::2]
        acts = children[1::2]
        names = [_activation_name(a) for a in acts]
        if not linears or len(linears) != len(acts) + 1 or \
                not all(isinstance(m, nn.Linear) for m in linears) or \
                None in names or len(set(names)) > 1:
            raise ValueError("sequential must alternate nn.Linear layers and one kind of "
                             "activation module (ReLU, GELU, SiLU, Sigmoid or Tanh), starting "
                             "and ending with nn.Linear")
        sizes = [linears[0].in_features] + [m.out_features for m in linears]
        for a, b in zip(linears[:-1], linears[1:]):
            if a.out_features != b.in_features:
                raise ValueError(f"sequential's layers do not chain: {a} then {b}")
        mlp = cls.__new__(cls)
        nn.Module.__init__(mlp)
        mlp.sizes = sizes
        activation = names[0] if names else "none"
        mlp.layers = nn.ModuleList(
            FusedLinear.from_linear(m, activation if i + 1 < len(linears) else "none")
            for i, m in enumerate(linears))
        return mlp


class SoftmaxCrossEntropyLoss(nn.Module):
    """Drop-in for nn.CrossEntropyLoss (class-index targets) on the fused LossGrad kernel."""

    def __init__(self, reduction="mean", label_smoothing=0.0, ignore_index=-100):
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be one of mean, sum, none; got {reduction!r}")
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.ignore_index = ignore_index

    def forward(self, logits, labels):
        """The cross-entropy of logits against labels (class indices), reduced as `reduction`
        says, with its gradient computed in the same pass (dpcuda.ops.loss_grad)."""
        return ops.softmax_cross_entropy(logits, labels, self.reduction, self.label_smoothing,
                                         self.ignore_index)


_ACTIVATION_MODULES = {"relu": nn.ReLU, "gelu": nn.GELU,
                       "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "silu": nn.SiLU,
                       "sigmoid": nn.Sigmoid, "tanh": nn.Tanh}


def _has_hooks(module):
    """Whether module has hooks of its own, which fusing would drop or feed another tensor."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def _has_grad_hooks(param):
    """Whether a parameter has gradient hooks (register_hook, post-accumulate-grad hooks)."""
    return bool(param._backward_hooks or param._post_accumulate_grad_hooks)


_ACTIVATION_TYPES = {nn.ReLU: "relu", nn.SiLU: "silu", nn.Sigmoid: "sigmoid", nn.Tanh: "tanh"}


def _activation_name(module):
    """The fused activation name of an activation module of exactly one of the supported
    classes (a subclass may compute something else), or None."""
    if type(module) is nn.GELU:
        return "gelu_tanh" if module.approximate == "tanh" else "gelu"
    return _ACTIVATION_TYPES.get(type(module))


def _why_not_exact(module):
    """Why an nn.Linear (or an activation) cannot be fused exactly, or None if it can."""
    from torch.nn.utils import parametrize
    if parametrize.is_parametrized(module):
        return "it is parametrized (its weight is computed from other tensors)"
    if isinstance(module, nn.Linear) and type(module) is not nn.Linear:
        return f"it is a {type(module).__module__}.{type(module).__qualname__}, not nn.Linear"
    if _has_hooks(module):
        return "it has hooks of its own"
    return None


def fuse(module):
    """Replaces, in place, each nn.Linear that an nn.Sequential follows with a supported
    activation (ReLU, GELU, SiLU, Sigmoid, Tanh) by one FusedLinear sharing its parameters, and
    the activation by nn.Identity so indices and state_dict keys stay as they were. Returns
    the module; a bare nn.Linear passed in comes back as a FusedLinear with no activation.

    Only what is exactly torch's is fused: an nn.Linear itself (not a subclass, which may have
    a forward of its own, as torch.ao's QAT Linear does; not parametrized, as weight_norm makes
    it; no hooks) followed by an activation of exactly one of those classes with no hooks, in
    an nn.Sequential itself (not a subclass). Anything else that looks like a candidate is left
    as it is, with one warning naming it. Code that calls a fused pair's nn.Linear directly
    (seq[0](x) outside the Sequential) gets the activation too: fuse a model only where its
    Sequentials are run as Sequentials."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    left = []
    fused = _fuse(module, "", left)
    if left:
        warnings.warn("dpcuda.nn.fuse: left unfused (fusing would change what they compute): "
                      + "; ".join(left), UserWarning, stacklevel=2)
    return fused


def _fuse(module, prefix, left):
    if isinstance(module, nn.Linear):
        why = _why_not_exact(module)
        if why is not None:
            left.append(f"{prefix or 'the module'}: {why}")
            return module
        return FusedLinear.from_linear(module) if not prefix else module
    for name, child in module.named_children():
        if not isinstance(child, nn.Linear):
            _fuse(child, f"{prefix}{name}.", left)
    if isinstance(module, nn.Sequential) and type(module) is not nn.Sequential:
        # A subclass may have a forward of its own (a residual around the activation, say).
        children = list(module._modules.values())
        if any(isinstance(a, nn.Linear) and _activation_name(b) is not None
               for a, b in zip(children, children[1:])):
            left.append(f"{prefix or 'the module'}: it is a {type(module).__qualname__}, an "
                        f"nn.Sequential subclass whose forward may not run its layers in order")
    elif isinstance(module, nn.Sequential):
        names = list(module._modules.keys())
        for name, next_name in zip(names, names[1:] + [None]):
            linear = module._modules[name]
            if not isinstance(linear, nn.Linear):
                continue
            act = module._modules[next_name] if next_name is not None else None
            if not isinstance(act, tuple(_ACTIVATION_TYPES) + (nn.GELU,)):
                continue  # no activation to fuse with
            why = _why_not_exact(linear)
            activation = _activation_name(act)
            if why is not None:
                left.append(f"{prefix}{name}: {why}")
            elif activation is None:
                left.append(f"{prefix}{next_name}: it is a {type(act).__qualname__}, not "
                            f"torch's own activation class")
            elif _has_hooks(act):
                left.append(f"{prefix}{next_name}: it has hooks of its own")
            else:
                module._modules[name] = FusedLinear.from_linear(linear, activation)
                module._modules[next_name] = nn.Identity()
    return module
