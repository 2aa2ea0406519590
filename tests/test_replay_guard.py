"""The replayed step's guard (dpcuda/parallel/replay_guard.py, csrc/torch/unchanged.cpp): a
graphed step whose checks would find what the last replay's found skips them.

The oracle is the same training with the guard off, where every step runs its checks: two
DataParallel(graphs=True) in lockstep, changed alike between steps in every way the checks
look at (the optimizer's hyperparameters, state, groups and hooks; the model's hooks,
attributes, parameters' storage and requires_grad; the loss's settings and hooks; torch's
global hooks; the batch's shape and dtype; grad mode; the wrapper's SGD settings), give the
same losses, weights, optimizer state, warnings and errors bit for bit. A guard with one of its
reads left out is caught by that comparison (test_a_guard_missing_a_read_is_caught)."""

import collections
import copy
import types
import warnings

import pytest
import torch

import dpcuda
from dpcuda import _C
from dpcuda.nn import SoftmaxCrossEntropyLoss
from dpcuda.parallel import DataParallel
from dpcuda.parallel import fused_update
from dpcuda.parallel import graphed as graphed_module
from dpcuda.parallel import replay_guard
from dpcuda.parallel.unchanged import (ABSENT, ATTR_IS, EMPTY, ITEM_IS, ITEMS, KEYS,
                                       MODULE_ABSENT, SAME, TENSOR_IS, TYPE_IS)
from test_graphed import closure, make  # noqa: F401 (closure: a fixture)
from test_nonblocking import batches


# -- dpcuda._C._unchanged: each check holds on what it was made from and fires on a change ----

class _Obj:
    pass


class _Raises:
    @property
    def value(self):
        raise RuntimeError("a property that raises")


def test_each_check_holds_and_fires_on_a_change():
    o = _Obj()
    o.a = [1]
    d = {"x": o, "y": 2}
    seq = [o, d]
    checks = ((ATTR_IS, o, "a", o.a), (ABSENT, o, "b", None), (EMPTY, {}, None, None),
              (ITEMS, d, None, tuple(d.items())), (SAME, seq, None, tuple(seq)),
              (TYPE_IS, o, None, _Obj))
    assert _C._unchanged(checks)
    assert _C._unchanged(())

    o.a = [1]                          # an equal value, another object
    assert not _C._unchanged(checks[:1])
    o.b = None                         # an attribute that was absent
    assert not _C._unchanged(checks[1:2])
    assert not _C._unchanged(((EMPTY, {"k": 1}, None, None),))
    assert not _C._unchanged(((EMPTY, 3, None, None),))  # (no len: an error, cleared)

    for change in (lambda e: e.__setitem__("y", 3),         # a value replaced
                   lambda e: e.__setitem__("z", 1),         # an entry added
                   lambda e: e.pop("y"),                    # an entry removed
                   lambda e: (e.pop("x"), e.__setitem__("x", o))):  # reordered
        e = dict(d)
        check = ((ITEMS, e, None, tuple(e.items())),)
        assert _C._unchanged(check)
        change(e)
        assert not _C._unchanged(check), e
    assert not _C._unchanged(((ITEMS, [("x", o)], None, (("x", o),)),))  # not a dict

    for change in (lambda s: s.append(o), lambda s: s.pop(), lambda s: s.__setitem__(0, d)):
        s = list(seq)
        check = ((SAME, s, None, tuple(s)),)
        assert _C._unchanged(check)
        change(s)
        assert not _C._unchanged(check)
    assert not _C._unchanged(((SAME, {"x": 1}, None, ("x",)),))  # not a list or tuple

    for change in (lambda e: e.__setitem__("y", 3), lambda e: e.pop("y")):
        e = dict(d)
        check = ((ITEM_IS, e, "y", 2),)
        e["x"] = None  # (the other entries are free)
        assert _C._unchanged(check)
        change(e)
        assert not _C._unchanged(check), e
    assert not _C._unchanged(((ITEM_IS, [2], 0, 2),))

    for change in (lambda e: e.__setitem__("z", 1), lambda e: e.pop("y"),
                   lambda e: (e.pop("x"), e.__setitem__("x", o))):
        e = dict(d)
        check = ((KEYS, e, None, tuple(e)),)
        e["y"] = 5  # (the values are free)
        assert _C._unchanged(check)
        change(e)
        assert not _C._unchanged(check), e

    class Other(_Obj):
        pass
    o.__class__ = Other
    assert not _C._unchanged(checks[5:])

    r = _Raises()
    assert not _C._unchanged(((ATTR_IS, r, "value", None),))  # (the error is cleared)
    assert not _C._unchanged(((ABSENT, r, "value", None),))   # (not an AttributeError)


