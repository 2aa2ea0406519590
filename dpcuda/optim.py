"""dpcuda's optimizers: SGD, Adam and AdamW, drop-in for torch.optim's.

Each is a torch.optim.Optimizer with torch's constructor signature, param_groups and
state_dict format (a state_dict loads into the torch optimizer of the same name and back), so
every torch.optim.lr_scheduler drives it, and GradScaler, clip_grad_norm_ and checkpoints work
as with torch's. The update of a parameter group is one fused multi-tensor operation per device
and dtype (dpcuda::optim_update_: one kernel for up to 24 tensors on CUDA), computed in the
order torch.optim's single-tensor code writes it, each product, quotient and sum rounded on its
own, so the CPU and a GPU give the same bits. The hyperparameters travel to the device in a
small float64 tensor the kernel reads (a schedule changes them without a new kernel).

    opt = dpcuda.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=1000)
    loss_fn(model(x), y).backward(); opt.step(); sched.step(); opt.zero_grad()

max_grad_norm (keyword, every optimizer; None by default): each step first clips the gradients
of all its parameters by their global norm, as torch.nn.utils.clip_grad_norm_(params,
max_grad_norm) before step() would; opt.grad_norm is then the norm before clipping (the value
clip_grad_norm_ returns; None until a step). On a plain model that is torch's clip_grad_norm_
itself. In DataParallel.step(..., optimizer=opt), where the update is fused into the reduction,
the norm comes from the reduction (each owner's sum of squares of its shard as it reduces it,
one small exchange, the coefficient applied inside the update: no pass of its own over the
gradients); it agrees with torch's to rounding (its summation order is the shards'). A
DataParallel step skipped for NaN or Inf gradients sets opt.grad_norm to NaN.

Against torch.optim on the same device: float64 and float32 agree within rounding (torch's
CPU kernels contract some products into fused multiply-adds); bfloat16 within two bfloat16
roundings of torch's single-tensor path (which rounds its intermediates to bfloat16; dpcuda
computes in float, as torch's fused=True path, whose bits it gives for Adam); see
tests/test_optim.py for the tolerances.
"""

import functools
import math
import numbers

import torch
from torch.optim import Optimizer
from torch.optim import optimizer as _torch_optimizer

from . import _C

__all__ = ["SGD", "Adam", "AdamW"]

# The hyperparameter array's slots and flag bits (csrc/kernels/optim/update.h).
_HYPER = 16
(_LR, _WEIGHT_DECAY, _MOMENTUM, _ONE_MINUS_DAMPENING, _ONE_MINUS_BETA1, _BETA2,
 _ONE_MINUS_BETA2, _EPS, _BETA1, _STEP, _DECAY, _FLAGS) = range(12)
_MAXIMIZE, _NESTEROV, _AMSGRAD, _FIRST, _DECOUPLED, _USE_MOMENTUM = 1, 2, 4, 8, 16, 32


def _value(x):
    """A hyperparameter as a Python float (a one-element tensor is read once)."""
    return float(x.item()) if torch.is_tensor(x) else float(x)


def _step_entry(func):
    """The optimizers' step as torch wraps it (torch.optim.Optimizer.profile_hook_step: the
    step hooks, global and the optimizer's own, and the "Optimizer.step#..." label of a
    record_function), without that wrapper where it would do nothing: no step hook registered
    and no RecordFunction callback (a profiler, an execution-trace observer) to see the label.
    On a GPU a small step's time is the host's, and the wrapper costs as much as the rest of a
    replayed step's optimizer call. (Marked hooked, as torch marks its own: torch does not
    wrap it again. A subclass's own step is wrapped by torch; reached from it through
    super().step(), this one adds nothing, so that hooks run once.)"""
    with_hooks = Optimizer.profile_hook_step(func)

    @functools.wraps(func)
    def step(self, *args, **kwargs):
        if type(self).step is not step:  # (from a subclass's own step, which torch wraps)
            return func(self, *args, **kwargs)
        if torch.compiler.is_compiling() or \
                self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks or \
                _torch_optimizer._global_optimizer_pre_hooks or \
                _torch_optimizer._global_optimizer_post_hooks or \
                _C._record_function_observed():
            return with_hooks(self, *args, **kwargs)
        return func(self, *args, **kwargs)
    step.hooked = True
    return step


def _step_eagerly(opt, loss):
    """The update of a step inside torch.compile, run eagerly (_FusedOptimizer.step)."""
    with torch.no_grad():
        return opt._step_without_grad(loss)


