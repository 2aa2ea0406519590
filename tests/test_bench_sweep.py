"""benchmarks/bench_sweep.py stays runnable: a tiny grid, every layout, both dtypes; the JSON
holds a row per cell with its ratio band, the skipped cells listed, the heat map written."""

import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

from cli_run import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(tmp_path, *args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_sweep.py"),
                           *args], capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_bench_sweep_runs_a_small_grid(tmp_path):
    proc = run(tmp_path, "--widths", "8,16", "--batches", "1,4,64", "--activations",
               "relu,gelu", "--bias", "on,off", "--dtypes", "float32,bfloat16", "--repeats",
               "2", "--min-seconds", "0", "--max-gflop", "0.00005", "--json", "s.json",
               "--png", "s.png", "--png-worst", "w.png")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    payload = json.loads((tmp_path / "s.json").read_text())
    rows = payload["results"]
    # 16 x 16 at batch 64 is 6 * 64 * 256 = 98304 flops, over the 50000 allowed: skipped
    assert payload["skipped"] and all(s["width"] == 16 and s["batch"] == 64
                                      for s in payload["skipped"])
    assert len(rows) == (2 * 3 - 1) * 2 * 2 * 3 * 2
    for r in rows:
        # (the quartiles of 2 rounds extrapolate: only their order is certain)
        band = r["eager_over_fused"]
        assert band["q1"] <= band["median"] <= band["q3"] and band["median"] > 0
        assert band["rounds"] >= 2 and 0 <= band["faster_rounds"] <= 1
        assert r["fused_ms"] > 0
    assert payload["geomean_eager_over_fused"] > 0
    assert (tmp_path / "s.png").stat().st_size > 1000
    assert (tmp_path / "w.png").stat().st_size > 1000
    assert "worst:" in proc.stdout
    # --redraw draws from the JSON alone, measuring nothing
    proc = run(tmp_path, "--redraw", "s.json", "--png-worst", "r.png")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "r.png").stat().st_size > 1000 and "worst:" not in proc.stdout
    proc = run_script("bench_sweep", "--redraw", "s.json", cwd=tmp_path)
    assert proc.returncode == 2 and "--redraw needs --png" in proc.stderr
    proc = run_script("bench_sweep", "--redraw", "missing.json", "--png", "m.png", cwd=tmp_path)
    assert proc.returncode == 2 and "--redraw: cannot read" in proc.stderr
    # (another benchmark's JSON, its rows without the sweep's ratios: refused, not a traceback)
    (tmp_path / "x.json").write_text(json.dumps({"results": [{"width": 8, "batch": 1}]}))
    proc = run_script("bench_sweep", "--redraw", "x.json", "--png", "x.png", cwd=tmp_path)
    assert proc.returncode == 2 and "--redraw: cannot read" in proc.stderr
    assert not (tmp_path / "x.png").exists()
    # (no rows, or a sweep's row with a median that is not a positive number, a width that is
    # not a positive int or a layout that is not a name: refused the same way)
    good = json.loads((tmp_path / "s.json").read_text())["results"][0]
    ratios = good["eager_over_fused"]
    for name, rows in [("empty", []),
                       ("text", [{**good, "eager_over_fused": {**ratios, "median": "1.1"}}]),
                       ("nan", [{**good, "eager_over_fused": {**ratios, "median": math.nan}}]),
                       ("width", [{**good, "width": -8}]), ("layout", [{**good, "layout": []}])]:
        (tmp_path / f"{name}.json").write_text(json.dumps({"results": rows}))
        proc = run_script("bench_sweep", "--redraw", f"{name}.json", "--png", f"{name}.png",
                          cwd=tmp_path)
        assert proc.returncode == 2 and "--redraw: cannot read" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
        assert not (tmp_path / f"{name}.png").exists()


