"""The cost per element of the fused CPU layer's activation pass against torch's activation
(issue #27: where the float32 exp-based activations trail). For a square layer of --width at
each batch: dpcuda's forward with the activation minus its forward without ("none": the same
GEMM), against torch's activation applied to the same pre-activation, each as ns per element,
on --threads threads; medians over rounds, dpcuda and torch round-robin. --in-features narrows
the layer's input (default: --width): the pass's size is batch x width whatever the input, and a
narrow input keeps the GEMM, identical on both sides, from drowning the pass in its noise (a
1024-wide layer's GEMM at batch 4096 takes 45 ms on 2 threads of the AVX-512 machines of
issue #27, the pass 1 ms). Both figures include a fresh output's allocation: past about 32 MB
(glibc's largest mmap threshold) each call's output is new pages, a page fault per 4 KB, which
then outweighs the arithmetic.

    python benchmarks/bench_activation_pass.py --json benchmarks/results/activation-pass-cpu.json

--routes measures what the CPU bfloat16 routing (csrc/torch/fused_linear.cpp) chooses between:
the bfloat16 layer's forward (GEMM and activation) with its activation by dpcuda's pass and by
ATen's kernel, in alternating order within each round, with and without bias; each row's figure
is the median over rounds of ATen's route's time over dpcuda's pass's (below 1: ATen's is the
faster), with its quartiles. Default activations silu and sigmoid, the closest calls; not gelu,
whose forward is ATen's on either route.

    python benchmarks/bench_activation_pass.py --routes --threads 2 --batches 4096,16384

--bias-routes measures the same for the float32 layer with a bias: its bias added by dpcuda's
pass after the GEMM (at::mm) against in the GEMM (at::addmm, torch's own call for F.linear);
each row's figure is the pass route's time over addmm's (above 1: addmm is the faster). Default
activations silu, gelu and relu.

    python benchmarks/bench_activation_pass.py --bias-routes --threads 2 --width 16,128,1024

--g-layouts measures the bfloat16 layer's backward (full_backward: dpcuda's activation pass
and the two GEMMs) over a transposed upstream gradient with g, the pass's result that the GEMMs
read, row-major against column-major (torch's layout there), with and without the bias's
gradient; each row's figure is the row-major time over the column-major one (above 1:
column-major is the faster). Default activations tanh and gelu.

    python benchmarks/bench_activation_pass.py --g-layouts --threads 2 --width 1024,2048,4096 \
        --batches 16,32,64,128,256
"""

import argparse
import itertools
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, paired_ratio, write_json  # noqa: E402

from dpcuda import _C  # noqa: E402  (registers torch.ops.dpcuda)

TORCH = {"relu": torch.relu, "gelu": F.gelu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
         "silu": F.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh}


def timed(fn, calls):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def measure(width, batch, activation, rounds, in_features=None):
    gen = torch.Generator().manual_seed(0)
    inputs = width if in_features is None else in_features
    x = torch.randn(batch, inputs, generator=gen)
    w = torch.randn(width, inputs, generator=gen) / inputs ** 0.5
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
    return {"width": width, "in_features": x.shape[1], "batch": batch, "activation": activation,
            "dpcuda_ns_per_element": 1e9 * (med["fused_act"] - med["fused_none"]) / n,
            "torch_ns_per_element": 1e9 * med["torch_act"] / n}


# What --routes, --bias-routes and --g-layouts switch: the dtype, the setter, and each route's
# name (the setter's 0 and 1) as the JSON names its time.
ROUTES = {
    "activation": (torch.bfloat16, "_set_bfloat16_forward_route", ("aten", "pass")),
    "bias": (torch.float32, "_set_float_bias_route", ("pass", "addmm")),
    "g": (torch.bfloat16, "_set_bfloat16_g_layout", ("rows", "columns")),
}


