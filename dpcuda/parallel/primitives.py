"""The data-parallel primitives, with torch.nn.parallel's names and meaning:

    replicate(module, devices)              one copy of module per device (devices may repeat)
    scatter(batch, devices, weights=None)   row slices of a (nested) batch, one per device
    gather(outputs, device)                 the replicas' outputs concatenated on one device
    parallel_apply(replicas, inputs)        replica i applied to inputs[i]
    all_reduce(tensors, op, algorithm)      in place; the same bits on every replica
"""

import contextlib
import copy
import dataclasses
import math
import threading
import warnings

import torch

from .. import _C  # noqa: F401  (registers torch.ops.dpcuda.*)

__all__ = ["replicate", "scatter", "gather", "parallel_apply", "all_reduce", "split_sizes",
           "ALGORITHMS", "MAX_REPLICAS"]

ALGORITHMS = ("auto", "one_shot", "two_shot", "ring")
MAX_REPLICAS = 16


# ---------------------------------------------------------------------------------------------
# devices

def _device(value, name):
    """torch.device of value, checked to exist on this machine."""
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"{name}: {value!r} is not a device ({err})") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = 0 if device.index is None else device.index
        if index >= count:
            raise ValueError(f"{name}: {value!r} does not exist; this machine has {count} CUDA "
                             f"device{'s' if count != 1 else ''}")
        device = torch.device("cuda", index)
    elif device.type != "cpu":
        raise ValueError(f"{name}: {value!r} is not supported; use 'cpu' or 'cuda:N'")
    return device


def _devices(devices):
    if isinstance(devices, (str, torch.device, int)):
        devices = [devices]
    devices = list(devices)
    if not devices:
        raise ValueError("devices must name at least one device")
    if len(devices) > MAX_REPLICAS:
        raise ValueError(f"devices names {len(devices)} replicas; at most {MAX_REPLICAS} are "
                         f"supported")
    return [_device(d, f"devices[{i}]") for i, d in enumerate(devices)]


# ---------------------------------------------------------------------------------------------
# primitives

def replicate(module, devices):
    """One independent copy of module per entry of devices (deep copies, so a device named
    twice gets two replicas)."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    return [copy.deepcopy(module).to(d) for d in _devices(devices)]


def split_sizes(rows, parts, weights=None):
    """How many of `rows` rows each of `parts` replicas gets: as even as possible (the first
    rows % parts get one more), or proportional to weights by largest remainder (ties to the
    lower index). A replica may get zero rows."""
    if not isinstance(rows, int) or rows < 0:
        raise ValueError(f"rows must be a non-negative int, got {rows!r}")
    if weights is None:
        return [rows // parts + (1 if i < rows % parts else 0) for i in range(parts)]
    weights = [float(w) for w in weights]
    if len(weights) != parts:
        raise ValueError(f"weights has {len(weights)} entries for {parts} replicas")
    if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be finite, non-negative and not all zero, got {weights}")
    total = sum(weights)
    exact = [rows * w / total for w in weights]
    sizes = [int(math.floor(e)) for e in exact]
    order = sorted(range(parts), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in order[:rows - sum(sizes)]:
        sizes[i] += 1
    return sizes


def scatter(batch, devices, weights=None):
    """Row slices of batch moved to each device: a list with one entry per device, each of
    batch's structure. batch is a tensor, or tuples, lists, dicts and dataclasses of them
    (nested); every tensor with a batch dimension is sliced along dim 0 (they must all have
    the same number of rows), and anything else (a 0-dim tensor, a number, None) is given to
    every replica as it is (0-dim tensors moved to its device). The split is even by default,
    proportional to weights otherwise (split_sizes)."""
    devices = _devices(devices)
    rows = batch_rows(batch)
    if rows is None:
        raise TypeError("batch must hold at least one tensor with a batch dimension")
    return scatter_sizes(batch, devices, split_sizes(rows, len(devices), weights))


def _leaves(obj):
    """The tensors of a nested structure, in order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # (the fields its constructor takes, as _map and _gather rebuild it)
        for f in dataclasses.fields(obj):
            if f.init:
                yield from _leaves(getattr(obj, f.name))
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _leaves(v)


def _map(fn, obj):
    """obj with every tensor t replaced by fn(t) (tuples, named tuples, lists, dicts and
    dataclasses rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _map(fn, getattr(obj, f.name))
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, dict):
        return type(obj)((k, _map(fn, v)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(_map(fn, v) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map(fn, v) for v in obj)
    return obj


def batch_rows(batch):
    """The number of rows of batch's tensors (those with a batch dimension; all must agree),
    or None if it has none."""
    rows = [t.shape[0] for t in _leaves(batch) if t.dim() > 0]
    if not rows:
        return None
    if any(r != rows[0] for r in rows):
        raise ValueError(f"the batch's tensors have different numbers of rows (dim 0): {rows}")
    return rows[0]


def scatter_sizes(batch, devices, sizes):
    """batch's row slices, sizes[i] rows to devices[i] (the devices already checked)."""
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)

    def part(i):
        def cut(t):
            piece = t[bounds[i]:bounds[i + 1]] if t.dim() > 0 else t
            return piece.to(devices[i], non_blocking=True)
        return _map(cut, batch)
    return [part(i) for i in range(len(devices))]


