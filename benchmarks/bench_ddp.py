"""dpcuda against torch DistributedDataParallel: N processes train the same MLP, on the same
data, from the same initial weights, three ways, alternated step by step (round-robin, the
order rotating every step) so that the machine's drift falls on all alike:

  ddp           torch.nn.parallel.DistributedDataParallel over nn.Linear/ReLU, torch.optim.SGD
  dpcuda        dpcuda.parallel.DataParallel(reducer="dist") over dpcuda.nn.FusedMLP
  dpcuda-plain  the same over nn.Linear/ReLU (the reduction and the fused update alone)

gloo on the CPU (one process per core, one torch thread each), NCCL
with one GPU per process where GPUs exist (there, torch.nn.DataParallel over all GPUs in one
process is timed too). A step is timed from a barrier to the end of the step (the optimizer
update included) on every rank; the step's time is the slowest rank's. Reports per-step
medians with quartiles, the paired ratio ddp/dpcuda (per step, adjacent runs) and the largest
parameter difference at the end between each dpcuda model and DDP's (judged against how far
DDP's weights moved from the start), and between ranks (must be 0). Exit status 1 on a
mismatch.

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
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, paired_ratio, write_json  # noqa: E402

import dpcuda  # noqa: E402
from dpcuda.nn import FusedMLP, SoftmaxCrossEntropyLoss  # noqa: E402
from dpcuda.parallel import DataParallel  # noqa: E402

# shape: (layer sizes, global batch, timed steps by default: more where a step is short)
SHAPES = {"784-256-10": ([784, 256, 10], 256, 300),
          "784-1024-1024-10": ([784, 1024, 1024, 10], 512, 60)}
CONTENDERS = ("ddp", "dpcuda", "dpcuda-plain")


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


def run_shape(rank, world, device, sizes, global_batch, steps, warmup, lr, momentum, seed):
    """One shape on this rank: returns the per-step times of each contender (this rank's) and
    the final parameters' differences."""
    torch.manual_seed(seed)
    reference = plain_mlp(sizes)  # the initial weights, the same on every rank
    init = [p.detach().clone() for p in reference.parameters()]

    ddp_model = plain_mlp(sizes).to(device)
    fused = FusedMLP(sizes).to(device)
    plain = plain_mlp(sizes).to(device)
    with torch.no_grad():
        for model in (ddp_model, fused, plain):
            for p, q in zip(model.parameters(), init):
                p.copy_(q)
    ddp = torch.nn.parallel.DistributedDataParallel(
        ddp_model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=momentum)
    dp_fused = DataParallel(fused, [device], reducer="dist", lr=lr, momentum=momentum)
    dp_plain = DataParallel(plain, [device], reducer="dist", lr=lr, momentum=momentum)
    fused_loss = SoftmaxCrossEntropyLoss()

    # The same global batches for every contender; this rank's rows of each.
    gen = torch.Generator().manual_seed(seed + 1)
    total = warmup + steps
    per = global_batch // world
    # Learnable labels (a fixed random linear teacher), not noise: training on random labels
    # is chaotic enough to blow rounding differences up to 1e-3 over hundreds of steps.
    xs = torch.randn(total, global_batch, sizes[0], generator=gen)
    teacher = torch.randn(sizes[0], sizes[-1], generator=gen)
    ys = (xs @ teacher).argmax(-1)
    xs = xs[:, rank * per:(rank + 1) * per].contiguous().to(device)
    ys = ys[:, rank * per:(rank + 1) * per].contiguous().to(device)

    def ddp_step(x, y):
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()

    steps_fn = {"ddp": ddp_step,
                "dpcuda": lambda x, y: dp_fused.step(x, y, fused_loss),
                "dpcuda-plain": lambda x, y: dp_plain.step(x, y, F.cross_entropy)}
    times = {name: [] for name in CONTENDERS}
    for i in range(total):
        order = CONTENDERS[i % 3:] + CONTENDERS[:i % 3]
        for name in order:
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            steps_fn[name](xs[i], ys[i])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                times[name].append((time.perf_counter() - t0) * 1e3)

    # The slowest rank's time of every step.
    stacked = torch.tensor([times[n] for n in CONTENDERS], dtype=torch.float64)
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
    times = {n: stacked[k].tolist() for k, n in enumerate(CONTENDERS)}

    ddp_params = list(ddp.module.parameters())
    # How far training moved the weights: the scale the differences are judged against.
    moved = _max_diff(ddp_params, init)
    diffs = {"ddp_moved": moved,
             "dpcuda_vs_ddp": _max_diff(dp_fused.module.parameters(), ddp_params),
             "dpcuda_plain_vs_ddp": _max_diff(dp_plain.module.parameters(), ddp_params)}
    # Every rank must hold the same dpcuda weights, bit for bit.
    spread = 0.0
    for model in (dp_fused.module, dp_plain.module):
        for p in model.parameters():
            lo, hi = p.detach().clone(), p.detach().clone()
            dist.all_reduce(lo, op=dist.ReduceOp.MIN)
            dist.all_reduce(hi, op=dist.ReduceOp.MAX)
            spread = max(spread, float((hi - lo).abs().max()))
    diffs["dpcuda_across_ranks"] = spread
    return times, diffs


def _worker(rank, world, port, args, queue):
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
                                   args.warmup,
                                   args.lr, args.momentum, args.seed)
        if rank == 0:
            queue.put(out)
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
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
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

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(args.procs, _free_port(), args, queue), nprocs=args.procs,
                       join=True, start_method="spawn")
    results = queue.get()

    device = "cuda" if args.backend == "nccl" else "cpu"
    env = environment(device)
    env["threads"] = 1 if device == "cpu" else env["threads"]
    print(f"dpcuda vs torch DDP: {args.procs} processes, {args.backend}, {env['device_name']}, "
          f"timed steps {', '.join(str(args.steps or SHAPES[s][2]) for s in args.shapes)} "
          f"(+{args.warmup} warm-up), SGD lr {args.lr} momentum "
          f"{args.momentum}; ms per step, median [q1, q3], the slowest rank")
    header = (f"{'shape':<18}{'batch':>6}{'ddp':>22}{'dpcuda':>22}{'dpcuda-plain':>22}"
              f"{'ddp/dpcuda':>18}{'max |dW|':>10}{'moved':>10}")
    print(header)
    rows = []
    for shape in args.shapes:
        times, diffs = results[shape]
        sizes, batch, steps = SHAPES[shape]
        row = {"steps": args.steps or steps, "shape": shape, "sizes": sizes, "global_batch": batch,
               **{n: _summary(times[n]) for n in CONTENDERS},
               "ratio_ddp_over_dpcuda": paired_ratio(times["ddp"], times["dpcuda"]),
               "ratio_ddp_over_dpcuda_plain": paired_ratio(times["ddp"], times["dpcuda-plain"]),
               "max_param_diff": diffs, "samples_ms": times}
        if device == "cuda":
            row["torch_dataparallel"] = time_torch_dataparallel(
                sizes, batch, args.steps or steps, args.warmup, args.lr, args.momentum, args.seed)
        rows.append(row)
        cell = lambda s: f"{s['median_ms']:.2f} [{s['q1_ms']:.2f}, {s['q3_ms']:.2f}]"  # noqa: E731
        r = row["ratio_ddp_over_dpcuda"]
        print(f"{shape:<18}{batch:>6}{cell(row['ddp']):>22}{cell(row['dpcuda']):>22}"
              f"{cell(row['dpcuda-plain']):>22}"
              f"{r['median']:>7.2f} [{r['q1']:.2f},{r['q3']:.2f}]"
              f"{max(diffs['dpcuda_vs_ddp'], diffs['dpcuda_plain_vs_ddp']):>10.1e}"
              f"{diffs['ddp_moved']:>10.2f}")
        if "torch_dataparallel" in row:
            print(f"{'':<18}torch.nn.DataParallel (1 process): "
                  f"{cell(row['torch_dataparallel'])} ms")
    # The same model: every rank's dpcuda weights bit-identical, and dpcuda's weights within 1%
    # of the distance DDP's moved from the start (rounding differences, amplified by training).
    bad = [(row["shape"], k, v) for row in rows for k, v in row["max_param_diff"].items()
           if k != "ddp_moved" and (not math.isfinite(v) or v > (
               0.0 if k == "dpcuda_across_ranks" else 1e-2 * row["max_param_diff"]["ddp_moved"]))]
    for shape, k, v in bad:
        print(f"MISMATCH {shape}: {k} = {v:.3g}")
    write_json(args.json, {"command": "benchmarks/bench_ddp.py", "procs": args.procs,
                           "backend": args.backend, "warmup": args.warmup,
                           "lr": args.lr, "momentum": args.momentum, "environment": env,
                           "results": rows})
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
