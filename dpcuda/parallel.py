"""Data-parallel training: the primitives (with torch.nn.parallel's names and meaning), the
replica all-reduce, and DataParallel, which runs one SGD step of a global batch over k replicas.

    replicate(module, devices)              one copy of module per device (devices may repeat)
    scatter(batch, devices, weights=None)   row slices of a tensor (or tuple of tensors)
    gather(outputs, device)                 the slices concatenated on one device
    parallel_apply(replicas, inputs)        replica i applied to inputs[i]
    all_reduce(tensors, op, algorithm)      in place; the same bits on every replica
    DataParallel(module, devices, reducer="p2p"|"host"|"dist", split="even"|"weighted"|"auto",
                 lr=..., momentum=0.0, weight_decay=0.0, blocking=True)

Training with k replicas gives the model that training the same global batches on one device
gives (up to float rounding): each replica's loss is weighted by its share of the global batch,
so the summed gradient is the gradient of the global batch's mean loss.
"""

import collections
import contextlib
import copy
import math
import re
import threading
import time
import warnings

import torch

from . import _C  # noqa: F401  (registers torch.ops.dpcuda.*)
from . import ops
from .batchnorm import Exchange, replica_context, sync_batch_norm_
from .nn import FusedLinear, SoftmaxCrossEntropyLoss

__all__ = ["replicate", "scatter", "gather", "parallel_apply", "all_reduce", "split_sizes",
           "DataParallel", "REDUCERS", "SPLITS", "ALGORITHMS"]

REDUCERS = ("p2p", "host", "dist")
BUFFERS = ("broadcast", "sync")
SPLITS = ("even", "weighted", "auto")
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
    """Row slices of batch (a tensor, or a tuple/list of tensors with the same number of rows)
    moved to each device: an even split by default, proportional to weights otherwise."""
    devices = _devices(devices)
    tensors = batch if isinstance(batch, (tuple, list)) else (batch,)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError("batch must be a tensor or a tuple of tensors")
    if any(t.dim() == 0 for t in tensors):
        raise ValueError("batch tensors must have a leading batch dimension")
    rows = tensors[0].shape[0]
    if any(t.shape[0] != rows for t in tensors):
        raise ValueError(f"batch tensors have different numbers of rows: "
                         f"{[t.shape[0] for t in tensors]}")
    parts = _slices(tensors, devices, split_sizes(rows, len(devices), weights))
    return parts if isinstance(batch, (tuple, list)) else [p[0] for p in parts]


def _slices(tensors, devices, sizes):
    """Consecutive row slices of every tensor, sizes[i] rows moved to devices[i]."""
    out, start = [], 0
    for device, size in zip(devices, sizes):
        out.append(tuple(t[start:start + size].to(device, non_blocking=True) for t in tensors))
        start += size
    return out


def gather(outputs, device):
    """outputs concatenated along the batch dimension on device."""
    device = _device(device, "device")
    return torch.cat([o.to(device) for o in outputs], dim=0)


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
    grad_enabled = torch.is_grad_enabled()
    kinds = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
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


# ---------------------------------------------------------------------------------------------
# DataParallel

def _summed_loss(loss_fn, targets):
    """For a loss that averages over the rows it does not ignore (a "mean" cross-entropy,
    nn.CrossEntropyLoss or dpcuda's SoftmaxCrossEntropyLoss, on class-index targets): the same
    loss as a sum over its rows, and its ignore_index. None for any other loss_fn, which must
    return the mean over all its rows. Half precision logits sum in float32: a float16 sum of a
    few thousand rows' losses overflows where the mean would not."""
    def summed(per_row):
        def fn(out, y):
            if out.dtype in (torch.float16, torch.bfloat16):
                return per_row(out, y, "none").sum(dtype=torch.float32)
            return per_row(out, y, "sum")
        return fn

    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        return None
    if isinstance(loss_fn, SoftmaxCrossEntropyLoss) and loss_fn.reduction == "mean":
        return summed(lambda out, y, reduction: ops.softmax_cross_entropy(
            out, y, reduction, loss_fn.label_smoothing, loss_fn.ignore_index)), \
            loss_fn.ignore_index
    if targets.dtype != torch.long:  # torch's losses take int64 class indices only
        return None
    F = torch.nn.functional
    if isinstance(loss_fn, torch.nn.CrossEntropyLoss) and loss_fn.reduction == "mean" and \
            loss_fn.weight is None:
        return summed(lambda out, y, reduction: F.cross_entropy(
            out, y, reduction=reduction, ignore_index=loss_fn.ignore_index,
            label_smoothing=loss_fn.label_smoothing)), loss_fn.ignore_index
    if loss_fn is F.cross_entropy:
        return summed(lambda out, y, reduction: F.cross_entropy(out, y, reduction=reduction)), \
            -100
    return None


