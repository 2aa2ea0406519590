"""Soak (#12): back-to-back 2-process torchrun runs of a short training, none may crash.
DPCUDA_SOAK=N runs (30 in the issue, about 6 s a run); CI runs the default, 2."""
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = int(os.environ.get("DPCUDA_SOAK", "2"))


@pytest.mark.skipif(RUNS == 0, reason="DPCUDA_SOAK=0")
def test_back_to_back_torchrun_runs_do_not_crash(tmp_path):
    failures = []
    for i in range(RUNS):
        with socket.socket() as s:  # each job its own rendezvous port (see README)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "dpcuda",
             "train", "--reducer", "dist", "--epochs", "1", "--no-progress", "--hidden", "32",
             "--json", str(tmp_path / f"run{i}.json")],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
            timeout=300)
        if proc.returncode != 0:
            failures.append((i, proc.returncode, proc.stderr[-2000:]))
    assert not failures, failures
