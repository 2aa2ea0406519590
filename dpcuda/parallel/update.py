"""How a DataParallel step's reduced gradients become an update: the checks of the step's
optimizer, the update by it (fused into the reduction where dpcuda.optim's FusedUpdate is ready,
else the replicas' gradients summed in replica order and optimizer.step() on the model), and the
wrapper's own SGD on the p2p reduction (reduce_sgd_) or the host's. A mixin of StepMixin
(step.py), which decides which of them a step takes.
"""

import itertools

import torch

from ..optim import _FusedOptimizer


class UpdateMixin:
    """The update half of DataParallel's step (the module docstring)."""

    def _check_optimizer(self, optimizer, params):
        """optimizer fits this step; params: the model's parameters (its walk's)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer (dpcuda.optim's or "
                            f"torch's), got {type(optimizer).__name__}")
        if not self.blocking:
            devices = {r.device for r in self._replicas}
            if not isinstance(optimizer, _FusedOptimizer) or len(devices) != 1:
                raise ValueError(
                    "dpcuda DataParallel: blocking=False with an optimizer needs a dpcuda.optim "
                    "optimizer (SGD, Adam, AdamW) and the replicas on one device, where its "
                    "update is fused into the reduction and the device decides to skip it; "
                    f"got {type(optimizer).__name__} over replicas on "
                    f"{sorted(map(str, devices))}; use blocking=True")
        own = set(map(id, params))
        held = itertools.chain.from_iterable(group["params"] for group in optimizer.param_groups)
        if not own.issuperset(map(id, held)):
            raise ValueError("dpcuda DataParallel: the optimizer holds a tensor that is not a "
                             "parameter of dp.module; make it over dp.parameters()")

    def _reduce_then_update(self, unused):
        """The update by the step's optimizer: fused into the reduction where FusedUpdate is
        ready for it; else the replicas' gradients summed in replica order (dpcuda's
        all-reduce, or the host's sum), the model's .grad the global gradient (None for a
        parameter no replica used, as one device leaves it), the other replicas' .grad None,
        then optimizer.step() on the model."""
        rs = self._replicas
        if self.reducer == "p2p" and self._fused_update.ready(self._optimizer, rs, unused,
                                                              self._set.generation):
            # The update fused into the reduction, with sharded optimizer state; .grad is None
            # afterwards (the reduction leaves no replica holding the global gradient).
            self._fused_update.update(self._optimizer, rs, self.algorithm)
            return
        if len(rs) > 1:
            if self.reducer == "p2p":
                torch.ops.dpcuda.all_reduce_([r.flat_grad for r in rs], "sum", self.algorithm)
            else:
                total = rs[0].flat_grad.to("cpu", copy=True)
                for r in rs[1:]:
                    total += r.flat_grad.to("cpu")
                rs[0].flat_grad.copy_(total)
        self._update_by_optimizer(unused)

    def _update_by_optimizer(self, unused):
        r0 = self._replicas[0]
        # A parameter frozen since an earlier step keeps no gradient from it (the optimizer
        # would apply it again, as torch's loop without zero_grad would not).
        for p in r0.params:
            p.grad = None
        for k, i in enumerate(r0.trainable):
            r0.params[i].grad = None if k in unused else r0.views[k]
        for r in self._replicas[1:]:
            r.drop_grads()
        self._optimizer.step()

    def _keep(self, indices):
        """Copies of the weights and momenta of the given parameters, to put back after the
        update: (destination, copy) pairs."""
        spans = [self._replicas[0].spans[i] for i in sorted(indices)]
        buffers = [t for r in self._replicas for t in (r.flat_param, r.momentum) if t is not None]
        if self.reducer == "host" and self._host_momentum is not None:
            buffers.append(self._host_momentum)
        return [(b[o:o + n], b[o:o + n].clone()) for b in buffers for o, n in spans]

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
        # the update applied to a host copy of the weights, the weights copied to every device.
        host = [r.flat_grad.to("cpu") for r in self._replicas]
        total = host[0]
        for g in host[1:]:
            total = total + g
        self._update_host(total)

    def _update_host(self, total):
        """The host reducer's update of the summed gradient (host memory): on a host copy of
        the weights, with the host's momentum; the weights then copied to every replica."""
        weights = self._replicas[0].flat_param.detach().to("cpu", copy=True)
        m = [self._host_momentum] if self.momentum else []
        torch.ops.dpcuda.reduce_sgd_([weights], [total], m, *self._sgd_args(), False,
                                     "one_shot")
        for r in self._replicas:
            r.flat_param.copy_(weights, non_blocking=False)
