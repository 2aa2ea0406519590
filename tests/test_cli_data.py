"""`dpcuda train --data`: the user's own data (.npz, a pair of .npy files, CSV with a label
column), its test split, `eval --data` and `predict` on the same kinds of file, and every bad
file refused with one line and exit status 2 before any training (dpcuda.data.read_table)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from dpcuda import data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "dpcuda", *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=env)


def one_line_error(proc, message):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def blobs(rows=300, features=6, classes=3, seed=0):
    """Separable classes: a trained MLP must score well above chance on them."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, features)) * 4
    y = rng.integers(0, classes, rows)
    return (centres[y] + rng.normal(size=(rows, features))).astype(np.float64), y


def write_csv(path, x, y, header=True, label_first=False):
    with open(path, "w") as f:
        cols = [f"f{i}" for i in range(x.shape[1])]
        if header:
            f.write(",".join(["label", *cols] if label_first else [*cols, "label"]) + "\n")
        for row, label in zip(x, y):
            values = [f"{v:.6f}" for v in row]
            f.write(",".join([str(label), *values] if label_first else [*values, str(label)])
                    + "\n")


def test_read_table_reads_every_kind_the_same(tmp_path):
    x, y = blobs(20)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    write_csv(tmp_path / "h.csv", x, y, header=True, label_first=True)
    write_csv(tmp_path / "n.csv", x, y, header=False)
    want = torch.from_numpy(x.astype(np.float32))
    for spec in ("d.npz", "x.npy,y.npy", "h.csv", "n.csv"):
        path = ",".join(str(tmp_path / p) for p in spec.split(","))
        xs, ys = data.read_table(path)
        assert ys.dtype == torch.int64 and torch.equal(ys, torch.from_numpy(y)), spec
        tol = 1e-6 if spec.endswith("csv") else 0  # (the CSV holds 6 decimals)
        torch.testing.assert_close(xs, want, atol=tol, rtol=tol, msg=spec)
    # the label column by name or index; without labels a found label column is left out
    xs, _ = data.read_table(str(tmp_path / "h.csv"), labels=False)
    assert xs.shape == (20, 6)
    write_csv(tmp_path / "first.csv", x, y, header=False, label_first=True)
    xs, ys = data.read_table(str(tmp_path / "first.csv"), label_column="0")
    assert xs.shape == (20, 6) and torch.equal(ys, torch.from_numpy(y))
    with pytest.raises(data.DataError, match=r"row 0's label .* is not an integer >= 0"):
        data.read_table(str(tmp_path / "n.csv"), label_column="0")  # a feature column


@pytest.mark.parametrize("kind", ["npz", "npy", "csv"])
def test_train_eval_and_predict_on_your_own_data(tmp_path, kind):
    x, y = blobs(400)
    if kind == "npz":
        np.savez(tmp_path / "train.npz", x=x, y=y)
        spec = str(tmp_path / "train.npz")
    elif kind == "npy":
        np.save(tmp_path / "x.npy", x)
        np.save(tmp_path / "y.npy", y)
        spec = f"{tmp_path / 'x.npy'},{tmp_path / 'y.npy'}"
    else:
        write_csv(tmp_path / "train.csv", x, y)
        spec = str(tmp_path / "train.csv")
    ck, out = tmp_path / "ck.pt", tmp_path / "run.json"
    proc = run("train", "--no-progress", "--data", spec, "--hidden", "16,8", "--epochs", "3",
               "--batch-size", "32", "--lr", "0.05", "--checkpoint", str(ck), "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["dataset"] == {"name": os.path.basename(spec.split(",")[0]), "train": 320,
                                 "test": 80, "features": 6, "classes": 3}
    assert result["final"]["test_accuracy"] > 0.9
    # eval: the checkpoint's own test split by default, any file with --data
    proc = run("eval", "--checkpoint", str(ck))
    assert proc.returncode == 0, proc.stderr
    assert f"accuracy {100 * result['final']['test_accuracy']:.2f}%" in proc.stdout
    x2, y2 = blobs(50, seed=0)  # the same classes (same centres), new rows
    write_csv(tmp_path / "new.csv", x2, y2)
    proc = run("eval", "--checkpoint", str(ck), "--data", str(tmp_path / "new.csv"))
    assert proc.returncode == 0 and "new.csv: 50 samples" in proc.stdout, proc.stderr
    # predict on a CSV with its label column (left out) and on a .npy of features
    for name in ("new.csv", "new.npy"):
        if name == "new.npy":
            np.save(tmp_path / name, x2)
        proc = run("predict", "--checkpoint", str(ck), "--input", str(tmp_path / name),
                   "--output", str(tmp_path / "pred.npy"))
        assert proc.returncode == 0, proc.stderr
        pred = np.load(tmp_path / "pred.npy")
        assert pred.shape == (50,) and (pred == y2).mean() > 0.9, name