class _Replica:
    """One replica: its module, its trainable parameters viewed into one flat buffer, their
    gradients viewed into another, and its momentum buffer. The gradient buffer (flat_grad) is
    the head of `exchange`, which has `record` more elements behind it: room for what the
    reducer "dist" sends with the gradients (the loss, the rows, the bad-label flag). Frozen
    parameters (requires_grad=False when the wrapper is made) stay out of the buffers and are
    never updated, as torch.optim.SGD skips a parameter without a gradient: no weight decay, no
    momentum."""

    def __init__(self, module, device, momentum, record=0):
        self.module = module
        self.device = device
        params = list(module.parameters())
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise TypeError(f"every parameter must have one floating dtype, got {sorted(map(str, dtypes))}")
        dtype = dtypes.pop()
        if not dtype.is_floating_point:
            raise TypeError(f"parameters must be floating point, got {dtype}")
        trainable = [p for p in params if p.requires_grad]
        total = sum(p.numel() for p in trainable)
        self.flat_param = torch.empty(total, dtype=dtype, device=device)
        self.exchange = torch.zeros(total + record, dtype=dtype, device=device)
        self.flat_grad = self.exchange[:total]
        self.momentum = torch.zeros(total, dtype=dtype, device=device) if momentum else None
        self.spans = []  # each trainable parameter's (offset, numel) in the flat buffers
        offset = 0
        for p in trainable:
            n = p.numel()
            self.flat_param[offset:offset + n].copy_(p.detach().reshape(-1))
            p.data = self.flat_param[offset:offset + n].view_as(p)
            p.grad = self.flat_grad[offset:offset + n].view_as(p)
            self.spans.append((offset, n))
            offset += n
        self.params = params
        self.frozen = [p for p in params if not p.requires_grad]
        self.grads = [(p, p.grad) for p in trainable]
        self.unused = set()  # the parameters the last backward gave no gradient (indices)
        # step_status's workspace (CUDA: int32 zeros, left zero by every launch)
        ints = _C._step_status_ints() if torch.device(device).type == "cuda" else 0
        self.status_work = torch.zeros(ints, dtype=torch.int32, device=device)
        # The fused layers' backwards write their gradients straight into the buffer (see
        # collect_grads); not for a parameter that two layers share, whose two gradients would
        # be written to one place.
        # (A parametrized weight is not a parameter of its layer: it takes the usual path.)
        layers = [m for m in module.modules() if isinstance(m, FusedLinear)]
        own = [(m._parameters.get("weight"), m._parameters.get("bias")) for m in layers]
        uses = {}
        for pair in own:
            for q in pair:
                if q is not None:
                    uses[id(q)] = uses.get(id(q), 0) + 1

        def into(q):
            return q if q is not None and q.requires_grad and uses[id(q)] == 1 else None
        self.fused = [(m, (into(w), into(b))) for m, (w, b) in zip(layers, own)]
        self.views = {id(p): view for p, view in self.grads}

    def release_grads(self):
        """Before a step's forward: .grad None (autograd then takes the fused layers' gradients,
        which are views of the buffer, as they are) and each fused layer told where its
        backward writes."""
        for p, _ in self.grads:
            p.grad = None
        for m, params in self.fused:
            # Not for a parameter with gradient hooks: they would be handed the buffer itself,
            # which the next step overwrites, where torch hands them a tensor of their own.
            into = tuple(self.views.get(id(q)) if q is not None and not q._backward_hooks
                         else None for q in params)
            m._grads_into = into if any(t is not None for t in into) else None

    def collect_grads(self):
        """After the backward (or a failure): every gradient in the buffer and .grad the
        buffer's view again. A fused layer's gradient is there already; any other is copied in;
        a parameter that got none (unused by this forward, or a replica without rows) is 0."""
        for m, _ in self.fused:
            m._grads_into = None
        self.unused = set()
        for i, (p, view) in enumerate(self.grads):
            g = p.grad
            if g is None:
                self.unused.add(i)
                view.zero_()
            elif g.data_ptr() != view.data_ptr():
                view.copy_(g)
            p.grad = view


