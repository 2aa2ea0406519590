"""What one DataParallel step issues (#13 item 3), counted where it can be on the CPU: the ATen
and dpcuda ops of a steady-state step, seen by a TorchDispatchMode. Each op that touches a
replica's tensors is at least one kernel launch on a GPU (the README's launch table maps them to
kernels); a new op on this path fails the budget test. And the gradient path that makes the
budget: the fused layers' backwards write their gradients into the flat buffer, which autograd
takes as .grad with no zeroing, copy or accumulation, with the same results as torch."""
import collections

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import reference_train
from dpcuda.nn import FusedLinear, FusedMLP, SoftmaxCrossEntropyLoss
from dpcuda.parallel import DataParallel


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__) if func.namespace == "aten"
                        else f"{func.namespace}.{func.overloadpacket.__name__}")
        return func(*args, **(kwargs or {}))


def test_a_fused_step_issues_no_zeroing_seed_scale_or_accumulation():
    torch.manual_seed(0)
    dp = DataParallel(FusedMLP([784, 256, 10]), ["cpu", "cpu"], lr=0.1, momentum=0.9)
    x, y = torch.randn(256, 784), torch.randint(0, 10, (256,))
    loss_fn = SoftmaxCrossEntropyLoss()
    dp.step(x, y, loss_fn)
    with OpLog() as log:
        dp.step(x, y, loss_fn)
    ops = collections.Counter(log.ops)
    # Per replica: 2 layer forwards, the loss and its gradient in one op, 2 layer backwards
    # writing into the buffer, the status read (which sums the per-row losses); then one fused
    # reduction + update.
    assert ops["dpcuda.full_forward"] == 4
    assert ops["dpcuda.loss_grad"] == 2
    assert ops["dpcuda.full_backward_into"] == 4
    assert ops["dpcuda.full_backward"] == 0
    assert ops["dpcuda.reduce_sgd_"] == 1
    assert ops["dpcuda.step_status"] == 2  # the loss, the NaN/Inf check and the flag, read
    # Replica 1 takes the model's weights before the forward: one flat copy (every forward
    # makes it; version counters cannot tell that nothing moved them).
    assert ops["copy_"] == 1
    # And nothing else: every op that is not a view of a tensor (no data moved) is counted, so
    # any op joining the step (a mul, a sum, an mm) fails here. The outputs' allocations
    # (empty) and the blocking step's reads of its two 4-value records on the host (3 values
    # each: _local_scalar_dense) are counted too.
    views = ("detach", "view", "select", "slice", "alias", "_unsafe_view", "as_strided")
    assert {k: v for k, v in ops.items() if k not in views} == {
        "dpcuda.full_forward": 4, "dpcuda.loss_grad": 2, "dpcuda.full_backward_into": 4,
        "dpcuda.step_status": 2, "dpcuda.reduce_sgd_": 1, "copy_": 1, "empty": 6,
        "_local_scalar_dense": 6}, ops
    for r in dp._replicas:  # the fused update consumed the gradient: .grad is None
        assert all(r.params[i].grad is None for i in r.trainable)


class Tied(nn.Module):
    """Shapes the fused path must not get wrong: one weight in two fused layers, a fused layer
    called twice, a plain nn.Linear, a frozen bias and a parameter this forward never uses."""

    def __init__(self):
        super().__init__()
        self.a = FusedLinear(12, 12, activation="tanh")
        self.b = FusedLinear(12, 12, activation="relu")
        self.b.weight = self.a.weight  # tied
        self.c = nn.Linear(12, 12)
        self.d = FusedLinear(12, 5, activation="none")
        self.d.bias.requires_grad_(False)
        self.unused = nn.Parameter(torch.randn(3))

    def forward(self, x):
        h = self.b(self.a(x))
        h = self.a(h)  # a second call of the same layer
        return self.d(torch.relu(self.c(h)))


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_the_fused_gradient_path_matches_torch_on_awkward_models(replicas):
    torch.manual_seed(replicas)
    model = Tied().double()
    data = [(torch.randn(7, 12, dtype=torch.float64), torch.randint(0, 5, (7,)))
            for _ in range(4)]
    want = reference_train(model, data, 0.1, 0.9, 1e-3)
    dp = DataParallel(copy_of(model), ["cpu"] * replicas, lr=0.1, momentum=0.9,
                      weight_decay=1e-3)
    for x, y in data:
        dp.step(x, y, SoftmaxCrossEntropyLoss())
    got = dict(dp.module.named_parameters())
    for name, p in want.named_parameters():
        torch.testing.assert_close(got[name], p, rtol=1e-10, atol=1e-12, msg=name)


def copy_of(model):
    import copy
    return copy.deepcopy(model)


