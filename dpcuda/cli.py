"""The command line: `python -m dpcuda train` (also the `dpcuda` console script), `eval`,
`predict` and `bench scaling`.

    python -m dpcuda train                         the digits MLP, 10 epochs, every GPU or the CPU
    python -m dpcuda train --replicas 4 --reducer host --json run.json --checkpoint ck.pt
    python -m dpcuda eval --checkpoint ck.pt       test-split loss and accuracy
    python -m dpcuda predict --checkpoint ck.pt --input x.npy --output y.npy
    python -m dpcuda bench scaling --json scaling.json --plot scaling.png

Bad options and paths exit with status 2 and a one-line message, before any training; Ctrl-C
and SIGTERM save the state reached (with --checkpoint) and exit with status 130 and 143; a
diverged run, a failed write or a lost peer process exit with status 1 and one line.
"""

import argparse
import json
import math
import os
import sys
import threading
import time

import torch

from . import data as data_mod
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
    p.add_argument("--dataset", choices=data_mod.DATASETS, default="digits", help="data set")
    p.add_argument("--data-dir", default=None, help="folder of the Fashion-MNIST IDX files")
    p.add_argument("--samples", type=_positive_int("--samples"), default=None,
                   help="synthetic data set size (default 60000)")
    p.add_argument("--features", type=_positive_int("--features"), default=None,
                   help="synthetic data set features (default 784)")
    p.add_argument("--classes", type=_positive_int("--classes"), default=None,
                   help="synthetic data set classes (default 10)")


def _data_args(args, parser):
    """--samples, --features and --classes: the synthetic data set's; an error elsewhere."""
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
                   help="the data set (default: the checkpoint's)")
    e.add_argument("--json", type=_path("--json"), default=None)

    pr = sub.add_parser("predict", help="class predictions of a checkpoint's model",
                        formatter_class=_Formatter)
    pr.add_argument("--checkpoint", type=_path("--checkpoint"), required=True)
    pr.add_argument("--input", type=_path("--input"), required=True,
                    help=".npy file of raw features, (rows, features), as the data set gives "
                         "them (digits: load_digits().data, pixels 0-16)")
    pr.add_argument("--output", type=_path("--output"), required=True,
                    help=".npy file for the int64 classes, (rows,)")
    pr.add_argument("--device", default="cpu")

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    s = bsub.add_parser("scaling", help="epoch time and accuracy for 1, 2, 4 replicas",
                        formatter_class=_Formatter)
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
    _add_data(s)
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(dataset="synthetic")
    s.add_argument("--replicas", default="1,2,4")
    s.add_argument("--batches", default="256,512",
                   help="global batch sizes; lr scales linearly from --lr at the first")
    s.add_argument("--reducers", default="p2p,host")
    s.add_argument("--json", default="scaling.json")
    s.add_argument("--plot", default="scaling.png")
    # Each command reports its errors under its own name ("dpcuda train: error: ...").
    t.set_defaults(run=_train, command_parser=t)
    e.set_defaults(run=_eval, command_parser=e)
    pr.set_defaults(run=_predict, command_parser=pr)
    s.set_defaults(run=_bench_scaling, command_parser=s)
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