def _step_untraced(opt, loss):
    """_step_eagerly as dynamo leaves it untraced. Wrapped here, inside a compile, where
    torch._dynamo is loaded already: decorated at import, `import dpcuda` would load dynamo
    (some 0.65 s) for every user."""
    return torch.compiler.disable(
        _step_eagerly, reason="dpcuda.optim's fused update runs eagerly, one graph break "
                              "(fullgraph=True cannot include an optimizer step)")(opt, loss)


class _FusedOptimizer(Optimizer):
    """The step shared by dpcuda's optimizers: each parameter group's parameters that have a
    gradient, bucketed by device, dtype and what the hyperparameters of their update are
    (Adam's step count; whether SGD's momentum buffer starts), one fused update per bucket."""

    _op = None  # the kernel family: "sgd" or "adam"

    def __init__(self, params, defaults, max_grad_norm=None):
        if defaults.get("differentiable"):
            raise ValueError(f"dpcuda.optim.{type(self).__name__} does not support "
                             f"differentiable=True (use torch.optim's)")
        if defaults.get("capturable"):
            raise ValueError(f"dpcuda.optim.{type(self).__name__} does not support "
                             f"capturable=True yet (its step count is read on the host)")
        if max_grad_norm is not None:
            if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, numbers.Real):
                raise TypeError(f"max_grad_norm must be None or a finite number >= 0, got "
                                f"{max_grad_norm!r}")
            if not 0 <= max_grad_norm < math.inf:
                raise ValueError(f"max_grad_norm must be None or a finite number >= 0, got "
                                 f"{max_grad_norm!r}")
        super().__init__(params, defaults)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.grad_norm = None
        self._hyper = {}

    def _sharded_error(self, what):
        return RuntimeError(
            f"dpcuda.optim.{type(self).__name__}: {what} needs the whole optimizer state, which "
            f"DataParallel.step(..., optimizer=...) holds sharded over the processes (reducer "
            f"'dist', ZeRO-1); call opt.consolidate_state_dict(to=rank) on every process first "
            f"(to=None gathers it on every process)")

    def _is_sharded(self):
        shards = self.__dict__.get("_shards")
        return shards is not None and shards.sharded

    def consolidate_state_dict(self, to=0):
        """As torch's ZeroRedundancyOptimizer: gathers the optimizer state that
        DataParallel.step(..., optimizer=self) keeps sharded over the processes (reducer
        "dist") onto rank `to` (None: every rank), whose state_dict() is then torch's format
        until its next step. A collective: call it on every process of the group. Without
        sharded state it does nothing."""
        shards = self.__dict__.get("_shards")
        if to is not None and (isinstance(to, bool) or not isinstance(to, int)):
            raise TypeError(f"to must be a rank (int) or None, got {to!r}")
        if to is not None:
            world = shards.world if shards is not None else None
            if world is None and torch.distributed.is_available() and \
                    torch.distributed.is_initialized():
                world = torch.distributed.get_world_size()
            if world is not None and not 0 <= to < world:
                raise ValueError(f"to must be a rank in [0, {world}), got {to}")
        if shards is None or not shards.bound:
            return
        shards.unshard(keep=to is None or to == shards.rank)
        if to is None:
            # Every process holds the whole state now: the optimizer's own again (its step()
            # works; the next DataParallel step shards it anew).
            shards.bound = False

    def state_dict(self):
        """torch.optim's state_dict(). Where DataParallel.step keeps the state sharded over
        the processes, call consolidate_state_dict(to=rank) on every process first."""
        if self._is_sharded():
            raise self._sharded_error("state_dict()")
        self._settle_plan()
        return super().state_dict()

    def _settle_plan(self):
        """DataParallel's fused update keeps some state on the device (whether SGD's momentum
        has begun; fused_update.py): made the optimizer's before it steps on its own or saves."""
        settle = self.__dict__.get("_plan_settle")
        if settle is not None:
            settle(self)

    def load_state_dict(self, state_dict):
        """torch.optim's load_state_dict(). Under DataParallel.step's sharded state, load the
        same whole state_dict on every process; the next step takes each process's shard."""
        super().load_state_dict(state_dict)
        shards = self.__dict__.get("_shards")
        if shards is not None:
            # (opt.state is whole again on every process: the next step re-shards it)
            shards.sharded = shards.bound = False

    def __getstate__(self):
        if self._is_sharded():
            raise self._sharded_error("pickling or copying the optimizer")
        self._settle_plan()
        # (torch's keeps defaults, state and param_groups only; max_grad_norm is a setting too)
        state = super().__getstate__()
        state["max_grad_norm"] = self.max_grad_norm
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("max_grad_norm", None)
        self.__dict__.setdefault("grad_norm", None)
        self._hyper = {}

    def _hyper_tensor(self, index, device, values):
        """The group's hyperparameters on `device`: a float64 tensor the kernel reads (on a GPU
        copied in stream order, without waiting for the device)."""
        if torch.device(device).type == "cpu":
            # One tensor per group, written in place: the CPU op runs synchronously, so the
            # last update has read the values.
            h = self._hyper.get(index)
            if h is None:
                h = self._hyper[index] = torch.empty(_HYPER, dtype=torch.float64)
            h.numpy()[:] = values
            return h
        # On a GPU a tensor of its own each time (from the caching allocator, on the current
        # stream): a kernel of the last update, queued on another stream, may still read the
        # previous one.
        return torch.tensor(values, dtype=torch.float64).to(device, non_blocking=True)

    @_step_entry
    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns closure's loss (the
        closure, when given, runs with grad enabled first, as in torch.optim)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if torch.compiler.is_compiling():
            # Not traced: dynamo's handling of a torch.optim.Optimizer's state gave the fused
            # update another parameter's state (AdamW: state1[1] of params[0]'s shape). The
            # update runs eagerly, one graph break, as it would in any case (one fused op).
            return _step_untraced(self, loss)
        # The update without autograd, as under torch.no_grad(): its own switch, without the
        # decorator's context object (on a GPU a small step's time is the host's).
        previous = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return self._step_without_grad(loss)
        finally:
            torch._C._set_grad_enabled(previous)

    def _step_without_grad(self, loss):
        fused = self.__dict__.pop("_fused_step", None)
        if fused is not None:
            # DataParallel.step's update, fused into its reduction (dpcuda.parallel)
            fused()
            return loss
        if self._is_sharded():
            raise self._sharded_error("step() outside DataParallel.step")
        self._settle_plan()
        if self.max_grad_norm is not None:
            with_grad = [p for group in self.param_groups for p in group["params"]
                         if p.grad is not None]
            for p in with_grad:
                self._check_dense(p)
            self.grad_norm = torch.nn.utils.clip_grad_norm_(with_grad, self.max_grad_norm)
        for index, group in enumerate(self.param_groups):
            buckets = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._check_dense(p)
                key, tensors, commit = self._prepare(p, group)
                buckets.setdefault((p.device, p.dtype) + key, []).append((tensors, commit))
            for key, entries in buckets.items():
                self._update(index, group, key[0], key[2:], entries)
        return loss

    def _check_dense(self, p):
        if p.grad.is_sparse:
            raise RuntimeError(f"dpcuda.optim.{type(self).__name__} does not support sparse "
                               f"gradients")

    def _update(self, index, group, device, key, entries):
        hyper = self._hyper_tensor(index, device, self._values(group, *key))
        lists = [[], [], [], [], []]
        write_back = []
        for entry, _ in entries:
            for i, t in enumerate(entry):
                if t is None:
                    continue
                if t.is_complex():
                    # As torch.optim: a complex parameter updates as its real view.
                    t = torch.view_as_real(t)
                if not t.is_contiguous():
                    c = t.contiguous()
                    if i != 1:  # (the gradient is only read)
                        write_back.append((t, c))
                    t = c
                lists[i].append(t)
        torch.ops.dpcuda.optim_update_(*lists, hyper, self._op)
        for t, c in write_back:
            t.copy_(c)
        # In place, as torch.optim's updates: autograd sees the parameters changed (a graph
        # that saved them raises at backward, as with torch.optim).
        torch.autograd.graph.increment_version([entry[0] for entry, _ in entries])
        # The state changes that say an update happened (a momentum buffer begun, a step
        # counted) only once it has: an update that raised leaves the state as it was.
        self._commit([commit for _, commit in entries])

    def _commit(self, commits):
        for commit in commits:
            if commit is not None:
                commit()

    def _state_like(self, p):
        return torch.zeros_like(p, memory_format=torch.contiguous_format)


