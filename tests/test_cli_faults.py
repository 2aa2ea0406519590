"""The training command under faults (#12): overwrites, resumes with another configuration,
bad output paths, a full disk, divergence, torchrun without --reducer dist; the eval and predict
commands and the v2 checkpoint format. Every refusal is one line with exit status 2 and comes
before the first step; a failure during the run is one line with exit status 1 and leaves the
previous checkpoint intact."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import dpcuda
from cli_run import run
from dpcuda import data
from dpcuda.nn import FusedMLP
from dpcuda.train import load_checkpoint, save_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = ["--no-progress", "--epochs", "2", "--hidden", "32"]


def one_line_error(proc, status, message):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == status, proc.stderr
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trained")
    ck = folder / "ck.pt"
    proc = run("train", *QUICK, "--checkpoint", str(ck), "--json", str(folder / "run.json"))
    assert proc.returncode == 0, proc.stderr
    return ck, json.loads((folder / "run.json").read_text())


def test_existing_checkpoint_is_not_overwritten(trained, tmp_path):
    ck, _ = trained
    before = ck.read_bytes()
    proc = run("train", *QUICK, "--hidden", "16", "--checkpoint", str(ck))
    one_line_error(proc, 2, "exists (another run's?); --resume")
    assert ck.read_bytes() == before and proc.stdout == ""
    copy = tmp_path / "ck.pt"
    copy.write_bytes(before)
    proc = run("train", *QUICK, "--hidden", "16", "--checkpoint", str(copy), "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert load_checkpoint(str(copy))["model"]["hidden"] == [16]


@pytest.mark.parametrize("args, message", [
    (["--batch-size", "64"], "--batch-size 64 (checkpoint: 256)"),
    (["--seed", "7"], "--seed 7 (checkpoint: 0)"),
    (["--dataset", "synthetic", "--samples", "3000", "--features", "64"],
     "--dataset synthetic (checkpoint: digits)"),
    (["--activation", "tanh"], "--activation tanh (checkpoint: relu)"),
    (["--epochs", "1"], "--epochs 1 is below the checkpoint's 2 completed epochs"),
])
def test_resume_refuses_what_changes_the_model_or_the_data_order(trained, tmp_path, args,
                                                                 message):
    ck, _ = trained
    copy = tmp_path / "ck.pt"
    copy.write_bytes(ck.read_bytes())
    proc = run("train", *QUICK, "--resume", str(copy), "--checkpoint", str(copy), *args)
    one_line_error(proc, 2, message)
    assert copy.read_bytes() == ck.read_bytes() and proc.stdout == ""


def test_resume_may_grow_epochs_and_change_replicas_and_lr(trained, tmp_path):
    """A resume with more epochs on 2 replicas ends with the model that 1 replica trains from
    the same checkpoint (the same numbers up to float rounding)."""
    ck, _ = trained
    results = []
    for replicas in ("2", "1"):
        copy = tmp_path / f"ck{replicas}.pt"
        copy.write_bytes(ck.read_bytes())
        out = tmp_path / f"run{replicas}.json"
        proc = run("train", *QUICK, "--epochs", "4", "--replicas", replicas, "--lr", "0.1",
                   "--resume", "auto", "--checkpoint", str(copy), "--json", str(out))
        assert proc.returncode == 0, proc.stderr
        assert load_checkpoint(str(copy))["epoch"] == 4
        results.append(json.loads(out.read_text()))
    two, one = results
    assert abs(two["final_parameters_checksum"] - one["final_parameters_checksum"]) <= \
        1e-4 * (1 + abs(one["final_parameters_checksum"]))
    assert two["final"]["test_accuracy"] == one["final"]["test_accuracy"]


@pytest.mark.parametrize("option", ["--checkpoint", "--json"])
def test_bad_output_paths_exit_2_before_training(tmp_path, option):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for path, message in ((tmp_path, "is a folder, not a file"),
                          (a_file / "out", "cannot make its folder"),
                          ("/proc/dpcuda-out", "cannot write in /proc")):
        proc = run("train", *QUICK, "--epochs", "50", option, str(path))
        one_line_error(proc, 2, message)
        assert proc.stdout == "" and proc.seconds < 60


FULL_DISK = """
import errno, sys, torch
real, calls = torch.save, [0]
def save(obj, f, *args, **kwargs):  # the second checkpoint hits a full disk half-way
    calls[0] += 1
    if calls[0] < 2:
        return real(obj, f, *args, **kwargs)
    f.write(b"partial")
    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as err:  # as torch reports it: a RuntimeError with the OSError behind it
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos") from err
torch.save = save
from dpcuda.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_full_disk_one_line_and_previous_checkpoint_intact(tmp_path):
    ck = tmp_path / "ck.pt"
    proc = run("train", *QUICK, "--epochs", "3", "--checkpoint", str(ck), code=FULL_DISK)
    one_line_error(proc, 1, f"cannot write the checkpoint {ck}: No space left on device")
    saved = load_checkpoint(str(ck))  # the first epoch's, whole
    assert saved["epoch"] == 1
    # no temporary file left behind (the lock file stays, empty)
    assert sorted(os.listdir(tmp_path)) == ["ck.pt", "ck.pt.lock"]