def _tensor_check(t, full=True):
    hooked = bool(t._backward_hooks or t._post_accumulate_grad_hooks)
    return ((TENSOR_IS, t, None, (type(t), tuple(t.shape), t.stride() if full else None,
                                  t.dtype, t.device, t.data_ptr() if full else None,
                                  t.requires_grad if full else None, hooked if full else None)),)


def test_tensor_is_holds_and_fires_on_a_change():
    for change in (lambda p: setattr(p, "data", p.data.as_strided((4, 4), (1, 4))),  # strides
                   lambda p: setattr(p, "data", p.data.clone()),                    # storage
                   lambda p: setattr(p, "data", p.data.view(16)),                   # shape
                   lambda p: setattr(p, "data", p.data.double()),                   # dtype
                   lambda p: setattr(p, "data", p.data[1:]),                        # offset
                   lambda p: p.requires_grad_(False),
                   lambda p: p.register_hook(lambda g: g),
                   lambda p: p.register_post_accumulate_grad_hook(lambda p: None)):
        p = torch.nn.Parameter(torch.randn(4, 4))
        check = _tensor_check(p)
        assert _C._unchanged(check)
        with torch.no_grad():
            p.add_(1.0)  # (values are free: the graph reads the storage)
        assert _C._unchanged(check)
        change(p)
        assert not _C._unchanged(check), change
    # a batch's check: type, shape, dtype and device; the rest free
    x = torch.randn(4, 4)
    check = _tensor_check(x, full=False)
    for same in (x, x.t(), x.clone(), torch.zeros(4, 4)):
        assert _C._unchanged(((TENSOR_IS, same) + check[0][2:],))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (nested tensors: a prototype)
        nested = torch.nested.nested_tensor([torch.ones(4), torch.ones(3)])
    for other in (x[:2], x.double(), torch.nn.Parameter(x), [x], x.numpy(), nested):
        # (a nested tensor's sizes cannot be read: a change, not an error)
        assert not _C._unchanged(((TENSOR_IS, other) + check[0][2:],)), other
    assert not _C._unchanged(((TENSOR_IS, x.to_sparse()) + _tensor_check(x)[0][2:],))


def test_module_absent_holds_and_fires_on_a_change():
    lookup = (torch.nn.Module.__getattr__, object.__getattribute__)

    class Loss(SoftmaxCrossEntropyLoss):
        pass
    for change in (lambda m: setattr(m, "weight", None),
                   lambda m: m.register_buffer("weight", torch.ones(3)),
                   lambda m: m.register_parameter("weight", torch.nn.Parameter(torch.ones(3))),
                   lambda m: m.add_module("weight", torch.nn.ReLU()),
                   lambda m: setattr(type(m), "weight", None),             # on its class
                   lambda m: setattr(type(m), "__getattr__", lambda self, name: 1)):
        m = Loss()
        check = ((MODULE_ABSENT, m, "weight", lookup),)
        assert _C._unchanged(check)
        m.other = 1
        assert _C._unchanged(check)
        change(m)
        assert not _C._unchanged(check), change
        assert getattr(m, "weight", "absent") != "absent"
        for name in ("weight", "__getattr__"):
            if name in Loss.__dict__:
                delattr(Loss, name)
    # ABSENT without the AttributeError made (a function's lookup) still sees the attribute
    def fn():
        pass
    check = ((ABSENT, fn, "reduction", None),)
    assert _C._unchanged(check)
    fn.reduction = "sum"
    assert not _C._unchanged(check)


def test_a_malformed_check_raises():
    for checks in ([], ((ATTR_IS, 1, "a"),), (("0", 1, "a", 1),), ((9, 1, "a", 1),),
                   ((ATTR_IS, 1, 2, 1),), ((ITEMS, {}, None, []),), ((SAME, [], None, []),),
                   ((KEYS, {}, None, []),), ((TENSOR_IS, torch.ones(1), None, ()),),
                   ((TENSOR_IS, torch.ones(1), None, (torch.Tensor, (1,), None, 1,
                                                      torch.device("cpu"), None, None, None)),),
                   ((MODULE_ABSENT, torch.nn.ReLU(), "w", None),)):
        with pytest.raises(TypeError, match="_unchanged"):
            _C._unchanged(checks)


# -- the lockstep oracle --------------------------------------------------------------------

def _setup(opt_name, guarded, opt_cls=None, devices=("cpu", "cpu"), graphs=True, **kw):
    model = make().to(devices[0])
    dp = DataParallel(model, list(devices), lr=0.05, momentum=0.9, graphs=graphs, **kw)
    if graphs:
        dp._graphed.guarded = guarded
    cfg = {"SGD": dict(lr=0.05, momentum=0.9), "AdamW": dict(lr=0.01),
           "Adam": dict(lr=0.01, amsgrad=True, max_grad_norm=1.0), None: None}[opt_name]
    opt_cls = opt_cls or (getattr(dpcuda.optim, opt_name) if opt_name else None)
    opt = opt_cls(model.parameters(), **cfg) if opt_name else None
    return types.SimpleNamespace(dp=dp, model=model, opt=opt, loss_fn=SoftmaxCrossEntropyLoss(),
                                 grad=True, handles=[], extra=None, accumulate=1, after=[])


