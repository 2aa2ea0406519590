"""The whole training step (an MLP, softmax cross-entropy, SGD or AdamW), timed as training runs
it: N steps issued back to back, then one synchronisation (ms per step = the N steps' time / N).
A synchronisation after every step would hide what a step that does not wait for the device
saves, so that per-step latency is reported beside it (the `latency_ms` column), not instead.
The `host` column (`host_ms_per_step`) is the host's time to issue the N steps, before the
synchronisation, per step. For a step that never waits for the device itself (torch eager and
compiled, torch's graph, dpcuda graphed), near ms/step means the step is the host's and the
device waits for it. dpcuda blocking reads its loss at every step and dpcuda nonblocking waits
once it runs `lag` steps ahead, so their column is near ms/step whatever bounds them.

Contenders, measured round-robin in the same run (benchmarks/common.py):
  torch eager         nn.Sequential + torch.optim (foreach=True), one device, the global batch
  torch eager fused   the same with torch.optim's fused=True update (AdamW)
  torch.compile       the model and the optimizer's step compiled (mode "default")
  torch.compile r-o   mode="reduce-overhead" (CUDA graphs; CUDA only)
  torch cuda graph    the whole step captured as one CUDA graph, torch's "whole network
                      capture" with a capturable optimizer (CUDA only)
  dpcuda blocking     DataParallel(FusedMLP, R replicas).step(x, y, loss, optimizer=dpcuda.optim)
  dpcuda nonblocking  the same with blocking=False (no host read of a device value)
  dpcuda graphed      the same with graphs=True (captured once, replayed; CUDA only)
Ratios are torch eager's time over each contender's (> 1: faster than torch eager).

    python benchmarks/bench_step.py --device cpu --json benchmarks/results/step-sync-cpu.json
"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import compare_samples, environment, write_json  # noqa: E402

import dpcuda  # noqa: E402
import dpcuda.optim  # noqa: E402
from dpcuda.nn import FusedMLP, SoftmaxCrossEntropyLoss  # noqa: E402
from dpcuda.parallel import DataParallel  # noqa: E402

CONTENDERS = ("torch eager", "torch eager fused", "torch.compile", "torch.compile r-o",
              "torch cuda graph", "dpcuda blocking", "dpcuda nonblocking", "dpcuda graphed")
CUDA_ONLY = ("torch.compile r-o", "torch cuda graph", "dpcuda graphed")


def plain_mlp(dims):
    layers = []
    for i, (a, b) in enumerate(zip(dims, dims[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(dims) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def torch_optimizer(name, params, lr, **kw):
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, **kw)
    return torch.optim.AdamW(params, lr=lr, **kw)


def dpcuda_optimizer(name, params, lr):
    if name == "sgd":
        return dpcuda.optim.SGD(params, lr=lr, momentum=0.9)
    return dpcuda.optim.AdamW(params, lr=lr)


def torch_eager(dims, opt_name, lr, x, y, device, **opt_kw):
    torch.manual_seed(0)
    model = plain_mlp(dims).to(device)
    opt = torch_optimizer(opt_name, model.parameters(), lr, **opt_kw)

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def torch_compiled(dims, opt_name, lr, x, y, device, mode):
    torch.manual_seed(0)
    model = plain_mlp(dims).to(device)
    opt = torch_optimizer(opt_name, model.parameters(), lr, foreach=True)
    compiled = torch.compile(model, mode=mode)
    # reduce-overhead graphs the model; the optimizer's step is compiled in the default mode
    # after one eager step has made its state: graphed, the state it makes on its first call
    # would be a graph output that the next replay overwrites.
    if mode == "reduce-overhead":
        F.cross_entropy(model(x), y).backward()
        opt.step()

    @torch.compile(mode="default" if mode == "reduce-overhead" else mode)
    def opt_step():
        opt.step()

    def step():
        if mode == "reduce-overhead":  # a new step: the last one's graph outputs are dead
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(compiled(x), y).backward()
        opt_step()
    return step


def torch_cuda_graph(dims, opt_name, lr, x, y, device):
    """torch's whole-network capture (the CUDA graphs notes): warm-up on a side stream, the
    step captured once with static inputs and a capturable optimizer, then copy and replay."""
    torch.manual_seed(0)
    model = plain_mlp(dims).to(device)
    kw = {"capturable": True} if opt_name == "adamw" else {}
    opt = torch_optimizer(opt_name, model.parameters(), lr, foreach=True, **kw)
    static_x, static_y = x.clone(), y.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(static_x), static_y).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        F.cross_entropy(model(static_x), static_y).backward()
        opt.step()

    def step():
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
    # The replays write the parameters and the optimizer's state in place: they must live as
    # long as the graph (freed, their memory would be handed to whatever is allocated next).
    step.keep = (model, opt)
    return step


def dpcuda_step(dims, opt_name, lr, x, y, device, replicas, blocking, graphs=False):
    torch.manual_seed(0)
    model = FusedMLP(dims)
    dp = DataParallel(model, [device] * replicas, blocking=blocking, graphs=graphs)
    opt = dpcuda_optimizer(opt_name, dp.parameters(), lr)
    loss_fn = SoftmaxCrossEntropyLoss()

    def step():
        dp.step(x, y, loss_fn, optimizer=opt)
    step.finish = dp.synchronize if not blocking else None
    return step


def make(name, dims, opt_name, x, y, device, replicas):
    lr = 0.05 if opt_name == "sgd" else 1e-3
    if name == "torch eager":
        return torch_eager(dims, opt_name, lr, x, y, device, foreach=True)
    if name == "torch eager fused":
        return torch_eager(dims, opt_name, lr, x, y, device, fused=True)
    if name == "torch.compile":
        return torch_compiled(dims, opt_name, lr, x, y, device, "default")
    if name == "torch.compile r-o":
        return torch_compiled(dims, opt_name, lr, x, y, device, "reduce-overhead")
    if name == "torch cuda graph":
        return torch_cuda_graph(dims, opt_name, lr, x, y, device)
    return dpcuda_step(dims, opt_name, lr, x, y, device, replicas,
                       blocking=name == "dpcuda blocking", graphs=name == "dpcuda graphed")


def parse_shapes(text):
    """'784-256-10:256,64-256-256-10:256' -> [([784, 256, 10], 256), ...]"""
    out = []
    for item in text.split(","):
        dims, _, batch = item.partition(":")
        out.append(([int(d) for d in dims.split("-")], int(batch)))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if dpcuda.cuda_available() else "cpu")
    parser.add_argument("--shapes", default="784-256-10:256,784-256-10:4096,64-256-256-10:256",
                        help="MLP widths and batch, comma-separated (default: %(default)s)")
    parser.add_argument("--replicas", default="1,2,4",
                        help="dpcuda's replica counts (default: %(default)s)")
    parser.add_argument("--optimizers", default="sgd,adamw", help="(default: %(default)s)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help="which to run (default: all; the CUDA-only ones are left out on "
                             "the CPU)")
    parser.add_argument("--steps-per-sync", type=int, default=20,
                        help="steps issued between synchronisations (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed rounds (default: 10 on a GPU, 7 on the CPU)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = args.device
    cuda = torch.device(device).type == "cuda"
    repeats = args.repeats or (10 if cuda else 7)
    per = args.steps_per_sync
    if per < 1:
        parser.error("--steps-per-sync must be at least 1")
    wanted = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in wanted if c not in CONTENDERS]
    if unknown:
        parser.error(f"unknown contenders {unknown}; choose from {list(CONTENDERS)}")
    if not cuda:
        wanted = [c for c in wanted if c not in CUDA_ONLY]
    rows = []
    failed = {}  # "contender shape batch optimizer replicas": the error that dropped it

    def tried(name, dims, opt_name, x, y, device, R):
        """The contender's step function after one trial step, or None (its error kept in
        the JSON's "failed"): one contender that fails does not end the others' run."""
        try:
            fn = make(name, dims, opt_name, x, y, device, R)
            fn()
            if getattr(fn, "finish", None) is not None:
                fn.finish()
            return fn
        except Exception as err:  # (whatever the contender raised, reported, not hidden)
            where = f"{name} {'-'.join(map(str, dims))} {x.shape[0]} {opt_name} {R}"
            failed[where] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            print(f"FAILED {where}: {failed[where]}", flush=True)
            return None

    def save(rows):
        write_json(args.json, {"benchmark": "step", "steps_per_sync": per,
                               "repeats": repeats, "environment": environment(device),
                               "results": rows, "failed": failed,
                               "not_run": [c for c in CONTENDERS if c not in wanted]})
    print(f"{'shape':>16}{'batch':>6}{'opt':>6}{'R':>3}{'method':>20}{'ms/step':>10}"
          f"{'latency':>10}{'host':>10}{'eager/this':>11}")
    for dims, batch in parse_shapes(args.shapes):
        torch.manual_seed(0)
        x = torch.randn(batch, dims[0], device=device)
        y = torch.randint(0, dims[-1], (batch,), device=device)
        for opt_name in args.optimizers.split(","):
            single = {}  # the one-device torch contenders, timed once per shape
            for R in [int(r) for r in args.replicas.split(",")]:
                fns = {}
                for name in wanted:
                    if name.startswith("torch") and (name == "torch eager" or R == 1):
                        if name == "torch eager fused" and opt_name != "adamw":
                            continue
                        if name not in single:  # (one try per shape: it has no replicas)
                            single[name] = tried(name, dims, opt_name, x, y, device, 1)
                        fn = single[name]
                    elif name.startswith("dpcuda"):
                        fn = tried(name, dims, opt_name, x, y, device, R)
                    else:
                        continue
                    if fn is not None:
                        fns[name] = fn

                # The host's time to issue a burst, before its synchronisation, per step: near
                # ms/step, the step is the host's (the GPU waits for it); well below, the
                # device's.
                issued = {n: [] for n in fns}

                def burst(name, fn):
                    def run():
                        start = time.perf_counter()
                        for _ in range(per):
                            fn()
                        issued[name].append((time.perf_counter() - start) * 1e3 / per)
                        if getattr(fn, "finish", None) is not None:
                            fn.finish()  # (a non-blocking step's records read: its sync)
                    return run
                try:
                    bursts = compare_samples({n: burst(n, f) for n, f in fns.items()}, device,
                                             warmup=1, repeats=repeats)
                    single_steps = compare_samples(fns, device, warmup=1, repeats=repeats)
                except Exception as err:  # (a contender failing after its trial step)
                    where = f"{'-'.join(map(str, dims))} {batch} {opt_name} {R}"
                    failed[f"timing {where}"] = \
                        f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
                    print(f"FAILED timing {where}: {failed[f'timing {where}']}", flush=True)
                    continue
                med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
                base = med(bursts["torch eager"]) / per if "torch eager" in bursts else None
                for name in fns:
                    ms = med(bursts[name]) / per
                    latency = med(single_steps[name])
                    ratio = base / ms if base else None
                    host = med(issued[name][1:])  # (the first: compare_samples' warm-up)
                    rows.append({"shape": "-".join(map(str, dims)), "batch": batch,
                                 "optimizer": opt_name, "replicas": R, "method": name,
                                 "ms_per_step": ms, "latency_ms": latency,
                                 "host_ms_per_step": host, "eager_over_this": ratio})
                    print(f"{'-'.join(map(str, dims)):>16}{batch:>6}{opt_name:>6}{R:>3}"
                          f"{name:>20}{ms:>10.3f}{latency:>10.3f}{host:>10.3f}"
                          f"{ratio if ratio else float('nan'):>11.2f}", flush=True)
                # written after every row group, so a run stopped at its time limit keeps them
                save(rows)
    save(rows)


if __name__ == "__main__":
    main()
