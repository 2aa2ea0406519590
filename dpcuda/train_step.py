"""The training step of `dpcuda train` when it runs a dpcuda.optim optimizer (--optimizer adam
or adamw, or SGD with an --lr-schedule, --warmup-steps, --clip-grad-norm or --accumulate):
the optimizer, its learning-rate schedule, and one optimizer step of a global batch.

Without clipping or accumulation the step is DataParallel.step(x, y, loss_fn, optimizer=opt);
with either, it is the conventional PyTorch loop on the wrapper: the micro-batches' backward
passes (the reduction deferred by no_sync() until the last), clip_grad_norm_, opt.step().
A step whose gradients hold NaN or Inf is skipped (no optimizer step, no schedule step), as
the wrapper's own step skips it.
"""

import contextlib
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
                         weight_decay=cfg.weight_decay)
    cls = optim.Adam if cfg.optimizer == "adam" else optim.AdamW
    return cls(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


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

    def __init__(self, dp, opt, sched, loss_fn, cfg, world=1):
        self.dp, self.opt, self.sched, self.loss_fn = dp, opt, sched, loss_fn
        self.clip, self.accumulate, self.world = cfg.clip_grad_norm, cfg.accumulate, world

    def __call__(self, x, y, global_rows):
        if self.clip is None:
            # (accumulation inside the step: the micro-batches reduced once, at the update)
            skipped = self.dp.skipped_steps
            loss = self.dp.step(x, y, self.loss_fn, optimizer=self.opt,
                                accumulate=self.accumulate)
            stepped = self.dp.skipped_steps == skipped
        else:
            loss, stepped = self._conventional(x, y, global_rows)
        if stepped:
            self.sched.step()
        return loss, not stepped

    def _conventional(self, x, y, global_rows):
        dp, opt = self.dp, self.opt
        opt.zero_grad(set_to_none=True)
        rows = x.shape[0]
        # The micro-batches' mean losses weighted by their share of the global batch: their
        # gradients add up to the gradient of the global batch's mean (as across processes,
        # whose gradients the reducer averages, each weighted by its share times the world).
        chunks = [c for c in torch.arange(rows).tensor_split(min(self.accumulate, rows))
                  if c.numel()]
        total = torch.zeros((), dtype=torch.float64)
        for j, idx in enumerate(chunks):
            last = j == len(chunks) - 1
            with contextlib.nullcontext() if last else dp.no_sync():
                loss = self.loss_fn(dp(x[idx]), y[idx]) * (idx.numel() * self.world
                                                           / global_rows)
                loss.backward()
            total += loss.detach().double().cpu()
        if self.world > 1:
            total = total.to(dp._comm_device())
            dp._dist.all_reduce(total, group=dp._group)
            total /= self.world
        grads = [p.grad for p in dp.parameters() if p.grad is not None]
        if self.clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(dp.parameters(), self.clip)
            finite = bool(torch.isfinite(norm))
        else:
            finite = all(bool(torch.isfinite(g).all()) for g in grads)
        if finite:
            opt.step()
        else:
            dp.skipped_steps += 1
        dp.steps += 1
        return float(total), finite