class DataParallel:
    """One SGD step of a global batch over replicas of module on devices.

    devices may repeat a device (["cpu", "cpu"], ["cuda:0", "cuda:0"]): each entry is one
    replica. reducer "p2p" reduces the replicas' flat gradient buffers device to device with
    dpcuda's all-reduce and fuses the SGD update into it; "host" is the classic scheme
    (gradients copied to host memory, summed and applied there, weights copied back); "dist"
    also all-reduces across processes with torch.distributed (one process per machine or
    device, started by torchrun; each process steps on its own part of the global batch).
    split "even" gives every replica the same rows, "weighted" rows proportional to
    split_weights, "auto" rows proportional to each replica's measured speed.

    buffers says what batch norm does across replicas: "broadcast" (default, as DDP) gives every
    replica (and process) replica 0's buffers (of rank 0) after each step, so the statistics
    are those of replica 0's rows; "sync" normalises BatchNorm1d/2d/3d in training mode with
    the statistics of the whole global batch, as one device would (dpcuda.batchnorm; not with
    reducer "dist"). timeout bounds each wait of that exchange (seconds).

    step(inputs, targets, loss_fn) runs forward, loss, backward and the update, and returns the
    global batch's mean loss as a float. loss_fn(outputs, targets) must return the mean loss of
    its rows (as nn.CrossEntropyLoss does by default). A step whose gradients hold NaN or Inf is
    skipped with a warning; a step that raises leaves every replica's weights and buffers as
    they were.

    blocking=False (reducer "p2p") makes a step wait for nothing on the devices: the update
    reads the replicas' status records on the device and skips itself there on NaN/Inf
    gradients or a bad label, and step() returns the loss as a float64 scalar tensor on
    devices[0] (not yet computed when it returns). What a step found is read later, once the
    device has it: at a later step() (which first waits for the step `lag` steps back, so the
    host runs at most `lag` steps ahead) or at synchronize(). A skipped step then warns and
    counts in skipped_steps; a bad label (seen by the CUDA loss kernel; on the CPU a bad label
    raises in its own step, as a blocking step's) raises there, naming the step and the
    position, before that call runs anything (the bad step's update was not applied; its
    forward's batch-norm statistics stay, as a skipped step's do; steps counts it). The state
    functions (state_dict, optimizer_state_dict and their loads) read every pending step first,
    so they too can raise a pending step's bad label (a load then changes nothing). With
    split="auto" (which times each replica) or buffers="sync" (which reads counts on the
    host) a step still synchronises.
    """

    # How many non-blocking steps the host may run ahead of what it has read.
    lag = 2
    # Non-blocking steps count the labels a mean is over on the device for labels on a GPU;
    # True makes them do so for labels in host memory too (a test hook: the CPU runs that path).
    _count_on_device = False

    # The model dtypes whose gradient buffer carries the reducer "dist" record (the loss; the
    # rows, exact to 2**24) behind the gradients; other dtypes send it in a float64 tensor.
    _record_inline = (torch.float32, torch.float64)

    def __init__(self, module, devices, reducer="p2p", split="even", lr=0.01, momentum=0.0,
                 weight_decay=0.0, split_weights=None, algorithm="auto", process_group=None,
                 buffers="broadcast", timeout=300.0, blocking=True):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if reducer not in REDUCERS:
            raise ValueError(f"reducer must be one of {', '.join(REDUCERS)}; got {reducer!r}")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")
        if buffers not in BUFFERS:
            raise ValueError(f"buffers must be one of {', '.join(BUFFERS)}; got {buffers!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
                not timeout > 0 or not math.isfinite(timeout):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if not isinstance(blocking, bool):
            raise TypeError(f"blocking must be True or False, got {blocking!r}")
        if not blocking and reducer != "p2p":
            raise ValueError(f"blocking=False needs reducer='p2p' (reducer {reducer!r} reads "
                             f"the gradients on the host at every step)")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}; got "
                             f"{algorithm!r}")
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a non-negative finite number, got {value!r}")
        self.devices = _devices(devices)
        self.reducer = reducer
        self.split = split
        self.algorithm = algorithm
        self.lr, self.momentum, self.weight_decay = float(lr), float(momentum), float(weight_decay)
        if split == "weighted":
            if split_weights is None:
                raise ValueError("split='weighted' needs split_weights, one number per replica")
            split_sizes(len(self.devices), len(self.devices), split_weights)  # validates
            self.split_weights = [float(w) for w in split_weights]
        else:
            self.split_weights = None
        self._speed = None  # rows per second of each replica, for split="auto"
        if reducer == "dist":
            import torch.distributed as dist
            if not dist.is_available() or not dist.is_initialized():
                raise RuntimeError("reducer='dist' needs torch.distributed initialised (start "
                                   "with torchrun and call dist.init_process_group first)")
            self._dist = dist
            self._group = process_group
            self._global_rows = None  # the last step's global batch
        self.buffers, self.timeout = buffers, float(timeout)
        copies = replicate(module, self.devices)
        self._sync_bn = False
        if buffers == "sync":
            if reducer == "dist":
                raise ValueError("buffers='sync' synchronises batch norm over the replicas of "
                                 "one process; with reducer='dist' use buffers='broadcast'")
            cuda = [d for d in self.devices if d.type == "cuda"]
            if len(set(cuda)) != len(cuda):
                raise ValueError("buffers='sync' needs one replica per CUDA device (the "
                                 "autograd engine runs a device's backwards on one thread)")
            self._sync_bn = sum(sync_batch_norm_(m) for m in copies) > 0
        self._replicas = [_Replica(m, d, self.momentum != 0.0, 3 if reducer == "dist" else 0)
                          for m, d in zip(copies, self.devices)]
        self._buffers = [list(r.module.buffers()) for r in self._replicas]
        if reducer == "dist":
            # Every process starts from rank 0's weights, frozen ones included.
            self._dist.broadcast(self._replicas[0].flat_param, src=0, group=self._group)
            for p in self._replicas[0].frozen:
                with torch.no_grad():
                    self._dist.broadcast(p.data, src=0, group=self._group)
            self._copy_params_from(0)
        if reducer == "host":
            self._host_param = self._replicas[0].flat_param.detach().to("cpu", copy=True)
            self._host_momentum = torch.zeros_like(self._host_param) if self.momentum else None
        self.steps = 0
        self.skipped_steps = 0
        self.blocking = blocking
        self._pending = collections.deque()  # the non-blocking steps not read yet

    # -- the model ---------------------------------------------------------------------------

    @property
    def module(self):
        """The model with the current weights (replica 0, on devices[0])."""
        return self._replicas[0].module

    @property
    def replicas(self):
        return [r.module for r in self._replicas]

    def state_dict(self):
        """The model's state_dict (the keys of the wrapped module). Reads every pending
        non-blocking step first (synchronize())."""
        self._settle(wait=True)
        return self.module.state_dict()

    def load_state_dict(self, state_dict):
        """Loads weights into every replica (the host master copy too); on error nothing
        changes. Reads every pending non-blocking step first (synchronize())."""
        self._settle(wait=True)
        probe = copy.deepcopy(self.module)
        probe.load_state_dict(state_dict)  # raises on missing keys or wrong shapes
        for r in self._replicas:
            with torch.no_grad():
                for p, q in zip(r.params, probe.parameters()):
                    p.copy_(q)
                for (_, b), (_, q) in zip(r.module.named_buffers(), probe.named_buffers()):
                    b.copy_(q)
        if self.reducer == "host":
            self._host_param.copy_(self._replicas[0].flat_param)

    def optimizer_state_dict(self):
        """The SGD state: hyper-parameters and the momentum buffer (flat, in parameter order).
        Reads every pending non-blocking step first (synchronize())."""
        self._settle(wait=True)
        momentum = None
        if self.momentum:
            source = self._host_momentum if self.reducer == "host" else self._replicas[0].momentum
            momentum = source.detach().to("cpu", copy=True)
        return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay,
                "momentum_buffer": momentum, "steps": self.steps}

    def load_optimizer_state_dict(self, state):
        self._settle(wait=True)
        buf = state.get("momentum_buffer")
        if buf is not None and self.momentum:
            if buf.numel() != self._replicas[0].flat_param.numel():
                raise ValueError(f"momentum_buffer has {buf.numel()} elements, the model has "
                                 f"{self._replicas[0].flat_param.numel()} parameters")
            for r in self._replicas:
                r.momentum.copy_(buf.reshape(-1))
            if self.reducer == "host":
                self._host_momentum.copy_(buf.reshape(-1))
        self.steps = int(state.get("steps", self.steps))

    # -- one step ----------------------------------------------------------------------------

    def _row_weights(self):
        if self.split == "weighted":
            return self.split_weights
        if self.split == "auto" and self._speed is not None:
            return self._speed
        return None

    @property
    def _inline(self):
        """Whether the reducer "dist" record rides behind the gradients (_record_inline)."""
        return self._replicas[0].flat_grad.dtype in self._record_inline

    def step(self, inputs, targets, loss_fn):
        if self._pending:
            self._settle(wait=False)
        # A step that raises leaves the buffers (batch-norm statistics) as they were, as it
        # leaves the weights.
        saved = [[b.clone() for b in bs] for bs in self._buffers] if self._buffers[0] else None
        try:
            loss = self._step_any(inputs, targets, loss_fn)
        except BaseException:
            # a flag a failed step raised (or left) must not speak for the next one (after a
            # sticky CUDA error this cannot run: the original error is the one to see)
            try:
                self._clear_label_flags()
            except Exception:
                pass
            if saved is not None:
                with torch.no_grad():
                    for bs, copies in zip(self._buffers, saved):
                        for b, c in zip(bs, copies):
                            b.copy_(c)
            raise
        if saved is not None and self.buffers == "broadcast":
            self._broadcast_buffers()
        return loss

    def _broadcast_buffers(self):
        """Every replica (and with reducer "dist" every process) takes replica 0's buffers (of
        rank 0), as DDP broadcasts rank 0's at each step."""
        with torch.no_grad():
            if self.reducer == "dist":
                for b in self._buffers[0]:
                    self._dist.broadcast(b, src=0, group=self._group)
            for bs in self._buffers[1:]:
                for b, b0 in zip(bs, self._buffers[0]):
                    b.copy_(b0)

    def _step_any(self, inputs, targets, loss_fn):
        if self.reducer != "dist":
            return self._step(inputs, targets, loss_fn)
        # Across processes a step that fails on one process (bad input, a bad label, an error
        # in its forward) must still take part in the step's collectives, or the others would
        # wait for it and then pair their next collectives with its next step's. So it joins
        # the exchange with a failure mark, every process raises, and none applies the step.
        self._dist_count = not self._global_rows or not self._inline
        self._dist_stage = 0  # 1: the count is done; 2: the exchange has begun
        try:
            return self._step(inputs, targets, loss_fn)
        except Exception:
            if self._dist_stage < 2:
                self._fail_exchange()
            raise

    def _step(self, inputs, targets, loss_fn):
        if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
            raise TypeError("inputs and targets must be tensors")
        if inputs.dim() == 0 or targets.dim() == 0:
            raise ValueError("inputs and targets must have a leading batch dimension")
        rows = inputs.shape[0]
        if targets.shape[0] != rows:
            raise ValueError(f"inputs has {rows} rows but targets has {targets.shape[0]}")
        if rows == 0:
            raise ValueError("the batch is empty")
        if rows < len(self._replicas):
            raise ValueError(f"the batch has {rows} rows, fewer than the {len(self._replicas)} "
                             f"replicas")
        sizes = split_sizes(rows, len(self._replicas), self._row_weights())
        parts = _slices((inputs, targets), self.devices, sizes)
        # What the loss is a mean over: the rows, or for a cross-entropy loss with class-index
        # targets the rows that are not ignored. Each replica's loss is its sum over that
        # denominator of the global batch, so every replica count computes the global mean.
        summed = _summed_loss(loss_fn, targets)
        # A non-blocking step does not read labels on a GPU: it scales by 1 / every label,
        # each replica's step_status counts its labels that are not ignored, and the update
        # rescales the gradient (and the loss) by labels / that count on the device (a factor
        # of exactly 1 when none is ignored). Not where gradients are float16 (a float16 model,
        # or float16 autocast): scaled by 1 / more labels than count, they would lose precision
        # to float16's subnormals before the rescale.
        kind = self._replicas[0].device.type
        half = self._replicas[0].flat_grad.dtype == torch.float16 or (
            torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) == torch.float16)
        count_on_device = not self.blocking and summed is not None and (
            targets.device.type != "cpu" or self._count_on_device) and not half
        if summed is None:
            dens = list(sizes)
        elif count_on_device:
            dens = [part[1].numel() for part in parts]
        else:
            # Counted in host memory (numpy, no op): no device synchronisation for targets there
            # (as a DataLoader gives them); for targets on a GPU one copy (a synchronisation)
            # and, up to 65536 labels, no kernel (more are compared there and copied as a mask,
            # an eighth of the bytes).
            y = targets.detach()
            if y.device.type == "cpu" or y.numel() <= 65536:
                kept = y.cpu().numpy() != summed[1]
            else:
                kept = (y != summed[1]).cpu().numpy()
            bounds = [0]
            for n in sizes:
                bounds.append(bounds[-1] + n)
            dens = [int(kept[a:b].sum()) for a, b in zip(bounds, bounds[1:])]
        global_den = sum(dens)
        # dpcuda's own loss on (batch, classes) logits takes the fused path (see step_replica).
        fold = summed is not None and isinstance(loss_fn, SoftmaxCrossEntropyLoss)
        if self.reducer == "dist":
            # Every process scales its loss by 1 / the global denominator before the backward.
            # The first step counts it with a collective; later steps take the previous step's
            # count (the same on every process), the true count travels with the gradients,
            # and a step whose count changed is rescaled after the exchange (_step_dist).
            # Half precision models count every step: a gradient scaled for a batch 16 times
            # smaller can overflow float16 before the rescale. So does the step after one whose
            # rows were all ignored.
            if self._dist_count:
                count = torch.tensor([global_den], dtype=torch.float64,
                                     device=self._comm_device())
                self._dist.all_reduce(count, group=self._group)
                self._dist_stage = 1
                self._global_rows = int(count.item())
            global_den = self._global_rows
        # No row counts (all ignored): the gradients are 0 and the loss NaN, as torch's mean
        # over no rows (its gradient is 0 too; the update still applies decay and momentum).
        inv = 1.0 / global_den if global_den > 0 else 0.0

        # The CUDA loss kernel's bad-label flags, read with this step's loss, must say what this
        # step saw. The status op of a device's only replica clears its flag as it reads it
        # (so it is clear here unless a step failed, which clears them all); a flag that
        # several replicas share, or that reducer "dist" reads, is cleared first.
        shared = self._shared_flag_devices()
        for device in shared:
            self._flag_tensor(device).zero_()

        exchange = Exchange(len(self._replicas), self.timeout) if self._sync_bn else None

        def work(index, replica, part, size):
            def run():
                if exchange is not None:
                    with replica_context(exchange, index):
                        return step_replica()
                return step_replica()

            def step_replica():
                replica.release_grads()
                try:
                    return forward_backward()
                finally:
                    replica.collect_grads()

            def forward_backward():
                if size == 0 and exchange is None:
                    return 0.0, 0.0
                start = time.perf_counter()
                x, y = part
                # On CUDA dpcuda's loss kernel flags a bad label on the device and this step
                # reads the flag with the loss (step_status), instead of the adapter
                # synchronising on every call to look.
                defer = replica.device.type == "cuda"
                previous = _C._defer_label_checks(True) if defer else None
                try:
                    out = replica.module(x)
                    grad = None
                    if size == 0:  # it takes part in the batch-norm exchanges only
                        loss = out.sum() * 0.0
                    elif fold and out.dim() == 2 and out.dtype.is_floating_point:
                        # dpcuda's loss: the loss and its gradient, both already scaled by
                        # 1 / the global denominator, from one kernel; the backward starts at
                        # the logits (no seed, no scale and no loss node on the way back).
                        losses, grad = torch.ops.dpcuda.loss_grad(
                            out.detach(), y.long(), inv, float(loss_fn.label_smoothing),
                            loss_fn.ignore_index, out.requires_grad)
                        loss = losses  # per row: step_status sums them (no sum kernel)
                    elif summed is None:
                        loss = loss_fn(out, y) * (size * inv)
                    else:
                        loss = summed[0](out, y) * inv
                finally:
                    if defer:
                        _C._defer_label_checks(previous)
                if grad is None:
                    loss.backward()
                elif out.requires_grad:
                    out.backward(grad)
                else:  # as loss.backward() in torch (no_grad, or nothing to train)
                    raise RuntimeError("element 0 of tensors does not require grad and does "
                                       "not have a grad_fn")
                if replica.device.type == "cuda" and self.split == "auto":
                    torch.cuda.synchronize(replica.device)
                self._classes = out.shape[1] if out.dim() >= 2 else None
                return loss.detach(), time.perf_counter() - start
            return run

        try:
            results = _run_all([work(i, r, p, s) for i, (r, p, s)
                                in enumerate(zip(self._replicas, parts, sizes))], self.devices,
                               concurrent=exchange is not None,
                               on_error=exchange.abort if exchange is not None else None)
        except ValueError as err:
            # A loss that checks labels as it runs (the CPU kernels, torch's losses) names a
            # position in its replica's slice: name the position in the caller's batch.
            found = re.match(r"labels must be class indices in \[0, (\d+)\)", str(err))
            if found is None:
                raise
            self._classes = int(found.group(1))
            self._raise_label_error(targets, summed)
            raise
        if self.split == "auto":
            self._update_speed(sizes, [t for _, t in results])
        if self.reducer == "dist":
            # (per-row losses summed in float64, as step_status sums them for the others)
            return self._step_dist([l.double().sum() if torch.is_tensor(l) and l.dim() else l
                                    for l, _ in results], dens, global_den, targets, summed)
        # Each replica's status record: the loss (its per-row losses summed there), whether its
        # gradient buffer holds a NaN or an Inf, its device's bad-label flag (one op; one kernel
        # on CUDA).
        records = []
        for (l, _), r, (_, y) in zip(results, self._replicas, parts):
            flag = self._flag_tensor(r.device)
            labels = None
            if count_on_device:
                labels = y.reshape(-1) if y.dtype == torch.long else y.reshape(-1).long()
            records.append(torch.ops.dpcuda.step_status(
                r.flat_grad, torch.as_tensor(l, device=r.device).detach(), flag, r.status_work,
                flag is not None and r.device not in shared, labels,
                summed[1] if summed is not None else -100))
        if not self.blocking:
            return self._step_async(records, targets, summed, global_den, count_on_device)
        # One host read per replica of its record.
        reads = [x.cpu() for x in records]
        if any(float(x[2]) for x in reads):
            self._raise_label_error(targets, summed)
        loss = float(sum(float(x[0]) for x in reads)) if global_den > 0 else math.nan

        if any(float(x[1]) for x in reads):
            warnings.warn(f"dpcuda DataParallel: step {self.steps} has NaN or Inf gradients; "
                          f"skipped (weights unchanged)", RuntimeWarning, stacklevel=2)
            self.skipped_steps += 1
            self.steps += 1
            return loss
        # torch.optim.SGD leaves a parameter that got no gradient alone (no decay, no momentum):
        # so does the step for one that no replica's forward used.
        unused = set.intersection(*(r.unused for r in self._replicas))
        kept = self._keep(unused) if unused else None
        if self.reducer == "p2p":
            self._reduce_p2p()
        else:
            self._reduce_host()
        if kept is not None:
            for dst, src in kept:
                dst.copy_(src)
        self.steps += 1
        return loss

    def _step_async(self, records, targets, summed, global_den, count_on_device):
        """The rest of a non-blocking step: the update, which the records skip (and, with the
        labels counted on the device, rescale) there, and which writes the loss (the records'
        losses summed in replica order from 0.0, as the blocking step sums its reads) into a
        device tensor; the records copied to host memory, to be read later."""
        unused = set.intersection(*(r.unused for r in self._replicas))
        kept = self._keep(unused) if unused else None
        # Everything that can fail is made before the update is queued (a step that raises
        # leaves the weights): the loss, the records' host memory (pinned, behind an event,
        # from CUDA devices), the events.
        loss = torch.empty((), dtype=torch.float64, device=self._replicas[0].device)
        cuda = sorted({r.device for r in self._replicas if r.device.type == "cuda"},
                      key=str)
        host = [torch.empty(x.numel(), dtype=torch.float64, pin_memory=bool(cuda))
                for x in records]
        events = [torch.cuda.Event() for _ in cuda]
        self._reduce_p2p(records, float(global_den) if count_on_device else 0.0, loss)
        if kept is not None:
            for dst, src in kept:
                dst.copy_(src)
        if global_den == 0:
            loss.fill_(math.nan)  # a mean over no labels, as torch's
        for h, x in zip(host, records):
            h.copy_(x, non_blocking=bool(cuda))
        for event, device in zip(events, cuda):
            event.record(torch.cuda.current_stream(device))
        self._pending.append((self.steps, host, events, targets, summed, self._classes))
        self.steps += 1
        return loss

    def synchronize(self):
        """Waits for every step so far and reads what they found (blocking=False): warns for
        each skipped step, raises for a bad label. Call it before relying on skipped_steps."""
        self._settle(wait=True)

    def _settle(self, wait):
        """Reads the records of earlier non-blocking steps, oldest first: those the devices
        have finished, then, waiting for them, every one (wait) or those more than `lag` steps
        back. NaN/Inf gradients warn and count; a bad label (that step's update was skipped on
        the device) raises once every record this call reads is read, the first one's."""
        error, more = None, []
        while self._pending:
            step, host, events, targets, summed, classes = self._pending[0]
            if not all(e.query() for e in events):
                if not wait and len(self._pending) < self.lag:
                    break
                for e in events:
                    e.synchronize()
            self._pending.popleft()
            rows = [h.numpy() for h in host]  # host memory, read with no op
            if any(r[2] != 0 for r in rows):
                if error is None:
                    self._classes = classes
                    try:
                        self._raise_label_error(targets, summed, step)
                    except ValueError as err:
                        error = err
                else:
                    more.append(step)
            elif any(r[1] != 0 for r in rows):
                warnings.warn(f"dpcuda DataParallel: step {step} has NaN or Inf gradients; "
                              f"skipped (weights unchanged)", RuntimeWarning, stacklevel=3)
                self.skipped_steps += 1
        if error is not None:
            if more:
                also = ", ".join(map(str, more))
                raise ValueError(f"{error}; step{'s' if len(more) > 1 else ''} {also} also had "
                                 f"a bad label (not applied either)")
            raise error

    def _keep(self, indices):
        """Copies of the weights and momenta of the given parameters, to put back after the
        update: (destination, copy) pairs."""
        spans = [self._replicas[0].spans[i] for i in sorted(indices)]
        buffers = [t for r in self._replicas for t in (r.flat_param, r.momentum) if t is not None]
        if self.reducer == "host":
            buffers += [t for t in (self._host_param, self._host_momentum) if t is not None]
        return [(b[o:o + n], b[o:o + n].clone()) for b in buffers for o, n in spans]

    @staticmethod
    def _flag_tensor(device):
        """The bad-label flag of dpcuda's CUDA loss kernel on device (one int32), or None on
        the CPU, whose adapter raises at once."""
        return _C._label_error_flag(device.index) if device.type == "cuda" else None

    def _label_flag(self, device):
        """The flag as a float64 scalar tensor, to be read with the loss (0 on the CPU)."""
        flag = self._flag_tensor(device)
        return torch.zeros((), dtype=torch.float64) if flag is None else flag[0].double()

    def _raise_label_error(self, targets, summed, step=None):
        """A loss kernel saw a label outside [0, classes): raise naming the first bad position
        of the batch (before any update; the next step clears the flags as it starts). step:
        the earlier non-blocking step whose record said so."""
        classes = self._classes
        ignore = summed[1] if summed is not None else -100
        y = targets.detach().cpu().reshape(-1)
        bad = ((y != ignore) & ((y < 0) | (y >= classes))).nonzero() if classes else []
        if step is not None:
            if len(bad):
                i = int(bad[0])
                raise ValueError(f"step {step}: labels must be class indices in [0, {classes}) "
                                 f"or ignore_index ({ignore}); got {int(y[i])} at position {i} "
                                 f"(that step's update was not applied; nothing of this call "
                                 f"ran)")
            raise ValueError(f"step {step}: a label outside [0, classes) reached dpcuda's CUDA "
                             f"loss kernel (its targets no longer hold it); that step's update "
                             f"was not applied; nothing of this call ran")
        if len(bad):
            i = int(bad[0])
            where = " of this process's batch" if self.reducer == "dist" else ""
            raise ValueError(f"labels must be class indices in [0, {classes}) or ignore_index "
                             f"({ignore}); got {int(y[i])} at position {i}{where} (the step "
                             f"was not applied)")
        raise ValueError("a label outside [0, classes) reached dpcuda's CUDA loss kernel since "
                         "the last step (not in this step's targets); the step was not applied")

    def _shared_flag_devices(self):
        """The CUDA devices whose bad-label flag a step clears before it starts: those of more
        than one replica, and every one with reducer "dist" (which reads the flags itself)."""
        devices = [r.device for r in self._replicas if self._flag_tensor(r.device) is not None]
        return {d for d in devices if self.reducer == "dist" or devices.count(d) > 1}

    def _clear_label_flags(self):
        for device in {r.device for r in self._replicas}:
            flag = self._flag_tensor(device)
            if flag is not None:
                flag.zero_()

    def _update_speed(self, sizes, seconds):
        speed = list(self._speed) if self._speed else [None] * len(sizes)
        for i, (n, t) in enumerate(zip(sizes, seconds)):
            if n > 0 and t > 0:
                now = n / t
                speed[i] = now if speed[i] is None else 0.7 * speed[i] + 0.3 * now
        known = [s for s in speed if s is not None]
        if not known:
            return
        # A replica that got no rows keeps its old estimate, or a small share to be re-measured.
        floor = min(known) * 0.25
        self._speed = [s if s is not None else floor for s in speed]

    def _sgd_args(self):
        return self.lr, self.momentum, self.weight_decay

    def _reduce_p2p(self, records=(), scaled_by=0.0, loss_out=None):
        rs = self._replicas
        torch.ops.dpcuda.reduce_sgd_([r.flat_param for r in rs], [r.flat_grad for r in rs],
                                     [r.momentum for r in rs] if self.momentum else [],
                                     *self._sgd_args(), False, self.algorithm, list(records),
                                     scaled_by, loss_out)

    def _reduce_host(self):
        # The classic scheme: every gradient to host memory, summed there in replica order,
        # the update applied to the host's master weights, the weights copied to every device.
        host = [r.flat_grad.to("cpu") for r in self._replicas]
        total = host[0]
        for g in host[1:]:
            total = total + g
        m = [self._host_momentum] if self.momentum else []
        torch.ops.dpcuda.reduce_sgd_([self._host_param], [total], m, *self._sgd_args(), False,
                                     "one_shot")
        for r in self._replicas:
            r.flat_param.copy_(self._host_param, non_blocking=False)

    def _comm_device(self):
        backend = self._dist.get_backend(self._group)
        return self.devices[0] if backend == "nccl" else torch.device("cpu")

    def _step_dist(self, losses, dens, assumed_rows, targets, summed,
                   bucket_bytes=25 * 1024 * 1024):
        """The rest of a step across processes, with one exchange: the local replicas' sum
        (device to device), then one all-reduce of the gradients with a three-number record
        behind them (the loss, the rows, the CUDA loss kernel's bad-label flag; float32/float64
        models) or beside them (a float64 record, in flight together; half precision models),
        and one wait. Every process then holds the same summed gradient, so each decides alike,
        with no further collective, whether to skip the step (a NaN or Inf anywhere) and
        applies the same update."""
        rs = self._replicas
        inline = self._inline
        local = []  # each replica's (loss, rows, bad-label flag)
        for r, loss, den in zip(rs, losses, dens):
            local.append(torch.stack([torch.as_tensor(loss, device=r.device).detach().to(
                dtype=torch.float64), torch.tensor(float(den), dtype=torch.float64,
                                                   device=r.device), self._label_flag(r.device)]))
            if inline:
                r.exchange[-3:].copy_(local[-1])
        buffers = [r.exchange for r in rs] if inline else [r.flat_grad for r in rs]
        if len(rs) > 1:
            torch.ops.dpcuda.all_reduce_(buffers, "sum", self.algorithm)
        device = self._comm_device()
        comm = buffers[0] if buffers[0].device == device else buffers[0].to(device)
        record = None if inline else torch.stack([x.to(device) for x in local]).sum(0)
        self._exchange(comm, record, bucket_bytes)
        if inline:
            record = comm[-3:]
            comm = comm[:-3]
        loss, global_rows, failed = record.tolist()
        if failed:
            # A bad label (1 per replica that saw one) or a process that failed (2): every
            # process sees the sum, so every process raises, and none applies the step.
            if any(float(x[2]) for x in local):
                self._raise_label_error(targets, summed)
            raise RuntimeError("dpcuda DataParallel: another process failed in this step (a bad "
                               "label or an error); the step was not applied on any process")
        self._global_rows = int(global_rows)
        if global_rows == 0:
            loss = math.nan  # a mean over no rows, as torch's; the gradients are 0
        elif global_rows != assumed_rows:
            # The global batch changed: every process scaled its gradients (and its loss) by
            # 1 / assumed_rows.
            fix = assumed_rows / global_rows
            comm.mul_(fix)
            loss *= fix
        if not (bool(torch.isfinite(comm.sum())) or bool(torch.isfinite(comm).all())):
            warnings.warn(f"dpcuda DataParallel: step {self.steps} has NaN or Inf gradients; "
                          f"skipped (weights unchanged)", RuntimeWarning, stacklevel=3)
            self.skipped_steps += 1
            self.steps += 1
            return loss
        for r in rs:
            if r.flat_grad.data_ptr() != comm.data_ptr():
                r.flat_grad.copy_(comm)
            m = [r.momentum] if self.momentum else []
            torch.ops.dpcuda.reduce_sgd_([r.flat_param], [r.flat_grad], m, *self._sgd_args(),
                                         False, "one_shot")
        self.steps += 1
        return loss

    def _exchange(self, comm, record, bucket_bytes=25 * 1024 * 1024):
        """The step's collectives: the record (when it is not inside comm) and comm in buckets,
        all in flight together, then one wait."""
        self._dist_stage = 2
        works = []
        if record is not None:
            works.append(self._dist.all_reduce(record, group=self._group, async_op=True))
        per = max(1, bucket_bytes // comm.element_size())
        # The last bucket first: the order in which DDP's buckets go (the last layer's
        # gradients are the first ready).
        works += [self._dist.all_reduce(comm[i:i + per], group=self._group, async_op=True)
                  for i in reversed(range(0, comm.numel(), per))]
        for w in works:
            w.wait()

    def _fail_exchange(self):
        """This process's part of a failed step's collectives: the count (if the step makes
        one and it has not run) and the exchange, with zero gradients and the failure mark."""
        r = self._replicas[0]
        device = self._comm_device()
        if self._dist_stage < 1 and self._dist_count:
            count = torch.zeros(1, dtype=torch.float64, device=device)
            self._dist.all_reduce(count, group=self._group)
            self._global_rows = int(count.item())  # as the other processes have it
        with torch.no_grad():
            r.exchange.zero_()
        if self._inline:
            r.exchange[-1] = 2.0
            comm = r.exchange if r.exchange.device == device else r.exchange.to(device)
            self._exchange(comm, None)
        else:
            comm = r.flat_grad if r.flat_grad.device == device else r.flat_grad.to(device)
            record = torch.tensor([0.0, 0.0, 2.0], dtype=torch.float64, device=device)
            self._exchange(comm, record)

    def _copy_params_from(self, index):
        src = self._replicas[index]
        for i, r in enumerate(self._replicas):
            if i != index:
                r.flat_param.copy_(src.flat_param)
                with torch.no_grad():
                    for p, q in zip(r.frozen, src.frozen):
                        p.copy_(q)