def _finite(value):
    """value with every non-finite float replaced by None (JSON has no NaN or Infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _write_json(path, payload):
    """Atomically (a temporary file renamed over path) and valid (null for a non-finite
    number). A failed write raises WriteError naming the path."""
    from .train import WriteError
    target = os.path.realpath(path)  # a symlink stays one: its target is written
    folder = os.path.dirname(target)
    tmp = os.path.join(folder, f".{os.path.basename(target)}.tmp-{os.getpid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(_finite(payload), f, indent=2, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as err:
        raise WriteError(f"cannot write {path}: {err.strerror or err}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _init_dist(devices, timeout):
    import datetime
    import torch.distributed as dist
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError("--reducer dist needs torch.distributed's environment: start with "
                         "torchrun (e.g. torchrun --nproc-per-node 2 -m dpcuda train "
                         "--reducer dist)")
    backend = "nccl" if torch.device(devices[0]).type == "cuda" else "gloo"
    if not dist.is_initialized():
        wait = datetime.timedelta(seconds=timeout)
        namespace = _attempt_namespace()
        client = namespace is not None or int(os.environ["RANK"]) != 0 or \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        if client:
            _wait_for_store(timeout)
        try:
            if namespace is None:
                dist.init_process_group(backend, timeout=wait)
            else:
                store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                      is_master=False, timeout=wait)
                dist.init_process_group(backend, store=dist.PrefixStore(namespace, store),
                                        rank=int(os.environ["RANK"]),
                                        world_size=int(os.environ["WORLD_SIZE"]), timeout=wait)
        except RuntimeError as err:  # the store or a peer unreachable, a connection that failed
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            raise JoinError(f"cannot start the process group (store {where}, --timeout "
                            f"{timeout:g} s): {_first_line(err)}") from None
    return dist.get_rank(), dist.get_world_size()


class JoinError(Exception):
    """The process group could not be started."""


def _wait_for_store(timeout):
    """Until the rendezvous store at MASTER_ADDR:MASTER_PORT accepts a connection, at most
    `timeout` seconds: a store that never comes up is then one line (JoinError), where c10d's
    own client would log its C++ stack first. Where the address is missing or bad, torch's
    set-up says so."""
    import socket
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not addr or not port.isdigit() or not 0 < int(port) < 65536:
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((addr, int(port)), timeout=min(timeout, 5.0)):
                return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise JoinError(f"cannot start the process group: no rendezvous store at "
                                f"{addr}:{port} within --timeout {timeout:g} s "
                                f"({err.strerror or err})") from None
        time.sleep(0.2)


def _attempt_namespace():
    """The store prefix of this torchrun attempt, or None for torch's own set-up.

    torchrun (torch >= 2.5, c10d rendezvous) lends its agent's TCPStore to the workers and
    keeps that store across --max-restarts, keys and all: a restarted group's process group
    then finds the keys its dead predecessor wrote (gloo's peer addresses, NCCL's id) and may
    connect to a process that is gone ("connection refused", "connect timeout"; seen here
    under load; pytorch/pytorch#135712). With one agent (one node) its restart count names
    the attempt exactly, so each attempt's process group gets keys of its own. Across nodes
    the agents' counts can disagree (pytorch/pytorch#108158), so there torch's set-up stays
    and main() warns (with --rdzv-backend c10d, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives
    every attempt a new store; torchrun's static rendezvous always shares its store)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        return None
    port = os.environ.get("MASTER_PORT", "")
    if not os.environ.get("MASTER_ADDR") or not port.isdigit() or not 0 < int(port) < 65536:
        return None  # torch's own set-up then says what is missing
    run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    return f"dpcuda/{run}/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def _shared_store_warning():
    """One line for a multi-node torchrun with restarts and the agent's store shared."""
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and os.environ.get("GROUP_WORLD_SIZE", "1") != "1"
            and os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") not in ("", "0")):
        return ("warning: torchrun --max-restarts across nodes keeps its store across restarts "
                "and a restarted group can read the failed group's keys (pytorch/pytorch#135712)"
                "; start torchrun with --rdzv-backend c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
                "=1 (the static rendezvous always keeps its store)")
    return None


def _replicas_text(devices, processes=1):
    k = len(devices) * processes
    names = sorted(set(devices), key=devices.index)
    where = ",".join(names) if len(names) <= 8 else f"{','.join(names[:8])},..."
    return f"{k} replica{'s' if k != 1 else ''} on {where}"


def _train(args, parser):
    from .train import (CheckpointError, Diverged, Interrupted, OutputError, WriteError,
                        _model_spec, check_output_path, describe, train)
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
        _lock_checkpoint(args.checkpoint, parser)
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

    def write_json(result):
        if args.json and (dist_info is None or dist_info[0] == 0):
            payload = dict(result)
            payload.pop("data_parallel", None)
            _write_json(args.json, {"command": "train", **payload,
                                    "environment": _env(cfg.devices)})
            return True
        return False

    try:
        if args.reducer == "dist":
            if "LOCAL_RANK" in os.environ and torch.device(devices[0]).type == "cuda":
                local = int(os.environ["LOCAL_RANK"])
                cfg.devices = [f"cuda:{local}"] if not args.devices else cfg.devices
            dist_info = _init_dist(cfg.devices, args.timeout)
            if dist_info[0] == 0 and _shared_store_warning():
                print(_shared_store_warning(), file=sys.stderr)
            heartbeat = _Heartbeat.start(*dist_info, args.timeout)
        dataset = data_mod.load(cfg.dataset, cfg.data_dir, cfg.samples, cfg.features,
                                cfg.classes, cfg.seed)
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
            write_json({**stop.result, "final": None})
        except WriteError as err:
            print(f"dpcuda train: error: {err}", file=sys.stderr)
        return 128 + int(stop.signum)
    except Diverged as err:
        try:
            write_json({**err.result, "final": None})
        except WriteError:
            pass
        parser.exit(1, f"{parser.prog}: error: {err}\n")
    except (WriteError, JoinError) as err:
        parser.exit(1, f"{parser.prog}: error: {err}\n")
    except Exception as err:
        if _is_out_of_memory(err):
            parser.exit(1, f"{parser.prog}: error: out of memory (a smaller --hidden, "
                           f"--samples, --features or --batch-size?): {_first_line(err)}\n")
        if dist_info is None or not _is_dist_failure(err):
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
        # Every thread joined and the process group destroyed before the interpreter exits: a
        # C++ thread still joinable at exit (gloo's, the store's) aborts the process
        # ("terminate called without an active exception", SIGABRT), as 3 of 20 back-to-back
        # torchrun runs did before this.
        # After a run that finished, the processes also meet once first (bounded by the
        # group's timeout) and drop what still holds the group's C++ objects, so that none
        # tears the group down while another still talks in it (a rank still aborted so once
        # in CI, 2026-11-25, in tests/test_cli_dist.py).
        if heartbeat is not None:
            heartbeat.stop()
        if dist_info is not None:
            import gc

            import torch.distributed as dist
            if dist.is_initialized():
                if finished:
                    try:
                        dist.barrier()
                    except Exception:
                        pass
                gc.collect()
                dist.destroy_process_group()
    result.pop("data_parallel")
    if dist_info is None or dist_info[0] == 0:
        # (the epochs' lines were printed as they ended; the summary does not repeat them)
        fin = result["final"]
        if fin:
            print(f"final test accuracy {100 * fin['test_accuracy']:.2f}% after "
                  f"{fin['epochs']} epochs, {fin['total_seconds']:.2f} s of training, "
                  f"{fin['samples_per_s']:.0f} samples/s")
        try:
            if write_json(result):
                print(f"wrote {args.json}")
        except WriteError as err:
            parser.exit(1, f"{parser.prog}: error: {err}\n")
    return 0


class _Heartbeat:
    """The health check of a --reducer dist run: every process bumps a counter in the
    rendezvous store (torchrun's, at MASTER_ADDR:MASTER_PORT) every second from a thread of its
    own. When a collective fails or times out, the counters that stopped moving name the ranks
    that stopped (SIGSTOP, a hung machine) or died. Clock-free: it compares counts, not times."""

    INTERVAL = 1.0

    def __init__(self, store, rank, world, prefix):
        self.store, self.rank, self.world, self.prefix = store, rank, world, prefix
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="dpcuda-heartbeat",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, rank, world, timeout):
        """A heartbeat, or None where there is no store to beat in (no MASTER_ADDR/PORT)."""
        import datetime
        import torch.distributed as dist
        try:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  is_master=False,
                                  timeout=datetime.timedelta(seconds=min(timeout, 30.0)))
        except Exception:  # no store reachable: the run goes on without naming lost ranks
            return None
        # each attempt's processes count from 1 again, so a counter a dead predecessor left
        # behind is told from a live one by its not moving; the attempt (where known) only
        # keeps the keys apart
        namespace = _attempt_namespace() or \
            f"dpcuda/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/"
        return cls(store, rank, world, f"{namespace}heartbeat/")

    def _beat(self):
        count = 0
        while not self._done.is_set():
            count += 1
            try:
                self.store.set(f"{self.prefix}{self.rank}", str(count))
            except Exception:
                return
            self._done.wait(self.INTERVAL)

    def _counts(self):
        counts = {}
        for r in range(self.world):
            key = f"{self.prefix}{r}"
            counts[r] = int(self.store.get(key)) if self.store.check([key]) else 0
        return counts

    def silent_ranks(self, wait=3.5):
        """The other ranks whose counter did not move for `wait` seconds ([] if unknown)."""
        try:
            before = self._counts()
            time.sleep(wait)
            after = self._counts()
        except Exception:
            return []
        return [r for r in range(self.world) if r != self.rank and after[r] == before[r]]

    def stop(self):
        self._done.set()
        self._thread.join(timeout=5.0)
        self.store = None