def _bits(t):
    return t.detach().clone().view(-1)


def _snapshot(s):
    out = [_bits(p) for p in s.model.parameters()]
    if s.opt is not None:
        for group in s.opt.param_groups:
            for p in group["params"]:
                for k, v in sorted(s.opt.state.get(p, {}).items()):
                    out.append(_bits(v) if torch.is_tensor(v) else torch.tensor([float(v)]))
    return out


def _equal(a, b):
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(
        x.view(torch.int8) if x.dtype.is_floating_point else x,
        y.view(torch.int8) if y.dtype.is_floating_point else y) for x, y in zip(a, b))


def _calls(mp, cls, name):
    """Patches cls.name to count its calls: returns the list that grows by one at each."""
    calls, original = [], getattr(cls, name)

    def counting(*args, **kw):
        calls.append(True)
        return original(*args, **kw)
    mp.setattr(cls, name, counting)
    return calls


def _binds_outside_replays(mp, record):
    """Patches the fused plan's bind so that record(opt) is called for each bind outside a
    replay of the CPU stand-in's graph (whose body runs the step's Python again, binding there
    too; a CUDA graph's replay runs no Python)."""
    graph_replay, bind = graphed_module._ClosureGraph.replay, fused_update._Plan.bind
    replaying = [False]

    def in_graph(self):
        replaying[0] = True
        try:
            return graph_replay(self)
        finally:
            replaying[0] = False

    def binding(self, opt):
        if not replaying[0]:
            record(opt)
        return bind(self, opt)
    mp.setattr(graphed_module._ClosureGraph, "replay", in_graph)
    mp.setattr(fused_update._Plan, "bind", binding)


def _decisions(mp, current):
    """Patches GraphedSteps so that each run records what each step did: ("eager",) or
    ("replay", n) for the graph of its n-th capture, and ("bind",) for the fused plan bound to
    the optimizer's state outside a replay (the CPU stand-in's replay runs the step's Python
    again, which binds there too; a CUDA graph's does not). current[0]: the GraphedSteps of
    the step that runs. Returns {id(GraphedSteps): [...]}."""
    log = {}
    cls = graphed_module.GraphedSteps
    replay, eager, capture = cls._replay, cls._eager, cls._capture
    _binds_outside_replays(mp, lambda opt: log.setdefault(current[0], []).append(("bind",)))

    def replaying(self, dp, graph, *args, **kw):
        log.setdefault(id(self), []).append(("replay", graph.ordinal))
        return replay(self, dp, graph, *args, **kw)

    def eagerly(self, *args, **kw):
        log.setdefault(id(self), []).append(("eager",))
        return eager(self, *args, **kw)

    def capturing(self, *args, **kw):
        graph = capture(self, *args, **kw)
        if graph is not None:
            self.captures = getattr(self, "captures", 0) + 1
            graph.ordinal = self.captures
        return graph
    mp.setattr(cls, "_replay", replaying)
    mp.setattr(cls, "_eager", eagerly)
    mp.setattr(cls, "_capture", capturing)
    return log


def lockstep(opt_name, changes, steps=44, trace=None, **kw):
    """Trains a guarded and an unguarded DataParallel alike, with changes[i](s) applied to
    both before step i. Compares, step by step, what each step did (eager, or the replay of
    which capture: on the CPU stand-in a replay recomputes what a CUDA graph holds, so the
    choice of graph must be compared, not only the numbers), the hyperparameters the graph
    reads, the loss, the weights, the optimizer's state, the warnings and the errors. Returns
    (the differences found, the guarded run's replays without checks, the steps whose change
    found no guard made: each change should meet one, or it tests nothing)."""
    runs = [_setup(opt_name, guarded, **kw) for guarded in (False, True)]
    data = batches(steps, nan_steps=(7,))
    differences, unarmed = [], []
    with pytest.MonkeyPatch.context() as mp:
        unchecked = _calls(mp, graphed_module.GraphedSteps, "_replay_unchanged")
        current = [None]
        log = _decisions(mp, current)
        for i, (x, y) in enumerate(data):
            results = []
            if i in changes and runs[1].dp._graphed.guard is None:
                unarmed.append(i)
            for s in runs:  # (all changed before either steps: torch's global hooks are shared)
                if i in changes:
                    changes[i](s)
            for s in runs:
                xi, yi = (s.extra(x, y) if s.extra else (x, y))
                current[0] = id(s.dp._graphed)
                steps_log = log.setdefault(current[0], [])
                done = len(steps_log)
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter("always")
                    try:
                        with torch.set_grad_enabled(s.grad):
                            loss = s.dp.step(xi, yi, s.loss_fn, optimizer=s.opt,
                                             accumulate=s.accumulate)
                        for after in s.after:
                            after()
                        s.dp.synchronize()
                        outcome = ("loss", _bits(torch.as_tensor(loss, dtype=torch.float64)))
                    except Exception as err:  # (compared between the runs)
                        outcome = ("error", type(err).__name__, str(err))
                plan = s.dp._fused_update._plan
                hyper = [_bits(plan.hyper_base)] if plan is not None else []
                results.append((outcome, steps_log[done:], [str(m.message) for m in w],
                                _snapshot(s) + hyper))
            (a, da, wa, sa), (b, db, wb, sb) = results
            if trace is not None:
                trace.append((i, a[:1] + a[2:], da, db))
            same = a[0] == b[0] and (_equal([a[1]], [b[1]]) if a[0] == "loss" else a == b)
            if not same or da != db or wa != wb or not _equal(sa, sb):
                differences.append((i, a[:1] + a[2:], b[:1] + b[2:], da, db, wa, wb))
    print(f"{len(unchecked)} of {steps} steps replayed without their checks; changes made "
          f"without a guard to test: {unarmed}")
    return differences, len(unchecked), unarmed


