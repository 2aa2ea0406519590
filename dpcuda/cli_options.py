"""The command line's options (dpcuda.cli): the parser (one-line errors, every default in
--help), the options' types and checks, and their translation into a TrainConfig. Everything
here runs before any training, so a bad option costs nothing but its one line and exit status
2. benchmarks/bench_scaling.py takes its options from here too.
"""

import argparse
import math
import os

import torch

from . import data as data_mod
from .parallel import REDUCERS, SPLITS
from .reference import ACTIVATIONS
from .train_step import OPTIMIZERS, SCHEDULES


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `dpcuda train: error: ...`, exit status 2; an option
    is spelled out (no prefixes: --data is not --dataset)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default in --help (those that
    have one)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.help is None:
            return action.help
        return super()._get_help_string(action)


def _momentum(text):
    value = _non_negative_float("--momentum")(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"--momentum must be in [0, 1), got {text!r}")
    return value


def _timeout(text):
    return _number("--timeout", float, "a positive number of seconds (at most 1e7)", 0.0, 1e7,
                   above=True)(text)


def _seed(text):
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2 ** 63:
        raise argparse.ArgumentTypeError(f"--seed must be an integer in [0, 2**63), got {text!r}")
    return value


def _path(option):
    def parse(text):
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{option} must name a file, got an empty string")
        return text
    return parse


