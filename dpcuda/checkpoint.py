"""dpcuda's files: the checkpoint format of `dpcuda train` (what it holds, its versions, its
checks on loading), the model it describes, and the one atomic writer behind every file the
command line writes (checkpoints, JSON results, predictions) with the checks of an output path
before a run starts and the lock that keeps two runs off one checkpoint.
"""

import json
import math
import os
import shutil
import tempfile

import torch

from ._text import first_line
from .nn import FusedMLP

__all__ = ["CHECKPOINT_FORMAT", "CHECKPOINT_VERSION", "CheckpointError", "OutputError",
           "WriteError", "atomic_write", "save_checkpoint", "write_json", "check_output_path",
           "lock_checkpoint", "load_checkpoint", "load_checkpoint_model", "model_from_payload",
           "Standardized",
           "widths", "describe"]

CHECKPOINT_FORMAT = "dpcuda-checkpoint"
CHECKPOINT_VERSION = 3
# version 1: the weights as an unnamed list, no normalisation; version 2: the wrapper's SGD
# state only; version 3: "optimizer" in torch.optim's format when a dpcuda.optim optimizer ran
# ("optimizer_kind" says which), and the learning-rate schedule's state.
_READABLE_VERSIONS = (1, 2, 3)


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: missing, truncated, not a dpcuda checkpoint, or of
    another model."""


class OutputError(ValueError):
    """An output path (--checkpoint, --json) that cannot be written: found before training."""


class WriteError(OSError):
    """A write that failed during the run (a full disk, say); the previous file is intact."""


def hidden_widths(hidden):
    """The hidden layers' widths as a list (checkpoints before version 3 hold one int)."""
    return [int(hidden)] if isinstance(hidden, int) else [int(h) for h in hidden]


def widths(spec):
    """The layer widths a checkpoint's model spec describes: [features, *hidden, classes]."""
    return [spec["features"], *hidden_widths(spec["hidden"]), spec["classes"]]


def describe(spec):
    """A model spec as text: its widths joined by dashes (64-256-10)."""
    return "-".join(map(str, widths(spec)))


def _os_error(err):
    """The OSError behind err (torch.save wraps a failed write in a RuntimeError)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def atomic_write(path, write, what="file"):
    """The one way dpcuda writes a file the user keeps (checkpoints, JSON results,
    predictions): write(f) fills a temporary file in path's folder, which is flushed to disk
    and then renamed over path, so a crash or a full disk leaves the old file or the new one,
    never a torn one. A symlink at path stays one (its target is written). A failed write
    raises WriteError naming `what`, the path and the system's reason. A file it replaces keeps
    its permissions."""
    target = os.path.realpath(path)
    folder = os.path.dirname(target)
    tmp = os.path.join(folder, f".{os.path.basename(target)}.tmp-{os.getpid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(target):  # the file it replaces keeps its permissions
            os.chmod(tmp, os.stat(target).st_mode & 0o7777)
        os.replace(tmp, target)
    except Exception as err:
        cause = _os_error(err)
        reason = (cause.strerror or str(cause)) if cause is not None else \
            (str(err).splitlines() or [type(err).__name__])[0]
        kept = f"; the previous {what}, if any, is intact" if what == "checkpoint" else ""
        raise WriteError(f"cannot write the {what} {path}: {reason}{kept}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save_checkpoint(path, payload):
    """Writes a checkpoint payload to path atomically (atomic_write). A failed write raises
    WriteError naming the path and the system's reason; the previous checkpoint is intact."""
    atomic_write(path, lambda f: torch.save(payload, f), "checkpoint")


def check_output_path(path, option, need_bytes=0):
    """Before the first step: path can be written (not a folder, its folder exists or can be
    made, files can be created there) and its disk has need_bytes free. OutputError if not."""
    if os.path.isdir(path):
        raise OutputError(f"{option} {path}: is a folder, not a file")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        raise OutputError(f"{option} {path}: cannot make its folder {folder}: "
                          f"{err.strerror or err}") from None
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{os.path.basename(path)}.probe-"):
            pass
    except OSError as err:
        raise OutputError(f"{option} {path}: cannot write in {folder}: "
                          f"{err.strerror or err}") from None
    if need_bytes:
        free = shutil.disk_usage(folder).free
        if free < need_bytes:
            raise OutputError(f"{option} {path}: {free} bytes free in {folder}, a checkpoint "
                              f"needs about {need_bytes}")


def _fused_keys(spec):
    model = FusedMLP(widths(spec), activation=spec["activation"], device="meta")
    return list(model.state_dict().keys())


