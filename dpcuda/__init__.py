"""dpcuda: fused MLP layer kernels and data-parallel training for PyTorch.

    import dpcuda
    layer = dpcuda.nn.FusedLinear(784, 256, activation="relu")
    loss = dpcuda.ops.softmax_cross_entropy(logits, labels)
"""

import torch

from . import _C
from . import ops, nn, reference

__all__ = ["built_with_cuda", "cuda_available", "ops", "nn", "reference"]
__version__ = "0.1.0"


def built_with_cuda():
    """True when the extension was compiled with its CUDA kernels."""
    return bool(_C.built_with_cuda())


def cuda_available():
    """True when the CUDA kernels were compiled in and a CUDA device can run them here."""
    return built_with_cuda() and torch.cuda.is_available()
