"""The command line: `python -m dpcuda train` (also the `dpcuda` console script), `eval` and
`predict`. It parses and renders; the work is the library's (dpcuda.train, dpcuda.data,
dpcuda.checkpoint, dpcuda.distributed). The scaling benchmark is benchmarks/bench_scaling.py.

    python -m dpcuda train                         the digits MLP, 10 epochs, every GPU or the CPU
    python -m dpcuda train --replicas 4 --reducer host --json run.json --checkpoint ck.pt
    python -m dpcuda eval --checkpoint ck.pt       test-split loss and accuracy
    python -m dpcuda train --data mine.csv --hidden 256,128 --checkpoint ck.pt
    python -m dpcuda predict --checkpoint ck.pt --input x.npy --output y.npy

Bad options and paths exit with status 2 and a one-line message, before any training; Ctrl-C
and SIGTERM save the state reached (with --checkpoint) and exit with status 130 and 143; a
diverged run, a failed write or a lost peer process exit with status 1 and one line.
"""

import argparse
import math
import os
import sys
import time

import torch

from . import data as data_mod
from .checkpoint import write_json
from .distributed import first_line as _first_line
from .parallel import REDUCERS, SPLITS
from .reference import ACTIVATIONS
from .train_step import OPTIMIZERS, SCHEDULES

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `dpcuda train: error: ...`, exit status 2."""

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
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value <= 0 or value > 1e7:
        raise argparse.ArgumentTypeError(f"--timeout must be a positive number of seconds (at "
                                         f"most 1e7), got {text!r}")
    return value


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
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be a number between 0 and 1, got {text!r}")
    return value


def _non_negative_int(name):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = -1
        if value < 0:
            raise argparse.ArgumentTypeError(f"{name} must be a non-negative integer, got "
                                             f"{text!r}")
        return value
    return parse


def _positive_float(name):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be a positive finite number, got "
                                             f"{text!r}")
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


def _add_data(p):
    p.add_argument("--seed", type=_seed, default=0,
                   help="initial weights, data order (and the synthetic data)")
    p.add_argument("--dataset", choices=data_mod.DATASETS, default=None,
                   help="a built-in data set (default: digits; --data: your own)")
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
        args.dataset = args.dataset or "digits"
    if args.test_data is not None and args.test_fraction is not None:
        parser.error("--test-data and --test-fraction: give one (--test-data is the test "
                     "split; --test-fraction holds out part of --data)")
    if args.test_fraction is None:
        args.test_fraction = 0.2
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
                   default="relu", help="activation of the hidden layer")
    p.add_argument("--split", choices=SPLITS, default="even",
                   help="rows per replica: even, weighted (by --split-weights) or auto (by "
                        "measured speed)")
    p.add_argument("--split-weights", default=None,
                   help="with --split weighted: comma-separated weights, one per replica")
    _add_data(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _parser():
    from . import __version__
    parser = _Parser(prog="dpcuda", description=__doc__, formatter_class=_Formatter)
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
    t.set_defaults(run=_train, command_parser=t)
    e.set_defaults(run=_eval, command_parser=e)
    pr.set_defaults(run=_predict, command_parser=pr)
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
    """Refuses two options naming the same file (one output would destroy the other file)."""
    seen = {}
    for option, path in named:
        if not path:
            continue
        key = os.path.realpath(path)
        if key in seen:
            parser.error(f"{option} and {seen[key]} name the same file {path}")
        seen[key] = option


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


def _optimizer_text(cfg):
    """The run's update, for the announcement line."""
    from .train_step import uses_optimizer
    if not uses_optimizer(cfg):
        return f"SGD lr {cfg.lr} momentum {cfg.momentum} (fused into the reduction)"
    text = f"dpcuda.optim {dict(sgd='SGD', adam='Adam', adamw='AdamW')[cfg.optimizer]} lr {cfg.lr}"
    if cfg.optimizer == "sgd":
        text += f" momentum {cfg.momentum}"
    text += f", {cfg.lr_schedule} schedule"
    if cfg.warmup_steps:
        text += f" after {cfg.warmup_steps} warm-up steps"
    if cfg.clip_grad_norm is not None:
        text += f", clip {cfg.clip_grad_norm}"
    if cfg.accumulate > 1:
        text += f", {cfg.accumulate} micro-batches"
    return text


