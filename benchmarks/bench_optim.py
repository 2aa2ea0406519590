"""dpcuda.optim against torch.optim, measured round-robin in the same run.

Part 1, the update alone (every parameter has a gradient; step() timed): dpcuda's SGD
(momentum) and AdamW against torch's single-tensor (foreach=False), multi-tensor
(foreach=True) and fused (fused=True) implementations, for the 784-256-10 MLP's parameters
(4 tensors, 203,530 elements) and for a wider MLP's (4096-4096-4096-10: 6 tensors, 33.6 M).

Part 2, the whole AdamW step of the 784-256-10 MLP (softmax cross-entropy, batch 256): over R
replicas with DataParallel.step(x, y, loss_fn, optimizer=dpcuda.optim.AdamW) (the update fused
into the reduction, sharded state) and with the conventional loop (dp(x), backward,
opt.step()), against torch on one device with AdamW foreach and fused, and against the same
DataParallel step with torch's fused AdamW (the reduction, then torch's update).

Part 3, the reduce-update alone: R replica gradient buffers (the 784-256-10 MLP's 203,530
elements, and 4 M) reduced and AdamW applied, as DataParallel's fused step calls it
(torch.ops.dpcuda.reduce_update_, the new weights into replica 0, which the next forward copies
to the others), against dpcuda's all-reduce followed by torch's fused AdamW on replica 0 (the
same work unfused). With the caches warm, and cold (a 64 MB buffer written before every run),
as a step finds them after its backward.

The whole-step and reduce-update parts shuffle the contenders' order every round: in a fixed
order each always follows the same one and inherits its caches (that bias measured up to 8%).

    python benchmarks/bench_optim.py --device cpu --json benchmarks/results/optim-cpu.json
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import compare_samples, environment, paired_ratio, write_json  # noqa: E402

import dpcuda  # noqa: E402
import dpcuda.optim  # noqa: E402
from dpcuda.nn import FusedMLP, SoftmaxCrossEntropyLoss  # noqa: E402
from dpcuda.parallel import DataParallel  # noqa: E402

SHAPES = {"784-256-10": [784, 256, 10], "4096x3-10": [4096, 4096, 4096, 10]}


def params_of(sizes, device):
    torch.manual_seed(0)
    ps = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        ps += [torch.randn(b, a, device=device) * 0.01, torch.zeros(b, device=device)]
    for p in ps:
        p.requires_grad_()
        p.grad = torch.randn_like(p) * 1e-3
    return ps


def update_only(device, repeats, rows):
    for shape, sizes in SHAPES.items():
        for kind in ("SGD", "AdamW"):
            kw = {"lr": 1e-3, "momentum": 0.9} if kind == "SGD" else {"lr": 1e-3,
                                                                        "weight_decay": 0.01}
            fns = {}
            for name, impl in (("torch single", {"foreach": False}),
                               ("torch foreach", {"foreach": True}),
                               ("torch fused", {"fused": True}), ("dpcuda", None)):
                ps = params_of(sizes, device)
                opt = getattr(dpcuda.optim, kind)(ps, **kw) if impl is None else \
                    getattr(torch.optim, kind)(ps, **kw, **impl)
                fns[name] = opt.step
            samples = compare_samples(fns, device, warmup=3, repeats=repeats)
            report(rows, {"part": "update", "shape": shape, "optimizer": kind}, samples,
                   ["torch single", "torch foreach", "torch fused"])


def whole_step(device, repeats, rows, replicas):
    torch.manual_seed(0)
    x = torch.randn(256, 784, device=device)
    y = torch.randint(0, 10, (256,), device=device)
    for R in replicas:
        fns = {}
        for impl in ("foreach", "fused"):
            torch.manual_seed(0)
            base = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(),
                                       torch.nn.Linear(256, 10)).to(device)
            opt = torch.optim.AdamW(base.parameters(), lr=1e-3, **{impl: True})

            def torch_step(base=base, opt=opt):
                opt.zero_grad()
                F.cross_entropy(base(x), y).backward()
                opt.step()
            fns[f"torch 1 device {impl}"] = torch_step
        torch.manual_seed(0)
        dp = DataParallel(FusedMLP([784, 256, 10]), [device] * R)
        opt = dpcuda.optim.AdamW(dp.parameters(), lr=1e-3)
        loss_fn = SoftmaxCrossEntropyLoss()
        fns["dpcuda step(optimizer=)"] = lambda dp=dp, opt=opt: dp.step(x, y, loss_fn,
                                                                         optimizer=opt)
        # The same step with the reduction followed by torch's fused AdamW (the update not
        # fused into the reduction): the baseline the fused reduce-update must not trail.
        torch.manual_seed(0)
        tdp = DataParallel(FusedMLP([784, 256, 10]), [device] * R)
        topt = torch.optim.AdamW(tdp.parameters(), lr=1e-3, fused=True)
        fns["reduce + torch fused"] = lambda tdp=tdp, topt=topt: tdp.step(x, y, loss_fn,
                                                                          optimizer=topt)
        torch.manual_seed(0)
        loop_dp = DataParallel(FusedMLP([784, 256, 10]), [device] * R)
        loop_opt = dpcuda.optim.AdamW(loop_dp.parameters(), lr=1e-3)

        def loop_step(loop_dp=loop_dp, loop_opt=loop_opt):
            loop_opt.zero_grad()
            F.cross_entropy(loop_dp(x), y).backward()
            loop_opt.step()
        fns["dpcuda loop"] = loop_step
        # (three times the rounds: whole steps on 2 CPU cores drift more than updates)
        samples = compare_samples(fns, device, warmup=3, repeats=3 * repeats, shuffle=True)
        report(rows, {"part": "step", "batch": 256, "replicas": R, "optimizer": "AdamW"},
               samples, ["torch 1 device foreach", "torch 1 device fused",
                         "reduce + torch fused"])


def reduce_update_only(device, repeats, rows, replicas):
    from dpcuda.parallel.fused_update import shard_range
    flush = torch.empty(16 << 20, device=device)  # 64 MB, twice the L3 cache here
    for n in (203530, 4 << 20):
        for R in replicas:
            torch.manual_seed(0)
            ps = [torch.randn(n, device=device) * 0.01 for _ in range(R)]
            gs = [torch.randn(n, device=device) * 1e-3 for _ in range(R)]
            align = 16 // ps[0].element_size()
            bounds = [shard_range(n, R, k, align) for k in range(R)]
            m1 = [torch.zeros(e - b, device=device) for b, e in bounds]
            m2 = [torch.zeros(e - b, device=device) for b, e in bounds]
            opt = dpcuda.optim.AdamW([torch.zeros(1)], lr=1e-3, weight_decay=0.01)
            hyper = [opt._hyper_tensor(0, device, opt._values(opt.param_groups[0], 1.0))] * R
            tm, tv = torch.zeros(n, device=device), torch.zeros(n, device=device)
            step = torch.tensor(0.0)

            def fused():
                torch.ops.dpcuda.reduce_update_(ps, gs, m1, m2, [], hyper, [0, n, 0], "adam",
                                                False, "auto", False)

            def unfused():
                torch.ops.dpcuda.all_reduce_(gs, "sum", "auto")
                torch._fused_adamw_([ps[0]], [gs[0]], [tm], [tv], [], [step], lr=1e-3,
                                    beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
                                    amsgrad=False, maximize=False)
            fns = {"dpcuda reduce_update_": fused, "all_reduce_ + torch fused": unfused}
            for cache in ("warm", "cold"):
                samples = compare_samples(
                    fns, device, warmup=3, repeats=repeats * (3 if n < 1 << 20 else 1),
                    shuffle=True, before=(lambda: flush.add_(1.0)) if cache == "cold" else None)
                report(rows, {"part": "reduce-update", "elements": n, "replicas": R,
                              "optimizer": "AdamW", "cache": cache}, samples,
                       ["all_reduce_ + torch fused"])


def report(rows, key, samples, baselines):
    import statistics
    for name, times in samples.items():
        row = dict(key, method=name, ms=statistics.median(times))
        for b in baselines:
            if name not in baselines:
                ratio = paired_ratio(samples[b], times)
                row[f"{b} / this"] = ratio["median"]
                row[f"{b} / this quartiles"] = [ratio["q1"], ratio["q3"]]
        rows.append(row)
        ratios = "  ".join(f"{b}/this {row[f'{b} / this']:.2f}" for b in baselines
                           if f"{b} / this" in row)
        print(f"{' '.join(str(v) for v in key.values()):>28} {name:>26} {row['ms']:9.3f} ms  "
              f"{ratios}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if dpcuda.cuda_available() else "cpu")
    parser.add_argument("--replicas", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    repeats = args.repeats or (50 if args.device.startswith("cuda") else 21)
    rows = []
    update_only(args.device, repeats, rows)
    replicas = [int(r) for r in args.replicas.split(",")]
    whole_step(args.device, repeats, rows, replicas)
    reduce_update_only(args.device, repeats, rows, [r for r in replicas if r > 1])
    write_json(args.json, {"benchmark": "optim", "repeats": repeats,
                           "environment": environment(args.device), "results": rows})


if __name__ == "__main__":
    main()
