"""DataParallel's convenience step across processes (reducer "dist"): the local replicas'
sum, then one torch.distributed exchange of the gradients with a record (the loss, the label
count, the bad-label flag) behind them, after which every process decides alike.
"""

import math

import torch


class DistStepMixin:
    """The reducer "dist" part of DataParallel's step (a mixin: it reads the wrapper's
    replicas and process group)."""

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
        inline = self._inline and not self._zero
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
        if self._zero:
            record = torch.stack([x.to(device) for x in local]).sum(0)
            return self._step_sharded(record, local, assumed_rows, targets, summed)
        comm = buffers[0] if buffers[0].device == device else buffers[0].to(device)
        record = None if inline else torch.stack([x.to(device) for x in local]).sum(0)
        self._exchange(comm, record, bucket_bytes)
        if inline:
            record = comm[-3:]
            comm = comm[:-3]
        loss, global_rows = self._read_record(record, local, targets, summed)
        if global_rows == 0:
            loss = math.nan  # a mean over no rows, as torch's; the gradients are 0
        elif global_rows != assumed_rows:
            # The global batch changed: every process scaled its gradients (and its loss) by
            # 1 / assumed_rows.
            fix = assumed_rows / global_rows
            comm.mul_(fix)
            loss *= fix
        if not (bool(torch.isfinite(comm.sum())) or bool(torch.isfinite(comm).all())):
            self._skipped(reduced=False, stacklevel=3)
            return loss
        if self._optimizer is not None:
            # As DDP: every parameter has a gradient (0 where no process used it).
            if rs[0].flat_grad.data_ptr() != comm.data_ptr():
                rs[0].flat_grad.copy_(comm)
            self._update_by_optimizer(set())
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

    def _read_record(self, record, local, targets, summed):
        """The summed record's loss and global rows; raises where a process failed."""
        loss, global_rows, failed = record.tolist()
        if failed:
            # A bad label (1 per replica that saw one) or a process that failed (2): every
            # process sees the sum, so every process raises, and none applies the step.
            if any(float(x[2]) for x in local):
                self._raise_label_error(targets, summed)
            raise RuntimeError("dpcuda DataParallel: another process failed in this step (a bad "
                               "label or an error); the step was not applied on any process")
        self._global_rows = int(global_rows)
        return loss, global_rows

    def _step_sharded(self, record, local, assumed_rows, targets, summed):
        """The rest of a step whose dpcuda.optim update is sharded over the processes
        (dpcuda/parallel/sharded.py): the reduce-scatter with the record's all-reduce, the
        verdict (skip, the norm) from every process's shard, the owners' updates and the
        weights' all-gather. .grad is None afterwards on every replica (no process holds the
        whole global gradient)."""
        rs = self._replicas
        shards = self._sharded_update.shards
        self._dist_stage = 2
        shards.exchange(rs[0].flat_grad, record)
        loss, global_rows = self._read_record(record, local, targets, summed)
        scale = 1.0
        if global_rows == 0:
            loss = math.nan  # a mean over no rows, as torch's; the gradients are 0
        elif global_rows != assumed_rows:
            scale = assumed_rows / global_rows
            loss *= scale
        opt = self._optimizer
        skip, norm = shards.verdict(scale, opt.max_grad_norm)
        for r in rs:
            r.drop_grads()
        if skip:
            self._skipped(reduced=False, stacklevel=4)
            return loss
        if norm is not None:
            opt.grad_norm = norm
        # Through opt.step(), so that what wraps it runs as for any step (post-hooks, the
        # schedulers' bookkeeping).
        opt._fused_step = lambda: shards.update(norm, rs[0].flat_param)
        try:
            opt.step()
        finally:
            opt.__dict__.pop("_fused_step", None)
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
        if self._zero:
            record = torch.tensor([0.0, 0.0, 2.0], dtype=torch.float64, device=device)
            self._sharded_update.shards.exchange(None, record)
            return
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
