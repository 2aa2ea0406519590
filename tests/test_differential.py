"""The differential suite (#11): random models and inputs, dpcuda against plain PyTorch.

Each example must end in one of two outcomes: dpcuda agrees with torch (fuse()d model against
the nn.Sequential it came from; DataParallel against torch.optim.SGD on one device) within the
dtype's tolerance, NaN and Inf included; or both raise. The draws cover widths and batches of 1
(and batches of 0), float32/float64/bfloat16/float16, every activation, bias on and off, frozen
parameters, NaN and +-Inf planted in inputs and upstream gradients, create_graph, autocast,
no_grad and inference_mode, ignore_index and label smoothing, BatchNorm/Dropout/LayerNorm
between layers, 1-4 replicas with even and weighted splits, momentum and weight decay.

Fixed seed (derandomize) in CI; DPCUDA_DIFF_EXAMPLES sets the examples per test (default 200;
a nightly-sized run: 2000).

One documented difference: gelu at +Inf. torch's own CPU kernels disagree there (its scalar
path gives gelu(inf) = inf, its vectorised path NaN; likewise the gradient at a large negative
input with an Inf upstream gradient, where dpcuda gives -Inf down to z = -12.9 and NaN beyond,
as gelu' underflows to 0); dpcuda gives the limit (the scalar path's value). Where torch has NaN
and dpcuda +-Inf in a gelu model fed non-finite values, the suite accepts it.
And with create_graph and a non-finite value planted, the parameters' gradients must be
non-finite exactly where torch's are, but +-Inf and NaN may trade places (second derivatives
through an infinite input multiply 0 by Inf in one graph and not in the other).
"""
import contextlib
import copy
import os
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from dpcuda import ops  # noqa: E402
from dpcuda.nn import FusedLinear, SoftmaxCrossEntropyLoss, fuse  # noqa: E402
from dpcuda.parallel import DataParallel  # noqa: E402

EXAMPLES = int(os.environ.get("DPCUDA_DIFF_EXAMPLES", "200"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))

ACTS = {"relu": nn.ReLU, "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
        "silu": nn.SiLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh}
# |ours - torch| <= TOL * (1 + max |torch|), elementwise, over finite entries.
TOL = {torch.float64: 1e-9, torch.float32: 5e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}


def build(widths, act, bias, between, dtype, frozen, seed):
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(a, b, bias=bias))
        if i + 2 < len(widths):
            layers.append(ACTS[act]())
            if between == "batchnorm":
                layers.append(nn.BatchNorm1d(b))
            elif between == "layernorm":
                layers.append(nn.LayerNorm(b))
            elif between == "dropout":
                layers.append(nn.Dropout(0.3))
    model = nn.Sequential(*layers).to(dtype)
    if frozen and len(list(model.parameters())) > 1:  # something stays trainable
        next(model.parameters()).requires_grad_(False)
    return model


def assert_agree(ours, theirs, dtype, gelu_nonfinite, what, loose=False):
    assert ours.shape == theirs.shape, what
    assert ours.dtype == theirs.dtype, what
    a, b = ours.detach().double(), theirs.detach().double()
    if loose:  # second derivatives of a non-finite input: which non-finite value may differ
        assert torch.equal(a.isfinite(), b.isfinite()), f"{what}: finite positions differ"
        a, b = a.nan_to_num(0, 0, 0), b.nan_to_num(0, 0, 0)
    nan_a, nan_b = a.isnan(), b.isnan()
    if gelu_nonfinite:  # torch NaN where dpcuda gives the limit (module docstring)
        nan_a = nan_a | (nan_b & a.isinf())
    assert torch.equal(nan_a, nan_b), f"{what}: NaN positions differ\n{a}\n{b}"
    inf_a, inf_b = a.isinf() & ~nan_a, b.isinf()
    assert torch.equal(inf_a, inf_b), f"{what}: Inf positions differ\n{a}\n{b}"
    assert torch.equal(a[inf_b], b[inf_b]), f"{what}: Inf signs differ"
    fin = a.isfinite() & b.isfinite()
    if fin.any():
        scale = 1 + b[fin].abs().max()
        err = (a[fin] - b[fin]).abs().max()
        assert err <= TOL[dtype] * scale, f"{what}: error {err:.3g} > {TOL[dtype]} * {scale:.3g}"