def test_a_replica_without_rows_contributes_zero_gradients():
    # Weighted split with a zero weight: replica 1 gets no rows at every step; its buffer,
    # never zeroed by a kernel, must still hold zeros and not the last step's gradient.
    torch.manual_seed(5)
    model = FusedMLP([6, 8, 3]).double()
    data = [(torch.randn(9, 6, dtype=torch.float64), torch.randint(0, 3, (9,)))
            for _ in range(3)]
    want = reference_train(model, data, 0.2, 0.0, 0.0)
    dp = DataParallel(copy_of(model), ["cpu", "cpu"], lr=0.2)
    for i, (x, y) in enumerate(data):
        dp._speed = [1.0, 1.0] if i == 0 else None
        dp.step(x, y, SoftmaxCrossEntropyLoss())
    for (name, p), q in zip(want.named_parameters(), dp.module.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-10, atol=1e-12, msg=name)


def test_a_failed_step_leaves_no_grad_and_no_layer_writing_into_the_buffer():
    # (.grad None: what the buffers hold after a failed step is no gradient of the batch; the
    # fused layers no longer write into them)
    dp = DataParallel(FusedMLP([6, 8, 3]), ["cpu", "cpu"], lr=0.2)
    before = [p.detach().clone() for p in dp.module.parameters()]
    with pytest.raises(ValueError, match="labels must be class indices"):
        dp.step(torch.randn(4, 6), torch.tensor([0, 1, 7, 2]), SoftmaxCrossEntropyLoss())
    assert all(torch.equal(a, b) for a, b in zip(before, dp.module.parameters()))
    for r in dp._replicas:
        assert all(r.params[i].grad is None for i in r.trainable)
        assert all(m._grads_into is None for m, _, _ in r.fused)
    # and the next step trains as if nothing had happened
    dp.step(torch.randn(4, 6), torch.tensor([0, 1, 2, 2]), SoftmaxCrossEntropyLoss())