class SGD(_FusedOptimizer):
    """torch.optim.SGD's update (momentum, dampening, Nesterov, weight decay, maximize), fused:
    one kernel per device and dtype for a parameter group. Same arguments, param_groups and
    state_dict (state "momentum_buffer" when momentum is not 0) as torch.optim.SGD."""

    _op = "sgd"

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0,
                 nesterov=False, *, maximize=False, foreach=None, differentiable=False,
                 fused=None, max_grad_norm=None):
        if torch.is_tensor(lr) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = {"lr": lr, "momentum": momentum, "dampening": dampening,
                    "weight_decay": weight_decay, "nesterov": nesterov, "maximize": maximize,
                    "foreach": foreach, "differentiable": differentiable, "fused": fused}
        super().__init__(params, defaults, max_grad_norm)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("differentiable", False)
            group.setdefault("fused", False)

    def _prepare(self, p, group):
        if group["momentum"] == 0:
            return (False,), (p, p.grad, None, None, None), None
        state = self.state[p]
        buf = state.get("momentum_buffer")
        if buf is not None:
            return (False,), (p, p.grad, buf, None, None), None
        # torch starts the buffer as a copy of the (decayed) gradient: the kernel writes it.
        buf = self._state_like(p)
        return (True,), (p, p.grad, buf, None, None), \
            lambda: state.__setitem__("momentum_buffer", buf)

    def _values(self, group, first):
        h = [0.0] * _HYPER
        momentum = _value(group["momentum"])
        h[_LR] = _value(group["lr"])
        h[_WEIGHT_DECAY] = _value(group["weight_decay"])
        h[_MOMENTUM] = momentum
        h[_ONE_MINUS_DAMPENING] = 1.0 - _value(group["dampening"])
        flags = _MAXIMIZE if group["maximize"] else 0
        if momentum != 0:
            flags |= _USE_MOMENTUM | (_NESTEROV if group["nesterov"] else 0)
            flags |= _FIRST if first else 0
        h[_FLAGS] = float(flags)
        return h


