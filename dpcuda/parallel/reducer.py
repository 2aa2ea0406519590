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


class _BackwardStart(torch.autograd.Function):
    """Identity on the replicas' pieces of one output; its backward starts the reduction."""

    @staticmethod
    def forward(ctx, reduction, *pieces):
        ctx.reduction = reduction
        return tuple(p.view_as(p) for p in pieces)

    @staticmethod
    def backward(ctx, *grads):
        ctx.reduction.started()
        return (None,) + grads


def mark_outputs(outputs, reduction):
    """The replicas' outputs (one structure each) with every output that requires grad routed
    through _BackwardStart."""
    leaves = [list(_leaves(o)) for o in outputs]
    if len({len(x) for x in leaves}) != 1:
        raise TypeError("dpcuda DataParallel: the replicas returned different structures")
    routed = [list(x) for x in leaves]
    for j in range(len(leaves[0])):
        pieces = [x[j] for x in leaves]
        if any(p.requires_grad for p in pieces):
            for i, p in enumerate(_BackwardStart.apply(reduction, *pieces)):
                routed[i][j] = p
    result = []
    for o, r in zip(outputs, routed):
        it = iter(r)
        result.append(_map(lambda t: next(it), o))
    return result


class GradReduction:
    """The reduction of one DataParallel: reduce(buffers) sums the replicas' flat gradient
    buffers in place (the reducer: p2p, host or dist)."""

    def __init__(self, replica_set, reduce):
        self._set = replica_set
        self._reduce = reduce
        self._lock = threading.Lock()
        self._active = False
        self.sync = True     # False under no_sync()
        self._local = None   # after a no_sync() pass: the model's .grad tensors and versions

    def started(self):
        with self._lock:
            if self._active:
                return
            self._active = True
        try:
            self._start()
        except BaseException:
            self._active = False
            raise
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _start(self):
        rs = self._set.replicas
        r0 = rs[0]
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
        try:
            self._finish_pass()
        finally:
            self._active = False

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
        # A parameter no replica has a gradient for keeps None, as on one device.
        for r in rs:
            for k, i in enumerate(r.trainable):
                if not got[k]:
                    r.params[i].grad = None