def test_heat_grid_worst_is_the_lowest_median_of_every_layout_and_bias():
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "bench_sweep", os.path.join(ROOT, "benchmarks", "bench_sweep.py"))
    bench_sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_sweep)

    def row(width, batch, layout, bias, median, act="gelu"):
        return {"width": width, "batch": batch, "activation": act, "layout": layout,
                "bias": bias, "dtype": "float32", "eager_over_fused": {"median": median}}

    rows = [row(16, 1, "dense", True, 1.3), row(16, 1, "transposed", False, 0.9),
            row(16, 1, "expanded", True, 1.1), row(64, 1, "dense", True, 1.2),
            row(64, 1, "expanded", False, 1.5), row(16, 1, "dense", True, 0.5, act="relu")]
    assert bench_sweep.heat_grid(rows, "gelu", [16, 64], [1]) == [[0.9], [1.2]]
    assert bench_sweep.heat_grid(rows, "gelu", [16, 64], [1], "dense", True) == [[1.3], [1.2]]
    grid = bench_sweep.heat_grid(rows, "gelu", [16, 64], [1], "expanded", False)
    assert math.isnan(grid[0][0]) and grid[1][0] == 1.5


def test_bench_sweep_measures_named_cells_alone(tmp_path):
    proc = run(tmp_path, "--cells", "8x4:gelu:on:transposed:bfloat16", "16x1:none:off:expanded",
               "--repeats", "2", "--min-seconds", "0", "--json", "c.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    payload = json.loads((tmp_path / "c.json").read_text())
    rows = payload["results"]
    assert [(r["width"], r["batch"], r["activation"], r["bias"], r["layout"], r["dtype"])
            for r in rows] == [(8, 4, "gelu", True, "transposed", "bfloat16"),
                               (16, 1, "none", False, "expanded", "float32")]
    # (each cell in a new interpreter, unless --same-process: the same rows either way)
    assert payload["cells_each_in_a_new_process"] is True
    proc = run(tmp_path, "--cells", "8x4:gelu:on:transposed:bfloat16", "16x1:none:off:expanded",
               "--repeats", "2", "--min-seconds", "0", "--same-process", "--json", "s.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    payload = json.loads((tmp_path / "s.json").read_text())
    assert payload["cells_each_in_a_new_process"] is False
    assert [(r["width"], r["activation"]) for r in payload["results"]] == [(8, "gelu"),
                                                                           (16, "none")]
    proc = run_script("bench_sweep", "--cells", "8x4:gelu:on:dense:float16", cwd=tmp_path)
    assert proc.returncode == 2 and "dtype must be one of" in proc.stderr
    # --control: torch eager against itself in the same rounds (the method's null)
    proc = run(tmp_path, "--cells", "8x4:relu:on:dense", "--control", "--repeats", "3",
               "--min-seconds", "0", "--json", "n.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = json.loads((tmp_path / "n.json").read_text())["results"]
    null = row["eager_over_eager_again"]
    assert null["rounds"] == row["eager_over_fused"]["rounds"] >= 3
    assert 0 < null["q1"] <= null["median"] <= null["q3"]
    assert "eager/eager_again" in proc.stdout


def test_bench_sweep_refuses_unknown_names(tmp_path):
    proc = run_script("bench_sweep", "--activations", "relu,swish", cwd=tmp_path)
    assert proc.returncode == 2 and "unknown activations" in proc.stderr
    proc = run_script("bench_sweep", "--dtypes", "float16", cwd=tmp_path)
    assert proc.returncode == 2 and "--dtypes" in proc.stderr


def run_profile(tmp_path, *args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "profile_cells.py"),
                           *args], capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_profile_cells_names_each_sides_operators(tmp_path):
    # Two small cells: the fused side runs dpcuda's ops and torch's GEMMs inside them, the eager
    # side torch's activation; the GEMMs' share is a share.
    proc = run_profile(tmp_path, "32x64:gelu:on:transposed", "16x8:none:off:expanded:bfloat16",
                       "--steps", "2", "--json", "p.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "p.json").read_text())["results"]
    assert [(r["width"], r["activation"], r["bias"], r["layout"], r["dtype"]) for r in rows] == [
        (32, "gelu", True, "transposed", "float32"), (16, "none", False, "expanded", "bfloat16")]
    for r in rows:
        fused = {o["op"] for o in r["fused"]["ops"]}
        eager = {o["op"] for o in r["eager"]["ops"]}
        assert {"dpcuda::full_forward", "dpcuda::full_backward"} <= fused
        assert not any(op.startswith("dpcuda::") for op in eager)
        for side in (r["fused"], r["eager"]):
            assert 0 < side["gemm_share"] < 1 and side["total_us_per_step"] > 0
    assert "aten::gelu_backward" in {o["op"] for o in rows[0]["eager"]["ops"]}


def test_profile_cells_refuses_a_malformed_cell(tmp_path):
    proc = run_script("profile_cells", "32x64:gelu:maybe:dense", cwd=tmp_path)
    assert proc.returncode == 2 and "bias must be on or off" in proc.stderr
    proc = run_script("profile_cells", "32:gelu:on:dense", cwd=tmp_path)
    assert proc.returncode == 2 and "WIDTHxBATCH" in proc.stderr
    proc = run_script("profile_cells", "32x64:swish:on:dense", cwd=tmp_path)
    assert proc.returncode == 2 and "activation must be one of" in proc.stderr
    proc = run_script("profile_cells", "32x64:gelu:on:sliced", cwd=tmp_path)
    assert proc.returncode == 2 and "layout must be one of" in proc.stderr
    proc = run_script("profile_cells", "--from", "s.json", "--alone-consecutive-ms", "-1",
                      cwd=tmp_path)
    assert proc.returncode == 2 and "--alone-consecutive-ms must be 0 or more" in proc.stderr
    proc = run_script("profile_cells", "--interleaved", "-1", cwd=tmp_path)
    assert proc.returncode == 2 and "--interleaved must be 0 or more" in proc.stderr
    proc = run_script("profile_cells", "--from", "s.json", "--interleaved", "2", cwd=tmp_path)
    assert proc.returncode == 2 and "--interleaved profiles the cells given" in proc.stderr


def test_profile_cells_interleaved_takes_each_sides_steps_apart(tmp_path):
    # --interleaved: one profile, the sides' steps in turn; every step of each side counted
    # (turns x steps), each side's operators its own (dpcuda's ops on the fused side only), and
    # a step's GEMMs and the rest each within the step's own time.
    proc = run_profile(tmp_path, "32x64:sigmoid:on:expanded:bfloat16", "--interleaved", "3",
                       "--steps", "2", "--json", "p.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["interleaved_turns"] == 3 and data["steps"] == 2
    (row,) = data["results"]
    assert (row["width"], row["activation"], row["bias"], row["layout"], row["dtype"]) == (
        32, "sigmoid", True, "expanded", "bfloat16")
    fused = {o["op"]: o for o in row["fused"]["ops"]}
    eager = {o["op"]: o for o in row["eager"]["ops"]}
    assert fused["dpcuda::full_forward"]["calls_per_step"] == 1
    assert fused["dpcuda::full_backward"]["calls_per_step"] == 1
    assert not any(op.startswith("dpcuda::") for op in eager)
    assert eager["aten::sigmoid"]["calls_per_step"] == 1
    for side in (row["fused"], row["eager"]):
        assert side["steps"] == 6
        assert 0 < side["gemm_us_per_step"] and 0 < side["own_us_per_step"]
        # (each part at most its step, step by step, so their medians at most the step's)
        assert side["gemm_us_per_step"] <= side["step_us"]
        assert side["own_us_per_step"] <= side["step_us"]


def test_bench_activation_pass_times_the_pass_behind_a_narrow_input(tmp_path):
    # --in-features narrows the layer's input, the pass's size (batch x width) unchanged.
    script = os.path.join(ROOT, "benchmarks", "bench_activation_pass.py")
    proc = subprocess.run([sys.executable, script, "--width", "16", "--in-features", "4",
                           "--batches", "8", "--activations", "gelu,relu", "--rounds", "2",
                           "--json", "p.json"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    payload = json.loads((tmp_path / "p.json").read_text())
    assert payload["benchmark"] == "activation_pass"
    assert [(r["width"], r["in_features"], r["batch"], r["activation"])
            for r in payload["results"]] == [(16, 4, 8, "gelu"), (16, 4, 8, "relu")]
    assert all(r["torch_ns_per_element"] > 0 for r in payload["results"])
    for bad in (("--in-features", "0"), ("--in-features", "4", "--routes")):
        proc = run_script("bench_activation_pass", *bad, cwd=tmp_path)
        assert proc.returncode == 2 and "--in-features must be at least 1, and not with " \
            "--routes" in proc.stderr


def run_activation_pass(tmp_path, *args):
    """bench_activation_pass.py with args in a new interpreter: its JSON (it must succeed)."""
    script = os.path.join(ROOT, "benchmarks", "bench_activation_pass.py")
    proc = subprocess.run([sys.executable, script, *args, "--json", "out.json"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((tmp_path / "out.json").read_text())


def test_bench_activation_pass_measures_the_g_layouts(tmp_path, monkeypatch):
    # --g-layouts: the bfloat16 layer's backward over a transposed gradient with g row-major
    # against column-major, with and without the bias's gradient; tanh and gelu by default. The
    # JSON records glibc's malloc and OpenMP's settings where the environment sets them.
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1073741824")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    payload = run_activation_pass(tmp_path, "--g-layouts", "--width", "8", "--batches", "4,16",
                                  "--rounds", "2")
    assert payload["benchmark"] == "g_layouts"
    assert payload["environment"]["malloc_env"]["MALLOC_TRIM_THRESHOLD_"] == "1073741824"
    assert payload["environment"]["openmp_env"]["OMP_WAIT_POLICY"] == "PASSIVE"
    assert [(r["width"], r["batch"], r["activation"], r["bias"]) for r in payload["results"]] == [
        (8, b, a, bias) for b in (4, 16) for a in ("tanh", "gelu") for bias in (False, True)]
    for r in payload["results"]:
        band = r["rows_over_columns"]
        assert r["rows_us"] > 0 and r["columns_us"] > 0 and band["q1"] <= band["q3"]
    proc = run_script("bench_activation_pass", "--g-layouts", "--bias-routes", cwd=tmp_path)
    assert proc.returncode == 2 and "one at a time" in proc.stderr


def test_bench_activation_pass_measures_the_float_bias_routes(tmp_path):
    # --bias-routes: the float32 layer's forward with a bias, its bias added by dpcuda's pass
    # after mm against in the GEMM (addmm); silu, gelu and relu by default; not with --routes.
    payload = run_activation_pass(tmp_path, "--bias-routes", "--width", "8", "--batches", "4,16",
                                  "--rounds", "2")
    assert payload["benchmark"] == "bias_routes"
    assert [(r["width"], r["batch"], r["activation"], r["bias"]) for r in payload["results"]] == [
        (8, b, a, True) for b in (4, 16) for a in ("silu", "gelu", "relu")]
    for r in payload["results"]:
        band = r["pass_over_addmm"]
        assert r["pass_us"] > 0 and r["addmm_us"] > 0 and band["q1"] <= band["q3"]
    proc = run_script("bench_activation_pass", "--bias-routes", "--routes", cwd=tmp_path)
    assert proc.returncode == 2 and "one at a time" in proc.stderr
    proc = run_script("bench_activation_pass", "--bias-routes", "--activations", "none",
                      cwd=tmp_path)
    assert proc.returncode == 2 and "unknown 'none'" in proc.stderr


def test_bench_activation_pass_measures_the_bfloat16_routes(tmp_path):
    # --routes: the bfloat16 layer's forward with its activation by dpcuda's pass and by ATen's
    # kernel (silu and sigmoid by default), with and without bias; "none" has no activation,
    # gelu's is ATen's on either route.
    payload = run_activation_pass(tmp_path, "--routes", "--width", "8,4", "--batches", "4,16",
                                  "--rounds", "2")
    assert payload["benchmark"] == "activation_routes" and "cpu_isa" in payload["environment"]
    assert [(r["width"], r["batch"], r["activation"], r["bias"]) for r in payload["results"]] == [
        (w, b, a, bias) for w in (8, 4) for b in (4, 16) for a in ("silu", "sigmoid")
        for bias in (False, True)]
    for r in payload["results"]:
        band = r["aten_over_pass"]
        assert r["pass_us"] > 0 and r["aten_us"] > 0 and band["q1"] <= band["q3"]
    proc = run_script("bench_activation_pass", "--routes", "--activations", "none",
                      cwd=tmp_path)
    assert proc.returncode == 2 and "unknown 'none'" in proc.stderr
    proc = run_script("bench_activation_pass", "--routes", "--activations", "gelu",
                      cwd=tmp_path)
    assert proc.returncode == 2 and "unknown 'gelu'" in proc.stderr
    proc = run_script("bench_activation_pass", "--activations", "relu,swish", cwd=tmp_path)
    assert proc.returncode == 2 and "unknown 'swish'" in proc.stderr
    proc = run_script("bench_activation_pass", "--batches", "4,x", cwd=tmp_path)
    assert proc.returncode == 2 and "--batches must be integers" in proc.stderr
    proc = run_script("bench_activation_pass", "--activations", "silu,", cwd=tmp_path)
    assert proc.returncode == 2 and "unknown ''" in proc.stderr


def test_profile_cells_explains_a_sweeps_cells_below_one(tmp_path):
    # A sweep's JSON with two cells below 1 and one above: the two are timed alone, profiled
    # and given a verdict; the one above is left out. Square cells: both sides' GEMM calls are
    # the same operators on the same shapes.
    cells = [(16, 8, "relu", True, "dense", 0.95), (8, 4, "none", False, "expanded", 0.90),
             (16, 8, "tanh", False, "dense", 1.20)]
    sweep = {"results": [
        {"width": w, "batch": b, "activation": a, "bias": bi, "layout": lay,
         "dtype": "float32", "eager_over_fused": {"median": m, "q1": m, "q3": m}}
        for w, b, a, bi, lay, m in cells]}
    (tmp_path / "s.json").write_text(json.dumps(sweep))
    proc = run_profile(tmp_path, "--from", "s.json", "--steps", "2", "--rounds", "3",
                       "--alone-repeats", "3", "--alone-min-seconds", "0",
                       "--alone-consecutive-ms", "0.5", "--json", "e.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads((tmp_path / "e.json").read_text())
    assert out["alone_consecutive_ms"] == 0.5
    rows = out["results"]
    assert [(r["width"], r["activation"], r["grid"]["median"]) for r in rows] == [
        (8, "none", 0.90), (16, "relu", 0.95)]
    for r in rows:
        behind = r["alone"]["median"] < 1.0
        assert (r["verdict"]["kind"] in ("no loss in the profile", "GEMMs", "own work",
                                         "other products", "within the noise")) == \
            behind, r["verdict"]
        assert r["verdict"]["same_gemm_calls"]
        assert 2 <= r["profiled_steps"] <= 2
        assert r["alone_steps_per_turn"] >= 2  # (--alone-consecutive-ms: one untimed, then more)
        for side in ("fused", "eager"):
            s = r[side]
            assert 0 < s["own_us_per_step"] < s["total_us_per_step"]
            assert s["minor_faults_per_step"] >= 0
            assert sorted(s["gemm_calls"].values()) == [1.0, 2.0]  # (x's, w's and g's)
        assert r["verdict"]["own_us_noise"] == max(r["fused"]["own_us_spread"],
                                                   r["eager"]["own_us_spread"])
        assert r["verdict"]["minor_faults_per_step"] == [r["fused"]["minor_faults_per_step"],
                                                         r["eager"]["minor_faults_per_step"]]
    assert sum(out["verdicts"].values()) == 2
    assert "2 cells below 1.0" in proc.stdout


def test_profile_cells_explain_keeps_each_cell_and_resumes(tmp_path):
    # The explanation's JSON is written after each cell; --resume takes the cells a run cut
    # short wrote and explains only the rest.
    cells = [(16, 8, "relu", True, "dense", 0.95), (8, 4, "none", False, "expanded", 0.90)]
    sweep = {"results": [
        {"width": w, "batch": b, "activation": a, "bias": bi, "layout": lay,
         "dtype": "float32", "eager_over_fused": {"median": m, "q1": m, "q3": m}}
        for w, b, a, bi, lay, m in cells]}
    (tmp_path / "s.json").write_text(json.dumps(sweep))
    common = ("--from", "s.json", "--steps", "2", "--rounds", "3", "--alone-repeats", "3",
              "--alone-min-seconds", "0")
    proc = run_profile(tmp_path, *common, "--json", "e.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    full = json.loads((tmp_path / "e.json").read_text())
    assert full["complete"] and len(full["results"]) == 2
    cut = dict(full, complete=False, results=full["results"][:1])  # (as after the first cell)
    (tmp_path / "cut.json").write_text(json.dumps(cut))
    proc = run_profile(tmp_path, *common, "--resume", "cut.json", "--json", "r.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 cells taken from cut.json" in proc.stdout
    assert proc.stdout.count(": grid ") == 1 and "8x8 batch 4" not in proc.stdout
    out = json.loads((tmp_path / "r.json").read_text())
    assert out["complete"] and out["results"][0] == full["results"][0]
    assert [(r["width"], r["activation"]) for r in out["results"]] == [(8, "none"), (16, "relu")]
    assert sum(out["verdicts"].values()) == 2
    # (a JSON of another sweep, or --resume without --from, is refused before any timing)
    (tmp_path / "other.json").write_text(json.dumps(dict(cut, sweep="t.json")))
    proc = run_profile(tmp_path, *common, "--resume", "other.json")
    assert proc.returncode == 2 and "--resume" in proc.stderr and "s.json" in proc.stderr
    proc = run_profile(tmp_path, "--resume", "cut.json", "8x8:relu:on:dense")
    assert proc.returncode == 2 and "--resume continues a --from run" in proc.stderr


def test_profile_cells_verdicts():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from profile_cells import verdict
    finally:
        sys.path.pop(0)
    calls = {"[8, 8] x [8, 8]": 2.0}
    side = lambda own, gemm, c=calls, spread=20: {  # noqa: E731
        "own_us_per_step": own, "own_us_spread": spread, "gemm_us_per_step": gemm,
        "gemm_calls": c}
    alone = lambda median, q1: {"median": median, "q1": q1}  # noqa: E731
    assert verdict(alone(1.03, 1.01), side(50, 100), side(10, 90), 1.0)["kind"] == "ahead alone"
    assert verdict(alone(1.01, 0.97), side(50, 100), side(10, 90), 1.0)["kind"] == "level alone"
    # Behind alone: where the profiles' difference lies.
    v = verdict(alone(0.97, 0.95), side(40, 110), side(45, 100), 1.0)
    assert v["kind"] == "GEMMs" and v["own_us"] == [40, 45] and v["gemm_us"] == [110, 100]
    # (dpcuda's own part costs more, within its noise, and its GEMMs' extra time is the larger)
    v = verdict(alone(0.97, 0.95), side(50, 110), side(45, 100), 1.0)
    assert v["kind"] == "GEMMs" and v["own_us_noise"] == 20 and not v["own_beyond_noise"]
    # The noise is the larger of the two spreads, and a difference equal to it is within it.
    assert verdict(alone(0.97, 0.95), side(60, 130, spread=20), side(45, 100, spread=2),
                   1.0)["kind"] == "GEMMs"
    assert verdict(alone(0.97, 0.95), side(55, 130, spread=10), side(45, 100, spread=10),
                   1.0)["kind"] == "GEMMs"
    # The same with the own parts steadier than their difference: a loss of dpcuda's own that
    # the GEMMs' difference would hide (the float32 gelu cell of session 29's profile).
    assert verdict(alone(0.97, 0.95), side(50, 110, spread=3), side(45, 100, spread=4),
                   1.0)["kind"] == "own work"
    assert verdict(alone(0.97, 0.95), side(50, 300, spread=3), side(45, 100), 1.0)["kind"] == \
        "GEMMs"  # (torch's own spread, 20, is the noise)
    v = verdict(alone(0.97, 0.95), side(60, 100, spread=5), side(45, 100, spread=5), 1.0)
    assert v["kind"] == "own work" and v["own_beyond_noise"]
    # The own parts' difference the larger but within the noise, the GEMMs level: undecided.
    assert verdict(alone(0.97, 0.95), side(60, 100), side(45, 100), 1.0)["kind"] == \
        "within the noise"
    # Ahead alone, and still a loss of dpcuda's own beyond its noise: recorded.
    v = verdict(alone(1.03, 1.01), side(60, 90, spread=5), side(45, 100, spread=5), 1.0)
    assert v["kind"] == "ahead alone" and v["own_beyond_noise"]
    # dpcuda's GEMMs faster and its own part slower by more: its own work.
    assert verdict(alone(0.97, 0.95), side(60, 95, spread=5), side(45, 100, spread=5),
                   1.0)["kind"] == "own work"
    # ... also where the GEMMs' gain outweighs it, once the own parts' difference stands out.
    assert verdict(alone(0.97, 0.95), side(70, 50), side(45, 100), 1.0)["kind"] == "own work"
    # The profiles show dpcuda no slower: not GEMMs, not its own work.
    assert verdict(alone(0.97, 0.95), side(40, 99), side(45, 100), 1.0)["kind"] == \
        "no loss in the profile"
    assert verdict(alone(0.97, 0.95), side(60, 50), side(45, 100), 1.0)["kind"] == \
        "no loss in the profile"  # (+15 within the noise of 20)
    # Other matrix products on dpcuda's side: not the same GEMMs, its choice.
    other = side(40, 110, {"[8, 8] x [8, 4]": 2.0})
    v = verdict(alone(0.97, 0.95), other, side(45, 100), 1.0)
    assert v["kind"] == "other products" and not v["same_gemm_calls"]


def test_profile_cells_refuses_an_unreadable_sweep(tmp_path):
    proc = run_script("profile_cells", "--from", "missing.json", "--rounds", "2", cwd=tmp_path)
    assert proc.returncode == 2 and "--rounds must be at least 3 with --from" in proc.stderr
    proc = run_script("profile_cells", "--from", "missing.json", cwd=tmp_path)
    assert proc.returncode == 2 and "--from" in proc.stderr and "missing.json" in proc.stderr
    (tmp_path / "bad.json").write_text('{"results": [{"width": 8}]}')
    proc = run_script("profile_cells", "--from", "bad.json", cwd=tmp_path)
    assert proc.returncode == 2 and "--from" in proc.stderr
    # (a cell's values are checked before any is measured)
    (tmp_path / "bad2.json").write_text(json.dumps({"results": [
        {"width": 8, "batch": 4, "activation": "swish", "bias": True, "layout": "dense",
         "dtype": "float32", "eager_over_fused": {"median": 0.9}}]}))
    proc = run_script("profile_cells", "--from", "bad2.json", cwd=tmp_path)
    assert proc.returncode == 2 and "activation must be one of" in proc.stderr
    proc = run_script("profile_cells", "--from", "bad.json", "8x8:relu:on:dense",
                      cwd=tmp_path)
    assert proc.returncode == 2 and "not both" in proc.stderr


def test_bench_after_gemm_splits_steps_into_gemms_and_the_rest(tmp_path):
    # The probes (warm and after a GEMM) and a cell's steps cut into the GEMMs and the rest.
    script = os.path.join(ROOT, "benchmarks", "bench_after_gemm.py")
    proc = subprocess.run([sys.executable, script, "--width", "16", "--batch", "64", "--rounds",
                           "3", "--cells", "16x32:none:off:dense",
                           "8x4:silu:on:expanded:bfloat16", "--steps", "3", "--threads", "1",
                           "--json", "g.json"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    payload = json.loads((tmp_path / "g.json").read_text())
    assert payload["benchmark"] == "after_gemm" and len(payload["probes"]) == 5
    assert all(r["warm_us"] > 0 and r["after_gemm_us"] > 0 for r in payload["probes"])
    assert [(c["width"], c["batch"], c["activation"], c["dtype"]) for c in payload["cells"]] == [
        (16, 32, "none", "float32"), (8, 4, "silu", "bfloat16")]
    for c in payload["cells"]:
        for side in ("fused_us", "eager_us"):
            parts = c[side]
            # (each a median over the steps: the parts' medians need not add up exactly)
            assert parts["step"] > 0 and parts["gemms"] > 0 and parts["rest"] > 0
    proc = run_script("bench_after_gemm", "--steps", "0", cwd=tmp_path)
    assert proc.returncode == 2 and "at least 1" in proc.stderr


def test_compare_samples_times_consecutive_runs_without_the_first(monkeypatch):
    # A contender that pays 30 ms whenever the other ran last (what it inherits): timed one run
    # a turn, every sample pays it; in turns of 3 consecutive runs, the first untimed, none does.
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from common import compare_samples
    finally:
        sys.path.pop(0)
    last = [None]
    calls = {"a": 0, "b": 0}

    def contender(name):
        def fn():
            if last[0] not in (None, name):
                time.sleep(0.03)
            last[0] = name
            calls[name] += 1
        return fn

    fns = {"a": contender("a"), "b": contender("b")}
    one = compare_samples(fns, "cpu", warmup=0, repeats=4, consecutive=1)
    assert sum(ms >= 25 for ms in one["a"] + one["b"]) >= 6
    calls.update(a=0, b=0)
    three = compare_samples(fns, "cpu", warmup=0, repeats=4, consecutive=3)
    assert len(three["a"]) == len(three["b"]) == 4 and calls == {"a": 12, "b": 12}
    assert all(ms < 5 for ms in three["a"] + three["b"])
    with pytest.raises(ValueError, match="consecutive"):
        compare_samples(fns, "cpu", consecutive=0)
    with pytest.raises(ValueError, match="consecutive"):
        compare_samples(fns, "cuda", consecutive=2)
    with pytest.raises(ValueError, match="before"):
        compare_samples(fns, "cpu", consecutive=2, before=lambda: None)


def test_bench_sweep_runs_consecutive_steps_a_turn(tmp_path, monkeypatch):
    # (two cells: each in its own interpreter, which must be given the option)
    proc = run(tmp_path, "--cells", "8x4:relu:on:dense", "16x2:gelu:off:transposed:bfloat16",
               "--consecutive-ms", "0.5", "--control", "--repeats", "3", "--min-seconds", "0",
               "--json", "k.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    payload = json.loads((tmp_path / "k.json").read_text())
    assert payload["consecutive_ms"] == 0.5 and len(payload["results"]) == 2
    for row in payload["results"]:
        assert 2 <= row["steps_per_turn"] <= 51 and row["eager_over_fused"]["rounds"] >= 3
    proc = run(tmp_path, "--cells", "8x4:relu:on:dense", "--repeats", "2", "--min-seconds", "0",
               "--json", "d.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((tmp_path / "d.json").read_text())["results"][0]["steps_per_turn"] == 1
    for bad in ("-1", "inf", "nan"):
        proc = run_script("bench_sweep", "--consecutive-ms", bad, cwd=tmp_path)
        assert proc.returncode == 2 and "--consecutive-ms" in proc.stderr, bad
    # The cell's turns are what compare_samples is given.
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import bench_sweep
    finally:
        sys.path.pop(0)
    given = []
    real = bench_sweep.compare_samples
    monkeypatch.setattr(bench_sweep, "compare_samples",
                        lambda *a, **k: given.append(k["consecutive"]) or real(*a, **k))
    _, turn = bench_sweep.cell(8, 4, "relu", True, "dense", torch.float32, False, 2, 0.0,
                               consecutive_ms=0.5)
    assert given == [turn] and turn >= 2
