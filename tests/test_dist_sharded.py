"""ZeRO-1 across processes (dpcuda/parallel/sharded.py): DataParallel.step(..., optimizer=opt)
with reducer "dist" and a dpcuda.optim optimizer, on gloo processes over loopback, against
torch.optim on one process as the oracle."""

import copy
import datetime
import gc
import math
import os
import socket
import warnings

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import dpcuda.optim
from dpcuda.parallel import DataParallel


# A collective that one process skips fails the test in a minute instead of hanging it.
TIMEOUT = datetime.timedelta(seconds=60)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 19), nn.Tanh(), nn.Linear(19, 7), nn.ReLU(),
                         nn.Linear(7, 5)).to(dtype)


def batches():
    """Global batches of changing sizes; step 4 holds a NaN in rank 1's rows (skipped on
    every process), step 6 ignores every third label, step 8 ignores all of them."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for i, rows in enumerate([24, 24, 17, 24, 24, 9, 31, 24, 24, 24]):
        x = torch.randn(rows, 12, generator=gen)
        y = torch.randint(0, 5, (rows,), generator=gen)
        if i == 4:
            x[-1, 2] = float("nan")
        if i == 6:
            y[::3] = -100
        if i == 8:
            y[:] = -100
        out.append((x, y))
    return out


def cut(step, rows, rank, world):
    """Process rank's rows of a global batch: uneven on purpose."""
    bounds = [0] + [min(rows, (k + 1) * rows // world + (step % 2) * (k == 0) * 2)
                    for k in range(world - 1)] + [rows]
    return slice(bounds[rank], bounds[rank + 1])


def make_optimizer(name, model, clip):
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    groups = [{"params": decay}, {"params": rest, "weight_decay": 0.0}]
    mod = dpcuda.optim if clip is not False else torch.optim
    kw = {} if clip is False else {"max_grad_norm": clip}
    if name == "adamw":
        return mod.AdamW(groups, lr=0.02, weight_decay=0.05, **kw)
    if name == "adam-amsgrad":
        return mod.Adam(groups, lr=0.02, weight_decay=0.01, amsgrad=True, **kw)
    return mod.SGD(groups, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3, **kw)


def reference(name, dtype, clip, steps=None):
    """One process, torch.optim, the whole global batch: the weights, losses, norms and
    optimizer state the sharded processes must reproduce."""
    model = make_model(dtype)
    opt = make_optimizer(name, model, False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    losses, norms = [], []
    for i, (x, y) in enumerate(batches()[:steps]):
        opt.zero_grad()
        loss = F.cross_entropy(model(x.to(dtype)), y)
        losses.append(float(loss.detach()))
        if torch.isnan(x).any():
            norms.append(math.nan)
            sched.step()
            continue
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        sched.step()
    return model, opt, losses, norms


def _worker(rank, world, port, out_dir, name, dtype, clip, devices):
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=TIMEOUT)
    try:
        model = make_model(dtype)
        dp = DataParallel(model, ["cpu"] * devices, reducer="dist", shard_optimizer=True)
        opt = make_optimizer(name, dp.module, clip)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        losses, norms, skipped = [], [], []
        for i, (x, y) in enumerate(batches()):
            part = cut(i, x.shape[0], rank, world)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                losses.append(dp.step(x[part].to(dtype), y[part], F.cross_entropy,
                                      optimizer=opt))
            skipped.append(any("NaN or Inf" in str(w.message) for w in caught))
            norms.append(float(opt.grad_norm) if clip is not None else None)
            sched.step()
            assert all(p.grad is None for p in dp.module.parameters())
        shards = dp._sharded_update.shards
        result = {"weights": {k: v.clone() for k, v in dp.module.state_dict().items()},
                  "losses": losses, "norms": norms, "skipped": skipped,
                  "state_bytes": shards.state_bytes, "sharded": shards.sharded}
        try:
            opt.state_dict()
            result["unconsolidated"] = None
        except RuntimeError as err:
            result["unconsolidated"] = str(err)
        try:
            opt.step()
            result["conventional"] = None
        except RuntimeError as err:
            result["conventional"] = str(err)
        opt.consolidate_state_dict(to=0)
        if rank == 0:
            result["state"] = opt.state_dict()
        else:
            try:
                opt.state_dict()
            except RuntimeError as err:
                result["other_rank"] = str(err)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # neither process tears the group down while the other still uses it
    finally:
        gc.collect()  # (gloo's objects before their group: left to exit, a worker may abort)
        dist.destroy_process_group()


CASES = [("adamw", torch.float64, 0.3, 2, 1), ("adamw", torch.float32, None, 2, 2),
         ("adam-amsgrad", torch.float64, 0.05, 3, 1), ("sgd", torch.float64, 0.3, 2, 1),
         ("sgd", torch.float32, None, 3, 2)]


@pytest.mark.parametrize("name,dtype,clip,world,devices", CASES,
                         ids=[f"{c[0]}-{str(c[1])[6:]}-clip{c[2]}-w{c[3]}-r{c[4]}"
                              for c in CASES])
def test_sharded_dist_step_trains_what_one_process_trains(tmp_path, name, dtype, clip, world,
                                                          devices):
    mp.spawn(_worker, args=(world, _free_port(), str(tmp_path), name, dtype, clip, devices),
             nprocs=world, join=True)
    runs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    model, ref_opt, ref_losses, ref_norms = reference(name, dtype, clip)
    tol = {torch.float32: (2e-5, 1e-4), torch.float64: (1e-11, 1e-10)}[dtype]
    for run in runs:
        assert run["skipped"] == [i == 4 for i in range(len(ref_losses))]
        finite = [i for i, v in enumerate(ref_losses) if math.isfinite(v)]
        torch.testing.assert_close([run["losses"][i] for i in finite],
                                   [ref_losses[i] for i in finite], atol=tol[0], rtol=tol[1])
        assert [i for i, v in enumerate(run["losses"]) if math.isnan(v)] == [4, 8]
        if clip is not None:
            # (the norms: a NaN for the skipped step, the clipping norm of every other)
            assert math.isnan(run["norms"][4])
            torch.testing.assert_close([v for i, v in enumerate(run["norms"]) if i != 4],
                                       [v for i, v in enumerate(ref_norms) if i != 4],
                                       atol=tol[0], rtol=tol[1])
        for k, v in model.state_dict().items():
            torch.testing.assert_close(run["weights"][k], v, atol=tol[0], rtol=tol[1])
            # every process the same bits
            assert torch.equal(run["weights"][k], runs[0]["weights"][k])
        assert run["sharded"]
        assert "consolidate_state_dict" in run["unconsolidated"]
        assert "consolidate_state_dict" in run["conventional"]
    assert "consolidate_state_dict" in runs[1]["other_rank"]
    # State bytes per process: its shard, about 1/world of the whole.
    n = sum(p.numel() for p in model.parameters())
    keys = {"adamw": 2, "adam-amsgrad": 3, "sgd": 1}[name]
    whole = n * keys * torch.tensor([], dtype=dtype).element_size()
    assert sum(r["state_bytes"] for r in runs) == whole
    for r in runs:
        assert r["state_bytes"] <= whole / world + 16 * keys
    # The consolidated state_dict is torch's: it matches the oracle's and loads into it.
    state = runs[0]["state"]
    ref_state = ref_opt.state_dict()
    assert state["param_groups"] == ref_state["param_groups"]
    assert state["state"].keys() == ref_state["state"].keys()
    for i, entry in ref_state["state"].items():
        assert entry.keys() == state["state"][i].keys()
        for k, v in entry.items():
            torch.testing.assert_close(state["state"][i][k].to(v.dtype), v, atol=tol[0],
                                       rtol=tol[1])
    torch_opt = make_optimizer(name, copy.deepcopy(model), False)
    torch_opt.load_state_dict(state)


def _resume_worker(rank, world, port, out_dir, saved):
    """Loads a consolidated whole state on every process mid-run, trains on: the same as
    training straight through; a bad label on one process fails the step on all."""
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=TIMEOUT)
    try:
        data = batches()
        model = make_model(torch.float64)
        dp = DataParallel(model, ["cpu"], reducer="dist", shard_optimizer=True)
        opt = make_optimizer("adamw", dp.module, 1.0)
        errors = []
        for i, (x, y) in enumerate(data[:4]):
            part = cut(i, x.shape[0], rank, world)
            y = y.clone()
            if i == 2 and rank == 1:
                y[part.start] = 9  # a bad label on rank 1's rows
            try:
                dp.step(x[part].double(), y[part], F.cross_entropy, optimizer=opt)
                errors.append(None)
            except Exception as err:  # noqa: BLE001 (recorded and compared)
                errors.append(f"{type(err).__name__}: {err}")
        opt.consolidate_state_dict(to=None)  # every rank: a whole copy, then reload it
        state = copy.deepcopy(opt.state_dict())
        weights = copy.deepcopy(dp.state_dict())
        fresh = make_model(torch.float64)
        dp2 = DataParallel(fresh, ["cpu"], reducer="dist", shard_optimizer=True)
        dp2.load_state_dict(weights)
        opt2 = make_optimizer("adamw", dp2.module, 1.0)
        opt2.load_state_dict(state)
        for i, (x, y) in enumerate(data[5:8], start=5):
            part = cut(i, x.shape[0], rank, world)
            dp2.step(x[part].double(), y[part], F.cross_entropy, optimizer=opt2)
        torch.save({"errors": errors, "weights": dp2.state_dict()},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # neither process tears the group down while the other still uses it
    finally:
        gc.collect()  # (gloo's objects before their group: left to exit, a worker may abort)
        dist.destroy_process_group()


def test_sharded_state_reloads_and_a_failed_step_fails_everywhere(tmp_path):
    world = 2
    mp.spawn(_resume_worker, args=(world, _free_port(), str(tmp_path), None), nprocs=world,
             join=True)
    runs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    assert runs[0]["errors"][:2] == [None, None] and runs[0]["errors"][3] is None
    assert "another process failed" in runs[0]["errors"][2]
    assert "Target 9 is out of bounds" in runs[1]["errors"][2]
    # The oracle: one process, torch's AdamW, clip_grad_norm_, without step 2.
    model = make_model(torch.float64)
    opt = make_optimizer("adamw", model, False)
    for i, (x, y) in enumerate(batches()):
        if i in (2, 4, 8, 9) or i > 7:
            continue
        opt.zero_grad()
        F.cross_entropy(model(x.double()), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(runs[0]["weights"][k], v, atol=1e-11, rtol=1e-10)
        assert torch.equal(runs[0]["weights"][k], runs[1]["weights"][k])


def _scenario_worker(rank, world, port, out_dir, scenario):
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=TIMEOUT)
    try:
        model, data, opt_fn, accumulate = SCENARIOS[scenario]()
        dp = DataParallel(model, ["cpu"], reducer="dist", shard_optimizer=True)
        opt = opt_fn(dp.module)
        sharded = []
        for i, (x, y) in enumerate(data):
            CHANGES[scenario](i, dp.module, opt)
            part = cut(i, x.shape[0], rank, world)
            loss_fn = F.cross_entropy
            if scenario == "consolidate" and i in (2, 3):
                # rank 0 gathers the state (twice), then a step on the gathered path (a loss
                # the step cannot compute per replica) gives it back to the optimizer whole
                for _ in range(2 if i == 2 else 1):
                    opt.consolidate_state_dict(to=0)
                if rank == 0:
                    opt.state_dict()
                if i == 3:
                    loss_fn = lambda out, y: F.cross_entropy(out, y)  # noqa: E731
                    part = slice(rank * x.shape[0] // world, (rank + 1) * x.shape[0] // world)
            dp.step(x[part], y[part], loss_fn, optimizer=opt, accumulate=accumulate)
            sharded.append(dp._zero)
        opt.consolidate_state_dict(to=0)
        torch.save({"weights": dp.state_dict(), "sharded": sharded,
                    "state": opt.state_dict() if rank == 0 else None},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # neither process tears the group down while the other still uses it
    finally:
        gc.collect()  # (gloo's objects before their group: left to exit, a worker may abort)
        dist.destroy_process_group()


def _tiny():
    # 4 parameters over 3 processes: shards of 2, 2 and 0 elements (float64 aligns to 2)
    torch.manual_seed(1)
    gen = torch.Generator().manual_seed(2)
    data = [(torch.randn(9, 1, generator=gen, dtype=torch.float64),
             torch.randint(0, 2, (9,), generator=gen)) for _ in range(6)]
    return (nn.Linear(1, 2).double(), data,
            lambda m: dpcuda.optim.Adam(m.parameters(), lr=0.1, max_grad_norm=0.2), 1)


def _changing():
    gen = torch.Generator().manual_seed(4)
    data = [(torch.randn(20, 12, generator=gen, dtype=torch.float64),
             torch.randint(0, 5, (20,), generator=gen)) for _ in range(9)]
    return (make_model(torch.float64), data,
            lambda m: dpcuda.optim.AdamW(m.parameters(), lr=0.02, max_grad_norm=0.3), 2)


def _change(i, model, opt):
    # frozen at step 3 (the sharded state gathered, the step counts then part ways: the
    # optimizer's own step on the whole state from then on), unfrozen at step 6
    if i == 3:
        model[2].weight.requires_grad_(False)
    if i == 6:
        model[2].weight.requires_grad_(True)


def _consolidating():
    model, data, _, _ = _changing()
    return model, data, lambda m: dpcuda.optim.AdamW(m.parameters(), lr=0.02,
                                                     max_grad_norm=0.3), 1


SCENARIOS = {"tiny": _tiny, "changing": _changing, "consolidate": _consolidating}
CHANGES = {"tiny": lambda i, m, o: None, "changing": _change,
           "consolidate": lambda i, m, o: None}


@pytest.mark.parametrize("scenario,world", [("tiny", 3), ("changing", 2), ("consolidate", 2)])
def test_sharded_steps_with_empty_shards_and_changes_after_wrapping(tmp_path, scenario, world):
    mp.spawn(_scenario_worker, args=(world, _free_port(), str(tmp_path), scenario),
             nprocs=world, join=True)
    runs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    model, data, opt_fn, accumulate = SCENARIOS[scenario]()
    clip = 0.2 if scenario == "tiny" else 0.3
    opt = getattr(torch.optim, type(opt_fn(copy.deepcopy(model))).__name__)(
        model.parameters(), **{k: v for k, v in opt_fn(copy.deepcopy(model)).defaults.items()
                               if k in ("lr", "weight_decay", "betas", "eps")})
    for i, (x, y) in enumerate(data):
        CHANGES[scenario](i, model, opt)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None],
                                       clip)
        opt.step()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(runs[0]["weights"][k], v, atol=1e-11, rtol=1e-10)
        for run in runs[1:]:
            assert torch.equal(run["weights"][k], runs[0]["weights"][k])
    ref = opt.state_dict()["state"]
    for i, entry in ref.items():
        for k, v in entry.items():
            torch.testing.assert_close(runs[0]["state"]["state"][i][k].to(v.dtype), v,
                                       atol=1e-11, rtol=1e-10)
    if scenario == "tiny":
        assert all(runs[0]["sharded"])
    elif scenario == "consolidate":
        assert runs[0]["sharded"] == [True] * 3 + [False] + [True] * 5
    else:
        # sharded until the freeze; after it the frozen weight's step count lags its group's
        assert runs[0]["sharded"] == [True] * 3 + [False] * 6


def _default_worker(rank, world, port, out_dir):
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=TIMEOUT)
    try:
        model, data, opt_fn, _ = _changing()
        dp = DataParallel(model, ["cpu"], reducer="dist")
        opt = opt_fn(dp.module)
        flags = [dp.shard_optimizer]
        for i, (x, y) in enumerate(data[:6]):
            if i == 2:
                dp.shard_optimizer = True   # sharded from here ...
            if i == 4:
                dp.shard_optimizer = False  # ... and whole again, gathered on every process
            part = cut(i, x.shape[0], rank, world)
            dp.step(x[part], y[part], F.cross_entropy, optimizer=opt)
            flags.append(dp._zero)
        state = opt.state_dict()  # whole: no consolidation needed
        torch.save({"flags": flags, "weights": dp.state_dict(), "state": state},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # neither process tears the group down while the other still uses it
    finally:
        gc.collect()  # (gloo's objects before their group: left to exit, a worker may abort)
        dist.destroy_process_group()


def test_gloo_keeps_the_state_whole_by_default_and_the_switch_gathers_it(tmp_path):
    mp.spawn(_default_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    runs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert runs[0]["flags"] == [False, False, False, True, True, False, False]
    model, data, opt_fn, _ = _changing()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    for x, y in data[:6]:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
        opt.step()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(runs[0]["weights"][k], v, atol=1e-11, rtol=1e-10)
        assert torch.equal(runs[0]["weights"][k], runs[1]["weights"][k])
    for r in runs:
        for i, entry in opt.state_dict()["state"].items():
            for k, v in entry.items():
                torch.testing.assert_close(r["state"]["state"][i][k].to(v.dtype), v,
                                           atol=1e-11, rtol=1e-10)


def test_shard_optimizer_argument_checks():
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="shard_optimizer must be None, True or False"):
        DataParallel(model, ["cpu"], shard_optimizer="yes")
    with pytest.raises(ValueError, match="reducer='dist'"):
        DataParallel(model, ["cpu"], shard_optimizer=True)


def _adversarial_worker(rank, world, port, out_dir, which):
    """What a process may do alone or a user may change mid-run, with the state sharded
    (each must keep the processes in the same collectives and the state whole)."""
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=TIMEOUT)
    try:
        model, data, _, _ = _changing()
        events = []
        if which == "adamw":
            dp = DataParallel(model, ["cpu"], reducer="dist", shard_optimizer=True)
            opt = dpcuda.optim.AdamW(dp.parameters(), lr=0.02, max_grad_norm=0.3)
            for i, (x, y) in enumerate(data[:8]):
                part = slice(rank * 10, rank * 10 + 10)  # (even: the conventional loop's mean)
                target = y[part]
                handle = None
                if i == 2 and rank == 1:
                    target = target.tolist()  # not a tensor, on one process only
                if i == 3 and rank == 0:
                    handle = opt.register_step_pre_hook(lambda o, a, k: None)  # one process
                if i == 4:
                    # the same model and optimizer wrapped anew: the old wrapper's shards hold
                    # the moments
                    dp = DataParallel(model, ["cpu"], reducer="dist", shard_optimizer=True)
                if i == 5:
                    # every process takes the whole state, then a conventional step of its own
                    opt.consolidate_state_dict(to=None)
                    opt.zero_grad()
                    F.cross_entropy(dp(x[part]), y[part]).backward()
                    opt.step()
                    events.append("conventional")
                    opt.consolidate_state_dict(to=0)  # (nothing sharded: no exchange)
                    continue
                try:
                    dp.step(x[part], target, F.cross_entropy, optimizer=opt)
                    events.append(dp._zero)
                except Exception as err:  # noqa: BLE001 (recorded and compared)
                    events.append(type(err).__name__)
                if handle is not None:
                    handle.remove()
            opt.consolidate_state_dict(to=0)
            state = opt.state_dict() if rank == 0 else None
        else:  # sgd: momentum off for a step, then on again; then a state that does not fit
            dp = DataParallel(model, ["cpu"], reducer="dist", shard_optimizer=True)
            opt = dpcuda.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9)
            for i, (x, y) in enumerate(data[:6]):
                for g in opt.param_groups:
                    g["momentum"] = 0.0 if i == 3 else 0.9
                part = slice(rank * 10, rank * 10 + 10)
                dp.step(x[part], y[part], F.cross_entropy, optimizer=opt)
                events.append(dp._zero)
            opt.consolidate_state_dict(to=None)
            state = copy.deepcopy(opt.state_dict())
            bad = copy.deepcopy(state)
            bad["state"][0]["momentum_buffer"] = torch.zeros(3, dtype=torch.float64)
            opt.load_state_dict(bad)
            x, y = data[6]
            try:
                dp.step(x[rank * 10:rank * 10 + 10], y[rank * 10:rank * 10 + 10],
                        F.cross_entropy, optimizer=opt)
                events.append("no error")
            except Exception as err:  # noqa: BLE001
                events.append(f"{type(err).__name__}: {err}")
        torch.save({"events": events, "weights": model.state_dict(), "state": state},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # neither process tears the group down while the other still uses it
    finally:
        gc.collect()  # (gloo's objects before their group: left to exit, a worker may abort)
        dist.destroy_process_group()


@pytest.mark.parametrize("which", ["adamw", "sgd"])
def test_sharded_state_survives_what_one_process_or_the_user_does(tmp_path, which):
    mp.spawn(_adversarial_worker, args=(2, _free_port(), str(tmp_path), which), nprocs=2,
             join=True)
    runs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    model, data, _, _ = _changing()
    if which == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=0.02)
        for i, (x, y) in enumerate(data[:8]):
            if i == 2:
                continue  # failed on every process
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
            opt.step()
        assert runs[0]["events"] == [True, True, "RuntimeError", False, True, "conventional",
                                     True, True]
        assert runs[1]["events"][2] == "TypeError"
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for i, (x, y) in enumerate(data[:6]):
            for g in opt.param_groups:
                g["momentum"] = 0.0 if i == 3 else 0.9
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        assert runs[0]["events"][:6] == [True] * 6
        for r in runs:  # a state that does not fit: the same clear error on every process
            assert "has shape [3]" in r["events"][6] and r["events"][6].startswith("ValueError")
    for k, v in model.state_dict().items():
        torch.testing.assert_close(runs[0]["weights"][k], v, atol=1e-11, rtol=1e-10)
        assert torch.equal(runs[0]["weights"][k], runs[1]["weights"][k])
    ref = opt.state_dict()
    assert runs[0]["state"]["state"].keys() == ref["state"].keys()
    for i, entry in ref["state"].items():
        assert runs[0]["state"]["state"][i].keys() == entry.keys()
        for k, v in entry.items():
            torch.testing.assert_close(runs[0]["state"]["state"][i][k].to(v.dtype), v,
                                       atol=1e-11, rtol=1e-10)
