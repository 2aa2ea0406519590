"""Forward+backward of FusedLinear and of a 784-256-10 FusedMLP with the fused LossGrad, against
torch eager (F.linear + activation + F.cross_entropy) and torch.compile of the same, measured in
the same run, round-robin. Prints medians and the ratios baseline / dpcuda (above 1: dpcuda is
faster), each the median of the per-round ratios, with their quartiles.

    python benchmarks/bench_layers.py --device cpu --json benchmarks/results/layers-cpu.json
"""

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import compare_samples, environment, paired_ratio, write_json  # noqa: E402

import dpcuda  # noqa: E402
from dpcuda import ops  # noqa: E402
from dpcuda.nn import FusedMLP  # noqa: E402
from dpcuda.reference import activation as torch_activation  # noqa: E402

# (batch, in, out): the classic 784->256 layer at batch 256 up to 4096->4096 at batch 4096.
LINEAR_SHAPES = [(256, 784, 256), (1024, 1024, 1024), (4096, 4096, 4096)]
MLP_BATCHES = [256, 4096]


def linear_case(batch, inf, outf, activation, device, dtype, repeats, min_seconds):
    x = torch.randn(batch, inf, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(outf, inf, device=device, dtype=dtype) * inf ** -0.5).requires_grad_()
    b = torch.randn(outf, device=device, dtype=dtype, requires_grad=True)
    go = torch.randn(batch, outf, device=device, dtype=dtype)

    def eager_fn(x, w, b):
        return torch_activation(F.linear(x, w, b), activation)

    compiled_fn = torch.compile(eager_fn)

    def run(fn):
        def step():
            x.grad = w.grad = b.grad = None
            fn(x, w, b).backward(go)
        return step

    return compare_samples({"dpcuda": run(lambda x, w, b: ops.full_forward(x, w, b, activation)),
                            "eager": run(eager_fn), "compile": run(compiled_fn)},
                           device, warmup=3, repeats=repeats, min_seconds=min_seconds)


class Activation(torch.nn.Module):
    """torch's own form of an activation, as a layer of the eager MLP."""

    def __init__(self, name):
        super().__init__()
        self.name = name

    def forward(self, x):
        return torch_activation(x, self.name)


def mlp_case(batch, activation, device, dtype, repeats, min_seconds):
    torch.manual_seed(0)
    fused = FusedMLP([784, 256, 10], activation=activation).to(device=device, dtype=dtype)
    act = torch.nn.ReLU() if activation == "relu" else Activation(activation)
    eager = torch.nn.Sequential(torch.nn.Linear(784, 256), act,
                                torch.nn.Linear(256, 10)).to(device=device, dtype=dtype)
    x = torch.randn(batch, 784, device=device, dtype=dtype)
    y = torch.randint(0, 10, (batch,), device=device)

    def eager_loss(x, y):
        return F.cross_entropy(eager(x), y)

    compiled_loss = torch.compile(eager_loss)

    def run(model, loss_fn):
        def step():
            for p in model.parameters():
                p.grad = None
            loss_fn(x, y).backward()
        return step

    return compare_samples({"dpcuda": run(fused, lambda x, y: ops.softmax_cross_entropy(fused(x), y)),
                            "eager": run(eager, eager_loss),
                            "compile": run(eager, compiled_loss)},
                           device, warmup=3, repeats=repeats, min_seconds=min_seconds)


def summarise(samples):
    """Medians, and the paired ratios baseline / dpcuda (above 1: dpcuda is faster)."""
    out = {name: statistics.median(v) for name, v in samples.items()}
    out["rounds"] = len(samples["dpcuda"])
    for base in ("eager", "compile"):
        ratio = paired_ratio(samples[base], samples["dpcuda"])
        out[f"{base}_over_dpcuda"] = ratio["median"]
        out[f"{base}_over_dpcuda_quartiles"] = [ratio["q1"], ratio["q3"]]
        out[f"dpcuda_faster_than_{base}_rounds"] = ratio["faster_rounds"]
    return out


def ratio_text(t, base):
    q1, q3 = t[f"{base}_over_dpcuda_quartiles"]
    text = f"{t[f'{base}_over_dpcuda']:.3f}"
    return f"{text} [{q1:.3f}-{q3:.3f}]" if base == "eager" else text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if dpcuda.cuda_available() else "cpu")
    parser.add_argument("--dtype", default="float32",
                        choices=["float32", "float64", "float16", "bfloat16"])
    parser.add_argument("--activation", default="relu")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs per case (default: 20 on CPU, 50 on CUDA)")
    parser.add_argument("--min-seconds", type=float, default=None,
                        help="keep adding rounds until this much time was timed per case "
                             "(default: 20 on CPU, 2 on CUDA)")
    parser.add_argument("--max-size", type=int, default=4096,
                        help="skip linear shapes with a dimension above this")
    parser.add_argument("--json", default=None, help="write every figure to this JSON file")
    args = parser.parse_args(argv)
    device, dtype = args.device, getattr(torch, args.dtype)
    if device.startswith("cuda") and not dpcuda.cuda_available():
        parser.error("--device cuda: dpcuda's CUDA kernels are not available here")
    repeats = args.repeats or (50 if device.startswith("cuda") else 20)
    if args.min_seconds is None:
        args.min_seconds = 2.0 if device.startswith("cuda") else 20.0
    results = []
    print(f"{'case':<38}{'dpcuda ms':>11}{'eager ms':>11}{'compile ms':>12}"
          f"{'eager/ours [quartiles]':>26}{'compile/ours':>14}")
    cases = [("linear", s) for s in LINEAR_SHAPES if max(s) <= args.max_size]
    cases += [("mlp", b) for b in MLP_BATCHES if b <= args.max_size]
    for kind, spec in cases:
        torch._dynamo.reset()
        if kind == "linear":
            name = f"linear {spec[1]}->{spec[2]} b{spec[0]} {args.activation}"
            t = linear_case(*spec, args.activation, device, dtype, repeats, args.min_seconds)
        else:
            name = f"mlp 784-256-10 + loss b{spec} {args.activation}"
            t = mlp_case(spec, args.activation, device, dtype, repeats, args.min_seconds)
        t = summarise(t)
        results.append({"case": name, "kind": kind, **t})
        print(f"{name:<38}{t['dpcuda']:>11.3f}{t['eager']:>11.3f}{t['compile']:>12.3f}"
              f"{ratio_text(t, 'eager'):>26}{ratio_text(t, 'compile'):>14}", flush=True)
    write_json(args.json, {"benchmark": "layers", "dtype": args.dtype, "repeats": repeats,
                           "min_seconds": args.min_seconds, "activation": args.activation,
                           "environment": environment(device), "results": results})


if __name__ == "__main__":
    main()
