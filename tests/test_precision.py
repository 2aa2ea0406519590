"""bfloat16/float16 and torch.autocast (#11 item 7): a fused model runs wherever nn.Linear does,
and gives torch's numbers within the half type's rounding.

The rule for half types: dpcuda's error against a float64 reference computed from the same
(rounded) inputs is at most twice torch's own error plus one unit in the last place
(assert_within_torch_error).
"""
import copy

import pytest
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import assert_within_torch_error
from dpcuda import _C, ops, reference as ref
from dpcuda.nn import FusedMLP, SoftmaxCrossEntropyLoss, fuse
from dpcuda.parallel import DataParallel

ACTS = ["none", "relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh"]
TORCH_ACTS = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "sigmoid": nn.Sigmoid,
              "tanh": nn.Tanh}
HALF = [torch.bfloat16, torch.float16]
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def assert_bfloat16_neighbours(ours, torchs, same_at_least):
    # Every element within one bfloat16 ulp of torch's (or 1e-6 apart, in the tails where the
    # float formulas both cancel: gelu_tanh at -5.125 is -1.5e-7 in float, -0 in torch's
    # bfloat16 kernel, -9.7e-8 in float64), NaN where torch's is NaN, and at least the given
    # share bit for bit.
    torch.testing.assert_close(ours.float(), torchs.float(), rtol=2.0 ** -7, atol=1e-6,
                               equal_nan=True)
    same = ours.view(torch.int16) == torchs.view(torch.int16)
    assert same.float().mean().item() >= same_at_least


@pytest.fixture(params=[0, 1], ids=["atens_activation", "dpcudas_pass"])
def bfloat16_route(request):
    # The CPU bfloat16 layer computes its forward activation by dpcuda's pass or by ATen's
    # kernel, whichever was measured the faster (csrc/torch/fused_linear.cpp): the tests that
    # take this fixture run both, whatever the choice.
    previous = _C._set_bfloat16_forward_route(request.param)
    yield request.param
    _C._set_bfloat16_forward_route(previous)


def forward_runs_atens_activation(activation):
    """Whether the bfloat16 layer's forward ran an ATen activation kernel (torch's profiler
    records it inside the layer) rather than dpcuda's pass."""
    torch.manual_seed(0)
    x = torch.randn(64, 16).bfloat16()
    w = torch.randn(8, 16).bfloat16()
    b = torch.randn(8).bfloat16()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                acc_events=True) as prof:
        out, _ = torch.ops.dpcuda.full_forward(x, w, b, activation)
    assert_bfloat16_neighbours(out, ref.full_forward(x, w, b, activation), same_at_least=0.97)
    names = {e.name for e in prof.events()}
    return bool(names & {"aten::relu", "aten::gelu", "aten::silu", "aten::sigmoid", "aten::tanh"})


@pytest.mark.parametrize("activation", ACTS)
def test_bfloat16_forward_route(activation):
    # As measured: ATen's kernel for gelu, dpcuda's pass for the others ("none" has neither);
    # either where set, but gelu's, ATen's always (ATen's gives NaN for +Inf in its vector loop).
    previous = _C._set_bfloat16_forward_route(-1)
    try:
        assert forward_runs_atens_activation(activation) == (activation == "gelu")
        for route in (0, 1):
            _C._set_bfloat16_forward_route(route)
            assert forward_runs_atens_activation(activation) == (
                activation == "gelu" or (route == 0 and activation != "none"))
    finally:
        _C._set_bfloat16_forward_route(previous)
    with pytest.raises(ValueError, match="route must be"):
        _C._set_bfloat16_forward_route(2)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("activation", ACTS)
