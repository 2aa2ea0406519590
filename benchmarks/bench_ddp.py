"""dpcuda against torch DistributedDataParallel: N processes train the same MLP, on the same
data, from the same initial weights, four ways, alternated step by step (round-robin, the
order rotating every step) so that the machine's drift falls on all alike:

  ddp           torch.nn.parallel.DistributedDataParallel over nn.Linear/ReLU, torch.optim.SGD
                (--optimizer adamw: torch.optim.AdamW, foreach)
  ddp-tuned     the same with gradient_as_bucket_view=True and SGD(fused=True) (AdamW(fused=True))
  dpcuda        dpcuda.parallel.DataParallel(reducer="dist") over dpcuda.nn.FusedMLP (with
                --optimizer adamw: step(optimizer=dpcuda.optim.AdamW))
  dpcuda-plain  the same over nn.Linear/ReLU (the reduction and the fused update alone)
  dpcuda-zero   (--optimizer adamw) dpcuda with the AdamW state sharded over the processes
                (shard_optimizer=True, ZeRO-1: reduce-scatter, update of the own shard,
                all-gather), over FusedMLP

gloo on the CPU (one process per core, one torch thread each), NCCL with one GPU per process
where GPUs exist (there, torch.nn.DataParallel over all GPUs in one process is timed too). A
step is timed from a barrier to the end of the step (the optimizer update included) on every
rank; the step's time is the slowest rank's. Reports per-step medians with quartiles and the
paired ratios DDP/dpcuda (per step, adjacent runs). The same model: after CHECK_STEPS steps
every model's weights must be within 1% of how far DDP's moved, and dpcuda's ranks must hold
the same bits; the differences at the end are reported (training amplifies rounding: a relu
whose input is near 0 flips). Exit status 1 on a mismatch.

    python benchmarks/bench_ddp.py --json benchmarks/results/ddp-cpu.json
"""

import argparse
import datetime
import gc
import math
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, paired_ratio, write_json  # noqa: E402

import dpcuda  # noqa: E402
import dpcuda.optim  # noqa: E402
from dpcuda.nn import FusedMLP, SoftmaxCrossEntropyLoss  # noqa: E402
from dpcuda.parallel import DataParallel  # noqa: E402

# shape: (layer sizes, global batch, timed steps by default: more where a step is short)
SHAPES = {"784-256-10": ([784, 256, 10], 256, 300),
          "784-1024-1024-10": ([784, 1024, 1024, 10], 512, 60)}
CONTENDERS = ("ddp", "ddp-tuned", "dpcuda", "dpcuda-plain")


def contenders(optimizer):
    return CONTENDERS + (("dpcuda-zero",) if optimizer == "adamw" else ())
# The models are compared after this many steps, before training has amplified rounding
# differences (a pre-activation near 0 that flips a relu sign, then momentum): each must be
# within 1% of how far DDP's weights moved by then. At the end they are only reported.
CHECK_STEPS = 10
CHECK_TOLERANCE = 1e-2


def plain_mlp(sizes):
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i + 2 < len(sizes):
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _summary(ms):
    q = statistics.quantiles(ms, n=4) if len(ms) > 1 else ms * 3
    return {"median_ms": statistics.median(ms), "q1_ms": q[0], "q3_ms": q[2]}


def _max_diff(a, b):
    return max(float((x.detach().cpu().double() - y.detach().cpu().double()).abs().max())
               for x, y in zip(a, b))


