"""A graphed step's checks, skipped while nothing they read has changed (graphed.py).

Before a replay, DataParallel(graphs=True) checks that the step is still the one its graph
captured: the model's structure, hooks and attributes (its walk), the batch's shapes, the loss
and its settings, the optimizer (its type, hooks, parameter groups and state, and the fused
update's plan over them), the wrapper's settings and torch's global hooks. In Python those
checks were most of a replayed step's host time (about 45 of 57 us on the CPU proxy of
benchmarks/bench_host.py), and on a GPU a small step's time is the host's.

A ReplayGuard is made by a step whose checks passed and whose graph was found (not captured: a
capture changes what it reads), just before its replay, from the objects those checks read:
each attribute, dict entry and list item as the object it was (csrc/torch/unchanged.cpp checks
them in one C call). At the next step, if every one of them is still the same object, and the
step's own arguments (the batch's type, shape, dtype and device, the loss, the optimizer,
accumulate, grad mode, autocast) are those of the guard's step, the checks would find what they
found then, and the step replays the same graph without them. The model is read as its walk
(ReplicaSet.walk) reads it, so that the walk is skipped too: every module's type and __dict__
(each attribute the same object), its hook dicts empty, the entries of its _parameters,
_buffers and _modules, and every parameter, buffer and tensor attribute's sizes, strides,
dtype, device, storage, requires_grad and gradient hooks, read from its C object. Anything else
(a hook registered anywhere the checks look, a state entry replaced or added, a parameter group
added or its members changed, a loss attribute set, a split weight edited, any attribute of a
module set, a parameter given new storage or strides) fails the guard, and the step runs the
checks, which decide as before and make a new guard. The parameter groups' values (a
scheduler's lr, momentum or betas, at every step) are not the guard's: the replay writes them
into the plan's device array as it did (write_hyper, with its memo, inside opt.step(), so after
what a subclass's step or a wrapper of it changes), and holds() checks the one thing the checks
read from them, the plan's kind of state (SGD's momentum 0 or not, Adam's amsgrad). A guard is
never made for a loss with submodules or hooks, an optimizer with step pre-hooks, or under
autocast: those steps run the checks every time.

What a step itself changes (SGD's first momentum buffers, a state bound to the plan) is seen
at the next step, which runs the checks once more before the guard holds again. Adam's step
counts on the CPU are read at every step (FusedUpdate.ready's uniformity check reads their
values; on a GPU the plan's own updates keep them alike). A guard holds references to what it
read until the next step replaces it.
"""

import collections

import torch
from torch.nn.modules import module as _module

from .. import _C
from . import step as _step
from .fused_update import FusedUpdate, _global_optimizer_pre_hooks
from .unchanged import (ABSENT, ATTR_IS, EMPTY, ITEM_IS, ITEMS, KEYS, MODULE_ABSENT, SAME,
                        TENSOR_IS, TYPE_IS, items_of)


_DICTS = (dict, collections.defaultdict)
_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                 "_backward_pre_hooks")  # (nn._has_hooks's)
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks",
                 "_global_backward_hooks", "_global_backward_pre_hooks")
# (GraphedSteps._key's settings, and summed_loss's weight)
_LOSS_SETTINGS = ("reduction", "label_smoothing", "ignore_index", "weight")
_MISSING = object()
# (MODULE_ABSENT's: the lookup of a module whose type uses nn.Module's)
_MODULE_LOOKUP = (torch.nn.Module.__getattr__, object.__getattribute__)
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)  # (TENSOR_IS's: torch's own getters)


def _plain_type(cls):
    """A tensor type whose attributes are its C object's: torch.Tensor, nn.Parameter, or a
    subclass of nn.Parameter that keeps its __torch_function__ off (as nn.Parameter does)."""
    return cls in _TENSOR_TYPES or (
        issubclass(cls, torch.nn.Parameter) and
        cls.__torch_function__ is torch._C._disabled_torch_function_impl)


