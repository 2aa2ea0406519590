"""Reads the resource usage of every kernel image that the CUDA build makes (ptxas -v through
nvcc --resource-usage, for each architecture of the build) and fails on any stack frame, spill
or local memory, or on more than 48 KiB of static shared memory. Prints the table.

    python scripts/check_kernel_resources.py [--arch 75 --arch 80 --arch 90] [--jobs 2]
    python scripts/check_kernel_resources.py --build build/cmake

The first form compiles every .cu itself. The second reads what a CMake build configured with
-DDPCUDA_KERNEL_REPORT=ON and built with Ninja left (CI's): ptxas's report of every image in
its log (build.log: `cmake --build ... > build.log`; Ninja prints each command's output whole)
and the PTX nvcc kept (kernel-report/*.compute_75.ptx), so that nothing is compiled twice. It
fails unless every .cu under csrc/kernels is in the log with an image for every architecture
the build makes.

Local memory is where by-value parameter arrays indexed at run time, or locals whose address
escapes, end up: slow on a GPU and invisible in the emulation, so it is checked here.

It also checks the floating-point rule of the SGD kernels (csrc/kernels/common.cuh,
mul_rn/add_rn) and of the optimizer kernels (csrc/kernels/optim/update.h, rn::): no product in
them may be contracted into an FMA, so that CPU and CUDA updates give the same bits. In their
PTX there must be no fma and no mul.f32/f64 without a rounding modifier (which ptxas may fuse
with an add). The detector is first shown to fire on a kernel written with plain
operators.
"""

import argparse
import concurrent.futures
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_LIMIT = 48 * 1024


def nvcc_path():
    for base in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if base and os.path.isfile(os.path.join(base, "bin", "nvcc")):
            return os.path.join(base, "bin", "nvcc")
    return shutil.which("nvcc")


def compile_one(nvcc, source, arch):
    cmd = [nvcc, "-std=c++17", "--expt-relaxed-constexpr", "-O3", "--resource-usage",
           f"-gencode=arch=compute_{arch},code=sm_{arch}", "-I", os.path.join(ROOT, "csrc"),
           "-c", source, "-o", os.devnull]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"nvcc failed on {source}:\n{done.stderr}")
    return done.stdout + done.stderr


def parse(text, arch):
    """One row per entry function: name, registers, stack, spill stores/loads, lmem, smem."""
    rows = []
    current = None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for 'sm_(\d+)'", line)
        if m:
            current = {"name": m.group(1), "arch": m.group(2), "regs": 0, "stack": 0,
                       "spill_st": 0, "spill_ld": 0, "lmem": 0, "smem": 0}
            rows.append(current)
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      line)
        if m:
            current["stack"], current["spill_st"], current["spill_ld"] = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current["regs"] = int(m.group(1))
            lmem = re.search(r"(\d+) bytes lmem", line)
            smem = re.search(r"(\d+) bytes smem", line)
            current["lmem"] = int(lmem.group(1)) if lmem else 0
            current["smem"] = int(smem.group(1)) if smem else 0
    return rows


def demangle(names):
    filt = shutil.which("c++filt")
    if not filt:
        return names
    out = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True).stdout
    short = []
    for name in out.splitlines():
        name = re.sub(r"\(anonymous namespace\)::|dpcuda::cuda::|dpcuda::", "", name)
        short.append(name)
    return short


# The kernels whose arithmetic must follow the no-contraction rule, by source and name: the
# fused SGD of the all-reduce, dpcuda.optim's update (csrc/kernels/optim/update.h's rn::) and
# the clipping's sums of squares and coefficient (csrc/kernels/optim/clip.h).
NO_FMA_SOURCES = [(os.path.join("csrc", "kernels", "all_reduce", "all_reduce.cu"),
                   r"sgd|update|square_sum|clip_coefficient"),
                  (os.path.join("csrc", "kernels", "optim", "optim.cu"), r"optim_kernel")]
# Any fma or mad, and any mul without an explicit rounding mode (.rn/.rz/.rm/.rp), predicated
# or not, with or without .ftz/.sat.
CONTRACTIBLE = re.compile(r"^\s*(@!?%\w+\s+)?(fma|mad)(\.\w+)*\.f(32|64)\b|"
                          r"^\s*(@!?%\w+\s+)?mul(\.ftz|\.sat)*\.f(32|64)\b")

BROKEN_SNIPPET = """
__global__ void sgd_plain(const float* g, float* p, float lr, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] = p[i] - lr * g[i];
}
"""


def kept_ptx(kept, source, arch):
    """The PTX of source for compute_<arch> that nvcc --keep left in the folder kept."""
    name = os.path.splitext(os.path.basename(source))[0]
    return os.path.join(kept, f"{name}.compute_{arch}.ptx")


def contractible_in(ptx, pattern):
    """{entry name: [contractible instructions]} of the entries of a PTX file whose name
    matches pattern."""
    found, entry = {}, None
    with open(ptx) as f:
        for line in f:
            m = re.search(r"\.entry\s+(\S+?)\(", line)
            if m:
                entry = m.group(1) if re.search(pattern, m.group(1)) else None
                if entry:
                    found.setdefault(entry, [])
            elif entry and CONTRACTIBLE.match(line):
                words = line.split()
                found[entry].append(words[1] if words[0].startswith("@") else words[0])
    return found


