"""Where a sweep cell's time goes (issue #27): torch's profiler over the fused layer and torch
eager, forward and backward, as bench_sweep.py runs them, for the cells the sweep shows below 1.
For each side: the operators the step runs, their calls and self time per step (the fused op's
own time is its passes; the GEMMs inside it are ATen's mm/addmm, listed apart), and the share
of the step the GEMMs take. What the two sides share (the same MKL GEMMs) is what dpcuda
cannot win; the rest is what the fusion changes.

    python benchmarks/profile_cells.py --json benchmarks/results/profile-cells-cpu.json

A cell is WIDTHxBATCH:activation:bias(on/off):layout[:dtype] (float32 unless given), as in the
sweep's JSON.

--interleaved TURNS profiles the cells given with both sides in one profile: TURNS turns, each
--steps steps of the fused side, then as many of torch's; per side the medians over its steps
(each operator's self time, the GEMMs', the rest's, the step's). A profile per side, as below,
is taken over a block of its own steps, so that the machine's drift from one block to the next
shows as a difference between the sides (on the 2-core VM torch's own sigmoid_backward took
103-612 us a call in three blocks of one cell).

--from SWEEP.json takes every cell of a sweep whose median eager/fused is below --below, times
it again alone (bench_sweep's timing, --alone-repeats rounds; --alone-consecutive-ms as the
sweep's --consecutive-ms) and profiles both sides --rounds times, alternating (each profile
about 0.2 s of steps, at least 2, at most --steps; one more short profile per side records the
GEMMs' operand shapes, apart, as recording shapes costs time); each cell then gets a verdict
from its figure alone and the profiles' medians (dpcuda's own part of a step: everything but
the GEMMs, its passes, its autograd node, copies, and torch's likewise: its activation
kernels, the bias sum, its nodes):
- "ahead alone": its median alone is at least --below, and so is its first quartile;
- "level alone": its median alone is at least --below, its first quartile not (the grid's
  figure was the machine's; the band reaches below);
- "own work": dpcuda's own part is the larger by more than its noise (the difference of the
  two sides' medians over the rounds exceeds the larger of the two sides' own spreads, max
  minus min, over at least 3 rounds; with --from, --rounds must be at least 3): a loss of
  dpcuda's, to fix or to explain, whatever the GEMMs did (their time moves by up to 3x
  between profiles here and could hide it);
- "no loss in the profile": behind alone, but the profiles show dpcuda's step no slower than
  torch's (own part and GEMMs together): the difference is not in them (noise, or what the
  profiler does not see);
- "other products": the difference is not in the own part beyond its noise, and dpcuda's
  matrix products are not torch's (other counts or operand shapes): dpcuda's choice, to fix
  or to explain;
- "GEMMs": the profiles' difference is mostly in the GEMMs (their difference at least the own
  parts'), and both sides make the same matrix products (as many, on the same operand shapes,
  through ATen's mm or addmm: their operands' layouts are not compared): where their time
  differs, it is the GEMMs' own time, not dpcuda's passes: the machine's noise (page faults
  first) or the calls' form, which the fusion can change (a float32 layer with a bias and an
  activation under 64K output elements: dpcuda's forward makes an mm where torch's makes an
  addmm with the bias; that add counts in torch's GEMMs and in dpcuda's own part; issue #27's
  A/Bs of the two forms);
- "within the noise": none of these: the own parts' difference is the larger but within its
  noise.
Every verdict also says whether dpcuda's own part is the larger beyond its noise
(own_beyond_noise), ahead or level alone too: a loss of its own the GEMMs' time made up for.
Each profile also counts the process's minor page faults per step (getrusage, all threads): a
fresh allocation's first touch costs a fault a page (about 1 us here), which lands in whichever
operator writes it first, most often a GEMM writing a new gradient; whether the allocator hands
back fresh pages (a 64 MB weight gradient: 16384 faults, or none) depends on the addresses and
the history of the process's allocations, and differs between profiles of one side. The
verdict records both sides' counts.
The profiler's per-operator cost (a few us a call) weighs on the side with more operators at
the smallest shapes; each row states both sides' figures.

    python benchmarks/profile_cells.py --from benchmarks/results/sweep-cpu.json \\
        --json benchmarks/results/explain-cpu.json

With --from the JSON is written after each cell ("complete": false until the last), so a run
cut short keeps the cells it measured; --resume EXPLAIN.json takes them and explains the rest
(the same sweep; the other options as the first run's).
"""

