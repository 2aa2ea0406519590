"""dpcuda: fused MLP layer kernels and data-parallel training for PyTorch.

    import dpcuda
    layer = dpcuda.nn.FusedLinear(784, 256, activation="relu")
    loss = dpcuda.ops.softmax_cross_entropy(logits, labels)
"""

import warnings

import torch

from . import _C, _heap  # noqa: F401  (_heap: glibc's malloc thresholds, docs/guide.md)


def _own_cxx_runtime(path):
    """Whether the shared library at path carries its own copy of the C++ runtime (libstdc++
    linked statically, as some compiler wrappers do): its __cxa_throw is then not the one of the
    process's libstdc++. False where that cannot be told (no libstdc++.so.6, no such symbol)."""
    import ctypes
    try:
        theirs = ctypes.CDLL("libstdc++.so.6").__cxa_throw
        ours = ctypes.CDLL(path).__cxa_throw
    except (OSError, AttributeError):
        return False
    return ctypes.cast(ours, ctypes.c_void_p).value != ctypes.cast(theirs, ctypes.c_void_p).value


# Such a build loads and mostly works, but an exception that crosses the two runtimes (torch's
# c10::Error raised by an argument check and caught by the binding, say) can crash the process
# later: seen on a GPU machine whose compiler wrapper added -static-libstdc++ (segmentation
# faults in the test suite, all at an argument check's error). Refuse it here, with the fix.
if _own_cxx_runtime(_C.__file__):
    raise ImportError(
        f"dpcuda's extension {_C.__file__} carries its own copy of the C++ runtime (its compiler "
        "linked libstdc++ statically, as a wrapper adding -static-libstdc++ does), so errors "
        "raised in C++ can crash the process; rebuild it with the system compiler, e.g. "
        "CXX=/usr/bin/g++ CC=/usr/bin/gcc pip install --no-build-isolation -e .")

from . import ops, nn, optim, reference, parallel  # noqa: E402

__all__ = ["built_with_cuda", "cuda_available", "load_checkpoint_model", "ops", "nn", "optim",
           "parallel", "reference"]


def load_checkpoint_model(path, device="cpu"):
    """The model of a `python -m dpcuda train` checkpoint, ready for inference (eval mode),
    taking raw features (the saved standardisation is applied first). See dpcuda.train."""
    from .checkpoint import load_checkpoint_model as load
    return load(path, device)
__version__ = "0.1.0"


def built_with_cuda():
    """True when the extension was compiled with its CUDA kernels."""
    return bool(_C.built_with_cuda())


def cuda_available():
    """True when the CUDA kernels were compiled in, there is a CUDA device, and every CUDA
    device here can run them: its compute capability is covered by the build's architectures
    (TORCH_CUDA_ARCH_LIST), read from the device's properties without creating a CUDA context.
    A GPU older than every architecture of the build cannot: then this warns once, naming the
    device and the fix, and returns False (dpcuda's ops on it raise the same message)."""
    if not (built_with_cuda() and torch.cuda.is_available()):
        return False
    archs = _C._cuda_archs()
    for device in range(torch.cuda.device_count()):
        capability = torch.cuda.get_device_capability(device)
        if not _archs_cover(archs, capability):
            error = (f"dpcuda's CUDA kernels cannot run on cuda:{device} "
                     f"({torch.cuda.get_device_name(device)}, compute capability "
                     f"{capability[0]}.{capability[1]}): this build has "
                     f"TORCH_CUDA_ARCH_LIST=\"{archs}\"; rebuild with TORCH_CUDA_ARCH_LIST="
                     f"\"{capability[0]}.{capability[1]}\" (pip install --no-build-isolation "
                     f"-e .), or use the CPU")
            if error not in _warned:
                _warned.add(error)
                warnings.warn(error, RuntimeWarning, stacklevel=2)
            return False
    return True


def _archs_cover(archs, capability):
    """Whether a TORCH_CUDA_ARCH_LIST ("7.5+PTX;8.0;9.0+PTX") has code for a device of this
    compute capability: machine code of the same major version and no newer minor one, or PTX
    of no newer version (which the driver compiles). An unreadable list is taken to cover."""
    try:
        entries = [e for e in archs.replace(" ", ";").split(";") if e]
        parsed = [(tuple(int(v) for v in e.replace("+PTX", "").split(".")), e.endswith("+PTX"))
                  for e in entries]
    except ValueError:
        return True
    if not parsed:
        return True
    return any((version[0] == capability[0] and version[1] <= capability[1]) or
               (ptx and version <= tuple(capability)) for version, ptx in parsed)


_warned = set()
