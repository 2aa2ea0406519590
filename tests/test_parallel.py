"""dpcuda.parallel: the all-reduce algorithms, the primitives and DataParallel against a
single-device torch.optim.SGD reference. Replicas share the CPU here (devices may repeat); the
CUDA cases run where a GPU is present."""

import copy
import math
import os
import socket
import warnings

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import dpcuda
from dpcuda import parallel
from dpcuda.nn import FusedMLP, SoftmaxCrossEntropyLoss
from dpcuda.parallel import DataParallel
from conftest import make_model, reference_train

ALGOS = ["one_shot", "two_shot", "ring", "auto"]
CUDA = dpcuda.cuda_available()


def replica_devices(device, k):
    return [device] * k


def devices_for_tests():
    out = ["cpu"]
    if CUDA:
        out.append("cuda:0")
    return out


# ---------------------------------------------------------------------------------------------
# all_reduce

@pytest.mark.parametrize("device", devices_for_tests())
@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("size", [1, 7, 4096 + 3, 1 << 20])
def test_all_reduce_matches_float64_sum_and_is_bitwise_identical(device, replicas, size):
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        gen = torch.Generator().manual_seed(replicas * 1000 + size)
        base = [torch.randn(size, generator=gen, dtype=torch.float64).to(dtype)
                for _ in range(replicas)]
        want = sum(b.double() for b in base)
        results = {}
        for algo in ALGOS:
            for op in ("sum", "mean"):
                ts = [b.clone().to(device) for b in base]
                out = parallel.all_reduce(ts, op=op, algorithm=algo)
                assert out is not None
                for t in ts[1:]:
                    assert torch.equal(t, ts[0]), (algo, op, dtype)
                target = want if op == "sum" else want / replicas
                tol = {torch.float64: 1e-12, torch.float32: 1e-5,
                       torch.float16: 2e-2, torch.bfloat16: 1e-1}[dtype]
                torch.testing.assert_close(ts[0].double().cpu(), target, atol=tol * replicas,
                                           rtol=tol)
                results[(algo, op)] = ts[0]
        for op in ("sum", "mean"):
            for algo in ALGOS:
                assert torch.equal(results[(algo, op)], results[("two_shot", op)]), (algo, op)


def test_all_reduce_changes_every_replica_in_place():
    ts = [torch.full((5,), float(i)) for i in range(3)]
    ptrs = [t.data_ptr() for t in ts]
    parallel.all_reduce(ts)
    assert [t.data_ptr() for t in ts] == ptrs
    for t in ts:
        assert torch.equal(t, torch.full((5,), 3.0))


def test_all_reduce_fixed_order_is_replica_order():
    # 1e8 + 1 - 1e8 in float32 depends on the order: the fixed order is tensors[0] first.
    vals = [1e8, 1.0, -1e8]
    want = torch.tensor([vals[0]], dtype=torch.float32)
    for v in vals[1:]:
        want = want + torch.tensor([v], dtype=torch.float32)
    for algo in ALGOS:
        ts = [torch.tensor([v], dtype=torch.float32) for v in vals]
        parallel.all_reduce(ts, algorithm=algo)
        assert torch.equal(ts[0], want), algo


@pytest.mark.parametrize("bad, match", [
    (lambda: parallel.all_reduce([]), "at least one"),
    (lambda: parallel.all_reduce([torch.ones(3), torch.ones(4)]), r"tensors\[1\] has 4 elements"),
    (lambda: parallel.all_reduce([torch.ones(3), torch.ones(3, dtype=torch.float64)]), "dtype"),
    (lambda: parallel.all_reduce([torch.ones(3)], op="max"), "op must be"),
    (lambda: parallel.all_reduce([torch.ones(3)], algorithm="tree"), "algorithm must be"),
    (lambda: parallel.all_reduce([torch.ones(4, 2).t()]), "contiguous"),
])
def test_all_reduce_bad_input(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        bad()


def test_all_reduce_rejects_shared_memory():
    t = torch.ones(8)
    with pytest.raises(ValueError, match="share memory"):
        parallel.all_reduce([t, t])
    with pytest.raises(ValueError, match="share memory"):
        parallel.all_reduce([t[:4], t[2:6]])


def test_reduce_sgd_fused_matches_unfused():
    gen = torch.Generator().manual_seed(3)
    n = 100003
    params = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(3)]
    mom = torch.randn(n, generator=gen)
    outs = {}
    for algo in ALGOS:
        ps = [params.clone() for _ in range(3)]
        ms = [mom.clone() for _ in range(3)]
        gs = [g.clone() for g in grads]
        torch.ops.dpcuda.reduce_sgd_(ps, gs, ms, 0.1, 0.9, 0.01, False, algo)
        for p in ps[1:]:
            assert torch.equal(p, ps[0])
        for m in ms[1:]:
            assert torch.equal(m, ms[0])
        outs[algo] = (ps[0], ms[0])
    g = grads[0] + grads[1] + grads[2]
    d = g + 0.01 * params
    m = 0.9 * mom + d
    torch.testing.assert_close(outs["two_shot"][1], m)
    torch.testing.assert_close(outs["two_shot"][0], params - 0.1 * m)
    for algo in ALGOS:
        assert torch.equal(outs[algo][0], outs["two_shot"][0]), algo


