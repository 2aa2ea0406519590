"""The training run behind `python -m dpcuda train`: an MLP trained data-parallel with
dpcuda.parallel.DataParallel, per-epoch figures, checkpoints (dpcuda.checkpoint) that resume to
identical weights, output paths checked before the first step, a divergence guard, a clean stop
on Ctrl-C or SIGTERM, and the evaluation of a trained model (evaluate).
"""

import math
import os
import signal
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from . import data as data_mod
from .checkpoint import (CHECKPOINT_FORMAT, CHECKPOINT_VERSION, CheckpointError, OutputError,
                         WriteError, _check_spec, _fused_keys, check_output_path, hidden_widths,
                         load_checkpoint, load_checkpoint_model, save_checkpoint)
from .nn import FusedMLP, SoftmaxCrossEntropyLoss
from .parallel import DataParallel
from .train_step import OptimizerStep, make_optimizer, make_scheduler, uses_optimizer

__all__ = ["TrainConfig", "CheckpointError", "OutputError", "WriteError", "Diverged",
           "Interrupted", "build_model", "train", "evaluate", "save_checkpoint", "load_checkpoint",
           "load_checkpoint_model", "check_output_path", "CHECKPOINT_FORMAT"]

# What a resumed run must share with its checkpoint (config key: option): these set the model or
# the order of the data. The rest (lr, momentum, replicas, devices, reducer, epochs upwards, ...)
# may change. samples, features and classes matter for the synthetic data set only.
_SAME_ON_RESUME = {"dataset": "--dataset", "seed": "--seed", "batch_size": "--batch-size",
                   "activation": "--activation", "hidden": "--hidden", "samples": "--samples",
                   "features": "--features", "classes": "--classes",
                   "optimizer": "--optimizer", "lr_schedule": "--lr-schedule",
                   "warmup_steps": "--warmup-steps", "test_fraction": "--test-fraction",
                   "label_column": "--label-column"}
# What the run's defaults were before a setting existed (a checkpoint written before it).
_OLD_DEFAULTS = {"optimizer": "sgd", "lr_schedule": "constant", "warmup_steps": 0}
_FILE_ONLY = ("test_fraction", "label_column")
_SYNTHETIC_ONLY = ("samples", "features", "classes")

_ACTIVATION_MODULES = {
    "relu": torch.nn.ReLU, "gelu": torch.nn.GELU, "gelu_tanh": lambda: torch.nn.GELU("tanh"),
    "silu": torch.nn.SiLU, "sigmoid": torch.nn.Sigmoid, "tanh": torch.nn.Tanh,
    "none": torch.nn.Identity,
}


class Diverged(Exception):
    """Raised by train() after max_bad_steps consecutive steps with non-finite gradients."""

    def __init__(self, message, result):
        super().__init__(message)
        self.result = result


class Interrupted(Exception):
    """Raised by train() after Ctrl-C or SIGTERM, once the last good state is saved; signum
    says which."""

    def __init__(self, message, result, signum=signal.SIGINT):
        super().__init__(message)
        self.result = result
        self.signum = signum


@dataclass
class TrainConfig:
    devices: list = field(default_factory=lambda: ["cpu"])  # one entry per replica
    batch_size: int = 256
    lr: float = 0.2
    momentum: float = 0.9
    weight_decay: float = 0.0
    epochs: int = 10
    hidden: list = field(default_factory=lambda: [256])  # the hidden layers' widths
    activation: str = "relu"
    optimizer: str = "sgd"  # sgd, adam, adamw (dpcuda.train_step)
    lr_schedule: str = "constant"  # constant, cosine, onecycle
    warmup_steps: int = 0
    clip_grad_norm: float = None
    accumulate: int = 1  # micro-batches per global batch
    reducer: str = "p2p"
    shard_optimizer: str = "auto"  # auto, on, off: the optimizer state over processes (dist)
    split: str = "even"
    split_weights: list = None
    fused: bool = True
    seed: int = 0
    dataset: str = "digits"
    data_dir: str = None
    samples: int = 60000
    features: int = 784
    classes: int = 10
    data: str = None  # the user's files (dataset "file"): dpcuda.data.read_table
    test_data: str = None
    test_fraction: float = 0.2  # of data's rows held out for the test split (no test_data)
    label_column: str = None  # a CSV's label column (name or index)
    checkpoint: str = None
    resume: str = None
    progress: bool = True
    log: bool = True
    max_bad_steps: int = 5  # consecutive steps with non-finite gradients that end the run
    timeout: float = 300.0  # seconds any wait on another process or replica may take