def _env(devices):
    import platform
    dev = torch.device(devices[0])
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else \
        (platform.processor() or platform.machine())
    return {"device_name": name, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d"), "python": platform.python_version()}


def _replicas_text(devices, processes=1):
    k = len(devices) * processes
    names = sorted(set(devices), key=devices.index)
    where = ",".join(names) if len(names) <= 8 else f"{','.join(names[:8])},..."
    return f"{k} replica{'s' if k != 1 else ''} on {where}"


def _train(args, parser):
    from . import distributed
    from .checkpoint import (CheckpointError, OutputError, WriteError, check_output_path,
                             describe, lock_checkpoint)
    from .train import Diverged, Interrupted, _model_spec, load_data, train
    _data_args(args, parser)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1 and args.reducer != "dist":
        parser.error(f"running under torchrun (WORLD_SIZE={world}) needs --reducer dist; "
                     f"without it every process would train its own copy and write the same "
                     f"files")
    if args.shard_optimizer == "on" and args.reducer != "dist":
        parser.error("--shard-optimizer on shards the optimizer state over processes: it needs "
                     "--reducer dist (within one process the fused step shards it by itself)")
    devices = _replica_devices(_devices(args, parser), args.replicas, parser)
    _distinct_paths(parser, ("--checkpoint", args.checkpoint), ("--json", args.json))
    if args.resume and args.resume != "auto":
        _distinct_paths(parser, ("--resume", args.resume), ("--json", args.json))
    if args.dataset == "fashion-mnist" and not args.data_dir:
        parser.error("--dataset fashion-mnist needs --data-dir")
    if args.resume == "auto":
        if not args.checkpoint:
            parser.error("--resume auto needs --checkpoint (it resumes that file if it exists)")
        args.resume = args.checkpoint if os.path.isfile(args.checkpoint) else None
    elif args.resume and not os.path.isfile(args.resume):
        parser.error(f"--resume {args.resume}: no such file")
    if args.checkpoint and os.path.isfile(args.checkpoint) and not args.overwrite and not (
            args.resume and os.path.samefile(args.resume, args.checkpoint)):
        parser.error(f"--checkpoint {args.checkpoint} exists (another run's?); --resume "
                     f"{args.checkpoint} continues it, --overwrite replaces it")
    lead_process = int(os.environ.get("RANK", "0") or 0) == 0
    if args.checkpoint and lead_process:
        try:
            lock_checkpoint(args.checkpoint)
        except OutputError as err:
            parser.error(str(err))
    try:
        if args.json and lead_process:
            check_output_path(args.json, "--json")
        cfg = _config(args, devices, reducer=args.reducer, fused=not args.no_fused,
                      optimizer=args.optimizer, lr_schedule=args.lr_schedule,
                      warmup_steps=args.warmup_steps, clip_grad_norm=args.clip_grad_norm,
                      accumulate=args.accumulate, shard_optimizer=args.shard_optimizer,
                      checkpoint=args.checkpoint, resume=args.resume,
                      max_bad_steps=args.max_bad_steps, timeout=args.timeout)
    except ValueError as err:
        parser.error(str(err))
    dist_info, heartbeat, finished = None, None, False

    def save_json(result):
        if args.json and (dist_info is None or dist_info[0] == 0):
            payload = dict(result)
            payload.pop("data_parallel", None)
            write_json(args.json, {"command": "train", **payload,
                                    "environment": _env(cfg.devices)})
            return True
        return False

    try:
        if args.reducer == "dist":
            if "LOCAL_RANK" in os.environ and torch.device(devices[0]).type == "cuda":
                local = int(os.environ["LOCAL_RANK"])
                cfg.devices = [f"cuda:{local}"] if not args.devices else cfg.devices
            dist_info = distributed.init_process_group(cfg.devices, args.timeout)
            if dist_info[0] == 0 and distributed.shared_store_warning():
                print(distributed.shared_store_warning(), file=sys.stderr)
            heartbeat = distributed.Heartbeat.start(*dist_info, args.timeout)
        dataset = load_data(cfg)
        lead = dist_info is None or dist_info[0] == 0

        def announce():  # once every check has passed, before the first step
            if lead:
                print(f"dpcuda train: {dataset.name} ({dataset.x_train.shape[0]} train, "
                      f"{dataset.x_test.shape[0]} test, {dataset.features} features), MLP "
                      f"{describe(_model_spec(cfg, dataset))} {cfg.activation}, "
                      f"{'fused' if cfg.fused else 'plain torch'} layers, "
                      f"{_replicas_text(cfg.devices, dist_info[1] if dist_info else 1)}, "
                      f"reducer {cfg.reducer}, batch {cfg.batch_size}, {_optimizer_text(cfg)}",
                      flush=True)

        result = train(cfg, dataset, dist_info, announce=announce)
        finished = True
    except (ValueError, CheckpointError, OutputError, data_mod.DataError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    except Interrupted as stop:
        print(f"dpcuda train: {stop}", file=sys.stderr)
        try:
            save_json({**stop.result, "final": None})
        except WriteError as err:
            print(f"dpcuda train: error: {err}", file=sys.stderr)
        return 128 + int(stop.signum)
    except Diverged as err:
        try:
            save_json({**err.result, "final": None})
        except WriteError:
            pass
        parser.exit(1, f"{parser.prog}: error: {err}\n")
    except (WriteError, distributed.JoinError) as err:
        parser.exit(1, f"{parser.prog}: error: {err}\n")
    except Exception as err:
        if _is_out_of_memory(err):
            parser.exit(1, f"{parser.prog}: error: out of memory (a smaller --hidden, "
                           f"--samples, --features or --batch-size?): {_first_line(err)}\n")
        if dist_info is None or not distributed.is_dist_failure(err):
            raise
        reason = str(err).strip().splitlines()[0][:160] if str(err).strip() else \
            type(err).__name__
        kept = f"; the last checkpoint {cfg.checkpoint} is intact" if cfg.checkpoint else ""
        silent = heartbeat.silent_ranks() if heartbeat is not None else []
        who = (f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} stopped "
               f"or died (no heartbeat)" if silent else
               f"lost another process (stopped, dead or silent for {args.timeout:g} s)")
        parser.exit(1, f"{parser.prog}: error: rank {dist_info[0]}: {who}: {reason}{kept}\n")
    finally:
        if dist_info is not None:
            distributed.shutdown(heartbeat, finished)
    result.pop("data_parallel")
    if dist_info is None or dist_info[0] == 0:
        # (the epochs' lines were printed as they ended; the summary does not repeat them)
        fin = result["final"]
        if fin:
            print(f"final test accuracy {100 * fin['test_accuracy']:.2f}% after "
                  f"{fin['epochs']} epochs, {fin['total_seconds']:.2f} s of training, "
                  f"{fin['samples_per_s']:.0f} samples/s")
        try:
            if save_json(result):
                print(f"wrote {args.json}")
        except WriteError as err:
            parser.exit(1, f"{parser.prog}: error: {err}\n")
    return 0


def _is_out_of_memory(err):
    if isinstance(err, MemoryError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("out of memory" in text or
                                              "not enough memory" in text or
                                              "defaultcpuallocator" in text)


def _load_model_for(args, parser):
    from .checkpoint import CheckpointError, load_checkpoint_model
    from .parallel import _device
    try:
        device = _device(args.device, "--device")
        return load_checkpoint_model(args.checkpoint, device), device
    except (CheckpointError, ValueError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")


def _model_sizes(model):
    inner = model.model if hasattr(model, "mean") else model
    return inner.layers[0].weight.shape[1], inner.layers[-1].weight.shape[0]


def _eval(args, parser):
    from .checkpoint import load_checkpoint
    from .train import evaluate
    _distinct_paths(parser, ("--checkpoint", args.checkpoint), ("--json", args.json))
    model, device = _load_model_for(args, parser)
    cfg = load_checkpoint(args.checkpoint, option="--checkpoint").get("config") or {}
    if args.data is not None and args.dataset is not None:
        parser.error(f"--data and --dataset {args.dataset}: give one")
    try:
        if args.data is not None:
            # Raw features, as the file holds them: the checkpoint's model standardises them
            # as it did its training data.
            name = f"{os.path.basename(args.data)}"
            x, y = data_mod.read_table(args.data, "--data",
                                       label_column=args.label_column or
                                       cfg.get("label_column"))
        else:
            name = args.dataset or cfg.get("dataset", "digits")
            dataset = data_mod.load(
                name, args.data_dir or cfg.get("data_dir"), cfg.get("samples", 60000),
                cfg.get("features", 784), cfg.get("classes", 10), cfg.get("seed", 0),
                data=cfg.get("data") if name == data_mod.FILE else None,
                test_data=cfg.get("test_data"), test_fraction=cfg.get("test_fraction", 0.2),
                label_column=cfg.get("label_column"))
            name = f"{dataset.name} test split"
            # The data set's features are standardised already: the checkpoint's network
            # without its own standardisation (which takes raw features) scores them as
            # training did.
            model = getattr(model, "model", model)
            x, y = dataset.x_test, dataset.y_test
    except data_mod.DataError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    features, classes = _model_sizes(model)
    if x.shape[1] != features or int(y.max()) >= classes:
        parser.exit(2, f"{parser.prog}: error: {name} has {x.shape[1]} features and labels up "
                       f"to {int(y.max())}, the checkpoint's model takes {features} features "
                       f"and has {classes} classes\n")
    result = evaluate(model, x, y, device)
    loss, accuracy = result["loss"], result["accuracy"]
    print(f"{name}: {x.shape[0]} samples, loss {loss:.4f}, accuracy "
          f"{100 * accuracy:.2f}%")
    if args.json:
        try:
            write_json(args.json, {"command": "eval", "checkpoint": args.checkpoint,
                                    "dataset": name, "samples": x.shape[0], "loss": loss,
                                    "accuracy": accuracy})
        except OSError as err:
            parser.exit(1, f"{parser.prog}: error: {err}\n")
    return 0


def _predict(args, parser):
    import numpy as np
    from .checkpoint import load_checkpoint
    model, device = _load_model_for(args, parser)
    _distinct_paths(parser, ("--checkpoint", args.checkpoint), ("--input", args.input),
                    ("--output", args.output))
    cfg = load_checkpoint(args.checkpoint, option="--checkpoint").get("config") or {}
    try:  # the kinds of file --data reads; a CSV's label column, if it has one, is left out
        xt, _ = data_mod.read_table(args.input, "--input", labels=False,
                                    label_column=cfg.get("label_column"))
    except data_mod.DataError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    features, _ = _model_sizes(model)
    if xt.shape == (features, 1) and features > 1:  # one row, given as a vector
        xt = xt.reshape(1, features)
    if xt.shape[1] != features:
        parser.exit(2, f"{parser.prog}: error: --input {args.input}: {xt.shape[1]} features per "
                       f"row, the checkpoint's model takes {features}\n")
    from .checkpoint import WriteError, atomic_write, check_output_path
    try:
        check_output_path(args.output, "--output")
    except ValueError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    with torch.no_grad():
        classes = torch.cat([model(xt[i:i + 4096].to(device)).argmax(1).cpu()
                             for i in range(0, xt.shape[0], 4096)]) if len(xt) else \
            torch.zeros(0, dtype=torch.int64)
    predicted = classes.numpy().astype(np.int64)
    try:
        atomic_write(args.output, lambda f: np.save(f, predicted), "predictions")
    except WriteError as err:
        parser.exit(1, f"{parser.prog}: error: {err}\n")
    print(f"wrote {args.output}: {classes.shape[0]} predictions")
    return 0


def main(argv=None):
    """Runs the command line on argv (default: sys.argv[1:]); returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args, args.command_parser)
    except KeyboardInterrupt:  # before the training loop's own handler, or a second Ctrl-C
        print(f"{args.command_parser.prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
