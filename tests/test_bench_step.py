"""benchmarks/bench_step.py stays runnable on the CPU: every contender the CPU has, a small
shape, a few steps per synchronisation; the JSON holds a row per contender and replica count,
the CUDA-only contenders listed as not run."""

import json
import os
import subprocess
import sys

from cli_run import run_script


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(tmp_path, *args):
    out = tmp_path / "step.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_step.py"),
                           "--device", "cpu", "--json", str(out), *args],
                          capture_output=True, text=True, timeout=600)
    return proc, out


def test_bench_step_runs_every_cpu_contender(tmp_path):
    proc, out = run(tmp_path, "--shapes", "16-8-4:32", "--replicas", "1,2", "--optimizers",
                    "adamw", "--steps-per-sync", "3", "--repeats", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    payload = json.loads(out.read_text())
    assert payload["steps_per_sync"] == 3
    assert payload["failed"] == {}
    assert sorted(payload["not_run"]) == ["dpcuda graphed", "torch cuda graph",
                                          "torch.compile r-o"]
    rows = payload["results"]
    for opt in ("adamw",):  # (one optimizer: a torch.compile costs CI seconds)
        r1 = {r["method"] for r in rows if r["optimizer"] == opt and r["replicas"] == 1}
        want = {"torch eager", "torch.compile", "dpcuda blocking", "dpcuda nonblocking"}
        assert r1 == want | ({"torch eager fused"} if opt == "adamw" else set())
        r2 = {r["method"] for r in rows if r["optimizer"] == opt and r["replicas"] == 2}
        assert r2 == {"torch eager", "dpcuda blocking", "dpcuda nonblocking"}
    for r in rows:
        assert r["ms_per_step"] > 0 and r["latency_ms"] > 0 and r["eager_over_this"] > 0
        # (the host's part of each timed burst, before its synchronisation, is within it)
        assert 0 < r["host_ms_per_step"] <= r["ms_per_step"]
        if r["method"] == "torch eager":
            assert r["eager_over_this"] == 1.0


def test_bench_step_refuses_what_it_cannot_run(tmp_path):
    proc = run_script("bench_step", "--device", "cpu", "--contenders", "torch eager,tensorflow")
    assert proc.returncode == 2 and "unknown contenders" in proc.stderr
    proc = run_script("bench_step", "--device", "cpu", "--steps-per-sync", "0")
    assert proc.returncode == 2 and "--steps-per-sync must be at least 1" in proc.stderr


def with_compile_contender(tmp_path, monkeypatch, fake, optimizers):
    """bench_step.main in this process, its torch.compile contender replaced by fake (a factory
    of step functions), against torch eager; returns its JSON."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_step
    monkeypatch.setattr(bench_step, "torch_compiled", lambda *args, **kwargs: fake())
    out = tmp_path / "step.json"
    bench_step.main(["--device", "cpu", "--shapes", "16-8-4:8", "--replicas", "1",
                     "--optimizers", optimizers, "--contenders", "torch eager,torch.compile",
                     "--steps-per-sync", "2", "--repeats", "2", "--json", str(out)])
    return json.loads(out.read_text())


def test_bench_step_reports_a_failing_contender_and_runs_the_others(tmp_path, monkeypatch):
    # (on the H100, 2026-11-27, one contender's error ended the whole run and its JSON)
    def broken():
        def step():
            raise RuntimeError("boom at the first step")
        return step
    payload = with_compile_contender(tmp_path, monkeypatch, broken, "sgd")
    assert payload["failed"] == {"torch.compile 16-8-4 8 sgd 1":
                                 "RuntimeError: boom at the first step"}
    assert [r["method"] for r in payload["results"]] == ["torch eager"]


def test_bench_step_reports_a_contender_failing_in_its_timing(tmp_path, monkeypatch):
    def flaky():
        calls = []

        def step():
            calls.append(1)
            if len(calls) > 1:  # (its trial step passes)
                raise RuntimeError("boom later")
        return step
    payload = with_compile_contender(tmp_path, monkeypatch, flaky, "sgd,adamw")
    assert payload["failed"] == {"timing 16-8-4 8 sgd 1": "RuntimeError: boom later",
                                 "timing 16-8-4 8 adamw 1": "RuntimeError: boom later"}


def test_bench_host_runs_and_times_the_graphed_steps_host_part(tmp_path):
    out = tmp_path / "host.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_host.py"),
                           "--optimizers", "adamw", "--steps", "5", "--rounds", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["results"]
    assert [r["method"] for r in rows] == ["torch eager", "dpcuda blocking",
                                           "dpcuda nonblocking", "dpcuda graphed host"]
    assert all(r["us_per_step"] > 0 for r in rows)
