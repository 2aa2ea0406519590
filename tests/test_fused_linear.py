import pytest
import torch
import torch.nn.functional as F

from dpcuda import ops, reference as ref
from conftest import DEVICES, assert_within_torch_error, dtypes_for

ATOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
CASES = [(d, t) for d in DEVICES for t in dtypes_for(d)]


def make(shape, device, dtype, scale=1.0):
    return (torch.randn(shape, dtype=torch.float64) * scale).to(device=device, dtype=dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("activation", ref.ACTIVATIONS)
@pytest.mark.parametrize("rows,inf,outf", [(1, 1, 1), (3, 17, 3), (17, 3, 1000), (64, 100, 17)])
def test_forward_and_backward_match_reference(device, dtype, activation, rows, inf, outf):
    x, w, b = make((rows, inf), device, dtype), make((outf, inf), device, dtype, 0.3), \
        make((outf,), device, dtype)
    x64, w64, b64 = x.double(), w.double(), b.double()
    out, pre = torch.ops.dpcuda.full_forward(x, w, b, activation)
    want = ref.full_forward(x64, w64, b64, activation)
    assert out.dtype == dtype and out.shape == want.shape
    assert_within_torch_error(out, ref.full_forward(x, w, b, activation), want, ATOL[dtype])

    kind = ops.saved_for_backward(activation)
    saved = out if kind == "output" else pre if kind == "pre" else None
    go = make((rows, outf), device, dtype)
    gi, gw, gb = ops.full_backward(go, x, w, saved, activation)
    want_gi, want_gw, want_gb = ref.full_backward(go.double(), x64, w64, b64, activation)
    plain = ref.full_backward(go, x, w, b, activation)
    # Reductions over rows grow the error with the row count.
    for got, pl, want in zip((gi, gw, gb), plain, (want_gi, want_gw, want_gb)):
        assert got.shape == want.shape
        assert_within_torch_error(got, pl, want, ATOL[dtype] * max(rows, inf))


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("activation", ["relu", "none"])
def test_relu_and_none_propagate_nan_and_inf_as_torch(device, dtype, activation):
    # z = x @ W.T + b with x = W = 0 is the bias exactly: NaN, +-Inf, +-0 and finite values,
    # forward; then upstream gradients holding NaN and +-Inf, on live and dead units alike.
    # torch.relu keeps a NaN; threshold_backward passes 0 for a dead unit whatever comes in.
    inf, nan = float("inf"), float("nan")
    b = torch.tensor([nan, inf, -inf, 0.0, -0.0, 2.0, -2.0, nan, 3.0, -3.0, inf, -inf],
                     dtype=dtype, device=device)
    go = torch.tensor([[1.0, 1.0, nan, inf, -inf, nan, nan, -2.0, inf, inf, 2.0, -inf]],
                      dtype=dtype, device=device)
    x = torch.zeros(1, 2, dtype=dtype, device=device, requires_grad=True)
    w = torch.zeros(12, 2, dtype=dtype, device=device, requires_grad=True)
    act = F.relu if activation == "relu" else (lambda z: z)
    bo, bt = b.clone().requires_grad_(), b.clone().requires_grad_()
    out = ops.full_forward(x, w, bo, activation)
    want = act(F.linear(x.detach(), w.detach(), bt))
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
    out.backward(go)
    want.backward(go)
    torch.testing.assert_close(bo.grad, bt.grad, rtol=0, atol=0, equal_nan=True)


def forward_gemm_calls(x, w, b, activation):
    """The ATen GEMMs (mm, addmm) that the CPU layer's forward ran, and its output."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                acc_events=True) as prof:
        out, pre = torch.ops.dpcuda.full_forward(x, w, b, activation)
    calls = sorted(e.name for e in prof.events() if e.name in ("aten::mm", "aten::addmm"))
    return calls, out, pre


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("activation", ref.ACTIVATIONS)
def test_cpu_float_bias_routes_match_torch(dtype, activation):
    # The CPU float forward adds its bias in the GEMM (addmm, torch's own call) from 64K output
    # elements, else in dpcuda's pass after mm, or as _set_float_bias_route says: either way
    # within torch's error of float64, with NaN and +-Inf biases where torch's are (x = W = 0 on
    # those units: the output is act(bias)), and its backward from the pre-activation it kept;
    # without a bias, mm alone.
    from dpcuda import _C
    torch.manual_seed(0)
    rows, inf, outf = 37, 19, 16
    x, w, b = make((rows, inf), "cpu", dtype), make((outf, inf), "cpu", dtype, 0.3), \
        make((outf,), "cpu", dtype)
    special = b.clone()
    special[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0], dtype=dtype)
    w_special = w.clone()
    w_special[:4] = 0
    want = ref.full_forward(x.double(), w.double(), b.double(), activation)
    go = make((rows, outf), "cpu", dtype)
    want_grads = ref.full_backward(go.double(), x.double(), w.double(), b.double(), activation)
    previous = _C._set_float_bias_route(-1)
    try:
        for route, gemm in ((-1, "aten::mm"), (1, "aten::addmm"), (0, "aten::mm")):
            _C._set_float_bias_route(route)
            calls, out, pre = forward_gemm_calls(x, w, b, activation)
            assert calls == [gemm if activation != "none" else "aten::addmm"], (route, calls)
            assert_within_torch_error(out, ref.full_forward(x, w, b, activation), want,
                                      ATOL[dtype])
            kind = ops.saved_for_backward(activation)
            if kind == "pre":
                # (the pre-activation kept for the backward holds the bias on either route)
                assert_within_torch_error(pre, F.linear(x, w, b), F.linear(
                    x.double(), w.double(), b.double()), ATOL[dtype])
            saved = out if kind == "output" else pre if kind == "pre" else None
            got = ops.full_backward(go, x, w, saved, activation)
            for g, pl, wt in zip(got, ref.full_backward(go, x, w, b, activation), want_grads):
                assert_within_torch_error(g, pl, wt, ATOL[dtype] * rows)
            odd = forward_gemm_calls(x, w_special, special, activation)[1][:, :4]
            torchs = ref.full_forward(x, w_special, special, activation)[:, :4]
            if activation == "gelu":
                # (ATen's vectorised gelu gives NaN for +Inf, dpcuda's the limit, +Inf)
                assert bool((odd[:, 1] == float("inf")).all())
                odd, torchs = odd[:, [0, 2, 3]], torchs[:, [0, 2, 3]]
            torch.testing.assert_close(odd, torchs, rtol=0, atol=0, equal_nan=True)
            real = ~torch.isnan(torchs)  # (and -0.0's sign where torch keeps it; a NaN's none)
            assert torch.equal(torch.signbit(odd[real]), torch.signbit(torchs[real]))
            assert forward_gemm_calls(x, w, None, activation)[0] == ["aten::mm"]
        # By the layer's size (-1): addmm from 64K output elements (here 2 x 2048 rows of a
        # 3-D input), whatever the size where a route is forced.
        for route, rows, gemm in ((-1, 2048, "aten::addmm"), (-1, 2047, "aten::mm"),
                                  (0, 2048, "aten::mm"), (1, 2047, "aten::addmm")):
            _C._set_float_bias_route(route)
            xs = make((2, rows, 3), "cpu", dtype)
            calls, out, _ = forward_gemm_calls(xs, w[:16, :3], b[:16], activation)
            assert calls == [gemm if activation != "none" else "aten::addmm"], (route, rows)
            assert out.shape == (2, rows, 16)
            assert_within_torch_error(out, ref.full_forward(xs, w[:16, :3], b[:16], activation),
                                      ref.full_forward(xs.double(), w[:16, :3].double(),
                                                       b[:16].double(), activation),
                                      ATOL[dtype])
    finally:
        _C._set_float_bias_route(previous)
    with pytest.raises(ValueError, match="route must be"):
        _C._set_float_bias_route(2)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_into_refuses_destinations_that_share_its_inputs(device):
    # The backward writes grad_weight and grad_bias before it has read everything (the
    # weight's gradient before the input's GEMM; the bias sums in the activation pass): a
    # destination sharing memory with what it reads is refused, naming both.
    x, w = make((6, 4), device, torch.float32), make((3, 4), device, torch.float32)
    go = make((6, 3), device, torch.float32)
    out, pre = torch.ops.dpcuda.full_forward(x, w, None, "silu")
    gw, gb = torch.empty_like(w), torch.empty(3, device=device)
    buffer = torch.zeros(6 * 4, device=device)
    cases = [((go, x, w, pre, w, gb), "grad_weight shares memory with weight"),
             ((go, x, w, pre, gw, go[0]), "grad_bias shares memory with grad_output"),
             ((go, buffer.view(6, 4), w, pre, buffer[:12].view(3, 4), gb),
              "grad_weight shares memory with input"),
             ((go, x, w, pre, gw, pre[1]), "grad_bias shares memory with saved"),
             ((go, x, w, pre, buffer[:12].view(3, 4), buffer[10:13]),
              "grad_weight and grad_bias share memory")]
    for (g, xi, wi, saved, dw, db), message in cases:
        with pytest.raises(ValueError, match=message):
            torch.ops.dpcuda.full_backward_into(g, xi, wi, saved, "silu", [True, True, True], dw,
                                                db)
    # ("none" never reads saved: any tensor will do, the destinations included)
    torch.ops.dpcuda.full_backward_into(go, x, w, gw, "none", [True, True, True], gw, gb)
    want = ops.full_backward(go, x, w, None, "none")
    torch.testing.assert_close(gw, want[1])
    torch.testing.assert_close(gb, want[2])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ref.ACTIVATIONS)
def test_no_input_features_gives_the_activation_of_the_bias(device, activation):
    # in_features == 0: x @ W.T is all zeros, so the output is act(bias) on every row (cuBLASLt's
    # relu epilogue returned the bias itself here).
    x = torch.empty(3, 0, device=device)
    w = torch.empty(4, 0, device=device)
    b = torch.tensor([-1.0, 0.5, -0.25, 2.0], device=device)
    out = ops.full_forward(x, w, b, activation)
    want = ref.full_forward(x, w, b, activation)
    torch.testing.assert_close(out, want)
    if activation == "relu":
        assert (out >= 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_leading_dims_noncontiguous_and_no_bias(device):
    x = torch.randn(4, 5, 9, device=device).transpose(0, 1)  # (5, 4, 9), non-contiguous
    w = torch.randn(6, 18, device=device)[:, ::2]               # (6, 9), strided
    assert not x.is_contiguous() and not w.is_contiguous()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = ops.full_forward(xr, wr, None, "silu")
    want = F.silu(F.linear(x, w))
    torch.testing.assert_close(out, want)
    assert out.shape == (5, 4, 6)
    out.square().sum().backward()
    xw, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    F.silu(F.linear(xw, ww)).square().sum().backward()
    torch.testing.assert_close(xr.grad, xw.grad)
    torch.testing.assert_close(wr.grad, ww.grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ["relu", "gelu", "none"])
def test_empty_batch(device, activation):
    x = torch.empty(0, 5, device=device, requires_grad=True)
    w = torch.randn(3, 5, device=device, requires_grad=True)
    b = torch.randn(3, device=device, requires_grad=True)
    out = ops.full_forward(x, w, b, activation)
    assert out.shape == (0, 3)
    out.sum().backward()
    assert x.grad.shape == (0, 5)
    assert torch.equal(w.grad, torch.zeros_like(w))
    assert torch.equal(b.grad, torch.zeros_like(b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16,
                                   torch.float16])
@pytest.mark.parametrize("activation", ref.ACTIVATIONS)
def test_empty_layers_on_the_cpu(dtype, activation):
    # A layer of no outputs, no inputs or no rows, with the upstream gradients that sum(),
    # mean() and a transpose hand back: torch's shapes and values (a bfloat16 layer without
    # outputs once divided by its width on an expanded gradient).
    for rows, inf, outf in ((4, 6, 0), (4, 0, 3), (0, 6, 3), (5, 0, 0)):
        for reduce in ("sum", "mean", "transposed"):
            x = torch.randn(rows, inf).to(dtype).requires_grad_()
            w = torch.randn(outf, inf).to(dtype).requires_grad_()
            b = torch.randn(outf).to(dtype).requires_grad_()
            xs, ws, bs = (t.detach().clone().requires_grad_() for t in (x, w, b))
            out = ops.full_forward(x, w, b, activation)
            want = ref.full_forward(xs, ws, bs, activation)
            torch.testing.assert_close(out, want, atol=ATOL[dtype], rtol=2e-2)
            if reduce == "transposed":
                go = torch.randn(outf, rows).to(dtype).t()
                out.backward(go)
                want.backward(go)
            else:
                getattr(out, reduce)().backward()
                getattr(want, reduce)().backward()
            for ours, theirs in ((x, xs), (w, ws), (b, bs)):
                torch.testing.assert_close(ours.grad, theirs.grad, atol=ATOL[dtype], rtol=2e-2,
                                           equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_skips_unrequested_gradients(device):
    x = torch.randn(8, 4, device=device)
    w = torch.randn(3, 4, device=device, requires_grad=True)
    out = ops.full_forward(x, w, None, "tanh")
    out.sum().backward()
    assert x.grad is None and w.grad is not None
    gi, gw, gb = ops.full_backward(torch.ones_like(out), x, w, out, "tanh", (False, True, False))
    assert gi is None and gb is None
    torch.testing.assert_close(gw, w.grad)


def torch_linear_grads(go, x, w, b, activation):
    """(out, grad_input, grad_weight, grad_bias) of act(F.linear(x, w, b)) by torch's autograd."""
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    out = ref.full_forward(x, w, b, activation)
    out.backward(go)
    return out.detach(), x.grad, w.grad, b.grad


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("activation", ["relu", "none", "gelu"])
@pytest.mark.parametrize("rows,inf,outf", [(256, 784, 256), (256, 256, 10), (1024, 1024, 1024),
                                           (7, 5, 3), (33, 64, 130)])
def test_cuda_small_gemms_through_cublaslt(dtype, activation, rows, inf, outf):
    # For small GEMMs the CUDA layer uses cuBLASLt with one-pass algorithms: the forward with
    # its bias epilogue, the weight gradient with the bias gradient (BGRADB), into new tensors
    # and into a flat buffer's views. With the path off (_set_cublaslt), a bias gradient view 4
    # bytes off 16-byte alignment, float64 or 1024^3 multiply-adds: cuBLAS and dpcuda's own bias
    # pass. Every way within torch's error of float64 autograd; NaN and Inf where torch's are.
    from dpcuda import _C
    torch.manual_seed(rows + inf + outf)
    dev = "cuda"
    x, w = make((rows, inf), dev, dtype), make((outf, inf), dev, dtype, 0.3)
    b = make((outf,), dev, dtype)
    go = make((rows, outf), dev, dtype)
    go[0, 0], go[-1, -1] = float("nan"), float("inf")
    if rows > 2:
        go[1, outf // 2] = float("-inf")
    want = torch_linear_grads(go.double(), x.double(), w.double(), b.double(), activation)
    plain = torch_linear_grads(go, x, w, b, activation)
    kind = ops.saved_for_backward(activation)
    mask = [True, True, True]
    n = outf * inf + outf
    flat = torch.full((n + 128,), 7.0, dtype=dtype, device=dev)
    small = rows * inf * outf <= 2 ** 28
    results = {}
    previous = _C._set_cublaslt(True)
    try:
        for on in (True, False):
            _C._set_cublaslt(on)
            calls = _C._cublaslt_calls()
            out, pre = torch.ops.dpcuda.full_forward(x, w, b, activation)
            saved = out if kind == "output" else pre if kind == "pre" else torch.empty(0, device=dev)
            gi, gw, gb = torch.ops.dpcuda.full_backward(go, x, w, saved, activation, mask)
            results[on, "new"] = (out, gi, gw, gb)
            took = _C._cublaslt_calls() - calls
            if on and small and dtype != torch.float64:
                # one pass over K, no atomics: the same bits again
                again = torch.ops.dpcuda.full_backward(go, x, w, saved, activation, mask)
                assert all(torch.equal(a.nan_to_num(), c.nan_to_num())
                           for a, c in zip(again, (gi, gw, gb)))
            # Pointers as aligned as the allocator's: for float32 at the MLP's shapes cuBLASLt
            # must have made all three GEMMs (a test of the path, not only of the results).
            if on and dtype == torch.float32 and (rows, inf, outf) in ((256, 784, 256),
                                                                      (256, 256, 10)):
                assert took == 3
            if not on or dtype == torch.float64 or not small:
                assert took == 0
            # without the bias gradient (bias=False, a frozen bias): the weight gradient alone,
            # DEFAULT epilogue, our pass not needed for a bias
            calls = _C._cublaslt_calls()
            gi2, gw2, gb2 = torch.ops.dpcuda.full_backward(go, x, w, saved, activation,
                                                           [True, True, False])
            if on and dtype == torch.float32 and (rows, inf, outf) in ((256, 784, 256),
                                                                      (256, 256, 10)):
                assert _C._cublaslt_calls() - calls == 2
            assert gb2.numel() == 0
            results[on, "no bias grad"] = (out, gi2, gw2, gb)
            for offset, name in ((64, "aligned"), (1, "off")):
                flat.fill_(7.0)
                gw = flat[offset:offset + outf * inf].view(outf, inf)
                gb = flat[offset + outf * inf:offset + n]
                calls = _C._cublaslt_calls()
                gi = torch.ops.dpcuda.full_backward_into(go, x, w, saved, activation, mask, gw, gb)
                took = _C._cublaslt_calls() - calls
                if name == "off" and gb.data_ptr() % 16:
                    # the bias by our pass: cuBLASLt for the input's and the weight's GEMMs
                    # at most (the weight's without the bias gradient, if it takes the view)
                    assert took <= 2
                if on and name == "aligned" and dtype == torch.float32 and \
                        (rows, inf, outf) in ((256, 784, 256), (256, 256, 10)):
                    assert took == 2  # the weight (and bias) gradient's and the input's
                results[on, name] = (out, gi, gw.clone(), gb.clone())
                assert bool((flat[:offset] == 7).all()) and bool((flat[offset + n:] == 7).all())
    finally:
        _C._set_cublaslt(previous)
    for key, got in results.items():
        for g, pl, wt in zip(got, plain, want):
            assert g.dtype == dtype and g.shape == wt.shape, key
            assert torch.equal(g.isnan(), pl.isnan()), key
            assert torch.equal(g.isinf(), pl.isinf()), key
            fin = pl.isfinite()
            assert_within_torch_error(g[fin], pl[fin], wt[fin], ATOL[dtype] * max(rows, inf))


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA GPU")
def test_cuda_backward_in_a_fresh_process_warns_nothing():
    # The backward's first CUDA call on autograd's device thread is a cuBLASLt query (activation
    # "none": no kernel of ours before it): it must find a current context, not make torch warn
    # "no current CUDA context" (a warning once per process: hence a process of its own).
    import subprocess
    import sys
    code = ("import warnings, torch, dpcuda\n"
            "from dpcuda import ops\n"
            "warnings.simplefilter('error')\n"
            "x = torch.randn(256, 784, device='cuda')\n"
            "w = torch.randn(10, 784, device='cuda', requires_grad=True)\n"
            "b = torch.randn(10, device='cuda', requires_grad=True)\n"
            "ops.full_forward(x, w, b, 'none').sum().backward()\n"
            "torch.cuda.synchronize()\n"
            "print('ok', float(b.grad.sum()))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "no current CUDA context" not in run.stderr, run.stderr[-2000:]
    assert run.stdout.startswith("ok ")


@pytest.mark.parametrize("activation", ref.ACTIVATIONS)
def test_gradcheck(activation):
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    if activation == "relu":
        # Keep pre-activations away from the kink, where finite differences are meaningless.
        with torch.no_grad():
            z = F.linear(x, w, b)
            b += torch.where(z.abs() < 0.1, 0.5, 0.0).amax(0)
    assert torch.autograd.gradcheck(lambda *a: ops.full_forward(*a, activation), (x, w, b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ["relu", "gelu", "none", "sigmoid"])
def test_opcheck(device, activation):
    x = torch.randn(6, 5, device=device, requires_grad=True)
    w = torch.randn(4, 5, device=device, requires_grad=True)
    b = torch.randn(4, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.dpcuda.full_forward.default, (x, w, b, activation))
    torch.library.opcheck(torch.ops.dpcuda.full_forward.default, (x, w, None, activation))
    out, pre = torch.ops.dpcuda.full_forward(x.detach(), w.detach(), b.detach(), activation)
    kind = ops.saved_for_backward(activation)
    saved = out if kind == "output" else pre
    torch.library.opcheck(torch.ops.dpcuda.full_backward.default,
                          (torch.randn_like(out), x.detach(), w.detach(), saved, activation,
                           [True, True, True]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(5,), (2, 3, 5)], ids=["1d", "3d"])
def test_opcheck_half_types_other_ranks_and_masks(dtype, shape):
    # torch.library.opcheck (schema, fake kernel, autograd registration, no aliasing between
    # outputs or with the inputs) on the CPU's half-type paths, inputs of one and three
    # dimensions (the adapters take a matrix as it is and reshape the others), and masks that
    # leave gradients out (each an empty tensor of its own).
    torch.manual_seed(0)
    x = torch.randn(*shape).to(dtype)
    w = torch.randn(4, 5).to(dtype)
    b = torch.randn(4).to(dtype)
    for activation in ("none", "relu", "silu"):
        torch.library.opcheck(torch.ops.dpcuda.full_forward.default, (x, w, b, activation))
        out, pre = torch.ops.dpcuda.full_forward(x, w, b, activation)
        saved = out if ops.saved_for_backward(activation) == "output" else pre
        for mask in ([True, True, True], [True, False, False], [False, True, False],
                     [False, False, True], [False, False, False]):
            torch.library.opcheck(torch.ops.dpcuda.full_backward.default,
                                  (torch.randn_like(out), x, w, saved, activation, mask))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_raise_named_errors(device):
    x, w, b = torch.randn(4, 5, device=device), torch.randn(3, 5, device=device), \
        torch.randn(3, device=device)
    with pytest.raises(ValueError, match="weight must have shape"):
        ops.full_forward(x, torch.randn(3, 5, 1, device=device), b)
    with pytest.raises(ValueError, match="input must have 5 features"):
        ops.full_forward(torch.randn(4, 6, device=device), w, b)
    with pytest.raises(ValueError, match="input must have shape"):
        ops.full_forward(torch.tensor(1.0, device=device), w, b)
    with pytest.raises(ValueError, match="bias must have shape"):
        ops.full_forward(x, w, torch.randn(4, device=device))
    with pytest.raises(TypeError, match="weight must have the dtype"):
        ops.full_forward(x, w.double(), b)
    with pytest.raises(TypeError, match="bias must have the dtype"):
        ops.full_forward(x, w, b.double())
    with pytest.raises(ValueError, match="activation must be one of"):
        ops.full_forward(x, w, b, "swish")
    with pytest.raises(ValueError, match="activation must be one of"):
        torch.ops.dpcuda.full_forward(x, w, b, "swish")
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        ops.full_forward([1.0], w, b)
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        ops.full_forward(x, [[1.0]], b)
    with pytest.raises(TypeError, match="bias must be a torch.Tensor"):
        ops.full_forward(x, w, 1.0)
    for bad in (["relu"], 3, None):
        with pytest.raises(ValueError, match="activation must be one of"):
            ops.full_forward(x, w, b, bad)
    with pytest.raises(ValueError, match="saved is required"):
        ops.full_backward(torch.randn(4, 3, device=device), x, w, None, "relu")
    with pytest.raises(ValueError, match="grad_output must have shape"):
        ops.full_backward(torch.randn(4, 2, device=device), x, w, None, "none")
    with pytest.raises(ValueError, match="saved must have"):
        ops.full_backward(torch.randn(4, 3, device=device), x, w, torch.randn(2, device=device),
                          "tanh")
    if device == "cpu":
        with pytest.raises(TypeError, match="float32, float64, bfloat16 or float16; input"):
            ops.full_forward(x.int(), w.int(), b.int())
    else:
        with pytest.raises(ValueError, match="weight must be on the same device"):
            ops.full_forward(x, w.cpu(), b)


def test_full_forward_hands_torch_function_overrides_the_op():
    # A mode or a tensor subclass that overrides torch functions sees torch.ops.dpcuda's op
    # (with a bias and without: the call's fast path into _C must not pass them by), and the
    # result is the subclass's.
    seen = []

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    class Sub(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append(func)
            return super().__torch_function__(func, types, args, kwargs)

    x, w, b = torch.randn(4, 3), torch.randn(2, 3), torch.randn(2)
    for bias in (b, None):
        seen.clear()
        with Mode():
            got = ops.full_forward(x, w, bias, "gelu")
        assert seen == [torch.ops.dpcuda.full_forward]
        torch.testing.assert_close(got, ops.full_forward(x, w, bias, "gelu"), rtol=0, atol=0)
    for args in ((x.as_subclass(Sub), w, b), (x, w.as_subclass(Sub), None),
                 (x, w, b.as_subclass(Sub))):
        seen.clear()
        got = ops.full_forward(*args, "gelu")
        assert seen[0] == torch.ops.dpcuda.full_forward and type(got) is Sub
        plain = [a if a is None else a.as_subclass(torch.Tensor) for a in args]
        torch.testing.assert_close(got.as_subclass(torch.Tensor),
                                   ops.full_forward(*plain, "gelu"), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph_training_step(device):
    from dpcuda.nn import FusedMLP, SoftmaxCrossEntropyLoss
    torch._dynamo.reset()
    model = FusedMLP([20, 16, 5], activation="gelu").to(device)
    loss_fn = SoftmaxCrossEntropyLoss(label_smoothing=0.05)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager = FusedMLP([20, 16, 5], activation="gelu").to(device)
    eager.load_state_dict(model.state_dict())
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)

    def forward_loss(m, x, y):
        return loss_fn(m(x), y)

    # The default backend (inductor) with fullgraph=True: any graph break fails the test.
    compiled = torch.compile(forward_loss, fullgraph=True)
    for _ in range(3):
        x = torch.randn(32, 20, device=device)
        y = torch.randint(0, 5, (32,), device=device)
        loss_c = compiled(model, x, y)
        loss_c.backward()
        opt.step()
        opt.zero_grad()
        loss_e = forward_loss(eager, x, y)
        loss_e.backward()
        eager_opt.step()
        eager_opt.zero_grad()
        torch.testing.assert_close(loss_c, loss_e)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q)


def test_no_graph_without_grad_and_forward_ad():
    x = torch.randn(5, 4)
    w = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    labels = torch.tensor([0, 1, 2, 0, 1])
    with torch.no_grad():
        out = ops.full_forward(x, w, b, "gelu")
        loss = ops.softmax_cross_entropy(out, labels)
    assert not out.requires_grad and out.grad_fn is None
    assert not loss.requires_grad and loss.grad_fn is None
    # The kernels called directly give the same values as through the autograd node.
    assert torch.equal(out, ops.full_forward(x, w, b, "gelu").detach())
    assert torch.equal(loss, ops.softmax_cross_entropy(out, labels))
    # Forward-mode AD gives torch's tangents (tests/test_transforms.py covers it fully).
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level():
        tangent = torch.randn_like(x)
        dual = fwAD.make_dual(x, tangent)
        got = fwAD.unpack_dual(ops.full_forward(dual, w.detach(), b.detach(), "relu")).tangent
        want = fwAD.unpack_dual(torch.relu(F.linear(dual, w.detach(), b.detach()))).tangent
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("activation", ["relu", "tanh", "gelu", "gelu_tanh", "sigmoid",
                                        "silu", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bias", [True, False])
def test_strided_upstream_gradients_give_the_bits_of_a_contiguous_one(activation, dtype, bias):
    # The CPU's backward reads an expanded gradient (what sum() and mean() hand back), a
    # transposed one and a row-sliced one where they lie: the same bits as their contiguous
    # copies, for every output and with the bias gradient's fixed summation order; but for the
    # bias sums alone ("none") over a transposed one, which have a fixed order of their own.
    torch.manual_seed(0)
    for rows, inf, outf in ((300, 9, 17), (40, 3, 65), (21, 3, 1025)):
        _strided_gradients_give_the_bits_of_a_contiguous_one(rows, inf, outf, activation, dtype,
                                                             bias)


def _strided_gradients_give_the_bits_of_a_contiguous_one(rows, inf, outf, activation, dtype,
                                                         bias):
    # (17, 65 and 1025 columns: a transposed gradient read in blocks of 16 rows and a rest,
    # 16 columns at a time and a rest. Without an activation only the bias sum is dpcuda's:
    # the GEMMs read the gradient where it lies, as torch's do; at these shapes MKL gives them
    # the bits of the contiguous layout, at some larger ones it does not, as for torch's own mm.
    # torch.equal compares values: the data is randn, with no -0 or NaN.)
    x = torch.randn(rows, inf, dtype=dtype)
    w = torch.randn(outf, inf, dtype=dtype)
    b = torch.randn(outf, dtype=dtype) if bias else None
    out, saved = torch.ops.dpcuda.full_forward(x, w, b, activation)
    if saved.numel() == 0:  # (relu, tanh, sigmoid: the backward reads the output)
        saved = out
    grads = {
        "expanded": torch.tensor(0.37, dtype=dtype).expand(rows, outf),
        "row expanded": torch.randn(outf, dtype=dtype).expand(rows, outf),
        "column expanded": torch.randn(rows, 1, dtype=dtype).expand(rows, outf),  # y.sum(1)
        "transposed": torch.randn(outf, rows, dtype=dtype).t(),
        "row sliced": torch.randn(rows, 2 * outf, dtype=dtype)[:, ::2],
        "column sliced": torch.randn(rows, outf + 5, dtype=dtype)[:, 2:outf + 2],
    }
    mask = [True, True, bias]
    for name, g in grads.items():
        assert not g.is_contiguous()
        got = torch.ops.dpcuda.full_backward(g, x, w, saved, activation, mask)
        want = torch.ops.dpcuda.full_backward(g.contiguous(), x, w, saved, activation, mask)
        for a, c, what in zip(got, want, ("input", "weight", "bias")):
            if what == "bias" and not bias:
                continue
            if what == "bias" and activation == "none" and name == "transposed":
                # (the sums alone over a column-major gradient: added down its columns in
                # their own fixed order, equal within rounding)
                eps = torch.finfo(dtype).eps
                torch.testing.assert_close(a, c, rtol=0, atol=16 * eps * g.abs().sum(0).max())
                continue
            assert torch.equal(a, c), (name, what)


@pytest.mark.parametrize("dtype,outf", [(torch.float32, 17), (torch.float32, 65),
                                        (torch.float32, 1025), (torch.float64, 70),
                                        (torch.bfloat16, 40), (torch.bfloat16, 300),
                                        (torch.bfloat16, 16), (torch.float16, 33),
                                        (torch.float16, 32)])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_a_layer_without_activation_gives_torchs_gemms_over_any_gradient(dtype, outf, bias):
    # Without an activation the backward's GEMMs are torch's own at::mm calls over the upstream
    # gradient where it lies (csrc/torch/fused_linear.cpp, gemm_operand), as torch's backward of
    # F.linear makes them: the input's and the weight's gradients are torch's bits over an
    # expanded, a sliced and a transposed gradient; but the half types up to 32 wide over one
    # contiguous copy (equal within rounding). The bias's gradient is dpcuda's fixed-order sum
    # (within rounding of torch's).
    torch.manual_seed(2)
    rows, inf = 37, 23
    x = torch.randn(rows, inf).to(dtype)
    w = (torch.randn(outf, inf) * 0.3).to(dtype)
    b = torch.randn(outf).to(dtype) if bias else None
    grads = {"expanded": torch.tensor(0.37).to(dtype).expand(rows, outf),
             "row expanded": torch.randn(outf).to(dtype).expand(rows, outf),
             "column expanded": torch.randn(rows, 1).to(dtype).expand(rows, outf),
             "sliced": torch.randn(rows, 2 * outf).to(dtype)[:, ::2],
             "transposed": torch.randn(outf, rows).to(dtype).t()}
    copied = dtype in (torch.bfloat16, torch.float16) and outf <= 32
    eps = torch.finfo(dtype).eps
    for name, go in grads.items():
        leaves = (x, w) + ((b,) if bias else ())
        ours = [t.clone().requires_grad_() for t in leaves]
        theirs = [t.clone().requires_grad_() for t in leaves]
        ops.full_forward(ours[0], ours[1], ours[2] if bias else None, "none").backward(go)
        F.linear(theirs[0], theirs[1], theirs[2] if bias else None).backward(go)
        for a, c, what in zip(ours, theirs, ("input", "weight", "bias")):
            if what == "bias" or (copied and name != "transposed"):
                scale = 16 * eps * (1 + c.grad.float().abs().max().item())
                torch.testing.assert_close(a.grad.float(), c.grad.float(), rtol=2 * eps,
                                           atol=scale, msg=f"{name} {what}")
            else:
                assert torch.equal(a.grad, c.grad), (name, what)


def test_a_sum_of_the_output_trains_as_torch():
    # y.sum().backward() through the fused layer (an expanded upstream gradient) against
    # torch's layer.
    torch.manual_seed(1)
    from dpcuda.nn import FusedLinear
    layer = FusedLinear(64, 64, activation="gelu").double()
    plain = torch.nn.Linear(64, 64).double()
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(512, 64, dtype=torch.float64)
    layer(x).sum().backward()
    F.gelu(plain(x)).sum().backward()
    torch.testing.assert_close(layer.weight.grad, plain.weight.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.bias.grad, plain.bias.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_bias_sums_over_a_transposed_gradient_follow_their_lane_order(dtype):
    # The bias sums alone ("none") over a column-major gradient, bit for bit against their
    # order written out with torch's own elementwise adds (each one IEEE add in the sums'
    # type: float for bfloat16): row r of a column into lane r % 64, lane j += lane j + 32,
    # + 16, ..., + 1, then 0 + lane 0 (a column of -0 sums to +0), bfloat16 rounded once. Values
    # of far-apart sizes, so that another order gives other bits; NaN and +-Inf in some
    # columns; 1 and 2 threads (columns split between threads) give the same bits. (bfloat16's
    # result is the float sum rounded to 8 bits, which hides most differences of order: the
    # chunked order before this one passes its case; tests/cpp/test_fused_linear.cpp checks its
    # float sums bit for bit. float32 and float64 fail with that order.)
    acc = torch.float32 if dtype == torch.bfloat16 else dtype
    gen = torch.Generator().manual_seed(5)
    for rows in (1, 63, 100, 2049):
        cols = 37
        gt = torch.randn(cols, rows, generator=gen, dtype=torch.float64) * \
            torch.pow(2.0, torch.randint(-12, 24, (cols, rows), generator=gen).double())
        gt = gt.to(dtype)
        gt[1] = -0.0
        gt[2, rows // 2] = float("nan")
        gt[3, rows // 3] = float("inf")
        gt[4, rows // 3] = float("-inf")
        g = gt.t()
        x = torch.randn(rows, 5, dtype=dtype)
        w = torch.randn(cols, 5, dtype=dtype)
        lanes = torch.zeros(cols, 64, dtype=acc)
        full = rows - rows % 64
        for r0 in range(0, full, 64):
            lanes += gt[:, r0:r0 + 64].to(acc)
        lanes[:, :rows - full] += gt[:, full:].to(acc)
        width = 32
        while width:
            lanes[:, :width] = lanes[:, :width] + lanes[:, width:2 * width]
            width //= 2
        want = (torch.zeros((), dtype=acc) + lanes[:, 0]).to(dtype)
        threads = torch.get_num_threads()
        try:
            for n in (1, 2):
                torch.set_num_threads(n)
                got = torch.ops.dpcuda.full_backward(g, x, w, x, "none", [False, False, True])[2]
                assert got.dtype == dtype and got.shape == (cols,)
                nan = want.isnan()
                assert torch.equal(got.isnan(), nan), (rows, n)
                bits = torch.int16 if dtype == torch.bfloat16 else \
                    {torch.float32: torch.int32, torch.float64: torch.int64}[dtype]
                assert torch.equal(got[~nan].view(bits), want[~nan].view(bits)), (rows, n)
                assert not got[1].signbit()
                # (into a given bias gradient, as DataParallel's flat buffer takes it)
                gw = torch.empty(cols, 5, dtype=dtype)
                gb = torch.full((cols,), 7.0, dtype=dtype)
                torch.ops.dpcuda.full_backward_into(g, x, w, x, "none", [False, True, True], gw,
                                                    gb)
                assert torch.equal(gb[~nan].view(bits), want[~nan].view(bits)), (rows, n)
                assert torch.equal(gb.isnan(), nan)
        finally:
            torch.set_num_threads(threads)


# (rows, in, out, activation, dtype, layout of the upstream gradient): g of each shape made in
# the thread's buffer (csrc/torch/fused_linear.cpp g_scratch, g from 128 KiB to 32 MiB), larger
# and smaller after one another, in several dtypes (the buffer viewed in each), column-major
# (bfloat16 over a transposed gradient from 2048 wide up to 32 rows: the third call, cut from
# the first call's larger buffer), and g below and above the buffer's limits.
SCRATCH_CALLS = [(1000, 5, 70, "tanh", torch.float32, "dense"),
                 (40, 3, 20, "gelu", torch.float32, "expanded"),
                 (31, 4, 4096, "sigmoid", torch.bfloat16, "transposed"),
                 (300, 5, 70, "silu", torch.float64, "transposed"),
                 (4097, 2, 2049, "relu", torch.float32, "dense"),
                 (1200, 6, 90, "gelu_tanh", torch.bfloat16, "dense"),
                 (1000, 5, 70, "sigmoid", torch.float32, "expanded"),
                 (33, 7, 9, "none", torch.float32, "expanded")]


def scratch_inputs(rows, inf, outf, dtype, layout, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inf, generator=gen).to(dtype)
    w = (torch.randn(outf, inf, generator=gen) * 0.3).to(dtype)
    b = torch.randn(outf, generator=gen).to(dtype)
    go = {"dense": lambda: torch.randn(rows, outf, generator=gen),
          "expanded": lambda: torch.full((), 0.7).expand(rows, outf),
          "transposed": lambda: torch.randn(outf, rows, generator=gen).t()}[layout]().to(dtype)
    return x, w, b, go


def scratch_call(rows, inf, outf, activation, dtype, layout, seed):
    x, w, b, go = scratch_inputs(rows, inf, outf, dtype, layout, seed)
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    ops.full_forward(x, w, b, activation).backward(go)
    return x.grad, w.grad, b.grad


def test_cpu_backwards_one_after_another_keep_what_they_returned():
    # The CPU backward's g, and a float layer's bias sums where it has an activation, live in
    # buffers that the next call on the thread writes again: what a call returned must be none
    # of them. Every call's gradients, kept, must still be what the
    # same call gives when made again afterwards in the other order, bit for bit, and torch's
    # within its error, as must those of the calls made in two threads at once (each with a
    # buffer of its own; within torch's error: the GEMMs' threads may differ there).
    import threading
    kept = [scratch_call(*c, seed=k) for k, c in enumerate(SCRATCH_CALLS)]
    again = {k: scratch_call(*c, seed=k) for k, c in reversed(list(enumerate(SCRATCH_CALLS)))}
    threaded = {}

    def worker(ks):
        for k in ks:
            threaded[k] = scratch_call(*SCRATCH_CALLS[k], seed=k)
    threads = [threading.Thread(target=worker, args=(ks,))
               for ks in ([0, 2, 4, 6], [7, 5, 3, 1])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(threaded) == list(range(len(SCRATCH_CALLS)))
    for k, (rows, inf, outf, activation, dtype, layout) in enumerate(SCRATCH_CALLS):
        for got, same in zip(kept[k], again[k]):
            assert torch.equal(got, same), SCRATCH_CALLS[k]
        x, w, b, go = scratch_inputs(rows, inf, outf, dtype, layout, seed=k)
        want = ref.full_backward(go.double(), x.double(), w.double(), b.double(), activation)
        plain = ref.full_backward(go, x, w, b, activation)
        for got, other, pl, wa in zip(kept[k], threaded[k], plain, want):
            assert_within_torch_error(got, pl, wa, ATOL[dtype] * max(rows, inf))
            assert_within_torch_error(other, pl, wa, ATOL[dtype] * max(rows, inf))