def run_model(model, x, case, labels, upstream):
    """(outputs, loss, grads) of one model on one case, or the exception it raised."""
    torch.manual_seed(case["seed"] + 1)  # the same dropout masks for both models
    if case["mode"] != "grad":
        ctx = torch.no_grad() if case["mode"] == "no_grad" else torch.inference_mode()
        with ctx:
            return model(x).clone(), None, []
    xi = x.clone().requires_grad_()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if case["autocast"] \
        else contextlib.nullcontext()
    with autocast:
        out = model(xi)
        if case["loss"]:
            fn = F.cross_entropy if not any(isinstance(m, FusedLinear) for m in model.modules()) \
                else ops.softmax_cross_entropy
            loss = fn(out, labels, ignore_index=-1, label_smoothing=case["smoothing"]) \
                if fn is F.cross_entropy else fn(out, labels, "mean", case["smoothing"], -1)
        else:
            loss = (out * upstream.to(out.dtype)).sum()
    inputs = [xi] + [p for p in model.parameters() if p.requires_grad]
    if case["create_graph"]:
        (gx,) = torch.autograd.grad(loss, xi, create_graph=True)
        (loss + gx.pow(2).sum()).backward()
    else:
        loss.backward()
    return out, loss, [t.grad for t in inputs]


@st.composite
def model_cases(draw):
    # (two layers at least: fuse() leaves a lone nn.Linear as it is, which would compare torch
    # with torch)
    depth = draw(st.integers(2, 3))
    case = {
        "widths": draw(st.lists(st.integers(1, 7), min_size=depth + 1, max_size=depth + 1)),
        "act": draw(st.sampled_from(sorted(ACTS))),
        "bias": draw(st.booleans()),
        "between": draw(st.sampled_from([None, "batchnorm", "layernorm", "dropout"])),
        "dtype": draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16,
                                       torch.float16])),
        "frozen": draw(st.booleans()),
        "batch": draw(st.sampled_from([0, 1, 2, 5])),
        "plant": draw(st.sampled_from([None, None, "nan", "inf", "-inf", "nan_grad",
                                       "inf_grad"])),
        "create_graph": draw(st.booleans()),
        "mode": draw(st.sampled_from(["grad", "grad", "no_grad", "inference_mode"])),
        "loss": draw(st.booleans()),
        "smoothing": draw(st.sampled_from([0.0, 0.2])),
        "train": draw(st.booleans()),
        "seed": draw(st.integers(0, 2 ** 16)),
    }
    case["autocast"] = case["dtype"] == torch.float32 and draw(st.booleans())
    if case["dtype"] in (torch.bfloat16, torch.float16):
        case["create_graph"] = False  # torch's half-type double backward is not the point
    return case


@SETTINGS
@given(model_cases())
def test_fused_model_matches_torch(case):
    dtype = case["dtype"]
    plain = build(case["widths"], case["act"], case["bias"], case["between"], dtype,
                  case["frozen"], case["seed"])
    fused = fuse(copy.deepcopy(plain))
    assert any(isinstance(m, FusedLinear) for m in fused.modules())
    for m in (plain, fused):
        m.train(case["train"])
    gen = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(case["batch"], case["widths"][0], generator=gen).to(dtype)
    out_shape = (case["batch"], case["widths"][-1])
    upstream = torch.randn(out_shape, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, case["widths"][-1], (case["batch"],), generator=gen)
    labels[::3] = -1  # ignored rows
    value = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
    if case["batch"]:
        if case["plant"] in value:
            x[0, 0] = value[case["plant"]]
        elif case["plant"] == "nan_grad":
            upstream[-1, 0] = float("nan")
        elif case["plant"] == "inf_grad":
            upstream[0, -1] = float("inf")
    results = []
    for model in (plain, fused):
        try:
            results.append(run_model(model, x, case, labels, upstream))
        except (RuntimeError, ValueError, IndexError, TypeError) as err:
            results.append(err)
    theirs, ours = results
    if isinstance(theirs, Exception) or isinstance(ours, Exception):
        # Both raise, or it is a failure: dpcuda raising where torch computes (or computing
        # where torch raises) is a difference.
        assert isinstance(theirs, Exception) and isinstance(ours, Exception), \
            f"torch: {theirs!r}\ndpcuda: {ours!r}"
        return
    gelu_nonfinite = case["act"].startswith("gelu") and case["plant"] is not None
    loose = case["create_graph"] and case["plant"] is not None
    compare_dtype = dtype if not case["autocast"] else torch.bfloat16
    assert_agree(ours[0], theirs[0], compare_dtype, gelu_nonfinite, "output")
    if ours[1] is not None:
        assert_agree(ours[1], theirs[1], compare_dtype, gelu_nonfinite, "loss")
    for i, (g_ours, g_theirs) in enumerate(zip(ours[2], theirs[2])):
        assert (g_ours is None) == (g_theirs is None), f"gradient {i}"
        if g_ours is not None:
            assert_agree(g_ours, g_theirs, compare_dtype, gelu_nonfinite, f"gradient {i}",
                         loose)