class _Checks:
    """The list of (op, object, name, expected) checks, made as the objects are read."""

    def __init__(self):
        self.list = []

    def attr(self, obj, name):
        """obj.name as it is now (its absence included); returns it (None if absent)."""
        value = getattr(obj, name, _MISSING)
        if value is _MISSING:
            cls = type(obj)
            if isinstance(obj, torch.nn.Module) and \
                    (cls.__getattr__, cls.__getattribute__) == _MODULE_LOOKUP:
                # (without nn.Module.__getattr__, whose AttributeError costs a microsecond)
                self.list.append((MODULE_ABSENT, obj, name, _MODULE_LOOKUP))
            else:
                self.list.append((ABSENT, obj, name, None))
            return None
        self.list.append((ATTR_IS, obj, name, value))
        return value

    def empty(self, obj, name):
        """obj.name is the same, empty container; False if it is not empty now."""
        value = self.attr(obj, name)
        if value is None or len(value) != 0:
            return False
        self.list.append((EMPTY, value, None, None))
        return True

    def items(self, d):
        """d's items as they are now; False if d is not a plain dict."""
        if type(d) not in _DICTS:
            return False
        self.list.append(items_of(d))
        return True

    def keys(self, d):
        """d's keys as they are now (their values free); False if d is not a plain dict."""
        if type(d) not in _DICTS:
            return False
        self.list.append((KEYS, d, None, tuple(d)))
        return True

    def item(self, d, key):
        """d[key] as it is now (present)."""
        value = d[key]
        self.list.append((ITEM_IS, d, key, value))
        return value

    def same(self, seq):
        if type(seq) not in (list, tuple):
            return False
        self.list.append((SAME, seq, None, tuple(seq)))
        return True

    def tensor(self, t, grad=False):
        """t's sizes, strides, dtype, device and storage as they are now (grad: its
        requires_grad and gradient hooks too), read from its C object; False where t is not
        a plain strided tensor with storage of torch's own types."""
        if not _plain_type(type(t)) or t.layout != torch.strided or t.is_nested:
            return False
        try:
            expected = (type(t), tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr())
        except RuntimeError:  # (no storage, or sizes it does not have)
            return False
        hooked = bool(t._backward_hooks or t._post_accumulate_grad_hooks) if grad else None
        self.list.append((TENSOR_IS, t, None,
                          expected + (t.requires_grad if grad else None, hooked)))
        return True

    def model(self, model):
        """What the step's walk of the model (ReplicaSet.walk) reads, as it is now: every
        module's type, __dict__ (its attributes, hook dicts, _parameters, _buffers and
        _modules, each the same object), its hook dicts empty, the entries of its _parameters,
        _buffers and _modules, and every parameter, buffer and tensor attribute (tensor()).
        False where the walk reads what this does not (a module whose dicts are not plain, a
        tensor tensor() does not read, a hook: the walk's checks then run at every step)."""
        stack, seen = [model], set()
        while stack:
            m = stack.pop()
            if id(m) in seen:
                continue
            seen.add(id(m))
            self.list.append((TYPE_IS, m, None, type(m)))
            d = self.attr(m, "__dict__")
            if type(d) is not dict or not self.items(d):
                return False
            for name in _MODULE_HOOKS:
                hooks = d.get(name)
                if hooks is None or len(hooks) != 0:
                    return False
                self.list.append((EMPTY, hooks, None, None))
            entries = [d.get(name) for name in ("_parameters", "_buffers", "_modules")]
            if not all(map(self.items, entries)):
                return False
            parameters, buffers, modules = entries
            for tensors, grad in ((parameters, True), (buffers, False)):
                for t in tensors.values():
                    if t is not None and id(t) not in seen:
                        seen.add(id(t))
                        if (grad and not isinstance(t, torch.nn.Parameter)) or \
                                not self.tensor(t, grad):
                            return False
            for k, v in d.items():  # (the walk's public attributes: a tensor by its storage)
                if k[:1] != "_" and isinstance(v, torch.Tensor) and not self.tensor(v):
                    return False
            stack.extend(reversed([c for c in modules.values() if c is not None]))
        return True


class ReplayGuard:
    """The module docstring: made by make_guard, checked by holds()."""

    def __init__(self, checks, graph, summed, plan, args):
        self.checks = tuple(checks)
        self.graph, self.summed = graph, summed
        (self.inputs_of, self.targets_of, self.loss_fn, self.optimizer, self.accumulate,
         self.grad, self.kind) = args
        # a plan of Adam on the CPU, whose step counts' uniformity ready() reads at every step
        # (SGD's: whether each parameter has a momentum buffer, the state's items, checked)
        self.cpu_plan = plan if plan is not None and plan.device.type == "cpu" and \
            self.optimizer._op == "adam" else None
        self.plan_structure = None if plan is None else {plan.keys}

    def holds(self, inputs, targets, loss_fn, optimizer, accumulate):
        """Whether this step's checks would find what the guard's step found (its model's
        walk among them: the guard's checks read what the walk reads)."""
        if loss_fn is not self.loss_fn or optimizer is not self.optimizer or \
                accumulate != self.accumulate:
            return False
        if torch.is_grad_enabled() is not self.grad or torch.is_autocast_enabled(self.kind):
            return False
        if not _C._unchanged(((TENSOR_IS, inputs, None, self.inputs_of),
                              (TENSOR_IS, targets, None, self.targets_of))) or \
                not _C._unchanged(self.checks):
            return False
        if optimizer is not None and {FusedUpdate._structure(optimizer, group) for group in
                                      optimizer.param_groups} != self.plan_structure:
            return False  # (SGD's momentum 0 or not, Adam's amsgrad: another plan)
        plan = self.cpu_plan
        if plan is not None:
            # (as FusedUpdate.ready on the CPU: the step counts' values)
            plan.is_uniform = plan.uniform(optimizer)
            return plan.is_uniform
        return True


