"""DataParallel's convenience step: step(inputs, targets, loss_fn) runs forward, loss, backward
and an SGD update of a global batch in one call.

A loss whose value is known without calling it (exactly nn.CrossEntropyLoss or dpcuda's
SoftmaxCrossEntropyLoss with reduction "mean" and no class weights, or F.cross_entropy, on
class-index targets; summed_loss) takes the per-replica path: each replica computes its rows'
summed loss over the global batch's label count, and the SGD update is fused into the
all-reduce (reduce_sgd_), which may skip itself on the device (blocking=False). Every other
loss is computed on the gathered output, as in the conventional loop, and the update follows
the reduction.
"""

import logging
import math
import operator
import time
import warnings

import torch

from .. import _C, ops
from ..batchnorm import Exchange, replica_context
from ..nn import SoftmaxCrossEntropyLoss, _has_grad_hooks, _has_hooks
from .labels import LabelChecks, LabelError, typed_label_error
from .pending import PendingSteps
from .primitives import _run_all, split_sizes
from .streams import StepStreams
from .update import UpdateMixin


# what an instance may set to compute something else than its class (nn.Module.__call__'s)
_CALL_ATTRIBUTES = ("forward", "_call_impl", "_wrapped_call_impl")


def _plain(loss_fn, cls):
    """loss_fn is exactly a cls (not a subclass, which may have a forward of its own) with no
    hooks and no forward set on the instance, so that its result is known without calling
    it."""
    if type(loss_fn) is not cls or _has_hooks(loss_fn):
        return False
    d = loss_fn.__dict__
    return not any(name in d for name in _CALL_ATTRIBUTES)


def _backward(out, grad):
    """out.backward(grad) for the logits and their gradient from loss_grad (the same shape,
    dtype and device, made by dpcuda): where neither is a subclass, no torch function mode is
    on and no functorch transform is active, straight into autograd's engine, without the
    checks torch.autograd.backward makes of a gradient it did not make (a few microseconds of
    a small step's host time); otherwise (or with autograd's debug logging on) torch's own
    call."""
    if type(out) is torch.Tensor and type(grad) is torch.Tensor and \
            not _has_torch_function((out, grad)) and \
            not torch._C._are_functorch_transforms_active() and \
            not _GRAPH_LOG.isEnabledFor(logging.DEBUG):
        _ENGINE.run_backward((out,), (grad,), False, False, (), allow_unreachable=True,
                             accumulate_grad=True)
    else:
        out.backward(grad)


_ENGINE = torch.autograd.Variable._execution_engine
_has_torch_function = torch._C._has_torch_function
_GRAPH_LOG = torch.autograd.graph.log


def summed_loss(loss_fn, targets):
    """For a loss that averages over the rows it does not ignore (a "mean" cross-entropy,
    nn.CrossEntropyLoss or dpcuda's SoftmaxCrossEntropyLoss, on class-index targets): the same
    loss as a sum over its rows, and its ignore_index. None for any other loss_fn, which
    the step computes on the gathered output. Half precision logits sum in float32: a float16 sum of a
    few thousand rows' losses overflows where the mean would not."""
    def summed(per_row):
        def fn(out, y):
            if out.dtype in (torch.float16, torch.bfloat16):
                return per_row(out, y, "none").sum(dtype=torch.float32)
            return per_row(out, y, "sum")
        return fn

    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        return None
    if _plain(loss_fn, SoftmaxCrossEntropyLoss) and loss_fn.reduction == "mean":
        return summed(lambda out, y, reduction: ops.softmax_cross_entropy(
            out, y, reduction, loss_fn.label_smoothing, loss_fn.ignore_index)), \
            loss_fn.ignore_index
    if targets.dtype != torch.long:  # torch's losses take int64 class indices only
        return None
    F = torch.nn.functional
    if _plain(loss_fn, torch.nn.CrossEntropyLoss) and loss_fn.reduction == "mean" and \
            loss_fn.weight is None:
        return summed(lambda out, y, reduction: F.cross_entropy(
            out, y, reduction=reduction, ignore_index=loss_fn.ignore_index,
            label_smoothing=loss_fn.label_smoothing)), loss_fn.ignore_index
    if loss_fn is F.cross_entropy:
        return summed(lambda out, y, reduction: F.cross_entropy(out, y, reduction=reduction)), \
            -100
    return None