def test_half_storage_forward_backward(dtype, activation):
    x = torch.randn(33, 20).to(dtype)
    w = (torch.randn(12, 20) / 4).to(dtype)
    b = torch.randn(12).to(dtype)
    go = torch.randn(33, 12).to(dtype)
    out = ops.full_forward(x, w, b, activation)
    plain = ref.full_forward(x, w, b, activation)
    assert out.dtype == dtype and out.shape == plain.shape
    x64, w64, b64 = x.double(), w.double(), b.double()
    want = ref.full_forward(x64, w64, b64, activation)
    scale = want.abs().max().item() + 1
    assert_within_torch_error(out, plain, want, atol=ULP[dtype] * scale)
    # backward through autograd against torch's autograd on the same half tensors
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    ops.full_forward(*leaves, activation).backward(go)
    plain_leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    ref.full_forward(*plain_leaves, activation).backward(go)
    want_grads = ref.full_backward(go.double(), x64, w64, b64, activation)
    for ours, theirs, want_g in zip(leaves, plain_leaves, want_grads):
        assert ours.grad.dtype == dtype
        g_scale = want_g.abs().max().item() + 1
        assert_within_torch_error(ours.grad, theirs.grad, want_g, atol=2 * ULP[dtype] * g_scale)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_half_logits_cross_entropy(dtype, reduction):
    logits = (torch.randn(40, 7) * 3).to(dtype)
    labels = torch.randint(0, 7, (40,))
    labels[::5] = -100
    ours = ops.softmax_cross_entropy(logits, labels, reduction, 0.1)
    plain = F.cross_entropy(logits, labels, reduction=reduction, label_smoothing=0.1)
    want = F.cross_entropy(logits.double(), labels, reduction=reduction, label_smoothing=0.1)
    assert ours.dtype == plain.dtype == dtype
    assert_within_torch_error(ours, plain, want, atol=ULP[dtype] * (want.abs().max().item() + 1))
    z = logits.clone().requires_grad_()
    ops.softmax_cross_entropy(z, labels, reduction, 0.1).sum().backward()
    z2 = logits.clone().requires_grad_()
    F.cross_entropy(z2, labels, reduction=reduction, label_smoothing=0.1).sum().backward()
    z3 = logits.double().requires_grad_()
    F.cross_entropy(z3, labels, reduction=reduction, label_smoothing=0.1).sum().backward()
    assert_within_torch_error(z.grad, z2.grad, z3.grad, atol=ULP[dtype])


