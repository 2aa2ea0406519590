"""Where a sweep cell's time goes (issue #27): torch's profiler over the fused layer and torch
eager, forward and backward, as bench_sweep.py runs them, for the cells the sweep shows below 1.
For each side: the operators the step runs, their calls and self time per step (the fused op's
own time is its passes; the GEMMs inside it are ATen's mm/addmm, listed apart), and the share
of the step the GEMMs take. What the two sides share (the same MKL GEMMs) is what dpcuda
cannot win; the rest is what the fusion changes.

    python benchmarks/profile_cells.py --json benchmarks/results/profile-cells-cpu.json

A cell is WIDTHxBATCH:activation:bias(on/off):layout[:dtype] (float32 unless given), as in the
sweep's JSON.
"""

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sweep import parse_cell, upstream  # noqa: E402
from common import environment, write_json  # noqa: E402

import torch.nn.functional as F  # noqa: E402
from dpcuda import ops  # noqa: E402
from dpcuda.reference import activation as torch_activation  # noqa: E402

GEMMS = ("aten::mm", "aten::addmm")

# The worst cells of sweep-f32-cpu-2026-11-27e.json, two or three of each kind: no activation;
# a layer of 1024 or more (the GEMMs are nearly all of it); an activation that keeps its
# pre-activation, without bias (the same passes as torch's).
DEFAULT_CELLS = (
    "256x8192:none:on:transposed", "64x4096:none:off:expanded", "16x8192:none:off:dense",
    "4096x256:sigmoid:on:transposed", "1024x4096:gelu:off:dense",
    "64x8192:silu:off:dense", "128x8192:gelu:off:dense",
)


def profile_side(step, steps):
    for _ in range(5):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    ops_ = []
    for event in prof.key_averages():
        if event.self_cpu_time_total <= 0:
            continue
        ops_.append({"op": event.key, "calls_per_step": event.count / steps,
                     "self_us_per_step": event.self_cpu_time_total / steps})
    ops_.sort(key=lambda o: -o["self_us_per_step"])
    total = sum(o["self_us_per_step"] for o in ops_)
    gemm = sum(o["self_us_per_step"] for o in ops_ if o["op"] in GEMMS)
    return {"total_us_per_step": total, "gemm_us_per_step": gemm,
            "gemm_share": gemm / total if total else 0.0, "ops": ops_}


def profile_cell(width, batch, act, bias, layout, dtype, steps):
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    x = torch.randn(batch, width, dtype=dt, requires_grad=True)
    w = (torch.randn(width, width, dtype=dt) * width ** -0.5).requires_grad_()
    b = torch.randn(width, dtype=dt, requires_grad=True) if bias else None
    go = upstream(layout, batch, width, dt)
    leaves = [t for t in (x, w, b) if t is not None]

    def run(fn):
        def step():
            for t in leaves:
                t.grad = None
            fn().backward(go)
        return step
    fused = run(lambda: ops.full_forward(x, w, b, act))
    eager = run(lambda: torch_activation(F.linear(x, w, b), act))
    return {"width": width, "batch": batch, "activation": act, "bias": bias, "layout": layout,
            "dtype": dtype, "fused": profile_side(fused, steps),
            "eager": profile_side(eager, steps)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cells", nargs="*", type=parse_cell,
                        help="(default: the losing cells named in the script)")
    parser.add_argument("--steps", type=int, default=20, help="(default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's intra-op threads (default: torch's own)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cells = args.cells or [parse_cell(c) for c in DEFAULT_CELLS]
    rows = []
    for width, batch, act, bias, layout, dtype in cells:
        row = profile_cell(width, batch, act, bias, layout, dtype, args.steps)
        rows.append(row)
        f, e = row["fused"], row["eager"]
        print(f"{width}x{width} batch {batch} {act} bias {'on' if bias else 'off'} {layout} "
              f"{dtype}: "
              f"fused {f['total_us_per_step']:.0f} us (GEMMs {100 * f['gemm_share']:.0f}%), "
              f"eager {e['total_us_per_step']:.0f} us (GEMMs {100 * e['gemm_share']:.0f}%)")
        for side in ("fused", "eager"):
            top = ", ".join(f"{o['op']} {o['self_us_per_step']:.0f}"
                            for o in row[side]["ops"][:5])
            print(f"    {side}: {top}")
    write_json(args.json, {"benchmark": "profile_cells", "steps": args.steps,
                           "threads": torch.get_num_threads(),
                           "environment": environment("cpu"), "results": rows})


if __name__ == "__main__":
    main()