class Adam(_FusedOptimizer):
    """torch.optim.Adam's update (weight decay as L2 or decoupled, amsgrad, maximize), fused:
    one kernel per device and dtype for a parameter group. Same arguments, param_groups and
    state_dict (state "step", "exp_avg", "exp_avg_sq" and, with amsgrad, "max_exp_avg_sq") as
    torch.optim.Adam. The step count is a float32 tensor, on the host (torch's default) or, under
    a non-blocking DataParallel step on a GPU, on the parameters' device (as torch's capturable
    Adam keeps it); the kernel derives the bias corrections from it (update.h's pow_step: beta^step
    in double-double, within one unit in the last place of torch's pow)."""

    _op = "adam"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False,
                 max_grad_norm=None):
        if torch.is_tensor(lr) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        betas = tuple(_value(b) for b in betas)
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "amsgrad": amsgrad, "maximize": maximize, "foreach": foreach,
                    "capturable": capturable, "differentiable": differentiable, "fused": fused,
                    "decoupled_weight_decay": decoupled_weight_decay}
        super().__init__(params, defaults, max_grad_norm)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("capturable", False)
            group.setdefault("differentiable", False)
            group.setdefault("decoupled_weight_decay", False)
            group.setdefault("fused", None)

    def load_state_dict(self, state_dict):
        """torch.optim's load, then every step count brought to the host as a float32 tensor
        (a state_dict of torch's fused or capturable Adam holds it on the device). Under
        DataParallel.step's sharded state, load the same whole state_dict on every process."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            step = state.get("step")
            if step is not None:
                state["step"] = torch.tensor(_value(step), dtype=torch.float32)

    def _prepare(self, p, group):
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = self._state_like(p)
            state["exp_avg_sq"] = self._state_like(p)
        vmax = None
        if group["amsgrad"]:
            # (also where amsgrad was switched on after the state began: the maximum starts
            # at zero)
            vmax = state.setdefault("max_exp_avg_sq", self._state_like(p))
        step = state["step"]
        return (_value(step) + 1,), (p, p.grad, state["exp_avg"], state["exp_avg_sq"], vmax), \
            step

    def _commit(self, steps):
        # Every step count of the update, in one op.
        torch._foreach_add_(steps, 1)

    def _values(self, group, step):
        h = [0.0] * _HYPER
        beta1, beta2 = (_value(b) for b in group["betas"])
        lr = _value(group["lr"])
        weight_decay = _value(group["weight_decay"])
        # torch.optim's scalars, in float64 as its Python computes them; the kernel derives the
        # bias corrections from beta1, beta2 and the step (update.h's pow_step).
        h[_LR] = lr
        h[_WEIGHT_DECAY] = weight_decay
        h[_ONE_MINUS_BETA1] = 1 - beta1
        h[_BETA2] = beta2
        h[_ONE_MINUS_BETA2] = 1 - beta2
        h[_EPS] = _value(group["eps"])
        h[_BETA1] = beta1
        h[_STEP] = step
        h[_DECAY] = 1 - lr * weight_decay
        flags = _MAXIMIZE if group["maximize"] else 0
        flags |= _AMSGRAD if group["amsgrad"] else 0
        flags |= _DECOUPLED if group["decoupled_weight_decay"] else 0
        h[_FLAGS] = float(flags)
        return h


class AdamW(Adam):
    """torch.optim.AdamW: Adam with decoupled weight decay (default 1e-2), fused. Same
    arguments, param_groups and state_dict as torch.optim.AdamW."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, max_grad_norm=None):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                         maximize=maximize, capturable=capturable,
                         differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, max_grad_norm=max_grad_norm)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True
