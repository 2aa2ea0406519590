"""benchmarks/bench_ddp.py stays runnable: two gloo processes, a few steps of the small shape;
DDP and dpcuda train the same model and dpcuda's ranks end bit-identical."""

import json
import os
import subprocess
import sys

import pytest

from cli_run import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_bench_ddp_runs_and_trains_the_same_model(tmp_path, optimizer):
    out = tmp_path / "ddp.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_ddp.py"),
                           "--shapes", "784-256-10", "--steps", "3", "--warmup", "1",
                           "--optimizer", optimizer, "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    payload = json.loads(out.read_text())
    (row,) = payload["results"]
    assert row["shape"] == "784-256-10" and row["global_batch"] == 256
    assert payload["optimizer"] == optimizer
    names = ("ddp", "ddp-tuned", "dpcuda", "dpcuda-plain") + \
        (("dpcuda-zero",) if optimizer == "adamw" else ())
    assert sorted(row["samples_ms"]) == sorted(names)
    for name in names:
        assert len(row["samples_ms"][name]) == 3
        assert 0 < row[name]["q1_ms"] <= row[name]["median_ms"] <= row[name]["q3_ms"]
    diffs = row["param_diff"]
    assert diffs["dpcuda_across_ranks"] == 0.0
    early = diffs["early"]
    assert early["steps"] == 4 and early["ddp_moved"] > 0
    for name in names[1:]:
        assert early[f"{name}_vs_ddp"] <= 1e-2 * early["ddp_moved"]
    assert "ddp/dpcuda" in proc.stdout


@pytest.mark.parametrize("args,named", [(["--shapes", "1-2-3"], "--shapes"),
                                        (["--shapes", ","], "--shapes"),
                                        (["--lr", "nan"], "--lr"),
                                        (["--momentum", "-1"], "--momentum"),
                                        (["--json", "/nonexistent/x.json"], "--json")])
def test_bench_ddp_rejects_bad_arguments(args, named):
    proc = run_script("bench_ddp", *args, timeout=60)
    assert proc.returncode == 2
    assert named in proc.stderr and "Traceback" not in proc.stderr
