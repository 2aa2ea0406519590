"""The training command end to end: default data with 1 and 2 replicas, the JSON schema,
checkpoints and resume, Ctrl-C, bad options and bad checkpoints, the IDX reader."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from cli_run import run as run_cli
from dpcuda import data
from dpcuda.train import TrainConfig, load_checkpoint, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("replicas", [1, 2])
def test_train_end_to_end_and_json_schema(tmp_path, replicas):
    out = tmp_path / "run.json"
    # (one replica in a new interpreter, as a user runs it; two in this one)
    proc = run_cli("train", "--devices", "cpu", "--replicas", str(replicas), "--epochs", "3",
                   "--no-progress", "--json", str(out), process=replicas == 1)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "" or replicas != 1, proc.stderr  # (a whole run: nothing on stderr)
    assert "final test accuracy" in proc.stdout
    payload = json.loads(out.read_text())
    assert payload["command"] == "train"
    assert payload["replicas"] == replicas and payload["devices"] == ["cpu"] * replicas
    assert payload["dataset"]["name"] == "digits" and payload["dataset"]["features"] == 64
    assert len(payload["epochs"]) == 3
    for i, record in enumerate(payload["epochs"]):
        assert record["epoch"] == i + 1
        for key in ("seconds", "samples_per_s", "train_loss", "test_accuracy"):
            assert isinstance(record[key], float) and record[key] >= 0
    assert payload["final"]["test_accuracy"] > 0.85
    assert payload["config"]["batch_size"] == 256 and payload["config"]["lr"] == 0.2
    assert {"device_name", "torch", "date"} <= set(payload["environment"])


def test_weighted_split_from_the_command_line():
    proc = run_cli("train", "--no-progress", "--replicas", "2", "--split", "weighted",
                   "--split-weights", "3,1", "--epochs", "1")
    assert proc.returncode == 0, proc.stderr


def test_default_training_reaches_95_percent():
    result = train(TrainConfig(progress=False, log=False))
    assert result["final"]["test_accuracy"] >= 0.95
    assert len(result["epochs"]) == 10


def test_fused_and_plain_layers_train_alike():
    a = train(TrainConfig(epochs=2, progress=False, log=False, fused=True))
    b = train(TrainConfig(epochs=2, progress=False, log=False, fused=False))
    assert a["final_parameters_checksum"] == pytest.approx(b["final_parameters_checksum"],
                                                           rel=1e-4)


def cfg(**kw):
    base = dict(devices=["cpu", "cpu"], epochs=4, progress=False, log=False)
    base.update(kw)
    return TrainConfig(**base)


def params_of(result):
    return [p.detach().clone() for p in result["data_parallel"].module.parameters()]


def test_resume_gives_identical_weights(tmp_path):
    ck = str(tmp_path / "ck.pt")
    full = params_of(train(cfg()))
    train(cfg(epochs=2, checkpoint=ck))
    resumed = params_of(train(cfg(resume=ck, checkpoint=ck)))
    for a, b in zip(full, resumed):
        assert torch.equal(a, b)
    assert load_checkpoint(ck)["epoch"] == 4


def test_interrupt_saves_and_resumes_mid_epoch(tmp_path):
    # Ctrl-C during an epoch: the run stops after the current step with the checkpoint saved,
    # and resuming from it ends where the uninterrupted run ends.
    ck = str(tmp_path / "ck.pt")
    full = params_of(train(cfg(epochs=2)))
    import dpcuda.parallel as par
    original = par.DataParallel.step
    calls = {"n": 0}

    def step(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 8:  # epoch 2, step 2 of 6
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, *a, **k)
    par.DataParallel.step = step
    try:
        from dpcuda.train import Interrupted
        with pytest.raises(Interrupted, match="epoch 2, step 2"):
            train(cfg(epochs=2, checkpoint=ck))
    finally:
        par.DataParallel.step = original
    state = load_checkpoint(ck)
    assert (state["epoch"], state["step"]) == (1, 2)
    resumed = params_of(train(cfg(epochs=2, resume=ck)))
    for a, b in zip(full, resumed):
        assert torch.equal(a, b)


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_the_cli_saves_mid_epoch_and_resumes(tmp_path, sig, status):
    """Ctrl-C and SIGTERM (preemption): the state reached is saved mid-epoch, the exit status
    is 128 + the signal, and the resumed run ends where an uninterrupted one does."""
    ck = tmp_path / "ck.pt"
    common = ["--dataset", "synthetic", "--samples", "40000", "--features", "32", "--epochs",
              "2", "--batch-size", "64", "--no-progress", "--hidden", "32"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "dpcuda", "train", *common, "--checkpoint",
                             str(ck)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        # Wait for the first epoch's line, then stop the second epoch.
        line = proc.stdout.readline()
        while line and not line.startswith("epoch"):
            line = proc.stdout.readline()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == status, err
    assert f"stopped by {sig.name} at epoch 2" in err and "Traceback" not in err
    saved = load_checkpoint(str(ck))
    assert saved["epoch"] == 1 and saved["step"] >= 1 and saved["version"] == 3
    proc = run_cli("train", *common, "--checkpoint", str(ck), "--resume", "auto",
                   "--json", str(tmp_path / "resumed.json"))
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("train", *common, "--json", str(tmp_path / "whole.json"))
    assert proc.returncode == 0, proc.stderr
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    whole = json.loads((tmp_path / "whole.json").read_text())
    assert resumed["final_parameters_checksum"] == whole["final_parameters_checksum"]
    assert resumed["final"]["test_accuracy"] == whole["final"]["test_accuracy"]


@pytest.mark.parametrize("args, message", [
    (["--batch-size", "-5"], "--batch-size must be a positive integer"),
    (["--lr", "fast"], "--lr must be a number"),
    (["--replicas", "2000"], "2000 replicas; at most 16 are supported"),
    (["--devices", ","], "--devices names no device"),
    (["--seed", "99999999999999999999999"], "--seed must be an integer in [0, 2**63)"),
    (["--checkpoint", ""], "--checkpoint must name a file, got an empty string"),
    (["--timeout", "1e15"], "--timeout must be a positive number of seconds (at most 1e7)"),
    (["--replicas", "2", "--split", "weighted", "--split-weights", "1e308,1e308"],
     "--split-weights must be non-negative finite numbers"),
    (["--dataset", "imagenet"], "invalid choice: 'imagenet'"),
    (["--dataset", "fashion-mnist", "--data-dir", "."], "missing train-images-idx3-ubyte.gz"),
    (["--dataset", "fashion-mnist"], "needs --data-dir"),
    (["--devices", "cuda:9"], "does not exist"),
    (["--resume", "/nonexistent/ck.pt"], "no such file"),
    (["--split", "weighted"], "needs --split-weights"),
    (["--replicas", "2", "--split", "weighted", "--split-weights", "1"], "1 weights for 2"),
    (["--momentum", "5"], "--momentum must be in [0, 1)"),
    (["--devices", "cpu:1"], "'cpu:1' does not exist"),
    (["--samples", "100"], "--samples only apply to --dataset synthetic, not digits"),
    (["--timeout", "0"], "--timeout must be a positive number of seconds"),
    (["--resume", "auto"], "--resume auto needs --checkpoint"),
    (["--max-bad-steps", "0"], "--max-bad-steps must be a positive integer"),
])
def test_bad_options_exit_2_with_one_line(args, message):
    # (the device and batch options in a new interpreter too: nothing at import time, such as
    # a warning of torch's CUDA set-up, may add a line)
    proc = run_cli("train", "--no-progress", *args, process=args[0] in ("--devices",
                                                                       "--batch-size"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert message in lines[0]
    assert proc.stdout == ""  # refused before anything ran


def test_bad_checkpoints_are_refused_and_kept(tmp_path):
    good = str(tmp_path / "good.pt")
    train(cfg(epochs=1, checkpoint=good))
    raw = open(good, "rb").read()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(raw[: len(raw) // 2])
    text = tmp_path / "notes.pt"
    text.write_text("not a checkpoint")
    other = tmp_path / "dict.pt"
    torch.save({"weights": torch.ones(3)}, other)
    cases = [(truncated, "not a readable checkpoint"), (text, "not a readable checkpoint"),
             (other, "not a dpcuda checkpoint")]
    for path, message in cases:
        before = path.read_bytes()
        proc = run_cli("train", "--no-progress", "--resume", str(path), "--checkpoint",
                       str(path))
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
        assert path.read_bytes() == before  # never overwritten
    before = open(good, "rb").read()
    proc = run_cli("train", "--no-progress", "--hidden", "32", "--resume", good,
                   "--checkpoint", good)
    assert proc.returncode == 2 and "--hidden 32 (checkpoint: 256)" in proc.stderr
    assert open(good, "rb").read() == before


def test_idx_reader_roundtrip_and_errors(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, (5, 4, 3), dtype=np.uint8)
    labels = np.array([0, 3, 9, 1, 2], dtype=np.uint8)
    data.write_idx(tmp_path / "img.gz", images)
    data.write_idx(tmp_path / "lab", labels)
    assert np.array_equal(data.read_idx(tmp_path / "img.gz"), images)
    assert np.array_equal(data.read_idx(tmp_path / "lab"), labels)
    raw = (tmp_path / "lab").read_bytes()
    (tmp_path / "short").write_bytes(raw[:-1])
    with pytest.raises(data.DataError, match="file holds 4 bytes"):
        data.read_idx(tmp_path / "short")
    (tmp_path / "junk").write_bytes(b"\x01\x02\x03\x04hello")
    with pytest.raises(data.DataError, match="bad magic"):
        data.read_idx(tmp_path / "junk")


def test_fashion_mnist_from_idx_files(tmp_path):
    rng = np.random.default_rng(1)
    for split, n in (("train", 40), ("t10k", 10)):
        data.write_idx(tmp_path / f"{split}-images-idx3-ubyte.gz",
                       rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        data.write_idx(tmp_path / f"{split}-labels-idx1-ubyte.gz",
                       rng.integers(0, 10, n, dtype=np.uint8))
    ds = data.load("fashion-mnist", str(tmp_path))
    assert ds.x_train.shape == (40, 784) and ds.x_test.shape == (10, 784)
    assert ds.y_train.dtype == torch.int64
    proc = run_cli("train", "--no-progress", "--dataset", "fashion-mnist", "--data-dir",
                   str(tmp_path), "--epochs", "1", "--batch-size", "16")
    assert proc.returncode == 0, proc.stderr
    # test images of another size, then no test images: one line naming the file
    test_images = tmp_path / "t10k-images-idx3-ubyte.gz"
    for images, message in ((rng.integers(0, 256, (10, 14, 14), dtype=np.uint8),
                             "pixels, the train images have"),
                            (np.zeros((0, 28, 28), dtype=np.uint8), "no images")):
        data.write_idx(test_images, images)
        data.write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz",
                       np.zeros(len(images), dtype=np.uint8))
        proc = run_cli("train", "--no-progress", "--dataset", "fashion-mnist", "--data-dir",
                       str(tmp_path), "--epochs", "1")
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert message in lines[0] and "t10k-images-idx3-ubyte" in lines[0], lines


def test_bench_scaling_writes_json_and_plot(tmp_path):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    import runpy
    bench = runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "benchmarks",
                                        "bench_scaling.py"))
    assert bench["main"](["--samples", "600", "--features", "32", "--epochs", "1",
                          "--replicas", "1,2", "--batches", "64", "--reducers", "p2p",
                          "--no-progress", "--json", str(out), "--plot", str(png)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert {(r["replicas"], r["layers"]) for r in rows} == {(1, "fused"), (2, "fused"),
                                                          (1, "plain"), (2, "plain")}
    assert png.stat().st_size > 1000


def test_one_line_per_epoch_and_a_batch_larger_than_the_data_refused(tmp_path):
    proc = run_cli("train", "--no-progress", "--epochs", "2")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("epoch ") for line in lines) == 2  # printed once each
    assert lines[-1].startswith("final test accuracy")
    # digits: 1438 training samples; a larger batch would make every epoch one step
    proc = run_cli("train", "--no-progress", "--epochs", "1", "--batch-size", "5000")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "--batch-size 5000 is larger than the " \
        "training set (1438 samples)" in proc.stderr
