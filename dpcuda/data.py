"""Data sets of the training command: scikit-learn's handwritten digits (ships with
scikit-learn, no download), Fashion-MNIST from its standard IDX files, and a synthetic set of
the classic 784-feature shape for throughput runs.

Every loader returns a Dataset of float32 features standardised with the training split's
mean and standard deviation, and int64 labels.
"""

import gzip
import os
import struct
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Dataset", "DataError", "DATASETS", "load", "read_idx", "write_idx",
           "FASHION_MNIST_FILES"]

DATASETS = ("digits", "fashion-mnist", "synthetic")
FASHION_MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


class DataError(ValueError):
    """A data set that cannot be loaded: missing files, a malformed file, bad sizes."""


@dataclass
class Dataset:
    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    classes: int
    # The preprocessing of raw features (as the source gives them: the digits' pixels 0-16,
    # Fashion-MNIST's 0-255): x = (x_raw / divisor - mean) / std.
    mean: torch.Tensor = None
    std: torch.Tensor = None
    divisor: float = 1.0

    @property
    def features(self):
        return self.x_train.shape[1]


# ---------------------------------------------------------------------------------------------
# IDX (the MNIST file format): magic 0x0000 | dtype code | ndim, then ndim big-endian uint32
# sizes, then the data, big-endian.

_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_IDX_CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09}


def read_idx(path):
    """The array stored in an IDX file (gzip-compressed when its name ends in .gz)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as err:
        raise DataError(f"{path}: cannot read ({err})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise DataError(f"{path}: not an IDX file (bad magic number)")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: truncated IDX header")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = np.dtype(_IDX_TYPES[raw[2]])
    count = int(np.prod(shape)) if shape else 1
    if len(raw) - header != count * dtype.itemsize:
        raise DataError(f"{path}: IDX header says {count} values of {dtype.itemsize} bytes but "
                        f"the file holds {len(raw) - header} bytes of data")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape).astype(
        dtype.newbyteorder("="))


def write_idx(path, array):
    """Writes a uint8 or int8 array as an IDX file (gzip-compressed for a .gz name)."""
    array = np.ascontiguousarray(array)
    code = _IDX_CODES[array.dtype]
    payload = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload += array.tobytes()
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(payload)


def _find(data_dir, stem):
    for name in (stem + ".gz", stem):
        path = os.path.join(data_dir, name)
        if os.path.isfile(path):
            return path
    return None


def _fashion_mnist(data_dir):
    if not data_dir:
        raise DataError("--dataset fashion-mnist needs --data-dir, the folder holding "
                        + ", ".join(f + ".gz" for f in FASHION_MNIST_FILES.values()))
    if not os.path.isdir(data_dir):
        raise DataError(f"--data-dir {data_dir}: no such folder")
    paths = {key: _find(data_dir, stem) for key, stem in FASHION_MNIST_FILES.items()}
    missing = [FASHION_MNIST_FILES[k] + ".gz" for k, p in paths.items() if p is None]
    if missing:
        raise DataError(f"--data-dir {data_dir}: missing {', '.join(missing)}")
    arrays = {key: read_idx(path) for key, path in paths.items()}
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        name = paths[f"{split}_images"]
        if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
            raise DataError(f"--data-dir {data_dir}: {split} images of shape {images.shape} do "
                            f"not match labels of shape {labels.shape}")
        if images.shape[0] == 0:
            raise DataError(f"{name}: no images")
    if arrays["train_images"].shape[1:] != arrays["test_images"].shape[1:]:
        raise DataError(f"{paths['test_images']}: images of {arrays['test_images'].shape[1:]} "
                        f"pixels, the train images have {arrays['train_images'].shape[1:]}")
    x_train = torch.from_numpy(arrays["train_images"].reshape(len(arrays["train_images"]), -1))
    x_test = torch.from_numpy(arrays["test_images"].reshape(len(arrays["test_images"]), -1))
    y_train = torch.from_numpy(arrays["train_labels"].astype(np.int64))
    y_test = torch.from_numpy(arrays["test_labels"].astype(np.int64))
    classes = int(max(y_train.max().item(), y_test.max().item())) + 1
    return ("fashion-mnist", x_train.float() / 255, y_train, x_test.float() / 255, y_test,
            classes, 255.0)


# load_digits() gives pixels 0-16; training divides them by this first.
DIGITS_DIVISOR = 16.0


def _digits():
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / DIGITS_DIVISOR
    y = torch.tensor(digits.target, dtype=torch.int64)
    # A fixed 80/20 split, the same for every run (seed 0 of its own generator), so accuracies
    # of different runs are measured on the same test images.
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    test = len(x) // 5
    return ("digits", x[perm[test:]], y[perm[test:]], x[perm[:test]], y[perm[:test]], 10,
            DIGITS_DIVISOR)


def _synthetic(samples, features, classes, seed):
    if samples < 2:
        raise DataError(f"--samples must be at least 2, got {samples}")
    if features < 1 or classes < 2:
        raise DataError(f"--features must be >= 1 and --classes >= 2, got {features}, "
                        f"{classes}")
    gen = torch.Generator().manual_seed(1000 + seed)
    # Class centres about 6 noise standard deviations apart whatever the feature count: a
    # nearest-centre classifier gets about 99% at 784 features, and the default MLP run
    # converges (loss falling every epoch, about 96-97% after 3 epochs). At 4 apart (an older
    # choice) the 784-feature MLP overfitted the noise and its loss rose at lr 0.4.
    centres = torch.randn(classes, features, generator=gen) * (18.0 / features) ** 0.5
    y = torch.randint(0, classes, (samples,), generator=gen)
    x = centres[y] + torch.randn(samples, features, generator=gen)
    test = max(1, samples // 5)
    return "synthetic", x[test:], y[test:], x[:test], y[:test], classes, 1.0


def load(name, data_dir=None, samples=60000, features=784, classes=10, seed=0):
    """The named data set (one of DATASETS), standardised with its training split's
    statistics."""
    if name == "digits":
        parts = _digits()
    elif name == "fashion-mnist":
        parts = _fashion_mnist(data_dir)
    elif name == "synthetic":
        parts = _synthetic(samples, features, classes, seed)
    else:
        raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    name, x_train, y_train, x_test, y_test, classes, divisor = parts
    if x_train.shape[0] == 0 or x_test.shape[0] == 0:
        raise DataError(f"{name}: the {'train' if x_train.shape[0] == 0 else 'test'} split "
                        f"has no samples")
    mean = x_train.mean(0)
    std = x_train.std(0).clamp_min(0.1)
    return Dataset(name, ((x_train - mean) / std).contiguous(), y_train.contiguous(),
                   ((x_test - mean) / std).contiguous(), y_test.contiguous(), classes,
                   mean, std, divisor)