def _number(name, kind, what, low, high=math.inf, above=False, below=False):
    """An option's parser: a finite `kind` (int or float) in [low, high] (above: > low;
    below: < high); else "NAME must be WHAT, got 'TEXT'" ("a number" for a float option given
    text that is none)."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            if kind is float:
                raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}")
            value = None
        if value is None or not math.isfinite(value) or not low <= value <= high or \
                (above and value == low) or (below and value == high):
            raise argparse.ArgumentTypeError(f"{name} must be {what}, got {text!r}")
        return value
    return parse


def _positive_int(name):
    return _number(name, int, "a positive integer", 0, above=True)


def _non_negative_int(name):
    return _number(name, int, "a non-negative integer", 0)


def _positive_float(name):
    return _number(name, float, "a positive finite number", 0.0, above=True)


def _non_negative_float(name):
    return _number(name, float, "a non-negative finite number", 0.0)


def _widths(text):
    parts = text.split(",")
    try:
        values = [int(v) for v in parts]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"--hidden must be comma-separated positive integers "
                                         f"(the hidden layers' widths), got {text!r}")
    return values


def _fraction(text):
    return _number("--test-fraction", float, "a number between 0 and 1", 0.0, 1.0, above=True,
                   below=True)(text)


def _default_devices():
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        from . import cuda_available
        if cuda_available():
            return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu"]


def _add_data(p, files=True, default="digits"):
    """The data options; files: --data and its companions (the training command's)."""
    p.add_argument("--seed", type=_seed, default=0,
                   help="initial weights, data order (and the synthetic data)")
    p.add_argument("--dataset", choices=data_mod.DATASETS, default=None,
                   help=f"a built-in data set (default: {default}"
                        f"{'; --data: your own' if files else ''})")
    p.set_defaults(default_dataset=default, data=None, test_data=None, test_fraction=None,
                   label_column=None)
    if not files:
        p.add_argument("--data-dir", default=None, help="folder of the Fashion-MNIST IDX files")
        _add_synthetic(p)
        return
    p.add_argument("--data", type=_path("--data"), default=None,
                   help="your own data: an .npz with arrays x and y, X.npy,Y.npy, or a CSV "
                        "with a label column (numbers, a header line optional)")
    p.add_argument("--test-data", type=_path("--test-data"), default=None,
                   help="--data's test split, in the same kinds of file (default: hold out "
                        "--test-fraction of --data's rows)")
    p.add_argument("--test-fraction", type=_fraction, default=None,
                   help="--data's rows held out for the test split, a fixed draw (default 0.2)")
    p.add_argument("--label-column", default=None,
                   help="a CSV's label column, a header name or a 0-based index (default: "
                        "a column named label, labels, y, target or class, else the last)")
    p.add_argument("--data-dir", default=None, help="folder of the Fashion-MNIST IDX files")
    _add_synthetic(p)


def _add_synthetic(p):
    p.add_argument("--samples", type=_positive_int("--samples"), default=None,
                   help="synthetic data set size (default 60000)")
    p.add_argument("--features", type=_positive_int("--features"), default=None,
                   help="synthetic data set features (default 784)")
    p.add_argument("--classes", type=_positive_int("--classes"), default=None,
                   help="synthetic data set classes (default 10)")


def _data_args(args, parser):
    """--samples, --features and --classes: the synthetic data set's; --test-data,
    --test-fraction and --label-column: --data's; an error elsewhere. --data names the data
    set "file"."""
    if args.data is not None:
        if args.dataset is not None:
            parser.error(f"--data and --dataset {args.dataset}: give one (--data is your own "
                         f"data, --dataset a built-in set)")
        args.dataset = data_mod.FILE
    else:
        for option in ("test_data", "test_fraction", "label_column"):
            if getattr(args, option) is not None:
                parser.error(f"--{option.replace('_', '-')} applies to --data")
        args.dataset = args.dataset or args.default_dataset
    if args.test_data is not None and args.test_fraction is not None:
        parser.error("--test-data and --test-fraction: give one (--test-data is the test "
                     "split; --test-fraction holds out part of --data)")
    if args.test_fraction is None:
        args.test_fraction = 0.2
    # The user's files by their real paths: a resume or an eval from another folder, or with
    # the path spelled otherwise, finds the same files.
    for key in ("data", "test_data"):
        spec = getattr(args, key)
        if spec is not None:
            setattr(args, key, ",".join(os.path.realpath(p) for p in data_mod.paths(spec)))
    given = [f"--{k}" for k in ("samples", "features", "classes") if getattr(args, k) is not None]
    if given and args.dataset != "synthetic":
        parser.error(f"{', '.join(given)} only apply to --dataset synthetic, not {args.dataset}")
    for key, default in (("samples", 60000), ("features", 784), ("classes", 10)):
        if getattr(args, key) is None:
            setattr(args, key, default)


def _add_model_and_data(p, epochs_default):
    p.add_argument("--devices", default=None,
                   help="comma-separated devices, e.g. cuda:0,cuda:1 (default: every GPU, "
                        "else the CPU)")
    p.add_argument("--batch-size", type=_positive_int("--batch-size"), default=256,
                   help="global batch, split over the replicas")
    p.add_argument("--lr", type=_non_negative_float("--lr"), default=0.2, help="learning rate")
    p.add_argument("--momentum", type=_momentum, default=0.9, help="SGD momentum")
    p.add_argument("--weight-decay", type=_non_negative_float("--weight-decay"), default=0.0,
                   help="weight decay (SGD and Adam: L2, added to the gradient; AdamW: "
                        "decoupled; note torch's AdamW defaults to 0.01)")
    p.add_argument("--epochs", type=_positive_int("--epochs"), default=epochs_default,
                   help="passes over the training split")
    p.add_argument("--hidden", type=_widths, default="256",
                   help="comma-separated widths of the hidden layers, e.g. 256,128")
    p.add_argument("--activation", choices=[a for a in ACTIVATIONS if a != "none"],
                   default="relu", help="activation of the hidden layers")
    p.add_argument("--split", choices=SPLITS, default="even",
                   help="rows per replica: even, weighted (by --split-weights) or auto (by "
                        "measured speed)")
    p.add_argument("--split-weights", default=None,
                   help="with --split weighted: comma-separated weights, one per replica")
    _add_data(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _parser(description=None):
    from . import __version__
    parser = _Parser(prog="dpcuda", description=description, formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"dpcuda {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    t = sub.add_parser("train", help="train the MLP data-parallel", formatter_class=_Formatter)
    _add_model_and_data(t, 10)
    t.add_argument("--replicas", type=_positive_int("--replicas"), default=None,
                   help="k replicas over the devices (default: one per device); on a "
                        "CPU-only machine this is how k devices are simulated")
    t.add_argument("--reducer", choices=REDUCERS, default="p2p",
                   help="dist: across processes with torch.distributed, under torchrun")
    t.add_argument("--shard-optimizer", choices=("auto", "on", "off"), default="auto",
                   help="--reducer dist with --optimizer adam/adamw (or SGD options): keep the "
                        "optimizer state sharded over the processes (ZeRO-1); auto: with NCCL "
                        "on, with gloo off (slower there)")
    t.add_argument("--no-fused", action="store_true", help="plain torch.nn layers")
    t.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                   help="sgd: with nothing below, DataParallel's SGD fused into the reduction; "
                        "otherwise dpcuda.optim's SGD, Adam or AdamW (--momentum is SGD's)")
    t.add_argument("--lr-schedule", choices=SCHEDULES, default="constant",
                   help="learning rate over the run: constant, cosine (to 0) or onecycle (peak "
                        "--lr)")
    t.add_argument("--warmup-steps", type=_non_negative_int("--warmup-steps"), default=0,
                   help="optimizer steps of linear warm-up to --lr")
    t.add_argument("--clip-grad-norm", type=_positive_float("--clip-grad-norm"), default=None,
                   help="clip the gradients' global 2-norm to this (clip_grad_norm_)")
    t.add_argument("--accumulate", type=_positive_int("--accumulate"), default=1,
                   help="micro-batches per global batch (gradient accumulation)")
    t.add_argument("--checkpoint", type=_path("--checkpoint"), default=None,
                   help="save a checkpoint here every epoch (and on Ctrl-C or SIGTERM)")
    t.add_argument("--resume", type=_path("--resume"), default=None,
                   help="continue from this checkpoint; 'auto': from --checkpoint if it exists "
                        "(for restarted jobs)")
    t.add_argument("--overwrite", action="store_true",
                   help="replace an existing --checkpoint file without resuming it")
    t.add_argument("--json", type=_path("--json"), default=None,
                   help="write every figure of the run here")
    t.add_argument("--max-bad-steps", type=_positive_int("--max-bad-steps"), default=5,
                   help="stop after this many consecutive steps with NaN or Inf gradients")
    t.add_argument("--timeout", type=_timeout, default=300.0,
                   help="seconds a wait on another process (--reducer dist) may take")

    e = sub.add_parser("eval", help="test-split loss and accuracy of a checkpoint",
                       formatter_class=_Formatter)
    e.add_argument("--checkpoint", type=_path("--checkpoint"), required=True)
    e.add_argument("--device", default="cpu")
    e.add_argument("--data-dir", default=None, help="folder of the Fashion-MNIST IDX files")
    e.add_argument("--dataset", choices=data_mod.DATASETS, default=None,
                   help="a built-in data set's test split (default: the checkpoint's data)")
    e.add_argument("--data", type=_path("--data"), default=None,
                   help="a file whose every row is scored, in the kinds of file train's --data "
                        "reads (default: the checkpoint's test split)")
    e.add_argument("--label-column", default=None,
                   help="with --data: a CSV's label column (default: the checkpoint's, else "
                        "as train's --data)")
    e.add_argument("--json", type=_path("--json"), default=None)

    pr = sub.add_parser("predict", help="class predictions of a checkpoint's model",
                        formatter_class=_Formatter)
    pr.add_argument("--checkpoint", type=_path("--checkpoint"), required=True)
    pr.add_argument("--input", type=_path("--input"), required=True,
                    help="raw features, (rows, features), as the data set gives them "
                         "(digits: load_digits().data, pixels 0-16): a .npy, an .npz with "
                         "array x, or a CSV (a label column, as train's --data finds it, is "
                         "left out)")
    pr.add_argument("--output", type=_path("--output"), required=True,
                    help=".npy file for the int64 classes, (rows,)")
    pr.add_argument("--device", default="cpu")

    # Each command reports its errors under its own name ("dpcuda train: error: ...").
    for command in (t, e, pr):
        command.set_defaults(command_parser=command)
    return parser


def _devices(args, parser):
    names = args.devices.split(",") if args.devices is not None else _default_devices()
    names = [n.strip() for n in names if n.strip()]
    if not names:
        parser.error("--devices names no device")
    from .parallel import _device
    try:
        devices = [_device(n, "--devices") for n in names]
    except ValueError as err:
        parser.error(str(err))
    for name, device in zip(names, devices):
        if device.type == "cpu" and device.index not in (None, 0):
            parser.error(f"--devices: {name!r} does not exist; the CPU is 'cpu' (for k "
                         f"replicas on it use --replicas k)")
    return [str(d) for d in devices]


def _replica_devices(devices, replicas, parser=None):
    from .parallel import MAX_REPLICAS
    k = replicas or len(devices)
    if k > MAX_REPLICAS:
        message = f"{k} replicas; at most {MAX_REPLICAS} are supported"
        if parser is None:
            raise ValueError(message)
        parser.error(message)
    return [devices[i % len(devices)] for i in range(k)]


def _distinct_paths(parser, *named):
    """Refuses two options naming the same file (one output would destroy the other file). A
    data option's spec counts each of its files (an X.npy,Y.npy pair is two)."""
    named = [(option, p) for option, path in named if path
             for p in (data_mod.paths(path) if option in _DATA_OPTIONS else [path])]
    seen = {}
    for option, path in named:
        if not path:
            continue
        key = os.path.realpath(path)
        if key in seen:
            parser.error(f"{option} and {seen[key]} name the same file {path}")
        seen[key] = option


_DATA_OPTIONS = ("--data", "--test-data", "--input")


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
    if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0 or \
            not math.isfinite(sum(weights)):
        raise ValueError("--split-weights must be non-negative finite numbers, not all zero, "
                         "with a finite sum")
    return weights


def _config(args, devices, **over):
    from .train import TrainConfig
    values = dict(devices=devices, batch_size=getattr(args, "batch_size", 256), lr=args.lr,
                  momentum=args.momentum, weight_decay=args.weight_decay, epochs=args.epochs,
                  hidden=args.hidden, activation=args.activation, split=args.split,
                  seed=args.seed, dataset=args.dataset, data_dir=args.data_dir,
                  samples=args.samples, features=args.features, classes=args.classes,
                  data=args.data, test_data=args.test_data, test_fraction=args.test_fraction,
                  label_column=args.label_column,
                  progress=not args.no_progress, split_weights=_split_weights(args, devices))
    values.update(over)
    return TrainConfig(**values)