def load_checkpoint(path, spec=None, option="--resume"):
    """A checkpoint's payload, checked to be a dpcuda checkpoint (of the model spec, if
    given), with its weights under "model_state_dict" (FusedMLP's keys) whatever its version.
    Raises CheckpointError with a one-line reason otherwise."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{option} {path}: no such file")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, not a pickle, unsupported objects ...
        raise CheckpointError(f"{option} {path}: not a readable checkpoint (truncated or "
                              f"another kind of file): {first_line(err, 160)}") from None
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{option} {path}: not a dpcuda checkpoint")
    if payload.get("version") not in _READABLE_VERSIONS:
        raise CheckpointError(f"{option} {path}: checkpoint version {payload.get('version')} "
                              f"is not supported (this dpcuda reads versions "
                              f"{', '.join(map(str, _READABLE_VERSIONS))})")
    if spec is not None:
        _check_spec(path, payload, spec, option)
    model = payload.get("model")
    if not isinstance(model, dict) or not {"features", "hidden", "classes", "activation"} <= \
            set(model):
        raise CheckpointError(f"{option} {path}: the checkpoint does not describe its model")
    if payload["version"] == 1:
        keys = _fused_keys(model)
        if len(payload["parameters"]) != len(keys):
            raise CheckpointError(f"{option} {path}: {len(payload['parameters'])} parameter "
                                  f"tensors, the model has {len(keys)}")
        payload["model_state_dict"] = dict(zip(keys, payload["parameters"]))
        payload["normalization"] = None
    # The weights must fit the model the checkpoint describes.
    try:
        want = FusedMLP(widths(model), activation=model["activation"],
                        device="meta").state_dict()
    except (TypeError, ValueError):
        raise CheckpointError(f"{option} {path}: the checkpoint does not describe its "
                              f"model") from None
    have = payload.get("model_state_dict")
    if not isinstance(have, dict) or list(have) != list(want) or any(
            not isinstance(have[k], torch.Tensor) or have[k].shape != want[k].shape
            for k in want):
        raise CheckpointError(f"{option} {path}: its weights do not fit the "
                              f"{describe(model)} MLP it describes")
    return payload


def _check_spec(path, payload, spec, option="--resume"):
    have = payload.get("model")
    try:
        same = dict(have, hidden=hidden_widths(have["hidden"])) == \
            dict(spec, hidden=hidden_widths(spec["hidden"]))
        shown = f"{describe(have)} {have.get('activation')}"
    except (TypeError, ValueError, KeyError):
        same, shown = False, "an undescribed"
    if not same:
        raise CheckpointError(
            f"{option} {path}: checkpoint is of a {shown} MLP, this run builds a "
            f"{describe(spec)} {spec['activation']} MLP")


class Standardized(torch.nn.Module):
    """A trained model with every preprocessing step of its training data: forward(x) =
    model((x / divisor - mean) / std) on raw features, as the data set's source gives them
    (the digits' pixels as load_digits() gives them, 0-16)."""

    def __init__(self, model, mean, std, divisor=1.0):
        super().__init__()
        self.model = model
        self.divisor = float(divisor)
        self.register_buffer("mean", mean.detach().clone())
        self.register_buffer("std", std.detach().clone())

    def forward(self, x):
        """The model's output on raw features, standardised first."""
        return self.model((x / self.divisor - self.mean) / self.std)


def load_checkpoint_model(path, device="cpu"):
    """The model a `dpcuda train` checkpoint holds, ready for inference (eval mode): a
    Standardized(FusedMLP) that takes raw features. Version 1 checkpoints, which did not save
    the standardisation, give the bare FusedMLP (it takes standardised features)."""
    return model_from_payload(load_checkpoint(path, option="--checkpoint"), device)


def model_from_payload(payload, device="cpu"):
    """load_checkpoint_model's model from a payload load_checkpoint already read."""
    spec = payload["model"]
    model = FusedMLP(widths(spec), activation=spec["activation"])
    model.load_state_dict(payload["model_state_dict"])
    norm = payload.get("normalization")
    if norm is not None:
        # (checkpoints before the divisor was saved took features already divided)
        model = Standardized(model, norm["mean"], norm["std"], norm.get("divisor", 1.0))
    return model.to(device).eval()


def _finite(value):
    """value with every non-finite float replaced by None (JSON has no NaN or Infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json(path, payload):
    """payload as JSON at path, atomically (atomic_write) and valid (null for a non-finite
    number). A failed write raises WriteError naming the path."""
    text = json.dumps(_finite(payload), indent=2, allow_nan=False).encode()
    atomic_write(path, lambda f: f.write(text), "JSON file")


def lock_checkpoint(path, option="--checkpoint"):
    """One run at a time per checkpoint: an exclusive lock on PATH.lock. Returns the open lock
    file, which the caller keeps for the run: the lock is held until it is closed (a context
    manager; dropping the last reference closes it too), or until the process ends, however it
    ends, when the system drops it; the file stays. OutputError if path cannot be written or
    another run (another process, or one still open in this one) holds the lock."""
    import fcntl
    check_output_path(path, option)  # (the room it needs is checked once it is sized)
    lock = os.path.realpath(path) + ".lock"
    try:
        os.makedirs(os.path.dirname(lock), exist_ok=True)
        f = open(lock, "a+")
    except OSError as err:
        raise OutputError(f"{option} {path}: cannot create its lock file {lock}: "
                          f"{err.strerror or err}") from None
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise OutputError(f"{option} {path}: another run is writing it (its lock {lock} is "
                          f"held)") from None
    return f
