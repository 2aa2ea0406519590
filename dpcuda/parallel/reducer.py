"""The gradient reduction of the conventional loop: when a backward through DataParallel's
output ends, every replica's .grad becomes the one-device gradient.

The replicas' outputs pass through _BackwardStart on their way to gather(). Its backward is the
first of the replicas' part of the graph to run: it leaves the model's .grad as it is (what
earlier backward passes accumulated, R: the backward adds replica 0's share to it), sets the
other replicas' .grad to None (they held copies of the last reduced gradient), and queues
GradReduction.finish on the autograd engine (torch's DDP queues its own final callback the same
way). finish runs once the whole backward has run: it sums the replicas' gradients in replica
order with dpcuda's all-reduce (every replica the same bits), so every replica holds R + every
replica's share, what one device accumulates. Under no_sync() finish does nothing: each
replica's .grad keeps its own accumulation (DDP's behaviour), and the next synchronised
backward sums them all.
"""

import threading

import torch

from .primitives import _leaves, _map
from ..nn import _has_grad_hooks
from .replicas import accumulator


class _BackwardStart(torch.autograd.Function):
    """Identity on the replicas' pieces of one output; its backward starts the reduction.
    probe: the reduction's probe leaf (never given a gradient), whose node tells whether the
    engine runs every node (a plain backward) or only those some inputs need."""

    @staticmethod
    def forward(ctx, reduction, generation, probe, *pieces):
        ctx.reduction, ctx.generation = reduction, generation
        return tuple(p.view_as(p) for p in pieces)

    @staticmethod
    def backward(ctx, *grads):
        ctx.reduction.started(ctx.generation)
        return (None, None, None) + grads


def mark_outputs(outputs, reduction, generation):
    """The replicas' outputs (one structure each) with every output that requires grad routed
    through _BackwardStart (the replicas as built at `generation`)."""
    leaves = [list(_leaves(o)) for o in outputs]
    if len({len(x) for x in leaves}) != 1:
        raise ValueError(f"dpcuda DataParallel: the replicas returned outputs of different "
                         f"structures ({[len(x) for x in leaves]} tensors): an entry per row "
                         f"cannot be gathered; return the rows as one tensor")
    routed = [list(x) for x in leaves]
    for j in range(len(leaves[0])):
        pieces = [x[j] for x in leaves]
        if any(p.requires_grad for p in pieces):
            for i, p in enumerate(_BackwardStart.apply(reduction, generation, reduction.probe,
                                                       *pieces)):
                routed[i][j] = p
    result = []
    for o, r in zip(outputs, routed):
        it = iter(r)
        result.append(_map(lambda t: next(it), o))
    return result


