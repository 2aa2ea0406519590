"""DataParallel's walk over the model in C (dpcuda._C._walk, csrc/torch/model_walk.cpp)
against the Python walk it stands in for (ReplicaSet._walk_python): the same parameters,
buffers, structure key, hooks, attribute state and kept objects, on random models; and None,
so that the Python walk runs and raises, wherever the Python walk has something to say."""

import math
import random

import pytest
import torch
from torch import nn

from dpcuda import _C
from dpcuda.nn import FusedLinear
from dpcuda.parallel import replicas as replicas_module
from dpcuda.parallel.replicas import ReplicaSet


class _Thing:
    pass


class _SubParameter(nn.Parameter):
    """A parameter of a subclass: the C walk reads its shape and hooks through Python."""


def _attribute(rng):
    """A module attribute of a kind a model may hold."""
    choice = rng.randrange(16)
    return [
        lambda: rng.randrange(-3, 1000),
        lambda: rng.choice([0.5, -0.0, 0.0, math.nan, math.inf, -math.inf, 1e-300]),
        lambda: rng.choice([True, False, None]),
        lambda: rng.choice(["relu", "", "_x", "nan"]),
        lambda: torch.Size([rng.randrange(5), 3]),
        lambda: torch.device("cpu"),
        lambda: rng.choice([torch.float32, torch.bfloat16]),
        lambda: (1, math.nan, "a", None, -0.0),
        lambda: (1, [2]),  # (a tuple holding a list: held by identity)
        lambda: [1, 2],
        lambda: {"k": 1},
        lambda: torch.randn(3),
        lambda: torch.randn(4, 2).t(),
        lambda: torch.empty(2, device="meta"),
        lambda: torch.randn(3, 3).to_sparse(),  # (no storage: held as an object)
        lambda: _Thing(),
    ][choice]()


def _model(rng):
    """A random module tree: shared modules and parameters, None entries, buffers, attributes
    of every kind, and hooks now and then."""
    pool = []
    for _ in range(rng.randrange(1, 7)):
        kind = rng.randrange(5)
        if kind == 0:
            m = nn.Linear(rng.randrange(1, 5), rng.randrange(1, 5), bias=rng.random() < 0.5)
        elif kind == 1:
            m = FusedLinear(3, 2, activation=rng.choice(["relu", "gelu", "none"]))
        elif kind == 2:
            m = nn.BatchNorm1d(3)
        elif kind == 3:
            m = nn.Sequential()
        else:
            m = nn.Module()
        for i in range(rng.randrange(3)):
            setattr(m, f"attr{i}", _attribute(rng))
        if rng.random() < 0.2:
            m.register_buffer(f"buf{rng.randrange(9)}", rng.choice([None, torch.randn(2)]))
        if rng.random() < 0.2:
            m.register_parameter("extra", rng.choice([None, nn.Parameter(torch.randn(2))]))
        if pool and rng.random() < 0.3:
            m.shared = rng.choice(pool)  # (a module reached twice)
        if rng.random() < 0.1:
            m.add_module("nothing", None)
        pool.append(m)
    root = nn.Sequential(*pool)
    if rng.random() < 0.3:
        linears = [m for m in root.modules() if isinstance(m, nn.Linear)]
        if len(linears) >= 2 and linears[0].weight.shape == linears[1].weight.shape:
            linears[1].weight = linears[0].weight  # (a tied parameter)
    if rng.random() < 0.2:
        rng.choice(pool).sub_param = _SubParameter(torch.randn(rng.randrange(1, 4), 2))
    hook = rng.randrange(9)
    target = rng.choice(list(root.modules()))
    if hook == 0:
        target.register_forward_hook(lambda *a: None)
    elif hook == 1:
        target.register_forward_pre_hook(lambda *a: None)
    elif hook == 2:
        target.register_full_backward_hook(lambda *a: None)
    elif hook == 3:
        params = list(root.parameters())
        if params:
            rng.choice(params).register_hook(lambda g: g)
    elif hook == 4:
        params = list(root.parameters())
        if params:
            rng.choice(params).register_post_accumulate_grad_hook(lambda p: None)
    elif hook == 5:
        params = list(root.parameters())
        if params:  # (a hook dict made, then emptied)
            rng.choice(params).register_hook(lambda g: g).remove()
    params = list(root.parameters())
    if params and rng.random() < 0.3:
        rng.choice(params).requires_grad_(False)
    return root


def _same(c, py):
    (cp, cb, ck, (ch, cs, co)), (pp, pb, pk, (ph, ps, po)) = c, py
    assert [id(p) for p in cp] == [id(p) for p in pp]
    assert [id(b) for b in cb] == [id(b) for b in pb]
    assert ck == pk and type(ck) is tuple and hash(ck) == hash(pk)
    assert ch == ph
    assert type(cs) is tuple and len(cs) == len(ps)
    for a, b in zip(cs, ps):  # (compared as a graph's key compares them)
        assert type(a) is type(b) and a == b
    assert [id(o) for o in co] == [id(o) for o in po]