@st.composite
def parallel_cases(draw):
    depth = draw(st.integers(1, 3))
    replicas = draw(st.integers(1, 4))
    case = {
        "widths": draw(st.lists(st.integers(1, 6), min_size=depth + 1, max_size=depth + 1)),
        "act": draw(st.sampled_from(sorted(ACTS))),
        "bias": draw(st.booleans()),
        "between": draw(st.sampled_from([None, "batchnorm", "layernorm"])),
        "dtype": draw(st.sampled_from([torch.float32, torch.float64])),
        "frozen": draw(st.booleans()),
        "fused": draw(st.booleans()),
        "replicas": replicas,
        "batch": draw(st.integers(max(replicas, 2), 9)),
        "weights": draw(st.one_of(st.none(), st.lists(st.integers(0, 3), min_size=replicas,
                                                      max_size=replicas).filter(any))),
        "momentum": draw(st.sampled_from([0.0, 0.9])),
        "weight_decay": draw(st.sampled_from([0.0, 1e-2])),
        "reducer": draw(st.sampled_from(["p2p", "host"])),
        "loss": draw(st.sampled_from(["torch", "dpcuda"])),
        "ignore": draw(st.booleans()),
        "smoothing": draw(st.sampled_from([0.0, 0.1])),
        "nan_step": draw(st.sampled_from([None, 1])),
        "seed": draw(st.integers(0, 2 ** 16)),
    }
    return case


@SETTINGS
@given(parallel_cases())
def test_data_parallel_matches_one_device(case):
    dtype = case["dtype"]
    model = build(case["widths"], case["act"], case["bias"], case["between"], dtype,
                  case["frozen"], case["seed"])
    if case["fused"]:
        model = fuse(model)
    gen = torch.Generator().manual_seed(case["seed"])
    classes = case["widths"][-1]
    steps = []
    for s in range(3):
        x = torch.randn(case["batch"], case["widths"][0], generator=gen, dtype=dtype)
        y = torch.randint(0, classes, (case["batch"],), generator=gen)
        if case["ignore"]:
            y[torch.rand(case["batch"], generator=gen) < 0.4] = -1
        if case["nan_step"] == s:
            x[-1, 0] = float("nan")
        steps.append((x, y))
    if case["loss"] == "torch":
        loss_fn = nn.CrossEntropyLoss(ignore_index=-1, label_smoothing=case["smoothing"])
    else:
        loss_fn = SoftmaxCrossEntropyLoss(ignore_index=-1, label_smoothing=case["smoothing"])
    dp = DataParallel(copy.deepcopy(model), ["cpu"] * case["replicas"], reducer=case["reducer"],
                      lr=0.1, momentum=case["momentum"], weight_decay=case["weight_decay"],
                      split="weighted" if case["weights"] else "even",
                      split_weights=case["weights"], buffers="sync")
    one = copy.deepcopy(model)
    opt = torch.optim.SGD([p for p in one.parameters() if p.requires_grad], lr=0.1,
                          momentum=case["momentum"], weight_decay=case["weight_decay"])
    for s, (x, y) in enumerate(steps):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = dp.step(x, y, loss_fn)
        opt.zero_grad()
        want = F.cross_entropy(one(x), y, ignore_index=-1, label_smoothing=case["smoothing"])
        want.backward()
        grads_finite = all(p.grad.isfinite().all() for p in one.parameters()
                           if p.grad is not None)
        if grads_finite:
            opt.step()  # DataParallel skips a step whose gradients are not finite, with a warning
        else:
            assert any("NaN or Inf" in str(w.message) for w in caught), "no skip warning"
        w = want.item()
        assert (got != got) == (w != w), (got, w)
        if w == w:
            assert abs(got - w) <= TOL[dtype] * 10 * (1 + abs(w)), (s, got, w)
    ref = one.state_dict()
    for k, v in dp.module.state_dict().items():
        assert_agree(v, ref[k], dtype, False, k) if v.is_floating_point() else \
            torch.testing.assert_close(v, ref[k])
    for r in dp.replicas[1:]:
        for k, v in r.state_dict().items():
            torch.testing.assert_close(v, dp.module.state_dict()[k], rtol=0, atol=0,
                                       equal_nan=True, msg=f"replicas differ at {k}")


