"""On a CUDA machine: the kernels, memory copies and memsets and the host synchronisations of one
steady-state training step (784-256-10 relu MLP, batch 256, inputs and labels on the GPU),
counted by torch.profiler and torch.cuda's sync debug mode over 5 steps, for torch eager
(nn.Sequential, F.cross_entropy, torch.optim.SGD) and for dpcuda's DataParallel (FusedMLP,
SoftmaxCrossEntropyLoss; blocking, blocking=False and graphs=True, whose kernels run inside one
graph launch). "host calls" counts what the host issues per step: kernel launches, graph
launches and copies or memsets (the CUDA runtime and driver calls of those names). The sync debug mode flags stream and
device synchronisations, blocking copies and reads of device values; it does not see a host
wait on an event, which a blocking=False step makes only when the host is DataParallel.lag steps
ahead of the device. The correctness of the CUDA step is tests/test_cuda_step.py's.

    python benchmarks/count_launches.py [--json FILE]
"""

import argparse
import collections
import json
import sys
import warnings

import torch
import torch.nn.functional as F

import dpcuda
from dpcuda.nn import FusedMLP, SoftmaxCrossEntropyLoss
from dpcuda.parallel import DataParallel


def count_step(fn, steps=5):
    for _ in range(8):  # (graphs=True: its warm-up and the capture)
        fn()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kinds = collections.Counter()
    names = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cu") and any(
                k in e.name for k in ("LaunchKernel", "GraphLaunch", "Memcpy", "Memset")):
            kinds["host calls"] += 1
            if "GraphLaunch" in e.name:
                kinds["graph launches"] += 1
        # (the GPU-side range of a user annotation, "Optimizer.step#SGD.step", is no launch)
        if e.device_type == torch.autograd.DeviceType.CUDA and not (
                getattr(e, "is_user_annotation", False) or e.name.startswith("Optimizer.")):
            k = "memcpy" if "Memcpy" in e.name else "memset" if "Memset" in e.name else "kernel"
            kinds[k] += 1
            if k == "kernel":
                names[e.name[:70]] += 1
    syncs = 0
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        syncs = sum("synchroniz" in str(x.message) for x in w)
    torch.cuda.set_sync_debug_mode(0)
    return ({k: v / steps for k, v in kinds.items()}, syncs / steps,
            {k: v / steps for k, v in names.most_common()})


def launches():
    torch.manual_seed(0)
    x = torch.randn(256, 784, device="cuda")
    y = torch.randint(0, 10, (256,), device="cuda")
    base = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10)).cuda()
    opt = torch.optim.SGD(base.parameters(), lr=0.1)
    opt_m = torch.optim.SGD(base.parameters(), lr=0.1, momentum=0.9)

    def torch_step(o):
        o.zero_grad()
        F.cross_entropy(base(x), y).backward()
        o.step()
    rows = {"torch eager (foreach SGD)": lambda: torch_step(opt),
            "torch eager, momentum 0.9": lambda: torch_step(opt_m)}
    for R in (1, 2):
        for mom in (0.0, 0.9):
            dp = DataParallel(FusedMLP([784, 256, 10]), ["cuda:0"] * R, lr=0.1, momentum=mom)
            rows[f"dpcuda {R} replica(s), momentum {mom}"] = (
                lambda dp=dp: dp.step(x, y, SoftmaxCrossEntropyLoss()))
    y_host = y.cpu()
    for blocking in (True, False):
        dp = DataParallel(FusedMLP([784, 256, 10]), ["cuda:0"], lr=0.1, momentum=0.9,
                          blocking=blocking)
        mode = "" if blocking else ", blocking=False"
        if not blocking:
            rows[f"dpcuda 1 replica{mode}"] = (
                lambda dp=dp: dp.step(x, y, SoftmaxCrossEntropyLoss()))
        rows[f"dpcuda 1 replica, labels in host memory{mode}"] = (
            lambda dp=dp: dp.step(x, y_host, SoftmaxCrossEntropyLoss()))
    for R in (1, 2):
        for name in ("SGD", "AdamW"):
            model = FusedMLP([784, 256, 10])
            dp = DataParallel(model, ["cuda:0"] * R, graphs=True)
            opt = getattr(dpcuda.optim, name)(model.parameters(), lr=0.01)
            rows[f"dpcuda {R} replica(s), graphs=True, dpcuda.optim.{name}"] = (
                lambda dp=dp, opt=opt: dp.step(x, y, SoftmaxCrossEntropyLoss(), optimizer=opt))
    out = {}
    for name, fn in rows.items():
        kinds, syncs, names = count_step(fn)
        out[name] = {"per_step": kinds, "host_syncs": syncs, "kernels": names}
        print(f"{name:58s} kernels {kinds.get('kernel', 0):5.1f}  "
              f"memcpy {kinds.get('memcpy', 0):4.1f}  memset {kinds.get('memset', 0):4.1f}  "
              f"syncs {syncs:4.1f}  host calls {kinds.get('host calls', 0):5.1f}  "
              f"graph launches {kinds.get('graph launches', 0):3.1f}", flush=True)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not dpcuda.cuda_available():
        sys.exit("count_launches: needs a CUDA device that dpcuda's kernels can run on")
    result = launches()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
