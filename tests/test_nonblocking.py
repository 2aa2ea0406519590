"""DataParallel(blocking=False): the update skips itself from the replicas' status records (on
the device, with no host read), step() returns the loss as a device tensor, and what a step
found (NaN/Inf gradients, a bad label) is read a step later or at synchronize(). Held against
the blocking step, which tests/test_parallel.py holds against torch.optim.SGD. On the CPU here;
tests/test_cuda_step.py runs the CUDA cases where a GPU is present."""

import collections
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import dpcuda.optim
from dpcuda.nn import SoftmaxCrossEntropyLoss
from dpcuda.parallel import DataParallel
from dpcuda.parallel import step as step_module
from dpcuda.parallel.pending import PendingStep
from conftest import make_model


def batches(steps, rows=24, seed=0, nan_steps=(), ignore_steps=(), all_ignored_steps=()):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        x = torch.randn(rows, 12, generator=gen)
        y = torch.randint(0, 5, (rows,), generator=gen)
        if s in nan_steps:
            x[int(torch.randint(0, rows, (1,), generator=gen)), 3] = float("nan")
        if s in ignore_steps:
            y[::3] = -100
        if s in all_ignored_steps:
            y[:] = -100
        out.append((x, y))
    return out


def run(blocking, model, devices, data, loss_fn, **kw):
    dp = DataParallel(model, devices, lr=0.1, blocking=blocking, **kw)
    losses, warned = [], []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for x, y in data:
            loss = dp.step(x, y, loss_fn)
            losses.append(loss)
        if not blocking:
            dp.synchronize()
    warned = [str(m.message) for m in w if "NaN or Inf" in str(m.message)]
    return dp, losses, warned