@pytest.mark.parametrize("activation", sorted(TORCH_ACTS))
def test_autocast_matches_torch(activation):
    plain = nn.Sequential(nn.Linear(16, 32), TORCH_ACTS[activation](), nn.Linear(32, 10))
    fused = fuse(copy.deepcopy(plain))
    x = torch.randn(64, 16)
    y = torch.randint(0, 10, (64,))
    results = []
    for model, loss_fn in ((plain, F.cross_entropy), (fused, ops.softmax_cross_entropy)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
            loss = loss_fn(out, y)
        loss.backward()
        results.append((out, loss, [p.grad for p in model.parameters()]))
    (out_p, loss_p, grads_p), (out_f, loss_f, grads_f) = results
    # The casts are torch's: the layers' outputs in bfloat16, the loss in float32.
    assert out_f.dtype == out_p.dtype == torch.bfloat16
    assert loss_f.dtype == loss_p.dtype == torch.float32
    torch.testing.assert_close(out_f, out_p, rtol=2 * ULP[torch.bfloat16], atol=1e-2)
    torch.testing.assert_close(loss_f, loss_p, rtol=1e-2, atol=1e-3)
    for gf, gp in zip(grads_f, grads_p):
        assert gf.dtype == gp.dtype == torch.float32  # the parameters stay float32
        torch.testing.assert_close(gf, gp, rtol=0, atol=2e-2 * gp.abs().max().item())


def test_autocast_leaves_float64_alone_and_casts_loss_to_float():
    x, w = torch.randn(4, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ops.full_forward(x, w, None, "relu").dtype == torch.float64
        logits = torch.randn(4, 3).bfloat16()
        labels = torch.tensor([0, 1, 2, 1])
        assert ops.softmax_cross_entropy(logits, labels).dtype == torch.float32
        losses, grad = ops.loss_grad(logits, labels)
        assert grad.dtype == torch.float32
        assert SoftmaxCrossEntropyLoss()(logits, labels).dtype == torch.float32


@pytest.mark.parametrize("reducer", ["p2p", "host"])
def test_data_parallel_in_bfloat16_and_under_autocast(reducer):
    model = FusedMLP([16, 32, 10])
    x, y = torch.randn(24, 16), torch.randint(0, 10, (24,))
    loss_fn = SoftmaxCrossEntropyLoss()
    # bfloat16 parameters: replicas against torch.optim.SGD on one device, both against the
    # same training in float64 (bfloat16 training drifts; dpcuda may not drift further).
    dp_model = copy.deepcopy(model).bfloat16()
    dp = DataParallel(dp_model, devices=["cpu", "cpu", "cpu"], reducer=reducer, lr=0.1,
                      momentum=0.9)
    trained = []
    for dtype in (torch.bfloat16, torch.float64):
        one = copy.deepcopy(model).to(dtype)
        opt = torch.optim.SGD(one.parameters(), lr=0.1, momentum=0.9)
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(one(x.to(dtype)), y).backward()
            opt.step()
        trained.append(one)
    for _ in range(3):
        dp.step(x.bfloat16(), y, loss_fn)
    for p, q, want in zip(dp.module.parameters(), trained[0].parameters(),
                          trained[1].parameters()):
        assert p.dtype == torch.bfloat16
        assert_within_torch_error(p, q, want.detach(), atol=ULP[torch.bfloat16])
    # autocast: float32 parameters, bfloat16 compute, against the same on one device
    dp_model = copy.deepcopy(model)
    dp = DataParallel(dp_model, devices=["cpu", "cpu"], reducer=reducer, lr=0.1)
    one = copy.deepcopy(model)
    opt = torch.optim.SGD(one.parameters(), lr=0.1)
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            dp.step(x, y, loss_fn)
            opt.zero_grad()
            loss = loss_fn(one(x), y)
        loss.backward()
        opt.step()
    for p, q in zip(dp.module.parameters(), one.parameters()):
        assert p.dtype == torch.float32
        torch.testing.assert_close(p, q, rtol=0, atol=1e-2 * q.abs().max().item())


def test_float16_overflows_where_torch_overflows():
    """The half types are rounded where torch rounds them: a layer output beyond float16's
    range is Inf before the activation (so NaN or Inf after it, as torch's), and a
    log-probability beyond it makes the loss Inf."""
    x = torch.tensor([[-300.0, -300.0], [1.0, 2.0]], dtype=torch.float16)
    w = torch.tensor([[200.0, 200.0], [1.0, -1.0]], dtype=torch.float16)
    for activation in ACTS:
        got = ops.full_forward(x, w, None, activation)
        want = ref.full_forward(x, w, None, activation)
        torch.testing.assert_close(got, want, equal_nan=True)
    logits = torch.tensor([[40000.0, -40000.0], [0.0, 0.0]], dtype=torch.float16)
    for labels, smoothing in ((torch.tensor([1, 0]), 0.0), (torch.tensor([0, 0]), 0.1)):
        for reduction in ("none", "sum", "mean"):
            got = ops.softmax_cross_entropy(logits, labels, reduction, smoothing)
            want = F.cross_entropy(logits, labels, reduction=reduction,
                                   label_smoothing=smoothing)
            torch.testing.assert_close(got, want, equal_nan=True)
    # a pre-activation gradient beyond float16's range overflows as torch's does
    z = torch.tensor([[3.0]], dtype=torch.float16, requires_grad=True)
    w1 = torch.ones(1, 1, dtype=torch.float16, requires_grad=True)
    go = torch.tensor([[60000.0]], dtype=torch.float16)
    ops.full_forward(z, w1, None, "silu").backward(go)
    z2 = z.detach().clone().requires_grad_()
    w2 = w1.detach().clone().requires_grad_()
    F.silu(F.linear(z2, w2)).backward(go)
    torch.testing.assert_close(z.grad, z2.grad, equal_nan=True)
    torch.testing.assert_close(w1.grad, w2.grad, equal_nan=True)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("activation", ACTS)
def test_half_types_on_the_cpu_are_torchs_own_kernels(dtype, activation, bfloat16_route):
    # The CPU's half-type layer is torch's half GEMM, its data stays in the half type, and the
    # activation is computed in float and rounded once where torch rounds it: by torch's kernel
    # for float16, so its output and its input's gradient are torch eager's bit for bit; for
    # bfloat16 by dpcuda's pass where that is the faster (its float functions are a few float
    # ulps from ATen's), so an element may round to the neighbouring bfloat16 value, and most
    # are torch's bits. The weight's and the bias's gradients agree within the half type's
    # rounding (the weight gradient's GEMM is laid out transposed to torch's, the bias sum is
    # dpcuda's fixed-order one in float).
    torch.manual_seed(3)
    x = torch.randn(300, 24).to(dtype).requires_grad_()
    w = (torch.randn(40, 24) / 4).to(dtype).requires_grad_()
    b = torch.randn(40).to(dtype).requires_grad_()
    go = torch.randn(300, 40).to(dtype)
    out = ops.full_forward(x, w, b, activation)
    out.backward(go)
    xs, ws, bs = (t.detach().clone().requires_grad_() for t in (x, w, b))
    want = ref.full_forward(xs, ws, bs, activation)
    want.backward(go)
    if dtype == torch.float16:
        assert torch.equal(out, want)
        assert torch.equal(x.grad, xs.grad)
    else:
        assert_bfloat16_neighbours(out, want, same_at_least=0.97)
        # (the input's gradient is a GEMM over g: a g one ulp apart moves it within rounding)
        torch.testing.assert_close(x.grad.float(), xs.grad.float(), rtol=2 * ULP[dtype],
                                   atol=2 * ULP[dtype] * (1 + xs.grad.float().abs().max().item()))
    for ours, theirs in ((w.grad, ws.grad), (b.grad, bs.grad)):
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=2 * ULP[dtype],
                                   atol=2 * ULP[dtype] * (1 + theirs.float().abs().max().item()))


@pytest.mark.parametrize("rows,outf", [(70, 300), (300, 40), (6600, 40)],
                         ids=["wide", "narrow", "narrow_groups"])
@pytest.mark.parametrize("activation", ACTS)
def test_bfloat16_passes_read_strided_gradients_and_keep_nan_and_inf_as_torch(activation, rows,
                                                                              outf,
                                                                              bfloat16_route):
    # dpcuda's bfloat16 passes (csrc/cpu/fused_linear.cpp): an expanded, a transposed and a
    # sliced upstream gradient give the bits of its contiguous copy wherever dpcuda's pass runs
    # for both (for silu, sigmoid and tanh ATen's runs over an expanded one, dpcuda's over the
    # others: their g then differs by at most one rounding; relu's ATen's over an expanded one
    # too, whose g, a select, is exact either way); and NaN, +-Inf and +-0 in the
    # pre-activation and the upstream gradient come out where torch's come out. Narrow rows
    # (under 128 columns) over a contiguous gradient take g over groups of rows (4096 / 40 =
    # 102 rows), then the bias sums: the bits of the strided gradients' row-by-row loop. The
    # bias sums' chunks are 32 rows at 300 rows (one short group each, starting off row 0),
    # 104 at 6600 (a group of 102 and one of 2).
    torch.manual_seed(5)
    inf_ = 5
    x = torch.randn(rows, inf_).bfloat16()
    w = (torch.randn(outf, inf_) / 2).bfloat16()
    b = (torch.randn(outf) * 4).bfloat16()
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3e38, -3e38,
                            89.0, -89.0, 13.0, -13.0])
    b[:len(special)] = special.bfloat16()
    out, saved = torch.ops.dpcuda.full_forward(x, w, b, activation)
    want = ref.full_forward(x, w, b, activation)
    assert torch.equal(out.isnan(), want.isnan())
    # (40 columns: the 11 special ones are a quarter of the elements; gelu_tanh's output
    # matches torch's bits in 96.9% of them at 6600 rows on the AVX-512 CPUs, torch's kernels
    # there; on an AVX2-only CPU, whose torch kernels round otherwise, gelu_tanh's and silu's
    # in 94.4-95.0%: every element is within one ulp either way)
    assert_bfloat16_neighbours(out, want, same_at_least=0.97 if outf > 100 else 0.93)
    if saved.numel() == 0:
        saved = out
    # (finite upstream gradients here: torch's bfloat16 GEMM can spread a NaN of one row of
    # a dense operand to its neighbour, 7.53 NaN where float64 gives 7.5277, in one layout
    # and not the other)
    go = torch.randn(rows, outf).bfloat16()
    grads = {"expanded": torch.tensor(0.37).bfloat16().expand(rows, outf),
             "transposed": go.t().contiguous().t(),
             "sliced": torch.cat([go, go], 1)[:, ::2]}
    mask = [True, True, True]
    aten_over_expanded = activation in ("silu", "sigmoid", "tanh")
    for name, g in grads.items():
        # (g row-major, as over the contiguous copy: where torch's GEMM spreads a NaN, g takes
        # the transposed gradient's layout at any size, and the GEMMs' bits follow it)
        previous = _C._set_bfloat16_g_layout(0)
        try:
            got = torch.ops.dpcuda.full_backward(g, x, w, saved, activation, mask)
        finally:
            _C._set_bfloat16_g_layout(previous)
        dense = torch.ops.dpcuda.full_backward(g.contiguous(), x, w, saved, activation, mask)
        for a, c in zip(got, dense):
            if aten_over_expanded and name == "expanded":
                torch.testing.assert_close(a.float(), c.float(), rtol=2.0 ** -6, atol=1e-3,
                                           equal_nan=True)
            else:  # (values; a NaN's payload from the GEMMs may follow the layout)
                torch.testing.assert_close(a, c, rtol=0, atol=0, equal_nan=True, msg=name)
    # against torch: the input's gradient (a GEMM over g) and the bias's (a sum over g)
    go[3, :len(special)] = special.bfloat16()
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
    ref.full_forward(xs, ws, bs, activation).backward(go)
    got = torch.ops.dpcuda.full_backward(go, x, w, saved, activation, mask)
    for ours, theirs in zip(got, (xs.grad, ws.grad, bs.grad)):
        assert torch.equal(ours.isnan(), theirs.isnan())
        assert torch.equal(ours.isinf() & (ours > 0), theirs.isinf() & (theirs > 0))
        assert torch.equal(ours.isinf() & (ours < 0), theirs.isinf() & (theirs < 0))