def _group(key, value):
    def change(s):
        for group in s.opt.param_groups:
            group[key] = value
    return change


def _hook(register):
    def change(s):
        s.handles.append(register(s))
    return change


def _undo(change):
    """A change that undoes one after which every step runs its checks (a hook that makes
    them eager, an error, a tensor lr): it meets no guard."""
    change.undoes = True
    return change


@_undo
def _unhook(s):
    while s.handles:
        s.handles.pop().remove()


def _set(attr, value, on="loss_fn"):
    def change(s):
        setattr(getattr(s, on) if on else s, attr, value)
    return change


def _new_storage(s):
    p = next(s.model.parameters())
    p.data = p.data.clone()


def _restride(s):
    # (the same storage and shape, read column-major: another weight, which the graph's
    # kernels would read with the strides of its capture)
    p = next(s.model.parameters())
    p.data = p.data.as_strided(p.shape, (1, p.shape[0]))


def _tensor_attribute(s):
    s.model.scale = torch.ones(3)


def _tensor_attribute_data(s):
    s.model.scale.data = torch.zeros(3)  # (the same object, new storage)


def _replace_state(s):
    p = s.opt.param_groups[0]["params"][0]
    state = s.opt.state[p]
    key = sorted(k for k in state if torch.is_tensor(state[k]) and state[k].dim())[0]
    state[key] = state[key] * 0.5


def _reload(s):
    s.opt.load_state_dict(copy.deepcopy(s.opt.state_dict()))


def _reversed_params(s):
    s.opt.param_groups[0]["params"].reverse()


def _stranger_group(s):
    s.opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})


@_undo
def _drop_stranger(s):
    s.opt.param_groups.pop()


def _batch(rows=None, dtype=None):
    def change(s):
        s.extra = None if rows is None and dtype is None else (
            lambda x, y: (x[:rows], (y[:rows] if dtype is None else y[:rows].to(dtype))))
    return change


def _as_tuple(s):
    s.extra = lambda x, y: ((x,), y)


def _loss(make_loss):
    def change(s):
        s.loss_fn = make_loss()
    return change


_CROSS_ENTROPY = torch.nn.functional.cross_entropy


def _doubled_cross_entropy(out, y):
    return _CROSS_ENTROPY(out, y) * 2


def _tripled_forward(s):
    s.loss_fn.forward = lambda out, y: 3 * torch.nn.functional.cross_entropy(out, y)


@_undo
def _own_forward_dropped(s):
    del s.loss_fn.forward


def _weighted(s):
    s.loss_fn.weight = torch.linspace(0.5, 1.5, 5)


def _freeze(flag):
    def change(s):
        next(s.model.parameters()).requires_grad_(not flag)
    return change


def _grad(flag):
    def change(s):
        s.grad = flag
    return change