import argparse
import json
import math
import os
import resource
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sweep import cell as time_cell  # noqa: E402
from bench_sweep import parse_cell, upstream  # noqa: E402
from common import environment, paired_ratio, write_json  # noqa: E402

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


def profile_side(step, steps, warmup=5, shapes=True):
    """Self time per operator per step over `steps` steps; shapes: also the GEMMs' products by
    their operands' shapes (recording shapes costs time: off for the timed profiles)."""
    for _ in range(warmup):
        step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=shapes) as prof:
        # (the steps' faults alone, not the profiler's start and stop)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(steps):
            step()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    ops_ = []
    for event in prof.key_averages():
        if event.self_cpu_time_total <= 0:
            continue
        ops_.append({"op": event.key, "calls_per_step": event.count / steps,
                     "self_us_per_step": event.self_cpu_time_total / steps})
    ops_.sort(key=lambda o: -o["self_us_per_step"])
    total = sum(o["self_us_per_step"] for o in ops_)
    gemm = sum(o["self_us_per_step"] for o in ops_ if o["op"] in GEMMS)
    result = {"total_us_per_step": total, "gemm_us_per_step": gemm,
              "gemm_share": gemm / total if total else 0.0,
              "minor_faults_per_step": faults / steps, "ops": ops_}
    if shapes:
        # The matrix products per step, by their two operands' shapes (addmm's bias left out:
        # dpcuda's float forward adds the bias in its own pass after an mm in a small layer,
        # torch's in its addmm).
        calls = {}
        for event in prof.key_averages(group_by_input_shape=True):
            if event.key in GEMMS:
                operands = event.input_shapes[1:3] if event.key == "aten::addmm" else \
                    event.input_shapes[:2]
                key = " x ".join(str(list(v)) for v in operands)
                calls[key] = calls.get(key, 0) + event.count / steps
        result["gemm_calls"] = dict(sorted(calls.items()))
    return result


def cell_steps(width, batch, act, bias, layout, dtype):
    """The fused and the eager step of a cell, as bench_sweep.py times them."""
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
    return (run(lambda: ops.full_forward(x, w, b, act)),
            run(lambda: torch_activation(F.linear(x, w, b), act)))


def cell_label(width, batch, act, bias, layout, dtype):
    return f"{width}x{width} batch {batch} {act} bias {'on' if bias else 'off'} {layout} {dtype}"


def profile_interleaved(sides, turns, steps, warmup=5):
    """One profile over `turns` turns, each `steps` steps of every side in order (a side's
    steps timed between the other's, not in a block of their own, where the machine's drift
    between blocks shows as a difference): per side the median over its steps of each
    operator's self time and of the whole step."""
    for _ in range(warmup):
        for step in sides.values():
            step()
    label = "profile_cells:"
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(turns):
            for name, step in sides.items():
                for _ in range(steps):
                    with record_function(label + name):
                        step()
    events = prof.events()
    per_step = {}   # side -> the step's event id -> op -> [calls, self us]
    step_us = {name: [] for name in sides}
    for event in events:
        if event.name.startswith(label):
            step_us[event.name[len(label):]].append(event.cpu_time_total)
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith(label):
            parent = parent.cpu_parent
        if parent is None or event.self_cpu_time_total <= 0:
            continue
        ops_ = per_step.setdefault(parent.name[len(label):], {}).setdefault(parent.id, {})
        calls_us = ops_.setdefault(event.name, [0, 0.0])
        calls_us[0] += 1
        calls_us[1] += event.self_cpu_time_total
    result = {}
    for name in sides:
        instances = list(per_step.get(name, {}).values())
        names = sorted({op for inst in instances for op in inst})
        ops_ = [{"op": op,
                 "calls_per_step": statistics.median(inst.get(op, [0, 0.0])[0]
                                                     for inst in instances),
                 "self_us_per_step": statistics.median(inst.get(op, [0, 0.0])[1]
                                                       for inst in instances)}
                for op in names]
        ops_.sort(key=lambda o: -o["self_us_per_step"])
        gemm = [sum(inst[op][1] for op in inst if op in GEMMS) for inst in instances]
        result[name] = {"steps": len(step_us[name]), "step_us": statistics.median(step_us[name]),
                        "gemm_us_per_step": statistics.median(gemm),
                        "own_us_per_step": statistics.median(
                            sum(v[1] for op, v in inst.items() if op not in GEMMS)
                            for inst in instances),
                        "ops": ops_}
    return result


