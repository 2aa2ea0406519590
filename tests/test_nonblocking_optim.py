"""DataParallel(blocking=False).step(..., optimizer=opt) with dpcuda's optimizers: the update is
fused into the reduction and obeys the step records on the device (reduce_update_'s status),
with Adam's step counts and SGD's "momentum begun" kept there, so a skipped step counts no
step. Against the blocking step as the oracle (which reads the records first, and which
tests/test_optim.py holds against torch.optim): the same bits."""

import math
import warnings

import pytest
import torch

import dpcuda
from dpcuda.nn import SoftmaxCrossEntropyLoss
from dpcuda.parallel import DataParallel
from conftest import make_model
from test_nonblocking import batches, logged_steps

CONFIGS = [
    ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-3)),
    ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True, maximize=True)),
    ("Adam", dict(lr=0.01, amsgrad=True, weight_decay=1e-3)),
    ("AdamW", dict(lr=0.01, max_grad_norm=0.5)),
]


def groups(model):
    """Weights with decay, biases without, and a group lr: what a user's AdamW gets."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if "bias" not in n]},
            {"params": [p for n, p in named if "bias" in n], "weight_decay": 0.0, "lr": 0.02}]


def train(blocking, name, cfg, fused, replicas, algorithm, data, dtype=torch.float32,
          conventional=False):
    """conventional: a step pre-hook makes the (blocking) step reduce and then call the
    optimizer's own step() on .grad: an independent path, with the fused update's bits for up
    to 3 replicas (tests/test_optim.py), where the update does not clip."""
    model = make_model(fused, dtype)
    dp = DataParallel(model, ["cpu"] * replicas, algorithm=algorithm, blocking=blocking)
    opt = getattr(dpcuda.optim, name)(groups(model), **cfg)
    if conventional:
        opt.register_step_pre_hook(lambda *args: None)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    loss_fn = SoftmaxCrossEntropyLoss() if fused else torch.nn.CrossEntropyLoss()
    losses, norms = [], []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for x, y in data:
            losses.append(float(dp.step(x.to(dtype), y, loss_fn, optimizer=opt)))
            norms.append(None if opt.grad_norm is None else float(opt.grad_norm))
            sched.step()
        dp.synchronize()
    warned = [str(m.message) for m in w if "NaN or Inf" in str(m.message)]
    return dp, opt, losses, norms, warned


def same(a, b):
    return (a != a and b != b) or a == b


@pytest.mark.parametrize("config", range(len(CONFIGS)))
@pytest.mark.parametrize("replicas", [1, 3])
@pytest.mark.parametrize("algorithm", ["two_shot", "ring"])
@pytest.mark.parametrize("fused", [False, True])
def test_nonblocking_fused_optimizer_is_the_blocking_one_bit_for_bit(config, replicas,
                                                                     algorithm, fused):
    # The first step is skipped (no step counted, no momentum begun on the device), and a
    # later one; groups with their own lr and decay; a scheduler; clipping for AdamW.
    name, cfg = CONFIGS[config]
    data = batches(7, nan_steps=(0, 4))
    a = train(True, name, cfg, fused, replicas, algorithm, data,
              conventional=cfg.get("max_grad_norm") is None)
    b = train(False, name, cfg, fused, replicas, algorithm, data)
    dpa, opta, la, na, wa = a
    dpb, optb, lb, nb, wb = b
    assert all(same(x, y) for x, y in zip(la, lb)), (la, lb)
    assert wa == wb and len(wa) == 2 and dpa.skipped_steps == dpb.skipped_steps == 2
    if cfg.get("max_grad_norm") is not None:
        assert all(same(x, y) for x, y in zip(na, nb)), (na, nb)
        assert math.isnan(nb[0]) and math.isnan(nb[4])
    for p, q in zip(dpa.module.parameters(), dpb.module.parameters()):
        assert torch.equal(p, q), name
    sa, sb = opta.state_dict(), optb.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for k, entry in sa["state"].items():
        assert entry.keys() == sb["state"][k].keys()
        for key, v in entry.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(sb["state"][k][key])), key
    if name != "SGD":
        assert all(float(s["step"]) == 5 for s in sb["state"].values())  # 7 steps, 2 skipped
    # it loads into torch's optimizer of the same name, which continues as dpcuda's does
    ref = getattr(torch.optim, name)(groups(make_model(fused)), **{
        k: v for k, v in cfg.items() if k != "max_grad_norm"})
    ref.load_state_dict(sb)


def test_bfloat16_and_several_micro_batches_match_the_blocking_step():
    data = batches(5, nan_steps=(2,))
    for dtype, accumulate in ((torch.bfloat16, 1), (torch.float32, 3)):
        out = []
        for blocking in (True, False):
            model = make_model(True, dtype)
            dp = DataParallel(model, ["cpu"] * 2, blocking=blocking)
            opt = dpcuda.optim.AdamW(model.parameters(), lr=0.01)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for x, y in data:
                    dp.step(x.to(dtype), y, SoftmaxCrossEntropyLoss(), optimizer=opt,
                            accumulate=accumulate)
                dp.synchronize()
            out.append([p.detach().clone() for p in model.parameters()])
        assert all(torch.equal(p, q) for p, q in zip(*out)), dtype


@pytest.mark.parametrize("name", ["SGD", "AdamW"])
def test_rows_counted_on_the_device_with_an_optimizer(monkeypatch, name):
    # Labels on a GPU are counted on the device (here the CPU runs that path): no ignored
    # label gives the blocking step's bits; ignored labels the same within rounding (the
    # gradient is rescaled by the update); all ignored gives torch's NaN loss.
    monkeypatch.setattr(DataParallel, "_count_on_device", True)
    cfg = dict(CONFIGS[0][1]) if name == "SGD" else dict(lr=0.01, max_grad_norm=0.5)
    for ignore in ((), (1, 3)):
        data = batches(5, nan_steps=(2,), ignore_steps=ignore, all_ignored_steps=(4,))
        _, _, la, na, _ = a = train(True, name, cfg, True, 2, "two_shot", data)
        _, _, lb, nb, _ = b = train(False, name, cfg, True, 2, "two_shot", data)
        assert math.isnan(la[4]) and math.isnan(lb[4])
        for p, q in zip(a[0].module.parameters(), b[0].module.parameters()):
            if ignore:
                torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(p, q)
        if ignore:
            assert lb[1] == pytest.approx(la[1], rel=1e-6)
            if name == "AdamW":
                assert nb[1] == pytest.approx(na[1], rel=1e-5)
        else:
            assert all(same(x, y) for x, y in zip(la, lb))


def test_a_nonblocking_optimizer_step_reads_no_tensor_on_the_host():
    # The blocking step reads its records (the test can fail); the non-blocking one with an
    # optimizer makes no host read: no .item(), no nonzero, Adam's step counted on the device.
    for blocking in (True, False):
        model = make_model(True)
        dp = DataParallel(model, ["cpu", "cpu"], blocking=blocking)
        opt = dpcuda.optim.AdamW(groups(model), lr=0.01, max_grad_norm=1.0)
        ops, found = logged_steps(batches(4), lambda x, y: dp.step(
            x, y, SoftmaxCrossEntropyLoss(), optimizer=opt))
        if blocking:
            assert found, ops
        else:
            assert not found, found
            assert ops["reduce_update_"] == 3 and ops["step_status"] == 6


def test_what_a_nonblocking_step_with_an_optimizer_refuses():
    data = batches(1)[0]
    model = make_model(False)
    dp = DataParallel(model, ["cpu", "cpu"], blocking=False)
    with pytest.raises(ValueError, match="needs a dpcuda.optim optimizer"):
        dp.step(*data, torch.nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(
            model.parameters(), lr=0.1))
    opt = dpcuda.optim.Adam(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    # a loss computed on the gathered output reads the device to check its gradient
    with pytest.raises(ValueError, match="computes per replica"):
        dp.step(data[0], torch.nn.functional.one_hot(data[1], 5).float(),
                torch.nn.MSELoss(), optimizer=opt)
    # a pre-hook (it would read .grad, which the fused update never fills)
    handle = opt.register_step_pre_hook(lambda *_: None)
    with pytest.raises(ValueError, match="fused into the reduction"):
        dp.step(*data, torch.nn.CrossEntropyLoss(), optimizer=opt)
    handle.remove()
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))
    assert opt.state == {} or all(float(s["step"]) == 0 for s in opt.state.values())
    dp.step(*data, torch.nn.CrossEntropyLoss(), optimizer=opt)
    dp.synchronize()
    assert not all(torch.equal(p, q) for p, q in zip(before, model.parameters()))


def _update_args(R=2, n=40, adam=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = [torch.randn(n, generator=gen, dtype=torch.float64)] * 1
    p = [p[0].clone() for _ in range(R)]
    g = [torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(R)]
    from dpcuda.parallel.fused_update import shard_range
    bounds = [shard_range(n, R, k, 2) for k in range(R)]
    s1 = [torch.rand(e - b, dtype=torch.float64, generator=gen) * 0.1 for b, e in bounds]
    s2 = [torch.rand(e - b, dtype=torch.float64, generator=gen) * 0.01 for b, e in bounds]
    h = dpcuda.optim.AdamW([torch.zeros(1)], lr=0.01)._values(
        {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
         "maximize": False, "amsgrad": False, "decoupled_weight_decay": True}, 3.0)
    hyper = [torch.tensor(h, dtype=torch.float64)] * R
    return p, g, s1, s2, hyper


def test_reduce_update_obeys_status_records():
    records = lambda nan, rows: [torch.tensor([0.5, float(nan), 0.0, rows], dtype=torch.float64),
                                 torch.tensor([0.25, 0.0, 0.0, 0.0], dtype=torch.float64)]
    # skip: nothing written, the norm NaN, the loss written
    p, g, s1, s2, hyper = _update_args()
    before = [t.clone() for t in p + s1 + s2]
    norm, loss = torch.zeros(1, dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    torch.ops.dpcuda.reduce_update_(p, g, s1, s2, [], hyper, [0, 40, 0], "adam", False,
                                    "two_shot", True, 1.0, norm, records(1, 24.0), 24.0, loss)
    assert all(torch.equal(a, b) for a, b in zip(before, p + s1 + s2))
    assert math.isnan(norm.item()) and loss.item() == 0.75
    # a fix of 24 / 17: the reduced gradient (rounded) times the fix, then clipped and applied
    for algorithm in ("one_shot", "two_shot", "ring"):
        p, g, s1, s2, hyper = _update_args(seed=1)
        q, h2, t1, t2, _ = _update_args(seed=1)
        reduced = (g[0] + g[1]) * (24.0 / 17.0)
        norm_a, norm_b = torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
        torch.ops.dpcuda.reduce_update_(p, g, s1, s2, [], hyper, [0, 40, 0], "adam", False,
                                        algorithm, True, 1.0, norm_a, records(0, 17.0), 24.0,
                                        loss)
        torch.ops.dpcuda.reduce_update_(q, [reduced, torch.zeros(40, dtype=torch.float64)],
                                        t1, t2, [], hyper, [0, 40, 0], "adam", False, algorithm,
                                        True, 1.0, norm_b)
        assert all(torch.equal(a, b) for a, b in zip(p + s1 + s2, q + t1 + t2)), algorithm
        assert torch.equal(norm_a, norm_b)
        assert loss.item() == 0.75 * (24.0 / 17.0)
    with pytest.raises(ValueError, match="status must be empty or hold one step_status record"):
        torch.ops.dpcuda.reduce_update_(p, g, s1, s2, [], hyper, [0, 40, 0], "adam", False,
                                        "two_shot", True, None, None, records(0, 1.0)[:1])
    with pytest.raises(ValueError, match="loss_out shares memory with state1"):
        torch.ops.dpcuda.reduce_update_(p, g, s1, s2, [], hyper, [0, 40, 0], "adam", False,
                                        "two_shot", True, None, None, records(0, 1.0), 0.0,
                                        s1[0][:1].reshape(()))


def test_a_skipped_first_sgd_step_leaves_torchs_state_and_the_own_step_continues_it():
    # The device skipped the first update: torch's SGD would hold no momentum buffer, and the
    # optimizer's own step() (a pre-hook makes the DataParallel step take it) must begin
    # momentum as torch does, after which the fused non-blocking steps continue it. The
    # oracle runs the same steps without the skipped one.
    data = batches(5, nan_steps=(0,))
    cfg = dict(lr=0.1, momentum=0.9, dampening=0.1)
    out = []
    for with_skip in (True, False):
        model = make_model(True)
        nb = DataParallel(model, ["cpu"] * 2, blocking=False)
        opt = dpcuda.optim.SGD(groups(model), **cfg)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if with_skip:
                nb.step(*data[0], SoftmaxCrossEntropyLoss(), optimizer=opt)
                nb.synchronize()
                assert nb.skipped_steps == 1
                # as torch's after no update: no momentum buffer
                assert all(not s for s in opt.state_dict()["state"].values())
            blocking = DataParallel(model, ["cpu"] * 2)
            handle = opt.register_step_pre_hook(lambda *args: None)
            for x, y in data[1:3]:
                blocking.step(x, y, SoftmaxCrossEntropyLoss(), optimizer=opt)
            handle.remove()
            for x, y in data[3:]:
                nb.step(x, y, SoftmaxCrossEntropyLoss(), optimizer=opt)
            nb.synchronize()
        out.append(([p.detach().clone() for p in model.parameters()],
                    [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]))
    (wa, ma), (wb, mb) = out
    assert all(torch.equal(a, b) for a, b in zip(wa, wb))
    assert all(torch.equal(a, b) for a, b in zip(ma, mb))


def test_the_optimizers_own_step_makes_the_fused_plan_bind_again():
    # After the optimizer's own step (here: a step whose forward leaves a parameter unused,
    # which takes opt.step()), the plan's cached reading of the state (one step count per
    # group, read once on a GPU) is dropped; the next fused step reads it again and, the
    # counts now differing in a group, takes the conventional path, as torch's would.
    class Skippy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(3)
            self.a = torch.nn.Linear(12, 5)
            self.b = torch.nn.Linear(12, 5)
            self.use_b = True

        def forward(self, x):
            return self.a(x) + (self.b(x) if self.use_b else 0)

    model = Skippy()
    dp = DataParallel(model, ["cpu"] * 2)
    opt = dpcuda.optim.Adam(model.parameters(), lr=0.01)
    data = batches(3)
    dp.step(*data[0], torch.nn.CrossEntropyLoss(), optimizer=opt)
    plan = dp._fused_update._plan
    assert plan.bound and plan.is_uniform
    model.use_b = False
    dp.step(*data[1], torch.nn.CrossEntropyLoss(), optimizer=opt)  # opt.step(): b unused
    assert not plan.bound
    model.use_b = True
    assert not dp._fused_update.ready(opt, dp._replicas, set(), dp._set.generation)
    assert [float(opt.state[p]["step"]) for p in model.parameters()] == [2, 2, 1, 1]