# What changes between steps, in order; each undo follows the change it undoes.
COMMON = [
    _set("label_smoothing", 0.1), _set("ignore_index", 2),
    _hook(lambda s: s.model.register_forward_hook(lambda *a: None)), _unhook,
    _hook(lambda s: torch.nn.modules.module.register_module_forward_hook(lambda *a: None)),
    _unhook,
    _hook(lambda s: s.loss_fn.register_forward_pre_hook(lambda *a: None)), _unhook,
    _tripled_forward, _own_forward_dropped,
    _new_storage, _restride, _set("note", 3, on="model"), _set("_private", 3, on="model"),
    _tensor_attribute, _tensor_attribute_data, _batch(rows=16), _batch(),
    _batch(dtype=torch.int32), _batch(), _grad(False), _undo(_grad(True)),
    _freeze(True), _undo(_freeze(False)), _set("accumulate", 2, on=None), _undo(
        _set("accumulate", 1, on=None)), _as_tuple, _undo(_batch()),
    _loss(lambda: _doubled_cross_entropy), _undo(_loss(torch.nn.CrossEntropyLoss)), _weighted,
    _undo(_loss(lambda: torch.nn.functional.cross_entropy)),
    _loss(lambda: torch.nn.CrossEntropyLoss(label_smoothing=0.05)),
]
OPTIMIZER = [
    _group("lr", 0.02), _group("weight_decay", 0.01), _replace_state, _reload,
    _hook(lambda s: s.opt.register_step_pre_hook(lambda *a: None)), _unhook,
    _reversed_params, _stranger_group, _drop_stranger, _set("max_grad_norm", 0.5, on="opt"),
    _group("lr", torch.tensor(0.01)), _undo(_group("lr", 0.01)),
    _hook(lambda s: s.opt.register_step_post_hook(lambda *a: None)), _unhook,
]
CHANGES = {
    None: [_set("lr", 0.02, on="dp"), _set("momentum", 0.5, on="dp"),
           _set("weight_decay", 0.01, on="dp")] + COMMON,
    "SGD": [_group("momentum", 0.0), _group("momentum", 0.8)] + OPTIMIZER + COMMON,
    "AdamW": [_group("betas", (0.8, 0.99))] + OPTIMIZER + COMMON,
    "Adam": [_group("amsgrad", False)] + OPTIMIZER + COMMON,
}
SPACING = 6  # (steps between changes: a new shape's warm-up, capture and first replay fit)


# The changes of changed_training: the lockstep's that a CUDA device takes as the CPU does.
TRAINING_CHANGES = [
    _group("lr", 0.02), _set("label_smoothing", 0.1), _new_storage, _restride,
    _set("note", 3, on="model"), _set("_private", 3, on="model"), _tensor_attribute,
    _tensor_attribute_data, _hook(lambda s: s.model.register_forward_hook(lambda *a: None)),
    _unhook, _set("ignore_index", 2), _replace_state, _reload,
    _batch(rows=16), _batch(), _group("weight_decay", 0.01),
]


def changed_training(opt_name, devices, mode, spacing=SPACING):
    """The lockstep's model trained on devices with TRAINING_CHANGES, one every `spacing`
    steps, in mode "eager" (blocking=False, no graphs), "graphed" (the guard on) or "checked"
    (off). Returns (the losses, the weights and optimizer state, the steps replayed without
    their checks). On a GPU a replay of a stale graph shows in the numbers (tests/
    test_cuda_step.py); on the CPU stand-in, whose replay runs the step's Python again, it
    cannot."""
    s = _setup(opt_name, mode == "graphed", devices=devices, graphs=mode != "eager",
               **({"blocking": False} if mode == "eager" else {}))
    changes = {spacing * (i + 1): change for i, change in enumerate(TRAINING_CHANGES)}
    device = devices[0]
    losses = []
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        unchecked = _calls(mp, graphed_module.GraphedSteps, "_replay_unchanged")
        warnings.simplefilter("ignore")  # (the NaN step, the eager steps' reasons)
        for i, (x, y) in enumerate(batches(spacing * (len(changes) + 2), nan_steps=(7,))):
            if i in changes:
                changes[i](s)
            x, y = x.to(device), y.to(device)
            xi, yi = s.extra(x, y) if s.extra else (x, y)
            losses.append(s.dp.step(xi, yi, s.loss_fn, optimizer=s.opt))
        s.dp.synchronize()
    return [float(v) for v in losses], _snapshot(s), len(unchecked)


@pytest.mark.parametrize("opt_name", ["SGD", "AdamW"])
def test_changed_training_graphed_is_the_eager_training(closure, opt_name):
    want, state, _ = changed_training(opt_name, ("cpu", "cpu"), "eager")
    for mode in ("graphed", "checked"):
        losses, got, unchecked = changed_training(opt_name, ("cpu", "cpu"), mode)
        assert losses == pytest.approx(want, rel=0, abs=0, nan_ok=True), mode
        assert _equal(got, state), mode
        assert (unchecked >= 40) if mode == "graphed" else not unchecked, (mode, unchecked)


@pytest.mark.parametrize("opt_name", [None, "SGD", "AdamW", "Adam"])
def test_guarded_training_is_the_checked_training_bit_for_bit(closure, opt_name):
    changes = {SPACING * (i + 1): change for i, change in enumerate(CHANGES[opt_name])}
    differences, unchecked, unarmed = lockstep(opt_name, changes,
                                               steps=SPACING * (len(changes) + 2))
    assert not differences, differences[:3]
    # (every change but an undo met a guard: none of them tests nothing)
    undoing = {i for i, change in changes.items() if getattr(change, "undoes", False)}
    assert unchecked >= 60 and set(unarmed) <= undoing, (unchecked, unarmed)


