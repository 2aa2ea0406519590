"""`dpcuda train` with dpcuda.optim: --optimizer, --lr-schedule, --warmup-steps,
--clip-grad-norm, --accumulate and --hidden of any depth; exact resume of the optimizer and the
schedule; the checkpoint's optimizer state in torch.optim's format; older checkpoints."""

import json

import pytest
import torch

from dpcuda.train import TrainConfig, load_checkpoint, train

from test_cli import run_cli

OPTS = ["--no-progress", "--optimizer", "adamw", "--lr", "0.01", "--warmup-steps", "5",
        "--clip-grad-norm", "1", "--accumulate", "3", "--hidden", "64,32", "--replicas", "2"]


def test_adamw_with_every_option_trains_and_resumes_exactly(tmp_path):
    straight, first, resumed = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    ck = tmp_path / "ck.pt"
    proc = run_cli("train", *OPTS, "--epochs", "4", "--json", str(straight))
    assert proc.returncode == 0, proc.stderr
    assert "dpcuda.optim AdamW lr 0.01, constant schedule after 5 warm-up steps, clip 1.0, " \
           "3 micro-batches" in proc.stdout
    assert "MLP 64-64-32-10" in proc.stdout
    a = json.loads(straight.read_text())
    assert a["final"]["test_accuracy"] > 0.9
    assert run_cli("train", *OPTS, "--epochs", "2", "--checkpoint", str(ck)).returncode == 0
    payload = load_checkpoint(str(ck))
    assert payload["version"] == 3 and payload["optimizer_kind"] == "dpcuda.optim"
    # torch.optim's format: it loads into torch's AdamW
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32),
                                torch.nn.Linear(32, 10))
    torch.optim.AdamW(model.parameters()).load_state_dict(payload["optimizer"])
    assert payload["scheduler"]["last_epoch"] == 2 * 6  # 6 optimizer steps an epoch
    proc = run_cli("train", *OPTS, "--epochs", "4", "--resume", str(ck), "--checkpoint",
                   str(ck), "--json", str(resumed))
    assert proc.returncode == 0, proc.stderr
    b = json.loads(resumed.read_text())
    assert b["final_parameters_checksum"] == a["final_parameters_checksum"]


def test_the_schedules_give_the_learning_rates_they_promise():
    import math

    from dpcuda.train_step import make_optimizer, make_scheduler
    p = [torch.zeros(2, requires_grad=True)]
    total, warmup, lr = 20, 4, 0.1

    def lrs(schedule, optimizer="adamw"):
        cfg = TrainConfig(lr=lr, optimizer=optimizer, lr_schedule=schedule, warmup_steps=warmup)
        opt = make_optimizer(cfg, p)
        sched = make_scheduler(cfg, opt, total)
        seen = []
        for _ in range(total):
            seen.append(opt.param_groups[0]["lr"])
            p[0].grad = torch.ones(2)
            opt.step()
            sched.step()
        return seen

    for step, got in enumerate(lrs("constant")):
        assert math.isclose(got, lr * min(1.0, (step + 1) / (warmup + 1)))
    for step, got in enumerate(lrs("cosine", "sgd")):
        want = lr * (step + 1) / (warmup + 1) if step < warmup else \
            lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
        assert math.isclose(got, want, abs_tol=1e-15)
    ref_opt = torch.optim.AdamW(p, lr=lr)
    ref = torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=lr, total_steps=total,
                                              pct_start=warmup / total)
    want = []
    for _ in range(total):
        want.append(ref_opt.param_groups[0]["lr"])
        ref_opt.step()
        ref.step()
    assert lrs("onecycle") == want


def test_what_a_resume_may_not_change_and_bad_options(tmp_path):
    ck = tmp_path / "ck.pt"
    assert run_cli("train", *OPTS, "--epochs", "1", "--checkpoint", str(ck)).returncode == 0
    proc = run_cli("train", *OPTS, "--epochs", "2", "--resume", str(ck), "--optimizer", "adam")
    assert proc.returncode == 2
    assert "--optimizer adam (checkpoint: adamw)" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    for bad, text in ((["--hidden", "3,x"], "--hidden must be comma-separated"),
                      (["--hidden", "0"], "--hidden must be comma-separated"),
                      (["--clip-grad-norm", "0"], "--clip-grad-norm must be a positive"),
                      (["--accumulate", "0"], "--accumulate must be a positive"),
                      (["--warmup-steps", "-1"], "--warmup-steps must be a non-negative"),
                      (["--optimizer", "lamb"], "invalid choice: 'lamb'"),
                      (["--shard-optimizer", "on"], "it needs --reducer dist")):
        proc = run_cli("train", "--no-progress", "--epochs", "1", *bad)
        assert proc.returncode == 2 and text in proc.stderr, (bad, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1
    help_text = run_cli("train", "--help").stdout
    for default in ("(default: sgd)", "(default: constant)", "(default: 0)", "(default: 1)",
                    "(default: 256)", "(default: auto)"):
        assert default in help_text, default


def test_the_wrapper_sgd_checkpoints_and_version_2_still_resume(tmp_path):
    ck = tmp_path / "ck.pt"
    assert run_cli("train", "--no-progress", "--epochs", "1", "--checkpoint",
                   str(ck)).returncode == 0
    payload = torch.load(ck, weights_only=True)
    assert payload["optimizer_kind"] == "DataParallel"
    # As dpcuda wrote it before version 3: hidden one int, no optimizer kind or schedule.
    for key in ("optimizer_kind", "scheduler"):
        del payload[key]
    for key in ("optimizer", "lr_schedule", "warmup_steps", "clip_grad_norm", "accumulate"):
        del payload["config"][key]
    payload["version"] = 2
    payload["model"]["hidden"] = payload["config"]["hidden"] = 256
    torch.save(payload, ck)
    proc = run_cli("train", "--no-progress", "--epochs", "2", "--resume", str(ck))
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("train", "--no-progress", "--epochs", "2", "--resume", str(ck),
                   "--optimizer", "adamw")
    assert proc.returncode == 2 and "--optimizer adamw (checkpoint: sgd)" in proc.stderr


def test_onecycle_refuses_a_run_too_short_and_keeps_the_momentum(tmp_path):
    for warmup in ("1", "12"):  # (digits: 6 optimizer steps an epoch, 12 in 2 epochs)
        proc = run_cli("train", "--no-progress", "--epochs", "2", "--optimizer", "adam",
                       "--lr-schedule", "onecycle", "--warmup-steps", warmup)
        assert proc.returncode == 2, proc.stderr
        assert "--lr-schedule onecycle needs a warm-up of at least 2" in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    ck = tmp_path / "ck.pt"
    proc = run_cli("train", "--no-progress", "--epochs", "2", "--optimizer", "sgd",
                   "--momentum", "0", "--lr-schedule", "onecycle", "--checkpoint", str(ck))
    assert proc.returncode == 0, proc.stderr
    group = load_checkpoint(str(ck))["optimizer"]["param_groups"][0]
    assert group["momentum"] == 0.0
