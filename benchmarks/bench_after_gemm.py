"""The host's part of a GEMM-bound layer step (issue #27: the "none" layers, where dpcuda and
torch make the same matrix products and dpcuda still trailed by 0.5-3%).

Two measurements, 2 threads by default, microseconds, medians over rounds:

1. Probes: small host calls timed warm (right after a tiny GEMM) and right after a large one
   (--batch x --width by --width x --width, float32), which leaves the caches holding its
   operands: torch.empty(0), a transpose view, F.linear of 2 rows, dpcuda's full_forward of 2
   rows ("none"), and dpcuda's full_backward asked for nothing (its checks and its three empty
   results).

2. --cells WIDTHxBATCH:activation:on|off:layout[:dtype] (bench_sweep.py's cells): the fused
   and the eager step, alternating in a shuffled order under torch's profiler, each step cut
   into its GEMMs (aten::mm, aten::addmm) and the rest (all else, the Python between the ops
   included), so that a difference in the step shows where it lies. The profiler's own cost per
   recorded op falls in the rest, the more for the side with more ops (torch's).

    python benchmarks/bench_after_gemm.py --cells 128x8192:none:off:dense --json \\
        benchmarks/results/after-gemm-cpu.json
"""

import argparse
import bisect
import os
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, write_json  # noqa: E402
from bench_sweep import parse_cell  # noqa: E402
from profile_cells import cell_steps  # noqa: E402

from dpcuda import ops  # noqa: E402

GEMMS = ("aten::mm", "aten::addmm")


def probes(width, batch, rounds):
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(batch, width, generator=gen)
    w = torch.randn(width, width, generator=gen) / width ** 0.5
    tiny = torch.randn(2, width, generator=gen)
    empty = torch.empty(0)
    calls = {
        "torch.empty(0)": lambda: torch.empty(0),
        "weight.t()": lambda: w.t(),
        "F.linear, 2 rows": lambda: F.linear(tiny, w),
        "dpcuda full_forward, 2 rows": lambda: ops.full_forward(tiny, w, None, "none"),
        "dpcuda full_backward, nothing asked": lambda: torch.ops.dpcuda.full_backward(
            big, big, w, empty, "none", [False, False, False]),
    }
    rows = []
    for name, call in calls.items():
        for _ in range(3):
            call()
        after = {"warm": [], "after_gemm": []}
        for _ in range(rounds):
            for where, gemm in (("warm", lambda: torch.mm(tiny, w)),
                                ("after_gemm", lambda: torch.mm(big, w))):
                gemm()
                start = time.perf_counter()
                call()
                after[where].append(1e6 * (time.perf_counter() - start))
        rows.append({"call": name, "warm_us": statistics.median(after["warm"]),
                     "after_gemm_us": statistics.median(after["after_gemm"])})
    return rows


def step_parts(spec, steps):
    width, batch, act, bias, layout, dtype = spec
    fused, eager = cell_steps(width, batch, act, bias, layout, dtype)
    fns = {"fused": fused, "eager": eager}
    for fn in fns.values():
        for _ in range(3):
            fn()
    order, rng = list(fns), random.Random(0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            rng.shuffle(order)
            for name in order:
                with torch.profiler.record_function("step:" + name):
                    fns[name]()
    events = prof.events()
    # (the GEMMs this thread ran, each once: one inside another is not counted again)
    thread = next(e.thread for e in events if e.name.startswith("step:"))
    gemms = []
    for e in sorted((e for e in events if e.name in GEMMS and e.thread == thread),
                    key=lambda e: e.time_range.start):
        if not gemms or e.time_range.start >= gemms[-1].time_range.end:
            gemms.append(e)
    starts = [e.time_range.start for e in gemms]
    parts = {name: {"step": [], "gemms": [], "rest": []} for name in fns}
    for e in events:
        if not e.name.startswith("step:"):
            continue
        t0, t1 = e.time_range.start, e.time_range.end
        i, gemm_us = bisect.bisect_left(starts, t0), 0.0
        while i < len(gemms) and gemms[i].time_range.start < t1:
            gemm_us += gemms[i].time_range.elapsed_us()
            i += 1
        p = parts[e.name[len("step:"):]]
        p["step"].append(t1 - t0)
        p["gemms"].append(gemm_us)
        p["rest"].append(t1 - t0 - gemm_us)
    return {"width": width, "batch": batch, "activation": act, "bias": bias, "layout": layout,
            "dtype": dtype, "steps": steps,
            **{f"{name}_us": {k: statistics.median(v) for k, v in p.items()}
               for name, p in parts.items()}}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=128, help="the probes' GEMM")
    parser.add_argument("--batch", type=int, default=16384, help="the probes' GEMM")
    parser.add_argument("--rounds", type=int, default=100, help="the probes' rounds")
    parser.add_argument("--cells", nargs="*", type=parse_cell, default=[], metavar="CELL")
    parser.add_argument("--steps", type=int, default=100, help="steps a side per cell")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if min(args.width, args.batch, args.rounds, args.steps, args.threads) < 1:
        parser.error("--width, --batch, --rounds, --steps and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    rows = probes(args.width, args.batch, args.rounds)
    print(f"after a {args.batch}x{args.width} @ {args.width}x{args.width} GEMM (us, warm -> "
          f"after it):")
    for r in rows:
        print(f"  {r['call']:38s} {r['warm_us']:7.1f} -> {r['after_gemm_us']:7.1f}")
    cells = []
    for spec in args.cells:
        c = step_parts(spec, args.steps)
        cells.append(c)
        f, e = c["fused_us"], c["eager_us"]
        print(f"{c['width']}x{c['batch']} {c['activation']} bias {'on' if c['bias'] else 'off'} "
              f"{c['layout']} {c['dtype']}: step {f['step']:.0f} / {e['step']:.0f} us (fused / "
              f"eager), GEMMs {f['gemms']:.0f} / {e['gemms']:.0f}, rest {f['rest']:.0f} / "
              f"{e['rest']:.0f}", flush=True)
    write_json(args.json, {"benchmark": "after_gemm", "threads": args.threads,
                           "probe_gemm": [args.batch, args.width], "probes": rows,
                           "cells": cells, "environment": environment("cpu")})


if __name__ == "__main__":
    main()