def test_divergence_stops_the_run_and_json_stays_valid(tmp_path):
    out = tmp_path / "run.json"
    proc = run("train", *QUICK, "--lr", "1e308", "--json", str(out))
    one_line_error(proc, 1, "the run diverged: 5 consecutive steps with NaN or Inf gradients")
    assert json.loads(out.read_text())["diverged"] is True
    # a guard wide enough to let every step of the second epoch be skipped: its loss is NaN,
    # written as null (strict JSON: NaN is refused by the parse below)
    proc = run("train", *QUICK, "--lr", "1e308", "--max-bad-steps", "1000", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(c))
    assert payload["epochs"][1]["train_loss"] is None
    assert payload["epochs"][1]["skipped_steps"] == 6


def test_torchrun_without_dist_is_refused():
    proc = run("train", *QUICK, env={"WORLD_SIZE": "2", "RANK": "1"})
    one_line_error(proc, 2, "running under torchrun (WORLD_SIZE=2) needs --reducer dist")


def test_eval_predict_and_the_v2_checkpoint(trained, tmp_path):
    ck, run_json = trained
    payload = load_checkpoint(str(ck))
    assert payload["version"] == 3
    assert list(payload["model_state_dict"]) == ["layers.0.weight", "layers.0.bias",
                                                 "layers.1.weight", "layers.1.bias"]
    assert payload["config"]["hidden"] == [32] and payload["model"]["hidden"] == [32]
    assert payload["optimizer_kind"] == "DataParallel"
    assert payload["optimizer"]["momentum_buffer"].numel() == 64 * 32 + 32 + 32 * 10 + 10
    # FusedMLP loads the weights; nn.Sequential through to_sequential's mapping
    model = FusedMLP([64, 32, 10])
    model.load_state_dict(payload["model_state_dict"])
    plain = model.to_sequential()
    digits = data.load("digits")
    # The raw features: the test split's rows of load_digits().data, pixels 0-16 as sklearn
    # gives them (the split is data.py's: seed 0 of its own generator, the first fifth).
    from sklearn.datasets import load_digits
    pixels = torch.tensor(load_digits().data, dtype=torch.float32)
    perm = torch.randperm(len(pixels), generator=torch.Generator().manual_seed(0))
    x_raw = pixels[perm[:len(pixels) // 5]]
    assert x_raw.max() == 16
    want = run_json["final"]["test_accuracy"]
    with torch.no_grad():
        acc = (plain(digits.x_test).argmax(1) == digits.y_test).float().mean().item()
        ready = dpcuda.load_checkpoint_model(str(ck))
        acc_raw = (ready(x_raw).argmax(1) == digits.y_test).float().mean().item()
    assert abs(acc - want) < 1e-6 and abs(acc_raw - want) < 1e-6
    # eval
    proc = run("eval", "--checkpoint", str(ck), "--json", str(tmp_path / "eval.json"))
    assert proc.returncode == 0, proc.stderr
    assert f"accuracy {100 * want:.2f}%" in proc.stdout
    assert abs(json.loads((tmp_path / "eval.json").read_text())["accuracy"] - want) < 1e-6
    # predict, on raw features
    np.save(tmp_path / "x.npy", x_raw.numpy())
    proc = run("predict", "--checkpoint", str(ck), "--input", str(tmp_path / "x.npy"),
               "--output", str(tmp_path / "y.npy"))
    assert proc.returncode == 0, proc.stderr
    y = np.load(tmp_path / "y.npy")
    assert y.dtype == np.int64 and abs((y == digits.y_test.numpy()).mean() - want) < 1e-6
    # bad inputs: one line, status 2
    np.save(tmp_path / "bad.npy", np.zeros((3, 5), dtype=np.float32))
    one_line_error(run("predict", "--checkpoint", str(ck), "--input", str(tmp_path / "bad.npy"),
                       "--output", str(tmp_path / "y2.npy")), 2,
                   "5 features per row, the checkpoint's model takes 64")
    one_line_error(run("predict", "--checkpoint", str(ck), "--input", str(tmp_path / "no.npy"),
                       "--output", str(tmp_path / "y2.npy")), 2, "no.npy: no such file")
    one_line_error(run("eval", "--checkpoint", str(tmp_path / "none.pt")), 2, "no such file")


def test_version_1_checkpoints_still_resume(trained, tmp_path):
    ck, _ = trained
    payload = load_checkpoint(str(ck))
    v1 = {k: v for k, v in payload.items() if k not in ("model_state_dict", "normalization")}
    v1["version"] = 1
    v1["parameters"] = list(payload["model_state_dict"].values())
    old = tmp_path / "v1.pt"
    save_checkpoint(str(old), v1)
    proc = run("train", *QUICK, "--epochs", "3", "--resume", str(old), "--checkpoint",
               str(tmp_path / "v2.pt"))
    assert proc.returncode == 0, proc.stderr
    assert load_checkpoint(str(tmp_path / "v2.pt"))["epoch"] == 3
    v1["version"] = 7
    save_checkpoint(str(old), v1)
    one_line_error(run("train", *QUICK, "--resume", str(old)), 2,
                   "checkpoint version 7 is not supported (this dpcuda reads versions 1, 2, 3)")


@pytest.mark.parametrize("args, message", [
    (["--replicas", "1,4", "--batches", "2", "--samples", "200", "--features", "8"],
     "--replicas 4 with --batches 2: every replica needs a row"),
    (["--json", "same.x", "--plot", "same.x"], "name the same file"),
    (["--batches", "0"], "--replicas and --batches take positive integers"),
    (["--replicas", "0,1"], "--replicas and --batches take positive integers"),
    (["--plot", "out.xyz"], "unknown image type 'xyz'"),
    (["--dataset", "digits", "--features", "9"], "--features only apply to --dataset synthetic"),
])
def test_bench_scaling_bad_options(args, message):
    # (benchmarks/bench_scaling.py takes the command line's options and their checks)
    one_line_error(run(*args, code="import runpy, sys; sys.argv[0] = 'bench_scaling'; "
                                   "runpy.run_path('benchmarks/bench_scaling.py', "
                                   "run_name='__main__')"), 2, message)


def test_help_version_and_package():
    proc = run("--version", process=True)
    assert proc.returncode == 0 and proc.stdout.strip() == f"dpcuda {dpcuda.__version__}"
    proc = run("train", "--help")
    assert "(default: 256)" in proc.stdout and "(default: 5)" in proc.stdout


def test_outputs_never_destroy_inputs_or_each_other(trained, tmp_path):
    ck, _ = trained
    before = ck.read_bytes()
    for args, message in (
            (["train", *QUICK, "--checkpoint", str(ck), "--resume", str(ck), "--json", str(ck)],
             "--json and --checkpoint name the same file"),
            (["train", *QUICK, "--resume", str(ck), "--checkpoint", str(tmp_path / "b.pt"),
              "--json", str(ck)], "--json and --resume name the same file"),
            (["eval", "--checkpoint", str(ck), "--json", str(ck)], "name the same file"),
            (["predict", "--checkpoint", str(ck), "--input", str(tmp_path / "x.npy"),
              "--output", str(ck)], "name the same file")):
        one_line_error(run(*args), 2, message)
    assert ck.read_bytes() == before
    # a symlinked checkpoint stays a symlink; its target is written
    target = tmp_path / "store" / "ck.pt"
    target.parent.mkdir()
    target.write_bytes(before)
    link = tmp_path / "link.pt"
    link.symlink_to(target)
    proc = run("train", *QUICK, "--epochs", "3", "--resume", "auto", "--checkpoint", str(link))
    assert proc.returncode == 0, proc.stderr
    assert link.is_symlink() and load_checkpoint(str(target))["epoch"] == 3


def test_one_run_per_checkpoint(tmp_path):
    ck = tmp_path / "ck.pt"
    first = subprocess.Popen(
        [sys.executable, "-m", "dpcuda", "train", "--dataset", "synthetic", "--samples",
         "100000", "--features", "32", "--epochs", "50", "--hidden", "16", "--no-progress",
         "--checkpoint", str(ck)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = first.stdout.readline()  # the header: the lock is held from before it
        assert line.startswith("dpcuda train:"), first.stderr.read()
        proc = run("train", *QUICK, "--checkpoint", str(ck), "--overwrite")
        one_line_error(proc, 2, "another run is writing it")
    finally:
        first.kill()
        first.communicate()


def test_a_run_in_this_process_holds_the_lock_until_it_returns(tmp_path):
    """dpcuda.cli.main called twice in one process (a notebook, these tests): the first run's
    lock is released when it returns, and an open lock refuses a run, as another process's."""
    from dpcuda.checkpoint import lock_checkpoint
    ck = tmp_path / "ck.pt"
    with lock_checkpoint(str(ck)):
        one_line_error(run("train", *QUICK, "--checkpoint", str(ck)), 2,
                       "another run is writing it")
    assert not ck.exists()
    proc = run("train", *QUICK, "--checkpoint", str(ck))
    assert proc.returncode == 0, proc.stderr
    proc = run("train", *QUICK, "--epochs", "3", "--resume", str(ck), "--checkpoint", str(ck))
    assert proc.returncode == 0, proc.stderr
    assert load_checkpoint(str(ck))["epoch"] == 3


def test_resume_lists_every_difference_with_the_model(trained, tmp_path):
    ck, _ = trained
    proc = run("train", *QUICK, "--hidden", "48", "--seed", "1", "--batch-size", "128",
               "--resume", str(ck), "--checkpoint", str(ck))
    one_line_error(proc, 2, "--seed 1 (checkpoint: 0); --batch-size 128 (checkpoint: 256); "
                            "--hidden 48 (checkpoint: 32)")


def test_predict_refuses_what_has_no_prediction(trained, tmp_path):
    ck, _ = trained
    x = np.zeros((3, 64))
    x[1, 5] = np.nan
    np.save(tmp_path / "nan.npy", x)
    np.savez(tmp_path / "x.npz", a=np.zeros((2, 64)))
    np.save(tmp_path / "c.npy", np.zeros((2, 64), dtype=np.complex64))
    np.save(tmp_path / "big.npy", np.full((2, 64), 1e300))
    for name, message in (("nan.npy", "row 1 (counting from 0) holds NaN, Inf"),
                          ("x.npz", "an .npz needs arrays named x; it has a"),
                          ("c.npy", "the features must be real numbers, got complex64"),
                          ("big.npy", "row 0 (counting from 0) holds NaN")):
        one_line_error(run("predict", "--checkpoint", str(ck), "--input", str(tmp_path / name),
                           "--output", str(tmp_path / "y.npy")), 2, message)


def test_eval_refuses_a_data_set_the_model_cannot_score(tmp_path):
    ck = tmp_path / "syn.pt"
    proc = run("train", "--no-progress", "--epochs", "1", "--hidden", "8", "--dataset",
               "synthetic", "--samples", "400", "--features", "64", "--classes", "3",
               "--checkpoint", str(ck))
    assert proc.returncode == 0, proc.stderr
    one_line_error(run("eval", "--checkpoint", str(ck), "--dataset", "digits"), 2,
                   "the checkpoint's model takes 64 features and has 3 classes")
    payload = load_checkpoint(str(ck))
    payload["model_state_dict"]["layers.0.weight"] = torch.zeros(2, 2)
    bad = tmp_path / "bad.pt"
    save_checkpoint(str(bad), payload)
    one_line_error(run("eval", "--checkpoint", str(bad)), 2, "its weights do not fit")


def test_out_of_memory_is_one_line():
    # 64 x 10^12 float32 weights: the allocator refuses them at once
    proc = run("train", "--no-progress", "--epochs", "1", "--hidden", "1000000000000")
    one_line_error(proc, 1, "out of memory (a smaller --hidden")


INTERRUPT_AT_START = """
import sys
import dpcuda.data
def load(*args, **kwargs):  # Ctrl-C while the data set loads, before the first step
    raise KeyboardInterrupt
dpcuda.data.load = load
from dpcuda.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_before_training_starts(tmp_path):
    proc = run("train", *QUICK, "--checkpoint", str(tmp_path / "ck.pt"), code=INTERRUPT_AT_START)
    one_line_error(proc, 130, "dpcuda train: interrupted")
    assert not (tmp_path / "ck.pt").exists()


NO_ROOM = """
import collections, shutil, sys
usage = collections.namedtuple("usage", "total used free")
shutil.disk_usage = lambda path: usage(10 ** 9, 10 ** 9 - 1000, 1000)  # 1000 bytes free
from dpcuda.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_disk_without_room_for_a_checkpoint_is_refused_before_training(tmp_path):
    proc = run("train", *QUICK, "--epochs", "50", "--checkpoint", str(tmp_path / "ck.pt"),
               code=NO_ROOM)
    one_line_error(proc, 2, "1000 bytes free in")
    assert "a checkpoint needs about" in proc.stderr and proc.stdout == ""
    assert proc.seconds < 60 and not (tmp_path / "ck.pt").exists()


FULL_DISK_JSON = """
import errno, os, sys
def fsync(fd):  # the disk fills as the JSON's temporary file is flushed
    raise OSError(errno.ENOSPC, "No space left on device")
os.fsync = fsync
from dpcuda.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_full_disk_during_the_json_write_is_one_line_and_the_old_json_intact(tmp_path):
    out = tmp_path / "run.json"
    out.write_text('{"old": true}')
    proc = run("train", *QUICK, "--json", str(out), code=FULL_DISK_JSON)
    one_line_error(proc, 1, f"cannot write the JSON file {out}: No space left on device")
    assert json.loads(out.read_text()) == {"old": True}
    assert sorted(os.listdir(tmp_path)) == ["run.json"]  # no temporary file left
