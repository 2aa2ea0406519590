"""The training run behind `python -m dpcuda train`: a 2-layer MLP trained data-parallel with
dpcuda.parallel.DataParallel, per-epoch figures, atomic checkpoints that resume to identical
weights, and a clean stop on Ctrl-C.
"""

import math
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from . import data as data_mod
from .nn import FusedMLP, SoftmaxCrossEntropyLoss
from .parallel import DataParallel

__all__ = ["TrainConfig", "CheckpointError", "Interrupted", "build_model", "train",
           "save_checkpoint", "load_checkpoint", "CHECKPOINT_FORMAT"]

CHECKPOINT_FORMAT = "dpcuda-checkpoint"
CHECKPOINT_VERSION = 1

_ACTIVATION_MODULES = {
    "relu": torch.nn.ReLU, "gelu": torch.nn.GELU, "gelu_tanh": lambda: torch.nn.GELU("tanh"),
    "silu": torch.nn.SiLU, "sigmoid": torch.nn.Sigmoid, "tanh": torch.nn.Tanh,
    "none": torch.nn.Identity,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: missing, truncated, not a dpcuda checkpoint, or of
    another model."""


class Interrupted(Exception):
    """Raised by train() after Ctrl-C, once the last good state is saved."""

    def __init__(self, message, result):
        super().__init__(message)
        self.result = result


@dataclass
class TrainConfig:
    devices: list = field(default_factory=lambda: ["cpu"])  # one entry per replica
    batch_size: int = 256
    lr: float = 0.2
    momentum: float = 0.9
    weight_decay: float = 0.0
    epochs: int = 10
    hidden: int = 256
    activation: str = "relu"
    reducer: str = "p2p"
    split: str = "even"
    split_weights: list = None
    fused: bool = True
    seed: int = 0
    dataset: str = "digits"
    data_dir: str = None
    samples: int = 60000
    features: int = 784
    classes: int = 10
    checkpoint: str = None
    resume: str = None
    progress: bool = True
    log: bool = True


def build_model(features, hidden, classes, activation, fused, seed):
    """The 2-layer MLP: FusedMLP when fused, else nn.Sequential(Linear, act, Linear); both
    draw the same initial weights for a seed."""
    torch.manual_seed(seed)
    if fused:
        return FusedMLP([features, hidden, classes], activation=activation)
    return torch.nn.Sequential(torch.nn.Linear(features, hidden),
                               _ACTIVATION_MODULES[activation](),
                               torch.nn.Linear(hidden, classes))


# ---------------------------------------------------------------------------------------------
# checkpoints

def _model_spec(cfg, dataset):
    return {"features": dataset.features, "hidden": cfg.hidden, "classes": dataset.classes,
            "activation": cfg.activation}


def save_checkpoint(path, payload):
    """Writes payload to path atomically: a temporary file in the same folder, flushed to disk,
    then renamed over path, so a crash leaves either the old checkpoint or the new one."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_checkpoint(path, spec=None):
    """A checkpoint's payload, checked to be a dpcuda checkpoint (of the model spec, if
    given). Raises CheckpointError with a one-line reason otherwise."""
    if not os.path.isfile(path):
        raise CheckpointError(f"--resume {path}: no such file")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, not a pickle, unsupported objects ...
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"--resume {path}: not a readable checkpoint (truncated or "
                              f"another kind of file): {reason[:160]}") from None
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"--resume {path}: not a dpcuda checkpoint")
    if payload.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"--resume {path}: checkpoint version {payload.get('version')} "
                              f"is not supported (this dpcuda writes {CHECKPOINT_VERSION})")
    if spec is not None and payload.get("model") != spec:
        have = payload.get("model") or {}
        raise CheckpointError(
            f"--resume {path}: checkpoint is of a {have.get('features')}-{have.get('hidden')}-"
            f"{have.get('classes')} {have.get('activation')} MLP, this run builds a "
            f"{spec['features']}-{spec['hidden']}-{spec['classes']} {spec['activation']} MLP")
    return payload


# ---------------------------------------------------------------------------------------------
# the run

def _evaluate(module, x, y, device, batch=4096):
    correct = 0
    with torch.no_grad():
        for i in range(0, x.shape[0], batch):
            out = module(x[i:i + batch].to(device))
            correct += int((out.argmax(1).cpu() == y[i:i + batch]).sum())
    return correct / max(1, x.shape[0])


class _StopFlag:
    """Ctrl-C sets the flag; the loop checks it between steps."""

    def __init__(self):
        self.set = False
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.set:  # a second Ctrl-C: stop at once
            raise KeyboardInterrupt
        self.set = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False


