"""BatchNorm under DataParallel (#11 item 5): buffers="broadcast" (DDP's default: every replica
takes replica 0's statistics after each step) and buffers="sync" (statistics over the global
batch, as one device computes them)."""
import copy
import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import reference_train
from dpcuda.batchnorm import Exchange
from dpcuda.parallel import DataParallel


def make_model(dtype=torch.float64, norm=nn.BatchNorm1d, **kw):
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(10, 16), norm(16, **kw), nn.ReLU(),
                         nn.Linear(16, 4)).to(dtype)


def batches(n=4, rows=32, dtype=torch.float64):
    gen = torch.Generator().manual_seed(2)
    return [(torch.randn(rows, 10, generator=gen, dtype=dtype) * 3 + 1,
             torch.randint(0, 4, (rows,), generator=gen)) for _ in range(n)]


def assert_replicas_identical(dp):
    ref = dp.module.state_dict()
    for r in dp.replicas[1:]:
        for k, v in r.state_dict().items():
            assert torch.equal(v.cpu(), ref[k].cpu()), k


@pytest.mark.parametrize("replicas", [2, 3, 4])
@pytest.mark.parametrize("split,weights", [("even", None), ("weighted", "uneven")])
@pytest.mark.parametrize("momentum_bn", [0.1, None])
def test_sync_matches_one_device(replicas, split, weights, momentum_bn):
    model = make_model(momentum=momentum_bn)
    data = batches()
    want = reference_train(model, data, 0.1, 0.9, 1e-3).state_dict()
    w = [0] + [i + 1 for i in range(replicas - 1)] if weights else None  # replica 0: no rows
    dp = DataParallel(copy.deepcopy(model), ["cpu"] * replicas, lr=0.1, momentum=0.9,
                      weight_decay=1e-3, buffers="sync", split=split, split_weights=w)
    losses = [dp.step(x, y, nn.CrossEntropyLoss()) for x, y in data]
    got = dp.module.state_dict()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-10, atol=1e-12)
    assert_replicas_identical(dp)
    assert all(l == l for l in losses)


def test_sync_2d_and_float32():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 4 * 4, 5))
    gen = torch.Generator().manual_seed(4)
    data = [(torch.randn(12, 3, 6, 6, generator=gen), torch.randint(0, 5, (12,), generator=gen))
            for _ in range(3)]
    want = reference_train(model, data, 0.1, 0.9, 1e-3).state_dict()
    dp = DataParallel(copy.deepcopy(model), ["cpu"] * 3, lr=0.1, momentum=0.9,
                      weight_decay=1e-3, buffers="sync")
    for x, y in data:
        dp.step(x, y, nn.CrossEntropyLoss())
    for k, v in dp.module.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=1e-4, atol=1e-5)
    assert_replicas_identical(dp)


def test_broadcast_takes_replica_0_statistics():
    model = make_model()
    (x, y), = batches(1)
    dp = DataParallel(copy.deepcopy(model), ["cpu"] * 2, lr=0.1, buffers="broadcast")
    dp.step(x, y, nn.CrossEntropyLoss())
    assert_replicas_identical(dp)
    # replica 0 normalised its own 16 rows: its running mean is momentum * their mean
    with torch.no_grad():
        pre = model[0](x[:16])
    torch.testing.assert_close(dp.module[1].running_mean, 0.1 * pre.mean(0))
    assert int(dp.module[1].num_batches_tracked) == 1


def test_failed_step_restores_buffers_and_raises_the_real_error():
    model = make_model()
    (x, y), = batches(1)
    for buffers in ("broadcast", "sync"):
        dp = DataParallel(copy.deepcopy(model), ["cpu"] * 2, lr=0.1, buffers=buffers)
        before = copy.deepcopy(dp.module.state_dict())
        bad = y.clone()
        bad[20] = 7  # a bad label in replica 1's rows: it fails after the forward exchanges
        start = time.monotonic()
        with pytest.raises((ValueError, IndexError)) as info:
            dp.step(x, bad, nn.CrossEntropyLoss())
        assert time.monotonic() - start < 10
        assert "7" in str(info.value) or "out of bounds" in str(info.value)
        for k, v in dp.module.state_dict().items():
            assert torch.equal(v, before[k]), (buffers, k)
        assert_replicas_identical(dp)
        dp.step(x, y, nn.CrossEntropyLoss())  # and the next step works


def test_exchange_wait_is_bounded():
    ex = Exchange(2, timeout=0.2)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="did not reach the batch-norm exchange within 0.2 s"):
        ex.all_sum(0, torch.ones(3))
    assert time.monotonic() - start < 5
    # and an abort wakes a waiting replica at once
    ex = Exchange(2, timeout=60)
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError,
                                                                    ex.all_sum, 0,
                                                                    torch.ones(1))))
    t.start()
    time.sleep(0.1)
    ex.abort()
    t.join(5)
    assert not t.is_alive() and errors


def test_outside_a_step_the_modules_are_torch_batch_norm():
    model = make_model()
    dp = DataParallel(copy.deepcopy(model), ["cpu"] * 2, lr=0.1, buffers="sync")
    (x, y), = batches(1)
    dp.step(x, y, nn.CrossEntropyLoss())
    m = dp.module
    plain = make_model()
    plain.load_state_dict(m.state_dict())  # same keys
    m.eval(), plain.eval()
    assert torch.equal(m(x), plain(x))
    m.train(), plain.train()
    assert torch.equal(m(x), plain(x))
    assert isinstance(m[1], nn.BatchNorm1d)
    copy.deepcopy(m)  # and it copies


class MyBatchNorm(nn.BatchNorm1d):
    """A subclass may change forward: sync mode cannot know its statistics."""


def test_bad_arguments():
    model = make_model()
    with pytest.raises(ValueError, match="buffers must be one of broadcast, sync"):
        DataParallel(model, ["cpu"], buffers="avg")
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        DataParallel(model, ["cpu"], timeout=0)
    with pytest.raises(ValueError, match="supports nn.BatchNorm1d/2d/3d"):
        DataParallel(nn.Sequential(nn.Linear(3, 3), MyBatchNorm(3)), ["cpu"] * 2,
                     buffers="sync")
    # one row over the whole global batch: torch's own error
    dp = DataParallel(make_model(), ["cpu"], buffers="sync")
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        dp.step(torch.randn(1, 10, dtype=torch.float64), torch.tensor([0]),
                nn.CrossEntropyLoss())


def _dist_bn_worker(rank, world, port, out_dir):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                           world_size=world)
    try:
        dp = DataParallel(make_model(), ["cpu", "cpu"], reducer="dist", lr=0.1,
                          buffers="broadcast")
        with pytest.raises(ValueError, match="with reducer='dist' use buffers='broadcast'"):
            DataParallel(make_model(), ["cpu"], reducer="dist", buffers="sync")
        for x, y in batches(3):
            half = x.shape[0] // 2  # each process its own half of the global batch
            dp.step(x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half],
                    nn.CrossEntropyLoss())
        torch.save(dp.module.state_dict(), f"{out_dir}/bn{rank}.pt")
        # rank 0's replica 0 normalised rows [0, 8) of the last batch
    finally:
        dist.destroy_process_group()


def test_dist_broadcast_makes_every_process_take_rank_0_buffers(tmp_path):
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_dist_bn_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    a, b = (torch.load(tmp_path / f"bn{r}.pt") for r in range(2))
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert int(a["1.num_batches_tracked"]) == 3
