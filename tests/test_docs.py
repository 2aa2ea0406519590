"""The documents stay true: every ```python block of README.md and docs/*.md runs, and the
measured tables of docs/benchmarks.md are what benchmarks/tables.py renders from the JSON.

Code blocks. Each block fenced as ```python runs on its own in a fresh interpreter (this one's
executable, a temporary working directory, the repository on PYTHONPATH) and must exit with
status 0. A block that needs a GPU is fenced as ```python gpu: it is skipped unless
dpcuda.cuda_available(). A block that is not meant to run (output, a command line, a sketch)
is fenced as something else (```text, ```bash, or a bare ```), and is not collected.

Command lines. The README's ```bash block of `python -m dpcuda` commands (the quickstart's
command line) runs too, line by line in one temporary directory, with the files it names made
first (COMMAND_FILES: a small labelled CSV and new rows); each command must exit with status 0.
"""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

import dpcuda

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.join("docs", name)
                              for name in os.listdir(os.path.join(ROOT, "docs"))
                              if name.endswith(".md"))
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<info>.*)$")


def python_blocks(path):
    """(first line number, info words after "python", code) of each ```python block."""
    with open(os.path.join(ROOT, path)) as f:
        lines = f.read().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        i += 1
        if not fence:
            continue
        info = fence["info"].split()
        end = i
        while end < len(lines) and not re.match(r"^\s*```\s*$", lines[end]):
            end += 1
        if info and info[0] == "python":
            indent = len(fence["indent"])
            blocks.append((i + 1, info[1:], "\n".join(line[indent:] for line in lines[i:end])))
        i = end + 1
    return blocks


BLOCKS = [pytest.param(path, *block, id=f"{path}:{n}")
          for path in DOCS for n, block in enumerate(python_blocks(path), 1)]


@pytest.mark.parametrize("path,line,info,code", BLOCKS)
def test_python_block_runs(path, line, info, code, tmp_path):
    if "gpu" in info and not dpcuda.cuda_available():
        pytest.skip("needs a GPU")
    # Blank lines before the code put the document's line numbers into a traceback.
    script = tmp_path / "block.py"
    script.write_text("\n" * (line - 1) + code + "\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (f"{path}, the block at line {line}, exited with "
                                  f"{proc.returncode}:\n{proc.stderr}")


def command_blocks(path):
    """(first line number, lines) of each ```bash block made only of `python -m dpcuda` lines."""
    with open(os.path.join(ROOT, path)) as f:
        lines = f.read().split("\n")
    blocks = []
    for i, line in enumerate(lines):
        fence = FENCE.match(line)
        if not fence or fence["info"].strip() != "bash":
            continue
        end = i + 1
        while end < len(lines) and not re.match(r"^\s*```\s*$", lines[end]):
            end += 1
        body = [b.strip() for b in lines[i + 1:end] if b.strip()]
        if body and all(b.startswith("python -m dpcuda ") for b in body):
            blocks.append((i + 2, body))
    return blocks


def _labelled_csv(path, rows, seed):
    import numpy as np
    rng = np.random.default_rng(seed)
    centres = np.random.default_rng(0).normal(size=(3, 8)) * 4
    y = rng.integers(0, 3, rows)
    x = centres[y] + rng.normal(size=(rows, 8))
    with open(path, "w") as f:
        f.write(",".join([f"f{i}" for i in range(8)] + ["label"]) + "\n")
        for row, label in zip(x, y):
            f.write(",".join(f"{v:.5f}" for v in row) + f",{label}\n")


COMMAND_FILES = {"mine.csv": lambda p: _labelled_csv(p, 600, 1),
                 "new.csv": lambda p: _labelled_csv(p, 50, 2)}


@pytest.mark.parametrize("line,commands", command_blocks("README.md"))
def test_readme_command_lines_run(line, commands, tmp_path):
    for name, make in COMMAND_FILES.items():
        make(tmp_path / name)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    # `python` is this interpreter (the project's environment)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    for command in commands:
        proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (f"README.md line {line}: {command}\n{proc.stderr}")


def test_python_blocks_are_found():
    """The collector sees the README's blocks (an empty parametrisation would pass silently)."""
    assert python_blocks("README.md")
    assert command_blocks("README.md")


def tables():
    spec = importlib.util.spec_from_file_location(
        "tables", os.path.join(ROOT, "benchmarks", "tables.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_tables_match_their_json(capsys):
    rc = tables().main(["--check"])
    assert rc == 0, ("docs/benchmarks.md is out of date; run python benchmarks/tables.py:\n"
                     + capsys.readouterr().out)


def test_check_finds_a_changed_cell_and_the_rewrite_restores_it(tmp_path, capsys):
    module = tables()
    with open(module.DOC) as f:
        original = f.read()
    lines = original.split("\n")
    begin = next(i for i, line in enumerate(lines) if module.BEGIN.match(line))
    name = module.BEGIN.match(lines[begin])["name"]
    # The first data row's last cell, under the header and the |---| line.
    row = lines[begin + 3].split("|")
    row[-2] = " 9.99 " if row[-2] != " 9.99 " else " 1.11 "
    lines[begin + 3] = "|".join(row)
    doc = tmp_path / "benchmarks.md"
    doc.write_text("\n".join(lines))

    assert module.main(["--check", "--doc", str(doc)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith(f"{name}: stale"), out

    assert module.main(["--doc", str(doc)]) == 0
    assert doc.read_text() == original
    assert module.main(["--check", "--doc", str(doc)]) == 0


def test_check_reports_unknown_and_missing_tables(tmp_path, capsys):
    module = tables()
    with open(module.DOC) as f:
        text = f.read()
    name = next(iter(module.TABLES))
    renamed = text.replace(f"<!-- table: {name} (", "<!-- table: no-such.json (", 1)
    doc = tmp_path / "benchmarks.md"
    doc.write_text(renamed)
    assert module.main(["--check", "--doc", str(doc)]) == 1
    out = capsys.readouterr().out
    assert "no-such.json: no renderer" in out and f"{name}: not marked" in out


def public_objects():
    """(qualified name, object) of every public function, class, method and property of
    dpcuda's modules (the names in each module's __all__, and their public members)."""
    import importlib
    import inspect
    import pkgutil

    import dpcuda.parallel
    names = ["dpcuda"] + [f"dpcuda.{m.name}" for m in pkgutil.iter_modules(dpcuda.__path__)
                          if not m.name.startswith("_")]
    names += [f"dpcuda.parallel.{m.name}" for m in pkgutil.iter_modules(dpcuda.parallel.__path__)
              if not m.name.startswith("_")]
    found = []
    for name in names:
        module = importlib.import_module(name)
        found.append((name, module))
        for attr in getattr(module, "__all__", []):
            obj = getattr(module, attr)
            if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            found.append((f"{name}.{attr}", obj))
            if inspect.isclass(obj):
                found += [(f"{name}.{attr}.{k}", v) for k, v in vars(obj).items()
                          if not k.startswith("_") and
                          (inspect.isfunction(v) or isinstance(v, property))]
    return found


def test_every_public_function_and_class_has_a_docstring():
    """What help() shows: a docstring for every public module, function, class, method and
    property (a new one without fails here)."""
    missing = [name for name, obj in public_objects() if not (obj.__doc__ or "").strip()]
    assert not missing, missing
    assert len(public_objects()) > 100  # (the walk finds the package)
