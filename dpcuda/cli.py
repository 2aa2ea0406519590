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

import contextlib
import os
import sys
import time

import torch

from . import data as data_mod
from .checkpoint import write_json
from .cli_options import (_config, _data_args, _devices, _distinct_paths, _parser,
                          _replica_devices)
from ._text import first_line as _first_line

__all__ = ["main"]


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
    # (an output must not be an input either: --data's files)
    _distinct_paths(parser, ("--checkpoint", args.checkpoint), ("--json", args.json),
                    ("--data", args.data), ("--test-data", args.test_data))
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
        try:  # (held until main() returns: a second run in this process may take it then)
            args.held.enter_context(lock_checkpoint(args.checkpoint))
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
                note = f"; {dataset.note}" if dataset.note else ""
                print(f"dpcuda train: {dataset.name} ({dataset.x_train.shape[0]} train, "
                      f"{dataset.x_test.shape[0]} test, {dataset.features} features, "
                      f"{dataset.classes} classes{note}), MLP "
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
        reason = _first_line(err, 160)
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
    """The checkpoint's model on --device, its device and the checkpoint (read once)."""
    from .checkpoint import CheckpointError, load_checkpoint, model_from_payload
    from .parallel import _device
    try:
        device = _device(args.device, "--device")
        payload = load_checkpoint(args.checkpoint, option="--checkpoint")
        return model_from_payload(payload, device), device, payload
    except (CheckpointError, ValueError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")


def _model_sizes(model):
    inner = model.model if hasattr(model, "mean") else model
    return inner.layers[0].weight.shape[1], inner.layers[-1].weight.shape[0]


def _eval(args, parser):
    from .train import evaluate
    _distinct_paths(parser, ("--checkpoint", args.checkpoint), ("--json", args.json),
                    ("--data", args.data))
    if args.data is not None and args.dataset is not None:
        parser.error(f"--data and --dataset {args.dataset}: give one")
    if args.label_column is not None and args.data is None:
        parser.error("--label-column applies to --data")
    model, device, payload = _load_model_for(args, parser)
    cfg = payload.get("config") or {}
    try:
        if args.data is not None:
            if not hasattr(model, "mean"):
                parser.exit(2, f"{parser.prog}: error: --checkpoint {args.checkpoint}: a version "
                               f"1 checkpoint, which saved no standardisation of its features: "
                               f"it can score only its own test split (leave --data out)\n")
            # Raw features, as the file holds them: the checkpoint's model standardises them
            # as it did its training data.
            name = f"{os.path.basename(args.data)}"
            x, y = data_mod.read_table(args.data, "--data",
                                       label_column=args.label_column or
                                       cfg.get("label_column"))
        else:
            name = args.dataset or cfg.get("dataset", "digits")
            if name == data_mod.FILE and payload.get("data_fingerprint") and \
                    data_mod.fingerprint(cfg.get("data")) != payload["data_fingerprint"]:
                parser.exit(2, f"{parser.prog}: error: --checkpoint {args.checkpoint}: its "
                               f"training data {cfg.get('data')} has changed since (another "
                               f"file's contents); score a file with --data\n")
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
    model, device, payload = _load_model_for(args, parser)
    _distinct_paths(parser, ("--checkpoint", args.checkpoint), ("--input", args.input),
                    ("--output", args.output))
    cfg = payload.get("config") or {}
    label = cfg.get("label_column")
    try:  # the kinds of file --data reads; a CSV's label column, if it has one, is left out
        xt, _ = data_mod.read_table(args.input, "--input", labels=False, label_column=label)
    except data_mod.DataError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    features, _ = _model_sizes(model)
    if xt.shape == (features, 1) and features > 1:  # one row, given as a vector
        xt = xt.reshape(1, features)
    if xt.shape[1] == features + 1 and args.input.lower().endswith(".csv"):
        # a CSV without a header that still holds its labels (the training file itself):
        # the label column as training took it
        drop = int(label) if label is not None and str(label).lstrip("-").isdigit() else -1
        xt = torch.cat([xt[:, :drop % xt.shape[1]], xt[:, drop % xt.shape[1] + 1:]], 1)
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
    parser = _parser(__doc__)
    args = parser.parse_args(argv)
    run = {"train": _train, "eval": _eval, "predict": _predict}[args.command]
    try:
        with contextlib.ExitStack() as held:  # what the run holds (the checkpoint's lock)
            args.held = held
            return run(args, args.command_parser)
    except KeyboardInterrupt:  # before the training loop's own handler, or a second Ctrl-C
        print(f"{args.command_parser.prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