# ---------------------------------------------------------------------------------------------
# The conventional loop (#23): DataParallel as a wrapper with a drawn torch optimizer, loss and
# change made after wrapping, against the same loop on one device.

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True,
                                      weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
}
LOSSES = {
    "ce": lambda out, y: F.cross_entropy(out, y),
    "ce_weight": lambda out, y: F.cross_entropy(
        out, y, weight=torch.linspace(0.5, 2.0, out.shape[1], dtype=out.dtype)),
    "ce_sum": lambda out, y: F.cross_entropy(out, y, reduction="sum"),
    "nll_ignore": lambda out, y: F.nll_loss(F.log_softmax(out, 1), y, ignore_index=0),
    "mse": lambda out, y: F.mse_loss(out, F.one_hot(y, out.shape[1]).to(out.dtype)),
    "smooth": lambda out, y: F.cross_entropy(out, y, label_smoothing=0.2) + out.abs().mean(),
}
CHANGES = ["none", "freeze", "unfreeze", "load", "inplace", "eval", "scale_data",
           "restride"]


@st.composite
def loop_cases(draw):
    replicas = draw(st.integers(1, 4))
    depth = draw(st.integers(1, 3))
    return {
        "widths": draw(st.lists(st.integers(1, 6), min_size=depth + 1, max_size=depth + 1)),
        "act": draw(st.sampled_from(sorted(ACTS))),
        "bias": draw(st.booleans()),
        "between": draw(st.sampled_from([None, "layernorm", "dropout"])),
        "dtype": draw(st.sampled_from([torch.float32, torch.float64])),
        "fused": draw(st.booleans()),
        "replicas": replicas,
        "batch": draw(st.integers(1, 9)),
        "weights": draw(st.one_of(st.none(), st.lists(st.integers(0, 3), min_size=replicas,
                                                      max_size=replicas).filter(any))),
        "reducer": draw(st.sampled_from(["p2p", "host"])),
        "algorithm": draw(st.sampled_from(["auto", "one_shot", "two_shot", "ring"])),
        "optimizer": draw(st.sampled_from(sorted(OPTIMIZERS))),
        "loss": draw(st.sampled_from(sorted(LOSSES))),
        "change": draw(st.sampled_from(CHANGES)),
        "accumulate": draw(st.sampled_from([1, 2])),
        "clip": draw(st.sampled_from([None, 0.1])),
        "seed": draw(st.integers(0, 2 ** 16)),
    }


def _change(model, case, step, state):
    """The drawn change, made to the model (dp.module, or the one-device copy) before step."""
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, FusedLinear))]
    kind = case["change"]
    if kind == "freeze" and step == 1:
        layers[0].weight.requires_grad_(False)
    elif kind == "unfreeze":
        layers[-1].weight.requires_grad_(step != 1)
    elif kind == "load" and step == 2:
        model.load_state_dict(state)
    elif kind == "inplace" and step == 1:
        with torch.no_grad():
            layers[-1].weight.mul_(0.5)
    elif kind == "eval":
        model.train(step % 2 == 1)
    elif kind == "scale_data" and step == 2:
        layers[0].weight.data.mul_(-1.0)  # through .data: no version bump
    elif kind == "restride" and step == 1:
        # the same storage and shape, read column-major: another weight
        w = layers[0].weight
        w.data = w.data.as_strided(w.shape, (1, w.shape[0]))


