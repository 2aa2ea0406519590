"""Where a replayed graphed step's host time goes on a GPU machine (issue #25): cProfile over
N replayed steps of DataParallel(graphs=True) on 784-256-10 at batch 256, plus the time per step
with and without the profiler.   python benchmarks/profile_graphed_host.py [--json F]"""
import argparse
import cProfile
import io
import json
import pstats
import time

import torch

import dpcuda.optim
from dpcuda.nn import FusedMLP, SoftmaxCrossEntropyLoss
from dpcuda.parallel import DataParallel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--optimizer", default="sgd")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (graphs=True replays CUDA graphs)")
    if a.optimizer not in ("sgd", "adamw") or a.steps < 1:
        ap.error("--optimizer is sgd or adamw, and --steps at least 1")
    torch.manual_seed(0)
    dev = torch.device("cuda")
    x = torch.randn(256, 784, device=dev)
    y = torch.randint(0, 10, (256,), device=dev)
    model = FusedMLP([784, 256, 10]).to(dev)
    dp = DataParallel(model, [dev], graphs=True)
    opt = (dpcuda.optim.SGD if a.optimizer == "sgd" else dpcuda.optim.AdamW)(
        dp.parameters(), lr=1e-3)
    loss = SoftmaxCrossEntropyLoss()
    for _ in range(20):
        dp.step(x, y, loss, optimizer=opt)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(a.steps):
        dp.step(x, y, loss, optimizer=opt)
    host = (time.perf_counter() - t) / a.steps * 1e6
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(a.steps):
        dp.step(x, y, loss, optimizer=opt)
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(40)
    s2 = io.StringIO()
    pstats.Stats(pr, stream=s2).sort_stats("cumulative").print_stats(45)
    print(f"host us/step without profiler: {host:.1f}")
    text = s.getvalue() + "\n" + s2.getvalue()
    print(text[:9000])
    if a.out:
        with open(a.out, "w") as f:
            f.write(f"host us/step without profiler: {host:.1f}\n" + text)
        json.dump({"host_us_per_step": host}, open(a.out + ".json", "w"))


if __name__ == "__main__":
    main()
