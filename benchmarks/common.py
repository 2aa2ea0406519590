"""Timing helpers shared by the benchmarks: warm-up, then the median of repeated runs, timed
with CUDA events on a GPU and with perf_counter on the CPU."""

import json
import os
import platform
import random
import statistics
import subprocess
import time

import torch


def time_ms(fn, device, warmup=2, repeats=10):
    """Median wall time of fn() in milliseconds."""
    for _ in range(warmup):
        fn()
    times = []
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def compare_samples(fns, device, warmup=2, repeats=10, min_seconds=0.0, shuffle=False,
                    before=None, consecutive=1):
    """Times in ms of each callable in the dict fns over `repeats` rounds, measured round-robin
    (a, b, c, a, b, c, ...) so that drift in the machine's speed (another process, clock
    changes) falls on every contender alike instead of on whichever ran last. At least `repeats`
    rounds, more until min_seconds of timed runs have passed (short cases need many rounds to
    average out the machine's noise). shuffle: each round in a new order (seeded), so that no
    contender always runs after the same one (whose caches and threads it inherits); before:
    called untimed before each run (a cache flush). consecutive (CPU only): each contender runs
    that many times in a row in its turn, as a training loop runs one model's steps, the first
    untimed (it inherits the other contender's caches, free lists and threads) and the round's
    sample the mean of the others. Returns {name: [ms per round]}."""
    if consecutive < 1 or (consecutive > 1 and torch.device(device).type != "cpu"):
        raise ValueError(f"consecutive must be 1, or more on the CPU; got {consecutive} "
                         f"on {device}")
    if consecutive > 1 and before is not None:
        raise ValueError("consecutive > 1 runs several times a turn: `before` (called before "
                         "each run) does not combine with it")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples = {name: [] for name in fns}
    order = list(fns)
    rng = random.Random(0)
    rounds = 0
    total_ms = 0.0
    while rounds < repeats or total_ms < min_seconds * 1e3:
        if shuffle:
            rng.shuffle(order)
        for name in order:
            fn = fns[name]
            if before is not None:
                before()
            if consecutive == 1:
                ms = time_ms(fn, device, warmup=0, repeats=1)
                total_ms += ms
            else:
                fn()
                t0 = time.perf_counter()
                for _ in range(consecutive - 1):
                    fn()
                elapsed_ms = (time.perf_counter() - t0) * 1e3
                ms = elapsed_ms / (consecutive - 1)
                total_ms += elapsed_ms
            samples[name].append(ms)
        rounds += 1
    return samples


def compare_ms(fns, device, warmup=2, repeats=10):
    """Median time in ms of each callable in fns, measured as compare_samples does."""
    samples = compare_samples(fns, device, warmup, repeats)
    return {name: statistics.median(v) for name, v in samples.items()}


def paired_ratio(baseline, ours):
    """The median over rounds of baseline / ours, each ratio taken within one round (adjacent
    runs), with its quartiles, the fraction of rounds where ours was faster and the number of
    rounds (with the fraction, a sign test's input): a ratio that moves less with the machine's
    drift than a ratio of medians."""
    ratios = sorted(b / o for b, o in zip(baseline, ours))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return {"median": statistics.median(ratios), "q1": q[0], "q3": q[2],
            "faster_rounds": sum(r > 1 for r in ratios) / len(ratios), "rounds": len(ratios)}


def environment(device):
    """Where a result was measured: device name, versions and the commit ("-dirty" after it
    where the tracked files differ from it: the code measured is not that commit's)."""
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                                capture_output=True, text=True, check=False,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit = ""
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or \
        platform.machine()
    # (the allocator's settings where the environment sets them: glibc's MALLOC_ variables and
    # tunables, or another malloc preloaded; they decide whether large tensors come back as
    # fresh pages, page faults and all, from one step to the next)
    malloc = {k: v for k, v in sorted(os.environ.items())
              if k.startswith("MALLOC_") or k in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    # (and OpenMP's, where set: its threads' wait between parallel regions, spinning or asleep,
    # decides what each region's start costs; GNU OpenMP's default, spinning a while and then
    # sleeping, put some small cells' ratio in one of two states per process, issue #27)
    openmp = {k: v for k, v in sorted(os.environ.items())
              if k.startswith(("OMP_", "GOMP_", "KMP_"))}
    # (and whether dpcuda set glibc's thresholds at import, dpcuda/_heap.py: "set", or why not)
    from dpcuda import _heap
    return {"device": str(device), "device_name": name, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "commit": commit,
            "date": time.strftime("%Y-%m-%d"), **host_cpu(),
            "dpcuda_malloc_tuning": _heap.STATE,
            **({"malloc_env": malloc} if malloc else {}),
            **({"openmp_env": openmp} if openmp else {})}


# The instruction sets that decide which GEMM and vector kernels torch's CPU runs (bfloat16's
# GEMMs are several times faster with AMX or AVX512-BF16 than without).
CPU_ISA = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")


def host_cpu():
    """The host CPU's model and the instruction sets above that it has (Linux's /proc/cpuinfo;
    empty elsewhere), with torch's own CPU capability."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"cpu_model": model, "cpu_isa": [f for f in CPU_ISA if f in flags],
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def write_json(path, payload):
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {path}")