def train(cfg, dataset=None, dist_info=None):
    """Runs training as cfg says; returns a dict with every figure of the run.

    dist_info: (rank, world) when running under torch.distributed with reducer "dist"; each
    process then steps on its slice of every global batch.
    """
    rank, world = dist_info or (0, 1)
    lead = rank == 0
    if dataset is None:
        dataset = data_mod.load(cfg.dataset, cfg.data_dir, cfg.samples, cfg.features,
                                cfg.classes, cfg.seed)
    n_train = dataset.x_train.shape[0]
    replicas = len(cfg.devices) * world
    if replicas > n_train:
        raise ValueError(f"{replicas} replicas but only {n_train} training samples")
    if cfg.batch_size < replicas:
        raise ValueError(f"--batch-size {cfg.batch_size} is smaller than the {replicas} "
                         f"replicas; every replica needs at least one row")
    spec = _model_spec(cfg, dataset)
    resumed = load_checkpoint(cfg.resume, spec) if cfg.resume else None

    model = build_model(dataset.features, cfg.hidden, dataset.classes, cfg.activation,
                        cfg.fused, cfg.seed)
    loss_fn = SoftmaxCrossEntropyLoss() if cfg.fused else F.cross_entropy
    dp = DataParallel(model, cfg.devices, reducer=cfg.reducer, split=cfg.split, lr=cfg.lr,
                      momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                      split_weights=cfg.split_weights)
    order_gen = torch.Generator().manual_seed(cfg.seed)
    history, start_epoch, start_step, order = [], 0, 0, None
    partial = {"loss_sum": 0.0, "samples": 0, "seconds": 0.0}
    if resumed is not None:
        keys = list(dp.state_dict().keys())
        params = resumed["parameters"]
        if len(params) != len(keys):
            raise CheckpointError(f"--resume {cfg.resume}: {len(params)} parameter tensors, "
                                  f"the model has {len(keys)}")
        dp.load_state_dict(dict(zip(keys, params)))
        dp.load_optimizer_state_dict(resumed["optimizer"])
        order_gen.set_state(resumed["order_generator"])
        torch.set_rng_state(resumed["torch_rng"])
        history = list(resumed["history"])
        start_epoch, start_step = int(resumed["epoch"]), int(resumed["step"])
        order = resumed["order"]
        partial = dict(resumed["partial"])

    def checkpoint_payload(epoch, step, order, partial):
        return {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "model": spec,
                "parameters": [p.detach().to("cpu", copy=True) for p in dp.module.parameters()],
                "optimizer": dp.optimizer_state_dict(), "epoch": epoch, "step": step,
                "order": order, "order_generator": order_gen.get_state(),
                "torch_rng": torch.get_rng_state(), "history": history,
                "partial": dict(partial), "config": asdict(cfg)}

    def save(epoch, step, order, partial):
        if cfg.checkpoint and lead:
            save_checkpoint(cfg.checkpoint, checkpoint_payload(epoch, step, order, partial))

    steps_per_epoch = math.ceil(n_train / cfg.batch_size)
    result = {"config": asdict(cfg), "replicas": replicas, "devices": list(cfg.devices),
              "dataset": {"name": dataset.name, "train": n_train,
                          "test": dataset.x_test.shape[0], "features": dataset.features,
                          "classes": dataset.classes},
              "resumed_from": cfg.resume, "epochs": history, "interrupted": False}
    progress = None
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
                loss = dp.step(dataset.x_train[idx], dataset.y_train[idx], loss_fn)
                partial["loss_sum"] += loss * rows
                partial["samples"] += rows
                partial["seconds"] += time.perf_counter() - t0
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(loss=f"{loss:.4f}")
                if stop.set:
                    if progress is not None:
                        progress.close()
                    save(epoch, step + 1, order, partial)
                    result["interrupted"] = True
                    where = f"epoch {epoch + 1}, step {step + 1} of {steps_per_epoch}"
                    saved = f"; saved {cfg.checkpoint}" if cfg.checkpoint else ""
                    raise Interrupted(f"interrupted at {where}{saved}", result)
            if progress is not None:
                progress.close()
            accuracy = _evaluate(dp.module, dataset.x_test, dataset.y_test, dp.devices[0])
            record = {"epoch": epoch + 1, "seconds": partial["seconds"],
                      "samples_per_s": partial["samples"] / max(partial["seconds"], 1e-12),
                      "train_loss": partial["loss_sum"] / max(partial["samples"], 1),
                      "test_accuracy": accuracy}
            history.append(record)
            order = None
            save(epoch + 1, 0, None, {"loss_sum": 0.0, "samples": 0, "seconds": 0.0})
            if cfg.log and lead:
                msg = (f"epoch {epoch + 1:>3}/{cfg.epochs}  {record['seconds']:7.2f} s  "
                       f"{record['samples_per_s']:10.0f} samples/s  loss "
                       f"{record['train_loss']:.4f}  test accuracy "
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


def _summary(history):
    if not history:
        return {}
    seconds = sum(r["seconds"] for r in history)
    return {"epochs": len(history), "test_accuracy": history[-1]["test_accuracy"],
            "train_loss": history[-1]["train_loss"], "total_seconds": seconds,
            "mean_epoch_seconds": seconds / len(history),
            "samples_per_s": sum(r["samples_per_s"] * r["seconds"] for r in history)
            / max(seconds, 1e-12)}
