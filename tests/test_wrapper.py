"""DataParallel as a wrapper (#23): the user's own loop, against the same loop on one device.

Every test trains a model with DataParallel over CPU replicas and a copy of it on one device
with the same torch optimizer, and compares (float64: 1e-10; float32: 1e-5; bfloat16: 2e-2).
"""
import copy
import dataclasses
import functools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dpcuda.nn import FusedLinear, fuse
from dpcuda.parallel import DataParallel, ReplicaError

TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def mlp(dtype=torch.float64, seed=0, dropout=False):
    torch.manual_seed(seed)
    layers = [nn.Linear(6, 9), nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(0.5))
    layers += [nn.Linear(9, 4)]
    return nn.Sequential(*layers).to(dtype)


def data(steps, rows=10, dtype=torch.float64, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 6, generator=gen).to(dtype), torch.randint(0, 4, (rows,),
                                                                          generator=gen))
            for _ in range(steps)]


def close(a, b, dtype, what=""):
    tol = TOL[dtype]
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol, msg=what)


def same_models(got, want, dtype):
    for (name, a), b in zip(got.named_parameters(), want.parameters()):
        close(a, b, dtype, name)
    for (name, a), b in zip(got.named_buffers(), want.buffers()):
        close(a.double(), b.double(), dtype, name)


def replicas_identical(dp):
    for rep in dp.replicas[1:]:
        for (name, a), b in zip(rep.named_parameters(), dp.module.parameters()):
            assert torch.equal(a, b), name
            if b.grad is not None:
                assert torch.equal(a.grad, b.grad), name


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5),
}