def test_test_data_and_test_fraction(tmp_path):
    x, y = blobs(200)
    np.savez(tmp_path / "a.npz", x=x, y=y)
    xt, yt = blobs(40, seed=0)
    np.savez(tmp_path / "t.npz", x=xt, y=yt)
    ds = data.load(data.FILE, data=str(tmp_path / "a.npz"), test_data=str(tmp_path / "t.npz"))
    assert ds.x_train.shape == (200, 6) and ds.x_test.shape == (40, 6)
    ds = data.load(data.FILE, data=str(tmp_path / "a.npz"), test_fraction=0.25)
    assert ds.x_train.shape == (150, 6) and ds.x_test.shape == (50, 6)
    # the split is the same draw for any --seed (a fixed generator)
    again = data.load(data.FILE, data=str(tmp_path / "a.npz"), test_fraction=0.25, seed=7)
    assert torch.equal(ds.y_test, again.y_test)


def test_bad_files_are_one_line_and_status_2(tmp_path):
    x, y = blobs(30)
    np.savez(tmp_path / "ok.npz", x=x, y=y)
    np.savez(tmp_path / "noy.npz", x=x)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "short.npy", y[:10])
    (tmp_path / "text.csv").write_text("a,b,label\n1,2,0\n3,oops,1\n")
    (tmp_path / "ragged.csv").write_text("1,2,0\n3,4\n")
    (tmp_path / "frac.csv").write_text("1,2,0\n3,4,1.5\n5,6,1\n")
    (tmp_path / "neg.csv").write_text("1,2,0\n3,4,-1\n5,6,1\n")
    (tmp_path / "nan.csv").write_text("1,2,0\n3,nan,1\n5,6,1\n")
    (tmp_path / "one.csv").write_text("1,0\n2,0\n3,0\n4,0\n5,0\n")
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    (tmp_path / "x.txt").write_text("1,2,3\n")
    ok = str(tmp_path / "ok.npz")
    quick = ("train", "--no-progress", "--epochs", "1")
    cases = [
        (["--data", str(tmp_path / "none.npz")], "none.npz: no such file"),
        (["--data", str(tmp_path / "noy.npz")], "an .npz needs arrays named x and y; it has x"),
        (["--data", str(tmp_path / "x.npy")], "a .npy file holds no labels"),
        (["--data", f"{tmp_path / 'x.npy'},{tmp_path / 'short.npy'}"],
         "30 rows of features but labels of shape (10,)"),
        (["--data", str(tmp_path / "text.csv")], "line 3 holds a field that is not a number"),
        (["--data", str(tmp_path / "ragged.csv")], "line 2 has 2 fields, the first has 3"),
        (["--data", str(tmp_path / "frac.csv")], "row 1's label 1.5 is not an integer >= 0"),
        (["--data", str(tmp_path / "neg.csv")], "row 1's label -1.0 is not an integer >= 0"),
        (["--data", str(tmp_path / "nan.csv")], "row 1 holds NaN, Inf"),
        (["--data", str(tmp_path / "one.csv")], "every label is 0"),
        (["--data", str(tmp_path / "bad.npz")], "cannot read it as .npz"),
        (["--data", str(tmp_path / "x.txt")], "unknown kind of file '.txt'"),
        (["--data", ok, "--dataset", "digits"], "--data and --dataset digits: give one"),
        (["--test-fraction", "0.3"], "--test-fraction applies to --data"),
        (["--data", ok, "--test-fraction", "1.5"], "must be a number between 0 and 1"),
        (["--data", ok, "--test-data", ok, "--test-fraction", "0.3"], "give one"),
        (["--data", ok, "--label-column", "nope"], "no column 'nope'"),
        (["--data", ok, "--batch-size", "100"], "--batch-size 100 is larger than the training "
                                                "set (24 samples)"),
    ]
    (tmp_path / "ok.csv").write_text("1,2,0\n3,4,1\n")
    cases[-2] = (["--data", str(tmp_path / "ok.csv"), "--label-column", "nope"],
                 "no column 'nope'")
    for args, message in cases:
        one_line_error(run(*quick, *args), message)


def test_resume_refuses_other_data(tmp_path):
    x, y = blobs(100)
    np.savez(tmp_path / "a.npz", x=x, y=y)
    np.savez(tmp_path / "b.npz", x=x, y=y)
    ck = tmp_path / "ck.pt"
    base = ("train", "--no-progress", "--hidden", "8", "--batch-size", "16", "--checkpoint",
            str(ck))
    assert run(*base, "--data", str(tmp_path / "a.npz"), "--epochs", "1").returncode == 0
    one_line_error(run(*base, "--data", str(tmp_path / "b.npz"), "--epochs", "2", "--resume",
                       str(ck)), "--data")
    proc = run(*base, "--data", str(tmp_path / "a.npz"), "--epochs", "2", "--resume", str(ck))
    assert proc.returncode == 0, proc.stderr
