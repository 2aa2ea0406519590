"""Data sets of the training command: scikit-learn's handwritten digits (ships with
scikit-learn, no download), Fashion-MNIST from its standard IDX files, a synthetic set of the
classic 784-feature shape for throughput runs, and the user's own files (read_table: .npz with
arrays x and y, a pair of .npy files, or CSV with a label column).

Every loader returns a Dataset of float32 features standardised with the training split's
mean and standard deviation, and int64 labels.
"""

import gzip
import os
import struct
from dataclasses import dataclass

import numpy as np
import torch

from ._text import first_line

__all__ = ["Dataset", "DataError", "DATASETS", "load", "read_idx", "write_idx", "read_table",
           "paths", "fingerprint", "FASHION_MNIST_FILES", "FILE"]

DATASETS = ("digits", "fashion-mnist", "synthetic")
FILE = "file"  # the dataset name of the user's own files (--data)
# Label columns a CSV header is searched for when none is named (else the last column).
LABEL_NAMES = ("label", "labels", "y", "target", "class")
MAX_CLASSES = 1_000_000  # class indices of the user's files are below this
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
    # What the run's first line says of the data (where the labels came from, test labels the
    # training split lacks), and the files' SHA-256 (the user's own files only).
    note: str = ""
    fingerprint: str = None

    @property
    def features(self):
        """The number of features per row."""
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


# ---------------------------------------------------------------------------------------------
# the user's own files

def _number(text):
    try:
        float(text)
        return True
    except ValueError:
        return False


def _is_header(fields):
    """Whether a CSV's first row names the columns: every field that is not empty is a name
    (not a number), or the row is pandas' default names for a frame's columns, 0, 1, ...,
    n - 1 (what DataFrame(array).to_csv(index=False) writes; as data such a row would be a
    rare coincidence beyond 3 columns)."""
    names = [f for f in fields if f]
    if names and not any(_number(f) for f in names):
        return True
    return len(fields) > 3 and fields == [str(i) for i in range(len(fields))]


def _csv_problem(path, option, skip, width):
    """The first line of the body that does not parse: one line naming it (file line numbers,
    counted from 1, blank lines included)."""
    import csv
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        for row in reader:
            if reader.line_num <= skip or not any(v.strip() for v in row):
                continue
            if len(row) != width:
                return (f"{option} {path}: line {reader.line_num} has {len(row)} fields, the "
                        f"first has {width}")
            for v in row:
                if not _number(v):
                    return (f"{option} {path}: line {reader.line_num} holds a field that is "
                            f"not a number ({v.strip()[:20]!r})")
    return f"{option} {path}: cannot read it as CSV of numbers"


def _csv(path, option, want_labels, label_column):
    """(features, labels or None, which column held the labels) of a CSV file."""
    import csv
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # (a BOM is not a name)
            reader = csv.reader(f)
            first = next((r for r in reader if any(v.strip() for v in r)), None)
            first_at = reader.line_num
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise DataError(f"{option} {path}: cannot read it as CSV "
                        f"({getattr(err, 'strerror', None) or err})") from None
    if first is None:
        raise DataError(f"{option} {path}: no rows")
    fields = [v.strip() for v in first]
    width = len(fields)
    header = fields if _is_header(fields) else None
    skip = first_at if header is not None else first_at - 1
    try:
        table = np.loadtxt(path, delimiter=",", skiprows=skip, dtype=np.float64, ndmin=2,
                           encoding="utf-8-sig", quotechar='"')
    except (ValueError, UnicodeDecodeError):
        raise DataError(_csv_problem(path, option, skip, width)) from None
    if table.size and table.shape[1] != width:
        raise DataError(_csv_problem(path, option, skip, width))
    if table.shape[0] == 0:
        table = table.reshape(0, width)
    column = None
    if label_column is not None:
        if header is not None and label_column in header:
            column = header.index(label_column)
        elif str(label_column).lstrip("-").isdigit() and \
                -width <= int(label_column) < width:
            column = int(label_column) % width
        elif want_labels:
            raise DataError(f"{option} {path}: no column {label_column!r} (--label-column: a "
                            f"header name or a 0-based index of the {width} columns)")
    elif header is not None:
        named = [n for n in LABEL_NAMES if n in header]
        if len(named) > 1 and want_labels:
            raise DataError(f"{option} {path}: the columns {', '.join(map(repr, named))} could "
                            f"each be the labels; name one with --label-column")
        if named:
            column = header.index(named[0])
    if want_labels and column is None:
        column = width - 1
    if column is None:
        return table, None, None
    if width < 2:
        raise DataError(f"{option} {path}: one column: the labels and no features")
    which = repr(header[column]) if header is not None else f"{column} (counting from 0)"
    return np.delete(table, column, axis=1), table[:, column], f"column {which}"


