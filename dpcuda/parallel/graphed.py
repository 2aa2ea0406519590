"""DataParallel(graphs=True): the one-call step captured as a CUDA graph once per input shape,
then replayed, so that a steady-state step costs the host a copy of the batch and one launch.

A step of a new shape runs WARMUP eager non-blocking steps (dp.step's own), then is captured:
the replicas' weight copies, forward, loss, backward, the step records and the reduction with
the fused update (dpcuda.optim's, or the wrapper's SGD), into static buffers: the batch, the
loss, and a device ring of the records (RING steps; the host copies it to pinned memory every
RING steps and reads it later, as a PendingWindow, or at synchronize()). Skipped steps and bad
labels are decided on the device, as in blocking=False. A replay whose optimizer holds new
hyperparameters (the learning rate a scheduler set) writes them into the plan's device copy
first, which the graph reads (none is written while they stay), and the host does what a step
does on the host (the step count, the optimizer's step() wrapper: its post-hooks and the
schedulers' bookkeeping).

What the capture holds as constants makes a new graph when it changes: the shapes, dtypes and
devices of the batch, the loss and its settings, the optimizer (its plan, max_grad_norm) or the
wrapper's lr/momentum/weight_decay, accumulate, the model's structure, its modules' public
attributes (values; tensors by storage; other objects by identity, kept alive with the graph)
and its buffers' storage, autocast. An object changed in place (a dict, a config object) is not
seen: the graph replays what it captured. What a graph cannot replay falls back to the eager
non-blocking step with one warning naming the reason: a loss computed on the gathered output,
Python hooks on the model or the loss, or torch's global module hooks (they would run at capture
only), float16 gradients (their labels are counted on the host), a capture the runtime refuses;
a model whose attributes or buffers change at every step is warned about once. DataParallel
refuses at construction what never can be graphed.

The checks above run before a replay only when something they read has changed: a replay
leaves a guard of what they read (replay_guard.py), and a step that finds all of it unchanged
replays the same graph without them (on a GPU a small step's time is the host's).

Replicas on one CUDA device: one graph. The CPU has no graphs: there a test runs this module's
logic with _ClosureGraph (capture keeps the body, replay runs it), which checks everything but
the capture itself. On a GPU (one H100, 2026-11-27) its CUDA tests passed, bit for bit against
the eager step (docs/validation.md).
"""

import collections
import warnings

import torch
from torch.nn.modules import module as _module

from ..nn import _has_grad_hooks, _has_hooks
from .pending import PendingWindow
from .replay_guard import make_guard
from .step import summed_loss

WARMUP = 3        # eager steps of a shape before it is captured
RING = 16         # the device ring's steps: the host reads the records every RING steps
MAX_GRAPHS = 8    # captured keys kept; the least recently used is dropped
SEEN_LIMIT = 1024  # shapes and keys whose warm-up steps are counted