@pytest.mark.parametrize("opt_name", [None, "SGD"])
def test_split_weights_edited_in_place(closure, opt_name):
    def edit(s):
        s.dp.split_weights[0] = 3.0
    differences, unchecked, unarmed = lockstep(opt_name, {12: edit}, steps=24, split="weighted",
                                               split_weights=[1, 1])
    assert not differences and not unarmed and unchecked >= 8, (differences, unarmed)


def _schedule(make_scheduler):
    """A scheduler stepped after every step from now on."""
    def change(s):
        s.after.append(make_scheduler(s.opt).step)
    return change


SCHEDULES = {
    "SGD": lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=0.1, total_steps=200, base_momentum=0.8, max_momentum=0.95),
    "AdamW": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.02,
                                                             total_steps=200),
    "Adam": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10),
}


@pytest.mark.parametrize("opt_name", ["SGD", "AdamW", "Adam"])
def test_a_schedule_stepped_at_every_step_keeps_the_guard(closure, opt_name):
    """OneCycleLR (lr and SGD's momentum or Adam's betas at every step), CosineAnnealingLR:
    the replays write each step's values, as the checked steps do, without the checks."""
    changes = {6: _schedule(SCHEDULES[opt_name]), 20: _group("momentum", 0.0)
               if opt_name == "SGD" else _group("amsgrad", opt_name == "AdamW"),
               30: _hook(lambda s: s.model.register_forward_hook(lambda *a: None)),
               32: _unhook}
    differences, unchecked, unarmed = lockstep(opt_name, changes, steps=48)
    assert not differences and unarmed == [32], (differences[:3], unarmed)
    assert unchecked >= 30


class _SteppingSGD(dpcuda.optim.SGD):
    """A subclass whose step() changes the learning rate and drops the momentum buffers, before
    the fused update, now and then."""

    calls = 0

    def step(self, closure=None):
        self.calls += 1
        if self.calls % 7 == 0:
            for group in self.param_groups:
                group["lr"] *= 0.5
        if self.calls % 11 == 0:
            for state in self.state.values():
                state.pop("momentum_buffer", None)
        return super().step(closure)


def _wrap_step(s):
    step = s.opt.step

    def wrapped(*args, **kw):
        s.opt.param_groups[0]["lr"] = 0.5 * s.opt.param_groups[0]["lr"]
        return step(*args, **kw)
    s.opt.step = wrapped


def test_what_the_optimizers_own_step_changes_reaches_the_replay(closure):
    """User code inside opt.step() before the fused update (a subclass's step, a wrapper set
    on the instance) runs after the guard's test: the replay still writes what it changed."""
    differences, unchecked, unarmed = lockstep("SGD", {}, steps=40, opt_cls=_SteppingSGD)
    assert not differences and unchecked >= 10, differences[:3]
    differences, unchecked, unarmed = lockstep("SGD", {8: _wrap_step}, steps=30)
    assert not differences and not unarmed and unchecked >= 10, differences[:3]


def _halve_lr_and_drop_momentum(opt, calls):
    if calls % 7 == 0:
        for group in opt.param_groups:
            group["lr"] *= 0.5
    if calls % 11 == 0:
        for state in opt.state.values():
            state.pop("momentum_buffer", None)


def _reset_state(opt, calls):
    if calls == 10:
        opt.state = collections.defaultdict(dict)  # (the usual reset of an optimizer)


def _own_entry(opt, calls):
    # (first made at the call after the skipped one: a state bound again after a first SGD
    # step the device skipped; torch's Adam makes its state only in an empty dict)
    if calls < (3 if "betas" in opt.defaults else 2):
        return
    for group in opt.param_groups:  # (an entry of a subclass's own, replaced at every call)
        for p in group["params"]:
            opt.state[p]["seen_at"] = calls


def _stepping(base, change):
    """An optimizer of base (dpcuda's, or torch's as the oracle) whose step() makes change
    before the update."""
    class Stepping(base):
        calls = 0

        def step(self, closure=None):
            self.calls += 1
            change(self, self.calls)
            return super().step(closure)
    return Stepping


INSIDE_STEP = [("SGD", _halve_lr_and_drop_momentum), ("SGD", _reset_state),
               ("Adam", _reset_state), ("SGD", _own_entry), ("Adam", _own_entry)]


@pytest.mark.parametrize("mode", ["blocking", "nonblocking", "graphed"])
@pytest.mark.parametrize("opt_name, change", INSIDE_STEP,
                         ids=[f"{o}-{c.__name__}" for o, c in INSIDE_STEP])