def paths(spec):
    """The files a --data spec names: [spec], or the two of an "X.npy,Y.npy" pair."""
    if "," in spec and not os.path.exists(spec):
        return [part.strip() for part in spec.split(",", 1)]
    return [spec]


def _file(path, option):
    if os.path.isdir(path):
        raise DataError(f"{option} {path}: is a folder, not a file")
    if not os.path.isfile(path):
        raise DataError(f"{option} {path}: no such file")


def _arrays(path, option, want_labels, label_column):
    """(x, y, where the labels came from) as stored (y None where the file has none)."""
    parts = paths(path)
    if len(parts) == 2:
        xs, ys = parts
        if not (xs.endswith(".npy") and ys.endswith(".npy")):
            raise DataError(f"{option} {path}: a pair of files is X.npy,Y.npy")
        if label_column is not None:
            raise DataError(f"{option} {path}: --label-column applies to a CSV file")
        return _npy(xs, option), _npy(ys, option), ys
    _file(path, option)
    ext = os.path.splitext(path)[1].lower()
    if ext == ".csv":
        return _csv(path, option, want_labels, label_column)
    if label_column is not None and want_labels:
        raise DataError(f"{option} {path}: --label-column applies to a CSV file")
    if ext == ".npy":
        if want_labels:
            raise DataError(f"{option} {path}: a .npy file holds no labels; give X.npy,Y.npy, "
                            f"an .npz with arrays x and y, or a CSV with a label column")
        return _npy(path, option), None, None
    if ext == ".npz":
        try:
            with np.load(path, allow_pickle=False) as archive:
                keys = set(archive.files)
                if "x" not in keys or (want_labels and "y" not in keys):
                    raise DataError(f"{option} {path}: an .npz needs arrays named x"
                                    f"{' and y' if want_labels else ''}; it has "
                                    f"{', '.join(sorted(keys)) or 'none'}")
                return (_member(archive, "x", path, option),
                        _member(archive, "y", path, option) if "y" in keys else None, "y")
        except DataError:
            raise
        except Exception as err:
            raise DataError(f"{option} {path}: cannot read it as .npz "
                            f"({first_line(err, 160)})") from None
    raise DataError(f"{option} {path}: unknown kind of file {ext or '(no extension)'!r}; use "
                    f".npz (x, y), X.npy,Y.npy or .csv")


def _member(archive, key, path, option):
    try:
        return archive[key]
    except ValueError as err:
        if "allow_pickle" in str(err):
            raise DataError(f"{option} {path}: array {key} holds Python objects, not numbers")
        raise


def _npy(path, option):
    _file(path, option)
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as err:
        if "allow_pickle" in str(err):
            raise DataError(f"{option} {path}: holds Python objects, not numbers") from None
        raise DataError(f"{option} {path}: cannot read it as .npy "
                        f"({first_line(err, 160)})") from None
    except Exception as err:
        raise DataError(f"{option} {path}: cannot read it as .npy "
                        f"({first_line(err, 160)})") from None


def _real(dtype):
    return np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.floating) or \
        dtype == np.bool_


def read_table(path, option="--data", labels=True, label_column=None):
    """Features and labels from the user's file: (x, y) as a float32 tensor (rows, features)
    and an int64 tensor (rows,), y None when labels=False. path is an .npz with arrays x (and
    y), a pair "X.npy,Y.npy", a single .npy of features (labels=False only), or a CSV file:
    numbers, with or without a header line, the labels in label_column (a header name or a
    0-based index; by default a column named label, labels, y, target or class, else the last
    one; with labels=False only a named or found label column is dropped). A file that cannot
    be read, or whose contents are not that (a feature that is NaN, Inf or beyond float32, a
    label that is not an integer >= 0, a row count that differs between x and y), raises
    DataError with one line naming option, the file and the first bad row."""
    x, y, _ = _read(path, option, labels, label_column)
    return x, y


