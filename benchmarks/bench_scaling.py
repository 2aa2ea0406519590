"""Scaling: epoch time and test accuracy of the training command's run for 1, 2 and 4 replicas
(or --replicas), fused and plain layers, each reducer and global batch; a JSON of every run and a
plot. Each run is dpcuda.train.train() on the same data; the first epoch of a run warms up and is
not timed (where a run has more than one). Its options and their checks are the command line's
(dpcuda.cli_options), so a bad option is one line and exit status 2, as there.

    python benchmarks/bench_scaling.py --samples 32768 --epochs 3 --json scaling.json \
        --plot scaling.png
"""

import os
import sys

from dpcuda import data as data_mod
from dpcuda.checkpoint import OutputError, WriteError, check_output_path, write_json
from dpcuda.cli import _env
from dpcuda.cli_options import (_add_data, _config, _data_args, _devices, _distinct_paths,
                                _Formatter, _momentum, _non_negative_float, _Parser,
                                _positive_int, _replica_devices)
from dpcuda.parallel import SPLITS
from dpcuda.reference import ACTIVATIONS
from dpcuda.train import train


def parser():
    s = _Parser(prog="bench_scaling", description=__doc__, formatter_class=_Formatter)
    s.add_argument("--devices", default=None,
                   help="comma-separated devices (default: every GPU, else the CPU)")
    s.add_argument("--lr", type=_non_negative_float("--lr"), default=0.2,
                   help="learning rate at the first --batches entry")
    s.add_argument("--momentum", type=_momentum, default=0.9)
    s.add_argument("--weight-decay", type=_non_negative_float("--weight-decay"), default=0.0)
    s.add_argument("--epochs", type=_positive_int("--epochs"), default=2)
    s.add_argument("--hidden", type=_positive_int("--hidden"), default=256)
    s.add_argument("--activation", choices=[a for a in ACTIVATIONS if a != "none"],
                   default="relu")
    s.add_argument("--split", choices=SPLITS, default="even")
    s.add_argument("--split-weights", default=None)
    _add_data(s, files=False, default="synthetic")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.add_argument("--replicas", default="1,2,4")
    s.add_argument("--batches", default="256,512",
                   help="global batch sizes; lr scales linearly from --lr at the first")
    s.add_argument("--reducers", default="p2p,host")
    s.add_argument("--json", default="scaling.json")
    s.add_argument("--plot", default="scaling.png")
    return s


def run(args, parser):
    samples_given = args.samples is not None
    _data_args(args, parser)
    if args.dataset == "synthetic" and not samples_given:
        args.samples = 16384
    devices = _devices(args, parser)
    try:
        replica_counts = [int(r) for r in args.replicas.split(",")]
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error("--replicas and --batches take comma-separated integers")
    if min(replica_counts) < 1 or min(batches) < 1:
        parser.error("--replicas and --batches take positive integers")
    _distinct_paths(parser, ("--json", args.json), ("--plot", args.plot))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        kinds = plt.figure().canvas.get_supported_filetypes()
        plt.close("all")
        ext = os.path.splitext(args.plot)[1].lstrip(".").lower()
        if ext not in kinds:
            parser.error(f"--plot {args.plot}: unknown image type {ext!r}; use one of "
                         f"{', '.join(sorted(kinds))}")
    try:
        for path, option in ((args.json, "--json"), (args.plot, "--plot")):
            if path:
                check_output_path(path, option)
    except OutputError as err:
        parser.error(str(err))
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
    # Every run's configuration is checked before the first one starts.
    n_train = dataset.x_train.shape[0]
    for batch in batches:
        for k in replica_counts:
            try:
                _config(args, _replica_devices(devices, k), batch_size=batch, lr=args.lr)
            except ValueError as err:
                parser.error(str(err))
            if k > n_train or batch < k:
                parser.error(f"--replicas {k} with --batches {batch}: every replica needs a row "
                             f"of each batch ({n_train} training samples)")
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
    payload = {"command": "bench_scaling", "dataset": dataset.name,
               "train_samples": dataset.x_train.shape[0], "epochs": args.epochs,
               "devices": devices, "environment": _env(devices), "results": rows}
    if args.json:
        try:
            write_json(args.json, payload)
        except WriteError as err:
            parser.exit(1, f"{parser.prog}: error: {err}\n")
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
    p = parser()
    return run(p.parse_args(argv), p)


if __name__ == "__main__":
    sys.exit(main())
