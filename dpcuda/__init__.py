"""dpcuda: fused MLP layer kernels and data-parallel training for PyTorch.

    import dpcuda
    layer = dpcuda.nn.FusedLinear(784, 256, activation="relu")
    loss = dpcuda.ops.softmax_cross_entropy(logits, labels)
"""

import warnings

import torch

from . import _C
from . import ops, nn, reference

__all__ = ["built_with_cuda", "cuda_available", "ops", "nn", "reference"]
__version__ = "0.1.0"


def built_with_cuda():
    """True when the extension was compiled with its CUDA kernels."""
    return bool(_C.built_with_cuda())


def cuda_available():
    """True when the CUDA kernels were compiled in, there is a CUDA device, and every CUDA
    device here can run them (a GPU older than every architecture of the build cannot: then
    this warns once, naming the device and the fix, and returns False)."""
    if not (built_with_cuda() and torch.cuda.is_available()):
        return False
    for device in range(torch.cuda.device_count()):
        error = _C._kernel_image_error(device)
        if error:
            if error not in _warned:
                _warned.add(error)
                warnings.warn(error, RuntimeWarning, stacklevel=2)
            return False
    return True


_warned = set()