def measure_routes(width, batch, activation, bias, rounds, kind="activation"):
    dtype, setter_name, names = ROUTES[kind]
    setter = getattr(_C, setter_name)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, width, generator=gen).to(dtype)
    w = (torch.randn(width, width, generator=gen) / width ** 0.5).to(dtype)
    b = torch.randn(width, generator=gen).to(dtype) if bias else None

    if kind == "g":
        # the backward alone, over a transposed gradient, from what the forward saved
        out, pre = torch.ops.dpcuda.full_forward(x, w, b, activation)
        saved = pre if pre.numel() else out
        go = torch.randn(width, batch, generator=gen).to(dtype).t()
        mask = [True, True, bias]

        def layer():
            return torch.ops.dpcuda.full_backward(go, x, w, saved, activation, mask)
    else:
        def layer():
            return torch.ops.dpcuda.full_forward(x, w, b, activation)
    calls = max(3, min(2000, 1_000_000 // (batch * width)))
    samples = {0: [], 1: []}
    previous = setter(1)
    try:
        for route in (0, 1):
            setter(route)
            timed(layer, calls)
        for r in range(rounds):
            for route in ((0, 1) if r % 2 else (1, 0)):
                setter(route)
                samples[route].append(timed(layer, calls))
    finally:
        setter(previous)
    return {"width": width, "batch": batch, "activation": activation, "bias": bias,
            f"{names[1]}_us": 1e6 * statistics.median(samples[1]),
            f"{names[0]}_us": 1e6 * statistics.median(samples[0]),
            f"{names[0]}_over_{names[1]}": paired_ratio(samples[0], samples[1])}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", default="64", help="one or more, separated by commas")
    parser.add_argument("--in-features", type=int, default=None,
                        help="the layer's input width (default: --width; not with --routes, "
                             "--bias-routes or --g-layouts)")
    parser.add_argument("--batches", default="256,2048,8192")
    parser.add_argument("--activations", default=None,
                        help="(default: tanh,silu,gelu,sigmoid,relu; with --routes "
                             "silu,sigmoid; with --bias-routes silu,gelu,relu; with --g-layouts "
                             "tanh,gelu)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--routes", action="store_true",
                        help="bfloat16: the layer by dpcuda's pass against by ATen's kernel")
    parser.add_argument("--bias-routes", action="store_true",
                        help="float32 with a bias: the layer's bias added by dpcuda's pass after "
                             "mm against in the GEMM (addmm)")
    parser.add_argument("--g-layouts", action="store_true",
                        help="bfloat16 over a transposed gradient: the layer's backward with g "
                             "row-major against column-major")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.routes + args.bias_routes + args.g_layouts > 1:
        parser.error("--routes, --bias-routes and --g-layouts: one at a time")
    kind = ("activation" if args.routes else "bias" if args.bias_routes
            else "g" if args.g_layouts else None)
    # (gelu's bfloat16 forward is ATen's on either route: csrc/torch/fused_linear.cpp)
    known = tuple(a for a in TORCH if a != "gelu") if args.routes else tuple(TORCH)
    if args.activations is None:
        args.activations = {"activation": "silu,sigmoid", "bias": "silu,gelu,relu",
                            "g": "tanh,gelu"}.get(kind, "tanh,silu,gelu,sigmoid,relu")
    activations = args.activations.split(",")
    unknown = [a for a in activations if a not in known]
    if unknown:
        parser.error(f"--activations: unknown {', '.join(map(repr, unknown))} (known: "
                     f"{', '.join(known)})")
    lists = {}
    for name in ("width", "batches"):
        text = getattr(args, name)
        try:
            lists[name] = [int(v) for v in text.split(",")]
        except ValueError:
            parser.error(f"--{name} must be integers separated by commas, got {text!r}")
    widths, batches = lists["width"], lists["batches"]
    if min(widths) < 1 or args.threads < 1 or args.rounds < 1 or min(batches) < 1:
        parser.error("--width, --batches, --threads and --rounds must be at least 1")
    if args.in_features is not None and (args.in_features < 1 or kind):
        parser.error("--in-features must be at least 1, and not with --routes, --bias-routes "
                     "or --g-layouts")
    torch.set_num_threads(args.threads)
    rows = []
    for width, batch, activation in itertools.product(widths, batches, activations):
        if kind:
            first, second = ROUTES[kind][2]
            for bias in (True,) if kind == "bias" else (False, True):
                row = measure_routes(width, batch, activation, bias, args.rounds, kind)
                rows.append(row)
                band = row[f"{first}_over_{second}"]
                print(f"{width:5d} {batch:6d} {activation:10s} bias {int(bias)} "
                      f"{second} {row[f'{second}_us']:9.1f} us  {first} "
                      f"{row[f'{first}_us']:9.1f} us  {first}/{second} {band['median']:.3f} "
                      f"[{band['q1']:.3f}, {band['q3']:.3f}]", flush=True)
            continue
        row = measure(width, batch, activation, args.rounds, args.in_features)
        rows.append(row)
        print(f"{width:5d} {batch:6d} {activation:10s} dpcuda "
              f"{row['dpcuda_ns_per_element']:.3f} ns  torch "
              f"{row['torch_ns_per_element']:.3f} ns per element", flush=True)
    write_json(args.json, {"benchmark": {"activation": "activation_routes",
                                         "bias": "bias_routes",
                                         "g": "g_layouts"}.get(kind, "activation_pass"),
                           "threads": args.threads, "rounds": args.rounds,
                           "environment": environment("cpu"), "results": rows})


if __name__ == "__main__":
    main()