def _train_loop(net, model, case, steps, state):
    opt = OPTIMIZERS[case["optimizer"]](list(model.parameters()))
    losses = []
    for s, (x, y) in enumerate(steps):
        _change(model, case, s, state)
        opt.param_groups[0]["params"] = [p for p in model.parameters() if p.requires_grad]
        for xs, ys in zip(x.tensor_split(case["accumulate"]), y.tensor_split(case["accumulate"])):
            if xs.shape[0] == 0:
                continue
            loss = LOSSES[case["loss"]](net(xs), ys) / case["accumulate"]
            loss.backward()
            losses.append(float(loss.detach()))
        if case["clip"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])
        opt.step()
        opt.zero_grad()
    return losses


@SETTINGS
@given(loop_cases())
def test_the_conventional_loop_matches_one_device(case):
    dtype = case["dtype"]
    if case["between"] == "layernorm" and 1 in case["widths"][1:-1]:
        # LayerNorm over one feature is a constant: the gradients behind it are rounding noise
        # (1e-9), whose sign the summation order decides, and Adagrad, Adam and RMSprop scale
        # noise to steps of the learning rate, on one device as over replicas.
        case["between"] = None
    model = build(case["widths"], case["act"], case["bias"], case["between"], dtype, False,
                  case["seed"])
    if case["between"] == "dropout" and case["change"] == "eval":
        # (in training mode the replicas draw other masks than one device: dropout is run in
        # eval mode, which the test then checks every replica follows)
        case["change"] = "none"
    if case["fused"]:
        model = fuse(model)
    state = copy.deepcopy(build(case["widths"], case["act"], case["bias"], case["between"],
                                dtype, False, case["seed"] + 1).state_dict())
    if case["fused"]:
        state = fuse(build(case["widths"], case["act"], case["bias"], case["between"], dtype,
                           False, case["seed"] + 1)).state_dict()
    gen = torch.Generator().manual_seed(case["seed"])
    classes = case["widths"][-1]
    steps = [(torch.randn(case["batch"], case["widths"][0], generator=gen, dtype=dtype),
              torch.randint(0, classes, (case["batch"],), generator=gen)) for _ in range(3)]
    one = copy.deepcopy(model)
    dp = DataParallel(model, ["cpu"] * case["replicas"], reducer=case["reducer"],
                      algorithm=case["algorithm"],
                      split="weighted" if case["weights"] else "even",
                      split_weights=case["weights"])
    if case["between"] == "dropout":
        model.eval()
        one.eval()
    outcomes = []
    for net, target in ((dp, model), (one, one)):
        try:
            outcomes.append(_train_loop(net, target, case, steps, state))
        except RuntimeError as err:  # e.g. nothing left to train: torch raises too
            outcomes.append(type(err))
    got, want = outcomes
    if not isinstance(want, list) or not isinstance(got, list):
        assert got == want, (got, want)
        return
    tol = TOL[dtype] * 10
    for g, w in zip(got, want):
        assert (g != g) == (w != w) and (g != g or abs(g - w) <= tol * (1 + abs(w))), (g, w)
    ref = one.state_dict()
    for k, v in model.state_dict().items():
        assert_agree(v, ref[k], dtype, False, k) if v.is_floating_point() else \
            torch.testing.assert_close(v, ref[k])
    for r in dp.replicas[1:]:
        for k, v in r.state_dict().items():
            torch.testing.assert_close(v, model.state_dict()[k], rtol=0, atol=0,
                                       equal_nan=True, msg=f"replicas differ at {k}")


