"""Clipping by the global norm in dpcuda.optim (max_grad_norm): on a plain model it is torch's
clip_grad_norm_ before the update; in DataParallel.step(..., optimizer=opt) it is computed
inside the fused reduce-update (reduce_update_'s max_norm). Torch as the oracle: one device,
clip_grad_norm_, then torch.optim's update."""

import math
import re

import pytest
import torch
from torch import nn

import dpcuda.optim
from dpcuda.parallel import DataParallel
from dpcuda.parallel.fused_update import shard_range


def close(a, b, rtol, atol=0.0):
    return torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)


def _model(dtype=torch.float64):
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(9, 21), nn.Tanh(), nn.Linear(21, 5)).to(dtype)


def _data(steps, rows=23, dtype=torch.float64, seed=4):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 9, generator=g).to(dtype) * 3,
             torch.randint(0, 5, (rows,), generator=g)) for _ in range(steps)]


CASES = [("AdamW", {"weight_decay": 0.05}), ("Adam", {"amsgrad": True}),
         ("SGD", {"momentum": 0.9, "nesterov": True})]


def _torch_run(name, cfg, max_norm, data, dtype=torch.float64):
    model = _model(dtype)
    opt = getattr(torch.optim, name)(model.parameters(), lr=0.02, **cfg)
    norms = []
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        opt.step()
    return model, norms


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_on_a_plain_model_it_is_torchs_clip_grad_norm(case):
    name, cfg = case
    data = _data(3)
    ref, norms = _torch_run(name, cfg, 0.3, data)
    model = _model()
    opt = getattr(dpcuda.optim, name)(model.parameters(), lr=0.02, max_grad_norm=0.3, **cfg)
    assert opt.grad_norm is None
    for i, ((x, y), norm) in enumerate(zip(data, norms)):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        # torch's own clip_grad_norm_: its bits at the first step (later the weights differ by
        # the updates' rounding: torch's CPU kernels contract some products into FMAs)
        assert torch.equal(opt.grad_norm, norm) if i == 0 else close(opt.grad_norm, norm, 1e-12)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert close(a, b, 1e-12, 1e-14)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("replicas,algorithm", [(1, "auto"), (2, "two_shot"), (3, "one_shot"),
                                                (3, "ring"), (4, "two_shot")])
@pytest.mark.parametrize("max_norm", [0.3, 1e6, 0.0])
def test_the_fused_step_clips_as_torch(case, replicas, algorithm, max_norm):
    name, cfg = case
    data = _data(3)
    ref, norms = _torch_run(name, cfg, max_norm, data)
    model = _model()
    dp = DataParallel(model, ["cpu"] * replicas, algorithm=algorithm)
    opt = getattr(dpcuda.optim, name)(dp.parameters(), lr=0.02, max_grad_norm=max_norm, **cfg)
    for (x, y), norm in zip(data, norms):
        dp.step(x, y, nn.CrossEntropyLoss(), optimizer=opt)
        # the norm before clipping, as clip_grad_norm_ returns it (summed in the shards'
        # order, so to rounding)
        assert opt.grad_norm.shape == () and opt.grad_norm.dtype == torch.float64
        assert close(opt.grad_norm, norm, 1e-13)
        if max_norm == 0.3:
            assert float(norm) > 0.3  # (the clipping is active)
    assert dp._fused_update._key is not None  # (the fused reduce-update ran)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert close(a, b, 1e-10, 1e-13), (a - b).abs().max()
    for r in dp.replicas[1:]:
        for a, b in zip(r.parameters(), model.parameters()):
            assert torch.equal(a, b)
    assert all(p.grad is None for p in model.parameters())


def test_the_fused_step_clips_float32_as_torch():
    data = _data(4, dtype=torch.float32)
    ref, norms = _torch_run("AdamW", {}, 0.2, data, torch.float32)
    model = _model(torch.float32)
    dp = DataParallel(model, ["cpu"] * 3)
    opt = dpcuda.optim.AdamW(dp.parameters(), lr=0.02, max_grad_norm=0.2)
    for (x, y), norm in zip(data, norms):
        dp.step(x, y, nn.CrossEntropyLoss(), optimizer=opt)
        assert close(opt.grad_norm, norm, 1e-5)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert close(a, b, 1e-4, 1e-6)


