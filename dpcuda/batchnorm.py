"""Batch normalisation with statistics over DataParallel's global batch (buffers="sync").

While DataParallel.step runs, each replica's BatchNorm1d/2d/3d in training mode normalises
with the mean and variance of the whole global batch, as one device would, not of its own
rows: the replicas exchange per-channel sums through _AllSum, an autograd function whose
backward is the same exchange of the gradients. The sums are added in replica order, in
float64, so every replica gets the same bits. Outside a step (evaluation, a plain call) the
modules are torch's BatchNorm.

The exchange needs every replica running at once: DataParallel gives each its own thread
(on the CPU the autograd engine runs a backward on the calling thread; on CUDA on the
device's own thread, so each replica needs a device of its own). Every wait is bounded.
"""
import threading

import torch
import torch.nn as nn

__all__ = ["Exchange", "replica_context", "sync_batch_norm_"]

_local = threading.local()


class Exchange:
    """Sums tensors over `replicas` threads: each calls all_sum(index, t) in the same order."""

    def __init__(self, replicas, timeout):
        self._barrier = threading.Barrier(replicas, timeout=timeout)
        self._slots = [None] * replicas
        self._result = None
        self._timeout = timeout

    def _wait(self):
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            err = RuntimeError(
                "dpcuda DataParallel (buffers='sync'): another replica failed, or did not reach "
                f"the batch-norm exchange within {self._timeout:g} s")
            err.dpcuda_secondary = True  # _run_all raises the failing replica's own error first
            raise err from None

    def all_sum(self, index, t):
        """The sum over replicas of t (replica order, float64), in t's dtype and device."""
        self._slots[index] = t
        self._wait()
        if index == 0:
            acc = self._slots[0].to(torch.float64)
            for s in self._slots[1:]:
                acc = acc + s.to(acc.device, torch.float64)
            self._result = acc
        self._wait()
        # The next call overwrites the result only after every replica has passed its first
        # wait, that is after every replica has read this one.
        # A copy per replica: the tensor becomes an autograd output or gradient of this
        # replica's graph alone (the engine may accumulate into a gradient in place).
        return self._result.to(t.device, t.dtype, copy=True)

    def abort(self):
        """Wakes every replica waiting in the exchange with an error (one has failed)."""
        self._barrier.abort()


class _AllSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, exchange, index):
        ctx.exchange, ctx.index = exchange, index
        return exchange.all_sum(index, t)

    @staticmethod
    def backward(ctx, grad):
        # Each replica's output is the sum of every replica's input: the gradient of an input
        # is the sum of every replica's output gradient.
        return ctx.exchange.all_sum(ctx.index, grad.contiguous()), None, None


class replica_context:
    """Marks the calling thread as replica `index` of a step using `exchange`."""

    def __init__(self, exchange, index):
        self._value = (exchange, index)

    def __enter__(self):
        self._previous = getattr(_local, "replica", None)
        _local.replica = self._value

    def __exit__(self, *exc):
        _local.replica = self._previous


def _sync_forward(bn, x, exchange, index):
    channels = x.shape[1]
    dims = [0] + list(range(2, x.dim()))
    shape = [1, channels] + [1] * (x.dim() - 2)
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    xf = x.to(acc)
    local_count = x.numel() // channels if channels else 0
    # The count travels with the sums, in float64 (exact up to 2**53 values per channel).
    local = torch.cat([xf.sum(dims).to(torch.float64),
                       torch.tensor([float(local_count)], dtype=torch.float64, device=x.device)])
    total = _AllSum.apply(local, exchange, index)
    count = int(total[-1].item())  # on CUDA one synchronisation per layer and step
    if count <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got {count} "
                         f"over the global batch")
    mean = total[:-1].to(acc) / count
    d = xf - mean.view(shape)
    var = _AllSum.apply((d * d).sum(dims), exchange, index) / count
    y = d * torch.rsqrt(var + bn.eps).view(shape)
    if bn.affine:
        y = y * bn.weight.to(acc).view(shape) + bn.bias.to(acc).view(shape)
    if bn.track_running_stats and bn.running_mean is not None:
        with torch.no_grad():
            bn.num_batches_tracked.add_(1)
            m = bn.momentum if bn.momentum is not None else 1.0 / float(bn.num_batches_tracked)
            unbiased = var.detach() * (count / (count - 1))
            bn.running_mean.mul_(1 - m).add_(mean.detach().to(bn.running_mean.dtype), alpha=m)
            bn.running_var.mul_(1 - m).add_(unbiased.to(bn.running_var.dtype), alpha=m)
    return y.to(x.dtype)


class _SyncMixin:
    def forward(self, x):
        replica = getattr(_local, "replica", None)
        if replica is None or not (self.training or self.running_mean is None):
            return super().forward(x)
        self._check_input_dim(x)
        return _sync_forward(self, x, *replica)


class SyncBatchNorm1d(_SyncMixin, nn.BatchNorm1d):
    pass


class SyncBatchNorm2d(_SyncMixin, nn.BatchNorm2d):
    pass


class SyncBatchNorm3d(_SyncMixin, nn.BatchNorm3d):
    pass


_SYNC = {nn.BatchNorm1d: SyncBatchNorm1d, nn.BatchNorm2d: SyncBatchNorm2d,
         nn.BatchNorm3d: SyncBatchNorm3d}


def sync_batch_norm_(module):
    """In place: every BatchNorm1d/2d/3d of module synchronises its statistics over the
    replicas during DataParallel steps (same parameters, buffers and state_dict keys). Other
    batch-norm classes raise ValueError. Returns how many were converted."""
    converted = 0
    for name, m in module.named_modules():
        if type(m) in _SYNC:
            m.__class__ = _SYNC[type(m)]
            converted += 1
        elif isinstance(m, nn.modules.batchnorm._NormBase) and not isinstance(m, _SyncMixin) \
                and isinstance(m, nn.modules.batchnorm._BatchNorm):
            raise ValueError(f"buffers='sync' supports nn.BatchNorm1d/2d/3d; {name or 'the model'} "
                             f"is {type(m).__name__}")
    return converted