@pytest.mark.parametrize("rows,outf", [(32, 2048), (16, 2048), (12, 2048), (33, 2050),
                                       (64, 2048), (32, 2047)])
@pytest.mark.parametrize("activation", [a for a in ACTS if a != "none"])
def test_bfloat16_g_over_a_transposed_gradient_takes_its_layout_where_its_gemm_is_faster(
        rows, outf, activation):
    # Over a column-major (transposed) upstream gradient, up to 32 rows and from 2048 columns,
    # dpcuda's bfloat16 pass writes g column-major, as torch's activation backward does: the
    # input's GEMM over it was the faster (csrc/torch/fused_linear.cpp, bfloat16_g_by_columns).
    # g's values and the bias sums are those of the row-major pass over the contiguous copy
    # (12 rows: a column stride under a transposed block's; a transposed gradient sliced from
    # wider columns); the GEMMs are torch's over g in its layout, which their bits tell apart
    # where BLAS's results for the two layouts differ (here on the machines measured; where they
    # do not, the layout is not asserted). 33 and 64 rows and 2047 columns keep g row-major;
    # forced column-major (below) at 33 and 64 rows, g's rows come in two chunks of the bias
    # sums, the second of one row at 33.
    torch.manual_seed(3)
    x = torch.randn(rows, outf).bfloat16()
    saved = torch.randn(rows, outf).bfloat16()  # (the pass's other operand; any values do)
    grads = {"transposed": torch.randn(outf, rows).bfloat16().t(),
             "sliced": torch.randn(outf, rows + 5).bfloat16()[:, 2:rows + 2].t()}
    identity = torch.eye(outf).bfloat16()
    w = (torch.randn(outf, outf) / 45).bfloat16()
    # (where torch's bfloat16 GEMM spreads a NaN to the next row, g takes torch's layout at any
    # size, relu's row-major: test_bfloat16_gemm_spreads_nan_probe)
    by_columns = (activation != "relu") if _C._bfloat16_gemm_spreads_nan() else (
        rows <= 32 and outf >= 2048)
    for name, go in grads.items():
        assert go.stride(0) == 1
        for mask in ([True, True, True], [True, True, False]):
            # g itself, exactly: the input's gradient through an identity weight (one product
            # each)
            g, _, sums = torch.ops.dpcuda.full_backward(go, x, identity, saved, activation, mask)
            g_dense, _, sums_dense = torch.ops.dpcuda.full_backward(
                go.contiguous(), x, identity, saved, activation, mask)
            assert torch.equal(g, g_dense), name
            if mask[2]:
                assert torch.equal(sums, sums_dense), name
            g_used = g.t().contiguous().t() if by_columns else g.contiguous()
            g_other = g.contiguous() if by_columns else g.t().contiguous().t()
            # with a weight: the two GEMMs are torch's over g in the layout chosen
            gi, gw, gb = torch.ops.dpcuda.full_backward(go, x, w, saved, activation, mask)
            assert torch.equal(gi, torch.mm(g_used, w)), name
            assert torch.equal(gw, torch.mm(g_used.t(), x)), name
            if mask[2]:
                assert torch.equal(gb, sums), name
            if not torch.equal(torch.mm(g_used, w), torch.mm(g_other, w)):
                assert not torch.equal(gi, torch.mm(g_other, w)), name
    # either layout forced (_C._set_bfloat16_g_layout, for tests and benchmarks): the same g
    # and sums, the GEMMs over g in the layout forced
    g_dense, _, sums_dense = torch.ops.dpcuda.full_backward(
        grads["transposed"].contiguous(), x, identity, saved, activation, [True, True, True])
    previous = _C._set_bfloat16_g_layout(-1)
    try:
        for layout in (0, 1):
            _C._set_bfloat16_g_layout(layout)
            go = grads["transposed"]
            g, _, sums = torch.ops.dpcuda.full_backward(go, x, identity, saved, activation,
                                                        [True, True, True])
            assert torch.equal(g, g_dense) and torch.equal(sums, sums_dense)
            forced = g_dense.t().contiguous().t() if layout else g_dense
            gi, gw, _ = torch.ops.dpcuda.full_backward(go, x, w, saved, activation,
                                                       [True, True, True])
            assert torch.equal(gi, torch.mm(forced, w)) and torch.equal(gw, torch.mm(forced.t(), x))
    finally:
        _C._set_bfloat16_g_layout(previous)
    with pytest.raises(ValueError, match="layout must be -1"):
        _C._set_bfloat16_g_layout(2)
    # NaN and +-Inf in the upstream gradient come out where torch's layer puts them
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38, -3e38])
    go = grads["transposed"].t().contiguous()
    go[:len(special), 1] = special.bfloat16()
    go = go.t()
    b = torch.randn(outf).bfloat16()
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
    ref.full_forward(xs, ws, bs, activation).backward(go)
    xf, wf, bf = (t.clone().requires_grad_() for t in (x, w, b))
    ops.full_forward(xf, wf, bf, activation).backward(go)
    for ours, theirs in ((xf.grad, xs.grad), (wf.grad, ws.grad), (bf.grad, bs.grad)):
        assert torch.equal(ours.isnan(), theirs.isnan())
        assert torch.equal(ours.isinf() & (ours > 0), theirs.isinf() & (theirs > 0))
        assert torch.equal(ours.isinf() & (ours < 0), theirs.isinf() & (theirs < 0))