def build_model(features, hidden, classes, activation, fused, seed):
    """The MLP (features, *hidden, classes): FusedMLP when fused, else nn.Sequential(Linear,
    act, ..., Linear); both draw the same initial weights for a seed."""
    torch.manual_seed(seed)
    sizes = [features, *hidden_widths(hidden), classes]
    if fused:
        return FusedMLP(sizes, activation=activation)
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i + 2 < len(sizes):
            layers.append(_ACTIVATION_MODULES[activation]())
    return torch.nn.Sequential(*layers)


# ---------------------------------------------------------------------------------------------
# the data and the model it sizes

def load_data(cfg):
    """The data set cfg names (dpcuda.data.load)."""
    return data_mod.load(cfg.dataset, cfg.data_dir, cfg.samples, cfg.features, cfg.classes,
                         cfg.seed, data=cfg.data, test_data=cfg.test_data,
                         test_fraction=cfg.test_fraction, label_column=cfg.label_column)


def _model_spec(cfg, dataset):
    return {"features": dataset.features, "hidden": hidden_widths(cfg.hidden),
            "classes": dataset.classes,
            "activation": cfg.activation}


def _check_resume(path, payload, cfg):
    saved = payload.get("config") or {}
    diffs = []
    for key, option in _SAME_ON_RESUME.items():
        if key in _SYNTHETIC_ONLY and (cfg.dataset != "synthetic" or
                                       saved.get("dataset") != "synthetic"):
            continue
        if key in _FILE_ONLY and (cfg.dataset != data_mod.FILE or
                                  saved.get("dataset") != data_mod.FILE):
            continue
        have, want = saved.get(key, _OLD_DEFAULTS.get(key)), getattr(cfg, key)
        if key == "hidden" and have is not None:
            have, want = hidden_widths(have), hidden_widths(want)
        if have is not None and have != want:
            shown = (lambda v: ",".join(map(str, v))) if key == "hidden" else str
            diffs.append(f"{option} {shown(want)} (checkpoint: {shown(have)})")
    if cfg.lr_schedule != "constant":
        # The schedule spans the run: its length and peak are the checkpoint's.
        for key, option in (("epochs", "--epochs"), ("lr", "--lr"), ("accumulate",
                                                                     "--accumulate")):
            if key in saved and saved[key] != getattr(cfg, key):
                diffs.append(f"{option} {getattr(cfg, key)} (checkpoint: {saved[key]}; "
                             f"--lr-schedule {cfg.lr_schedule} spans the run)")
    if cfg.dataset == data_mod.FILE and saved.get("dataset") == data_mod.FILE:
        # the same files, however their paths are spelled (their contents: train() compares
        # the checkpoint's fingerprint)
        for key, option in (("data", "--data"), ("test_data", "--test-data")):
            have, want = saved.get(key), getattr(cfg, key)
            real = (lambda spec: [os.path.realpath(p) for p in data_mod.paths(spec)]
                    if spec else None)
            if real(have) != real(want):
                diffs.append(f"{option} {want} (checkpoint: {have})")
    if cfg.dataset == "fashion-mnist" and saved.get("dataset") == "fashion-mnist" and \
            saved.get("data_dir") and cfg.data_dir and \
            os.path.realpath(saved["data_dir"]) != os.path.realpath(cfg.data_dir):
        diffs.append(f"--data-dir {cfg.data_dir} (checkpoint: {saved['data_dir']})")
    if diffs:
        raise CheckpointError(f"--resume {path}: this run differs from the checkpoint's in what "
                              f"sets the model, its optimizer or the data order: "
                              f"{'; '.join(diffs)}")
    epoch, step = int(payload["epoch"]), int(payload["step"])
    needed = epoch + (1 if step else 0)
    if cfg.epochs < needed:
        raise CheckpointError(f"--epochs {cfg.epochs} is below the checkpoint's "
                              f"{needed if step else epoch} {'started' if step else 'completed'} "
                              f"epochs; --epochs may only grow on a resume")


# ---------------------------------------------------------------------------------------------
# the run

def evaluate(module, x, y, device="cpu", batch=4096):
    """The mean cross-entropy loss and the accuracy of module's logits on the features x (as
    the model takes them) against the labels y, in batches of `batch` rows on `device`:
    {"loss": float, "accuracy": float}. What training reports after each epoch and `dpcuda
    eval` reports for a checkpoint."""
    total, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, x.shape[0], batch):
            out = module(x[i:i + batch].to(device)).float().cpu()
            total += float(F.cross_entropy(out, y[i:i + batch], reduction="sum"))
            correct += int((out.argmax(1) == y[i:i + batch]).sum())
    n = max(1, x.shape[0])
    return {"loss": total / n, "accuracy": correct / n}