def gather(outputs, device):
    """The replicas' outputs concatenated along dim 0 on device, with autograd: outputs is one
    entry per replica, each of the same structure (a tensor, or tuples, lists, dicts and
    dataclasses of them). 0-dim tensors (one per replica) are stacked into a vector, with a
    warning, as torch.nn.parallel.gather does; anything that is not a tensor is taken from the
    first replica."""
    device = _device(device, "device")
    outputs = list(outputs)
    if not outputs:
        raise ValueError("outputs must hold one entry per replica")
    return _gather(outputs, device)


def _gather(outputs, device):
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(o, torch.Tensor) for o in outputs):
            raise TypeError("the replicas returned different structures")
        if first.dim() == 0:
            warnings.warn("dpcuda.parallel.gather: the replicas returned scalars; gathered "
                          "into a vector, one entry per replica", UserWarning, stacklevel=3)
            return torch.stack([o.to(device) for o in outputs])
        return torch.cat([o.to(device) for o in outputs], dim=0)
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        return dataclasses.replace(first, **{
            f.name: _gather([getattr(o, f.name) for o in outputs], device)
            for f in dataclasses.fields(first) if f.init})
    if isinstance(first, (dict, list, tuple)) and any(
            type(o) is not type(first) or len(o) != len(first) for o in outputs):
        raise ValueError(f"dpcuda.parallel.gather: the replicas returned {type(first).__name__}s "
                         f"of different lengths ({[len(o) for o in outputs]}): an entry per "
                         f"row cannot be gathered; return the rows as one tensor")
    if isinstance(first, dict):
        return type(first)((k, _gather([o[k] for o in outputs], device)) for k in first)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(_gather(list(vs), device) for vs in zip(*outputs)))
    if isinstance(first, (tuple, list)):
        return type(first)(_gather(list(vs), device) for vs in zip(*outputs))
    return first


def _run_all(fns, devices, concurrent=False, on_error=None):
    """Runs every fn: one thread per replica when the replicas are on different devices (so
    host work on one overlaps kernels on another, as nn.parallel.parallel_apply does), in order
    on this thread when they share a device (threads would only compete for it). A thread runs
    with the caller's grad mode, autocast state and current CUDA stream of its device. Every fn
    runs; the first exception is raised after all have finished. concurrent=True gives every
    fn a thread even on a shared device (they must run at once: buffers="sync"), and on_error
    is called as soon as one fails (to wake the others)."""
    results = [None] * len(fns)
    errors = [None] * len(fns)
    threaded = len(fns) > 1 and (concurrent or len(set(devices)) == len(devices))
    # What a worker thread does not inherit and torch.nn.parallel.parallel_apply carries over:
    # grad mode, autocast (per device type) and, per CUDA device, the caller's current stream.
    # (read only for threads: on this thread they hold as they are)
    grad_enabled = torch.is_grad_enabled() if threaded else None
    kinds = (["cpu"] + (["cuda"] if torch.cuda.is_available() else [])) if threaded else []
    autocast = {k: (torch.is_autocast_enabled(k), torch.get_autocast_dtype(k)) for k in kinds}
    streams = [torch.cuda.current_stream(d) if d.type == "cuda" else None for d in devices]

    def call(i):
        if devices[i].type == "cuda":
            with torch.cuda.device(devices[i]), torch.cuda.stream(streams[i]):
                return fns[i]()
        return fns[i]()

    def run(i):
        try:
            if not threaded:
                results[i] = call(i)
                return
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.set_grad_enabled(grad_enabled))
                for kind, (enabled, dtype) in autocast.items():
                    stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
                results[i] = call(i)
        except BaseException as err:  # re-raised below, on the caller's thread
            errors[i] = err
            if on_error is not None:
                on_error()

    if threaded:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in range(len(fns)):
            run(i)
    failed = [e for e in errors if e is not None]
    for err in sorted(failed, key=lambda e: getattr(e, "dpcuda_secondary", False)):
        raise err
    return results


def parallel_apply(replicas, inputs):
    """[replicas[i](inputs[i])]; a tuple input is unpacked into arguments."""
    if len(replicas) != len(inputs):
        raise ValueError(f"{len(replicas)} replicas but {len(inputs)} inputs")
    devices = [_module_device(m) for m in replicas]
    fns = [(lambda m=m, x=x: m(*x) if isinstance(x, tuple) else m(x))
           for m, x in zip(replicas, inputs)]
    return _run_all(fns, devices)


def _module_device(module):
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def all_reduce(tensors, op="sum", algorithm="auto"):
    """Sums (op="sum") or averages (op="mean") tensors in place: every tensor ends holding the
    same values, bit for bit, summed in one fixed order (tensors[0] + tensors[1] + ...)
    whatever the algorithm. The tensors live on the replicas' devices (CPU, or CUDA devices that
    may repeat) and must have one dtype and size. Returns tensors."""
    if isinstance(tensors, torch.Tensor) or not all(isinstance(t, torch.Tensor)
                                                     for t in tensors):
        raise TypeError("tensors must be a list of tensors")
    tensors = list(tensors)
    if not tensors:
        raise ValueError("tensors must hold at least one tensor")
    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}; got {algorithm!r}")
    torch.ops.dpcuda.all_reduce_(tensors, op, algorithm)
    return tensors