def contractible_ops(nvcc, source, arch, pattern, include=True):
    """{entry name: [contractible PTX instructions]} of the entries of source whose name
    matches pattern."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "out.ptx")
        cmd = [nvcc, "-std=c++17", "--expt-relaxed-constexpr", "-O3", "-ptx",
               f"-arch=compute_{arch}", "-o", ptx, source]
        if include:
            cmd[1:1] = ["-I", os.path.join(ROOT, "csrc")]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"nvcc -ptx failed on {source}:\n{done.stderr}")
        return contractible_in(ptx, pattern)


def check_no_contraction(nvcc, arch, kept=None):
    """kept: the folder of the PTX a build kept (<name>.compute_<arch>.ptx), read instead of
    compiling the sources again."""
    with tempfile.TemporaryDirectory() as tmp:
        broken = os.path.join(tmp, "broken_sgd.cu")
        with open(broken, "w") as f:
            f.write(BROKEN_SNIPPET)
        seen = contractible_ops(nvcc, broken, arch, r"sgd", include=False)
    if not any(seen.values()):
        print("no-FMA check: the detector missed the FMA of a plain p - lr * g kernel")
        return 1
    found, missing = {}, []
    for source, pattern in NO_FMA_SOURCES:
        if kept is None:
            entries = contractible_ops(nvcc, os.path.join(ROOT, source), arch, pattern)
        else:
            ptx = kept_ptx(kept, source, arch)
            entries = contractible_in(ptx, pattern) if os.path.isfile(ptx) else {}
        if not entries:
            missing.append(source)
        found.update(entries)
    bad = {k: v for k, v in found.items() if v}
    for name, ops in bad.items():
        print(f"no-FMA check: {demangle([name])[0]}: {len(ops)} contractible "
              f"({', '.join(sorted(set(ops)))})")
    for source in missing:
        print(f"no-FMA check: no kernel of {source} found to check")
    print(f"no-FMA check (compute_{arch}): {len(found)} SGD and optimizer kernels, {len(bad)} "
          f"with a product "
          f"that may become an FMA (the detector fires on a plain kernel: "
          f"{sum(len(v) for v in seen.values())} found there)")
    return 1 if bad or missing else 0


BUILDING = re.compile(r"Building CUDA object \S*?(csrc/kernels/\S+\.cu)\.o\b")


def rows_from_log(log, sources, archs, kept):
    """The rows of every image in a Ninja build's log (each command's output follows its
    "Building CUDA object ..." line); an error unless each source has images for every arch,
    or none and no kernel in its kept PTX (host code only)."""
    chunks, current = {}, None
    with open(log, errors="replace") as f:
        for line in f:
            m = BUILDING.search(line)
            if m:
                current = m.group(1)
                chunks.setdefault(current, [])
            elif current is not None:
                chunks[current].append(line)
    rows, problems = [], []
    for source in sources:
        rel = os.path.relpath(source, ROOT)
        if rel not in chunks:
            problems.append(f"{rel}: not built in {log}")
            continue
        found = parse("".join(chunks[rel]), None)
        seen = {row["arch"] for row in found}
        if not seen:
            ptx = kept_ptx(kept, source, archs[0])
            if os.path.isfile(ptx):
                with open(ptx) as f:
                    if not re.search(r"\.entry\s", f.read()):
                        continue  # (no kernel in it)
        if seen != set(archs):
            problems.append(f"{rel}: images for sm_{', sm_'.join(sorted(seen)) or '(none)'}, "
                            f"the build makes sm_{', sm_'.join(archs)} (configured with "
                            f"-DDPCUDA_KERNEL_REPORT=ON?)")
        for row in found:
            row["file"] = rel
            rows.append(row)
    return rows, problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", default=None,
                        help="compute capability digits, e.g. 80 (default: 75, 80 and 90)")
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("MAX_JOBS", "2")))
    parser.add_argument("--build", default=None,
                        help="a CMake build folder to read (its build.log and kernel-report/) "
                             "instead of compiling")
    args = parser.parse_args()
    nvcc = nvcc_path()
    if nvcc is None:
        print("check_kernel_resources: nvcc not found (set CUDA_HOME)", file=sys.stderr)
        return 2
    archs = args.arch or ["75", "80", "90"]
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "kernels", "**", "*.cu"),
                               recursive=True))
    kept = None
    if args.build is not None:
        kept = os.path.join(args.build, "kernel-report")
        rows, problems = rows_from_log(os.path.join(args.build, "build.log"), sources, archs,
                                       kept)
        for problem in problems:
            print(f"check_kernel_resources: {problem}")
        if problems:
            return 1
    else:
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            outputs = list(pool.map(lambda sa: (sa, compile_one(nvcc, *sa)),
                                    [(s, a) for s in sources for a in archs]))
        rows = []
        for (source, arch), text in outputs:
            for row in parse(text, arch):
                row["file"] = os.path.relpath(source, ROOT)
                rows.append(row)
    names = demangle([r["name"] for r in rows])
    bad = 0
    print(f"{'arch':>4} {'regs':>4} {'stack':>5} {'spill':>5} {'lmem':>5} {'smem':>6}  kernel")
    for row, name in sorted(zip(rows, names), key=lambda rn: (rn[0]["file"], rn[1], rn[0]["arch"])):
        spill = row["spill_st"] + row["spill_ld"]
        flag = row["stack"] or spill or row["lmem"] or row["smem"] > SHARED_LIMIT
        bad += 1 if flag else 0
        print(f"{row['arch']:>4} {row['regs']:>4} {row['stack']:>5} {spill:>5} {row['lmem']:>5} "
              f"{row['smem']:>6}  {name}{'   <-- FAILS' if flag else ''}")
    print(f"{len(rows)} kernel images, {bad} with stack, spills, local memory or over "
          f"{SHARED_LIMIT} bytes of static shared memory")
    contraction = check_no_contraction(nvcc, archs[0], kept)
    return 1 if bad or not rows or contraction else 0


if __name__ == "__main__":
    sys.exit(main())
