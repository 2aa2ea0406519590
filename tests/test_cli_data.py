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

from cli_run import run
from dpcuda import data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    with pytest.raises(data.DataError, match=r"row 0 \(counting from 0\): its label .* is not an integer >= 0"):
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
        (["--data", str(tmp_path / "frac.csv")], "row 1 (counting from 0): its label 1.5 is not an integer >= 0"),
        (["--data", str(tmp_path / "neg.csv")], "row 1 (counting from 0): its label -1.0 is not an integer >= 0"),
        (["--data", str(tmp_path / "nan.csv")], "row 1 (counting from 0) holds NaN, Inf"),
        (["--data", str(tmp_path / "one.csv")], "every training label is 0"),
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


# ---------------------------------------------------------------------------------------------
# what a review found (each trained on the wrong labels or rows, or lost a file, before)

def test_csv_headers_the_way_spreadsheets_and_pandas_write_them(tmp_path):
    x, y = blobs(30)
    # Excel's "CSV UTF-8": a byte-order mark before the header
    write_csv(tmp_path / "bom.csv", x, y, header=True, label_first=True)
    text = (tmp_path / "bom.csv").read_text()
    (tmp_path / "bom.csv").write_text("\ufeff" + text, encoding="utf-8")
    xs, ys = data.read_table(str(tmp_path / "bom.csv"))
    assert xs.shape == (30, 6) and torch.equal(ys, torch.from_numpy(y))
    # pandas' DataFrame(array).to_csv(index=False): a header of 0, 1, ..., n - 1
    rows = "\n".join(",".join([*(f"{v:.6f}" for v in r), str(l)]) for r, l in zip(x, y))
    (tmp_path / "pandas.csv").write_text(",".join(map(str, range(7))) + "\n" + rows + "\n")
    xs, ys = data.read_table(str(tmp_path / "pandas.csv"))
    assert xs.shape == (30, 6) and torch.equal(ys, torch.from_numpy(y))
    # an empty field in the first row is a bad field, not a header (file line numbers)
    (tmp_path / "empty.csv").write_text("1,,0\n\n3,4,1\n")
    with pytest.raises(data.DataError, match="line 1 holds a field that is not a number"):
        data.read_table(str(tmp_path / "empty.csv"))
    (tmp_path / "later.csv").write_text("1,2,0\n\n3,,1\n")
    with pytest.raises(data.DataError, match="line 3 holds a field that is not a number"):
        data.read_table(str(tmp_path / "later.csv"))
    # two columns that could each be the labels: refused, not a guess
    (tmp_path / "two.csv").write_text("x,y,class\n1,2,0\n3,4,1\n")
    with pytest.raises(data.DataError, match="'y', 'class' could each be the labels"):
        data.read_table(str(tmp_path / "two.csv"))
    xs, ys = data.read_table(str(tmp_path / "two.csv"), label_column="class")
    assert ys.tolist() == [0, 1] and xs.tolist() == [[1, 2], [3, 4]]


def test_outputs_never_overwrite_the_inputs(tmp_path):
    x, y = blobs(60)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    write_csv(tmp_path / "d.csv", x, y)
    pair = f"{tmp_path / 'x.npy'},{tmp_path / 'y.npy'}"
    quick = ("train", "--no-progress", "--epochs", "1", "--hidden", "8", "--batch-size", "16")
    one_line_error(run(*quick, "--data", str(tmp_path / "d.csv"), "--json",
                       str(tmp_path / "d.csv")), "name the same file")
    one_line_error(run(*quick, "--data", pair, "--checkpoint", str(tmp_path / "x.npy"),
                       "--overwrite"), "name the same file")
    ck = tmp_path / "ck.pt"
    assert run(*quick, "--data", pair, "--checkpoint", str(ck)).returncode == 0
    one_line_error(run("eval", "--checkpoint", str(ck), "--data", pair, "--json",
                       str(tmp_path / "y.npy")), "name the same file")
    one_line_error(run("predict", "--checkpoint", str(ck), "--input", pair, "--output",
                       str(tmp_path / "y.npy")), "name the same file")
    assert np.array_equal(np.load(tmp_path / "y.npy"), y)  # untouched
    one_line_error(run(*quick, "--data", pair, "--test-data", pair), "name the same file")


def test_the_training_data_is_known_by_its_contents_not_its_path(tmp_path, monkeypatch):
    x, y = blobs(100)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    ck = tmp_path / "ck.pt"
    monkeypatch.chdir(tmp_path)
    base = ("train", "--no-progress", "--hidden", "8", "--batch-size", "16", "--checkpoint",
            str(ck))
    env_run = lambda *a: run(*a, cwd=tmp_path)  # noqa: E731 (a relative --data)
    assert env_run(*base, "--data", "d.npz", "--epochs", "1").returncode == 0
    # the same file spelled otherwise resumes; eval from another folder finds it
    proc = env_run(*base, "--data", "./d.npz", "--epochs", "2", "--resume", str(ck))
    assert proc.returncode == 0, proc.stderr
    proc = run("eval", "--checkpoint", str(ck))
    assert proc.returncode == 0 and "d.npz test split: 20 samples" in proc.stdout, proc.stderr
    # the same path with other contents: refused by resume and eval
    np.savez(tmp_path / "d.npz", x=x * 3 + 5, y=y)
    one_line_error(env_run(*base, "--data", "d.npz", "--epochs", "3", "--resume", str(ck)),
                   "the file's contents differ from those the checkpoint trained on")
    one_line_error(run("eval", "--checkpoint", str(ck)), "has changed since")