def test_bfloat16_gemm_spreads_nan_probe():
    # The probe is torch's own product: where a NaN in one row of a bfloat16 g makes the row
    # before it NaN (oneDNN's AMX kernels on a Xeon with AMX), dpcuda says so and takes torch's
    # layouts (the shapes it spreads at differ between torch's versions: the probe tries eight).
    def spreads(rows, cols, n):
        g = torch.zeros(rows, cols, dtype=torch.bfloat16)
        g[1, 0] = float("nan")
        out = torch.mm(g, torch.randn(cols, n).bfloat16())
        assert out[1].isnan().all()
        return bool(out[0].isnan().any())
    assert _C._bfloat16_gemm_spreads_nan() == any(
        spreads(rows, cols, n) for rows in (17, 33) for cols in (2047, 2050) for n in (4, 64))


def test_bfloat16_g_layout_rule_and_its_knob():
    # The rule itself, whatever BLAS's bits show: column-major g over a column-major gradient
    # (row stride 1) of 2 to 32 rows from 2048 columns, or, where torch's bfloat16 GEMM spreads
    # a NaN, of any size but relu's (torch's layout there); never over another layout or one
    # row; _set_bfloat16_g_layout forces either layout over any column-major gradient.
    rule = _C._bfloat16_g_by_columns_for_tests
    spreads = _C._bfloat16_gemm_spreads_nan()
    assert rule(1, 32, 32, 2048) and rule(1, 2, 2, 4096) and rule(1, 40, 32, 2048)
    assert rule(1, 33, 33, 2048) == spreads and rule(1, 32, 32, 2047) == spreads
    assert rule(1, 32, 32, 2048, relu=True) != spreads and not rule(1, 33, 33, 2048, relu=True)
    assert not rule(2048, 1, 32, 2048) and not rule(0, 0, 32, 2048) and not rule(1, 1, 1, 4096)
    previous = _C._set_bfloat16_g_layout(-1)
    try:
        assert _C._set_bfloat16_g_layout(1) == -1
        assert rule(1, 300, 300, 16) and not rule(16, 1, 300, 16) and not rule(1, 1, 1, 16)
        assert _C._set_bfloat16_g_layout(0) == 1
        assert not rule(1, 32, 32, 2048)
    finally:
        _C._set_bfloat16_g_layout(previous)
    assert rule(1, 32, 32, 2048)


