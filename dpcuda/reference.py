"""Pure-PyTorch reference implementations of dpcuda's ops.

They are the test oracle and the documentation of the math: each function computes, with plain
torch operations, exactly what the fused kernel of the same name computes.
"""

import math

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATIONS", "activation", "activation_grad", "full_forward", "full_backward",
           "loss_grad"]

ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh")


def activation(z, name):
    """The activation `name` applied to the pre-activation z."""
    if name == "none":
        return z
    if name == "relu":
        return torch.relu(z)
    if name == "gelu":
        return F.gelu(z)
    if name == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if name == "silu":
        return F.silu(z)
    if name == "sigmoid":
        return torch.sigmoid(z)
    if name == "tanh":
        return torch.tanh(z)
    raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}; got {name!r}")


def activation_grad(z, name):
    """d act(z) / dz, written out in closed form."""
    if name == "none":
        return torch.ones_like(z)
    if name == "relu":
        return (z > 0).to(z.dtype)
    if name == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(z / math.sqrt(2.0)))
        pdf = torch.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
        return cdf + z * pdf
    if name == "gelu_tanh":
        k = math.sqrt(2.0 / math.pi)
        t = torch.tanh(k * (z + 0.044715 * z ** 3))
        return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * k * (1 + 3 * 0.044715 * z * z)
    if name == "silu":
        s = torch.sigmoid(z)
        return s * (1 + z * (1 - s))
    if name == "sigmoid":
        s = torch.sigmoid(z)
        return s * (1 - s)
    if name == "tanh":
        return 1 - torch.tanh(z) ** 2
    raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}; got {name!r}")


def full_forward(x, weight, bias=None, activation_name="relu"):
    """act(x @ weight.T + bias) for x of shape (..., in)."""
    return activation(F.linear(x, weight, bias), activation_name)


def full_backward(grad_output, x, weight, bias=None, activation_name="relu"):
    """(grad_input, grad_weight, grad_bias) of full_forward, recomputing the pre-activation."""
    z = F.linear(x, weight, bias)
    g = (grad_output * activation_grad(z, activation_name)).reshape(-1, weight.shape[0])
    x2 = x.reshape(-1, weight.shape[1])
    return (g @ weight).reshape(x.shape), g.t() @ x2, g.sum(0)


def loss_grad(logits, labels, scale=1.0, label_smoothing=0.0, ignore_index=-100):
    """Per-row loss and d loss / d logits of softmax cross-entropy, both times `scale`."""
    classes = logits.shape[1]
    logp = torch.log_softmax(logits, dim=1)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    eps = label_smoothing
    nll = -logp.gather(1, safe[:, None])[:, 0]
    smooth = -logp.sum(1) / classes
    loss = torch.where(valid, (1 - eps) * nll + eps * smooth, torch.zeros_like(nll))
    target = torch.full_like(logits, eps / classes)
    target.scatter_add_(1, safe[:, None], torch.full_like(logits[:, :1], 1 - eps))
    grad = (logp.exp() - target) * valid[:, None].to(logits.dtype)
    return scale * loss, scale * grad

