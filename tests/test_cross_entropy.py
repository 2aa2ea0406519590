import pytest
import torch
import torch.nn.functional as F

from dpcuda import _C, ops, reference as ref
from conftest import DEVICES, assert_within_torch_error, dtypes_for

ATOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
CASES = [(d, t) for d in DEVICES for t in dtypes_for(d)]


def labels_for(rows, classes, device, ignore_every=0, ignore_index=-100):
    y = torch.randint(0, classes, (rows,), device=device)
    if ignore_every:
        y[::ignore_every] = ignore_index
    return y


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("rows,classes", [(1, 1), (3, 17), (17, 3), (64, 1000), (5, 4099)])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_loss_grad_matches_reference(device, dtype, rows, classes, smoothing):
    z = (torch.randn(rows, classes, dtype=torch.float64) * 4).to(device)
    y = labels_for(rows, classes, device, ignore_every=3)
    loss, grad = torch.ops.dpcuda.loss_grad(z.to(dtype), y, 0.5, smoothing, -100, True)
    want_loss, want_grad = ref.loss_grad(z, y, 0.5, smoothing)
    plain_loss, plain_grad = ref.loss_grad(z.to(dtype), y, 0.5, smoothing)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert grad.dtype == dtype
    assert_within_torch_error(loss, plain_loss, want_loss, ATOL[dtype] * 10)
    assert_within_torch_error(grad, plain_grad, want_grad, ATOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_softmax_cross_entropy_matches_torch(device, reduction, smoothing, ignore_index):
    z = torch.randn(33, 7, device=device, dtype=torch.float64, requires_grad=True)
    y = labels_for(33, 7, device, ignore_every=4, ignore_index=ignore_index)
    ours = ops.softmax_cross_entropy(z, y, reduction, smoothing, ignore_index)
    want = F.cross_entropy(z, y, reduction=reduction, label_smoothing=smoothing,
                           ignore_index=ignore_index)
    torch.testing.assert_close(ours, want)
    w = torch.randn_like(want)
    (g_ours,) = torch.autograd.grad((ours * w).sum(), z)
    (g_want,) = torch.autograd.grad((want * w).sum(), z)
    torch.testing.assert_close(g_ours, g_want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("seed", range(4))
def test_non_finite_logits_match_torch(device, smoothing, seed):
    # Masked classes (-inf away from the label) at random positions, and rows with +inf, NaN or
    # only -inf: loss and gradient as torch's, NaN where torch's is NaN.
    g = torch.Generator().manual_seed(seed)
    rows, classes = 24, 37
    z = torch.randn(rows, classes, generator=g, dtype=torch.float64) * 3
    y = torch.randint(0, classes, (rows,), generator=g)
    masked = torch.rand(rows, classes, generator=g) < 0.3
    masked[torch.arange(rows), y] = False
    z[masked] = float("-inf")
    z[0] = float("-inf")
    z[1, 5] = float("inf")
    z[2, 7] = float("nan")
    z = z.to(device).requires_grad_(True)
    y = y.to(device)
    ours = ops.softmax_cross_entropy(z, y, "none", smoothing)
    want = F.cross_entropy(z, y, reduction="none", label_smoothing=smoothing)
    torch.testing.assert_close(ours, want, equal_nan=True)
    w = torch.rand(rows, dtype=torch.float64, device=device)
    (g_ours,) = torch.autograd.grad((torch.nan_to_num(ours) * w).sum(), z)
    (g_want,) = torch.autograd.grad((torch.nan_to_num(want) * w).sum(), z)
    torch.testing.assert_close(g_ours[3:], g_want[3:], equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_every_label_ignored_is_torchs_nan_loss_and_zero_gradient(device, smoothing):
    # A mean over no rows: NaN, and a zero gradient whatever flows back (g / 0 must not make it
    # NaN). Labels on the host (the count read there) and as a tensor count (labels on device).
    from dpcuda.nn import SoftmaxCrossEntropyLoss
    logits = torch.randn(5, 4, device=device)
    labels = torch.full((5,), -100, device=device)
    for upstream in (1.0, float("nan")):
        ours = logits.clone().requires_grad_()
        theirs = logits.clone().requires_grad_()
        loss = SoftmaxCrossEntropyLoss(label_smoothing=smoothing)(ours, labels)
        want = F.cross_entropy(theirs, labels, label_smoothing=smoothing)
        assert torch.isnan(loss) and torch.isnan(want)
        loss.backward(torch.tensor(upstream, device=device))
        want.backward(torch.tensor(upstream, device=device))
        torch.testing.assert_close(ours.grad, theirs.grad, equal_nan=True)
        assert torch.equal(ours.grad, torch.zeros_like(ours.grad))


@pytest.mark.parametrize("device", DEVICES)
def test_unbatched_and_empty(device):
    z = torch.randn(5, device=device)
    y = torch.tensor(3, device=device)
    torch.testing.assert_close(ops.softmax_cross_entropy(z, y), F.cross_entropy(z, y))
    empty = torch.empty(0, 4, device=device, requires_grad=True)
    no_labels = torch.empty(0, dtype=torch.long, device=device)
    assert ops.softmax_cross_entropy(empty, no_labels, "sum").item() == 0.0
    assert ops.softmax_cross_entropy(empty, no_labels, "none").shape == (0,)


@pytest.mark.parametrize("device", DEVICES)
def test_loss_grad_wrapper_scale(device):
    z = torch.randn(10, 6, device=device)
    y = labels_for(10, 6, device, ignore_every=5)
    loss, grad = ops.loss_grad(z, y)
    zr = z.clone().requires_grad_()
    want = F.cross_entropy(zr, y)
    want.backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(grad, zr.grad)
    loss2, grad2 = ops.loss_grad(z, y, scale=0.1)
    torch.testing.assert_close(loss2, F.cross_entropy(z, y, reduction="sum") * 0.1)
    torch.testing.assert_close(grad2, zr.grad * 8 * 0.1)


def test_extreme_logits_stay_finite():
    z = torch.tensor([[1e4, 0.0, -1e4], [-1e4, -1e4, -1e4]])
    y = torch.tensor([1, 2])
    loss, grad = ops.loss_grad(z, y, scale=1.0)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(loss, F.cross_entropy(z, y, reduction="sum"))


def test_gradcheck():
    z = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 1, 4, -100, 2, 3])
    for reduction in ("mean", "sum", "none"):
        assert torch.autograd.gradcheck(
            lambda z: ops.softmax_cross_entropy(z, y, reduction, 0.1), (z,))
    assert torch.autograd.gradcheck(
        lambda z: torch.ops.dpcuda.loss_grad(z, y, 0.3, 0.05, -100, True)[0], (z,))


@pytest.fixture(params=["as is", "read as GPU labels"])
def gpu_label_path(request):
    """On the CPU, "read as GPU labels" sends CPU labels down the path of labels on a GPU in the
    loss's autograd node (copied to host memory, checked there, the mean's count as the
    kernel's scale), so that a machine without a GPU tests that path too."""
    previous = _C._read_cpu_labels_for_tests(request.param != "as is")
    yield request.param
    _C._read_cpu_labels_for_tests(previous)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device, gpu_label_path):
    z = torch.randn(6, 5, device=device, requires_grad=True)
    y = torch.tensor([0, 1, 4, -100, 2, 3], device=device)
    torch.library.opcheck(torch.ops.dpcuda.loss_grad.default, (z, y, 1.0, 0.0, -100, True))
    torch.library.opcheck(torch.ops.dpcuda.loss_grad.default,
                          (z, y.clamp(min=0), 0.5, 0.1, 2, True))
    for reduction in ("mean", "sum", "none"):
        torch.library.opcheck(torch.ops.dpcuda.softmax_cross_entropy.default,
                              (z, y, reduction, 0.1, -100))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_raise_named_errors(device):
    z = torch.randn(4, 5, device=device)
    y = torch.tensor([0, 1, 2, 3], device=device)
    with pytest.raises(ValueError, match=r"labels must be class indices in \[0, 5\).*got 5 at "
                                         r"position 2"):
        ops.softmax_cross_entropy(z, torch.tensor([0, 1, 5, 3], device=device))
    with pytest.raises(ValueError, match="got -1 at position 0"):
        ops.softmax_cross_entropy(z, torch.tensor([-1, 1, 2, 3], device=device))
    with pytest.raises(ValueError, match="labels must have shape"):
        ops.softmax_cross_entropy(z, y[:3])
    with pytest.raises(ValueError, match="logits must have shape"):
        ops.softmax_cross_entropy(z[None], y)
    with pytest.raises(TypeError, match="labels must be integer"):
        ops.softmax_cross_entropy(z, y.float())
    with pytest.raises(ValueError, match="label_smoothing must be"):
        ops.softmax_cross_entropy(z, y, label_smoothing=1.5)
    with pytest.raises(ValueError, match="reduction must be one of"):
        ops.softmax_cross_entropy(z, y, reduction="avg")
    with pytest.raises(TypeError, match="labels must be int64"):
        torch.ops.dpcuda.loss_grad(z, y.int(), 1.0, 0.0, -100, True)
    if device != "cpu":
        with pytest.raises(ValueError, match="labels must be on the same device"):
            ops.softmax_cross_entropy(z, y.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [300, 70000])  # on CUDA: labels read to the host, or the flag
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_training_call_checks_labels_and_matches_torch(device, rows, reduction, gpu_label_path):
    # A loss that needs a gradient takes the autograd node's path: on CUDA, up to 65536 labels
    # are read into host memory once (the check, and the mean's count as the kernel's scale);
    # more keep the device count and the kernel's flag. Both must give torch's loss and
    # gradient, ignored rows included, and name a bad label's position.
    gen = torch.Generator().manual_seed(rows)
    z = (torch.randn(rows, 7, generator=gen, dtype=torch.float64) * 3).to(device)
    y = torch.randint(0, 7, (rows,), generator=gen).to(device)
    y[::5] = -100
    got_z, want_z = z.clone().requires_grad_(), z.clone().requires_grad_()
    got = ops.softmax_cross_entropy(got_z, y, reduction, 0.1)
    want = F.cross_entropy(want_z, y, reduction=reduction, label_smoothing=0.1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    seed = torch.randn(got.shape, generator=gen, dtype=torch.float64).to(device)
    got.backward(seed)
    want.backward(seed)
    torch.testing.assert_close(got_z.grad, want_z.grad, rtol=1e-12, atol=1e-12)
    assert_checks_not_deferred()
    for bad in (7, -3):
        y_bad = y.clone()
        y_bad[rows - 2] = bad
        with pytest.raises(ValueError, match=rf"got {bad} at position {rows - 2}\b"):
            ops.softmax_cross_entropy(z.clone().requires_grad_(), y_bad, reduction)
        assert_checks_not_deferred()
    # The error left nothing behind: the next call on good labels is torch's again.
    again = ops.softmax_cross_entropy(z.clone().requires_grad_(), y, reduction, 0.1)
    torch.testing.assert_close(again, want.detach(), rtol=1e-12, atol=1e-12)


def assert_checks_not_deferred():
    """The loss turns the adapter's own label check off only for its call: it must be on again
    afterwards, also after an error (a leak would let later bad labels through on CUDA)."""
    assert _C._defer_label_checks(False) is False


@pytest.mark.parametrize("device", DEVICES)
def test_training_call_raises_the_adapters_errors_before_a_labels(device, gpu_label_path):
    # Arguments the adapter refuses keep its error even when a label is bad too: the labels are
    # read and checked first only for arguments it accepts.
    z = torch.randn(3, 4, device=device, requires_grad=True)
    y = torch.tensor([0, 1, 9], device=device)
    with pytest.raises(ValueError, match="at least one class"):
        ops.softmax_cross_entropy(torch.randn(3, 0, device=device, requires_grad=True),
                                  torch.zeros(3, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="label_smoothing must be"):
        torch.ops.dpcuda.softmax_cross_entropy(z, y, "mean", 2.0, -100)
    with pytest.raises(TypeError, match="dtype|float"):
        ops.softmax_cross_entropy(torch.randn(3, 4, dtype=torch.complex64, device=device,
                                              requires_grad=True), y)
    assert_checks_not_deferred()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("incoming", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_incoming_gradient_keeps_ignored_rows_at_torchs(device, reduction, incoming,
                                                                   gpu_label_path):
    # torch's ignored rows never see the gradient that comes into the loss: with a NaN or Inf
    # coming in they stay 0 (NaN where their logits are NaN), and the other rows take it.
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(9, 4, generator=gen, dtype=torch.float64)
    z[4, 1] = float("nan")  # an ignored row whose log_softmax is NaN
    z = z.to(device)
    for y in (torch.tensor([0, -100, 3, 1, -100, 2, -100, 0, 1]),
              torch.full((9,), -100), torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0])):
        y = y.to(device)
        got_z, want_z = z.clone().requires_grad_(), z.clone().requires_grad_()
        got = ops.softmax_cross_entropy(got_z, y, reduction, 0.1)
        want = F.cross_entropy(want_z, y, reduction=reduction, label_smoothing=0.1)
        seed = torch.full(got.shape, incoming, dtype=torch.float64, device=device)
        if reduction == "none":
            seed[::2] = 1.5  # finite on some rows, non-finite on the others
        got.backward(seed)
        want.backward(seed)
        if incoming != incoming:  # NaN: torch's values exactly, NaN where torch's are
            torch.testing.assert_close(got_z.grad, want_z.grad, rtol=1e-12, atol=1e-12,
                                       equal_nan=True)
        else:  # +-Inf: non-finite where torch's are (torch's arithmetic makes some of them NaN
            # where dpcuda's product gives +-Inf), torch's finite values elsewhere
            finite = torch.isfinite(want_z.grad)
            assert torch.equal(torch.isfinite(got_z.grad), finite)
            torch.testing.assert_close(got_z.grad[finite], want_z.grad[finite], rtol=1e-12,
                                       atol=1e-12)