def fixed_order_bias_sums(values, chunk, tree=True, group=1):
    """The CPU bias sums' order in float32: rows in order within chunks of `chunk` rows, each
    chunk's sum from 0, the chunks' sums added pairwise (chunk k += chunk k + s for s = 1, 2, 4,
    ..., k a multiple of 2s; tree=False: in order) onto 0; rounded once to bfloat16. (group > 1:
    `group` rows summed first, then onto their chunk's sum: an order the tests tell apart.)"""
    partials = []
    for r0 in range(0, values.shape[0], chunk):
        partial = np.zeros(values.shape[1], dtype=np.float32)
        r1 = min(values.shape[0], r0 + chunk)
        for q in range(r0, r1, group):
            rows = np.zeros(values.shape[1], dtype=np.float32)
            for r in range(q, min(r1, q + group)):
                rows += values[r]
            partial += rows
        partials.append(partial)
    total = np.zeros(values.shape[1], dtype=np.float32)
    if tree:
        s = 1
        while s < len(partials):
            for k in range(0, len(partials) - s, 2 * s):
                partials[k] = partials[k] + partials[k + s]
            s *= 2
        total += partials[0]
    else:
        for partial in partials:
            total += partial
    return torch.from_numpy(total).bfloat16()


def bias_chunk_rows(rows):
    """The CPU's rows per bias chunk: ceil(rows / 64), at least 32 and at most 128."""
    return min(128, max(32, -(-rows // 64)))


@pytest.mark.parametrize("rows,cols", [(8192, 16), (4101, 5), (300, 64), (37, 127), (2051, 128),
                                       (20, 16), (20000, 3)])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "row_stride"])
def test_bfloat16_bias_sums_alone_add_in_their_fixed_order(rows, cols, strided):
    # A "none" layer's bfloat16 bias gradient: float sums of the rows in row order within
    # chunks of bias_chunk_rows(rows) rows (one chunk at 32 rows or fewer), the chunks' sums
    # added pairwise onto 0, rounded once: the same bits for any thread count and CPU, narrow
    # rows taken several at a time included. A first row of 2^24, ones in the rows after it up
    # to the second row of the second chunk, a last row of -2^24 (each column scaled by a power
    # of two): float32 drops each one added to 2^24 (a tie, to even), so the first chunk keeps
    # none of its ones and the second both of its own; any other grouping of the additions
    # (another chunk size, rows summed before their partial) keeps a different count of them;
    # the test checks that of its own data. Also over a gradient whose rows are further apart
    # than its width (a slice of a wider one).
    gen = torch.Generator().manual_seed(rows * 1000 + cols)
    chunk = bias_chunk_rows(rows)
    go = torch.zeros(rows, cols)
    go[1:min(chunk + 2, rows - 1)] = 1.0
    go[0], go[-1] = 2.0 ** 24, -(2.0 ** 24)
    go = (go * torch.exp2(torch.randint(0, 3, (1, cols), generator=gen).float())).bfloat16()
    if strided:
        go = torch.cat([go, torch.full_like(go, float("nan"))], 1)[:, :cols]
    x = torch.randn(rows, 3).bfloat16()
    w = torch.randn(cols, 3).bfloat16()
    _, _, gb = torch.ops.dpcuda.full_backward(go, x, w, torch.empty(0).bfloat16(), "none",
                                              [False, False, True])
    values = go.float().numpy()
    want = fixed_order_bias_sums(values, chunk)
    assert torch.equal(gb.view(torch.int16), want.view(torch.int16)), (gb[:4], want[:4])
    others = [torch.from_numpy(values.astype(np.float64).sum(0)).bfloat16()]
    if rows > 32:
        others += [fixed_order_bias_sums(values, chunk + 1), fixed_order_bias_sums(values, rows),
                   fixed_order_bias_sums(values, chunk, group=8)]
    for other in others:  # (the data tells these orders apart)
        assert not torch.equal(other.view(torch.int16), want.view(torch.int16))
    if rows > 2 * chunk:
        # The chunks' sums pairwise, not in order: 2^24 in the first row, a one in the first row
        # of every other chunk, -2^24 in the last row. In order each one is added to 2^24 and
        # dropped (a tie, to even); pairwise the ones meet each other first.
        go2 = torch.zeros(rows, cols)
        go2[0] = 2.0 ** 24
        go2[chunk::chunk] = 1.0
        go2[-1] = -(2.0 ** 24)
        go2 = go2.bfloat16()
        if strided:
            go2 = torch.cat([go2, torch.full_like(go2, float("nan"))], 1)[:, :cols]
        _, _, gb2 = torch.ops.dpcuda.full_backward(go2, x, w, torch.empty(0).bfloat16(), "none",
                                                   [False, False, True])
        values2 = go2.float().numpy()
        want2 = fixed_order_bias_sums(values2, chunk)
        assert torch.equal(gb2.view(torch.int16), want2.view(torch.int16)), (gb2[:4], want2[:4])
        in_order = fixed_order_bias_sums(values2, chunk, tree=False)
        assert not torch.equal(in_order.view(torch.int16), want2.view(torch.int16))


@pytest.mark.parametrize("activation", ["none", "relu"])
@pytest.mark.parametrize("layout", ["dense", "expanded", "transposed"])
def test_float32_bias_gradient_error_does_not_grow_with_the_batch(activation, layout):
    # 300K rows of one value (the gradient of 0.1 * y.sum(), and the same value dense and
    # column-major; relu's g is that value or 0): each bias chunk adds at most 128 rows in order
    # and the chunks (or the column-major sums' blocks) are added pairwise, so the relative
    # error stays near float32's rounding whatever the batch. Summed in 64 chunks of 4688 rows,
    # as before issue #27's review, it was 4.2e-5 (torch's cascade sum: 6.7e-7); the test
    # checks its data tells the long in-order sum apart.
    rows, cols = 300_000, 3
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(rows, 4, generator=gen)
    w = torch.randn(cols, 4, generator=gen) * 0.3
    b = torch.randn(cols, generator=gen)
    go = {"dense": torch.full((rows, cols), 0.1),
          "expanded": torch.tensor(0.1).expand(rows, cols),
          "transposed": torch.full((cols, rows), 0.1).t()}[layout]
    y = ops.full_forward(x, w, b, activation).detach()
    saved = {"output": y, None: None}[ops.saved_for_backward(activation)]
    gb = ops.full_backward(go, x, w, saved, activation)[2]
    exact = ref.full_backward(go.double(), x.double(), w.double(), b.double(), activation)[2]
    scale = exact.abs().max().item()
    assert (gb.double() - exact).abs().max().item() <= 2e-6 * scale
    # (the data tells the old order apart: g, 0.1 times the derivative, added in order 4688
    # rows at a time, the 64 chunks then in order, errs above the bound)
    g = (go * ref.activation_grad(x @ w.t() + b, activation)).numpy()
    chunks = [np.cumsum(g[r0:r0 + 4688], axis=0, dtype=np.float32)[-1]
              for r0 in range(0, rows, 4688)]
    in_order = np.cumsum(np.stack(chunks), axis=0, dtype=np.float32)[-1]
    assert np.abs(in_order.astype(np.float64) - exact.numpy()).max() > 2e-6 * scale


@pytest.mark.parametrize("rows", [3, 33, 300])
@pytest.mark.parametrize("layout", ["dense", "transposed"])
def test_bfloat16_bias_gradient_rounds_its_float_sums_to_nearest_even(rows, layout):
    # The bfloat16 bias gradient is the float sum over the rows rounded once to bfloat16, to
    # nearest with ties to even, as Tensor.to rounds (the CPU adapter rounds it by a loop of
    # its own). Columns whose float sums are exact in any order (three bfloat16 values, the
    # other rows 0) and fall on halfway points, just past them, on bfloat16's largest value,
    # past it (Inf), on NaN and +-Inf, -0: the bits of go.float().sum(0).bfloat16().
    big = 3.3895313892515355e38  # bfloat16's largest finite value
    h = 2.0 ** -8  # half a bfloat16 ulp of 1
    terms = [(1.0, h, 0.0), (1.0, 3 * h, 0.0), (-1.0, -h, 0.0), (256.0, 1.0, 0.0),
             (258.0, 1.0, 0.0), (1.0, h, 2.0 ** -20), (-1.0, -h, -(2.0 ** -20)),
             (1.0, h, -(2.0 ** -20)), (big, 0.0, 0.0), (big, big * 2.0 ** -9, 0.0), (big, big, 0.0),
             (big, 2.0 ** 119, 0.0), (-big, -(2.0 ** 119), 0.0),  # (halfway to Inf: Inf)
             (float("nan"), 1.0, 0.0), (float("inf"), 1.0, 0.0), (-float("inf"), 2.0, 0.0),
             (float("inf"), -float("inf"), 0.0), (-0.0, -0.0, -0.0), (0.0, -0.0, -0.0),
             (2.0 ** -133, 0.0, 0.0)]
    go = torch.zeros(rows, len(terms))
    for row, k in ((0, 0), (1, 1), (rows - 1, 2)):
        go[row] = torch.tensor([t[k] for t in terms])
    go = go.bfloat16()
    torch.testing.assert_close(go.float()[[0, 1, rows - 1]], torch.tensor(terms).t(), rtol=0,
                               atol=0, equal_nan=True)  # (each term is a bfloat16 value)
    if layout == "transposed":
        go = go.t().contiguous().t()
    x = torch.randn(rows, 3).bfloat16()
    w = torch.randn(len(terms), 3).bfloat16()
    _, _, gb = torch.ops.dpcuda.full_backward(go, x, w, torch.empty(0).bfloat16(), "none",
                                              [False, False, True])
    want = go.float().sum(0).bfloat16()
    assert torch.equal(gb.isnan(), want.isnan())
    same = gb.view(torch.int16) == want.view(torch.int16)
    assert bool((same | want.isnan()).all()), (gb, want)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ["sigmoid", "silu"])
