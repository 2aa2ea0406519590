"""The cost per element of the fused CPU layer's activation pass against torch's activation
(issue #27: where the float32 exp-based activations trail). For a square layer of --width at
each batch: dpcuda's forward with the activation minus its forward without ("none": the same
GEMM), against torch's activation applied to the same pre-activation, each as ns per element,
on --threads threads; medians over rounds, dpcuda and torch round-robin.

    python benchmarks/bench_activation_pass.py --json benchmarks/results/activation-pass-cpu.json
"""

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

import dpcuda  # noqa: F401  (registers torch.ops.dpcuda)

TORCH = {"relu": torch.relu, "gelu": F.gelu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
         "silu": F.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh}


def timed(fn, calls):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def measure(width, batch, activation, rounds):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, width, generator=gen)
    w = torch.randn(width, width, generator=gen) / width ** 0.5
    z = x @ w.t()
    op = torch.ops.dpcuda.full_forward
    calls = max(5, 2_000_000 // (batch * width))
    fns = {"fused_act": lambda: op(x, w, None, activation),
           "fused_none": lambda: op(x, w, None, "none"),
           "torch_act": lambda: TORCH[activation](z)}
    for fn in fns.values():
        timed(fn, max(2, calls // 5))
    samples = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            samples[k].append(timed(fn, calls))
    med = {k: statistics.median(v) for k, v in samples.items()}
    n = batch * width
    return {"width": width, "batch": batch, "activation": activation,
            "dpcuda_ns_per_element": 1e9 * (med["fused_act"] - med["fused_none"]) / n,
            "torch_ns_per_element": 1e9 * med["torch_act"] / n}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batches", default="256,2048,8192")
    parser.add_argument("--activations", default="tanh,silu,gelu,sigmoid,relu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for activation in args.activations.split(","):
            row = measure(args.width, batch, activation, args.rounds)
            rows.append(row)
            print(f"{args.width:5d} {batch:6d} {activation:10s} dpcuda "
                  f"{row['dpcuda_ns_per_element']:.3f} ns  torch "
                  f"{row['torch_ns_per_element']:.3f} ns per element", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "activation_pass", "threads": args.threads,
                       "rounds": args.rounds,
                       "environment": {"torch": torch.__version__,
                                       "cpu": torch.backends.cpu.get_cpu_capability(),
                                       "machine": platform.machine(),
                                       "date": time.strftime("%Y-%m-%d")},
                       "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
