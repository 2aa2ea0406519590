"""The command line: `python -m dpcuda train` (also the `dpcuda` console script) and
`python -m dpcuda bench scaling`.

    python -m dpcuda train                         the digits MLP, 10 epochs, every GPU or the CPU
    python -m dpcuda train --replicas 4 --reducer host --json run.json
    python -m dpcuda bench scaling --json scaling.json --plot scaling.png

Bad options exit with status 2 and a one-line message; Ctrl-C saves the last good state (with
--checkpoint) and exits with status 130.
"""

import argparse
import json
import math
import os
import sys
import time

import torch

from . import data as data_mod
from .parallel import REDUCERS, SPLITS
from .reference import ACTIVATIONS

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `dpcuda train: error: ...`, exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(name):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a positive integer, got {text!r}")
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be a positive integer, got {text!r}")
        return value
    return parse


def _non_negative_float(name):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}")
        if not math.isfinite(value) or value < 0:
            raise argparse.ArgumentTypeError(f"{name} must be a non-negative finite number, "
                                             f"got {text!r}")
        return value
    return parse


def _default_devices():
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        from . import cuda_available
        if cuda_available():
            return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu"]


def _add_model_and_data(p, epochs_default):
    p.add_argument("--devices", default=None,
                   help="comma-separated devices, e.g. cuda:0,cuda:1 (default: every GPU, "
                        "else the CPU)")
    p.add_argument("--batch-size", type=_positive_int("--batch-size"), default=256)
    p.add_argument("--lr", type=_non_negative_float("--lr"), default=0.2)
    p.add_argument("--momentum", type=_non_negative_float("--momentum"), default=0.9)
    p.add_argument("--weight-decay", type=_non_negative_float("--weight-decay"), default=0.0)
    p.add_argument("--epochs", type=_positive_int("--epochs"), default=epochs_default)
    p.add_argument("--hidden", type=_positive_int("--hidden"), default=256)
    p.add_argument("--activation", choices=[a for a in ACTIVATIONS if a != "none"],
                   default="relu")
    p.add_argument("--split", choices=SPLITS, default="even",
                   help="rows per replica: even, weighted (by --split-weights) or auto (by "
                        "measured speed)")
    p.add_argument("--split-weights", default=None,
                   help="with --split weighted: comma-separated weights, one per replica")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", choices=data_mod.DATASETS, default="digits")
    p.add_argument("--data-dir", default=None, help="folder of the Fashion-MNIST IDX files")
    p.add_argument("--samples", type=_positive_int("--samples"), default=60000,
                   help="synthetic data set size")
    p.add_argument("--features", type=_positive_int("--features"), default=784)
    p.add_argument("--classes", type=_positive_int("--classes"), default=10)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _parser():
    parser = _Parser(prog="dpcuda", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    t = sub.add_parser("train", help="train the MLP data-parallel")
    _add_model_and_data(t, 10)
    t.add_argument("--replicas", type=_positive_int("--replicas"), default=None,
                   help="k replicas over the devices (default: one per device); on a "
                        "CPU-only machine this is how k devices are simulated")
    t.add_argument("--reducer", choices=REDUCERS, default="p2p")
    t.add_argument("--no-fused", action="store_true", help="plain torch.nn layers")
    t.add_argument("--checkpoint", default=None, help="save a checkpoint here every epoch")
    t.add_argument("--resume", default=None, help="continue from this checkpoint")
    t.add_argument("--json", default=None, help="write every figure of the run here")

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    s = bsub.add_parser("scaling", help="epoch time and accuracy for 1, 2, 4 replicas")
    _add_model_and_data(s, 2)
    s.set_defaults(dataset="synthetic", samples=16384)
    s.add_argument("--replicas", default="1,2,4")
    s.add_argument("--batches", default="256,512",
                   help="global batch sizes; lr scales linearly from --lr at the first")
    s.add_argument("--reducers", default="p2p,host")
    s.add_argument("--json", default="scaling.json")
    s.add_argument("--plot", default="scaling.png")
    # Each command reports its errors under its own name ("dpcuda train: error: ...").
    t.set_defaults(run=_train, command_parser=t)
    s.set_defaults(run=_bench_scaling, command_parser=s)
    return parser


def _devices(args, parser):
    names = args.devices.split(",") if args.devices else _default_devices()
    names = [n.strip() for n in names if n.strip()]
    from .parallel import _device
    try:
        return [str(_device(n, "--devices")) for n in names]
    except ValueError as err:
        parser.error(str(err))


def _replica_devices(devices, replicas):
    k = replicas or len(devices)
    return [devices[i % len(devices)] for i in range(k)]


def _split_weights(args, devices):
    if args.split != "weighted":
        if args.split_weights:
            raise ValueError("--split-weights needs --split weighted")
        return None
    if not args.split_weights:
        raise ValueError("--split weighted needs --split-weights, one number per replica")
    try:
        weights = [float(w) for w in args.split_weights.split(",")]
    except ValueError:
        raise ValueError(f"--split-weights must be comma-separated numbers, got "
                         f"{args.split_weights!r}") from None
    if len(weights) != len(devices):
        raise ValueError(f"--split-weights has {len(weights)} weights for {len(devices)} "
                         f"replicas")
    if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError("--split-weights must be non-negative numbers, not all zero")
    return weights


def _config(args, devices, **over):
    from .train import TrainConfig
    values = dict(devices=devices, batch_size=args.batch_size, lr=args.lr,
                  momentum=args.momentum, weight_decay=args.weight_decay, epochs=args.epochs,
                  hidden=args.hidden, activation=args.activation, split=args.split,
                  seed=args.seed, dataset=args.dataset, data_dir=args.data_dir,
                  samples=args.samples, features=args.features, classes=args.classes,
                  progress=not args.no_progress, split_weights=_split_weights(args, devices))
    values.update(over)
    return TrainConfig(**values)


def _env(devices):
    import platform
    dev = torch.device(devices[0])
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else \
        (platform.processor() or platform.machine())
    return {"device_name": name, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d"), "python": platform.python_version()}


def _print_table(history):
    print(f"{'epoch':>6}{'seconds':>10}{'samples/s':>12}{'train loss':>12}{'test acc':>10}")
    for r in history:
        print(f"{r['epoch']:>6}{r['seconds']:>10.2f}{r['samples_per_s']:>12.0f}"
              f"{r['train_loss']:>12.4f}{100 * r['test_accuracy']:>9.2f}%")


def _write_json(path, payload):
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)


def _init_dist(devices):
    import torch.distributed as dist
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError("--reducer dist needs torch.distributed's environment: start with "
                         "torchrun (e.g. torchrun --nproc-per-node 2 -m dpcuda train "
                         "--reducer dist)")
    backend = "nccl" if torch.device(devices[0]).type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def _train(args, parser):
    from .train import CheckpointError, Interrupted, train
    devices = _replica_devices(_devices(args, parser), args.replicas)
    if args.dataset == "fashion-mnist" and not args.data_dir:
        parser.error("--dataset fashion-mnist needs --data-dir")
    if args.resume and not os.path.isfile(args.resume):
        parser.error(f"--resume {args.resume}: no such file")
    try:
        cfg = _config(args, devices, reducer=args.reducer, fused=not args.no_fused,
                      checkpoint=args.checkpoint, resume=args.resume)
    except ValueError as err:
        parser.error(str(err))
    dist_info = None
    try:
        if args.reducer == "dist":
            if "LOCAL_RANK" in os.environ and torch.device(devices[0]).type == "cuda":
                local = int(os.environ["LOCAL_RANK"])
                cfg.devices = [f"cuda:{local}"] if not args.devices else cfg.devices
            dist_info = _init_dist(cfg.devices)
        dataset = data_mod.load(cfg.dataset, cfg.data_dir, cfg.samples, cfg.features,
                                cfg.classes, cfg.seed)
        lead = dist_info is None or dist_info[0] == 0
        if lead:
            print(f"dpcuda train: {dataset.name} ({dataset.x_train.shape[0]} train, "
                  f"{dataset.x_test.shape[0]} test, {dataset.features} features), MLP "
                  f"{dataset.features}-{cfg.hidden}-{dataset.classes} {cfg.activation}, "
                  f"{'fused' if cfg.fused else 'plain torch'} layers, "
                  f"{len(cfg.devices) * (dist_info[1] if dist_info else 1)} replicas on "
                  f"{','.join(cfg.devices)}, reducer {cfg.reducer}, batch {cfg.batch_size}, "
                  f"lr {cfg.lr}, momentum {cfg.momentum}", flush=True)
        result = train(cfg, dataset, dist_info)
    except (ValueError, CheckpointError, data_mod.DataError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    except Interrupted as stop:
        print(f"dpcuda train: {stop}", file=sys.stderr)
        if args.json:
            payload = dict(stop.result)
            payload.pop("data_parallel", None)
            _write_json(args.json, {"command": "train", **payload, "environment": _env(devices)})
        return 130
    result.pop("data_parallel")
    if dist_info is None or dist_info[0] == 0:
        print()
        _print_table(result["epochs"])
        fin = result["final"]
        if fin:
            print(f"final test accuracy {100 * fin['test_accuracy']:.2f}% after "
                  f"{fin['epochs']} epochs, {fin['total_seconds']:.2f} s of training, "
                  f"{fin['samples_per_s']:.0f} samples/s")
        if args.json:
            _write_json(args.json, {"command": "train", **result,
                                    "environment": _env(cfg.devices)})
            print(f"wrote {args.json}")
    return 0


def _bench_scaling(args, parser):
    from .train import train
    devices = _devices(args, parser)
    try:
        replica_counts = [int(r) for r in args.replicas.split(",")]
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error("--replicas and --batches take comma-separated integers")
    reducers = [r.strip() for r in args.reducers.split(",")]
    for r in reducers:
        if r not in ("p2p", "host"):
            parser.error(f"--reducers: {r!r} is not one of p2p, host (dist runs under torchrun: "
                         f"python -m dpcuda train --reducer dist)")
    try:
        dataset = data_mod.load(args.dataset, args.data_dir, args.samples, args.features,
                                args.classes, args.seed)
    except data_mod.DataError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    rows = []
    print(f"scaling: {dataset.name}, {dataset.x_train.shape[0]} train samples, "
          f"{args.epochs} epochs per run, devices {','.join(devices)}")
    print(f"{'batch':>6}{'lr':>6}{'reducer':>8}{'layers':>7}{'replicas':>9}{'s/epoch':>9}"
          f"{'test acc':>10}")
    for batch in batches:
        lr = args.lr * batch / batches[0]
        for reducer in reducers:
            for fused in (True, False):
                for k in replica_counts:
                    try:
                        cfg = _config(args, _replica_devices(devices, k), batch_size=batch,
                                      lr=lr, reducer=reducer, fused=fused, log=False)
                        result = train(cfg, dataset)
                    except ValueError as err:
                        parser.exit(2, f"{parser.prog}: error: {err}\n")
                    epochs = result["epochs"]
                    timed = epochs[1:] if len(epochs) > 1 else epochs  # the first one warms up
                    sec = sum(e["seconds"] for e in timed) / len(timed)
                    row = {"batch": batch, "lr": lr, "reducer": reducer,
                           "layers": "fused" if fused else "plain", "replicas": k,
                           "epoch_seconds": sec, "test_accuracy": epochs[-1]["test_accuracy"],
                           "samples_per_s": epochs[-1]["samples_per_s"]}
                    rows.append(row)
                    print(f"{batch:>6}{lr:>6.2f}{reducer:>8}{row['layers']:>7}{k:>9}"
                          f"{sec:>9.3f}{100 * row['test_accuracy']:>9.2f}%", flush=True)
    payload = {"command": "bench scaling", "dataset": dataset.name,
               "train_samples": dataset.x_train.shape[0], "epochs": args.epochs,
               "devices": devices, "environment": _env(devices), "results": rows}
    if args.json:
        _write_json(args.json, payload)
        print(f"wrote {args.json}")
    if args.plot:
        _plot(rows, args.plot, f"{dataset.name}, {_env(devices)['device_name']}")
        print(f"wrote {args.plot}")
    return 0


def _plot(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_a) = plt.subplots(1, 2, figsize=(11, 4.2))
    keys = sorted({(r["batch"], r["reducer"], r["layers"]) for r in rows})
    for batch, reducer, layers in keys:
        sel = sorted((r for r in rows if (r["batch"], r["reducer"], r["layers"]) ==
                      (batch, reducer, layers)), key=lambda r: r["replicas"])
        label = f"b{batch} {reducer} {layers}"
        style = "-" if layers == "fused" else "--"
        ax_t.plot([r["replicas"] for r in sel], [r["epoch_seconds"] for r in sel], style,
                  marker="o", label=label)
        ax_a.plot([r["replicas"] for r in sel], [100 * r["test_accuracy"] for r in sel], style,
                  marker="o", label=label)
    ax_t.set_xlabel("replicas")
    ax_t.set_ylabel("seconds per epoch")
    ax_a.set_xlabel("replicas")
    ax_a.set_ylabel("test accuracy (%)")
    for ax in (ax_t, ax_a):
        ax.set_xticks(sorted({r["replicas"] for r in rows}))
        ax.grid(alpha=0.3)
    ax_a.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)
    return args.run(args, args.command_parser)


if __name__ == "__main__":
    sys.exit(main())