class StepMixin(LabelChecks, PendingSteps, UpdateMixin):
    """The convenience step of DataParallel (see its docstring)."""

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

    def step(self, inputs, targets, loss_fn, optimizer=None, accumulate=1):
        """One step of the global batch (inputs, targets): forward, loss_fn(outputs,
        targets), backward and the update. Returns the loss as a float (blocking=False: a
        float64 scalar tensor on devices[0]). See DataParallel's docstring.

        optimizer: None (the wrapper's SGD, lr/momentum/weight_decay, fused into the
        reduction), or a torch.optim.Optimizer over the model's parameters (its param_groups,
        schedulers and state as usual). A dpcuda.optim optimizer, with the cross-entropy losses
        of the per-replica path, reducer "p2p" and the replicas on one device, is fused into
        the reduction (dpcuda/parallel/fused_update.py: each replica reduces and updates the
        shard it owns, with that shard's optimizer state, and the weights are gathered);
        .grad is then None afterwards. Otherwise the gradients are reduced, the model's .grad
        holds the global gradient (None for a parameter no replica used) and
        optimizer.step() updates the model, whose weights the other replicas take at the next
        forward. A step with NaN or Inf gradients is skipped (no update, no state change)
        either way.

        accumulate: run each replica's rows in this many micro-batches, one forward and
        backward after another with the gradients summed on the replica (activations for
        1/accumulate of the rows at a time), then reduce once and update once: the loss and,
        up to the rounding of that sum, the gradient of the whole batch. Needs the
        per-replica cross-entropy path (the loss of a batch is then the sum of its
        micro-batches' losses); not with buffers="sync". Batch-norm running statistics are
        updated once per micro-batch, as in a loop that accumulates."""
        if self._pending:
            self._settle(wait=False)
        if isinstance(accumulate, bool):
            raise TypeError(f"accumulate must be a positive int, got {accumulate!r}")
        try:
            accumulate = operator.index(accumulate)
        except TypeError:
            raise TypeError(f"accumulate must be a positive int, got {accumulate!r}") from None
        if accumulate < 1:
            raise ValueError(f"accumulate must be a positive int, got {accumulate}")
        if accumulate > 1 and any(map(_has_grad_hooks, self.module.parameters())):
            # (a hook would see each micro-batch's gradient alone, where torch's accumulating
            # loop hands it the running sum)
            raise ValueError("accumulate > 1 does not work with gradient hooks on the model's "
                             "parameters; accumulate in your own loop with no_sync()")
        if accumulate > 1 and self._sync_bn:
            raise ValueError("accumulate > 1 does not work with buffers='sync': batch norm "
                             "would normalise over a micro-batch, not the global batch")
        if not self._reduction.sync:
            raise RuntimeError("dpcuda DataParallel: step() inside no_sync(): a step applies "
                               "its update at once, with nothing to defer")
        # A graphed step whose checks would find what the last one found skips them and the
        # model's walk (replay_guard.py), this one included.
        guard = None if self._graphed is None else self._graphed.unchanged(
            inputs, targets, loss_fn, optimizer, accumulate)
        # Otherwise one walk over the model for the step's checks and its first sync, handed
        # down as an argument (no user code runs in between); a graphed step's checks read it
        # too (graphed.py).
        walk = None if guard is not None else self._set.walk(self._graphed is not None)
        if optimizer is not None and guard is None:
            self._check_optimizer(optimizer, walk[0])
        # On CUDA each step is ordered after the previous one and after the caller's work,
        # and the caller's streams after it, whichever stream or thread issued it (streams.py).
        return self._streams().run(lambda: self._step_checked(
            inputs, targets, loss_fn, optimizer, accumulate, walk, guard))

    def _streams(self):
        """The StepStreams of the replicas' devices (made at first use)."""
        streams = self.__dict__.get("_step_streams")
        if streams is None:
            streams = self.__dict__["_step_streams"] = StepStreams(
                [r.device for r in self._replicas])
        return streams

    def _step_checked(self, inputs, targets, loss_fn, optimizer, accumulate, walk=None,
                      guard=None):
        if self._graphed is not None:
            return self._graphed.step(self, inputs, targets, loss_fn, optimizer, accumulate,
                                      walk, guard)
        return self._step_eager(inputs, targets, loss_fn, optimizer, accumulate, walk)

    def _step_eager(self, inputs, targets, loss_fn, optimizer, accumulate, walk=None):
        """walk: the step's walk of the model (ReplicaSet.walk), made since the caller's last
        code ran; None: walked here."""
        self._sync(walk)
        # A step that raises leaves the buffers (batch-norm statistics) as they were, as it
        # leaves the weights.
        saved = [[b.clone() for b in bs] for bs in self._replica_buffers] if self._replica_buffers[0] else None
        self._optimizer = optimizer
        try:
            loss = self._step_any(inputs, targets, loss_fn, accumulate)
        except BaseException:
            # a flag a failed step raised (or left) must not speak for the next one (after a
            # sticky CUDA error this cannot run: the original error is the one to see)
            try:
                self._clear_label_flags()
            except Exception:
                pass
            # .grad None: what a failed step leaves in the buffers (some micro-batches' sums,
            # one replica's share) is no gradient of the batch
            for r in self._replicas:
                r.drop_grads()
            if saved is not None:
                with torch.no_grad():
                    for bs, copies in zip(self._replica_buffers, saved):
                        for b, c in zip(bs, copies):
                            b.copy_(c)
            raise
        finally:
            self._optimizer = None
        if saved is not None and self.buffer_mode == "broadcast" and self.reducer == "dist":
            # Every process takes rank 0's buffers, as DDP broadcasts rank 0's at each step
            # (the replicas of this process take the model's at the next forward).
            with torch.no_grad():
                for b in self._replica_buffers[0]:
                    self._dist.broadcast(b, src=0, group=self._group)
        return loss

    def _step_any(self, inputs, targets, loss_fn, accumulate=1):
        if self.reducer != "dist":
            return self._step(inputs, targets, loss_fn, accumulate)
        # Across processes a step that fails on one process (bad input, a bad label, an error
        # in its forward) must still take part in the step's collectives, or the others would
        # wait for it and then pair their next collectives with its next step's. So it joins
        # the exchange with a failure mark, every process raises, and none applies the step.
        self._dist_count = not self._global_rows or not self._inline
        self._dist_stage = 0  # 1: the count is done; 2: the exchange has begun
        # A dpcuda.optim optimizer's update sharded over the processes (ZeRO-1,
        # dpcuda/parallel/sharded.py), decided alike on every process before the step's
        # collectives begin (the failure exchange mirrors them).
        self._zero = False
        if self._optimizer is not None and self.shard_optimizer:
            want = isinstance(targets, torch.Tensor) and \
                summed_loss(loss_fn, targets) is not None
            self._zero = self._sharded_update.decide(
                self._optimizer, self._replicas, self._set.generation, self._dist, self._group,
                self._comm_device(), want)
        elif self._optimizer is not None:
            # (sharding switched off: the optimizer's own step on the whole state)
            self._sharded_update.release()
        try:
            return self._step(inputs, targets, loss_fn, accumulate)
        except Exception:
            if self._dist_stage < 2:
                self._fail_exchange()
            raise

    def _step(self, inputs, targets, loss_fn, accumulate=1):
        if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
            raise TypeError("inputs and targets must be tensors")
        if inputs.dim() == 0 or targets.dim() == 0:
            raise ValueError("inputs and targets must have a leading batch dimension")
        rows = inputs.shape[0]
        if targets.shape[0] != rows:
            raise ValueError(f"inputs has {rows} rows but targets has {targets.shape[0]}")
        if rows == 0:
            raise ValueError("the batch is empty")
        # (fewer rows than replicas: the replicas left without rows take part with none, as
        # in a weighted split that gives a replica nothing)
        sizes = split_sizes(rows, len(self._replicas), self._row_weights())
        summed = summed_loss(loss_fn, targets)
        if summed is None:
            if not self.blocking and self._optimizer is not None:
                raise ValueError(
                    f"dpcuda DataParallel: blocking=False with an optimizer needs a loss the "
                    f"step computes per replica (exactly nn.CrossEntropyLoss, F.cross_entropy "
                    f"or dpcuda's SoftmaxCrossEntropyLoss, mean, no class weights, on "
                    f"class-index targets); loss_fn {loss_fn!r} is computed on the gathered "
                    f"output, whose check reads the device; use blocking=True")
            if accumulate > 1:
                raise ValueError(
                    f"accumulate > 1 needs a loss the step computes per replica (exactly "
                    f"nn.CrossEntropyLoss, F.cross_entropy or dpcuda's "
                    f"SoftmaxCrossEntropyLoss, mean, no class weights, on class-index "
                    f"targets); for loss_fn {loss_fn!r} accumulate in your own loop with "
                    f"no_sync()")
            self._dist_stage = 2  # (the gathered path makes no failure exchange)
            return self._step_gathered(inputs, targets, loss_fn)
        self._set.build_modules()
        parts, start = [], 0
        for device, n in zip(self.devices, sizes):
            parts.append((inputs[start:start + n].to(device, non_blocking=True),
                          targets[start:start + n].to(device, non_blocking=True)))
            start += n
        # What the loss is a mean over: the rows, or for a cross-entropy loss with class-index
        # targets the rows that are not ignored. Each replica's loss is its sum over that
        # denominator of the global batch, so every replica count computes the global mean.
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
            targets.device.type != "cpu" or self._count_on_device or
            self._graph_ring is not None) and not half
        if count_on_device:
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
        fold = isinstance(loss_fn, SoftmaxCrossEntropyLoss)
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
                _C._take_label_error()  # (a record an earlier call left must not speak here)
                added = []  # whether a later micro-batch's gradients are to be added
                try:
                    return micro_batches(added)
                except ValueError as err:
                    typed = typed_label_error(err)
                    if typed is None:
                        raise
                    raise typed from None
                finally:
                    replica.collect_grads(add=bool(added))

            def micro_batches(added):
                if accumulate == 1 or size == 0:
                    return forward_backward(*part)
                # Each micro-batch's loss is its rows' sum over the global denominator, so the
                # micro-batches' losses and gradients sum to the batch's.
                x, y = part
                losses, seconds, at = [], 0.0, 0
                for n in split_sizes(size, accumulate):
                    if n == 0:
                        continue
                    if at:
                        replica.collect_grads(add=bool(added))
                        replica.release_grads(into=False)
                        added.append(True)
                    loss, t = forward_backward(x[at:at + n], y[at:at + n])
                    losses.append(loss.reshape(-1))
                    seconds += t
                    at += n
                return torch.cat(losses), seconds

            def forward_backward(x, y):
                if size == 0 and exchange is None:
                    return 0.0, 0.0
                start = time.perf_counter()
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
                    else:
                        loss = summed[0](out, y) * inv
                finally:
                    if defer:
                        _C._defer_label_checks(previous)
                if grad is None:
                    loss.backward()
                elif out.requires_grad:
                    _backward(out, grad)
                else:  # as loss.backward() in torch (no_grad, or nothing to train)
                    raise RuntimeError("element 0 of tensors does not require grad and does "
                                       "not have a grad_fn")
                if replica.device.type == "cuda" and self.split == "auto":
                    torch.cuda.synchronize(replica.device)
                self._classes = out.shape[1] if out.dim() >= 2 else None
                return loss.detach(), time.perf_counter() - start
            return run

        self._reduction.enabled = False  # (this path reduces by itself)
        try:
            results = _run_all([work(i, r, p, s) for i, (r, p, s)
                                in enumerate(zip(self._replicas, parts, sizes))], self.devices,
                               concurrent=exchange is not None,
                               on_error=exchange.abort if exchange is not None else None)
        except LabelError as err:
            # dpcuda's CPU loss checks labels as it runs and names a position in its replica's
            # slice: name the position in the caller's batch.
            self._classes = err.classes
            self._raise_label_error(targets, summed)
            raise
        finally:
            self._reduction.enabled = True
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
                summed[1]))
        if not self.blocking:
            return self._step_async(records, targets, summed, global_den, count_on_device)
        # (blocking=False, with or without an optimizer, took _step_async above)
        # One host read per replica of its record.
        reads = [x.cpu() for x in records]
        if any(float(x[2]) for x in reads):
            self._raise_label_error(targets, summed)
        loss = float(sum(float(x[0]) for x in reads)) if global_den > 0 else math.nan

        if any(float(x[1]) for x in reads):
            self._skipped(reduced=False, stacklevel=2)
            return loss
        # torch.optim.SGD leaves a parameter that got no gradient alone (no decay, no momentum):
        # so does the step for one that no replica's forward used.
        unused = set.intersection(*(r.unused for r in self._replicas))
        if self._optimizer is not None:
            self._reduce_then_update(unused)
            self.steps += 1
            return loss
        kept = self._keep(unused) if unused else None
        if self.reducer == "p2p":
            self._reduce_p2p()
        else:
            self._reduce_host()
        if kept is not None:
            for dst, src in kept:
                dst.copy_(src)
        self._consumed()
        self.steps += 1
        return loss

    def _skipped(self, reduced, stacklevel):
        """A step skipped for NaN or Inf gradients: counted; .grad kept where it is the global
        gradient (reduced), else None (never a replica's unreduced share); a clipping
        optimizer's grad_norm NaN (the norm of a non-finite gradient is not a number to act
        on), where it would otherwise still show the last step's. Then its warning (last: a
        warnings filter that makes it an error leaves the step counted and the state whole);
        stacklevel: the caller's."""
        step = self.steps
        self.skipped_steps += 1
        self.steps += 1
        if not reduced:
            for r in self._replicas:
                r.drop_grads()
        if getattr(self._optimizer, "max_grad_norm", None) is not None:
            self._optimizer.grad_norm = torch.tensor(
                math.nan, dtype=self._replicas[0].flat_param.dtype, device=self.devices[0])
        warnings.warn(f"dpcuda DataParallel: step {step} has NaN or Inf gradients; skipped "
                      f"(weights unchanged)", RuntimeWarning, stacklevel=stacklevel + 1)

    def _consumed(self):
        """After a fused update: .grad is None (the update consumed the gradient, which the
        reduction leaves only partly summed on some replicas; None, never a partial sum), and
        the replicas hold the same weights."""
        for r in self._replicas:
            r.drop_grads()

    def _step_gathered(self, inputs, targets, loss_fn):
        """The step for any other loss: loss_fn on the gathered output, as one device computes
        it; the backward's reduction gives every replica the global gradient (.grad keeps it);
        then the same SGD update on every replica."""
        if self._sync_bn:
            raise ValueError(f"buffers='sync' works with the cross-entropy losses step() "
                             f"computes per replica (exactly nn.CrossEntropyLoss, "
                             f"F.cross_entropy or dpcuda's SoftmaxCrossEntropyLoss, mean, no "
                             f"class weights); loss_fn {loss_fn!r} is computed on the gathered "
                             f"output, whose backward runs the replicas one after another")
        for r in self._replicas:
            r.drop_grads()
        out = self(inputs)
        loss = loss_fn(out, targets)
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss_fn must return a tensor, got {type(loss).__name__}")
        loss.backward()
        r0 = self._replicas[0]
        unused = {k for k, i in enumerate(r0.trainable) if r0.params[i].grad is None}
        if not self._reduces:
            r0.collect_grads()  # (one replica: the gradients into its flat buffer)
        value = float(loss.detach().double()) if loss.numel() == 1 else float("nan")
        if self.blocking:
            result = value
        else:
            result = torch.tensor(value, dtype=torch.float64, device=self.devices[0])
        if not bool(torch.isfinite(r0.flat_grad).all()):
            self._skipped(reduced=True, stacklevel=3)
            return result
        if self._optimizer is not None:
            self._update_by_optimizer(unused)
            self.steps += 1
            return result
        kept = self._keep(unused) if unused else None
        if self.reducer == "host":
            # (the host's weights and momentum, as the fused host step updates them)
            self._update_host(self._replicas[0].flat_grad.to("cpu"))
        for r in self._replicas if self.reducer != "host" else ():
            torch.ops.dpcuda.reduce_sgd_([r.flat_param], [r.flat_grad],
                                         [r.momentum] if self.momentum else [],
                                         *self._sgd_args(), False, "one_shot")
        if kept is not None:
            for dst, src in kept:
                dst.copy_(src)
        self.steps += 1
        return result

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
