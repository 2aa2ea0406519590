"""Drop-in modules over the fused ops.

    FusedLinear(in, out, bias=True, activation="relu")   nn.Linear + activation in one op
    FusedMLP([784, 256, 10], activation="relu")          no activation after the last layer
    SoftmaxCrossEntropyLoss(...)                          nn.CrossEntropyLoss
    fuse(module)                                          nn.Linear + activation -> FusedLinear
"""

import math

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

    def forward(self, x):
        return ops.full_forward(x, self.weight, self.bias, self.activation)

    def extra_repr(self):
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
        for layer in self.layers:
            x = layer(x)
        return x


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
        return ops.softmax_cross_entropy(logits, labels, self.reduction, self.label_smoothing,
                                         self.ignore_index)


def _activation_name(module):
    """The fused activation name of an activation module, or None if it has none."""
    if isinstance(module, nn.ReLU):
        return "relu"
    if isinstance(module, nn.GELU):
        return "gelu_tanh" if module.approximate == "tanh" else "gelu"
    if isinstance(module, nn.SiLU):
        return "silu"
    if isinstance(module, nn.Sigmoid):
        return "sigmoid"
    if isinstance(module, nn.Tanh):
        return "tanh"
    return None


def fuse(module):
    """Replaces, in place, each nn.Linear that an nn.Sequential follows with a supported
    activation (ReLU, GELU, SiLU, Sigmoid, Tanh) by one FusedLinear sharing its parameters, and
    the activation by nn.Identity so indices and state_dict keys stay as they were. Returns
    the module; a bare nn.Linear passed in comes back as a FusedLinear with no activation."""
    if isinstance(module, nn.Linear):
        return FusedLinear.from_linear(module)
    for child in module.children():
        if not isinstance(child, nn.Linear):
            fuse(child)
    if isinstance(module, nn.Sequential):
        names = list(module._modules.keys())
        for name, next_name in zip(names[:-1], names[1:]):
            linear, act = module._modules[name], module._modules[next_name]
            activation = _activation_name(act)
            if isinstance(linear, nn.Linear) and activation is not None:
                module._modules[name] = FusedLinear.from_linear(linear, activation)
                module._modules[next_name] = nn.Identity()
    return module