def _read(path, option, labels, label_column):
    """read_table's work; also says where the labels came from (for the run's first line)."""
    x, y, source = _arrays(path, option, labels, label_column)
    if not isinstance(x, np.ndarray) or not _real(x.dtype):
        raise DataError(f"{option} {path}: the features must be real numbers, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.ndim == 1:
        x = x[:, None]
    if x.ndim != 2 or (labels and x.shape[0] == 0) or x.shape[1] == 0:
        raise DataError(f"{option} {path}: the features must be a (rows, features) table with "
                        f"at least one {'of each' if labels else 'feature'}, got shape "
                        f"{x.shape}")
    with np.errstate(over="ignore", invalid="ignore"):
        x32 = np.asarray(x, dtype=np.float32)
    bad = np.flatnonzero(~np.isfinite(x32).all(axis=1)) if x32.size else []
    if len(bad):
        raise DataError(f"{option} {path}: row {bad[0]} (counting from 0) holds NaN, Inf or a "
                        f"value beyond float32 ({len(bad)} such rows)")
    if not labels:
        return torch.from_numpy(np.ascontiguousarray(x32)), None, None
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1 or y.shape[0] != x.shape[0]:
        raise DataError(f"{option} {path}: {x.shape[0]} rows of features but labels of shape "
                        f"{y.shape}")
    if not _real(y.dtype):
        raise DataError(f"{option} {path}: the labels must be integers >= 0, got {y.dtype}")
    with np.errstate(invalid="ignore"):
        bad = np.flatnonzero(~np.isfinite(y) | (y < 0) | (y != np.floor(y)) | (y > 2 ** 31))
    if len(bad):
        raise DataError(f"{option} {path}: row {bad[0]} (counting from 0): its label "
                        f"{y[bad[0]].item()!r} is not an integer >= 0 (class indices 0, 1, ...)")
    if y.size and y.max() >= MAX_CLASSES:
        raise DataError(f"{option} {path}: a label of {int(y.max())}: class indices must be "
                        f"below {MAX_CLASSES} (a label of n makes a model of n + 1 outputs)")
    return (torch.from_numpy(np.ascontiguousarray(x32)),
            torch.from_numpy(y.astype(np.int64)), source)


def fingerprint(spec):
    """The SHA-256 of the bytes of the files a --data spec names: what a checkpoint keeps of its
    data, so that a resume or an eval finds a file changed since (paths alone cannot)."""
    import hashlib
    digest = hashlib.sha256()
    for path in paths(spec):
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _files(data, test_data, test_fraction, label_column):
    x, y, source = _read(data, "--data", True, label_column)
    notes = [f"labels from {source}"] if source and source != "y" else []
    if test_data:
        same = {os.path.realpath(p) for p in paths(data)} & \
            {os.path.realpath(p) for p in paths(test_data)}
        if same:
            raise DataError(f"--test-data {test_data}: the same file as --data; the test split "
                            f"must be other rows (or leave --test-data out: --test-fraction)")
        x_test, y_test, _ = _read(test_data, "--test-data", True, label_column)
        if x_test.shape[1] != x.shape[1]:
            raise DataError(f"--test-data {test_data}: {x_test.shape[1]} features, --data "
                            f"{data} has {x.shape[1]}")
        x_train, y_train = x, y
    else:
        if not 0 < test_fraction < 1:
            raise DataError(f"--test-fraction must be between 0 and 1, got {test_fraction}")
        test = int(round(len(x) * test_fraction))
        if test < 1 or test >= len(x):
            raise DataError(f"--data {data}: {len(x)} rows leave no "
                            f"{'test' if test < 1 else 'training'} rows at --test-fraction "
                            f"{test_fraction}; give more rows or --test-data")
        # A fixed split (seed 0 of its own generator, as the digits'): runs with different
        # --seed are measured on the same test rows.
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        x_train, y_train = x[perm[test:]], y[perm[test:]]
        x_test, y_test = x[perm[:test]], y[perm[:test]]
    seen = torch.unique(y_train)
    if len(seen) < 2:
        raise DataError(f"--data {data}: every training label is {int(seen[0])}; a classifier "
                        f"needs two classes at least")
    unseen = sorted(set(torch.unique(y_test).tolist()) - set(seen.tolist()))
    if unseen:
        notes.append(f"the test split has {len(unseen)} label"
                     f"{'s' if len(unseen) > 1 else ''} the training split lacks "
                     f"({', '.join(map(str, unseen[:5]))}{', ...' if len(unseen) > 5 else ''})")
    classes = int(max(y_train.max(), y_test.max())) + 1
    name = os.path.basename(paths(data)[0])
    return name, x_train, y_train, x_test, y_test, classes, 1.0, "; ".join(notes)


def load(name, data_dir=None, samples=60000, features=784, classes=10, seed=0, *, data=None,
         test_data=None, test_fraction=0.2, label_column=None):
    """The named data set (one of DATASETS, or FILE: the files data and test_data, read by
    read_table, with test_fraction of data's rows held out when there is no test_data),
    standardised with its training split's statistics."""
    note, digest = "", None
    if name == FILE or data is not None:
        if not data:
            raise DataError("the data set 'file' needs --data PATH")
        if name != FILE:
            raise DataError(f"data {data!r} is the data set {FILE!r}; give dataset={FILE!r} "
                            f"with it (not {name!r})")
        *parts, note = _files(data, test_data, test_fraction, label_column)
        digest = fingerprint(data)
    elif name == "digits":
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
                   mean, std, divisor, note, digest)
