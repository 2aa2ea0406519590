"""The fused CPU layer against torch over a grid of shapes (issue #27): one square layer
(width x width) of every activation, forward and backward, for each width, batch, bias,
upstream-gradient layout and dtype, round-robin against torch eager (F.linear + activation)
and, with --compile, torch.compile of the same. Each cell's figure is the median over rounds of
eager / fused (above 1: dpcuda is faster), taken within each round, with its quartiles (the
noise band). Writes the JSON, heat maps (eager/fused by width x batch, one panel per
activation: --png, dense with bias; --png-worst, each square the worst of every layout and
bias) and prints the worst cells and the geometric mean.

    python benchmarks/bench_sweep.py --json benchmarks/results/sweep-cpu.json \\
        --png benchmarks/results/sweep-cpu.png --png-worst benchmarks/results/sweep-cpu-worst.png

--redraw SWEEP.json draws the heat maps of a sweep already run, measuring nothing.

Upstream-gradient layouts: dense (a contiguous tensor), expanded (what y.sum() hands back: one
value broadcast), transposed (a (out, batch) tensor's transpose). Cells whose work exceeds
--max-gflop (forward and backward: 6 * batch * width^2 flops) are skipped and listed. --cells
measures named cells alone, whatever their size, each in a new interpreter (a cell's time in the
whole grid, or after other cells in one process, can depend on what ran before it: the
allocator's history places its tensors; --same-process runs them one after another in this
one; a single named cell runs in this process):

    python benchmarks/bench_sweep.py --cells 256x4096:gelu:on:transposed:bfloat16 \\
        64x8192:silu:off:expanded

--control adds torch eager a second time as a contender (eager_over_eager_again in the JSON):
the method's null, what a layer identical to torch's scores, against which a cell's eager/fused
band is read.
"""

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import compare_samples, environment, paired_ratio, write_json  # noqa: E402

from dpcuda import ops  # noqa: E402
from dpcuda.reference import ACTIVATIONS  # noqa: E402
from dpcuda.reference import activation as torch_activation  # noqa: E402

LAYOUTS = ("dense", "expanded", "transposed")
DTYPES = ("float32", "bfloat16")


def parse_cell(text):
    """WIDTHxBATCH:activation:on|off:layout[:dtype] (dtype float32 unless given), as the JSON's
    rows name a cell; returns (width, batch, activation, bias, layout, dtype)."""
    parts = text.split(":")
    try:
        shape, act, bias, layout = parts[:4]
        width, batch = (int(v) for v in shape.split("x"))
        if len(parts) > 5:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a cell is WIDTHxBATCH:activation:on|off:layout[:dtype], got {text!r}") from None
    dtype = parts[4] if len(parts) == 5 else "float32"
    if bias not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"bias must be on or off, got {bias!r}")
    if act not in ACTIVATIONS:
        raise argparse.ArgumentTypeError(f"activation must be one of {', '.join(ACTIVATIONS)}, "
                                         f"got {act!r}")
    if layout not in LAYOUTS:
        raise argparse.ArgumentTypeError(f"layout must be one of {', '.join(LAYOUTS)}, "
                                         f"got {layout!r}")
    if dtype not in DTYPES:
        raise argparse.ArgumentTypeError(f"dtype must be one of {', '.join(DTYPES)}, "
                                         f"got {dtype!r}")
    return width, batch, act, bias == "on", layout, dtype


def upstream(layout, batch, width, dtype):
    if layout == "dense":
        return torch.randn(batch, width, dtype=dtype)
    if layout == "expanded":
        return torch.ones((), dtype=dtype).expand(batch, width)
    return torch.randn(width, batch, dtype=dtype).t()


def steps_per_turn(step, consecutive_ms):
    """How many steps each contender runs in its turn for --consecutive-ms: one untimed, then
    enough to last about consecutive_ms (by the median of 3 timed steps after an untimed one),
    1 to 50 of them."""
    step()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return 1 + min(50, max(1, round(consecutive_ms / max(statistics.median(times), 1e-6))))