class _StopFlag:
    """Ctrl-C (SIGINT) or SIGTERM (what torchrun, Slurm and Kubernetes send at preemption)
    sets the flag; the loop checks it between steps. A second Ctrl-C stops at once."""

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.set = False
        self.signum = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self._SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.set and signum == signal.SIGINT:  # a second Ctrl-C: stop at once
            raise KeyboardInterrupt
        self.set = True
        self.signum = self.signum or signum

    def __exit__(self, *exc):
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        return False


def train(cfg, dataset=None, dist_info=None, announce=None):
    """Runs training as cfg says; returns a dict with every figure of the run.

    dist_info: (rank, world) when running under torch.distributed with reducer "dist"; each
    process then steps on its slice of every global batch. announce() is called once every
    check (configuration, resume, output paths) has passed, before the first step.
    """
    rank, world = dist_info or (0, 1)
    lead = rank == 0
    if dataset is None:
        dataset = load_data(cfg)
    n_train = dataset.x_train.shape[0]
    replicas = len(cfg.devices) * world
    if replicas > n_train:
        raise ValueError(f"{replicas} replicas but only {n_train} training samples")
    if cfg.batch_size < replicas:
        raise ValueError(f"--batch-size {cfg.batch_size} is smaller than the {replicas} "
                         f"replicas; every replica needs at least one row")
    if cfg.batch_size > n_train:
        # (else every epoch would be one step over the whole set, silently)
        raise ValueError(f"--batch-size {cfg.batch_size} is larger than the training set "
                         f"({n_train} samples); give at most {n_train}")
    spec = _model_spec(cfg, dataset)
    resumed = load_checkpoint(cfg.resume) if cfg.resume else None
    if resumed is not None:
        _check_resume(cfg.resume, resumed, cfg)  # every difference of the run, listed
        saved_digest = resumed.get("data_fingerprint")
        if saved_digest and dataset.fingerprint and saved_digest != dataset.fingerprint:
            raise CheckpointError(f"--resume {cfg.resume}: --data {cfg.data}: the file's "
                                  f"contents differ from those the checkpoint trained on")
        _check_spec(cfg.resume, resumed, spec)  # the model, where the configuration says less
    if cfg.checkpoint and lead:
        # The checkpoint holds the weights, the momentum buffer, the data order: room for it
        # (and for the old one while the new one is written) before the first step.
        n_params = sum(p.numel() for p in build_model(dataset.features, cfg.hidden,
                                                      dataset.classes, cfg.activation, True,
                                                      cfg.seed).parameters())
        states = 2 if cfg.optimizer != "sgd" else (1 if cfg.momentum else 0)
        need = (n_params * 4 * (1 + states) + n_train * 8
                + dataset.features * 8) * 11 // 10 + (1 << 20)
        check_output_path(cfg.checkpoint, "--checkpoint", need)

    model = build_model(dataset.features, cfg.hidden, dataset.classes, cfg.activation,
                        cfg.fused, cfg.seed)
    loss_fn = SoftmaxCrossEntropyLoss() if cfg.fused else F.cross_entropy
    dp = DataParallel(model, cfg.devices, reducer=cfg.reducer, split=cfg.split, lr=cfg.lr,
                      momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                      split_weights=cfg.split_weights, timeout=cfg.timeout,
                      shard_optimizer={"auto": None, "on": True, "off": False}[
                          cfg.shard_optimizer] if cfg.reducer == "dist" else None)
    steps_per_epoch = math.ceil(n_train / cfg.batch_size)
    opt = sched = optimizer_step = None
    if uses_optimizer(cfg):
        opt = make_optimizer(cfg, dp.parameters())
        sched = make_scheduler(cfg, opt, cfg.epochs * steps_per_epoch)
        optimizer_step = OptimizerStep(dp, opt, sched, loss_fn, cfg)
    order_gen = torch.Generator().manual_seed(cfg.seed)
    history, start_epoch, start_step, order = [], 0, 0, None
    partial = {"loss_sum": 0.0, "samples": 0, "seconds": 0.0}
    if resumed is not None:
        # FusedMLP's keys in the checkpoint, the same tensors in the same order as
        # nn.Sequential(Linear, act, Linear)'s.
        keys = list(dp.state_dict().keys())
        dp.load_state_dict(dict(zip(keys, resumed["model_state_dict"].values())))
        kind = resumed.get("optimizer_kind", "DataParallel")
        if (kind == "dpcuda.optim") != (opt is not None):
            raise CheckpointError(
                f"--resume {cfg.resume}: the checkpoint's optimizer state is "
                f"{'a dpcuda.optim' if kind == 'dpcuda.optim' else 'the wrapper SGD'}'s, this "
                f"run uses {'a dpcuda.optim optimizer' if opt is not None else 'the wrapper SGD'}"
                f" (--optimizer, --lr-schedule, --warmup-steps, --clip-grad-norm and "
                f"--accumulate choose it)")
        if opt is None:
            dp.load_optimizer_state_dict(resumed["optimizer"])
            # The command line's hyper-parameters win over the checkpoint's (a resume may
            # change --lr, --momentum or --weight-decay); the momentum buffer is the
            # checkpoint's.
            dp.lr, dp.momentum, dp.weight_decay = cfg.lr, cfg.momentum, cfg.weight_decay
        else:
            opt.load_state_dict(resumed["optimizer"])
            sched.load_state_dict(resumed["scheduler"])
            # The command line's hyper-parameters win here too (a constant schedule's --lr; a
            # schedule that spans the run keeps its --lr, _check_resume said).
            for group, base in zip(opt.param_groups, sched.base_lrs):
                group["weight_decay"] = cfg.weight_decay
                if cfg.optimizer == "sgd":
                    group["momentum"] = cfg.momentum
                if cfg.lr_schedule == "constant":
                    group["lr"] = group["lr"] / base * cfg.lr if base else cfg.lr
            if cfg.lr_schedule == "constant":
                sched.base_lrs = [cfg.lr] * len(sched.base_lrs)
                sched._last_lr = [g["lr"] for g in opt.param_groups]
        order_gen.set_state(resumed["order_generator"])
        torch.set_rng_state(resumed["torch_rng"])
        history = list(resumed["history"])
        start_epoch, start_step = int(resumed["epoch"]), int(resumed["step"])
        order = resumed["order"]
        partial = dict(resumed["partial"])

    def checkpoint_payload(epoch, step, order, partial):
        weights = [p.detach().to("cpu", copy=True) for p in dp.module.parameters()]
        return {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "model": spec,
                "model_state_dict": dict(zip(_fused_keys(spec), weights)),
                "normalization": None if dataset.mean is None else
                {"mean": dataset.mean.clone(), "std": dataset.std.clone(),
                 "divisor": dataset.divisor},
                "optimizer_kind": "dpcuda.optim" if opt is not None else "DataParallel",
                "optimizer": opt.state_dict() if opt is not None else dp.optimizer_state_dict(),
                "scheduler": sched.state_dict() if sched is not None else None,
                "epoch": epoch, "step": step,
                "order": order, "order_generator": order_gen.get_state(),
                "torch_rng": torch.get_rng_state(), "history": history,
                "partial": dict(partial), "config": asdict(cfg),
                "data_fingerprint": dataset.fingerprint}

    def save(epoch, step, order, partial):
        if not cfg.checkpoint:
            return
        if opt is not None:
            # Under reducer "dist" the optimizer state is sharded over the processes (ZeRO-1):
            # every process takes part in gathering it on rank 0 (save runs on every process
            # at the same points: an epoch's end, an agreed stop).
            opt.consolidate_state_dict(to=0)
        if lead:
            save_checkpoint(cfg.checkpoint, checkpoint_payload(epoch, step, order, partial))

    if announce is not None:
        announce()
    result = {"config": asdict(cfg), "replicas": replicas, "devices": list(cfg.devices),
              "dataset": {"name": dataset.name, "train": n_train,
                          "test": dataset.x_test.shape[0], "features": dataset.features,
                          "classes": dataset.classes},
              "resumed_from": cfg.resume, "epochs": history, "interrupted": False}
    progress = None
    bad_steps = 0
    with _StopFlag() as stop:
        for epoch in range(start_epoch, cfg.epochs):
            if order is None:
                order = torch.randperm(n_train, generator=order_gen)
                partial = {"loss_sum": 0.0, "samples": 0, "seconds": 0.0}
                start_step = 0
            if cfg.progress and lead:
                from tqdm import tqdm
                progress = tqdm(total=steps_per_epoch, initial=start_step, leave=False,
                                desc=f"epoch {epoch + 1}/{cfg.epochs}", unit="step",
                                disable=None)
            for step in range(start_step, steps_per_epoch):
                t0 = time.perf_counter()
                idx = order[step * cfg.batch_size:(step + 1) * cfg.batch_size]
                rows = idx.shape[0]  # the global batch, before this process takes its slice
                if world > 1:
                    share = idx.shape[0] // world
                    rest = idx.shape[0] - share * world
                    lo = rank * share + min(rank, rest)
                    idx = idx[lo:lo + share + (1 if rank < rest else 0)]
                skipped = dp.skipped_steps
                with warnings.catch_warnings():
                    # Counted here (bad_steps, the divergence guard), not warned step by step.
                    warnings.filterwarnings("ignore", message="dpcuda DataParallel: step .* "
                                                              "NaN or Inf")
                    if optimizer_step is None:
                        loss = dp.step(dataset.x_train[idx], dataset.y_train[idx], loss_fn)
                    else:
                        loss, _ = optimizer_step(dataset.x_train[idx], dataset.y_train[idx])
                if dp.skipped_steps > skipped:
                    bad_steps += 1
                    partial["skipped_steps"] = partial.get("skipped_steps", 0) + 1
                    if bad_steps >= cfg.max_bad_steps:
                        if progress is not None:
                            progress.close()
                        result["diverged"] = True
                        raise Diverged(
                            f"the run diverged: {bad_steps} consecutive steps with NaN or Inf "
                            f"gradients, the last at epoch {epoch + 1}, step {step + 1}; the "
                            f"weights were not updated by them (lower --lr; the last "
                            f"checkpoint, if any, is intact)", result)
                else:
                    bad_steps = 0
                    partial["loss_sum"] += loss * rows
                    partial["samples"] += rows
                partial["seconds"] += time.perf_counter() - t0
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(loss=f"{loss:.4g}")
                if _agreed_stop(stop, dp, world):
                    if progress is not None:
                        progress.close()
                    save(epoch, step + 1, order, partial)
                    result["interrupted"] = True
                    where = f"epoch {epoch + 1}, step {step + 1} of {steps_per_epoch}"
                    saved = f"; saved {cfg.checkpoint}" if cfg.checkpoint else ""
                    name = signal.Signals(stop.signum or signal.SIGINT).name
                    raise Interrupted(f"stopped by {name} at {where}{saved}", result,
                                      stop.signum or signal.SIGINT)
            if progress is not None:
                progress.close()
            accuracy = evaluate(dp.module, dataset.x_test, dataset.y_test,
                                dp.devices[0])["accuracy"]
            record = {"epoch": epoch + 1, "seconds": partial["seconds"],
                      "samples_per_s": partial["samples"] / max(partial["seconds"], 1e-12),
                      "train_loss": partial["loss_sum"] / partial["samples"]
                      if partial["samples"] else math.nan,
                      "test_accuracy": accuracy,
                      "skipped_steps": partial.get("skipped_steps", 0)}
            history.append(record)
            order = None
            save(epoch + 1, 0, None, {"loss_sum": 0.0, "samples": 0, "seconds": 0.0})
            if cfg.log and lead:
                msg = (f"epoch {epoch + 1:>3}/{cfg.epochs}  {record['seconds']:7.2f} s  "
                       f"{record['samples_per_s']:10.0f} samples/s  loss "
                       f"{record['train_loss']:.4g}  test accuracy "
                       f"{100 * accuracy:6.2f}%")
                if progress is not None:
                    from tqdm import tqdm
                    tqdm.write(msg)
                else:
                    print(msg, flush=True)
    result["final"] = _summary(history)
    result["final_parameters_checksum"] = float(sum(p.detach().double().sum()
                                                    for p in dp.module.parameters()))
    result["data_parallel"] = dp
    return result


def _agreed_stop(stop, dp, world):
    """Whether to stop after this step: the signal flag, agreed by every process under
    torch.distributed (a process stopping alone would leave the others waiting in the next
    step's collectives), in one tiny all-reduce per step."""
    if world == 1:
        return stop.set
    import torch.distributed as dist
    flag = torch.tensor([1.0 if stop.set else 0.0], device=dp._comm_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() > 0 and not stop.set:
        stop.set, stop.signum = True, signal.SIGTERM  # another process was signalled
    return stop.set


def _summary(history):
    if not history:
        return {}
    seconds = sum(r["seconds"] for r in history)
    return {"epochs": len(history), "test_accuracy": history[-1]["test_accuracy"],
            "train_loss": history[-1]["train_loss"], "total_seconds": seconds,
            "mean_epoch_seconds": seconds / len(history),
            "samples_per_s": sum(r["samples_per_s"] * r["seconds"] for r in history)
            / max(seconds, 1e-12)}
