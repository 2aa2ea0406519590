"""The import-time refusal of an extension that carries its own copy of the C++ runtime
(libstdc++ linked statically): on a GPU machine whose compiler wrapper did that, errors raised
in C++ crashed the test suite's processes. The check must pass this build and fire on a
library built with -static-libstdc++."""

import shutil
import subprocess

import pytest

import dpcuda

SOURCE = '#include <stdexcept>\nextern "C" int f(int x) { if (x) throw std::runtime_error("x"); return 0; }\n'


def build(tmp_path, *flags):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = tmp_path / "throws.cpp"
    src.write_text(SOURCE)
    out = tmp_path / f"throws{len(flags)}.so"
    done = subprocess.run([cxx, "-shared", "-fPIC", *flags, str(src), "-o", str(out)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot build the test library: {done.stderr.strip()[:200]}")
    return str(out)


def test_this_build_uses_the_process_cxx_runtime():
    assert not dpcuda._own_cxx_runtime(dpcuda._C.__file__)


def test_a_statically_linked_cxx_runtime_is_found(tmp_path):
    assert dpcuda._own_cxx_runtime(build(tmp_path, "-static-libstdc++"))
    assert not dpcuda._own_cxx_runtime(build(tmp_path))


def test_what_cannot_be_told_is_not_refused(tmp_path):
    assert not dpcuda._own_cxx_runtime(str(tmp_path / "missing.so"))