def cell(width, batch, act, bias, layout, dtype, compile_, repeats, min_seconds, control=False,
         consecutive_ms=0.0):
    x = torch.randn(batch, width, dtype=dtype, requires_grad=True)
    w = (torch.randn(width, width, dtype=dtype) * width ** -0.5).requires_grad_()
    b = torch.randn(width, dtype=dtype, requires_grad=True) if bias else None
    go = upstream(layout, batch, width, dtype)
    leaves = [t for t in (x, w, b) if t is not None]

    def eager_fn(x, w, b):
        return torch_activation(F.linear(x, w, b), act)

    def run(fn):
        def step():
            for t in leaves:
                t.grad = None
            fn(x, w, b).backward(go)
        return step

    fns = {"fused": run(lambda x, w, b: ops.full_forward(x, w, b, act)), "eager": run(eager_fn)}
    if compile_:
        fns["compile"] = run(torch.compile(eager_fn))
    if control:
        # torch eager again, a closure of its own: eager / eager_again is the harness's null,
        # what a contender identical to torch's scores (its band is the noise of the method).
        fns["eager_again"] = run(lambda x, w, b: eager_fn(x, w, b))
    consecutive = steps_per_turn(fns["fused"], consecutive_ms) if consecutive_ms > 0 else 1
    return compare_samples(fns, "cpu", warmup=3, repeats=repeats, min_seconds=min_seconds,
                           shuffle=True, consecutive=consecutive), consecutive


def heat_grid(rows, act, widths, batches, layout=None, bias=None):
    """The medians of one activation's rows as [width][batch] (NaN where none); without a
    layout, each square's lowest over the rows of every layout and bias."""
    grid = [[math.nan] * len(batches) for _ in widths]
    for r in rows:
        if r["activation"] != act or (layout is not None and
                                      (r["layout"], r["bias"]) != (layout, bias)):
            continue
        i, j = widths.index(r["width"]), batches.index(r["batch"])
        value = r["eager_over_fused"]["median"]
        grid[i][j] = value if math.isnan(grid[i][j]) else min(grid[i][j], value)
    return grid


