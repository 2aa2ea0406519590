"""One full data-parallel training step (784 -> 256 -> 10 MLP, softmax cross-entropy, SGD) for
1, 2 and 4 replicas: DataParallel.step() for each reducer, fused layers (dpcuda.nn.FusedMLP)
and plain torch.nn layers (and the fused p2p step with blocking=False), and the conventional
loop (dp(x), loss.backward(), torch.optim.SGD: rows "loop"), against the single-device torch
baseline (nn.Sequential + torch.optim.SGD) and, on CUDA, torch.nn.DataParallel over the same
devices, measured in the same run.

    python benchmarks/bench_step.py --device cpu --json benchmarks/results/step-cpu.json
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import compare_ms, environment, write_json  # noqa: E402

import dpcuda  # noqa: E402
from dpcuda.nn import FusedMLP, SoftmaxCrossEntropyLoss  # noqa: E402
from dpcuda.parallel import DataParallel  # noqa: E402


def plain_mlp():
    return torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if dpcuda.cuda_available() else "cpu")
    parser.add_argument("--batches", default="256,512")
    parser.add_argument("--replicas", default="1,2,4")
    parser.add_argument("--reducers", default="p2p,host")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = args.device
    cuda = device.startswith("cuda")
    repeats = args.repeats or (50 if cuda else 20)
    rows = []
    print(f"{'batch':>6}{'R':>3}{'method':>24}{'ms':>10}{'torch/ours':>12}")
    for batch in [int(b) for b in args.batches.split(",")]:
        torch.manual_seed(0)
        x = torch.randn(batch, 784, device=device)
        y = torch.randint(0, 10, (batch,), device=device)
        base = plain_mlp().to(device)
        opt = torch.optim.SGD(base.parameters(), lr=0.2)

        def torch_step():
            opt.zero_grad(set_to_none=False)
            F.cross_entropy(base(x), y).backward()
            opt.step()
        for R in [int(r) for r in args.replicas.split(",")]:
            devs = [device] * R
            fns = {"torch 1 device": torch_step}
            for reducer in args.reducers.split(","):
                for fused in (True, False):
                    torch.manual_seed(0)
                    model = FusedMLP([784, 256, 10]) if fused else plain_mlp()
                    loss_fn = SoftmaxCrossEntropyLoss() if fused else F.cross_entropy
                    dp = DataParallel(model, devs, reducer=reducer, lr=0.2)
                    name = f"{reducer} {'fused' if fused else 'plain'}"
                    fns[name] = (lambda dp=dp, loss_fn=loss_fn: dp.step(x, y, loss_fn))
                    if reducer == "p2p" and fused:  # the step that waits for nothing
                        torch.manual_seed(0)
                        nb = DataParallel(FusedMLP([784, 256, 10]), devs, lr=0.2,
                                          blocking=False)
                        fns["p2p fused nonblocking"] = (
                            lambda nb=nb, loss_fn=loss_fn: nb.step(x, y, loss_fn))
            for fused in (False, True):
                # The conventional loop (#23): the user's torch optimizer over dp.parameters(),
                # zero_grad as the baseline does it.
                torch.manual_seed(0)
                model = FusedMLP([784, 256, 10]) if fused else plain_mlp()
                loop_dp = DataParallel(model, devs)
                loop_opt = torch.optim.SGD(loop_dp.parameters(), lr=0.2)

                def loop_step(loop_dp=loop_dp, loop_opt=loop_opt):
                    loop_opt.zero_grad(set_to_none=False)
                    F.cross_entropy(loop_dp(x), y).backward()
                    loop_opt.step()
                fns[f"loop {'fused' if fused else 'plain'}"] = loop_step
            if cuda and R > 1:
                torch_dp = torch.nn.DataParallel(plain_mlp().to(device))
                dp_opt = torch.optim.SGD(torch_dp.parameters(), lr=0.2)

                def nn_dp_step():
                    dp_opt.zero_grad(set_to_none=False)
                    F.cross_entropy(torch_dp(x), y).backward()
                    dp_opt.step()
                fns["nn.DataParallel"] = nn_dp_step
            times = compare_ms(fns, device, warmup=3, repeats=repeats)
            for name, ms in times.items():
                ratio = times["torch 1 device"] / ms
                rows.append({"batch": batch, "replicas": R, "method": name, "ms": ms,
                             "torch_over_this": ratio})
                print(f"{batch:>6}{R:>3}{name:>24}{ms:>10.3f}{ratio:>12.2f}", flush=True)
    write_json(args.json, {"benchmark": "step", "repeats": repeats,
                           "environment": environment(device), "results": rows})


if __name__ == "__main__":
    main()