# ---------------------------------------------------------------------------------------------
# primitives

def test_split_sizes():
    assert parallel.split_sizes(10, 3) == [4, 3, 3]
    assert parallel.split_sizes(2, 3) == [1, 1, 0]
    assert parallel.split_sizes(10, 2, [3, 1]) == [8, 2]  # 7.5, 2.5: tie to the lower index
    assert parallel.split_sizes(7, 3, [1, 1, 1]) == [3, 2, 2]
    assert parallel.split_sizes(5, 2, [1, 0]) == [5, 0]
    assert sum(parallel.split_sizes(1001, 4, [0.1, 0.2, 0.3, 0.4])) == 1001
    with pytest.raises(ValueError, match="weights"):
        parallel.split_sizes(5, 2, [1, -1])
    with pytest.raises(ValueError, match="weights has 3 entries"):
        parallel.split_sizes(5, 2, [1, 1, 1])


def test_scatter_gather_roundtrip():
    x = torch.arange(20.0).reshape(10, 2)
    y = torch.arange(10)
    parts = parallel.scatter((x, y), ["cpu", "cpu", "cpu"], weights=[1, 0, 1])
    assert [p[0].shape[0] for p in parts] == [5, 0, 5]
    assert torch.equal(parallel.gather([p[0] for p in parts], "cpu"), x)
    assert torch.equal(parallel.gather([p[1] for p in parts], "cpu"), y)
    single = parallel.scatter(x, ["cpu", "cpu"])
    assert [p.shape[0] for p in single] == [5, 5]


def test_replicate_and_parallel_apply():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    reps = parallel.replicate(model, ["cpu", "cpu"])
    assert reps[0] is not reps[1] and reps[0].weight.data_ptr() != model.weight.data_ptr()
    xs = parallel.scatter(torch.randn(6, 4), ["cpu", "cpu"])
    outs = parallel.parallel_apply(reps, xs)
    torch.testing.assert_close(parallel.gather(outs, "cpu"), model(torch.cat(xs)))


def test_bad_device_names():
    with pytest.raises(ValueError, match=r"devices\[1\].*does not exist"):
        parallel.replicate(torch.nn.Linear(2, 2), ["cpu", "cuda:97"])
    with pytest.raises(ValueError, match=r"devices\[0\]"):
        parallel.replicate(torch.nn.Linear(2, 2), ["gpu-ish"])


# ---------------------------------------------------------------------------------------------
# DataParallel

