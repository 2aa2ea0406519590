"""The documents stay true: every ```python block of README.md and docs/*.md runs, and the
measured tables of docs/results.md are what benchmarks/tables.py renders from the JSON.

Code blocks. Each block fenced as ```python runs on its own in a fresh interpreter (this one's
executable, a temporary working directory, the repository on PYTHONPATH) and must exit with
status 0. A block that needs a GPU is fenced as ```python gpu: it is skipped unless
dpcuda.cuda_available(). A block that is not meant to run (output, a command line, a sketch)
is fenced as something else (```text, ```bash, or a bare ```), and is not collected.
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


def test_python_blocks_are_found():
    """The collector sees the README's blocks (an empty parametrisation would pass silently)."""
    assert python_blocks("README.md")


def tables():
    spec = importlib.util.spec_from_file_location(
        "tables", os.path.join(ROOT, "benchmarks", "tables.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_tables_match_their_json(capsys):
    rc = tables().main(["--check"])
    assert rc == 0, ("docs/results.md is out of date; run python benchmarks/tables.py:\n"
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
    doc = tmp_path / "results.md"
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
    doc = tmp_path / "results.md"
    doc.write_text(renamed)
    assert module.main(["--check", "--doc", str(doc)]) == 1
    out = capsys.readouterr().out
    assert "no-such.json: no renderer" in out and f"{name}: not marked" in out