def test_load_refuses_data_under_another_data_set_name(tmp_path):
    x, y = blobs(40)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    with pytest.raises(data.DataError, match="give dataset='file' with it"):
        data.load("digits", data=str(tmp_path / "d.npz"))


def test_eval_data_refuses_a_checkpoint_without_its_standardisation(tmp_path):
    from dpcuda.train import load_checkpoint, save_checkpoint
    x, y = blobs(100)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    ck = tmp_path / "ck.pt"
    assert run("train", "--no-progress", "--epochs", "1", "--hidden", "8", "--batch-size", "16",
               "--data", str(tmp_path / "d.npz"), "--checkpoint", str(ck)).returncode == 0
    payload = load_checkpoint(str(ck))
    v1 = {k: v for k, v in payload.items() if k not in ("model_state_dict", "normalization")}
    v1["version"] = 1
    v1["parameters"] = list(payload["model_state_dict"].values())
    save_checkpoint(str(tmp_path / "v1.pt"), v1)
    one_line_error(run("eval", "--checkpoint", str(tmp_path / "v1.pt"), "--data",
                       str(tmp_path / "d.npz")), "saved no standardisation")


def test_predict_on_features_only_and_on_the_training_csv_itself(tmp_path):
    x, y = blobs(200)
    with open(tmp_path / "t.csv", "w") as f:
        f.write("a,b,c,d,e,f,cls\n")
        for row, label in zip(x, y):
            f.write(",".join(f"{v:.6f}" for v in row) + f",{label}\n")
    ck = tmp_path / "ck.pt"
    proc = run("train", "--no-progress", "--epochs", "3", "--hidden", "16", "--batch-size", "32",
               "--lr", "0.05", "--data", str(tmp_path / "t.csv"), "--label-column", "cls",
               "--checkpoint", str(ck))
    assert proc.returncode == 0 and "labels from column 'cls'" in proc.stdout, proc.stderr
    want = None
    for name, header, labels in (("features.csv", "a,b,c,d,e,f\n", False),
                                 ("t.csv", None, True), ("bare.csv", "", True)):
        if header is not None:
            with open(tmp_path / name, "w") as f:
                f.write(header)
                for row, label in zip(x, y):
                    f.write(",".join(f"{v:.6f}" for v in row) + (f",{label}" if labels else "")
                            + "\n")
        proc = run("predict", "--checkpoint", str(ck), "--input", str(tmp_path / name),
                   "--output", str(tmp_path / "p.npy"))
        assert proc.returncode == 0, (name, proc.stderr)
        got = np.load(tmp_path / "p.npy")
        want = got if want is None else want
        assert np.array_equal(got, want), name  # the same rows, the same predictions
    assert (want == y).mean() > 0.9


def test_labels_a_classifier_cannot_learn_from_are_refused(tmp_path):
    x, _ = blobs(40)
    quick = ("train", "--no-progress", "--epochs", "1", "--hidden", "8", "--batch-size", "8")
    np.savez(tmp_path / "five.npz", x=x, y=np.full(40, 5))
    one_line_error(run(*quick, "--data", str(tmp_path / "five.npz")),
                   "every training label is 5")
    big = np.zeros(40, dtype=np.int64)
    big[::2] = 1
    big[3] = 10 ** 6
    np.savez(tmp_path / "big.npz", x=x, y=big)
    one_line_error(run(*quick, "--data", str(tmp_path / "big.npz")),
                   "a label of 1000000: class indices must be below 1000000")
    # labels only the test split has: said in the run's first line
    xt, yt = blobs(10, seed=3)
    np.savez(tmp_path / "a.npz", x=x, y=np.arange(40) % 2)
    np.savez(tmp_path / "t.npz", x=xt, y=np.full(10, 2))
    proc = run(*quick, "--data", str(tmp_path / "a.npz"), "--test-data", str(tmp_path / "t.npz"))
    assert proc.returncode == 0, proc.stderr
    assert "the test split has 1 label the training split lacks (2)" in proc.stdout


def test_the_scaling_benchmark_takes_no_data_files():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_scaling.py"),
                           "--data", "x.npz"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2 and "unrecognized arguments: --data x.npz" in proc.stderr


def test_a_replaced_file_keeps_its_permissions(tmp_path):
    from dpcuda.checkpoint import write_json
    out = tmp_path / "r.json"
    out.write_text("{}")
    os.chmod(out, 0o600)
    write_json(str(out), {"a": 1})
    assert json.loads(out.read_text()) == {"a": 1}
    assert os.stat(out).st_mode & 0o777 == 0o600