class _CudaGraph:
    """One captured step on a CUDA device: capture runs nothing, replay runs the step."""

    def __init__(self, device, pool):
        self.graph = torch.cuda.CUDAGraph()
        self.device = device
        self.pool = pool

    def capture(self, body):
        caller = torch.cuda.current_stream(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(caller)
        # thread_local: another thread's CUDA calls (a DataLoader's pin-memory thread) do not
        # break this capture; kernels queued on the capturing stream from any thread (the
        # autograd engine's) are captured as in the default mode.
        with torch.cuda.graph(self.graph, pool=self.pool, stream=stream,
                              capture_error_mode="thread_local"):
            body()
        caller.wait_stream(stream)

    def replay(self):
        self.graph.replay()


class _ClosureGraph:
    """The CPU stand-in of a graph (tests): capture keeps the body and runs nothing, as a CUDA
    capture; replay runs it. The body's host code must therefore give the same device work at
    every run, which is what a CUDA capture needs of it too."""

    def __init__(self, device, pool):
        self.body = None

    def capture(self, body):
        self.body = body

    def replay(self):
        self.body()


class _Sink:
    """Where one graph's capture puts what its step returns: the ring (shared by the graphs of
    a DataParallel) and the norm tensor of its clipping, which the graph rewrites at every
    replay (each replay hands the optimizer a copy, as an eager step hands a new tensor)."""

    def __init__(self, ring):
        self.ring = ring
        self.loss = ring.loss
        self.norm = None

    def write(self, records):
        self.ring.write(records)


class _Ring:
    """The records of the graphed steps on the device: the graph writes slot `counter` and
    advances it; the host keeps the same count (one per replay) and copies the ring to pinned
    memory each time it is full, or when it must read it (synchronize, a state function, an
    eager step that follows)."""

    def __init__(self, replicas, device):
        self.device = device
        self.records = torch.zeros(RING, replicas, 4, dtype=torch.float64, device=device)
        self.counter = torch.zeros(1, dtype=torch.long, device=device)
        self.loss = torch.zeros((), dtype=torch.float64, device=device)
        self.window = []  # (step, targets, summed, classes) of the slots written, not yet read
        self.slot = 0     # the host's copy of counter

    def write(self, records):
        """In the graph: this step's records into slot `counter`, and counter advanced (one
        launch; a fused update writes them with its own counts instead: device_update)."""
        torch.ops.dpcuda.update_counts_(list(records), None, self.records, self.counter, "sgd")

    def flush(self, pending):
        """The window's records to pinned host memory behind an event, one PendingWindow."""
        if not self.window:
            return
        cuda = self.device.type == "cuda"
        host = torch.empty(self.records.shape, dtype=torch.float64, pin_memory=cuda)
        host.copy_(self.records, non_blocking=cuda)
        events = []
        if cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            events.append(event)
        first = (self.slot - len(self.window)) % RING
        pending.append(PendingWindow(host, [(first + i) % RING for i in range(len(self.window))],
                                     self.window, events))
        self.window = []


class _Graph:
    """One captured step: its static batch, the plan it updates, and the graph."""

    def __init__(self, objects, graph, static_x, static_y, plan, sink):
        self.objects = list(objects)  # (their ids are in the key: none is freed and reused)
        self.graph, self.static_x, self.static_y, self.plan = graph, static_x, static_y, plan
        self.sink = sink


class GraphedSteps:
    """DataParallel's graphed step (the module docstring): step() per call."""

    def __init__(self, backend):
        self.backend = backend
        self.graphs = collections.OrderedDict()
        self.seen = collections.Counter()
        self.eager_keys = set()  # keys whose capture failed: eager from then on
        # _count_change: the last step's value of the wrapper's (lr, momentum, weight_decay)
        # ("sgd") and of the model's attributes and buffers ("state"), and how many
        # consecutive steps changed it
        self.last, self.changes = {}, {}
        self.warned = set()
        self.ring = None
        self.pool = None
        self.guard = None  # the last replay's ReplayGuard (replay_guard.py), or None
        self.guarded = True  # (tests: False runs every step's checks, the guard's oracle)

    # -- what a graph can replay -----------------------------------------------------------

    @staticmethod
    def _hooked(module):
        """A module with hooks of its own (the loss: the model's are read by its walk)."""
        if not module._modules and not module._parameters:  # (a plain loss: no walk)
            return _has_hooks(module)
        return any(map(_has_hooks, module.modules())) or \
            any(map(_has_grad_hooks, module.parameters()))

    @staticmethod
    def _global_hooks():
        return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks or
                    _module._global_backward_hooks or _module._global_backward_pre_hooks)

    def _why_not(self, dp, targets, loss_fn, summed, hooked):
        """Why this step cannot be replayed from a graph (None: it can). hooked: the model's
        walk found a hook."""
        if summed is None:
            return (f"the loss {type(loss_fn).__name__} is computed on the gathered output "
                    f"(graphs replay the per-replica cross-entropy losses)")
        if hooked or self._global_hooks() or (isinstance(loss_fn, torch.nn.Module) and
                                              self._hooked(loss_fn)):
            return ("Python hooks on the model or the loss, or torch's global module hooks, "
                    "would run at the capture only")
        kind = dp._replicas[0].device.type
        half = dp._replicas[0].flat_grad.dtype == torch.float16 or (
            torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) == torch.float16)
        if half:
            return "float16 gradients count their labels on the host"
        return None

    def _key(self, dp, inputs, targets, loss_fn, optimizer, accumulate, state):
        """(the shape's part, the whole key) of a step: what its graph holds as constants.
        state: the walk's (ReplicaSet.walk) modules' attributes and buffers' storage."""
        settings = (getattr(loss_fn, "reduction", None),
                    getattr(loss_fn, "label_smoothing", None),
                    getattr(loss_fn, "ignore_index", None))
        if optimizer is None:
            update = ("sgd", dp.lr, dp.momentum, dp.weight_decay)
        else:
            update = (id(optimizer), getattr(optimizer, "max_grad_norm", None))
        kind = dp._replicas[0].device.type
        weights = dp._row_weights()
        # (the shape's part first: its warm-up is counted per shape)
        shape = (inputs.shape, inputs.dtype, inputs.device, targets.shape, targets.dtype,
                 targets.device, dp._set.generation, dp._set._structure)
        return shape, shape + (type(loss_fn), id(loss_fn) if not isinstance(
            loss_fn, torch.nn.Module) else None, settings, update, accumulate, state,
            torch.is_autocast_enabled(kind), dp.algorithm, torch.is_grad_enabled(),
            tuple(weights) if weights else None)

    # -- the step --------------------------------------------------------------------------

    def unchanged(self, inputs, targets, loss_fn, optimizer, accumulate):
        """The last replay's guard if this step's checks, and its walk of the model, would
        find what its checks found (the step then replays its graph without them, and without
        the walk: replay_guard.py), else None."""
        guard = self.guard
        if guard is not None and self.guarded and \
                guard.holds(inputs, targets, loss_fn, optimizer, accumulate):
            return guard
        return None

    def step(self, dp, inputs, targets, loss_fn, optimizer, accumulate, walk=None,
             guard=None):
        """walk: the model's walk (ReplicaSet.walk) that DataParallel.step made for this step,
        or None to make it here. guard: unchanged()'s guard, found for this step (no walk
        made)."""
        if guard is not None:
            return self._replay_unchanged(dp, guard, inputs, targets, optimizer)
        self.guard = None
        if dp.blocking or not isinstance(inputs, torch.Tensor) or \
                not isinstance(targets, torch.Tensor):
            return self._eager(dp, inputs, targets, loss_fn, optimizer, accumulate, walk)
        # The structure the key names, its hooks and what a graph holds from its capture (the
        # modules' attributes, the buffers' storage), in one walk without the weight copies
        # (the graph makes them).
        walk = walk or dp._set.walk()
        params, _, structure, (hooked, state, objects) = walk
        summed = summed_loss(loss_fn, targets)
        reason = self._why_not(dp, targets, loss_fn, summed, hooked)
        if reason is not None:
            if reason not in self.warned:
                self.warned.add(reason)
                warnings.warn(f"dpcuda DataParallel(graphs=True): this step runs eagerly: "
                              f"{reason}", RuntimeWarning, stacklevel=3)
            return self._eager(dp, inputs, targets, loss_fn, optimizer, accumulate, walk)
        # A changed model is built again first (and walked again: the build gives the
        # trainable parameters the strides of their flat views).
        if structure != dp._set._structure or \
                [p.data_ptr() for p in params] != dp._set._pointers:
            dp._sync(walk)
            walk = dp._set.walk()
            params, _, structure, (hooked, state, objects) = walk
        shape, key = self._key(dp, inputs, targets, loss_fn, optimizer, accumulate, state)
        # A model whose attributes or buffers change at every step (a forward that keeps a new
        # object, a buffer given new storage) is never replayed: said once.
        self._count_change(
            "state", state,
            "a module attribute or a buffer of the model changes at every step (a forward that "
            "stores a new object or tensor, a buffer given new storage): each change runs the "
            "step eagerly, as a graph holds them as they were at its capture; keep such values "
            "out of the module's attributes (or in place)")
        graph = self.graphs.get(key)
        if graph is not None and optimizer is not None:
            fused = dp._fused_update
            if not fused.ready(optimizer, dp._replicas, set(), dp._set.generation):
                return self._eager(dp, inputs, targets, loss_fn, optimizer, accumulate, walk)
            if fused._plan is not graph.plan:  # (a new plan: new state buffers)
                del self.graphs[key]
                graph = None
        if optimizer is None:
            # The wrapper's SGD takes lr, momentum and weight_decay as constants of the graph:
            # a new value is a new key, which runs eagerly once and is captured again. A value
            # changed at every step (a schedule) would never be replayed: said once.
            self._count_change(
                "sgd", (dp.lr, dp.momentum, dp.weight_decay),
                "the wrapper's lr, momentum or weight_decay keep changing: each new value runs "
                "a step eagerly and captures the step again (the wrapper's SGD takes them as "
                "constants); a dpcuda.optim optimizer's schedule reaches the replayed update")
        if graph is None:
            # Captured once the shape has run WARMUP eager steps and this key one of its own
            # (whatever a new code path sets up lazily is then set up outside the capture).
            # (counted by hash: a key holds a value per module attribute and buffer)
            if len(self.seen) > SEEN_LIMIT:  # (keys seen once and never again: bounded)
                self.seen = collections.Counter({h: self.seen[h] for h in
                                                 map(hash, self.graphs)})
            if len(self.eager_keys) > SEEN_LIMIT:
                self.eager_keys.clear()
            shape_seen, key_seen = hash(shape), hash(key)
            self.seen[shape_seen] += 1
            self.seen[key_seen] += 1
            if key in self.eager_keys or self.seen[shape_seen] <= WARMUP or \
                    self.seen[key_seen] < 2:
                return self._eager(dp, inputs, targets, loss_fn, optimizer, accumulate, walk)
            graph = self._capture(dp, key, inputs, targets, loss_fn, summed, optimizer,
                                  accumulate, objects)
            if graph is None:
                return self._eager(dp, inputs, targets, loss_fn, optimizer, accumulate, walk)
        elif self.guarded:
            # (a graph found, not captured now: what these checks read is what the next
            # step's read, unless something changes it)
            self.guard = make_guard(dp, graph, inputs, targets, loss_fn, optimizer, accumulate,
                                    walk, summed)
        self.graphs.move_to_end(key)
        return self._replay(dp, graph, inputs, targets, summed, optimizer)

    def _replay_unchanged(self, dp, guard, inputs, targets, optimizer):
        """step() where the guard holds: what its checks would do, done (_count_change's
        counts: no change; its last value, the model's state, is this step's, as the model is
        unchanged), then the replay. (Its graph is the most recent already: any other key's
        step ran the checks, which dropped the guard.)"""
        self.changes["state"] = 0
        if optimizer is None:
            self.changes["sgd"] = 0
        return self._replay(dp, guard.graph, inputs, targets, guard.summed, optimizer)

    def _count_change(self, what, value, message):
        """One warning (message) once what's value has changed at 3 consecutive steps. (Over
        consecutive steps: a value that changes now and then, as MultiStepLR's lr, is captured
        again after each change and replayed in between.)"""
        last = self.last.get(what)
        self.changes[what] = self.changes.get(what, 0) + 1 if (
            last is not None and value != last) else 0
        self.last[what] = value
        if self.changes[what] == 3 and what not in self.warned:
            self.warned.add(what)
            warnings.warn(f"dpcuda DataParallel(graphs=True): {message}", RuntimeWarning,
                          stacklevel=4)

    def _eager(self, dp, inputs, targets, loss_fn, optimizer, accumulate, walk=None):
        # The ring's steps are read before an eager step's (the records in step order).
        if self.ring is not None:
            self.ring.flush(dp._pending)
        return dp._step_eager(inputs, targets, loss_fn, optimizer, accumulate, walk)

    def _capture(self, dp, key, inputs, targets, loss_fn, summed, optimizer, accumulate,
                 objects=()):
        """The step captured for key (None: the runtime refused; eager from then on).
        objects: what the key holds by identity, kept alive with the graph."""
        device = dp._replicas[0].device
        if self.ring is None or self.ring.records.shape[1] != len(dp._replicas):
            if self.ring is not None:
                self.ring.flush(dp._pending)
            self.ring = _Ring(len(dp._replicas), device)
        if self.pool is None and self.backend is _CudaGraph:
            self.pool = torch.cuda.graph_pool_handle()
        static_x = torch.empty_like(inputs, device=device)
        static_y = torch.empty_like(targets, device=device)
        graph = self.backend(device, self.pool)
        sink = _Sink(self.ring)
        dp._optimizer = optimizer
        if optimizer is not None:
            # (the plan and its hyperparameters exist before the capture reads them)
            if not dp._fused_update.ready(optimizer, dp._replicas, set(), dp._set.generation):
                dp._optimizer = None
                return None
            dp._fused_update.write_hyper(optimizer)

        grad_enabled = torch.is_grad_enabled()  # (a replay runs inside opt.step's no_grad)
        # What the body's sync would make (momentum buffers switched on since the warm-up, a
        # rebuilt replica) is made now, outside the capture: made inside, it would live in the
        # graph's pool and be made again (zeroed) by every replay.
        dp._sync()
        previous_norm = getattr(optimizer, "grad_norm", None)

        def body():
            dp._optimizer = optimizer
            dp._graph_ring = sink
            try:
                with torch.set_grad_enabled(grad_enabled):
                    dp._sync()
                    dp._step(static_x, static_y, loss_fn, accumulate)
            finally:
                dp._graph_ring = None
                dp._optimizer = None
        try:
            graph.capture(body)
        except Exception as err:  # the runtime refused the capture: eager from now on
            self.eager_keys.add(key)
            reason = f"the capture failed ({type(err).__name__}: {str(err)[:200]})"
            if reason not in self.warned:
                self.warned.add(reason)
                warnings.warn(f"dpcuda DataParallel(graphs=True): this step runs eagerly: "
                              f"{reason}", RuntimeWarning, stacklevel=4)
            for r in dp._replicas:
                r.drop_grads()
            if optimizer is not None:
                optimizer.grad_norm = previous_norm  # (not a tensor no kernel wrote)
            return None
        finally:
            dp._optimizer = None
        # (the optimizer kept alive with the graph: the key holds it by its id)
        captured = _Graph(list(objects) + [optimizer], graph, static_x, static_y,
                          dp._fused_update._plan if optimizer is not None else None, sink)
        self.graphs[key] = captured
        while len(self.graphs) > MAX_GRAPHS:
            # An evicted key warms up again before its next capture.
            evicted, _ = self.graphs.popitem(last=False)
            self.seen.pop(hash(evicted), None)
        return captured

    def _replay(self, dp, graph, inputs, targets, summed, optimizer):
        """One step from the graph: the batch into the static buffers, the hyperparameters
        into the plan's array, the replay; then the host's part of a step."""
        ring = self.ring
        # (no autograd context: the static buffers do not require grad, and a batch that does
        # is detached, so that no copy is recorded; torch.no_grad() costs as much as a copy)
        graph.static_x.copy_(inputs.detach() if inputs.requires_grad else inputs,
                             non_blocking=True)
        graph.static_y.copy_(targets.detach() if targets.requires_grad else targets,
                             non_blocking=True)

        replayed = []

        def run():
            # (inside opt.step(): after what a subclass's step or a wrapper of it changes)
            if optimizer is not None:
                dp._fused_update.recheck(optimizer)
                dp._fused_update.write_hyper(optimizer)
            graph.graph.replay()
            replayed.append(True)
            if optimizer is not None:
                dp._fused_update.finish(optimizer)
                if graph.sink.norm is not None:
                    # (a copy: the graph rewrites its norm at the next replay)
                    optimizer.grad_norm = graph.sink.norm.reshape(()).clone()
        try:
            if optimizer is not None:
                # Through opt.step(), as the eager fused step: its post-hooks and the
                # schedulers' bookkeeping see one step.
                optimizer._fused_step = run
                try:
                    optimizer.step()
                finally:
                    optimizer.__dict__.pop("_fused_step", None)
            else:
                run()
        finally:
            # Once replayed, the step counts and its records are read, also when a post-hook
            # raises after it: the host's count of the ring stays the device's.
            if replayed:
                ring.window.append((dp.steps, targets, summed, dp._classes))
                ring.slot = (ring.slot + 1) % RING
                dp.steps += 1
                for r in dp._replicas:
                    r.drop_grads()
                if len(ring.window) == RING:
                    ring.flush(dp._pending)
        return ring.loss.clone()  # (the static loss is rewritten by the next replay)

    def flush(self, dp):
        """The ring read now (synchronize(), the state functions): on DataParallel's own
        stream, after the replays, whichever stream the caller is on."""
        if self.ring is None or not self.ring.window:
            return
        stream = dp._streams().side(self.ring.device)
        if stream is None:
            self.ring.flush(dp._pending)
            return
        with torch.cuda.stream(stream):
            self.ring.flush(dp._pending)