@st.composite
def optimizer_cases(draw):
    """dpcuda.optim's optimizer and its hyperparameters, drawn, over DataParallel: the
    conventional loop or the one-call step (fused into the reduction), against torch.optim's
    optimizer of the same name on one device."""
    name = draw(st.sampled_from(["SGD", "Adam", "AdamW"]))
    hyper = {"lr": draw(st.sampled_from([1e-3, 0.01, 0.1])),
             "weight_decay": draw(st.sampled_from([0.0, 1e-2, 0.3])),
             "maximize": draw(st.booleans())}
    if name == "SGD":
        hyper["momentum"] = draw(st.sampled_from([0.0, 0.5, 0.9]))
        nesterov = hyper["momentum"] > 0 and draw(st.booleans())
        hyper["nesterov"] = nesterov
        hyper["dampening"] = 0.0 if nesterov else draw(st.sampled_from([0.0, 0.3]))
    else:
        hyper["betas"] = (draw(st.sampled_from([0.5, 0.9])), draw(st.sampled_from([0.9, 0.999])))
        hyper["eps"] = draw(st.sampled_from([1e-8, 1e-3]))
        hyper["amsgrad"] = draw(st.booleans())
    return {"name": name, "hyper": hyper, "groups": draw(st.booleans()),
            "replicas": draw(st.integers(1, 4)),
            "algorithm": draw(st.sampled_from(["auto", "one_shot", "two_shot", "ring"])),
            "path": draw(st.sampled_from(["loop", "step"])),
            "dtype": draw(st.sampled_from([torch.float32, torch.float64])),
            "schedule": draw(st.booleans()), "seed": draw(st.integers(0, 2 ** 16)),
            # clipping by the global norm (active at 0.05, idle at 10) and, for the one-call
            # step, micro-batches reduced once
            "clip": draw(st.sampled_from([None, 0.05, 10.0])),
            "accumulate": draw(st.sampled_from([1, 2, 4]))}


@SETTINGS
@given(optimizer_cases())
def test_dpcuda_optimizers_match_torch_over_replicas(case):
    import dpcuda.optim
    dtype = case["dtype"]
    torch.manual_seed(case["seed"])
    model = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 4)).to(dtype)
    one = copy.deepcopy(model)

    def groups(m):
        ps = list(m.parameters())
        if not case["groups"]:
            return ps
        return [{"params": ps[0::2]}, {"params": ps[1::2], "weight_decay": 0.0,
                                       "lr": case["hyper"]["lr"] / 2}]

    dp = DataParallel(model, ["cpu"] * case["replicas"], algorithm=case["algorithm"])
    ours = getattr(dpcuda.optim, case["name"])(groups(model), max_grad_norm=case["clip"],
                                               **case["hyper"])
    theirs = getattr(torch.optim, case["name"])(groups(one), foreach=False, **case["hyper"])
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, 0.7) for o in (ours, theirs)] \
        if case["schedule"] else []
    gen = torch.Generator().manual_seed(case["seed"])
    for _ in range(3):
        x = torch.randn(9, 6, generator=gen, dtype=torch.float64).to(dtype)
        y = torch.randint(0, 4, (9,), generator=gen)
        if case["path"] == "step":
            dp.step(x, y, nn.CrossEntropyLoss(), optimizer=ours, accumulate=case["accumulate"])
        else:
            ours.zero_grad()
            F.cross_entropy(dp(x), y).backward()
            ours.step()
        theirs.zero_grad()
        F.cross_entropy(one(x), y).backward()
        if case["clip"] is not None:
            norm = torch.nn.utils.clip_grad_norm_(one.parameters(), case["clip"])
            assert_agree(ours.grad_norm, norm, dtype, False, "grad_norm")
        theirs.step()
        for s in scheds:
            s.step()
    for (k, v), w in zip(model.state_dict().items(), one.state_dict().values()):
        assert_agree(v, w, dtype, False, k)
    for p, q in zip(model.parameters(), one.parameters()):
        for k, v in theirs.state[q].items():
            if k == "step":
                assert float(ours.state[p][k]) == float(v)
            else:
                assert_agree(ours.state[p][k], v, dtype, False, k)
    for r in dp.replicas[1:]:
        for a, b in zip(r.parameters(), model.parameters()):
            assert torch.equal(a, b), "replicas differ"