def test_grads_into_checks_its_destinations():
    from dpcuda import ops
    x = torch.randn(4, 6)
    w = torch.randn(3, 6, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    for bad, match in ((torch.empty(6, 3), "grad_weight must have shape"),
                       (torch.empty(3, 6, dtype=torch.float64), "grad_weight must have dtype"),
                       (torch.empty(6, 3).t(), "grad_weight must be contiguous")):
        with pytest.raises(ValueError, match=match):
            ops.full_forward(x, w, b, "relu", _grads_into=(bad, None))
    gw, gb = torch.full((3, 6), 7.0), torch.full((3,), 7.0)
    ops.full_forward(x, w, b, "relu", _grads_into=(gw, gb)).sum().backward()
    w2, b2 = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    torch.relu(nn.functional.linear(x, w2, b2)).sum().backward()
    torch.testing.assert_close(gw, w2.grad)
    torch.testing.assert_close(gb, b2.grad)
    assert w.grad.data_ptr() == gw.data_ptr() and b.grad.data_ptr() == gb.data_ptr()


def test_grads_into_onto_an_existing_grad_accumulates_as_torch():
    # The destination is .grad itself after the first backward: micro-batch accumulation and a
    # retained graph must add, as torch does (the node then takes the usual path). (Two nodes
    # given one destination in one backward would not: DataParallel never does that, and
    # _grads_into is not an API.)
    from dpcuda import ops
    torch.manual_seed(3)
    w0, b0 = torch.randn(3, 6, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    xs = [torch.randn(4, 6, dtype=torch.float64) for _ in range(2)]

    def torch_grads(run):
        w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
        run(lambda x: torch.tanh(nn.functional.linear(x, w, b)))
        return w.grad, b.grad

    def dpcuda_grads(run):
        w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
        gw, gb = torch.zeros_like(w0), torch.zeros_like(b0)
        run(lambda x: ops.full_forward(x, w, b, "tanh", _grads_into=(gw, gb)))
        return w.grad, b.grad

    def micro_batches(f):
        for x in xs:
            f(x).pow(2).sum().backward()

    def retained(f):
        y = f(xs[0])
        y.sum().backward(retain_graph=True)
        y.pow(2).sum().backward()

    def saved_on_cpu(f):  # saved-tensor hooks hand the backward copies of what it saved
        with torch.autograd.graph.save_on_cpu():
            micro_batches(f)

    for run in (micro_batches, retained, saved_on_cpu):
        for got, want in zip(dpcuda_grads(run), torch_grads(run)):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=run.__name__)


def test_grads_into_refuses_what_is_not_a_pair_of_separate_tensors():
    from dpcuda import ops
    x, w, b = torch.randn(4, 6), torch.randn(3, 6, requires_grad=True), torch.randn(3)
    for bad in ((torch.empty(3, 6),), [None, None, None], ("a", None), torch.empty(2, 3, 6)):
        with pytest.raises(TypeError, match="_grads_into"):
            ops.full_forward(x, w, b, "relu", _grads_into=bad)
    flat = torch.empty(21)
    with pytest.raises(ValueError, match="overlap"):
        ops.full_forward(x, w, b, "relu", _grads_into=(flat[:18].view(3, 6), flat[15:18]))


def test_a_gradient_hook_gets_a_tensor_of_its_own():
    torch.manual_seed(4)
    model = FusedMLP([6, 8, 3]).double()
    dp = DataParallel(model, ["cpu"], lr=0.1)
    seen = []
    dp.module.layers[0].weight.register_hook(lambda g: seen.append(g))
    data = [(torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 3, (5,)))
            for _ in range(3)]
    ref = copy_of(model)
    want = []
    for x, y in data:
        dp.step(x, y, SoftmaxCrossEntropyLoss())
        ref.zero_grad()
        F_loss = nn.functional.cross_entropy(ref(x), y)
        F_loss.backward()
        want.append(ref.layers[0].weight.grad.clone())
        with torch.no_grad():
            for p in ref.parameters():
                p -= 0.1 * p.grad
    assert len(seen) == 3
    for g, w in zip(seen, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_a_step_without_grad_raises_as_torch():
    dp = DataParallel(FusedMLP([6, 8, 3]), ["cpu", "cpu"], lr=0.1)
    before = [p.detach().clone() for p in dp.module.parameters()]
    with torch.no_grad(), pytest.raises(RuntimeError, match="does not require grad"):
        dp.step(torch.randn(4, 6), torch.tensor([0, 1, 2, 0]), SoftmaxCrossEntropyLoss())
    assert all(torch.equal(a, b) for a, b in zip(before, dp.module.parameters()))


def test_step_status_reads_the_loss_the_flag_and_any_nan_or_inf():
    work = torch.zeros(0, dtype=torch.int32)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        g = torch.randn(1000).to(dtype)
        for bad in (None, float("nan"), float("inf"), -float("inf")):
            if bad is not None:
                g[int(torch.randint(0, 1000, ()))] = bad
            for clear in (False, True):
                flag = torch.ones(1, dtype=torch.int32)
                out = torch.ops.dpcuda.step_status(g, torch.tensor(2.5), flag, work, clear)
                assert out.dtype == torch.float64
                assert out.tolist() == [2.5, 0.0 if bad is None else 1.0, 1.0, 0.0]
                assert int(flag) == (0 if clear else 1)
    # finite elements whose sum overflows: not a NaN or an Inf (the exact test decides)
    for dtype, big in ((torch.float32, 3e38), (torch.float64, 1.7e308), (torch.float16, 6e4),
                       (torch.bfloat16, 3e38)):
        out = torch.ops.dpcuda.step_status(torch.full((10,), big, dtype=dtype),
                                           torch.tensor(1.0), None, work, True)
        assert out.tolist() == [1.0, 0.0, 0.0, 0.0], dtype
    out = torch.ops.dpcuda.step_status(torch.zeros(0), torch.tensor(1.0), None, work, True)
    assert out.tolist() == [1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="grad must be a contiguous 1-D"):
        torch.ops.dpcuda.step_status(torch.zeros(2, 2), torch.tensor(1.0), None, work, True)
    # per-row losses: their sum, in float64
    rows = torch.randn(300, dtype=torch.float32)
    out = torch.ops.dpcuda.step_status(torch.zeros(2), rows, None, work, True)
    assert out[0].item() == pytest.approx(rows.double().sum().item(), rel=1e-12, abs=1e-12)
    out = torch.ops.dpcuda.step_status(torch.zeros(2), torch.zeros(0), None, work, True)
    assert out.tolist() == [0.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="loss must be floating point"):
        torch.ops.dpcuda.step_status(torch.zeros(2), torch.zeros(2, dtype=torch.int64), None,
                                     work, True)
    with pytest.raises(ValueError, match="grad must be float32, float64, float16 or bfloat16"):
        torch.ops.dpcuda.step_status(torch.zeros(2, dtype=torch.float8_e4m3fn),
                                     torch.tensor(1.0), None, work, True)
    with pytest.raises(ValueError, match="workspace must be int32"):
        torch.ops.dpcuda.step_status(torch.zeros(2), torch.tensor(1.0), None, torch.zeros(1),
                                     True)
    with pytest.raises(ValueError, match="label_flag must be one int32"):
        torch.ops.dpcuda.step_status(torch.zeros(2), torch.tensor(1.0), torch.zeros(1), work,
                                     True)


def test_the_backward_goes_through_torch_where_a_torch_function_mode_or_subclass_is_there():
    # The step hands the logits' gradient straight to autograd's engine (no checks of a
    # gradient it made itself), but a torch function mode or a tensor subclass must see the
    # backward as in torch's own loop, and the step's results are the same either way.
    from torch.overrides import TorchFunctionMode

    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    def run(mode):
        torch.manual_seed(0)
        model = FusedMLP([6, 5, 3])
        dp = DataParallel(model, ["cpu"], lr=0.1, momentum=0.9)
        loss_fn = SoftmaxCrossEntropyLoss()
        losses = []
        for _ in range(3):
            x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
            if mode is None:
                losses.append(dp.step(x, y, loss_fn))
            else:
                with mode:
                    losses.append(dp.step(x, y, loss_fn))
        return losses, [p.detach().clone() for p in model.parameters()]

    seen = Seen()
    la, pa = run(None)
    lb, pb = run(seen)
    assert "backward" in seen.names
    assert la == lb and all(torch.equal(p, q) for p, q in zip(pa, pb))