def _batch(step, seed, sizes, global_batch, rank, world, teacher, device):
    """This rank's rows of global batch `step`, made from its own seed (nothing is kept)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(global_batch, sizes[0], generator=gen)
    y = (x @ teacher).argmax(-1)
    per = global_batch // world
    return x[rank * per:(rank + 1) * per].to(device), y[rank * per:(rank + 1) * per].to(device)


def run_shape(rank, world, device, sizes, global_batch, steps, warmup, lr, momentum, seed,
              optimizer="sgd"):
    """One shape on this rank: returns the per-step times of each contender (the slowest
    rank's) and the parameters' differences, after CHECK_STEPS steps and at the end."""
    torch.manual_seed(seed)
    init = [p.detach().clone() for p in plain_mlp(sizes).parameters()]  # the same on every rank
    # Learnable labels (a fixed random linear teacher), not noise.
    teacher = torch.randn(sizes[0], sizes[-1], generator=torch.Generator().manual_seed(seed))

    names = contenders(optimizer)
    models = {"ddp": plain_mlp(sizes), "ddp-tuned": plain_mlp(sizes), "dpcuda": FusedMLP(sizes),
              "dpcuda-plain": plain_mlp(sizes), "dpcuda-zero": FusedMLP(sizes)}
    models = {n: models[n] for n in names}
    with torch.no_grad():
        for model in models.values():
            model.to(device)
            for p, q in zip(model.parameters(), init):
                p.copy_(q)
    ids = [device.index] if device.type == "cuda" else None
    ddp = torch.nn.parallel.DistributedDataParallel(models["ddp"], device_ids=ids)
    adamw = optimizer == "adamw"

    def torch_opt(params, **impl):
        if adamw:
            return torch.optim.AdamW(params, lr=lr, **impl)
        return torch.optim.SGD(params, lr=lr, momentum=momentum, **impl)
    opt = torch_opt(ddp.parameters(), **({"foreach": True} if adamw else {}))
    # DDP as tuned by hand: gradients as views of its buckets (no copy into them) and the
    # fused optimizer kernel.
    tuned = torch.nn.parallel.DistributedDataParallel(models["ddp-tuned"], device_ids=ids,
                                                      gradient_as_bucket_view=True)
    tuned_opt = torch_opt(tuned.parameters(), fused=True)
    dp_fused = DataParallel(models["dpcuda"], [device], reducer="dist", lr=lr,
                            momentum=momentum)
    dp_plain = DataParallel(models["dpcuda-plain"], [device], reducer="dist", lr=lr,
                            momentum=momentum)
    ours = {"dpcuda": dpcuda.optim.AdamW(dp_fused.parameters(), lr=lr) if adamw else None,
            "dpcuda-plain": dpcuda.optim.AdamW(dp_plain.parameters(), lr=lr) if adamw else None}
    if adamw:
        dp_zero = DataParallel(models["dpcuda-zero"], [device], reducer="dist",
                               shard_optimizer=True)
        ours["dpcuda-zero"] = dpcuda.optim.AdamW(dp_zero.parameters(), lr=lr)
    fused_loss = SoftmaxCrossEntropyLoss()

    def ddp_step(model, optimizer):
        def run(x, y):
            optimizer.zero_grad(set_to_none=False)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        return run

    steps_fn = {"ddp": ddp_step(ddp, opt), "ddp-tuned": ddp_step(tuned, tuned_opt),
                "dpcuda": lambda x, y: dp_fused.step(x, y, fused_loss,
                                                     optimizer=ours["dpcuda"]),
                "dpcuda-plain": lambda x, y: dp_plain.step(x, y, F.cross_entropy,
                                                           optimizer=ours["dpcuda-plain"])}
    if adamw:
        steps_fn["dpcuda-zero"] = lambda x, y: dp_zero.step(x, y, fused_loss,
                                                            optimizer=ours["dpcuda-zero"])
    params = {"ddp": lambda: ddp.module.parameters(),
              "ddp-tuned": lambda: tuned.module.parameters(),
              "dpcuda": lambda: dp_fused.module.parameters(),
              "dpcuda-plain": lambda: dp_plain.module.parameters()}
    if adamw:
        params["dpcuda-zero"] = lambda: dp_zero.module.parameters()

    def differences():
        ref = [p.detach().clone() for p in params["ddp"]()]
        out = {"ddp_moved": _max_diff(ref, init)}
        for name in names[1:]:
            out[f"{name}_vs_ddp"] = _max_diff(params[name](), ref)
        return out

    times = {name: [] for name in names}
    total = warmup + steps
    early = None
    n = len(names)
    for i in range(total):
        x, y = _batch(i, seed, sizes, global_batch, rank, world, teacher, device)
        for name in names[i % n:] + names[:i % n]:
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            steps_fn[name](x, y)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                times[name].append((time.perf_counter() - t0) * 1e3)
        if i + 1 == min(total, CHECK_STEPS):
            early = differences()
            early["steps"] = i + 1

    # The slowest rank's time of every step.
    stacked = torch.tensor([times[n] for n in names], dtype=torch.float64)
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
    times = {n: stacked[k].tolist() for k, n in enumerate(names)}

    final = differences()
    final["steps"] = total
    # Every rank must hold the same dpcuda weights, bit for bit.
    spread = 0.0
    for name in [n for n in names if n.startswith("dpcuda")]:
        for p in params[name]():
            lo, hi = p.detach().clone(), p.detach().clone()
            dist.all_reduce(lo, op=dist.ReduceOp.MIN)
            dist.all_reduce(hi, op=dist.ReduceOp.MAX)
            spread = max(spread, float((hi - lo).abs().max()))
    return times, {"early": early, "final": final, "dpcuda_across_ranks": spread}


def _worker(rank, world, port, args, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.backend == "nccl"
    if not cuda:
        # One torch thread per process. Not pinned to a core: gloo's own threads then find the
        # other core while this one computes (pinned, the 784-256-10 step took 1.7x as long).
        torch.set_num_threads(1)
    device = torch.device(f"cuda:{rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        out = {}
        for shape in args.shapes:
            sizes, batch, steps = SHAPES[shape]
            out[shape] = run_shape(rank, world, device, sizes, batch, args.steps or steps,
                                   args.warmup, args.lr, args.momentum, args.seed,
                                   args.optimizer)
        if rank == 0:
            # A file, not a pipe: a pipe's 64 KiB would block rank 0 (and the run) while the
            # parent waits for the workers to end.
            torch.save(out, out_path)
    finally:
        # Free the DDP and gloo objects before their process group goes: left to the
        # interpreter's exit, a spawned worker aborted ("terminate called without an active
        # exception") after destroy_process_group.
        gc.collect()
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_torch_dataparallel(sizes, global_batch, steps, warmup, lr, momentum, seed):
    """torch.nn.DataParallel over every GPU, one process: the median step time in ms."""
    torch.manual_seed(seed)
    model = torch.nn.DataParallel(plain_mlp(sizes).cuda())
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(global_batch, sizes[0], generator=gen).cuda()
    y = torch.randint(0, sizes[-1], (global_batch,), generator=gen).cuda()
    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return _summary(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    gpus = torch.cuda.device_count() if dpcuda.cuda_available() else 0
    parser.add_argument("--procs", type=int, default=gpus if gpus >= 2 else 2,
                        help="processes (default: one per GPU, else 2)")
    parser.add_argument("--backend", choices=("gloo", "nccl"),
                        default="nccl" if gpus >= 2 else "gloo")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per shape (default 300 for 784-256-10, 60 for the "
                             "wider one)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                        help="sgd (lr, momentum) or adamw (lr; torch's foreach and fused "
                             "AdamW against dpcuda.optim.AdamW)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if not args.shapes:
        parser.error(f"--shapes: name at least one of {', '.join(SHAPES)}")
    for name in ("lr", "momentum"):
        value = getattr(args, name)
        if not math.isfinite(value) or value < 0:
            parser.error(f"--{name} must be a non-negative finite number, got {value}")
    for s in args.shapes:
        if s not in SHAPES:
            parser.error(f"--shapes: {s!r} is not one of {', '.join(SHAPES)}")
    if args.procs < 2 or (args.steps is not None and args.steps < 1) or args.warmup < 0:
        parser.error("--procs must be at least 2, --steps at least 1, --warmup at least 0")
    for s in args.shapes:
        if SHAPES[s][1] % args.procs:
            parser.error(f"--procs {args.procs} does not divide the global batch of {s}")
    if args.backend == "nccl" and args.procs > gpus:
        parser.error(f"--backend nccl needs one GPU per process; {gpus} GPUs here")

    if args.json:
        folder = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            parser.error(f"--json: cannot write into {folder}")
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "results.pt")
        mp.start_processes(_worker, args=(args.procs, _free_port(), args, out_path),
                           nprocs=args.procs, join=True, start_method="spawn")
        results = torch.load(out_path)

    device = "cuda" if args.backend == "nccl" else "cpu"
    env = environment(device)
    env["threads"] = 1 if device == "cpu" else env["threads"]
    print(f"dpcuda vs torch DDP: {args.procs} processes, {args.backend}, {env['device_name']}, "
          f"timed steps {', '.join(str(args.steps or SHAPES[s][2]) for s in args.shapes)} "
          f"(+{args.warmup} warm-up), " + (f"AdamW lr {args.lr}" if args.optimizer == "adamw"
                                           else f"SGD lr {args.lr} momentum {args.momentum}"))
    print("ms per step, median [q1, q3], the slowest rank; ratios: median of the per-step "
          "ratios [quartiles]")
    names = contenders(args.optimizer)
    print(f"{'shape':<18}{'batch':>6}" + "".join(f"{n:>22}" for n in names) +
          f"{'ddp/dpcuda':>19}{'tuned/dpcuda':>19}")
    rows = []
    bad = []
    for shape in args.shapes:
        times, diffs = results[shape]
        sizes, batch, steps = SHAPES[shape]
        row = {"steps": args.steps or steps, "shape": shape, "sizes": sizes,
               "global_batch": batch, **{n: _summary(times[n]) for n in names},
               "ratio_ddp_over_dpcuda": paired_ratio(times["ddp"], times["dpcuda"]),
               "ratio_ddp_tuned_over_dpcuda": paired_ratio(times["ddp-tuned"], times["dpcuda"]),
               "ratio_ddp_over_dpcuda_plain": paired_ratio(times["ddp"], times["dpcuda-plain"]),
               "param_diff": diffs, "samples_ms": times}
        if "dpcuda-zero" in names:
            row["ratio_dpcuda_over_dpcuda_zero"] = paired_ratio(times["dpcuda"],
                                                                times["dpcuda-zero"])
            row["ratio_ddp_tuned_over_dpcuda_zero"] = paired_ratio(times["ddp-tuned"],
                                                                   times["dpcuda-zero"])
        if device == "cuda":
            row["torch_dataparallel"] = time_torch_dataparallel(
                sizes, batch, args.steps or steps, args.warmup, args.lr, args.momentum, args.seed)
        rows.append(row)
        cell = lambda s: f"{s['median_ms']:.2f} [{s['q1_ms']:.2f}, {s['q3_ms']:.2f}]"  # noqa: E731
        ratio = lambda r: f"{r['median']:.2f} [{r['q1']:.2f},{r['q3']:.2f}]"  # noqa: E731
        print(f"{shape:<18}{batch:>6}" + "".join(f"{cell(row[n]):>22}" for n in names) +
              f"{ratio(row['ratio_ddp_over_dpcuda']):>19}"
              f"{ratio(row['ratio_ddp_tuned_over_dpcuda']):>19}")
        if "dpcuda-zero" in names:
            print(f"{'':<18}dpcuda/dpcuda-zero {ratio(row['ratio_dpcuda_over_dpcuda_zero'])}, "
                  f"ddp-tuned/dpcuda-zero "
                  f"{ratio(row['ratio_ddp_tuned_over_dpcuda_zero'])}")
        if "torch_dataparallel" in row:
            print(f"{'':<18}torch.nn.DataParallel (1 process): "
                  f"{cell(row['torch_dataparallel'])} ms")
        # The same model: every rank's dpcuda weights bit-identical; after CHECK_STEPS steps
        # every model within CHECK_TOLERANCE of how far DDP's weights had moved.
        early, final = diffs["early"], diffs["final"]
        for when in (early, final):
            print(f"{'':<18}after {when['steps']} steps: max |W - W_ddp| " +
                  ", ".join(f"{k[:-7]} {v:.1e}" for k, v in when.items() if k.endswith("_vs_ddp"))
                  + f" (DDP's weights moved {when['ddp_moved']:.2e})")
        if diffs["dpcuda_across_ranks"] != 0.0:
            bad.append(f"{shape}: dpcuda's ranks differ by {diffs['dpcuda_across_ranks']:.3g}")
        for k, v in early.items():
            if k.endswith("_vs_ddp") and not v <= CHECK_TOLERANCE * early["ddp_moved"]:
                bad.append(f"{shape}: after {early['steps']} steps {k} = {v:.3g}")
    for line in bad:
        print(f"MISMATCH {line}")
    write_json(args.json, {"command": "benchmarks/bench_ddp.py", "procs": args.procs,
                           "backend": args.backend, "warmup": args.warmup,
                           "lr": args.lr, "momentum": args.momentum,
                           "optimizer": args.optimizer, "environment": env,
                           "results": rows})
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