def profile_cell(width, batch, act, bias, layout, dtype, steps):
    fused, eager = cell_steps(width, batch, act, bias, layout, dtype)
    return {"width": width, "batch": batch, "activation": act, "bias": bias, "layout": layout,
            "dtype": dtype, "fused": profile_side(fused, steps),
            "eager": profile_side(eager, steps)}


def explain_cell(width, batch, act, bias, layout, dtype, steps, rounds, repeats, min_seconds,
                 below, consecutive_ms=0.0):
    """A cell timed alone, then profiled `rounds` times per side (alternating), with its
    verdict (the module's docstring)."""
    samples, per_turn = time_cell(width, batch, act, bias, layout, getattr(torch, dtype), False,
                                  repeats, min_seconds, consecutive_ms=consecutive_ms)
    alone = paired_ratio(samples["eager"], samples["fused"])
    # Each profile covers about 0.2 s of steps (at least 2, at most `steps`): large cells
    # take seconds a step in bfloat16 here.
    fused_ms = statistics.median(samples["fused"])
    steps = min(steps, max(2, math.ceil(200.0 / max(fused_ms, 1e-3))))
    fused, eager = cell_steps(width, batch, act, bias, layout, dtype)
    profiles = {"fused": [], "eager": []}
    for _ in range(rounds):
        for side, step in (("fused", fused), ("eager", eager)):
            profiles[side].append(profile_side(step, steps, warmup=2, shapes=False))
    row = {"width": width, "batch": batch, "activation": act, "bias": bias, "layout": layout,
           "dtype": dtype, "alone": alone, "alone_steps_per_turn": per_turn,
           "profiled_steps": steps}
    for side, runs in profiles.items():
        step = fused if side == "fused" else eager
        own = [r["total_us_per_step"] - r["gemm_us_per_step"] for r in runs]
        row[side] = {
            # (medians over the rounds, each figure apart)
            "total_us_per_step": statistics.median(r["total_us_per_step"] for r in runs),
            "gemm_us_per_step": statistics.median(r["gemm_us_per_step"] for r in runs),
            "own_us_per_step": statistics.median(own),
            "own_us_spread": max(own) - min(own),
            "minor_faults_per_step": statistics.median(r["minor_faults_per_step"] for r in runs),
            "gemm_calls": profile_side(step, 1, warmup=0)["gemm_calls"],
            "ops_of_the_middle_round": sorted(
                runs, key=lambda r: r["total_us_per_step"])[len(runs) // 2]["ops"]}
    row["verdict"] = verdict(alone, row["fused"], row["eager"], below)
    return row


def verdict(alone, fused, eager, below):
    """The module docstring's verdict from a cell's figure alone (median, q1) and each side's
    profile (own_us_per_step, own_us_spread, gemm_us_per_step, gemm_calls)."""
    same_gemms = fused["gemm_calls"] == eager["gemm_calls"]
    own = fused["own_us_per_step"] - eager["own_us_per_step"]
    gemm = fused["gemm_us_per_step"] - eager["gemm_us_per_step"]
    own_noise = max(fused["own_us_spread"], eager["own_us_spread"])
    beyond = own > own_noise
    if alone["median"] >= below:
        kind = "ahead alone" if alone["q1"] >= below else "level alone"
    elif beyond:
        kind = "own work"
    elif own + gemm <= 0:
        kind = "no loss in the profile"
    elif not same_gemms:
        kind = "other products"
    elif gemm >= own:
        kind = "GEMMs"
    else:
        kind = "within the noise"
    # (also where the cell is ahead or level alone: a loss of dpcuda's own the GEMMs made up for)
    return {"kind": kind, "same_gemm_calls": same_gemms, "own_beyond_noise": beyond,
            "own_us": [fused["own_us_per_step"], eager["own_us_per_step"]],
            "own_us_noise": own_noise,
            "minor_faults_per_step": [fused.get("minor_faults_per_step"),
                                      eager.get("minor_faults_per_step")],
            "gemm_us": [fused["gemm_us_per_step"], eager["gemm_us_per_step"]]}


def cells_below(path, below):
    """The cells of a sweep JSON whose median eager/fused is below `below`, worst first."""
    with open(path) as f:
        rows = json.load(f)["results"]
    rows = sorted((r for r in rows if r["eager_over_fused"]["median"] < below),
                  key=lambda r: r["eager_over_fused"]["median"])
    # (each cell as a cell's text, checked as the command line's are)
    return [parse_cell(f"{r['width']}x{r['batch']}:{r['activation']}:"
                       f"{'on' if r['bias'] else 'off'}:{r['layout']}:{r['dtype']}") +
            (r["eager_over_fused"],) for r in rows]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cells", nargs="*", type=parse_cell,
                        help="(default: the losing cells named in the script)")
    parser.add_argument("--steps", type=int, default=20, help="(default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's intra-op threads (default: torch's own)")
    parser.add_argument("--from", dest="sweep", default=None, metavar="SWEEP.json",
                        help="explain the cells of this sweep below --below (the docstring)")
    parser.add_argument("--below", type=float, default=1.0, help="(default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="with --from: profiles per side (default: %(default)s)")
    parser.add_argument("--alone-repeats", type=int, default=15,
                        help="with --from: rounds of the timing alone (default: %(default)s)")
    parser.add_argument("--alone-min-seconds", type=float, default=0.3,
                        help="with --from: (default: %(default)s)")
    parser.add_argument("--alone-consecutive-ms", type=float, default=0.0,
                        help="with --from: each contender's turn in the timing alone, as "
                             "bench_sweep.py's --consecutive-ms (default: one step a turn)")
    parser.add_argument("--interleaved", type=int, default=0, metavar="TURNS",
                        help="profile both sides in one profile, TURNS turns of --steps steps "
                             "each, in turn; medians over the steps (default: a profile per "
                             "side)")
    parser.add_argument("--resume", default=None, metavar="EXPLAIN.json",
                        help="with --from: keep the cells an earlier run over the same sweep "
                             "wrote to this JSON and explain the rest")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.sweep and args.rounds < 3:
        parser.error("--rounds must be at least 3 with --from (the own parts' noise is their "
                     "spread over the rounds)")
    if args.alone_repeats < 1:
        parser.error("--alone-repeats must be at least 1")
    if not (math.isfinite(args.alone_consecutive_ms) and args.alone_consecutive_ms >= 0):
        parser.error(f"--alone-consecutive-ms must be 0 or more, got {args.alone_consecutive_ms}")
    if args.sweep and args.cells:
        parser.error("give cells or --from, not both")
    if args.interleaved < 0:
        parser.error(f"--interleaved must be 0 or more, got {args.interleaved}")
    if args.resume and not args.sweep:
        parser.error("--resume continues a --from run")
    if args.interleaved and args.sweep:
        parser.error("--interleaved profiles the cells given, not --from's")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.sweep:
        try:
            cells = cells_below(args.sweep, args.below)
        except (OSError, ValueError, KeyError, TypeError, argparse.ArgumentTypeError) as e:
            parser.error(f"--from: cannot read a sweep's cells from {args.sweep!r}: {e}")
        rows = []
        if args.resume:
            try:
                rows = resumed_rows(args.resume, args.sweep)
            except (OSError, ValueError, KeyError, TypeError) as e:
                parser.error(f"--resume: cannot take the cells of {args.resume!r}: {e}")
        explain(cells, args, rows)
        return
    cells = args.cells or [parse_cell(c) for c in DEFAULT_CELLS]
    if args.interleaved:
        interleaved(cells, args)
        return
    rows = []
    for width, batch, act, bias, layout, dtype in cells:
        row = profile_cell(width, batch, act, bias, layout, dtype, args.steps)
        rows.append(row)
        f, e = row["fused"], row["eager"]
        print(f"{cell_label(width, batch, act, bias, layout, dtype)}: "
              f"fused {f['total_us_per_step']:.0f} us (GEMMs {100 * f['gemm_share']:.0f}%), "
              f"eager {e['total_us_per_step']:.0f} us (GEMMs {100 * e['gemm_share']:.0f}%)")
        for side in ("fused", "eager"):
            top = ", ".join(f"{o['op']} {o['self_us_per_step']:.0f}"
                            for o in row[side]["ops"][:5])
            print(f"    {side}: {top}")
    write_json(args.json, {"benchmark": "profile_cells", "steps": args.steps,
                           "threads": torch.get_num_threads(),
                           "environment": environment("cpu"), "results": rows})


def interleaved(cells, args):
    rows = []
    for width, batch, act, bias, layout, dtype in cells:
        fused, eager = cell_steps(width, batch, act, bias, layout, dtype)
        sides = profile_interleaved({"fused": fused, "eager": eager}, args.interleaved,
                                    args.steps)
        rows.append({"width": width, "batch": batch, "activation": act, "bias": bias,
                     "layout": layout, "dtype": dtype, **sides})
        print(f"{cell_label(width, batch, act, bias, layout, dtype)}, medians of "
              f"{sides['fused']['steps']} steps a side:")
        for side in ("fused", "eager"):
            d = sides[side]
            top = ", ".join(f"{o['op']} {o['self_us_per_step']:.0f}" for o in d["ops"][:5])
            print(f"    {side}: step {d['step_us']:.0f} us, GEMMs {d['gemm_us_per_step']:.0f}, "
                  f"the rest {d['own_us_per_step']:.0f}: {top}")
    write_json(args.json, {"benchmark": "profile_cells", "interleaved_turns": args.interleaved,
                           "steps": args.steps, "threads": torch.get_num_threads(),
                           "environment": environment("cpu"), "results": rows})


def cell_key(width, batch, act, bias, layout, dtype):
    return (int(width), int(batch), str(act), bool(bias), str(layout), str(dtype))


def resumed_rows(path, sweep):
    """The rows an earlier --from run over the same sweep wrote to `path` (its JSON is written
    after each cell, so a run cut short keeps what it measured)."""
    with open(path) as f:
        payload = json.load(f)
    if payload.get("benchmark") != "explain_cells" or payload.get("sweep") != sweep:
        raise ValueError(f"not an explanation of {sweep!r}")
    rows = payload["results"]
    for r in rows:
        cell_key(r["width"], r["batch"], r["activation"], r["bias"], r["layout"], r["dtype"])
    return rows


def explain(cells, args, rows):
    done = {cell_key(r["width"], r["batch"], r["activation"], r["bias"], r["layout"],
                     r["dtype"]) for r in rows}
    if rows:
        print(f"{len(rows)} cells taken from {args.resume}")

    def payload(complete):
        kinds = {}
        for r in rows:
            kinds[r["verdict"]["kind"]] = kinds.get(r["verdict"]["kind"], 0) + 1
        return {"benchmark": "explain_cells", "sweep": args.sweep, "complete": complete,
                       "below": args.below, "max_steps": args.steps, "rounds": args.rounds,
                       "alone_repeats": args.alone_repeats,
                       "alone_min_seconds": args.alone_min_seconds,
                       "alone_consecutive_ms": args.alone_consecutive_ms,
                       "threads": torch.get_num_threads(), "verdicts": kinds,
                       "environment": environment("cpu"), "results": rows}

    for width, batch, act, bias, layout, dtype, grid in cells:
        if cell_key(width, batch, act, bias, layout, dtype) in done:
            continue
        row = explain_cell(width, batch, act, bias, layout, dtype, args.steps, args.rounds,
                           args.alone_repeats, args.alone_min_seconds, args.below,
                           args.alone_consecutive_ms)
        row["grid"] = grid
        rows.append(row)
        a, v = row["alone"], row["verdict"]
        print(f"{cell_label(width, batch, act, bias, layout, dtype)}: "
              f"grid {grid['median']:.2f}, alone {a['median']:.2f} "
              f"[{a['q1']:.2f}, {a['q3']:.2f}]; own us {v['own_us'][0]:.0f} (dpcuda) / "
              f"{v['own_us'][1]:.0f} (torch) +-{v['own_us_noise']:.0f}, faults/step "
              f"{v['minor_faults_per_step'][0]:.0f} / {v['minor_faults_per_step'][1]:.0f}, GEMMs {v['gemm_us'][0]:.0f} / "
              f"{v['gemm_us'][1]:.0f}: {v['kind']}", flush=True)
        if args.json:  # (after each cell, whole or not at all: a run cut short keeps them)
            with open(args.json + ".part", "w") as f:
                json.dump(payload(False), f, indent=2)
            os.replace(args.json + ".part", args.json)
    final = payload(True)
    print(f"{len(rows)} cells below {args.below}: " +
          ", ".join(f"{n} {k}" for k, n in sorted(final["verdicts"].items())))
    write_json(args.json, final)


if __name__ == "__main__":
    main()