def test_what_the_optimizers_own_step_changes_is_torchs(closure, monkeypatch, mode, opt_name,
                                                        change):
    """An lr halved and the momentum buffers dropped, the state replaced by a new dict, an
    entry of the subclass's own (the first step skipped for a NaN: momentum not begun), inside
    opt.step() after the step's checks: torch's training, in every mode. A state changed there
    binds the plan again on the host before the update (a CUDA graph's replay runs no Python:
    the CPU stand-in's body would bind it again itself), and an entry of the subclass's own
    does not at every step."""
    def model():
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 5)).double()
    cfg = dict(lr=0.05, momentum=0.9, dampening=0.1) if opt_name == "SGD" else dict(lr=0.01)
    data = [(x.double(), y) for x, y in batches(30, nan_steps=(0,))]
    ref = model()
    ref_opt = _stepping(getattr(torch.optim, opt_name), change)(ref.parameters(), **cfg)
    # (the NaN step: skipped, no update and no state; a step decided on the device calls
    # opt.step() all the same, a blocking one does not)
    ref_opt.calls = 0 if mode == "blocking" else 1
    for x, y in data[1:]:
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    binds_outside = []
    _binds_outside_replays(monkeypatch, lambda opt: binds_outside.append(opt.calls))
    m = model()
    dp = DataParallel(m, ["cpu"] * 2, graphs=mode == "graphed",
                      **({} if mode == "graphed" else {"blocking": mode == "blocking"}))
    opt = _stepping(getattr(dpcuda.optim, opt_name), change)(m.parameters(), **cfg)
    loss_fn = torch.nn.CrossEntropyLoss()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the NaN step)
        for x, y in data:
            dp.step(x, y, loss_fn, optimizer=opt)
    dp.synchronize()
    assert dp.skipped_steps == 1
    for a, b in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    if change is _own_entry:
        assert len(binds_outside) <= 3, binds_outside
    else:
        # (each drop or reset bound again before its update)
        wanted = {10} if change is _reset_state else {11, 22}
        assert wanted <= set(binds_outside), binds_outside
        assert len(binds_outside) <= len(wanted) + 3, binds_outside


def _momentum_off(opt, calls):
    if calls == 5:
        opt.param_groups[0]["momentum"] = 0.0


def _new_group(opt, calls):
    if calls == 5:
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})


def _one_buffer_dropped(opt, calls):
    if calls == 5:
        opt.state[opt.param_groups[0]["params"][0]].pop("momentum_buffer")


def _one_step_count(opt, calls):
    if calls == 5:
        opt.state[opt.param_groups[0]["params"][0]]["step"].add_(5)  # (in place)


RAISING = [("SGD", _momentum_off), ("SGD", _new_group), ("SGD", _one_buffer_dropped),
           ("Adam", _one_step_count)]


@pytest.mark.parametrize("mode", ["blocking", "nonblocking", "graphed"])
@pytest.mark.parametrize("opt_name, change", RAISING,
                         ids=[f"{o}-{c.__name__}" for o, c in RAISING])
def test_what_the_fused_update_cannot_take_inside_the_step_raises(closure, mode, opt_name,
                                                                  change):
    """Another kind of state (SGD's momentum to 0), another number of groups, a group's
    parameters at two points (one momentum buffer dropped, one step count advanced in place),
    inside opt.step(): the update set up before it cannot apply them. A clear error, and the
    weights as they were."""
    model = make()
    dp = DataParallel(model, ["cpu"] * 2, graphs=mode == "graphed",
                      **({} if mode == "graphed" else {"blocking": mode == "blocking"}))
    opt = _stepping(getattr(dpcuda.optim, opt_name), change)(
        model.parameters(), lr=0.05, **({"momentum": 0.9} if opt_name == "SGD" else {}))
    data = batches(5)
    loss_fn = SoftmaxCrossEntropyLoss()
    for x, y in data[:4]:
        dp.step(x, y, loss_fn, optimizer=opt)
    dp.synchronize()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"Stepping.step\(\) .* left .* inside "
                                           r"DataParallel.step.*nothing was updated"):
        dp.step(*data[4], loss_fn, optimizer=opt)
        dp.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("mode", ["blocking", "nonblocking", "graphed"])