def _batch_of(t):
    """TENSOR_IS's expectation of a batch: what the checks read of it (its type, shape, dtype
    and device); None where it is not a tensor of torch's own types."""
    if type(t) not in _TENSOR_TYPES:
        return None
    return type(t), tuple(t.shape), None, t.dtype, t.device, None, None, None


def make_guard(dp, graph, inputs, targets, loss_fn, optimizer, accumulate, walk, summed):
    """The guard of a step whose checks have just passed and found graph (the module
    docstring), or None where its checks read more than identities."""
    kind = dp._replicas[0].device.type
    if torch.is_autocast_enabled(kind):
        return None
    c = _Checks()
    # DataParallel's settings and its replicas (_check_optimizer, _why_not, _key)
    for name in ("blocking", "algorithm", "split", "_fused_update"):
        c.attr(dp, name)
    for name in ("split_weights", "_speed"):  # (lists the key holds by value)
        value = c.attr(dp, name)
        if value is not None and not c.same(value):
            return None
    rs = c.attr(dp, "_set")
    for name in ("generation", "_structure", "_pointers"):
        c.attr(rs, name)
    replicas = c.attr(rs, "replicas")
    c.same(replicas)
    for r in replicas:
        c.attr(r, "device")
    c.attr(replicas[0], "flat_grad")
    if not all(c.empty(_module, name) for name in _GLOBAL_HOOKS):
        return None
    # the loss (summed_loss, _why_not's hooks, _key's settings)
    if isinstance(loss_fn, torch.nn.Module):
        c.list.append((TYPE_IS, loss_fn, None, type(loss_fn)))
        # (its instance attributes' names: a forward set on it is another loss, summed_loss's
        # _plain)
        if not c.keys(c.attr(loss_fn, "__dict__")):
            return None
        if not all(c.empty(loss_fn, name) for name in
                   _MODULE_HOOKS + ("_modules", "_parameters")):
            return None  # (hooks, or a loss whose modules the checks walk)
    for name in _LOSS_SETTINGS:
        c.attr(loss_fn, name)
    # (summed_loss looks these up at every step)
    c.attr(_step, "SoftmaxCrossEntropyLoss")
    c.attr(torch.nn, "CrossEntropyLoss")
    c.attr(torch.nn, "functional")
    c.attr(torch.nn.functional, "cross_entropy")
    plan = None
    if optimizer is None:
        for name in ("_lr", "_momentum", "_weight_decay"):  # (the wrapper's SGD)
            c.attr(dp, name)
    else:
        # _check_optimizer and FusedUpdate.ready: the optimizer's type, hooks, groups and state
        c.list.append((TYPE_IS, optimizer, None, type(optimizer)))
        c.attr(optimizer, "max_grad_norm")
        if not c.empty(optimizer, "_optimizer_step_pre_hooks") or _global_optimizer_pre_hooks:
            return None
        c.list.append((EMPTY, _global_optimizer_pre_hooks, None, None))
        # The groups' members and entries; their values (a scheduler's lr, momentum or betas)
        # are free: write_hyper reads them at every replay, and the plan's kind of state
        # (ready's _structure) is checked by holds().
        groups = c.attr(optimizer, "param_groups")
        if not c.same(groups) or not all(map(c.keys, groups)) or \
                not all(c.same(c.item(group, "params")) for group in groups):
            return None
        state = c.attr(optimizer, "state")
        if not c.items(state) or not all(map(c.items, state.values())):
            return None
        fused = dp._fused_update
        plan = c.attr(fused, "_plan")
        c.attr(fused, "_plan_key")
        if plan is not graph.plan or plan is None or not plan.bound:
            return None
        for name in ("bound", "is_uniform"):
            c.attr(plan, name)
    params, _, structure, (hooked, _, _) = walk
    if hooked or structure != rs._structure or [p.data_ptr() for p in params] != rs._pointers:
        return None
    # the model as its walk read it (the next step's walk is then skipped: StepMixin.step)
    if not c.model(c.attr(rs, "model")):
        return None
    batch = _batch_of(inputs), _batch_of(targets)
    if None in batch or not _C._unchanged(tuple(c.list)):
        return None  # (a check that does not hold now would fail at every step)
    args = batch + (loss_fn, optimizer, accumulate, torch.is_grad_enabled(), kind)
    return ReplayGuard(c.list, graph, summed, plan, args)