def heat_map(rows, path, dtype, layout=None, bias=None):
    """eager/fused by width x batch, a panel per activation, for one layout and bias; without
    them (--png-worst), each square is the lowest median of its width, batch and activation
    over every layout and bias in the rows, so that the grid's worst cells are in the picture."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in rows if r["dtype"] == dtype]
    acts = sorted({r["activation"] for r in rows})
    widths = sorted({r["width"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    cols = min(4, len(acts))
    fig, axes = plt.subplots(math.ceil(len(acts) / cols), cols,
                             figsize=(3.2 * cols, 2.9 * math.ceil(len(acts) / cols) + 0.5),
                             squeeze=False, layout="constrained")
    for ax in axes.flat[len(acts):]:
        ax.axis("off")
    image = None
    for ax, act in zip(axes.flat, acts):
        grid = heat_grid(rows, act, widths, batches, layout, bias)
        image = ax.imshow(grid, cmap="RdYlGn", vmin=0.8, vmax=1.25, origin="lower",
                          aspect="auto")
        for i, j in itertools.product(range(len(widths)), range(len(batches))):
            if not math.isnan(grid[i][j]):
                ax.text(j, i, f"{grid[i][j]:.2f}", ha="center", va="center", fontsize=7)
        ax.set_title(act, fontsize=9)
        ax.set_xticks(range(len(batches)), [str(b) for b in batches], fontsize=7)
        ax.set_yticks(range(len(widths)), [str(w) for w in widths], fontsize=7)
        ax.set_xlabel("batch", fontsize=8)
        ax.set_ylabel("width", fontsize=8)
    what = (f"{layout} upstream gradient, bias {'on' if bias else 'off'}" if layout is not None
            else "each square the worst of every layout and bias")
    fig.suptitle(f"torch eager / dpcuda fused, forward+backward; > 1: dpcuda faster\n"
                 f"({dtype}, {what})", fontsize=9)
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def heat_maps(rows, args):
    """--png (the first row's layout, bias and dtype) and --png-worst (the first row's dtype)."""
    if not rows:
        return
    first = rows[0]
    if args.png:
        heat_map(rows, args.png, first["dtype"], first["layout"], first["bias"])
    if args.png_worst:
        heat_map(rows, args.png_worst, first["dtype"])


def cells_in_new_processes(args):
    """--cells, each cell by this script in a new interpreter with this run's options; the rows
    reported together."""
    options = [f"--repeats={args.repeats}", f"--min-seconds={args.min_seconds}"]
    options += [f"--threads={args.threads}"] if args.threads else []
    options += ["--compile"] if args.compile else []
    options += ["--control"] if args.control else []
    options += [f"--consecutive-ms={args.consecutive_ms}"] if args.consecutive_ms else []
    cell_rows = []
    with tempfile.TemporaryDirectory() as folder:
        for k, (w, b, a, bi, lay, dt) in enumerate(args.cells):
            out = os.path.join(folder, f"{k}.json")
            name = f"{w}x{b}:{a}:{'on' if bi else 'off'}:{lay}:{dt}"
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--cells",
                                   name, *options, "--json", out], capture_output=True,
                                  text=True)
            lines = proc.stdout.splitlines()
            if proc.returncode != 0 or not os.path.exists(out):
                # (the cells measured so far are written before the run stops)
                report(cell_rows, [], args)
                raise SystemExit(f"bench_sweep.py: the cell {name} failed in its own "
                                 f"process (exit status {proc.returncode}):\n"
                                 f"{proc.stdout}{proc.stderr}")
            if k == 0:
                print(lines[0])
            print(lines[1], flush=True)  # (the child's header, then its one row)
            with open(out) as f:
                cell_rows += json.load(f)["results"]
    return report(cell_rows, [], args)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    parser.add_argument("--widths", type=ints, default=[16, 64, 128, 256, 1024, 4096],
                        help="(default: 16,64,128,256,1024,4096)")
    parser.add_argument("--batches", type=ints, default=[1, 32, 256, 4096, 8192],
                        help="(default: 1,32,256,4096,8192)")
    parser.add_argument("--activations", default=",".join(ACTIVATIONS),
                        help="(default: all)")
    parser.add_argument("--bias", default="on,off", help="(default: %(default)s)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="(default: %(default)s)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="(default: %(default)s)")
    parser.add_argument("--compile", action="store_true",
                        help="add torch.compile as a contender (a compile per cell)")
    parser.add_argument("--control", action="store_true",
                        help="add torch eager again as a contender: eager/eager_again, the "
                             "method's null (what torch scores against itself)")
    parser.add_argument("--consecutive-ms", type=float, default=0.0,
                        help="each contender's turn in a round: consecutive steps lasting about "
                             "this long, the first untimed, as a training loop runs one model's "
                             "steps (default: one timed step a turn)")
    parser.add_argument("--max-gflop", type=float, default=60.0,
                        help="skip cells of more work (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=15, help="(default: %(default)s)")
    parser.add_argument("--min-seconds", type=float, default=0.3,
                        help="time each cell at least this long (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's)")
    parser.add_argument("--cells", nargs="+", type=parse_cell, default=None,
                        metavar="CELL",
                        help="measure these cells alone instead of the grid: "
                             "WIDTHxBATCH:activation:on|off:layout[:dtype]")
    parser.add_argument("--same-process", action="store_true",
                        help="with --cells: all in this process, one after another (default: "
                             "each in a new interpreter)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--png", default=None,
                        help="the heat map of the first cell's layout, bias and dtype (the "
                             "grid's: dense, bias on, float32 when measured)")
    parser.add_argument("--png-worst", default=None,
                        help="the heat map of the first cell's dtype, each square the worst "
                             "median of every layout and bias")
    parser.add_argument("--redraw", default=None, metavar="SWEEP.json",
                        help="measure nothing: draw --png and --png-worst from this JSON")
    args = parser.parse_args(argv)
    if args.redraw:
        if not (args.png or args.png_worst):
            parser.error("--redraw needs --png or --png-worst")
        keys = ("width", "batch", "activation", "bias", "layout", "dtype")
        try:
            with open(args.redraw) as f:
                rows = json.load(f)["results"]
            if not isinstance(rows, list) or not rows:
                raise ValueError("no rows")
            for r in rows:
                [r[k] for k in keys]
                median = r["eager_over_fused"]["median"]
                if (isinstance(median, bool) or not isinstance(median, (int, float))
                        or not math.isfinite(median) or median <= 0):
                    raise ValueError(f"a median of {median!r}")
                if not all(isinstance(r[k], int) and not isinstance(r[k], bool) and r[k] > 0
                           for k in ("width", "batch")):
                    raise ValueError(f"a width or batch of {r['width']!r}, {r['batch']!r}")
                if not all(isinstance(r[k], str) for k in ("activation", "layout", "dtype")):
                    raise ValueError("an activation, layout or dtype that is not a name")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # (one line, exit status 2: the file is at fault, not the command line's usage)
            message = (f"bench_sweep.py: error: --redraw: cannot read a sweep's results from "
                       f"{args.redraw}: {type(exc).__name__}: {exc}")
            print(" ".join(message.split()), file=sys.stderr)
            sys.exit(2)
        return heat_maps(rows, args)
    acts = [a for a in args.activations.split(",") if a]
    bad = [a for a in acts if a not in ACTIVATIONS]
    if bad:
        parser.error(f"unknown activations {bad}; choose from {list(ACTIVATIONS)}")
    layouts = [v for v in args.layouts.split(",") if v]
    if any(v not in LAYOUTS for v in layouts):
        parser.error(f"--layouts: choose from {list(LAYOUTS)}")
    dtypes = []
    for name in args.dtypes.split(","):
        if name not in DTYPES:
            parser.error(f"--dtypes: float32 or bfloat16, got {name!r}")
        dtypes.append(name)
    if not (math.isfinite(args.consecutive_ms) and args.consecutive_ms >= 0):
        parser.error(f"--consecutive-ms must be 0 or more, got {args.consecutive_ms}")
    biases = [{"on": True, "off": False}[v] for v in args.bias.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cells and len(args.cells) > 1 and not args.same_process:
        return cells_in_new_processes(args)
    if args.cells:
        grid = [(dt, w, b, a, bi, lay) for w, b, a, bi, lay, dt in args.cells]
    else:
        grid = itertools.product(dtypes, args.widths, args.batches, acts, biases, layouts)
    torch.manual_seed(0)
    rows, skipped = [], []
    print(f"{'width':>6}{'batch':>6}{'activation':>11}{'bias':>5}{'layout':>11}{'dtype':>9}"
          f"{'eager/fused':>12}{'q1':>6}{'q3':>6}{'compile/fused':>14}")
    for dtype, width, batch, act, bias, layout in grid:
        gflop = 6 * batch * width * width / 1e9
        if gflop > args.max_gflop and not args.cells:  # (named cells run whatever their size)
            skipped.append({"width": width, "batch": batch, "gflop": gflop})
            continue
        samples, consecutive = cell(width, batch, act, bias, layout, getattr(torch, dtype),
                                    args.compile, args.repeats, args.min_seconds, args.control,
                                    args.consecutive_ms)
        row = {"width": width, "batch": batch, "activation": act, "bias": bias,
               "layout": layout, "dtype": dtype, "steps_per_turn": consecutive,
               "fused_ms": sorted(samples["fused"])[len(samples["fused"]) // 2],
               "eager_over_fused": paired_ratio(samples["eager"], samples["fused"])}
        if "compile" in samples:
            row["compile_over_fused"] = paired_ratio(samples["compile"], samples["fused"])
        if "eager_again" in samples:
            row["eager_over_eager_again"] = paired_ratio(samples["eager"], samples["eager_again"])
        rows.append(row)
        e = row["eager_over_fused"]
        c = row.get("compile_over_fused", {}).get("median", math.nan)
        null = row.get("eager_over_eager_again")
        print(f"{width:>6}{batch:>6}{act:>11}{'on' if bias else 'off':>5}{layout:>11}"
              f"{dtype:>9}{e['median']:>12.2f}{e['q1']:>6.2f}{e['q3']:>6.2f}{c:>14.2f}"
              + (f"  eager/eager_again {null['median']:.3f} [{null['q1']:.3f}, "
                 f"{null['q3']:.3f}]" if null else ""), flush=True)
    return report(rows, skipped, args)


def report(rows, skipped, args):
    """The geometric mean, the worst cells and the JSON and heat map of a run's rows."""
    ratios = [r["eager_over_fused"]["median"] for r in rows]
    geomean = math.exp(sum(math.log(v) for v in ratios) / len(ratios)) if ratios else math.nan
    worst = sorted(rows, key=lambda r: r["eager_over_fused"]["median"])[:10]
    print(f"geometric mean of eager/fused over {len(rows)} cells: {geomean:.3f}")
    for r in worst:
        print(f"  worst: {r['width']}x{r['width']} batch {r['batch']} {r['activation']} "
              f"bias {r['bias']} {r['layout']} {r['dtype']}: "
              f"{r['eager_over_fused']['median']:.2f} "
              f"[{r['eager_over_fused']['q1']:.2f}, {r['eager_over_fused']['q3']:.2f}]")
    write_json(args.json, {"benchmark": "sweep", "environment": environment("cpu"),
                           "repeats": args.repeats, "min_seconds": args.min_seconds,
                           "consecutive_ms": args.consecutive_ms,
                           "cells_each_in_a_new_process": bool(
                               args.cells and len(args.cells) > 1 and not args.same_process),
                           "geomean_eager_over_fused": geomean, "results": rows,
                           "skipped": skipped})
    heat_maps(rows, args)


if __name__ == "__main__":
    main()
