"""DataParallel.step(..., accumulate=k): each replica's rows in k micro-batches, the gradients
summed on the replica, one reduction and one update, against torch on one device training the
whole batch (float64: agreement to rounding, as the micro-batches sum the gradient in another
order than one GEMM)."""

import pytest
import torch
from torch import nn

import dpcuda.optim
from dpcuda.nn import FusedMLP, SoftmaxCrossEntropyLoss
from dpcuda.parallel import DataParallel


def close(a, b, rtol=1e-11, atol=1e-13):
    return torch.allclose(a, b, rtol=rtol, atol=atol)


class Partly(nn.Module):
    """An MLP with a layer its forward never uses (no gradient: torch's optimizers skip it)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 11), nn.Tanh(), nn.Linear(11, 4))
        self.spare = nn.Linear(3, 3)

    def forward(self, x):
        return self.body(x)


def _data(steps, rows, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 6, generator=g, dtype=torch.float64),
             torch.randint(0, 4, (rows,), generator=g)) for _ in range(steps)]


def _torch_run(make, opt_fn, data, loss_fn):
    model = make()
    opt = opt_fn(model.parameters()) if opt_fn else torch.optim.SGD(
        model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return model, losses


OPTIMIZERS = {
    "wrapper SGD": None,
    "dpcuda AdamW": lambda ps: dpcuda.optim.AdamW(ps, lr=0.01, weight_decay=0.05),
    "dpcuda SGD": lambda ps: dpcuda.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "torch Adam": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
}


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("replicas,accumulate,rows", [(1, 3, 19), (2, 2, 20), (3, 4, 17),
                                                      (2, 8, 9)])
def test_accumulated_micro_batches_train_what_one_device_trains(opt_name, replicas, accumulate,
                                                                rows):
    def make():
        torch.manual_seed(7)
        return Partly().double()
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    data = _data(3, rows)
    opt_fn = OPTIMIZERS[opt_name]
    ref, ref_losses = _torch_run(make, opt_fn, data, loss_fn)
    model = make()
    dp = DataParallel(model, ["cpu"] * replicas, lr=0.05, momentum=0.9)
    opt = opt_fn(dp.parameters()) if opt_fn else None
    losses = [dp.step(x, y, loss_fn, optimizer=opt, accumulate=accumulate) for x, y in data]
    for a, b in zip(model.parameters(), ref.parameters()):
        assert close(a, b), (a - b).abs().max()
    assert all(abs(a - b) <= 1e-12 * abs(b) for a, b in zip(losses, ref_losses))
    # the layer no micro-batch used is left alone, as torch's optimizers leave it
    assert torch.equal(model.spare.weight, make().spare.weight)
    for r in dp.replicas[1:]:
        for a, b in zip(r.parameters(), model.parameters()):
            assert torch.equal(a, b)


def test_fused_layers_and_the_fused_update_accumulate_as_torch():
    # FusedMLP (its backward writes into the gradient buffer for the first micro-batch; later
    # ones add) with dpcuda's AdamW fused into the reduction.
    torch.manual_seed(2)
    model = FusedMLP([6, 13, 4]).double()
    ref = nn.Sequential(nn.Linear(6, 13), nn.ReLU(), nn.Linear(13, 4)).double()
    ref.load_state_dict(_as_sequential(model))
    topt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    dp = DataParallel(model, ["cpu"] * 3, algorithm="two_shot")
    opt = dpcuda.optim.AdamW(dp.parameters(), lr=0.01)
    for x, y in _data(4, 23, seed=9):
        loss = dp.step(x, y, SoftmaxCrossEntropyLoss(), optimizer=opt, accumulate=3)
        topt.zero_grad()
        want = nn.functional.cross_entropy(ref(x), y)
        want.backward()
        topt.step()
        assert abs(loss - float(want.detach())) <= 1e-12 * abs(float(want.detach()))
    assert dp._fused_update._key is not None  # (the fused reduce-update ran)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert close(a, b)
    assert all(p.grad is None for p in model.parameters())


def _as_sequential(model):
    state = model.state_dict()
    names = list(state)
    ref_names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert len(names) == 4, names
    return dict(zip(ref_names, state.values()))


def test_accumulate_1_is_the_step_it_was():
    def run(**kw):
        torch.manual_seed(4)
        model = Partly().double()
        dp = DataParallel(model, ["cpu"] * 2, lr=0.05, momentum=0.9)
        for x, y in _data(2, 12):
            dp.step(x, y, nn.CrossEntropyLoss(), **kw)
        return model
    for a, b in zip(run().parameters(), run(accumulate=1).parameters()):
        assert torch.equal(a, b)


def test_accumulate_runs_micro_batches_one_after_another():
    # Each micro-batch's forward sees its rows only (the activations of 1/k of the batch).
    seen = []
    torch.manual_seed(1)
    model = Partly().double()
    model.body[0].register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    dp = DataParallel(model, ["cpu"] * 2)
    x, y = _data(1, 22)[0]
    dp.step(x, y, nn.CrossEntropyLoss(), accumulate=3)
    assert sorted(seen) == sorted([4, 4, 3, 4, 4, 3])


@pytest.mark.parametrize("bad,error", [(0, ValueError), (-2, ValueError), (1.5, TypeError),
                                       (True, TypeError), ("2", TypeError),
                                       (torch.tensor(2.0), TypeError)])
def test_a_bad_accumulate_is_refused_by_name(bad, error):
    dp = DataParallel(Partly().double(), ["cpu"] * 2)
    x, y = _data(1, 8)[0]
    before = [p.clone() for p in dp.parameters()]
    with pytest.raises(error, match="accumulate"):
        dp.step(x, y, nn.CrossEntropyLoss(), accumulate=bad)
    assert all(torch.equal(a, b) for a, b in zip(before, dp.parameters()))


def test_accumulate_needs_a_per_replica_loss():
    dp = DataParallel(Partly().double(), ["cpu"] * 2)
    x, _ = _data(1, 8)[0]
    before = [p.clone() for p in dp.parameters()]
    with pytest.raises(ValueError, match="accumulate > 1 needs a loss"):
        dp.step(x, torch.randn(8, 4, dtype=torch.float64), nn.MSELoss(), accumulate=2)
    assert all(torch.equal(a, b) for a, b in zip(before, dp.parameters()))


def test_accumulate_refuses_synchronised_batch_norm():
    model = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 4)).double()
    dp = DataParallel(model, ["cpu"] * 2, buffers="sync")
    x, y = _data(1, 8)[0]
    with pytest.raises(ValueError, match="buffers='sync'"):
        dp.step(x, y, nn.CrossEntropyLoss(), accumulate=2)


@pytest.mark.parametrize("loss_fn", [nn.CrossEntropyLoss(), SoftmaxCrossEntropyLoss()],
                         ids=["torch", "dpcuda"])
def test_a_bad_label_in_a_later_micro_batch_raises_and_changes_nothing(loss_fn):
    torch.manual_seed(5)
    model = Partly().double()
    dp = DataParallel(model, ["cpu"] * 2)
    x, y = _data(1, 16)[0]
    y[13] = 9
    before = [p.clone() for p in model.parameters()]
    # (torch's loss raises its own message; dpcuda's names the position in the whole batch)
    match = "out of bounds" if isinstance(loss_fn, nn.CrossEntropyLoss) else "13"
    with pytest.raises((IndexError, ValueError), match=match):
        dp.step(x, y, loss_fn, accumulate=4)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # and the next step runs as if nothing had happened
    y[13] = 1
    ref = Partly().double()
    ref.load_state_dict(model.state_dict())
    dp.step(x, y, loss_fn, accumulate=4)
    nn.functional.cross_entropy(ref(x), y).backward()
    with torch.no_grad():
        for p in ref.body.parameters():
            p -= 0.01 * p.grad
    for a, b in zip(model.body.parameters(), ref.body.parameters()):
        assert close(a, b)


def test_the_clis_step_accumulates_and_clips_inside_the_fused_step():
    # train_step: the optimizer made with max_grad_norm=--clip-grad-norm, and every step
    # dp.step(..., accumulate=--accumulate): what torch trains on one device with the whole
    # batch, clip_grad_norm_ and AdamW.
    import types

    from dpcuda.train_step import OptimizerStep, make_optimizer

    cfg = types.SimpleNamespace(clip_grad_norm=0.05, accumulate=3, optimizer="adamw", lr=0.01,
                                weight_decay=0.02, momentum=0.0)
    torch.manual_seed(8)
    # (every parameter used: a parameter no replica uses takes the unfused path)
    model = Partly().body.double()
    ref = Partly().body.double()
    ref.load_state_dict(model.state_dict())
    dp = DataParallel(model, ["cpu"] * 2)
    opt = make_optimizer(cfg, dp.parameters())
    assert opt.max_grad_norm == 0.05
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    step = OptimizerStep(dp, opt, sched, nn.CrossEntropyLoss(), cfg)
    calls = []
    original = dp.step
    dp.step = lambda *a, **kw: calls.append(kw.get("accumulate")) or original(*a, **kw)
    topt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.02)
    for x, y in _data(3, 20):
        loss, skipped = step(x, y)
        topt.zero_grad()
        want = nn.functional.cross_entropy(ref(x), y)
        want.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        topt.step()
        assert not skipped and abs(loss - float(want.detach())) <= 1e-12
        assert float(norm) > 0.05  # (the clipping was active)
        assert torch.allclose(opt.grad_norm, norm, rtol=1e-12)
    assert calls == [3, 3, 3]
    assert dp._fused_update._key is not None
    for a, b in zip(model.parameters(), ref.parameters()):
        assert close(a, b, 1e-10, 1e-12)


def test_accumulate_takes_any_integer_and_refuses_gradient_hooks():
    import numpy as np
    torch.manual_seed(6)
    model = Partly().double()
    dp = DataParallel(model, ["cpu"])
    x, y = _data(1, 12)[0]
    dp.step(x, y, nn.CrossEntropyLoss(), accumulate=np.int64(3))
    # a parameter hook would see each micro-batch's gradient, not torch's running sum
    model.body[0].weight.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(ValueError, match="gradient hooks"):
        dp.step(x, y, nn.CrossEntropyLoss(), accumulate=2)
    dp.step(x, y, nn.CrossEntropyLoss())  # (one micro-batch: the hook sees the gradient)


def test_a_failed_step_leaves_no_partial_grad():
    torch.manual_seed(5)
    model = Partly().double()
    dp = DataParallel(model, ["cpu"] * 2)
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    x, y = _data(1, 16)[0]
    dp.step(x, y, nn.CrossEntropyLoss(), optimizer=opt)
    y = y.clone()
    y[13] = 9  # a bad label in the last micro-batch of the second replica
    with pytest.raises((IndexError, ValueError)):
        dp.step(x, y, nn.CrossEntropyLoss(), optimizer=opt, accumulate=3)
    assert all(p.grad is None for r in dp.replicas for p in r.parameters())


def test_a_parameter_frozen_after_a_step_is_not_updated_again():
    # The unfused path leaves .grad on the model; a parameter frozen afterwards must not be
    # stepped with that old gradient at the next step (torch's loop would not).
    torch.manual_seed(5)
    model = Partly().double()
    dp = DataParallel(model, ["cpu"] * 2)
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)  # (torch's: the unfused path)
    x, y = _data(1, 16)[0]
    dp.step(x, y, nn.CrossEntropyLoss(), optimizer=opt)
    assert model.body[0].weight.grad is not None
    model.body[0].weight.requires_grad_(False)
    frozen = model.body[0].weight.clone()
    dp.step(x, y, nn.CrossEntropyLoss(), optimizer=opt)
    assert torch.equal(model.body[0].weight, frozen)