@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("algorithm", ["auto", "one_shot", "two_shot", "ring"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_nonblocking_training_is_the_blocking_training_bit_for_bit(replicas, fused, algorithm,
                                                                   dtype):
    data = [(x.to(dtype), y) for x, y in
            batches(8, nan_steps=(2, 5), ignore_steps=(3,), all_ignored_steps=(6,))]
    loss_fn = SoftmaxCrossEntropyLoss() if fused else torch.nn.CrossEntropyLoss()
    kw = dict(momentum=0.9, weight_decay=1e-3, algorithm=algorithm)
    a, la, wa = run(True, make_model(fused, dtype), ["cpu"] * replicas, data, loss_fn, **kw)
    b, lb, wb = run(False, make_model(fused, dtype), ["cpu"] * replicas, data, loss_fn, **kw)
    for x, y in zip(la, lb):
        assert isinstance(y, torch.Tensor) and y.dim() == 0 and y.dtype == torch.float64
        assert y.device == torch.device("cpu")
        assert (x != x and y != y) or x == y.item(), (x, y)
    assert wa == wb and len(wa) == 2  # the same warnings, naming the same steps
    assert a.skipped_steps == b.skipped_steps == 2 and a.steps == b.steps == 8
    for p, q in zip(a.module.parameters(), b.module.parameters()):
        assert torch.equal(p, q)
    for r in b.replicas[1:]:
        for p, q in zip(r.parameters(), b.module.parameters()):
            assert torch.equal(p, q)


def test_a_skipped_step_warns_at_the_next_call_and_counts_after_it():
    dp = DataParallel(make_model(False), ["cpu", "cpu"], lr=0.1, momentum=0.9, blocking=False)
    (x0, y0), (x1, y1), (x2, y2) = batches(3)
    dp.step(x0, y0, F.cross_entropy)
    before = [p.detach().clone() for p in dp.module.parameters()]
    x1 = x1.clone()
    x1[-1, 0] = float("inf")  # only the second replica's rows see it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = dp.step(x1, y1, F.cross_entropy)  # no warning yet: nothing is read
    # (the blocking step's loss too: the Inf row's logits give a NaN cross-entropy)
    assert loss.dtype == torch.float64 and torch.isnan(loss)
    # the update skipped itself: weights and momentum as they were
    assert all(torch.equal(p, b) for p, b in zip(dp.module.parameters(), before))
    assert dp.skipped_steps == 0
    with pytest.warns(RuntimeWarning, match="step 1 has NaN or Inf gradients; skipped"):
        dp.step(x2, y2, F.cross_entropy)
    assert dp.skipped_steps == 1
    assert not all(torch.equal(p, b) for p, b in zip(dp.module.parameters(), before))
    dp.synchronize()
    dp.synchronize()  # nothing left: no second warning, no error
    assert dp.skipped_steps == 1


class _Flagged:
    """The CUDA loss kernel's bad-label flag, simulated on the CPU (as test_parallel does)."""

    def __init__(self, monkeypatch):
        self.flags = {}
        monkeypatch.setattr(DataParallel, "_flag_tensor", staticmethod(self.flag_of))
        known = step_module.summed_loss

        def summed_loss(loss_fn, targets):  # the flagging loss taken as a known mean loss
            if loss_fn == self.loss:
                return (lambda out, y: self.loss(out, y, "sum")), -100
            return known(loss_fn, targets)
        monkeypatch.setattr(step_module, "summed_loss", summed_loss)

    def flag_of(self, device):
        return self.flags.setdefault(device, torch.zeros(1, dtype=torch.int32))

    def loss(self, out, y, reduction="mean"):  # its kernel saw a bad label (read it clamped)
        self.flag_of(out.device).fill_(1)
        return F.cross_entropy(out, y.clamp(0, out.shape[1] - 1), reduction=reduction)


def test_a_bad_label_raises_at_the_next_call_naming_step_and_position(monkeypatch):
    flagged = _Flagged(monkeypatch)
    dp = DataParallel(make_model(False), ["cpu"], lr=0.1, momentum=0.9, blocking=False)
    (x0, y0), (x1, y1), (x2, y2) = batches(3)
    dp.step(x0, y0, F.cross_entropy)
    dp.synchronize()
    before = [p.detach().clone() for p in dp.module.parameters()]
    momentum = dp._replicas[0].momentum.clone()
    bad = y1.clone()
    bad[9] = 7
    dp.step(x1, bad, flagged.loss)  # returns: the device skips the update by itself
    assert all(torch.equal(p, b) for p, b in zip(dp.module.parameters(), before))
    assert torch.equal(dp._replicas[0].momentum, momentum)
    with pytest.raises(ValueError, match=r"step 1: labels must be class indices in \[0, 5\) or "
                                         r"ignore_index \(-100\); got 7 at position 9 \(that "
                                         r"step's update was not applied; nothing of this call "
                                         r"ran"):
        dp.step(x2, y2, F.cross_entropy)
    # this call ran nothing: no step counted, no weight moved
    assert dp.steps == 2
    assert all(torch.equal(p, b) for p, b in zip(dp.module.parameters(), before))
    dp.step(x2, y2, F.cross_entropy)  # and training goes on
    dp.synchronize()
    assert dp.steps == 3
    assert not all(torch.equal(p, b) for p, b in zip(dp.module.parameters(), before))


def test_a_bad_label_the_targets_no_longer_hold_still_raises(monkeypatch):
    flagged = _Flagged(monkeypatch)
    dp = DataParallel(make_model(False), ["cpu"], lr=0.1, blocking=False)
    x, y = batches(1)[0]
    reused = y.clone()
    dp.step(x, reused, flagged.loss)
    reused.zero_()  # the caller reused its label buffer before the step was read
    with pytest.raises(ValueError, match="step 0: a label outside .* no longer hold it"):
        dp.synchronize()


class _Event:
    """A CUDA event's host side: not done until the host waits for it."""

    def __init__(self, log, step):
        self.log, self.step, self.done = log, step, False

    def query(self):
        return self.done

    def synchronize(self):
        self.log.append(self.step)
        self.done = True


def test_the_host_waits_only_for_the_step_lag_steps_back():
    dp = DataParallel(make_model(False), ["cpu"], lr=0.1, blocking=False)
    assert dp.lag == 2
    waited = []
    clear = torch.zeros(4, dtype=torch.float64)
    for step in range(2):
        dp._pending.append(PendingStep(step, [clear], [_Event(waited, step)], None, None, 5))
    dp._settle(wait=False)  # two steps in flight: the older one is waited for, not the newer
    assert waited == [0] and len(dp._pending) == 1
    dp._settle(wait=False)  # one in flight: no wait
    assert waited == [0] and len(dp._pending) == 1
    dp._pending[0].events[0].done = True  # the device finished it: read with no wait
    dp._settle(wait=False)
    assert waited == [0] and not dp._pending
    dp._pending.append(PendingStep(7, [clear], [_Event(waited, 7)], None, None, 5))
    dp.synchronize()  # waits for everything
    assert waited == [0, 7] and not dp._pending


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


# The ops that read a tensor's value on the host.
READS = ("_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal")


def logged_steps(data, step):
    """step(x, y) on data[0], then on the rest under an op log: the ops, and those that read a
    tensor on the host."""
    step(*data[0])
    with _OpLog() as log:
        for x, y in data[1:]:
            step(x, y)
    return log.ops, {op: log.ops[op] for op in READS if log.ops[op]}


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("count_on_device", [False, True])
def test_a_nonblocking_step_reads_no_tensor_on_the_host(monkeypatch, fused, count_on_device):
    # Reading a tensor's value on the host (.item(), float(), bool(), .tolist(), .nonzero())
    # is what synchronises with a GPU: every such read is an aten._local_scalar_dense or a
    # nonzero here. The blocking step makes them (the test can fail); a steady-state
    # non-blocking step, labels in host memory, makes none: its records are read as numpy
    # views of host memory once the device has written them.
    monkeypatch.setattr(DataParallel, "_count_on_device", count_on_device)
    loss_fn = SoftmaxCrossEntropyLoss() if fused else torch.nn.CrossEntropyLoss()
    for blocking in (True, False):
        dp = DataParallel(make_model(fused), ["cpu", "cpu"], lr=0.1, momentum=0.9,
                          blocking=blocking)
        ops, found = logged_steps(batches(4, ignore_steps=(1,)),
                                  lambda x, y: dp.step(x, y, loss_fn))
        if blocking:
            assert found, ops
        else:
            assert not found, found
            assert ops["reduce_sgd_"] == 3 and ops["step_status"] == 6


def test_blocking_argument_checks():
    model = make_model(False)
    with pytest.raises(TypeError, match="blocking must be True or False"):
        DataParallel(model, ["cpu"], blocking="no")
    with pytest.raises(ValueError, match="blocking=False needs reducer='p2p'"):
        DataParallel(model, ["cpu"], reducer="host", blocking=False)


def test_reduce_sgd_obeys_status_records_and_checks_them():
    torch.manual_seed(0)
    g = [torch.randn(37) for _ in range(3)]
    p0 = torch.randn(37)
    m0 = torch.randn(37)

    def update(status, scaled_by=0.0, loss_out=None):
        ps = [p0.clone() for _ in g]
        ms = [m0.clone() for _ in g]
        torch.ops.dpcuda.reduce_sgd_(ps, [x.clone() for x in g], ms, 0.1, 0.9, 1e-3, False,
                                     "auto", status, scaled_by, loss_out)
        return ps, ms

    plain_p, plain_m = update(None)
    clear = [torch.tensor([1.5, 0.0, 0.0, 2.0], dtype=torch.float64) for _ in g]
    ps, ms = update(clear)
    assert all(torch.equal(a, b) for a, b in zip(ps + ms, plain_p + plain_m))
    for col, value in ((1, 1.0), (2, 1.0), (1, float("nan"))):
        for who in range(3):
            status = [x.clone() for x in clear]
            status[who][col] = value
            ps, ms = update(status)
            assert all(torch.equal(a, p0) for a in ps) and all(torch.equal(a, m0) for a in ms)
    with pytest.raises(ValueError, match="status must be empty or hold one step_status record "
                                         "per replica"):
        update(clear[:2])
    with pytest.raises(ValueError, match=r"status\[1\] must be a step_status record"):
        update([clear[0], clear[1].float(), clear[2]])
    with pytest.raises(ValueError, match=r"status\[2\] must be a step_status record"):
        update([clear[0], clear[1], torch.zeros(3, dtype=torch.float64)])
    with pytest.raises(ValueError, match="scaled_by needs status records"):
        update(None, 6.0)
    with pytest.raises(ValueError, match="scaled_by must be a non-negative number"):
        update(clear, -1.0)
    with pytest.raises(ValueError, match="loss_out needs status records"):
        update(None, 0.0, torch.empty((), dtype=torch.float64))
    with pytest.raises(ValueError, match="loss_out must be one float64"):
        update(clear, 0.0, torch.empty(2, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_reduce_sgd_rescales_by_the_rows_the_records_count(dtype):
    # scaled_by: the gradients were scaled by 1 / scaled_by rows; the records count the rows
    # that are not ignored; the reduced gradient (rounded to the dtype) is multiplied by
    # scaled_by / rows (rounded again) before the step, as the CUDA kernels do
    # (test_emulation_kernels holds those to the same formula). loss_out: the records' losses
    # summed in replica order, times that factor; NaN when no row counts.
    torch.manual_seed(0)
    g = [torch.randn(37).to(dtype) for _ in range(3)]
    p0, m0 = torch.randn(37).to(dtype), torch.randn(37).to(dtype)

    def update(counts, scaled_by, momentum=0.9):
        ps, ms = [p0.clone() for _ in g], [m0.clone() for _ in g]
        status = [torch.tensor([0.25 * (i + 1), 0.0, 0.0, c], dtype=torch.float64)
                  for i, c in enumerate(counts)]
        loss = torch.full((), -1.0, dtype=torch.float64)
        torch.ops.dpcuda.reduce_sgd_(ps, [x.clone() for x in g], ms if momentum else [], 0.1,
                                     momentum, 1e-3, False, "auto", status, scaled_by, loss)
        return ps, ms, loss.item()

    plain = update([0, 0, 0], 0.0)
    assert plain[2] == 0.25 + 0.5 + 0.75
    same = update([8, 8, 8], 24.0)  # every row counts: fix exactly 1, the same bits
    assert all(torch.equal(a, b) for a, b in zip(same[0] + same[1], plain[0] + plain[1]))
    assert same[2] == plain[2]
    fewer = update([2, 5, 1], 24.0)  # 8 rows of 24: the gradient tripled
    total = (g[0].float() + g[1].float() + g[2].float()).to(dtype) if dtype == torch.bfloat16 \
        else g[0] + g[1] + g[2]
    grad = (total.float() * 3.0).to(dtype) if dtype == torch.bfloat16 else total * 3.0
    ref_p, ref_m = [p0.clone()], [m0.clone()]
    torch.ops.dpcuda.reduce_sgd_(ref_p, [grad], ref_m, 0.1, 0.9, 1e-3, False, "auto")
    assert all(torch.equal(a, ref_p[0]) for a in fewer[0])
    assert all(torch.equal(a, ref_m[0]) for a in fewer[1])
    assert fewer[2] == 1.5 * 3.0
    none = update([0, 0, 0], 24.0)  # no row counts: loss NaN, the gradient as it is
    assert math.isnan(none[2])
    assert all(torch.equal(a, b) for a, b in zip(none[0] + none[1], plain[0] + plain[1]))
    skipped = torch.tensor([1.0, 1.0, 0.0, 8.0], dtype=torch.float64)  # skip still says the loss
    ps, ms = [p0.clone() for _ in g], [m0.clone() for _ in g]
    loss = torch.empty((), dtype=torch.float64)
    torch.ops.dpcuda.reduce_sgd_(ps, g, ms, 0.1, 0.9, 0.0, False, "auto",
                                 [skipped, skipped, skipped], 48.0, loss)
    assert loss.item() == 3.0 * 2.0 and all(torch.equal(a, p0) for a in ps)


def test_step_status_counts_the_labels_not_ignored():
    grad = torch.randn(10)
    work = torch.zeros(0, dtype=torch.int32)
    y = torch.tensor([0, -100, 3, 3, 7, -100, 1])
    rec = torch.ops.dpcuda.step_status(grad, torch.ones(7), None, work, False, y, -100)
    assert rec.tolist() == [7.0, 0.0, 0.0, 5.0]
    rec = torch.ops.dpcuda.step_status(grad, torch.ones(7), None, work, False, y, 3)
    assert rec[3].item() == 5.0
    rec = torch.ops.dpcuda.step_status(grad, torch.ones(7), None, work, False)
    assert rec[3].item() == 0.0
    with pytest.raises(ValueError, match="labels must be int64 class indices"):
        torch.ops.dpcuda.step_status(grad, torch.ones(7), None, work, False, y.int(), -100)


@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("algorithm", ["two_shot", "ring"])
def test_rows_counted_on_the_device_train_as_counted_on_the_host(monkeypatch, replicas, fused,
                                                                 algorithm):
    # What a non-blocking step does with labels on a GPU, run on the CPU: scale by every row,
    # count the rows on the device, rescale in the update. With no ignored label that is the
    # blocking step bit for bit; with ignored labels the same within rounding (the gradient is
    # rescaled once more); all ignored gives torch's NaN loss and a zero gradient.
    monkeypatch.setattr(DataParallel, "_count_on_device", True)
    loss_fn = SoftmaxCrossEntropyLoss() if fused else torch.nn.CrossEntropyLoss()
    kw = dict(momentum=0.9, weight_decay=1e-3, algorithm=algorithm)
    for ignore in ((), (1, 3, 4)):
        data = batches(6, nan_steps=(2,), ignore_steps=ignore, all_ignored_steps=(5,))
        a, la, wa = run(True, make_model(fused), ["cpu"] * replicas, data, loss_fn, **kw)
        b, lb, wb = run(False, make_model(fused), ["cpu"] * replicas, data, loss_fn, **kw)
        assert wa == wb and a.skipped_steps == b.skipped_steps == 1
        for i, (x, y) in enumerate(zip(la, lb)):
            if i == 5:
                assert math.isnan(x) and math.isnan(y.item())
            elif ignore:
                assert y.item() == pytest.approx(x, rel=1e-6, nan_ok=True)  # float32 rows
            else:
                assert (x != x and y != y) or x == y.item()
        for p, q in zip(a.module.parameters(), b.module.parameters()):
            if ignore:
                torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(p, q)
        for r in b.replicas[1:]:
            for p, q in zip(r.parameters(), b.module.parameters()):
                assert torch.equal(p, q)


class _PerPosition(torch.nn.Module):
    """Logits (rows, classes, positions) for labels (rows, positions): a loss over every
    position of every row, as a sequence model's."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.linear = torch.nn.Linear(12, 5 * 4)

    def forward(self, x):
        return self.linear(x).reshape(x.shape[0], 5, 4)


@pytest.mark.parametrize("replicas", [1, 2])
def test_labels_of_several_positions_counted_on_the_device(monkeypatch, replicas):
    # The device count is of label elements, and so is the scale: with nothing ignored the
    # factor is exactly 1 and the training the blocking one, bit for bit.
    monkeypatch.setattr(DataParallel, "_count_on_device", True)
    gen = torch.Generator().manual_seed(4)
    for ignore in (False, True):
        data = []
        for _ in range(4):
            y = torch.randint(0, 5, (8, 4), generator=gen)
            if ignore:
                y[::3, 1:] = -100
            data.append((torch.randn(8, 12, generator=gen), y))
        a, la, _ = run(True, _PerPosition(), ["cpu"] * replicas, data,
                       torch.nn.CrossEntropyLoss(), momentum=0.9)
        b, lb, _ = run(False, _PerPosition(), ["cpu"] * replicas, data,
                       torch.nn.CrossEntropyLoss(), momentum=0.9)
        for p, q in zip(a.module.parameters(), b.module.parameters()):
            if ignore:
                torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(p, q)
        if not ignore:
            assert la == [x.item() for x in lb]


def test_a_float16_model_counts_its_labels_on_the_host(monkeypatch):
    # A gradient scaled for more labels than count could overflow float16 before the
    # rescale: float16 models take the host count (the blocking step's bits).
    monkeypatch.setattr(DataParallel, "_count_on_device", True)
    data = [(x.half(), y) for x, y in batches(4, ignore_steps=(0, 1, 2, 3))]
    a, la, _ = run(True, make_model(False, torch.float16), ["cpu", "cpu"], data,
                   F.cross_entropy)
    b, lb, _ = run(False, make_model(False, torch.float16), ["cpu", "cpu"], data,
                   F.cross_entropy)
    assert la == [x.item() for x in lb]
    for p, q in zip(a.module.parameters(), b.module.parameters()):
        assert torch.equal(p, q)


def test_reduce_sgd_checks_everything_before_it_writes():
    p, g = [torch.ones(4)], [torch.ones(4)]
    skip = [torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=torch.float64)]
    loss = torch.full((), -1.0, dtype=torch.float64)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        torch.ops.dpcuda.reduce_sgd_(p, g, [], 0.1, 0.0, 0.0, False, "bogus", skip, 0.0, loss)
    assert loss.item() == -1.0
    with pytest.raises(ValueError, match=r"loss_out shares memory with status\[0\]"):
        torch.ops.dpcuda.reduce_sgd_(p, g, [], 0.1, 0.0, 0.0, False, "auto", skip, 0.0,
                                     skip[0][1])
    with pytest.raises(ValueError, match=r"loss_out shares memory with params\[0\]"):
        pd = torch.ones(4, dtype=torch.float64)
        torch.ops.dpcuda.reduce_sgd_([pd], [g[0].double()], [], 0.1, 0.0, 0.0, False, "auto",
                                     skip, 0.0, pd[2])
    with pytest.raises(ValueError, match="loss_out is on meta but params"):
        torch.ops.dpcuda.reduce_sgd_(p, g, [], 0.1, 0.0, 0.0, False, "auto", skip, 0.0,
                                     torch.empty((), dtype=torch.float64, device="meta"))
    with pytest.raises(ValueError, match="labels is on meta but grad"):
        torch.ops.dpcuda.step_status(torch.zeros(2), torch.ones(1), None,
                                     torch.zeros(0, dtype=torch.int32), False,
                                     torch.zeros(2, dtype=torch.long, device="meta"))
    with pytest.raises(ValueError, match=r"tensors\[1\] is on meta but tensors\[0\]"):
        torch.ops.dpcuda.all_reduce_([torch.ones(3), torch.ones(3, device="meta")], "sum",
                                     "auto")
    assert torch.equal(p[0], torch.ones(4))


def test_synchronize_reads_every_step_and_raises_the_first_bad_label():
    # Three steps in flight (a bad label, another, NaN gradients): synchronize() reads them
    # all, warns and counts the skipped one, then raises for the first bad label.
    dp = DataParallel(make_model(False), ["cpu"], lr=0.1, blocking=False)
    waited = []
    y = batches(1)[0][1].clone()
    y[3] = 9

    def record(nan, bad):
        return [torch.tensor([1.0, float(nan), float(bad), 24.0], dtype=torch.float64)]
    for step, (nan, bad) in enumerate([(0, 1), (0, 1), (1, 0)], start=1):
        dp._pending.append(PendingStep(step, record(nan, bad), [_Event(waited, step)], y,
                                       (None, -100), 5))
    with pytest.warns(RuntimeWarning, match="step 3 has NaN or Inf"):
        with pytest.raises(ValueError, match=r"step 1: .* got 9 at position 3 .*; step 2 also "
                                             r"had a bad label \(not applied either\)"):
            dp.synchronize()
    assert waited == [1, 2, 3] and not dp._pending and dp.skipped_steps == 1
    dp.synchronize()  # nothing left


def test_the_state_functions_read_pending_steps_first(monkeypatch):
    flagged = _Flagged(monkeypatch)
    for call in ("state_dict", "optimizer_state_dict", "load_state_dict",
                 "load_optimizer_state_dict"):
        dp = DataParallel(make_model(False), ["cpu"], lr=0.1, momentum=0.9, blocking=False)
        x, y = batches(1)[0]
        bad = y.clone()
        bad[2] = 8
        state = dp.state_dict(), dp.optimizer_state_dict()
        dp.step(x, bad, flagged.loss)
        before = [p.detach().clone() for p in dp.module.parameters()]
        args = {"load_state_dict": (state[0],), "load_optimizer_state_dict": (state[1],)}
        with pytest.raises(ValueError, match="step 0: .* got 8 at position 2"):
            getattr(dp, call)(*args.get(call, ()))
        assert all(torch.equal(p, b) for p, b in zip(dp.module.parameters(), before))
        assert not dp._pending
        getattr(dp, call)(*args.get(call, ()))  # read: it goes through now


class _NoLabels(torch.nn.Module):
    """Logits (rows, classes, 0) for labels (rows, 0): a batch with no label at all."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.linear = torch.nn.Linear(12, 12)

    def forward(self, x):
        return self.linear(x)[:, :0].reshape(x.shape[0], 5, 0)


def test_a_batch_without_labels_counted_on_the_device_is_torchs_nan(monkeypatch):
    monkeypatch.setattr(DataParallel, "_count_on_device", True)
    x = torch.randn(6, 12)
    y = torch.zeros(6, 0, dtype=torch.long)
    want = F.cross_entropy(_NoLabels()(x), y)
    assert math.isnan(want.item())
    a, la, _ = run(True, _NoLabels(), ["cpu", "cpu"], [(x, y)], torch.nn.CrossEntropyLoss())
    b, lb, _ = run(False, _NoLabels(), ["cpu", "cpu"], [(x, y)], torch.nn.CrossEntropyLoss())
    assert math.isnan(la[0]) and math.isnan(lb[0].item())
    for p, q in zip(a.module.parameters(), b.module.parameters()):
        assert torch.equal(p, q)


def test_float16_autocast_counts_its_labels_on_the_host(monkeypatch):
    # float16 logits under autocast: the host count too (the blocking step's bits).
    monkeypatch.setattr(DataParallel, "_count_on_device", True)
    data = batches(3, ignore_steps=(0, 1, 2))
    out = []
    for blocking in (True, False):
        with torch.autocast("cpu", dtype=torch.float16):
            out.append(run(blocking, make_model(False), ["cpu", "cpu"], data, F.cross_entropy))
    (a, la, _), (b, lb, _) = out
    assert la == [x.item() for x in lb]
    for p, q in zip(a.module.parameters(), b.module.parameters()):
        assert torch.equal(p, q)



@pytest.mark.parametrize("mode", ["blocking", "nonblocking"])
def test_a_skipped_steps_warning_made_an_error_leaves_the_step_counted(mode):
    # (from the review: with warnings as errors the RuntimeWarning raised before the step was
    # counted, so skipped_steps stayed 0 and a blocking step was missing from dp.steps)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    dp = DataParallel(model, ["cpu"] * 2, blocking=mode == "blocking")
    opt = dpcuda.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    bad = x.clone()
    bad[1, 2] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        raised = 0
        for batch in (bad, None):
            try:
                if batch is None:
                    dp.synchronize()
                else:
                    dp.step(batch, y, torch.nn.CrossEntropyLoss(), optimizer=opt)
            except RuntimeWarning as w:
                assert "step 0 has NaN or Inf gradients" in str(w)
                raised += 1
    assert raised == 1
    assert dp.skipped_steps == 1 and dp.steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    dp.step(x, y, torch.nn.CrossEntropyLoss(), optimizer=opt)  # (and training goes on)
    dp.synchronize()
    assert dp.steps == 2 and dp.skipped_steps == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