def _walks(model, graphed, replicas):
    s = ReplicaSet.__new__(ReplicaSet)  # (the walk alone, without building replicas)
    s.model, s.devices = model, ["cpu"] * replicas
    return _C._walk(model, graphed, replicas), s


@pytest.mark.parametrize("seed", range(60))
def test_the_c_walk_is_the_python_walk_on_random_models(seed):
    rng = random.Random(seed)
    model = _model(rng)
    for graphed in (True, False):
        c, s = _walks(model, graphed, 1)
        assert c is not None
        _same(c, s._walk_python(graphed))
        assert s.walk(graphed)[2] == c[2]


def test_the_c_walk_leaves_refusals_and_embeddings_to_the_python_walk():
    # a parameter that is not an nn.Parameter: the Python walk raises its error
    m = nn.Linear(2, 2)
    m._parameters["weight"] = torch.randn(2, 2)
    c, s = _walks(m, True, 1)
    assert c is None
    with pytest.raises(ValueError, match="not an nn.Parameter"):
        s.walk()
    # a gradient hook on two replicas: refused there
    m = nn.Linear(2, 2)
    m.weight.register_hook(lambda g: g)
    assert _walks(m, True, 1)[0] is not None
    c, s = _walks(m, False, 2)
    assert c is None
    with pytest.raises(ValueError, match="gradient hook"):
        s.walk(False)
    # an embedding: the Python walk's (refused when sparse, walked otherwise)
    m = nn.Sequential(nn.Embedding(5, 2), nn.Linear(2, 2))
    c, s = _walks(m, True, 1)
    assert c is None
    assert s.walk()[2] == s._walk_python()[2]
    m = nn.Embedding(5, 2, sparse=True)
    with pytest.raises(ValueError, match="sparse"):
        _walks(m, True, 1)[1].walk()


def test_the_comparison_sees_a_different_walk(monkeypatch):
    # (the check above fires on a walk that holds a NaN attribute otherwise)
    m = nn.Linear(2, 2)
    m.eps = math.nan
    c, s = _walks(m, True, 1)
    _same(c, s._walk_python(True))
    monkeypatch.setattr(replicas_module, "_attribute_key", lambda v, objects: v)
    with pytest.raises(AssertionError):
        _same(c, s._walk_python(True))


def test_an_attribute_whose_data_ptr_raises_otherwise_propagates():
    class Bad(torch.Tensor):
        def data_ptr(self):
            raise KeyError("boom")
    m = nn.Linear(2, 2)
    m.odd = torch.randn(2).as_subclass(Bad)
    with pytest.raises(KeyError, match="boom"):
        _C._walk(m, True, 1)
    with pytest.raises(KeyError, match="boom"):
        _walks(m, True, 1)[1]._walk_python(True)


def test_containers_that_are_not_plain_dicts_are_the_python_walks():
    # (from the review: a TorchScript child keeps its parameters in a wrapper of its own; an
    # OrderedDict reordered with move_to_end has an order that is not its dict's)
    m = nn.Sequential(torch.jit.script(nn.Linear(2, 2)), nn.Linear(2, 3))
    c, s = _walks(m, True, 1)
    assert c is None
    assert [p.shape for p in s.walk()[0]] == [p.shape for p in m.parameters()]
    import collections
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 3))
    m._modules = collections.OrderedDict(m._modules)
    m._modules.move_to_end("0")
    c, s = _walks(m, False, 1)
    assert c is None
    assert [p.shape for p in s.walk(False)[0]] == [p.shape for p in m.parameters()]


def test_a_tensor_attribute_whose_shape_raises_is_held_as_an_object():
    # (a nested tensor: data_ptr works, .shape raises a RuntimeError)
    m = nn.Linear(2, 2)
    m.lengths = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    c, s = _walks(m, True, 1)
    _same(c, s._walk_python(True))
    assert any(o is m.lengths for o in c[3][2])


def test_a_module_dropped_while_the_walk_runs_python_code_is_still_walked_as_in_python():
    # (from the review: a tensor subclass's data_ptr deletes a sibling not visited yet; the
    # walk holds it, as the Python walk's stack does, and reads no freed memory)
    import gc
    root = nn.Sequential(nn.Linear(2, 2), nn.Linear(3, 3))

    class Dropper(torch.Tensor):
        def data_ptr(self):
            root._modules.pop("1", None)
            return super().data_ptr()
    results = []
    for walk in ("c", "python"):
        root.add_module("1", nn.Linear(3, 3))
        root[0].odd = torch.zeros(1).as_subclass(Dropper)
        gc.disable()
        try:
            s = ReplicaSet.__new__(ReplicaSet)
            s.model, s.devices = root, ["cpu"]
            out = _C._walk(root, True, 1) if walk == "c" else s._walk_python(True)
        finally:
            gc.enable()
        results.append(([tuple(p.shape) for p in out[0]],
                         [k for k in out[2] if isinstance(k, type)]))
    assert results[0] == results[1] == ([(2, 2), (2,), (3, 3), (3,)],
                                        [nn.Sequential, nn.Linear, nn.Linear])