def test_a_loss_whose_forward_is_set_on_the_instance(closure, mode):
    """A cross-entropy loss with a forward of its own, set on the instance (from the start, or
    after the guard is made): computed as it says, on the gathered output."""
    for when in (0, 8):
        model = make(fused=False)
        ref = copy.deepcopy(model)
        dp = DataParallel(model, ["cpu"] * 2, lr=0.05, graphs=mode == "graphed",
                          **({} if mode == "graphed" else {"blocking": mode == "blocking"}))
        loss_fn = torch.nn.CrossEntropyLoss()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i, (x, y) in enumerate(batches(14, nan_steps=())):
                if i == when:
                    loss_fn.forward = lambda out, y: 3 * torch.nn.functional.cross_entropy(out, y)
                want = (3 if i >= when else 1) * torch.nn.functional.cross_entropy(ref(x), y)
                ref.zero_grad()
                want.backward()
                with torch.no_grad():
                    for p in ref.parameters():
                        p -= 0.05 * p.grad
                got = dp.step(x, y, loss_fn)
                torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float64),
                                           want.detach().double(), rtol=1e-5, atol=1e-6)
        dp.synchronize()
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opt_name", [None, "SGD", "AdamW"])
def test_unchanged_steps_skip_the_checks(closure, monkeypatch, opt_name):
    """After the warm-up, the capture and one replay with the checks, every step replays
    without them, with a schedule stepped at every step; a hook runs them (its steps eager),
    then the guard holds again."""
    checked = []
    original = graphed_module.GraphedSteps._why_not

    def why_not(self, *args):
        checked.append(True)
        return original(self, *args)
    monkeypatch.setattr(graphed_module.GraphedSteps, "_why_not", why_not)
    s = _setup(opt_name, True)
    sched = torch.optim.lr_scheduler.LambdaLR(s.opt, lambda e: 0.99 ** e) if s.opt else None
    per_step = []
    for i, (x, y) in enumerate(batches(36)):
        if i == 20:
            handle = s.model.register_forward_hook(lambda *a: None)
        if i == 22:
            handle.remove()
        before = len(checked)
        s.dp.step(x, y, s.loss_fn, optimizer=s.opt)
        if sched:
            sched.step()
        per_step.append(len(checked) - before)
    s.dp.synchronize()
    assert per_step[10:20] == [0] * 10 and per_step[20:22] == [1, 1], per_step
    assert per_step[-8:] == [0] * 8, per_step


class _OwnParameter(torch.nn.Parameter):
    pass


def _own_parameters(s):
    for m in s.model.modules():
        for name, p in list(m._parameters.items()):
            m._parameters[name] = _OwnParameter(p.detach().clone())
    s.opt = type(s.opt)(s.model.parameters(), lr=0.05, momentum=0.9)


def _nested_attribute(s):
    s.model.ragged = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])


@pytest.mark.parametrize("model_change", [_own_parameters, _nested_attribute])
def test_the_guard_holds_with_a_parameter_subclass_and_leaves_a_nested_tensor(
        closure, monkeypatch, model_change):
    """A subclass of nn.Parameter (its __torch_function__ off, as nn.Parameter's) is read
    from its C object: the guard holds. A nested tensor among a module's attributes, whose
    sizes cannot be read, leaves the guard off (every step checked) and trains as before."""
    unchecked = _calls(monkeypatch, graphed_module.GraphedSteps, "_replay_unchanged")
    s = _setup("SGD", True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (nested tensors: a prototype)
        model_change(s)
    for x, y in batches(30):
        s.dp.step(x, y, s.loss_fn, optimizer=s.opt)
    s.dp.synchronize()
    if model_change is _own_parameters:
        assert len(unchecked) >= 20, len(unchecked)
    else:
        assert not unchecked and s.dp._graphed.graphs


def test_a_restrided_weight_builds_the_replicas_once(closure, monkeypatch):
    """A weight given other strides over its storage before a graphed step: one build (the
    step walks the model again after it, as the build gives the weight its flat view's
    strides)."""
    from dpcuda.parallel import replicas as replicas_module
    builds = _calls(monkeypatch, replicas_module.ReplicaSet, "_build")
    s = _setup("SGD", True)
    for i, (x, y) in enumerate(batches(12)):
        if i == 8:
            builds.clear()
            _restride(s)
        s.dp.step(x, y, s.loss_fn, optimizer=s.opt)
        if i == 8:
            assert len(builds) == 1, len(builds)


def test_cross_entropy_rebound(closure, monkeypatch):
    """summed_loss looks torch.nn.functional.cross_entropy up at every step: a library that
    rebinds it makes the checked step compute the loss on the gathered output (eagerly)."""
    def rebind(s):
        monkeypatch.setattr(torch.nn.functional, "cross_entropy", _doubled_cross_entropy)
    original = torch.nn.functional.cross_entropy
    differences, unchecked, unarmed = lockstep(
        "SGD", {6: _loss(lambda: original), 12: rebind}, steps=20)
    assert not differences and not unarmed and unchecked >= 4, differences[:3]


def test_a_guard_missing_a_read_is_caught(closure, monkeypatch):
    """The oracle's check on itself: a guard that does not read the loss's label_smoothing
    replays a graph of the old loss after it changes, and the lockstep reports it."""
    monkeypatch.setattr(replay_guard, "_LOSS_SETTINGS", ("reduction", "ignore_index", "weight"))
    differences, _, unarmed = lockstep("SGD", {10: _set("label_smoothing", 0.1)}, steps=14)
    assert not unarmed
    assert differences and differences[0][0] == 10, differences
    assert differences[0][3] == [("eager",)] and differences[0][4] == [("replay", 1)]
