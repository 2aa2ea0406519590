"""The host's cost of a training step, measured on the CPU (issue #25). On a GPU a small
step's time is the host's: on the H100 (2026-11-27) torch eager's 784-256-10 SGD step at
batch 256 took about 1.1 ms for an estimated 0.05 ms of GPU work, and dpcuda's graphed step
0.47 ms. The host's part is the same Python on any device, so it is measured here where it can
be, on a model so small that its arithmetic is a few microseconds:

  torch eager          zero_grad, forward, F.cross_entropy, backward, optimizer.step()
  dpcuda blocking      DataParallel.step (its loss read each step)
  dpcuda nonblocking   DataParallel(blocking=False).step
  dpcuda graphed host  DataParallel(graphs=True).step with the CPU stand-in of the graph and
                       its replay emptied: everything a replayed step does on the host but the
                       device work (a GPU runs it from the graph)

One thread, one replica, microseconds per step, medians over rounds run round-robin.

    python benchmarks/bench_host.py --json benchmarks/results/host-cpu.json
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, write_json  # noqa: E402

import dpcuda.optim  # noqa: E402
from dpcuda.nn import FusedMLP, SoftmaxCrossEntropyLoss  # noqa: E402
from dpcuda.parallel import DataParallel  # noqa: E402
from dpcuda.parallel import graphed  # noqa: E402


def torch_eager(dims, opt_name, x, y):
    torch.manual_seed(0)
    layers = []
    for i in range(len(dims) - 1):
        layers += [torch.nn.Linear(dims[i], dims[i + 1]), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    cls = torch.optim.SGD if opt_name == "sgd" else torch.optim.AdamW
    opt = cls(model.parameters(), lr=1e-3, foreach=True)

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step


class _HostOnly(graphed._ClosureGraph):
    """The stand-in graph with its replay emptied: the host's part of a replayed step."""

    def replay(self):
        if getattr(self, "timed", False):
            return
        super().replay()


def dpcuda_step(dims, opt_name, x, y, mode):
    torch.manual_seed(0)
    model = FusedMLP(dims)
    kw = {"graphs": True} if mode == "graphed" else {"blocking": mode == "blocking"}
    dp = DataParallel(model, ["cpu"], **kw)
    if mode == "graphed":
        dp._graphed.backend = _HostOnly
    cls = dpcuda.optim.SGD if opt_name == "sgd" else dpcuda.optim.AdamW
    opt = cls(model.parameters(), lr=1e-3)
    loss_fn = SoftmaxCrossEntropyLoss()
    for _ in range(graphed.WARMUP + 3):  # (captured by now)
        dp.step(x, y, loss_fn, optimizer=opt)
    dp.synchronize()
    if mode == "graphed":
        assert dp._graphed.graphs, "the step was not captured"
        for g in dp._graphed.graphs.values():
            g.graph.timed = True

    def step():
        dp.step(x, y, loss_fn, optimizer=opt)
    step.finish = dp.synchronize
    return step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="16-8-4:8",
                        help="layer widths:batch, small so that the host's part dominates "
                             "(default: %(default)s)")
    parser.add_argument("--optimizers", default="sgd,adamw", help="(default: %(default)s)")
    parser.add_argument("--steps", type=int, default=200, help="steps per round "
                        "(default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=15, help="(default: %(default)s)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.rounds < 2 or args.steps < 1:
        parser.error("--rounds must be at least 2 (the quartiles) and --steps at least 1")
    torch.set_num_threads(1)
    # The CPU stand-in of the graph, and the labels counted by step_status as on a GPU (where
    # the non-blocking and graphed steps never count them on the host).
    DataParallel._graph_backend = "closure"
    DataParallel._count_on_device = True
    dims_text, _, batch = args.shape.partition(":")
    dims = [int(d) for d in dims_text.split("-")]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(int(batch), dims[0], generator=gen)
    y = torch.randint(0, dims[-1], (int(batch),), generator=gen)
    rows = []
    print(f"{'optimizer':>10}{'method':>22}{'us/step':>10}{'torch/this':>12}")
    for opt_name in args.optimizers.split(","):
        fns = {"torch eager": torch_eager(dims, opt_name, x, y)}
        for mode in ("blocking", "nonblocking", "graphed"):
            fns[f"dpcuda {mode}" + (" host" if mode == "graphed" else "")] = \
                dpcuda_step(dims, opt_name, x, y, mode)
        samples = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                start = time.perf_counter()
                for _ in range(args.steps):
                    fn()
                if getattr(fn, "finish", None) is not None:
                    fn.finish()
                samples[name].append((time.perf_counter() - start) / args.steps * 1e6)
        base = statistics.median(samples["torch eager"])
        for name, values in samples.items():
            us = statistics.median(values)
            q = statistics.quantiles(values, n=4)
            rows.append({"optimizer": opt_name, "method": name, "us_per_step": us,
                         "quartiles_us": [q[0], q[2]], "torch_over_this": base / us})
            print(f"{opt_name:>10}{name:>22}{us:>10.1f}{base / us:>12.2f}", flush=True)
    write_json(args.json, {"benchmark": "host", "shape": args.shape, "steps": args.steps,
                           "rounds": args.rounds, "environment": environment("cpu"),
                           "results": rows})


if __name__ == "__main__":
    main()
