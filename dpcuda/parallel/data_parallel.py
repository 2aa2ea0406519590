"""DataParallel: the wrapper. dp(*args, **kwargs) runs the model's replicas on their rows of the
batch and gathers the outputs; the backward ends with the replicas' gradients reduced, so the
user's own loop (any loss, any torch.optim optimizer, schedulers, clipping, accumulation) trains
what one device trains. step() is the one-call convenience step built on the same pieces."""

import collections
import contextlib
import math

import torch
from torch import nn

from ..batchnorm import sync_batch_norm_
from .dist_step import DistStepMixin
from .fused_update import FusedUpdate
from .primitives import (ALGORITHMS, _devices, _map, _run_all, batch_rows, gather,
                         scatter_sizes, split_sizes)
from .reducer import GradReduction, mark_outputs
from .sharded import ShardedUpdate
from .replicas import ReplicaSet
from .step import StepMixin

REDUCERS = ("p2p", "host", "dist")
BUFFERS = ("broadcast", "sync")
SPLITS = ("even", "weighted", "auto")


def _hyper(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative finite number, got {value!r}")
    return float(value)


class DataParallel(nn.Module, StepMixin, DistStepMixin):
    """Data parallelism over replicas of module, one per entry of devices (a device may repeat:
    ["cpu", "cpu"], ["cuda:0", "cuda:0"]).

    The wrapper (as torch's DistributedDataParallel):
        dp = DataParallel(model, devices)      # dp.module is model, moved to devices[0]
        opt = torch.optim.AdamW(dp.parameters(), lr=1e-3)
        loss = loss_fn(dp(x), y); loss.backward(); opt.step(); opt.zero_grad()
    dp(*args, **kwargs) splits every tensor with a batch dimension (also inside tuples, lists,
    dicts and dataclasses) along dim 0, runs the replicas (threads on distinct devices, with the
    caller's grad mode, autocast and streams) and gathers their outputs on devices[0] with
    autograd, so any loss on them is the one-device loss. When the backward ends, every
    replica's .grad is the one-device gradient: the replicas' gradients summed in replica order
    by the reducer, the same bits everywhere, added to what .grad held (accumulation). Inside
    no_sync() the reduction waits for the next backward outside it. The model is replica 0,
    trained in place; before each forward the other replicas take its weights, buffers,
    requires_grad, training mode and structure (dpcuda.parallel.replicas). Parameter gradient
    hooks with two or more replicas, nn.Embedding(sparse=True) and, with two or more replicas,
    nn.Embedding(max_norm=...) raise a ValueError: they cannot be made exact.

    reducer: "p2p" (dpcuda's device-to-device all-reduce), "host" (the classic scheme through
    host memory) or "dist" (the local sum, then torch.distributed across processes started by
    torchrun; the processes' gradients are averaged, as DDP's). split: "even", "weighted"
    (rows proportional to split_weights) or "auto" (to each replica's measured speed).
    buffers: "broadcast" (DDP's: every replica takes the model's buffers before each forward)
    or "sync" (step() only: BatchNorm1d/2d/3d normalise over the whole global batch; the
    model's batch-norm modules become dpcuda.batchnorm's subclasses, torch's outside a step).

    step(inputs, targets, loss_fn) runs forward, loss, backward and an SGD update (lr,
    momentum, weight_decay: attributes a schedule may change) and returns the loss as a float.
    A step whose gradients hold NaN or Inf is skipped with a warning; a step that raises leaves
    the weights and buffers as they were. With exactly nn.CrossEntropyLoss / dpcuda's
    SoftmaxCrossEntropyLoss (mean, no class weights) or F.cross_entropy on class-index targets
    the update is fused into the all-reduce and .grad is None afterwards; with any other loss
    the loss is computed on the gathered output and .grad keeps the global gradient.

    shard_optimizer (reducer "dist"): whether step(..., optimizer=opt) with a dpcuda.optim
    optimizer keeps its state sharded over the processes (ZeRO-1: reduce-scatter, each process
    updates its shard, all-gather; dpcuda/parallel/sharded.py). None: with NCCL yes, with gloo
    no (its reduce-scatter is slower than its all-reduce). While sharded, call
    opt.consolidate_state_dict(to=rank) on every process before that rank's opt.state_dict().

    blocking=False (reducer "p2p", the fused losses): a step waits for nothing on the devices;
    the update skips itself there on NaN/Inf or a bad label, step() returns the loss as a
    float64 scalar tensor on devices[0], and what a step found is read at a later step() (the
    host runs at most `lag` steps ahead) or at synchronize(): a skipped step warns and counts
    in skipped_steps, a bad label raises there naming the step and position. state_dict() and
    the other state functions read every pending step first. With step(..., optimizer=opt) it
    needs a dpcuda.optim optimizer over replicas on one device, whose update is fused into the
    reduction: a skipped update counts no step there (Adam's step counts and SGD's "momentum
    begun" live on the device), and the optimizer's post-hooks and schedulers see the step as
    issued (the device's skip is known only when the step is read).
    """

    # How many non-blocking steps the host may run ahead of what it has read.
    lag = 2
    # Non-blocking steps count the labels a mean is over on the device for labels on a GPU;
    # True makes them do so for labels in host memory too (a test hook: the CPU runs that path).
    _count_on_device = False
    # The model dtypes whose gradient buffer carries the reducer "dist" record (the loss; the
    # rows, exact to 2**24) behind the gradients; other dtypes send it in a float64 tensor.
    _record_inline = (torch.float32, torch.float64)

    # The state a step changes: plain attributes, set without nn.Module.__setattr__'s checks
    # (microseconds a call, several calls a step).
    _PLAIN = frozenset({"steps", "skipped_steps", "_classes", "_dist_stage", "_dist_count",
                        "_global_rows", "_speed", "_host_momentum", "_lr", "_momentum",
                        "_weight_decay", "_optimizer", "_zero", "_graph_ring"})

    def __setattr__(self, name, value):
        if name in self._PLAIN:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def __init__(self, module, devices, reducer="p2p", split="even", lr=0.01, momentum=0.0,
                 weight_decay=0.0, split_weights=None, algorithm="auto", process_group=None,
                 buffers="broadcast", timeout=300.0, blocking=None, shard_optimizer=None,
                 graphs=False):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        for name, value, allowed in (("reducer", reducer, REDUCERS), ("split", split, SPLITS),
                                     ("buffers", buffers, BUFFERS),
                                     ("algorithm", algorithm, ALGORITHMS)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
                not timeout > 0 or not math.isfinite(timeout):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if not isinstance(graphs, bool):
            raise TypeError(f"graphs must be True or False, got {graphs!r}")
        if blocking is None:
            blocking = not graphs
        if not isinstance(blocking, bool):
            raise TypeError(f"blocking must be True or False, got {blocking!r}")
        if shard_optimizer is not None and not isinstance(shard_optimizer, bool):
            raise TypeError(f"shard_optimizer must be None, True or False, got "
                            f"{shard_optimizer!r}")
        if shard_optimizer and reducer != "dist":
            raise ValueError("shard_optimizer=True shards the optimizer state over processes "
                             "(reducer='dist'); over the replicas of one process step() shards "
                             "it by itself")
        if graphs and reducer != "p2p":
            raise ValueError(f"dpcuda DataParallel: graphs=True: reducer {reducer!r} is not "
                             f"captured (reducer 'p2p' is)")
        if not blocking and reducer != "p2p":
            raise ValueError(f"blocking=False needs reducer='p2p' (reducer {reducer!r} reads "
                             f"the gradients on the host at every step)")
        self._lr, self._momentum, self._weight_decay = (
            _hyper("lr", lr), _hyper("momentum", momentum), _hyper("weight_decay", weight_decay))
        self.devices = _devices(devices)
        self.reducer, self.split, self.algorithm = reducer, split, algorithm
        if graphs:  # (refused before the model is moved or its parameters made views)
            self._check_graphs(blocking, split, buffers)
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
            self._dist, self._group = dist, process_group
            self._global_rows = None  # the last step's global batch
            if shard_optimizer is None:
                # NCCL's all-reduce is a reduce-scatter and an all-gather, so sharding costs no
                # bytes there and saves (W-1)/W of the state and of the update (reasoned: NCCL
                # across GPUs has never run here). gloo's reduce-scatter is slower than its
                # all-reduce: a sharded AdamW step measured 1.4x the replicated one on 2 CPU
                # processes (docs/benchmarks.md), so there the state stays whole by default.
                shard_optimizer = dist.get_backend(process_group) == "nccl"
        self.shard_optimizer = bool(shard_optimizer)
        self.buffer_mode, self.timeout = buffers, float(timeout)
        self._sync_bn = False
        if buffers == "sync":
            if reducer == "dist":
                raise ValueError("buffers='sync' synchronises batch norm over the replicas of "
                                 "one process; with reducer='dist' use buffers='broadcast'")
            cuda = [d for d in self.devices if d.type == "cuda"]
            if len(set(cuda)) != len(cuda):
                raise ValueError("buffers='sync' needs one replica per CUDA device (the "
                                 "autograd engine runs a device's backwards on one thread)")
            self._sync_bn = sync_batch_norm_(module) > 0
        # The model is replica 0: on devices[0] (moved in place, as module.to does; the
        # Parameter objects stay, so an optimizer made before wrapping still holds them).
        module.to(self.devices[0])
        self.module = module
        self._host_momentum = None
        self._set = ReplicaSet(module, self.devices, 3 if reducer == "dist" else 0,
                               before_build=self._save_host_momentum)
        self._reduction = GradReduction(self._set, self._reduce_grads,
                                        every_param=reducer == "dist")
        self._set.on_accumulate = self._reduction.started
        if reducer == "dist":
            # Every process starts from rank 0's weights and buffers.
            with torch.no_grad():
                for t in list(module.parameters()) + list(module.buffers()):
                    self._dist.broadcast(t, src=0, group=self._group)
        self.steps = 0
        self.skipped_steps = 0
        self._optimizer = None  # step()'s optimizer, during the step
        self._fused_update = FusedUpdate()  # a dpcuda.optim optimizer's sharded state
        self._sharded_update = ShardedUpdate()  # the same across processes (reducer "dist")
        self._zero = False
        self.blocking = blocking
        self._pending = collections.deque()  # the non-blocking steps not read yet (PendingStep)
        self._graph_ring = None  # during a graphed step's capture: where its records go
        self._graphed = self._graphed_steps() if graphs else None

    # The backend of graphs=True: "cuda" (torch.cuda.CUDAGraph), or "closure" (a test hook: the
    # CPU runs the graphed step's logic with a stand-in that replays the captured body).
    _graph_backend = "cuda"

    def _graphed_steps(self):
        """graphs=True's step (graphed.py)."""
        from .graphed import GraphedSteps, _ClosureGraph, _CudaGraph
        return GraphedSteps(_CudaGraph if self._graph_backend == "cuda" else _ClosureGraph)

    def _check_graphs(self, blocking, split, buffers):
        """graphs=True's refusals: what can never be graphed."""
        why = None
        if blocking:
            why = "it replays the non-blocking step: leave blocking unset (or False)"
        elif split == "auto":
            why = "split='auto' times every replica on the host"
        elif buffers == "sync":
            why = "buffers='sync' reads batch-norm counts on the host"
        elif len(set(self.devices)) > 1:
            why = ("replicas on several devices are not graphed: torch's capture allocates "
                   "from one device's private pool, and several GPUs have never been "
                   "available to try a multi-device capture; use blocking=False")
        elif self.devices[0].type != "cuda" and self._graph_backend == "cuda":
            why = "CUDA graphs need CUDA replicas; on the CPU use blocking=False"
        if why is not None:
            raise ValueError(f"dpcuda DataParallel: graphs=True: {why}")

    def __getstate__(self):
        # (copy.deepcopy, pickle: captured graphs are not state; a copy makes its own, as it
        # makes its own streams, StepStreams.__getstate__)
        state = self.__dict__.copy()
        if state.get("_graphed") is not None:
            state["_graphed"] = self._graphed_steps()
        return state

    # -- the SGD hyperparameters of step() (a schedule may change them between steps) --------

    lr = property(lambda self: self._lr,
                  lambda self, v: setattr(self, "_lr", _hyper("lr", v)),
                  doc="step()'s SGD learning rate (without an optimizer); set it between steps "
                      "to schedule it")
    momentum = property(lambda self: self._momentum,
                        lambda self, v: setattr(self, "_momentum", _hyper("momentum", v)),
                        doc="step()'s SGD momentum, in [0, 1)")
    weight_decay = property(lambda self: self._weight_decay,
                            lambda self, v: setattr(self, "_weight_decay",
                                                    _hyper("weight_decay", v)),
                            doc="step()'s SGD weight decay (L2, added to the gradient)")

    # -- the replicas ------------------------------------------------------------------------

    @property
    def _replicas(self):
        return self._set.replicas

    @property
    def _replica_buffers(self):
        return [r.buffers for r in self._set.replicas]

    @property
    def replicas(self):
        """The replicas' modules at the model's current state (replica 0 is the model)."""
        self._sync()
        return self._set.build_modules()

    @property
    def _reduces(self):
        """Whether a backward through dp() ends in a reduction (more than one replica, or
        other processes)."""
        return len(self.devices) > 1 or self.reducer == "dist"

    def _sync(self, walk=None):
        """The replicas brought to the model (ReplicaSet.sync; walk: a walk of the model made
        since the caller's code last ran, or None)."""
        self._set.sync(walk)
        if self.momentum:
            for r in self._set.replicas:
                r.ensure_momentum()
            if self.reducer == "host" and self._host_momentum is None:
                m = self._set.replicas[0].momentum
                self._host_momentum = m if m.device.type == "cpu" else m.to("cpu", copy=True)

    def _save_host_momentum(self):
        """Before the replicas are rebuilt: the host reducer's momentum back into replica 0's
        buffer, which the rebuild carries over. Refused between no_sync() passes: the new
        replicas would not hold the gradients the old ones kept aside."""
        if self._reduction._local is not None:
            raise RuntimeError(
                "dpcuda DataParallel: the model changed (its parameters, buffers or "
                "requires_grad) between backward passes under no_sync(); the replicas' "
                "accumulated gradients cannot follow it (make the change before the "
                "accumulation, or after the synchronised backward)")
        if self._host_momentum is not None:
            m = self._set.replicas[0].momentum
            if m is not None and m is not self._host_momentum:
                m.copy_(self._host_momentum)
            self._host_momentum = None

    # -- the conventional loop ---------------------------------------------------------------

    def forward(self, *args, **kwargs):
        """The module's forward on every replica, each on its share of the batch's rows; the
        outputs gathered on devices[0] (a tuple or dict of tensors is gathered element by
        element). A backward through them leaves every replica's .grad the one-device
        gradient."""
        if self._pending:
            self._settle(wait=False)
        if not self._reduces:
            device = self.devices[0]
            args, kwargs = _map(lambda t: t.to(device, non_blocking=True), (args, kwargs))
            return self.module(*args, **kwargs)
        if self._sync_bn:
            raise ValueError("buffers='sync' works with step() only: the conventional loop's "
                             "backward runs the replicas one after another")
        self._sync()
        modules = self._set.build_modules()
        rows = batch_rows((args, kwargs))
        if rows is None:
            raise ValueError("dpcuda DataParallel: the inputs hold no tensor with a batch "
                             "dimension to split over the replicas")
        sizes = split_sizes(rows, len(self.devices), self._row_weights())
        parts = scatter_sizes((args, kwargs), self.devices, sizes)
        active = [i for i, n in enumerate(sizes) if n > 0] or [0]
        outputs = _run_all([lambda i=i: modules[i](*parts[i][0], **parts[i][1]) for i in active],
                           [self.devices[i] for i in active])
        if torch.is_grad_enabled():
            outputs = mark_outputs(outputs, self._reduction, self._set.generation)
        return gather(outputs, self.devices[0])

    @contextlib.contextmanager
    def no_sync(self):
        """As DDP's no_sync(): backward passes inside keep each replica's gradients aside
        (each replica's .grad shows its own accumulation); the first backward outside reduces
        them all with its own."""
        previous = self._reduction.sync
        self._reduction.sync = False
        try:
            yield
        finally:
            self._reduction.sync = previous

    def _reduce_grads(self, buffers):
        """Sums the replicas' flat gradient buffers in place, in replica order."""
        if self.reducer == "p2p" and len(buffers) > 1:
            torch.ops.dpcuda.all_reduce_(buffers, "sum", self.algorithm)
        elif self.reducer == "host" and len(buffers) > 1:
            total = buffers[0].to("cpu", copy=True)
            for g in buffers[1:]:
                total += g.to("cpu")
            for g in buffers:
                g.copy_(total)
        elif self.reducer == "dist":
            if len(buffers) > 1:
                torch.ops.dpcuda.all_reduce_(buffers, "sum", self.algorithm)
            device = self._comm_device()
            comm = buffers[0] if buffers[0].device == device else buffers[0].to(device)
            self._dist.all_reduce(comm, group=self._group)
            comm.div_(self._dist.get_world_size(self._group))
            for g in buffers:
                if g.data_ptr() != comm.data_ptr():
                    g.copy_(comm)

    # -- state -------------------------------------------------------------------------------

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """The model's state_dict (its own keys, with no "module." prefix). Reads every pending
        non-blocking step first (synchronize()). Inside another module's state_dict (a prefix
        or a destination given) the wrapper is an ordinary submodule, with "module." in its
        keys, so that the container loads its own state_dict."""
        self._settle(wait=True)
        if args or destination is not None or prefix:
            return super().state_dict(*args, destination=destination, prefix=prefix,
                                      keep_vars=keep_vars)
        return self.module.state_dict(keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """Loads into the model (the replicas take it at the next forward); on error nothing
        changes. Reads every pending non-blocking step first (synchronize())."""
        self._settle(wait=True)
        if assign:
            raise ValueError("dpcuda DataParallel: load_state_dict(assign=True) would replace "
                             "the model's parameters; load into dp.module before wrapping")
        probe = nn.Module.state_dict(self.module)
        probe = {k: v.clone() for k, v in probe.items()}
        try:
            return self.module.load_state_dict(state_dict, strict=strict)
        except BaseException:
            with torch.no_grad():
                self.module.load_state_dict(probe, strict=False)
            raise

    def optimizer_state_dict(self):
        """step()'s SGD state: hyper-parameters and the momentum buffer (flat, in parameter
        order). Reads every pending non-blocking step first (synchronize())."""
        self._settle(wait=True)
        self._sync()
        momentum = None
        if self.momentum:
            source = self._host_momentum if self.reducer == "host" else \
                self._replicas[0].momentum
            momentum = source.detach().to("cpu", copy=True)
        return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay,
                "momentum_buffer": momentum, "steps": self.steps}

    def load_optimizer_state_dict(self, state):
        """Loads what optimizer_state_dict() gave: the hyper-parameters (lr, momentum,
        weight_decay) and the momentum buffer; checked first, so on error nothing changes."""
        self._settle(wait=True)
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        hyper = {k: _hyper(k, state[k]) for k in ("lr", "momentum", "weight_decay")
                 if k in state}
        buf = state.get("momentum_buffer")
        self._sync()
        total = self._replicas[0].flat_param.numel()
        if buf is not None and buf.numel() != total:
            raise ValueError(f"momentum_buffer has {buf.numel()} elements, the model has "
                             f"{total} trainable parameters")
        for k, v in hyper.items():
            setattr(self, k, v)
        self._sync()
        if buf is not None and self.momentum:
            for r in self._replicas:
                r.momentum.copy_(buf.reshape(-1))
            if self._host_momentum is not None:
                self._host_momentum.copy_(buf.reshape(-1))
        self.steps = int(state.get("steps", self.steps))
