"""The gradient reduction of the conventional loop: when a backward through DataParallel's
output ends, every replica's .grad becomes the one-device gradient.

The replicas' outputs pass through _BackwardStart on their way to gather(). Its backward is the
first of the replicas' part of the graph to run: it takes the model's current gradients (what
earlier backward passes accumulated, R), sets every replica's .grad to None, and queues
GradReduction.finish on the autograd engine (torch's DDP queues its own final callback the same
way). finish runs once the whole backward has run: it sums the replicas' fresh gradients in
replica order with dpcuda's all-reduce (every replica the same bits) and gives every replica
R + that sum, which is what one device accumulates. Under no_sync() the fresh gradients are
kept aside instead (each replica's .grad shows R + its own share, as DDP's does) and join the
next synchronised backward's sum.
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
        self.sync = True            # False under no_sync()
        self._base = None           # R: per trainable parameter, the model's gradient or None
        self._unreduced = None      # per replica, the flat gradients no_sync() kept aside
        self._shown = None          # the .grad tensors no_sync() set on the model

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
        model_grads = [r0.params[i].grad for i in r0.trainable]
        if self._unreduced is not None:
            # Between no_sync() passes .grad holds what this object set there.
            if any(g is not s or (g is not None and g._version != v)
                   for g, (s, v) in zip(model_grads, self._shown)):
                self._abandon()
                raise RuntimeError(
                    "dpcuda DataParallel: a parameter's .grad changed between backward passes "
                    "under no_sync(); the gradients kept aside there could not be combined "
                    "with it (zero the gradients and start the accumulation again)")
        else:
            base = []
            for k, g in enumerate(model_grads):
                # The gradient buffer is overwritten by this pass: a gradient that is a view of
                # it is kept as a copy.
                if g is not None and g.data_ptr() == r0.views[k].data_ptr():
                    g = g.detach().clone()
                base.append(g)
            self._base = base
        for r in rs:
            r.drop_grads()

    def _abandon(self):
        self._unreduced = self._shown = self._base = None

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
                    for q in rs:
                        q.drop_grads()
                    self._abandon()
                    raise RuntimeError(
                        "dpcuda DataParallel: a backward with create_graph=True or sparse "
                        "gradients cannot be reduced over 2 or more replicas")
        fresh = []
        for r in rs:
            fresh.append([r.params[i].grad is not None for i in r.trainable])
            r.collect_grads()
        if self._unreduced is not None:
            for r, u in zip(rs, self._unreduced):
                r.flat_grad.add_(u)
        got = [any(f[k] for f in fresh) or (self._unreduced is not None and self._had[k])
               for k in range(len(rs[0].trainable))]
        if not self.sync:
            # Kept aside; each replica's .grad shows R + its own share, as DDP's does.
            self._unreduced = [r.flat_grad.clone() for r in rs]
            self._had = got
            self._show(rs, got, lambda r, k: r.views[k].clone())
            self._shown = [(g, None if g is None else g._version)
                           for g in (rs[0].params[i].grad for i in rs[0].trainable)]
            return
        self._unreduced = self._shown = None
        self._reduce([r.flat_grad for r in rs])
        self._show(rs, got, lambda r, k: r.views[k])
        self._base = None

    def _show(self, rs, got, value):
        """Every replica's .grad: R + the gradient where one arrived, R where none did."""
        base = self._base
        for r in rs:
            for k, i in enumerate(r.trainable):
                p = r.params[i]
                b = base[k]
                if not got[k]:
                    p.grad = None if b is None else b.to(r.device, copy=r.device != b.device
                                                         or r is not rs[0])
                    continue
                g = value(r, k)
                if b is not None:
                    g.add_(b.to(r.device))
                p.grad = g