_LOCKS = []  # open lock files, held until the process exits


def _lock_checkpoint(path, parser):
    """One run at a time per checkpoint: an exclusive lock on PATH.lock, held until exit (the
    system drops it when the process ends, however it ends; the file stays)."""
    import fcntl
    from .train import check_output_path
    try:
        check_output_path(path, "--checkpoint")  # the room it needs is checked once sized
    except ValueError as err:
        parser.error(str(err))
    lock = os.path.realpath(path) + ".lock"
    try:
        os.makedirs(os.path.dirname(lock), exist_ok=True)
        f = open(lock, "a+")
    except OSError as err:
        parser.error(f"--checkpoint {path}: cannot create its lock file {lock}: "
                     f"{err.strerror or err}")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        parser.error(f"--checkpoint {path}: another run is writing it (its lock {lock} is "
                     f"held)")
    _LOCKS.append(f)


def _first_line(err):
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else type(err).__name__


def _is_out_of_memory(err):
    if isinstance(err, MemoryError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("out of memory" in text or
                                              "not enough memory" in text or
                                              "defaultcpuallocator" in text)


def _is_dist_failure(err):
    """Whether err is torch.distributed reporting a lost or silent peer (gloo/NCCL)."""
    import torch.distributed as dist
    kinds = tuple(k for k in (getattr(dist, "DistError", None),
                              getattr(dist, "DistBackendError", None),
                              getattr(dist, "DistNetworkError", None)) if k is not None)
    if kinds and isinstance(err, kinds):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(
        s in text for s in ("gloo", "nccl", "connection", "timed out", "timeout", "peer"))


def _load_model_for(args, parser):
    from .train import CheckpointError, load_checkpoint_model
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
    from .train import load_checkpoint
    import torch.nn.functional as F
    _distinct_paths(parser, ("--checkpoint", args.checkpoint), ("--json", args.json))
    model, device = _load_model_for(args, parser)
    cfg = load_checkpoint(args.checkpoint, option="--checkpoint").get("config") or {}
    name = args.dataset or cfg.get("dataset", "digits")
    try:
        dataset = data_mod.load(name, args.data_dir or cfg.get("data_dir"),
                                cfg.get("samples", 60000), cfg.get("features", 784),
                                cfg.get("classes", 10), cfg.get("seed", 0))
    except data_mod.DataError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    # The data set's features are preprocessed already: the checkpoint's network without its
    # own preprocessing (which takes raw features) evaluates them as training did.
    model = getattr(model, "model", model)
    x = dataset.x_test
    features, classes = _model_sizes(model)
    if x.shape[1] != features or dataset.classes > classes:
        parser.exit(2, f"{parser.prog}: error: {name} has {x.shape[1]} features and "
                       f"{dataset.classes} classes, the checkpoint's model takes {features} "
                       f"features and has {classes} classes\n")
    with torch.no_grad():
        logits = torch.cat([model(x[i:i + 4096].to(device)).cpu()
                            for i in range(0, x.shape[0], 4096)])
    loss = float(F.cross_entropy(logits.float(), dataset.y_test))
    accuracy = float((logits.argmax(1) == dataset.y_test).float().mean())
    print(f"{name} test split: {x.shape[0]} samples, loss {loss:.4f}, accuracy "
          f"{100 * accuracy:.2f}%")
    if args.json:
        try:
            _write_json(args.json, {"command": "eval", "checkpoint": args.checkpoint,
                                    "dataset": name, "samples": x.shape[0], "loss": loss,
                                    "accuracy": accuracy})
        except OSError as err:
            parser.exit(1, f"{parser.prog}: error: {err}\n")
    return 0


def _predict(args, parser):
    import numpy as np
    model, device = _load_model_for(args, parser)
    _distinct_paths(parser, ("--checkpoint", args.checkpoint), ("--input", args.input),
                    ("--output", args.output))
    try:
        x = np.load(args.input, allow_pickle=False)
    except (OSError, ValueError) as err:
        parser.exit(2, f"{parser.prog}: error: --input {args.input}: cannot read a .npy array "
                       f"({_first_line(err)})\n")
    if not isinstance(x, np.ndarray):  # an .npz archive
        parser.exit(2, f"{parser.prog}: error: --input {args.input}: an .npz archive, not a "
                       f".npy array\n")
    features, _ = _model_sizes(model)
    if x.ndim == 1 and x.shape[0] == features:
        x = x[None]
    if x.ndim != 2 or x.shape[1] != features or not (np.issubdtype(x.dtype, np.integer) or
                                                     np.issubdtype(x.dtype, np.floating)):
        parser.exit(2, f"{parser.prog}: error: --input {args.input}: expected real numbers of "
                       f"shape (rows, {features}), got {x.dtype} {x.shape}\n")
    with np.errstate(over="ignore"):
        x32 = np.asarray(x, dtype=np.float32)
    bad = np.flatnonzero(~np.isfinite(x32).all(axis=1)) if x32.size else []
    if len(bad):
        parser.exit(2, f"{parser.prog}: error: --input {args.input}: row {bad[0]} holds NaN, "
                       f"Inf or a value beyond float32 ({len(bad)} such rows); no prediction "
                       f"for it would mean anything\n")
    from .train import WriteError, check_output_path
    try:
        check_output_path(args.output, "--output")
    except ValueError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    xt = torch.from_numpy(np.ascontiguousarray(x32))
    with torch.no_grad():
        classes = torch.cat([model(xt[i:i + 4096].to(device)).argmax(1).cpu()
                             for i in range(0, xt.shape[0], 4096)]) if len(xt) else \
            torch.zeros(0, dtype=torch.int64)
    target = os.path.realpath(args.output)  # a symlink stays one: its target is written
    folder = os.path.dirname(target)
    tmp = os.path.join(folder, f".{os.path.basename(target)}.tmp-{os.getpid()}.npy")
    try:
        np.save(tmp, classes.numpy().astype(np.int64))
        os.replace(tmp, target)
    except OSError as err:
        parser.exit(1, f"{parser.prog}: error: cannot write {args.output}: "
                       f"{err.strerror or err}\n")
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    print(f"wrote {args.output}: {classes.shape[0]} predictions")
    return 0


def _bench_scaling(args, parser):
    from .train import train
    if args.samples is None and args.dataset == "synthetic":
        args.samples = 16384
    _data_args(args, parser)
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
    from .train import check_output_path
    try:
        for path, option in ((args.json, "--json"), (args.plot, "--plot")):
            if path:
                check_output_path(path, option)
    except ValueError as err:
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
    payload = {"command": "bench scaling", "dataset": dataset.name,
               "train_samples": dataset.x_train.shape[0], "epochs": args.epochs,
               "devices": devices, "environment": _env(devices), "results": rows}
    if args.json:
        try:
            _write_json(args.json, payload)
        except OSError as err:
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
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args, args.command_parser)
    except KeyboardInterrupt:  # before the training loop's own handler, or a second Ctrl-C
        print(f"{args.command_parser.prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