def run_loop(model, steps, make_opt, accumulate=1, clip=None, sched=True, wrap=None):
    """The README's loop: OneCycleLR, optional clipping, micro-batches accumulated."""
    net = wrap(model) if wrap else model
    opt = make_opt(net.parameters())
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=opt.param_groups[0]["lr"] * 3, total_steps=len(steps)) if sched else None
    losses, norms = [], []
    for x, y in steps:
        for xs, ys in zip(x.chunk(accumulate), y.chunk(accumulate)):
            loss = F.cross_entropy(net(xs), ys) / accumulate
            loss.backward()
            losses.append(float(loss.detach()))
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip or 1e9)))
        opt.step()
        if scheduler is not None:
            scheduler.step()
        opt.zero_grad()
    return net, losses, norms


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_users_loop_trains_what_one_device_trains(replicas, opt, accumulate):
    steps = data(4, rows=10)
    model = mlp()
    want, want_losses, want_norms = run_loop(copy.deepcopy(model), steps, OPTIMIZERS[opt],
                                             accumulate, clip=0.5)
    dp, losses, norms = run_loop(model, steps, OPTIMIZERS[opt], accumulate, clip=0.5,
                                 wrap=lambda m: DataParallel(m, ["cpu"] * replicas))
    assert dp.module is model  # trained in place
    same_models(model, want, torch.float64)
    torch.testing.assert_close(losses, want_losses, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(norms, want_norms, rtol=1e-10, atol=1e-12)
    replicas_identical(dp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot", "ring"])
@pytest.mark.parametrize("reducer", ["p2p", "host"])
def test_dtypes_algorithms_reducers_and_uneven_splits(dtype, algorithm, reducer):
    steps = data(3, rows=7, dtype=dtype)
    model = mlp(dtype)
    want, _, _ = run_loop(copy.deepcopy(model), steps, OPTIMIZERS["adamw"])
    dp, _, _ = run_loop(model, steps, OPTIMIZERS["adamw"], wrap=lambda m: DataParallel(
        m, ["cpu"] * 3, reducer=reducer, algorithm=algorithm, split="weighted",
        split_weights=[1, 0, 3]))
    same_models(model, want, dtype)
    replicas_identical(dp)


def test_grad_after_backward_is_the_one_device_gradient_on_every_replica():
    model, (x, y) = mlp(), data(1)[0]
    one = copy.deepcopy(model)
    F.cross_entropy(one(x), y).backward()
    dp = DataParallel(model, ["cpu"] * 3)
    F.cross_entropy(dp(x), y).backward()
    for a, b in zip(model.parameters(), one.parameters()):
        close(a.grad, b.grad, torch.float64)
    replicas_identical(dp)
    # A second backward without zero_grad accumulates, as on one device.
    F.cross_entropy(one(x * 2), y).backward()
    F.cross_entropy(dp(x * 2), y).backward()
    for a, b in zip(model.parameters(), one.parameters()):
        close(a.grad, b.grad, torch.float64)


def test_no_sync_defers_the_reduction_exactly():
    model, steps = mlp(), data(3)
    one = copy.deepcopy(model)
    dp = DataParallel(model, ["cpu"] * 2)
    for x, y in steps:
        F.cross_entropy(one(x), y).backward()
    with dp.no_sync():
        for x, y in steps[:2]:
            F.cross_entropy(dp(x), y).backward()
    # Inside no_sync each replica's .grad is its own accumulation (DDP's): not the global one.
    F.cross_entropy(dp(steps[2][0]), steps[2][1]).backward()
    for a, b in zip(model.parameters(), one.parameters()):
        close(a.grad, b.grad, torch.float64)
    replicas_identical(dp)


def test_changing_grad_between_no_sync_passes_raises():
    model, (x, y) = mlp(), data(1)[0]
    dp = DataParallel(model, ["cpu"] * 2)
    with dp.no_sync():
        F.cross_entropy(dp(x), y).backward()
        for p in model.parameters():
            p.grad.mul_(2)
        with pytest.raises(RuntimeError, match="changed between backward passes under no_sync"):
            F.cross_entropy(dp(x), y).backward()


# ---------------------------------------------------------------------------------------------
# changes made after wrapping

def _loop_with(change, replicas=3, steps=4, dropout=False):
    """Trains model with DataParallel and its copy on one device, applying change(model, step)
    to both before each step."""
    model = mlp(dropout=dropout)
    one = copy.deepcopy(model)
    dp = DataParallel(model, ["cpu"] * replicas)
    for net in (dp, one):
        target = net.module if net is dp else net
        opt = torch.optim.SGD(target.parameters(), lr=0.1, momentum=0.9)
        for s, (x, y) in enumerate(data(steps)):
            change(target, s)
            opt.param_groups[0]["params"] = [p for p in target.parameters()]
            torch.manual_seed(s)
            F.cross_entropy(net(x), y).backward()
            opt.step()
            opt.zero_grad()
    same_models(model, one, torch.float64)
    replicas_identical(dp)
    return dp


def test_freezing_and_unfreezing_after_wrapping():
    def change(m, s):
        m[0].weight.requires_grad_(s not in (1, 2))
    _loop_with(change)


def test_load_state_dict_and_in_place_edits_after_wrapping():
    state = copy.deepcopy(mlp(seed=5).state_dict())

    def change(m, s):
        if s == 1:
            m.load_state_dict(state)
        if s == 2:
            with torch.no_grad():
                m[2].weight.mul_(0.5)
        if s == 3:
            m[2].bias.data.add_(0.25)  # through .data: no version bump
    _loop_with(change)


def test_a_parameter_given_other_strides_over_its_storage():
    # (the same data pointer and shape, another weight: p.data = p.data.t() on a square one)
    def change(m, s):
        w = m[s % 2 * 2].weight
        if s in (1, 2):
            w.data = w.data.as_strided(w.shape, (1, w.shape[0]))
        if s == 3:
            m[0].weight.data = m[0].weight.data.t().contiguous().t()
    _loop_with(change, steps=5)


def test_eval_mode_and_dropout_follow_the_model():
    # In eval mode dropout is off on every replica (in train mode half the values would be 0).
    model = mlp(dropout=True)
    dp = DataParallel(model, ["cpu"] * 2)
    x, _ = data(1)[0]
    model.eval()
    with torch.no_grad():
        close(dp(x), model(x), torch.float64)
    assert all(not m.training for rep in dp.replicas for m in rep.modules())
    dp.train()
    assert model.training and all(m.training for rep in dp.replicas for m in rep.modules())


def test_a_replaced_parameter_or_module_and_a_new_parameter():
    def change(m, s):
        if s == 1:
            m[0].weight = nn.Parameter(m[0].weight.detach() * 0.9)
        if s == 2:
            m[1] = nn.Tanh()
        if s == 3:
            m[2].register_parameter("extra", nn.Parameter(torch.zeros(1, dtype=torch.float64)))
    _loop_with(change)


def test_a_fused_torch_optimizer_moves_the_weights_without_a_version_bump():
    steps = data(3)
    model = mlp()
    want, _, _ = run_loop(copy.deepcopy(model), steps, OPTIMIZERS["adamw_fused"])
    dp, _, _ = run_loop(model, steps, OPTIMIZERS["adamw_fused"],
                        wrap=lambda m: DataParallel(m, ["cpu"] * 2))
    same_models(model, want, torch.float64)


def test_a_parameter_added_on_a_replica_raises():
    model, (x, y) = mlp(), data(1)[0]
    dp = DataParallel(model, ["cpu"] * 2)
    dp(x)
    dp._set.replicas[1].module[0].register_parameter("p", nn.Parameter(torch.zeros(1)))
    with pytest.raises(ReplicaError, match="make the change on dp.module"):
        dp(x)


def test_embedding_max_norm_and_sparse_are_refused():
    class Net(nn.Module):
        def __init__(self, **kw):
            super().__init__()
            self.emb = nn.Embedding(10, 4, **kw)
            self.out = nn.Linear(4, 3)

        def forward(self, i):
            return self.out(self.emb(i))
    ids = torch.randint(0, 10, (8,))
    with pytest.raises(ValueError, match=r"emb is an nn.Embedding\(max_norm=1.0\)"):
        DataParallel(Net(max_norm=1.0), ["cpu"] * 2)
    DataParallel(Net(max_norm=1.0), ["cpu"])(ids)  # one replica: the model itself
    with pytest.raises(ValueError, match=r"emb is an nn.Embedding\(sparse=True\)"):
        DataParallel(Net(sparse=True), ["cpu"] * 2)
    dp = DataParallel(Net(), ["cpu"] * 2)
    dp.module.emb.max_norm = 2.0  # after wrapping: refused at the next forward
    with pytest.raises(ValueError, match="max_norm=2.0"):
        dp(ids)


# ---------------------------------------------------------------------------------------------
# hooks

def test_parameter_hooks_see_the_one_device_gradient_or_are_refused():
    model, (x, y) = mlp(), data(1)[0]
    seen = []
    model[0].weight.register_hook(lambda g: seen.append(g.clone()))
    one = copy.deepcopy(model)
    dp = DataParallel(model, ["cpu"])  # one replica: the model's own backward
    F.cross_entropy(dp(x), y).backward()
    F.cross_entropy(one(x), y).backward()
    close(seen[0], one[0].weight.grad, torch.float64)
    dp2 = DataParallel(mlp(), ["cpu"] * 2)
    dp2.module[2].bias.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(ValueError, match=r"parameter '2.bias' has a gradient hook"):
        dp2(x)


def test_module_hooks_fire_on_every_replica_with_its_rows():
    model, (x, y) = mlp(), data(1, rows=9)[0]
    rows = []
    model[0].register_forward_hook(lambda m, i, o: rows.append(o.shape[0]))
    DataParallel(model, ["cpu"] * 3)(x)
    assert sorted(rows) == [3, 3, 3]


# ---------------------------------------------------------------------------------------------
# inputs and outputs

@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: torch.Tensor
    note: str = "kept"


class Multi(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.a = nn.Linear(6, 5).double()
        self.b = nn.Linear(5, 4).double()

    def forward(self, x, *, scale=1.0, extra=None):
        h = torch.tanh(self.a(x * scale + (extra["shift"] if extra else 0)))
        out = self.b(h)
        if self.kind == "tuple":
            return out, h
        if self.kind == "dict":
            return {"logits": out, "hidden": h}
        return Out(out, h)


@pytest.mark.parametrize("kind", ["tuple", "dict", "dataclass"])
def test_models_returning_tuples_dicts_and_dataclasses(kind):
    torch.manual_seed(0)
    model = Multi(kind)
    one = copy.deepcopy(model)
    (x, y), = data(1, rows=7)
    shift = torch.randn(7, 6, dtype=torch.float64)
    dp = DataParallel(model, ["cpu"] * 3)

    def loss_of(out):
        logits, h = (out if kind == "tuple" else (out["logits"], out["hidden"]) if kind == "dict"
                     else (out.logits, out.hidden))
        return F.cross_entropy(logits, y) + h.pow(2).mean()
    got = dp(x, scale=2.0, extra={"shift": shift})
    want = one(x, scale=2.0, extra={"shift": shift})
    if kind == "dataclass":
        assert got.note == "kept"
    loss_of(got).backward()
    loss_of(want).backward()
    for a, b in zip(model.parameters(), one.parameters()):
        close(a.grad, b.grad, torch.float64)


# ---------------------------------------------------------------------------------------------
# losses in the convenience step

class MyCE(nn.CrossEntropyLoss):
    def forward(self, input, target):
        return super().forward(input, target) + 0.1 * input.pow(2).mean()


LOSSES = {
    "ce": lambda: nn.CrossEntropyLoss(),
    "ce_weight": lambda: nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5, 3.0],
                                                                 dtype=torch.float64)),
    "ce_sum": lambda: nn.CrossEntropyLoss(reduction="sum"),
    "partial_ignore": lambda: functools.partial(F.cross_entropy, ignore_index=0),
    "nll_ignore": lambda: (lambda out, y: F.nll_loss(F.log_softmax(out, 1), y, ignore_index=0)),
    "subclass": lambda: MyCE(),
    "mse": lambda: (lambda out, y: F.mse_loss(out, F.one_hot(y, 4).to(out.dtype))),
}