def _op_inputs(n, R, dtype, seed=5, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    grads = [(torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype)
             for _ in range(R)]
    return p0, grads


def _op_run(p0, grads, algorithm, max_norm, gather=True, lr=0.01):
    R, n, dtype = len(grads), p0.numel(), p0.dtype
    opt = dpcuda.optim.AdamW([torch.zeros(1)], lr=lr, weight_decay=0.1)
    h = opt._hyper_tensor(0, "cpu", opt._values(opt.param_groups[0], 1.0)).clone()
    bounds = [shard_range(n, R, k, 16 // p0.element_size()) for k in range(R)]
    ps = [p0.clone() for _ in range(R)]
    gs = [x.clone() for x in grads]
    m = [torch.zeros(e - b, dtype=dtype) for b, e in bounds]
    v = [torch.zeros(e - b, dtype=dtype) for b, e in bounds]
    norm = torch.full((1,), math.nan, dtype=dtype)
    torch.ops.dpcuda.reduce_update_(ps, gs, m, v, [], [h] * R, [0, n, 0], "adam", True,
                                    algorithm, gather, max_norm, norm)
    return ps, torch.cat(m), torch.cat(v), norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_ops_clipping_is_torchs_and_the_same_bits_for_every_algorithm(dtype):
    n, R = 20011, 3  # shards of several norm chunks
    p0, grads = _op_inputs(n, R, dtype)
    out = {a: _op_run(p0, grads, a, 2.0) for a in ("two_shot", "one_shot", "ring")}
    ps, m, v, norm = out["two_shot"]
    for a in ("one_shot", "ring"):
        assert all(torch.equal(x, y) for x, y in zip(out[a][0], ps)), a
        assert torch.equal(out[a][1], m) and torch.equal(out[a][3], norm), a
    assert all(torch.equal(x, ps[0]) for x in ps[1:])
    # torch: the mean of the replicas' gradients, clip_grad_norm_, then AdamW
    mean = grads[0].float() if dtype == torch.bfloat16 else grads[0].clone()
    for x in grads[1:]:
        mean = mean + (x.float() if dtype == torch.bfloat16 else x)
    mean = (mean / R).to(dtype)
    w = p0.clone().requires_grad_()
    w.grad = mean.clone()
    want = torch.nn.utils.clip_grad_norm_([w], 2.0)
    assert float(want) > 2.0
    torch.optim.AdamW([w], lr=0.01, weight_decay=0.1).step()
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2}[dtype]
    assert close(norm[0].double(), want.double(), tol)
    assert close(ps[0].double(), w.detach().double(), tol, tol)


def test_the_ops_clipping_without_the_gather_and_on_one_replica():
    p0, grads = _op_inputs(5003, 2, torch.float32)
    ps, m, _, norm = _op_run(p0, grads, "two_shot", 1.0)
    qs, m2, _, norm2 = _op_run(p0, grads, "two_shot", 1.0, gather=False)
    assert torch.equal(qs[0], ps[0]) and torch.equal(m2, m) and torch.equal(norm2, norm)
    assert torch.equal(qs[1], p0)
    # one replica: its gradient is the whole reduction
    one, _, _, n1 = _op_run(p0, grads[:1], "auto", 1.0)
    w = p0.clone().requires_grad_()
    w.grad = grads[0].clone()
    want = torch.nn.utils.clip_grad_norm_([w], 1.0)
    assert close(n1[0], want, 1e-6)


def test_an_infinite_gradient_clips_as_torch_does():
    # norm inf, coefficient 0: inf * 0 is NaN where the gradient was inf, 0 elsewhere (torch's
    # clip_grad_norm_ without error_if_nonfinite); the update then follows.
    p0, grads = _op_inputs(64, 2, torch.float64)
    grads[1][7] = math.inf
    ps, _, _, norm = _op_run(p0, grads, "two_shot", 1.0)
    w = p0.clone().requires_grad_()
    w.grad = (grads[0] + grads[1]) / 2
    want = torch.nn.utils.clip_grad_norm_([w], 1.0)
    torch.optim.AdamW([w], lr=0.01, weight_decay=0.1).step()
    assert math.isinf(float(norm[0])) and math.isinf(float(want))
    assert close(ps[0], w.detach(), 1e-12, 1e-14)
    assert ps[0][7].isnan()


def test_a_max_norm_of_zero_applies_the_decay_alone():
    p0, grads = _op_inputs(100, 2, torch.float64)
    ps, m, v, _ = _op_run(p0, grads, "two_shot", 0.0)
    assert torch.equal(m, torch.zeros_like(m)) and torch.equal(v, torch.zeros_like(v))
    assert torch.equal(ps[0], p0 * (1 - 0.01 * 0.1))


def test_bad_clipping_arguments_are_refused_by_name():
    ps, gs = [torch.zeros(8), torch.zeros(8)], [torch.zeros(8), torch.zeros(8)]
    h = torch.zeros(16, dtype=torch.float64)
    args = (ps, gs, [], [], [], [h, h], [0, 8, 0], "sgd", False, "two_shot", True)
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="max_norm must be a finite number >= 0"):
            torch.ops.dpcuda.reduce_update_(*args, bad, None)
    with pytest.raises(ValueError, match="norm is written only when max_norm is given"):
        torch.ops.dpcuda.reduce_update_(*args, None, torch.zeros(1))
    with pytest.raises(TypeError, match="norm has dtype"):
        torch.ops.dpcuda.reduce_update_(*args, 1.0, torch.zeros(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="norm must be a one-element tensor"):
        torch.ops.dpcuda.reduce_update_(*args, 1.0, torch.zeros(2))
    # norm is written before the update reads the other arguments: it may share none's memory
    for what, t in (("params[0]", ps[0][:1]), ("grads[1]", gs[1][3:4])):
        with pytest.raises(ValueError, match=rf"norm and {re.escape(what)} share memory"):
            torch.ops.dpcuda.reduce_update_(*args, 1.0, t)
    h64 = torch.zeros(16, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"norm and hyper\[0\] share memory"):
        torch.ops.dpcuda.reduce_update_(
            [torch.zeros(8, dtype=torch.float64)] * 1, [torch.zeros(8, dtype=torch.float64)],
            [], [], [], [h64], [0, 8, 0], "sgd", False, "two_shot", True, 1.0, h64[:1])
    for bad in (-0.5, math.nan, math.inf):
        with pytest.raises(ValueError, match="max_grad_norm must be None or a finite"):
            dpcuda.optim.AdamW([torch.zeros(2, requires_grad=True)], max_grad_norm=bad)
    for bad in (True, "1", [1.0]):
        with pytest.raises(TypeError, match="max_grad_norm must be None or a finite"):
            dpcuda.optim.AdamW([torch.zeros(2, requires_grad=True)], max_grad_norm=bad)
    import numpy as np
    assert dpcuda.optim.SGD([torch.zeros(2, requires_grad=True)],
                            max_grad_norm=np.float32(1.5)).max_grad_norm == 1.5


def test_max_grad_norm_survives_pickling_and_leaves_the_state_dict_torchs():
    import pickle
    p = torch.zeros(3, requires_grad=True)
    opt = dpcuda.optim.SGD([p], lr=0.1, max_grad_norm=2.5)
    again = pickle.loads(pickle.dumps(opt))
    assert again.max_grad_norm == 2.5 and again.grad_norm is None
    state = opt.state_dict()
    assert "max_grad_norm" not in state["param_groups"][0]
    torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=0.1).load_state_dict(state)


def test_a_half_norm_overflows_as_torchs():
    # float16 gradients whose norm exceeds float16's range: torch's norm is inf, so its
    # coefficient is 0 and the clipped gradient is 0; the update then applies the decay alone.
    p0 = torch.linspace(-1, 1, 64).half()
    grads = [torch.full((64,), 6e4).half(), torch.full((64,), 6e4).half()]
    ps, m, _, norm = _op_run(p0, grads, "two_shot", 1.0)
    w = p0.clone().requires_grad_()
    w.grad = grads[0].clone()  # (the mean of two equal gradients)
    want = torch.nn.utils.clip_grad_norm_([w], 1.0)
    assert math.isinf(float(want)) and math.isinf(float(norm[0]))
    assert torch.equal(w.grad, torch.zeros_like(w.grad)) and torch.equal(m, torch.zeros_like(m))
    # (torch's float16 AdamW on the CPU computes in float16, where eps = 1e-8 underflows and a
    # zero gradient gives 0 / 0; dpcuda computes in float, as torch's fused path: the decay)
    assert torch.equal(ps[0], (p0.float() * (1 - 0.01 * 0.1)).half())


def test_a_skipped_step_leaves_grad_norm_nan_and_no_half_reduced_grad():
    model = _model()
    dp = DataParallel(model, ["cpu"] * 2)
    opt = dpcuda.optim.AdamW(dp.parameters(), lr=0.02, max_grad_norm=0.3)
    (x, y), = _data(1)
    dp.step(x, y, nn.CrossEntropyLoss(), optimizer=opt)
    assert math.isfinite(float(opt.grad_norm))
    x = x.clone()
    x[-1, 0] = math.inf  # the second replica's rows
    before = [p.clone() for p in model.parameters()]
    with pytest.warns(RuntimeWarning, match="skipped"):
        dp.step(x, y, nn.CrossEntropyLoss(), optimizer=opt)
    assert math.isnan(float(opt.grad_norm))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for r in dp.replicas for p in r.parameters())