class GradReduction:
    """The reduction of one DataParallel: reduce(buffers) sums the replicas' flat gradient
    buffers in place (the reducer: p2p, host or dist); every_param=True (reducer "dist") gives
    every parameter a gradient, since whether another process used one is not known here.
    enabled=False (DataParallel.step's fused path, which reduces by itself) turns it off.

    A reduction starts once per backward pass (the engine's graph task id tells passes apart,
    also after a pass that failed and never ran its final callback): from _BackwardStart, or
    from a pre-hook on the AccumulateGrad node of a parameter of replica 1 or more (a loss that
    reaches the replicas other than through dp's output, such as activations a forward hook
    kept)."""

    def __init__(self, replica_set, reduce, every_param=False):
        self._set = replica_set
        self._reduce = reduce
        self._every_param = every_param
        self.enabled = True
        self._lock = threading.Lock()
        self._task = None    # the graph task whose reduction has started
        self.sync = True     # False under no_sync()
        self._local = None   # after a no_sync() pass: the model's .grad tensors and versions
        self.probe = torch.zeros((), requires_grad=True)
        self._probe_node = None

    def __getstate__(self):  # (copy.deepcopy, pickle: no lock, no autograd node)
        state = dict(self.__dict__)
        state["_lock"] = state["_probe_node"] = state["_task"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def started(self, generation=None):
        if not self.enabled:
            return
        if generation is not None and generation != self._set.generation:
            # (checked for every output: one made before the rebuild fails the pass)
            raise RuntimeError(
                "dpcuda DataParallel: the model changed (its parameters, buffers or "
                "requires_grad) after this output's forward, so its replicas were rebuilt; run "
                "the forward again before the backward")
        task = torch._C._current_graph_task_id()
        with self._lock:
            if self._task == task:
                return
            self._task = task
        if generation is not None and not self._every_node_runs():
            return
        self._start()
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _every_node_runs(self):
        """False for torch.autograd.grad and backward(inputs=...), where no parameter's
        gradient accumulates: exact when only the inputs' gradients are asked for (a gradient
        penalty's); raises when the model's parameters are among the inputs, whose gradients
        would be replica 0's share only."""
        if self._probe_node is None:
            self._probe_node = accumulator(self.probe)
        if torch._C._will_engine_execute_node(self._probe_node):
            return True
        r0 = self._set.replicas[0]
        try:
            # (torch.autograd.grad refuses to be asked about a leaf among its inputs)
            asked = any(torch._C._will_engine_execute_node(n) for n in r0.accumulators())
        except RuntimeError:
            asked = True
        if asked:
            raise RuntimeError(
                "dpcuda DataParallel: torch.autograd.grad or backward(inputs=...) asking for "
                "the model's parameters through 2 or more replicas would give only replica 0's "
                "share of their gradients; call backward() without inputs (every replica's "
                ".grad is then the one-device gradient). The inputs' gradients alone are exact")
        return False

    def _start(self):
        rs = self._set.replicas
        r0 = rs[0]
        for i in r0.trainable:
            p = r0.params[i]
            if _has_grad_hooks(p):
                raise RuntimeError(
                    f"dpcuda DataParallel: a parameter of the model has a gradient hook "
                    f"(registered after the forward); with {len(rs)} replicas it would see "
                    f"replica 0's share of the gradient. Remove it, or read .grad after "
                    f"backward()")
        if self._local is None:
            # The other replicas hold copies of the last reduced gradient (in the model's .grad).
            for r in rs[1:]:
                r.drop_grads()
            return
        # After no_sync() passes every replica holds its own accumulation. A model gradient set
        # to None since (zero_grad) drops the others' too; one changed otherwise cannot be
        # combined with theirs.
        for k, i in enumerate(r0.trainable):
            g, (kept, version) = r0.params[i].grad, self._local[k]
            if g is None and kept is not None:
                for r in rs[1:]:
                    r.params[i].grad = None
            elif g is not kept or (g is not None and g._version != version):
                self._local = None
                raise RuntimeError(
                    "dpcuda DataParallel: a parameter's .grad changed between backward passes "
                    "under no_sync(); the other replicas' accumulations could not be combined "
                    "with it (zero the gradients with zero_grad() and start again)")
        self._local = None

    def _finish(self):
        self._finish_pass()

    def _finish_pass(self):
        rs = self._set.replicas
        for r in rs:
            for i in r.trainable:
                g = r.params[i].grad
                if g is not None and (g.requires_grad or g.is_sparse):
                    raise RuntimeError(
                        "dpcuda DataParallel: a backward with create_graph=True or sparse "
                        "gradients cannot be reduced over 2 or more replicas")
        if not self.sync:
            r0 = rs[0]
            self._local = [(g, None if g is None else g._version)
                           for g in (r0.params[i].grad for i in r0.trainable)]
            return
        got = [False] * len(rs[0].trainable)
        for r in rs:
            for k, i in enumerate(r.trainable):
                got[k] = got[k] or r.params[i].grad is not None
            r.collect_grads()
        self._reduce([r.flat_grad for r in rs])
        # A parameter no replica has a gradient for keeps None, as on one device (not across
        # processes, where another may have used it: there every parameter gets its gradient).
        if self._every_param:
            return
        for r in rs:
            for k, i in enumerate(r.trainable):
                if not got[k]:
                    r.params[i].grad = None