class LogSoftmaxNLL(nn.Module):
    def __init__(self):
        super().__init__()
        self.nll = nn.NLLLoss(ignore_index=0)

    def forward(self, out, y):
        return self.nll(F.log_softmax(out, 1), y)


LOSSES["NLLLoss"] = LogSoftmaxNLL


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_step_gives_the_one_device_result_for_every_loss(loss, replicas):
    model, steps = mlp(), data(3)
    one = copy.deepcopy(model)
    opt = torch.optim.SGD(one.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    dp = DataParallel(model, ["cpu"] * replicas, lr=0.1, momentum=0.9, weight_decay=1e-3)
    loss_fn = LOSSES[loss]()
    for x, y in steps:
        got = dp.step(x, y, loss_fn)
        want = loss_fn(one(x), y)
        want.backward()
        opt.step()
        opt.zero_grad()
        want = float(want.detach())
        assert abs(got - want) <= 1e-10 * (1 + abs(want))
    same_models(model, one, torch.float64)
    replicas_identical(dp)


def test_fused_step_leaves_grad_none_and_the_gathered_step_the_global_gradient():
    model, (x, y) = mlp(), data(1)[0]
    dp = DataParallel(model, ["cpu"] * 2, lr=0.1)
    dp.step(x, y, nn.CrossEntropyLoss())
    assert all(p.grad is None for p in model.parameters())
    one = copy.deepcopy(model)
    F.mse_loss(one(x), torch.zeros(10, 4, dtype=torch.float64)).backward()
    dp.step(x, torch.zeros(10, 4, dtype=torch.float64), F.mse_loss)
    for a, b in zip(model.parameters(), one.parameters()):
        close(a.grad, b.grad, torch.float64)


# ---------------------------------------------------------------------------------------------
# smaller gaps

def test_hyperparameters_can_be_set_and_are_saved():
    model, (x, y) = mlp(), data(1)[0]
    dp = DataParallel(model, ["cpu"] * 2, lr=0.1)
    dp.momentum = 0.9  # from none: buffers made as torch.optim.SGD makes them, lazily
    dp.lr = 0.05
    with pytest.raises(ValueError, match="momentum must be a non-negative finite number"):
        dp.momentum = float("nan")
    one = copy.deepcopy(model)
    opt = torch.optim.SGD(one.parameters(), lr=0.05, momentum=0.9)
    for _ in range(2):
        dp.step(x, y, F.cross_entropy)
        F.cross_entropy(one(x), y).backward()
        opt.step()
        opt.zero_grad()
    same_models(model, one, torch.float64)
    state = dp.optimizer_state_dict()
    other = DataParallel(mlp(), ["cpu"], lr=1.0)
    other.load_optimizer_state_dict(state)
    assert (other.lr, other.momentum, other.weight_decay) == (0.05, 0.9, 0.0)
    with pytest.raises(ValueError, match="lr must be"):
        other.load_optimizer_state_dict({**state, "lr": -1.0})
    assert other.lr == 0.05


def test_fused_linear_takes_nn_linears_argument_name():
    layer = FusedLinear(3, 2, activation="none").double()
    x = torch.randn(4, 3, dtype=torch.float64)
    torch.testing.assert_close(layer(input=x), layer(x))


def test_dp_is_a_module_wrapping_the_model():
    model = mlp()
    dp = DataParallel(model, ["cpu"] * 2)
    assert isinstance(dp, nn.Module) and dp.module is model
    assert [id(p) for p in dp.parameters()] == [id(p) for p in model.parameters()]
    assert dp.state_dict().keys() == model.state_dict().keys()
    dp.eval()
    assert not model.training


def test_an_optimizer_made_before_wrapping_still_trains_the_model():
    model, steps = mlp(), data(2)
    one = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    dp = DataParallel(model, ["cpu"] * 2)
    ref = torch.optim.Adam(one.parameters(), lr=1e-2)
    for x, y in steps:
        F.cross_entropy(dp(x), y).backward()
        opt.step()
        opt.zero_grad()
        F.cross_entropy(one(x), y).backward()
        ref.step()
        ref.zero_grad()
    same_models(model, one, torch.float64)


def test_no_grad_forward_and_batches_smaller_than_the_replicas():
    model = mlp()
    dp = DataParallel(model, ["cpu"] * 4)
    x = torch.randn(2, 6, dtype=torch.float64)
    with torch.no_grad():
        close(dp(x), model(x), torch.float64)
    y = torch.tensor([1, 2])
    one = copy.deepcopy(model)
    F.cross_entropy(dp(x), y).backward()
    F.cross_entropy(one(x), y).backward()
    for a, b in zip(model.parameters(), one.parameters()):
        close(a.grad, b.grad, torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dp(x).shape == (2, 4)


def test_zero_grad_between_no_sync_passes_starts_the_accumulation_again():
    model, steps = mlp(), data(3)
    one = copy.deepcopy(model)
    dp = DataParallel(model, ["cpu"] * 3)
    with dp.no_sync():
        F.cross_entropy(dp(steps[0][0]), steps[0][1]).backward()
    dp.zero_grad()  # set_to_none: every replica's accumulation is dropped
    with dp.no_sync():
        F.cross_entropy(dp(steps[1][0]), steps[1][1]).backward()
    F.cross_entropy(dp(steps[2][0]), steps[2][1]).backward()
    for x, y in steps[1:]:
        F.cross_entropy(one(x), y).backward()
    for a, b in zip(model.parameters(), one.parameters()):
        close(a.grad, b.grad, torch.float64)
    replicas_identical(dp)


def test_zero_grad_in_place_after_a_reduction_and_unused_parameters():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(6, 4).double(), nn.Linear(6, 4).double()

        def forward(self, x):
            return self.used(x)
    torch.manual_seed(0)
    model, steps = Net(), data(2)
    one = copy.deepcopy(model)
    dp = DataParallel(model, ["cpu"] * 2)
    for x, y in steps:
        for net in (dp, one):
            for p in net.parameters():
                if p.grad is not None:
                    p.grad.zero_()  # zero_grad(set_to_none=False)
            F.cross_entropy(net(x), y).backward()
        for a, b in zip(model.parameters(), one.parameters()):
            assert (a.grad is None) == (b.grad is None)
            if b.grad is not None:
                close(a.grad, b.grad, torch.float64)
    assert model.unused.weight.grad is None


def test_a_model_moved_off_devices_0_raises_and_a_dtype_change_is_followed():
    model, (x, y) = mlp(), data(1)[0]
    dp = DataParallel(model, ["cpu"] * 2)
    model.to("meta")
    with pytest.raises(ValueError, match=r"tensor on meta; the model is replica 0 and stays on "
                                         r"devices\[0\] \(cpu\)"):
        dp(x)
    model = mlp()
    dp = DataParallel(model, ["cpu"] * 2)
    model.float()
    one = copy.deepcopy(model)
    F.cross_entropy(dp(x.float()), y).backward()
    F.cross_entropy(one(x.float()), y).backward()
    for a, b in zip(model.parameters(), one.parameters()):
        assert a.grad.dtype == torch.float32
        close(a.grad, b.grad, torch.float32)


def test_the_readme_quickstart_runs_as_written():
    import pathlib
    import re
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    loop = [b for b in blocks if "DataParallel(" in b and "opt.zero_grad()" in b]
    assert loop, "no conventional DataParallel loop in the README's quickstart"
    scope = {}
    exec(compile(loop[0], "README.md quickstart", "exec"), scope)
    dp, model = scope["dp"], scope["model"]
    assert dp.module is model and all(p.grad is None for p in model.parameters())
    for rep in dp.replicas[1:]:
        for a, b in zip(rep.parameters(), model.parameters()):
            assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# what a review found (each a silently wrong result before it was fixed)

def test_a_backward_that_fails_does_not_stop_later_reductions():
    model, (x, y) = mlp(), data(1)[0]
    dp = DataParallel(model, ["cpu"] * 3)

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        F.cross_entropy(Boom.apply(dp(x)), y).backward()
    dp.zero_grad()
    one = copy.deepcopy(model)
    F.cross_entropy(dp(x), y).backward()
    F.cross_entropy(one(x), y).backward()
    for a, b in zip(model.parameters(), one.parameters()):
        close(a.grad, b.grad, torch.float64)
    replicas_identical(dp)


def test_a_rebuild_under_inference_mode_leaves_the_model_trainable():
    model, (x, y) = mlp(), data(1)[0]
    dp = DataParallel(model, ["cpu"] * 2)
    model[0].bias.requires_grad_(False)  # a change: the next forward rebuilds the replicas
    with torch.inference_mode():
        dp(x)
    assert not any(p.is_inference() for p in model.parameters())
    model[0].bias.requires_grad_(True)
    one = copy.deepcopy(model)
    F.cross_entropy(dp(x), y).backward()
    F.cross_entropy(one(x), y).backward()
    for a, b in zip(model.parameters(), one.parameters()):
        close(a.grad, b.grad, torch.float64)


def test_weight_edits_between_steps_without_a_version_bump_reach_the_replicas():
    model, (x, y) = mlp(), data(1)[0]
    dp = DataParallel(model, ["cpu"] * 2, lr=0.1)
    dp.step(x, y, F.cross_entropy)
    model[0].weight.data.mul_(0.5)  # e.g. WGAN's weight clipping through .data
    with torch.no_grad():
        close(dp(x), model(x), torch.float64)


def test_step_inside_no_sync_raises_and_host_momentum_follows_mixed_losses():
    model, steps = mlp(), data(4)
    dp = DataParallel(model, ["cpu"] * 2, reducer="host", lr=0.1, momentum=0.9)
    with dp.no_sync(), pytest.raises(RuntimeError, match="step\\(\\) inside no_sync"):
        dp.step(*steps[0], F.cross_entropy)
    one = copy.deepcopy(model)
    opt = torch.optim.SGD(one.parameters(), lr=0.1, momentum=0.9)
    mse = lambda out, y: F.mse_loss(out, F.one_hot(y, 4).double())  # noqa: E731
    for s, (x, y) in enumerate(steps):
        loss_fn = F.cross_entropy if s % 2 else mse
        dp.step(x, y, loss_fn)
        loss_fn(one(x), y).backward()
        opt.step()
        opt.zero_grad()
    same_models(model, one, torch.float64)
    replicas_identical(dp)


def test_autograd_grad_and_backward_inputs():
    model, (x, y) = mlp(), data(1)[0]
    dp = DataParallel(model, ["cpu"] * 3)
    one = copy.deepcopy(model)
    # The inputs' gradient (a gradient penalty's) is exact; the parameters' would be replica
    # 0's share: an error.
    xs, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    gx, = torch.autograd.grad(F.cross_entropy(dp(xs), y), xs, create_graph=True)
    want, = torch.autograd.grad(F.cross_entropy(one(xo), y), xo, create_graph=True)
    close(gx, want, torch.float64)
    for ask in (lambda loss: torch.autograd.grad(loss, list(model.parameters())),
                lambda loss: torch.autograd.grad(loss, [xs, model[0].weight]),
                lambda loss: loss.backward(inputs=list(model.parameters()))):
        with pytest.raises(RuntimeError, match="asking for the model's parameters"):
            ask(F.cross_entropy(dp(xs), y))
    xs.grad = None
    F.cross_entropy(dp(xs), y).backward(inputs=[xs])  # the input only: exact
    close(xs.grad, want, torch.float64)


def test_hooks_registered_after_the_forward_are_refused():
    model, (x, y) = mlp(), data(1)[0]
    dp = DataParallel(model, ["cpu"] * 2)
    out = dp(x)
    model[0].weight.register_hook(lambda g: g * 2)
    with pytest.raises(RuntimeError, match="gradient hook \\(registered after the forward\\)"):
        F.cross_entropy(out, y).backward()


def test_a_loss_on_activations_a_forward_hook_kept_is_reduced():
    model, (x, y) = mlp(), data(1)[0]
    kept = []
    model[1].register_forward_hook(lambda m, i, o: kept.append(o))
    one = copy.deepcopy(model)
    dp = DataParallel(model, ["cpu"] * 3)
    dp(x)
    sum(k.pow(2).sum() for k in kept).backward()  # no loss on dp's output at all
    kept.clear()
    one(x)
    sum(k.pow(2).sum() for k in kept).backward()
    for a, b in zip(model.parameters(), one.parameters()):
        assert (a.grad is None) == (b.grad is None)
        if b.grad is not None:
            close(a.grad, b.grad, torch.float64)


def test_changes_that_cannot_be_followed_raise():
    model, (x, y) = mlp(), data(1)[0]
    dp = DataParallel(model, ["cpu"] * 2)
    # a rebuild between no_sync passes
    with dp.no_sync():
        F.cross_entropy(dp(x), y).backward()
    model[1].register_buffer("count", torch.zeros(()))
    with pytest.raises(RuntimeError, match="between backward passes under no_sync"):
        dp(x)
    # an output made before a rebuild
    model, dp = mlp(), None
    dp = DataParallel(model, ["cpu"] * 2)
    first = F.cross_entropy(dp(x), y)
    model[2].bias.requires_grad_(False)
    second = F.cross_entropy(dp(x), y)
    with pytest.raises(RuntimeError, match="after this output's forward"):
        (first + second).backward()
    # modules outside _modules, a patched forward, functional_call on the wrapper
    import types
    model = mlp()
    model.layers = [model[0], model[2]]
    with pytest.raises(ValueError, match="'layers' .* a plain list or tuple of modules"):
        DataParallel(model, ["cpu"] * 2)(x)
    model = mlp()
    model.forward = types.MethodType(lambda self, t: self[2](self[1](self[0](t))), model)
    with pytest.raises(ValueError, match="'forward' .* a method bound to a module"):
        DataParallel(model, ["cpu"] * 2)(x)
    dp = DataParallel(mlp(), ["cpu"] * 2)
    params = {k: v.detach().clone() for k, v in dp.module.named_parameters()}
    with pytest.raises(ValueError, match="not an nn.Parameter"):
        torch.func.functional_call(dp.module, params, (x,)) if False else \
            torch.func.functional_call(dp, {f"module.{k}": v for k, v in params.items()}, (x,))
    # per-row lists of different lengths
    class PerRow(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 4).double()

        def forward(self, t):
            return list(self.lin(t))
    with pytest.raises(ValueError, match="different (lengths|structures)"):
        DataParallel(PerRow(), ["cpu"] * 2)(x[:7])
    # EmbeddingBag
    with pytest.raises(ValueError, match=r"nn.EmbeddingBag\(max_norm=1.0\)"):
        DataParallel(nn.EmbeddingBag(10, 3, max_norm=1.0), ["cpu"] * 2)


def test_a_frozen_then_unfrozen_parameter_keeps_its_momentum():
    model, steps = mlp(), data(4)
    one = copy.deepcopy(model)
    opt = torch.optim.SGD(one.parameters(), lr=0.1, momentum=0.9)
    dp = DataParallel(model, ["cpu"] * 2, lr=0.1, momentum=0.9)
    for s, (x, y) in enumerate(steps):
        for m in (model, one):
            m[0].weight.requires_grad_(s != 1)
        dp.step(x, y, F.cross_entropy)
        F.cross_entropy(one(x), y).backward()
        opt.step()
        opt.zero_grad()
    same_models(model, one, torch.float64)


def test_containers_deepcopy_pickle_class_swaps_and_dataclass_fields():
    import io
    model, (x, y) = mlp(), data(1)[0]

    class Holder(nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = DataParallel(net, ["cpu"] * 2)
            self.head = nn.Linear(4, 2).double()
    holder = Holder(model)
    state = holder.state_dict()
    assert "net.module.0.weight" in state
    holder.load_state_dict(state)
    dp = DataParallel(mlp(), ["cpu"] * 2, lr=0.1, momentum=0.9)
    dp.step(x, y, F.cross_entropy)
    twin = copy.deepcopy(dp)
    buf = io.BytesIO()
    torch.save(dp, buf)
    for other in (twin, torch.load(io.BytesIO(buf.getvalue()), weights_only=False)):
        other.step(x, y, F.cross_entropy)
        assert other.module is not dp.module
    dp.step(x, y, F.cross_entropy)
    same_models(twin.module, dp.module, torch.float64)

    class Twice(nn.Tanh):
        def forward(self, t):
            return super().forward(t) * 2
    model = mlp()
    dp = DataParallel(model, ["cpu"] * 3)
    dp(x)
    model[1].__class__ = Twice
    with torch.no_grad():
        close(dp(x), model(x), torch.float64)

    @dataclasses.dataclass
    class WithDerived:
        extra: torch.Tensor = dataclasses.field(init=False)
        logits: torch.Tensor

        def __post_init__(self):
            self.extra = self.logits.detach() * 0

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 4).double()

        def forward(self, t):
            return WithDerived(self.lin(t))
    net = Net()
    one = copy.deepcopy(net)
    got = DataParallel(net, ["cpu"] * 3)(x)
    close(got.logits, one(x).logits, torch.float64)
    assert got.logits.requires_grad


def test_a_gradient_penalty_through_the_wrapper():
    # WGAN-GP's loss: the gradient with respect to the input (create_graph), its norm's penalty
    # then backpropagated to the parameters.
    model, (x, y) = mlp(), data(1)[0]
    one = copy.deepcopy(model)
    dp = DataParallel(model, ["cpu"] * 3)
    for net in (dp, one):
        xs = x.clone().requires_grad_()
        out = net(xs)
        g, = torch.autograd.grad(out.sum(), xs, create_graph=True)
        (F.cross_entropy(out, y) + (g.norm(dim=1) - 1).pow(2).mean()).backward()
    for a, b in zip(model.parameters(), one.parameters()):
        close(a.grad, b.grad, torch.float64)
    replicas_identical(dp)
