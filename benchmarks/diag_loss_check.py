"""Diagnosis, on a CUDA machine: where the fused MLP + loss step (784-256-10, batch 256, forward
and backward) loses to torch eager. Times, round-robin in one run: torch eager; dpcuda
(FusedMLP + SoftmaxCrossEntropyLoss); dpcuda with the loss op's eager label check (a reduction
and a host synchronisation per call) deferred, as DataParallel.step defers it; FusedMLP with
F.cross_entropy; nn.Sequential with dpcuda's loss.

    python benchmarks/diag_loss_check.py [--batch 256] [--repeats 300]
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import compare_ms  # noqa: E402

import dpcuda  # noqa: E402
from dpcuda import _C  # noqa: E402
from dpcuda.nn import FusedMLP, SoftmaxCrossEntropyLoss  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    if not dpcuda.cuda_available():
        sys.exit("diag_loss_check: needs a CUDA device that dpcuda's kernels can run on")
    torch.manual_seed(0)
    x = torch.randn(args.batch, 784, device="cuda")
    y = torch.randint(0, 10, (args.batch,), device="cuda")
    eager = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10)).cuda()
    fused = FusedMLP([784, 256, 10]).cuda()
    loss = SoftmaxCrossEntropyLoss()

    def step(model, loss_fn):
        for p in model.parameters():
            p.grad = None
        loss_fn(model(x), y).backward()

    def deferred():
        previous = _C._defer_label_checks(True)
        try:
            step(fused, loss)
        finally:
            _C._defer_label_checks(previous)

    fns = {"torch eager": lambda: step(eager, F.cross_entropy),
           "dpcuda": lambda: step(fused, loss),
           "dpcuda, label check deferred": deferred,
           "FusedMLP + F.cross_entropy": lambda: step(fused, F.cross_entropy),
           "nn.Sequential + dpcuda loss": lambda: step(eager, loss)}
    times = compare_ms(fns, "cuda", warmup=10, repeats=args.repeats)
    for name, ms in times.items():
        print(f"{name:32s} {ms:8.3f} ms   eager/this {times['torch eager'] / ms:5.2f}")


if __name__ == "__main__":
    main()
