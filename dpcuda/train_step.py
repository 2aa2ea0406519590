"""The training step of `dpcuda train` when it runs a dpcuda.optim optimizer (--optimizer adam
or adamw, or SGD with an --lr-schedule, --warmup-steps, --clip-grad-norm or --accumulate):
the optimizer, its learning-rate schedule, and one optimizer step of a global batch.

The step is DataParallel.step(x, y, loss_fn, optimizer=opt, accumulate=--accumulate), the
optimizer made with max_grad_norm=--clip-grad-norm: with the replicas on one device the
update, the clipping by the global norm and the sharded optimizer state are fused into the
reduction, and the micro-batches are reduced once, at the update. A step whose gradients hold
NaN or Inf is skipped (no optimizer step, no schedule step), as the wrapper's own step skips
it.
"""

import math

import torch

from . import optim

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine", "onecycle")


def uses_optimizer(cfg):
    """Whether the run needs a dpcuda.optim optimizer (else the wrapper's fused SGD runs)."""
    return (cfg.optimizer != "sgd" or cfg.lr_schedule != "constant" or cfg.warmup_steps > 0
            or cfg.clip_grad_norm is not None or cfg.accumulate > 1)


def make_optimizer(cfg, params):
    if cfg.optimizer == "sgd":
        return optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                         weight_decay=cfg.weight_decay, max_grad_norm=cfg.clip_grad_norm)
    cls = optim.Adam if cfg.optimizer == "adam" else optim.AdamW
    return cls(params, lr=cfg.lr, weight_decay=cfg.weight_decay,
               max_grad_norm=cfg.clip_grad_norm)


def make_scheduler(cfg, opt, total_steps):
    """--lr-schedule over total_steps optimizer steps, after --warmup-steps of linear warm-up
    (from lr / (warmup + 1)): constant, cosine (to 0) or onecycle (torch's OneCycleLR with
    max_lr = --lr, its warm-up the --warmup-steps, or 30% of the steps when 0, the momentum
    not cycled). A onecycle run too short for its two phases raises ValueError."""
    warmup = cfg.warmup_steps
    if cfg.lr_schedule == "onecycle":
        # Its two phases each need at least one step: 2 <= warm-up < the run's steps.
        rise = warmup or int(0.3 * total_steps)
        if not 2 <= rise < total_steps:
            raise ValueError(f"--lr-schedule onecycle needs a warm-up of at least 2 optimizer "
                             f"steps and fewer than the run's {total_steps}; got {rise}"
                             f"{'' if warmup else ' (30% of the run)'}: change --warmup-steps "
                             f"or --epochs")
        # The momentum (SGD's, Adam's beta1) stays the one given; torch's default would cycle
        # it between 0.85 and 0.95 over --momentum.
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=total_steps,
                                                   pct_start=rise / total_steps,
                                                   cycle_momentum=False)
    cosine = cfg.lr_schedule == "cosine"

    def factor(step):
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if not cosine:
            return 1.0
        span = max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(step - warmup, span) / span))
    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


class OptimizerStep:
    """One optimizer step of a global batch on the wrapper: returns (loss, skipped)."""

    def __init__(self, dp, opt, sched, loss_fn, cfg):
        self.dp, self.opt, self.sched, self.loss_fn = dp, opt, sched, loss_fn
        self.accumulate = cfg.accumulate

    def __call__(self, x, y):
        skipped = self.dp.skipped_steps
        loss = self.dp.step(x, y, self.loss_fn, optimizer=self.opt, accumulate=self.accumulate)
        stepped = self.dp.skipped_steps == skipped
        if stepped:
            self.sched.step()
        return loss, not stepped