def batches(steps=20, rows=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 12, generator=gen), torch.randint(0, 5, (rows,), generator=gen))
            for _ in range(steps)]


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("reducer", ["p2p", "host"])
@pytest.mark.parametrize("split", ["even", "weighted", "auto"])
@pytest.mark.parametrize("fused", [False, True])
def test_data_parallel_matches_single_device_sgd(replicas, reducer, split, fused):
    model = make_model(fused)
    data = batches()
    ref = reference_train(model, data, 0.1, 0.9, 1e-3)
    weights = [i + 1 for i in range(replicas)] if split == "weighted" else None
    dp = DataParallel(model, ["cpu"] * replicas, reducer=reducer, split=split, lr=0.1,
                      momentum=0.9, weight_decay=1e-3, split_weights=weights)
    for x, y in data:
        loss = dp.step(x, y, F.cross_entropy)
        assert isinstance(loss, float) and loss > 0
    for a, b in zip(dp.module.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    for rep in dp.replicas[1:]:
        for a, b in zip(rep.parameters(), dp.module.parameters()):
            assert torch.equal(a, b)


@pytest.mark.parametrize("algorithm", ["one_shot", "ring", "auto"])
def test_data_parallel_algorithms_give_identical_weights(algorithm):
    # (each against two_shot)
    model = make_model(False, torch.float64)
    data = [(x.double(), y) for x, y in batches(5)]
    results = []
    for algo in (algorithm, "two_shot"):
        dp = DataParallel(copy.deepcopy(model), ["cpu"] * 3, lr=0.05, momentum=0.5,
                          algorithm=algo)
        for x, y in data:
            dp.step(x, y, F.cross_entropy)
        results.append([p.detach().clone() for p in dp.module.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_data_parallel_loss_is_the_global_mean():
    model = make_model(False)
    x, y = batches(1, rows=10)[0]
    want = F.cross_entropy(model(x), y).item()
    dp = DataParallel(model, ["cpu"] * 3, split="weighted", split_weights=[5, 1, 4], lr=0.0)
    assert dp.step(x, y, F.cross_entropy) == pytest.approx(want, rel=1e-5)


def snapshot(dp):
    return [p.detach().clone() for r in dp.replicas for p in r.parameters()]


def assert_untouched(dp, before):
    after = snapshot(dp)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("inputs, targets, match", [
    (torch.randn(0, 12), torch.zeros(0, dtype=torch.long), "empty"),
    (torch.randn(6, 12), torch.zeros(5, dtype=torch.long), "6 rows but targets has 5"),
])
def test_data_parallel_bad_batches_leave_weights(inputs, targets, match):
    dp = DataParallel(make_model(False), ["cpu"] * 3, lr=0.1)
    before = snapshot(dp)
    with pytest.raises(ValueError, match=match):
        dp.step(inputs, targets, F.cross_entropy)
    assert_untouched(dp, before)


def test_data_parallel_bad_arguments():
    model = make_model(False)
    with pytest.raises(ValueError, match="does not exist"):
        DataParallel(model, ["cpu", "cuda:41"])
    with pytest.raises(ValueError, match="reducer"):
        DataParallel(model, ["cpu"], reducer="smoke")
    with pytest.raises(ValueError, match="lr"):
        DataParallel(model, ["cpu"], lr=float("nan"))
    with pytest.raises(ValueError, match="split_weights"):
        DataParallel(model, ["cpu", "cpu"], split="weighted")
    with pytest.raises(RuntimeError, match="torch.distributed"):
        DataParallel(model, ["cpu"], reducer="dist")


@pytest.mark.parametrize("reducer", ["p2p", "host"])
def test_nonfinite_gradients_skip_the_step(reducer):
    dp = DataParallel(make_model(False), ["cpu"] * 2, reducer=reducer, lr=0.1, momentum=0.9)
    x, y = batches(1)[0]
    dp.step(x, y, F.cross_entropy)
    before = snapshot(dp)
    x = x.clone()
    x[-1, 0] = float("inf")  # only the second replica's rows see it
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        dp.step(x, y, F.cross_entropy)
    assert_untouched(dp, before)
    assert dp.skipped_steps == 1
    dp.step(*batches(1, seed=5)[0], F.cross_entropy)  # and training goes on
    assert not all(torch.equal(a, b) for a, b in zip(before, snapshot(dp)))


def test_exception_in_one_replica_leaves_every_replica():
    dp = DataParallel(make_model(False), ["cpu"] * 3, lr=0.1)
    before = snapshot(dp)
    calls = []

    def fail_second(module, inputs, output):  # a forward hook: every replica runs it
        calls.append(output.shape[0])
        if len(calls) == 2:
            raise RuntimeError("replica failure")

    dp.module.register_forward_hook(fail_second)
    with pytest.raises(RuntimeError, match="replica failure"):
        dp.step(*batches(1)[0], F.cross_entropy)
    assert_untouched(dp, before)


def test_state_dict_roundtrip_and_bad_state():
    model = make_model(False)
    dp = DataParallel(model, ["cpu"] * 2, lr=0.1, momentum=0.9)
    dp.step(*batches(1)[0], F.cross_entropy)
    state = copy.deepcopy(dp.state_dict())
    opt_state = dp.optimizer_state_dict()
    fresh = DataParallel(make_model(False), ["cpu"] * 3, lr=0.1, momentum=0.9)
    fresh.load_state_dict(state)
    fresh.load_optimizer_state_dict(opt_state)
    for rep in fresh.replicas:
        for a, b in zip(rep.parameters(), dp.module.parameters()):
            assert torch.equal(a, b)
    data = batches(1, seed=9)[0]
    dp.step(*data, F.cross_entropy)
    fresh.step(*data, F.cross_entropy)
    for a, b in zip(fresh.module.parameters(), dp.module.parameters()):
        torch.testing.assert_close(a, b)
    before = snapshot(fresh)
    bad = {k: v[:1] for k, v in state.items()}
    with pytest.raises(RuntimeError):
        fresh.load_state_dict(bad)
    assert_untouched(fresh, before)
    # An nn.Linear-shaped state_dict loads into the plain module too.
    model.load_state_dict(dp.state_dict())


@pytest.mark.parametrize("replicas", [1, 3])
@pytest.mark.parametrize("reducer", ["p2p", "host"])
@pytest.mark.parametrize("fused", [False, True])
def test_frozen_parameters_stay_as_torch_sgd_leaves_them(replicas, reducer, fused):
    # A frozen layer gets no weight decay and no momentum, as torch.optim.SGD skips a
    # parameter without a gradient; the trainable ones train as on one device.
    model = make_model(fused)
    frozen = list(model.parameters())[:2]  # the first layer's weight and bias
    for p in frozen:
        p.requires_grad_(False)
    before = [p.detach().clone() for p in frozen]
    data = batches(steps=6)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1,
                          momentum=0.9, weight_decay=0.05)
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
    dp = DataParallel(model, ["cpu"] * replicas, reducer=reducer, lr=0.1, momentum=0.9,
                      weight_decay=0.05)
    for x, y in data:
        dp.step(x, y, F.cross_entropy)
    for r in dp.replicas:
        for p, b in zip(list(r.parameters())[:2], before):
            assert torch.equal(p, b)
    for got, want in zip(dp.module.parameters(), ref.parameters()):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert dp.optimizer_state_dict()["momentum_buffer"].numel() == sum(
        p.numel() for p in ref.parameters() if p.requires_grad)


def _ignore_losses():
    from dpcuda.nn import SoftmaxCrossEntropyLoss
    return {
        "F.cross_entropy": (F.cross_entropy, -100, 0.0),
        "nn.CrossEntropyLoss": (torch.nn.CrossEntropyLoss(), -100, 0.0),
        "SoftmaxCrossEntropyLoss": (SoftmaxCrossEntropyLoss(), -100, 0.0),
        "smoothing+ignore 3": (torch.nn.CrossEntropyLoss(ignore_index=3, label_smoothing=0.1),
                               3, 0.1),
        "dpcuda smoothing+ignore 3": (SoftmaxCrossEntropyLoss(ignore_index=3,
                                                              label_smoothing=0.1), 3, 0.1),
    }


@pytest.mark.parametrize("loss_name", list(_ignore_losses()))
@pytest.mark.parametrize("replicas,reducer", [(2, "p2p"), (3, "p2p"), (2, "host"),
                                              (4, "p2p")])
def test_ignored_rows_give_the_one_device_mean(loss_name, replicas, reducer):
    # The mean over the global batch's non-ignored rows, however they fall on replicas: ignored
    # rows bunched in the first replica's slice, a replica whose rows are all ignored, random
    # ignored rows; the losses returned and the weights as one device with torch.optim.SGD.
    loss_fn, ignore, smoothing = _ignore_losses()[loss_name]
    gen = torch.Generator().manual_seed(5)
    data = []
    for step in range(6):
        x = torch.randn(16, 12, generator=gen)
        y = torch.randint(0, 5, (16,), generator=gen)
        if ignore == 3:
            y[y == 3] = 4  # only the rows set below are ignored
        if step % 3 == 0:
            y[:3] = ignore             # 3 of the first replica's rows
        elif step % 3 == 1:
            y[:16 // replicas] = ignore  # the whole first replica
        else:
            y[torch.rand(16, generator=gen) < 0.4] = ignore
        data.append((x, y))
    model = make_model(False)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    want_losses = []
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(ref(x), y, ignore_index=ignore, label_smoothing=smoothing)
        want_losses.append(float(loss.detach()))
        loss.backward()
        opt.step()
    dp = DataParallel(model, ["cpu"] * replicas, reducer=reducer, lr=0.1, momentum=0.9,
                      weight_decay=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no step may be skipped
        got_losses = [dp.step(x, y, loss_fn) for x, y in data]
    torch.testing.assert_close(got_losses, want_losses, atol=1e-6, rtol=1e-5)
    for got, want in zip(dp.module.parameters(), ref.parameters()):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_int32_labels_with_dpcuda_loss_give_the_one_device_mean():
    # dpcuda's loss takes any integer labels; the ignored rows then count as with int64.
    from dpcuda.nn import SoftmaxCrossEntropyLoss
    x, y = batches(steps=1, rows=16)[0]
    y[:6] = -100
    losses = []
    for labels in (y, y.to(torch.int32)):
        dp = DataParallel(make_model(False), ["cpu", "cpu"], lr=0.1)
        losses.append(dp.step(x, labels, SoftmaxCrossEntropyLoss()))
    with torch.no_grad():
        want = float(F.cross_entropy(make_model(False)(x), y))
    assert losses[0] == pytest.approx(want, rel=1e-6)
    assert losses[1] == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_all_rows_ignored_is_torchs_nan_loss_and_zero_gradient(fused):
    # torch: the mean over no rows is NaN, its gradient 0; SGD still applies weight decay and
    # momentum. DataParallel does the same (a NaN loss with finite gradients is not skipped).
    model = make_model(False)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.05)
    dp = DataParallel(model, ["cpu", "cpu"], lr=0.1, momentum=0.9, weight_decay=0.05)
    from dpcuda.nn import SoftmaxCrossEntropyLoss
    loss_fn = SoftmaxCrossEntropyLoss() if fused else F.cross_entropy
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        x = torch.randn(8, 12, generator=gen)
        y = torch.randint(0, 5, (8,), generator=gen) if step != 0 else torch.full((8,), -100)
        opt.zero_grad()
        want = F.cross_entropy(ref(x), y)
        want.backward()
        opt.step()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = dp.step(x, y, loss_fn)
        assert math.isnan(got) == math.isnan(float(want.detach())) == (step == 0)
    for got, want in zip(dp.module.parameters(), ref.parameters()):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_a_raised_label_flag_stops_the_step_before_the_update(monkeypatch):
    # On CUDA the loss kernel flags a bad label on the device and step() reads the flag with
    # the loss. The flag is simulated here (no GPU): the step raises, naming the first bad
    # position when the step's targets hold one, and no weight changes.
    model = make_model(False)
    dp = DataParallel(model, ["cpu", "cpu"], lr=0.1, momentum=0.9)
    x, y = batches(steps=1)[0]
    dp.step(x, y, F.cross_entropy)
    before = [p.detach().clone() for p in dp.module.parameters()]
    flags = {}  # one int32 flag per device, as the CUDA loss kernel's

    def flag_of(device):
        return flags.setdefault(device, torch.zeros(1, dtype=torch.int32))

    def flagging(module, inputs, out):  # as a loss kernel that saw a bad label (on CUDA)
        flag_of(out.device).fill_(1)
    monkeypatch.setattr(DataParallel, "_flag_tensor", staticmethod(flag_of))
    hook = dp.module.register_forward_hook(flagging)
    with pytest.raises(ValueError, match="not in this step's targets"):
        dp.step(x, y, F.cross_entropy)
    hook.remove()
    for p, b in zip(dp.module.parameters(), before):
        assert torch.equal(p, b)
    # The failed step clears the flags: the next step is not blamed for them.
    assert [int(f) for f in flags.values()] == [0]
    # A flag left raised before a step (two replicas share "cpu"'s) is cleared as it starts.
    flags[torch.device("cpu")].fill_(1)
    dp.step(x, y, F.cross_entropy)
    assert not any(torch.equal(p, b) for p, b in zip(dp.module.parameters(), before))
    bad = y.clone()
    bad[5] = 7
    with pytest.raises(ValueError, match=r"\[0, 5\) or ignore_index \(-100\); got 7 at position 5"):
        dp._raise_label_error(bad, (None, -100))


# ---------------------------------------------------------------------------------------------
# reducer="dist": two gloo processes on loopback

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dist_batches():
    """Global batches of changing sizes, with one NaN in step 7's input (rows of rank 1): a
    step every process must skip alike; ignored labels on steps 3 (all of rank 0's rows), 9
    (every third row) and 10 (every row)."""
    data = []
    gen = torch.Generator().manual_seed(3)
    for i, rows in enumerate([24] * 5 + [17, 24, 24, 9, 31, 31, 24]):
        x = torch.randn(rows, 12, generator=gen)
        y = torch.randint(0, 5, (rows,), generator=gen)
        if i == 7:
            x[-1, 3] = float("nan")
        if i == 3:
            y[:rows // 2 + 3] = -100  # all of rank 0's rows (dist_cut gives it rows // 2 + 3)
        if i == 9:
            y[::3] = -100
        if i == 10:
            y[:] = -100  # nothing to average: a NaN loss, zero gradients, as torch
        data.append((x, y))
    return data


def dist_cut(step, rows):
    """Rank 0's rows of a step: uneven on purpose every third step."""
    return rows // 2 + (step % 3 == 1) * 3


def _dist_worker(rank, world, port, out_dir, dtype, inline):
    import warnings
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        model = make_model(False, dtype)
        list(model.parameters())[1].requires_grad_(False)  # a frozen bias, broadcast too
        if rank == 1:  # a different start: the wrapper must take rank 0's weights
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        dp = DataParallel(model, ["cpu", "cpu"], reducer="dist", lr=0.1, momentum=0.9,
                          weight_decay=1e-3)
        if not inline:  # the path of half-precision models, with float32 numbers
            dp._record_inline = ()
        losses, skipped = [], []
        for step, (x, y) in enumerate(dist_batches()):
            cut = dist_cut(step, x.shape[0])
            part = slice(0, cut) if rank == 0 else slice(cut, None)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                losses.append(dp.step(x[part].to(dtype), y[part], F.cross_entropy))
            skipped.append(any("NaN or Inf" in str(w.message) for w in caught))
        torch.save({"state": dp.state_dict(), "losses": losses, "skipped": skipped,
                    "skipped_steps": dp.skipped_steps},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _dist_failure_worker(rank, world, port, out_dir, inline):
    import datetime
    import torch.distributed as dist
    torch.set_num_threads(1)
    # A bounded wait: unpaired collectives (the defect this tests for) end in an error.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    try:
        dp = DataParallel(make_model(False), ["cpu"], reducer="dist", lr=0.1, momentum=0.9)
        if not inline:
            dp._record_inline = ()
        errors = []
        for step, (x, y) in enumerate(batches(steps=6)):
            x, y = x[rank * 12:(rank + 1) * 12], y[rank * 12:(rank + 1) * 12].clone()
            if rank == 1 and step == 0:
                x, y = x[:0], y[:0]  # fails before the first count: "the batch is empty"
            if rank == 1 and step == 3:
                y[4] = 7  # a label outside [0, 5): F.cross_entropy raises on this rank only
            try:
                dp.step(x, y, F.cross_entropy)
                errors.append(None)
            except Exception as err:  # noqa: BLE001  (recorded, compared below)
                errors.append(f"{type(err).__name__}: {err}")
        torch.save({"state": dp.state_dict(), "errors": errors},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("inline", [True, False], ids=["behind", "beside"])
def test_dist_a_step_failing_on_one_process_fails_on_all_and_they_go_on(tmp_path, inline):
    # Rank 1 fails on step 0 (before the count) and step 3 (a bad label, found by
    # F.cross_entropy): both processes raise, neither applies the step, and the next steps stay paired:
    # the model is that of one device trained on the other steps.
    world = 2
    mp.spawn(_dist_failure_worker, args=(world, _free_port(), str(tmp_path), inline),
             nprocs=world, join=True)
    runs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for step in (0, 3):
        assert "another process failed" in runs[0]["errors"][step]
    assert "the batch is empty" in runs[1]["errors"][0]
    assert runs[1]["errors"][3].startswith("IndexError: Target 7 is out of bounds")
    for run in runs:
        assert [e is None for e in run["errors"]] == [False, True, True, False, True, True]
    model = make_model(False)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step, (x, y) in enumerate(batches(steps=6)):
        if step in (0, 3):
            continue
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(runs[0]["state"][k], v, atol=1e-5, rtol=1e-4)
        assert torch.equal(runs[0]["state"][k], runs[1]["state"][k])


# float32/float64 send the loss and the rows behind the gradients, half precision models in a
# tensor beside them ("beside": float32 runs it here, where its numbers are exact to compare).
@pytest.mark.parametrize("dtype,inline", [(torch.float32, True), (torch.float64, True),
                                          (torch.float32, False)],
                         ids=["float32-behind", "float64-behind", "float32-beside"])
def test_dist_reducer_matches_single_process(tmp_path, dtype, inline):
    # Two processes x two replicas, uneven slices, a global batch that changes size, a step
    # with a NaN on one process: the model and the losses one process computes alone.
    world = 2
    mp.spawn(_dist_worker, args=(world, _free_port(), str(tmp_path), dtype, inline),
             nprocs=world, join=True)
    model = copy.deepcopy(make_model(False, dtype))
    list(model.parameters())[1].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1,
                          momentum=0.9, weight_decay=1e-3)
    ref_losses = []
    for x, y in dist_batches():
        opt.zero_grad()
        loss = F.cross_entropy(model(x.to(dtype)), y)
        ref_losses.append(float(loss.detach()))
        if not torch.isnan(x).any():  # the NaN input's step is skipped; all-ignored is not
            loss.backward()
            opt.step()
    tol = {torch.float32: (1e-5, 1e-4), torch.float64: (1e-12, 1e-12)}[dtype]
    runs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for run in runs:
        assert run["skipped"] == [i == 7 for i in range(len(ref_losses))]
        assert run["skipped_steps"] == 1
        finite = [i for i, v in enumerate(ref_losses) if math.isfinite(v)]
        torch.testing.assert_close([run["losses"][i] for i in finite],
                                   [ref_losses[i] for i in finite], atol=tol[0], rtol=tol[1])
        assert [i for i, v in enumerate(run["losses"]) if math.isnan(v)] == [7, 10]
        assert [i for i, v in enumerate(ref_losses) if math.isnan(v)] == [7, 10]
    assert runs[0]["losses"][:7] == runs[1]["losses"][:7]
    for k, v in model.state_dict().items():
        torch.testing.assert_close(runs[0]["state"][k], v, atol=tol[0], rtol=tol[1])
        assert torch.equal(runs[0]["state"][k], runs[1]["state"][k])


def test_replica_threads_inherit_grad_mode_and_autocast():
    # Replicas on distinct devices run on threads, which inherit nothing from the caller by
    # themselves: grad mode and autocast must be carried over (the CUDA stream too, on GPUs), as
    # torch.nn.parallel.parallel_apply does. Two distinct devices without a GPU: cpu and meta.
    import threading
    linear = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)

    def probe():
        return (threading.current_thread() is threading.main_thread(),
                torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
                torch.get_autocast_dtype("cpu"), linear(x).dtype)

    for grad in (True, False):
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):
            got = parallel._run_all([probe, probe], [torch.device("cpu"), torch.device("meta")])
        for on_main, grad_mode, enabled, dtype, out_dtype in got:
            assert not on_main
            assert grad_mode is grad and enabled and dtype == torch.bfloat16
            assert out_dtype == torch.bfloat16
    got = parallel._run_all([probe, probe], [torch.device("cpu"), torch.device("meta")])
    assert all(not enabled and out_dtype == torch.float32 for _, _, enabled, _, out_dtype in got)


def test_bad_label_names_its_position_in_the_callers_batch():
    model = FusedMLP([4, 8, 3])
    dp = DataParallel(model, ["cpu", "cpu"], lr=0.1)
    y = torch.tensor([0, 1, 2, 0, 1, 7, 2, 0])
    # (torch's own losses raise their IndexError, which names no position)
    with pytest.raises(ValueError, match="got 7 at position 5"):
        dp.step(torch.randn(8, 4), y, SoftmaxCrossEntropyLoss())


def test_a_bad_label_is_a_typed_error_with_its_fields():
    from dpcuda.parallel import LabelError
    from dpcuda import _C
    dp = DataParallel(FusedMLP([4, 8, 3]), ["cpu"] * 3, lr=0.1)
    y = torch.tensor([0, 1, 2, 0, 1, 2, -1, 9, 2])
    with pytest.raises(LabelError) as caught:
        dp.step(torch.randn(9, 4), y, SoftmaxCrossEntropyLoss())
    err = caught.value
    assert (err.position, err.label, err.classes, err.ignore_index) == (6, -1, 3, -100)
    assert isinstance(err, ValueError)
    # The C++ adapter's record of the fields: taken once, on the thread that raised.
    with pytest.raises(ValueError):
        torch.ops.dpcuda.loss_grad(torch.randn(2, 3), torch.tensor([0, 5]), 1.0, 0.0, -100, True)
    assert _C._take_label_error() == (1, 5, 3, -100)
    assert _C._take_label_error() is None


def _dist_loop_worker(rank, world, port, out_dir):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        model = make_model(False, torch.float64)
        if rank == 1:  # a different start: the wrapper takes rank 0's weights
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        dp = DataParallel(model, ["cpu", "cpu"], reducer="dist")
        opt = torch.optim.AdamW(dp.parameters(), lr=1e-2)
        for x, y in batches(4, rows=24, seed=5):
            part = slice(0, 12) if rank == 0 else slice(12, None)  # DDP: equal parts
            loss = F.cross_entropy(dp(x[part].double()), y[part])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(dp.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
        torch.save(dp.state_dict(), os.path.join(out_dir, f"loop{rank}.pt"))
        dist.barrier()  # neither process tears the group down while the other still uses it
    finally:
        dist.destroy_process_group()


def test_dist_conventional_loop_matches_one_process(tmp_path):
    # Two processes x two replicas, the user's loop (AdamW, clipping): the local sum, then the
    # processes' gradients averaged as DDP's, which for equal parts is the global batch's mean.
    world = 2
    mp.spawn(_dist_loop_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world,
             join=True)
    model = make_model(False, torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in batches(4, rows=24, seed=5):
        F.cross_entropy(model(x.double()), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    runs = [torch.load(tmp_path / f"loop{r}.pt") for r in range(world)]
    for k, v in model.state_dict().items():
        torch.testing.assert_close(runs[0][k], v, atol=1e-12, rtol=1e-10)
        assert torch.equal(runs[0][k], runs[1][k])


@pytest.mark.parametrize("replicas,rows,kind,reducer,blocking,accumulate", [
    (3, 2, "wrapper", "p2p", True, 1), (3, 1, "wrapper", "p2p", True, 1),
    (3, 2, "wrapper", "host", True, 1), (3, 2, "wrapper", "p2p", False, 1),
    (3, 2, "adamw", "p2p", True, 1), (4, 1, "adamw", "p2p", True, 2),
    (4, 3, "adamw", "p2p", True, 3)])
def test_a_batch_with_fewer_rows_than_replicas_trains_as_one_device(replicas, rows, kind,
                                                                    reducer, blocking,
                                                                    accumulate):
    # (the last batch of an epoch may be that small: the replicas without rows take part
    # with none)
    import dpcuda.optim
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 4)).double()
    ref = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 4)).double()
    ref.load_state_dict(model.state_dict())
    dp = DataParallel(model, ["cpu"] * replicas, reducer=reducer, lr=0.1, momentum=0.9,
                      blocking=blocking)
    if kind == "wrapper":
        opt, topt = None, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = dpcuda.optim.AdamW(dp.parameters(), lr=0.01, max_grad_norm=0.1)
        topt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(rows, 6, generator=g, dtype=torch.float64)
        y = torch.randint(0, 4, (rows,), generator=g)
        loss = dp.step(x, y, nn.CrossEntropyLoss(), optimizer=opt, accumulate=accumulate)
        topt.zero_grad()
        want = F.cross_entropy(ref(x), y)
        want.backward()
        if opt is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        topt.step()
        assert abs(float(loss) - float(want.detach())) <= 1e-12
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)