def test_sigmoid_tail_keeps_torchs_subnormals_and_infinities(activation, dtype, bias,
                                                             bfloat16_route):
    # For 88.38 < -z < 88.72 exp(-z) is finite in float, and torch's sigmoid a subnormal (3e-39
    # to 4e-39), not 0: an infinite upstream gradient then gives +-Inf, not Inf * 0 = NaN.
    # Beyond it torch's exp overflows and its sigmoid is 0, as dpcuda's. (With a bias the
    # bfloat16 backward is dpcuda's pass, without it for silu ATen's.)
    z = torch.tensor([-88.0, -88.3, -88.4, -88.5, -88.6, -88.7, -88.72, -88.73, -89.0, -100.0,
                      88.5, 100.0])
    x = torch.ones(1, 1, dtype=dtype)
    w = z.to(dtype).reshape(-1, 1)
    b = torch.zeros(len(z), dtype=dtype) if bias else None
    out, saved = torch.ops.dpcuda.full_forward(x, w, b, activation)
    torch_out = ref.full_forward(x, w, b, activation)  # (torch in the dtype: the oracle here)
    assert torch.equal(out == 0, torch_out == 0), (out, torch_out)
    # (float32 silu: z * sigmoid(z) from a subnormal sigmoid, torch's z / (1 + e): up to 3
    # float ulps apart in the band)
    rtol = 2.0 ** -21 if dtype == torch.float32 else 2 * ULP[dtype]
    torch.testing.assert_close(out.double(), torch_out.double(), rtol=rtol, atol=1e-44)
    for inf in (float("inf"), -float("inf")):
        go = torch.full((1, len(z)), inf, dtype=dtype)
        got = torch.ops.dpcuda.full_backward(go, x, w, saved if saved.numel() else out,
                                             activation, [True, True, bias])
        leaves = [t.clone().requires_grad_() for t in (x, w) + ((b,) if bias else ())]
        ref.full_forward(leaves[0], leaves[1], leaves[2] if bias else None,
                         activation).backward(go)
        for ours, leaf in zip(got, leaves):
            theirs = leaf.grad
            assert torch.equal(ours.isnan(), theirs.isnan()), (ours, theirs)
            assert torch.equal(ours.isinf(), theirs.isinf()), (ours, theirs)
            assert torch.equal(ours.sign().nan_to_num(), theirs.sign().nan_to_num())
