"""glibc's malloc thresholds, set when dpcuda is imported (dpcuda/_heap.py): each case in a new
interpreter, since glibc's settings belong to the process."""

import json
import os
import platform
import subprocess
import sys

import pytest

from dpcuda import _heap

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# Where a 30 MiB block comes from, and whether freeing it hands the heap's top back: from the
# heap (below the program break) and kept there with dpcuda's thresholds; mapped afresh by
# glibc's defaults (its mmap threshold is 128 KiB until the process frees a mapped block, and
# importing torch frees none that large).
PROBE = r"""
import ctypes, json, sys
import torch
if sys.argv[1] == "dpcuda":
    import dpcuda
    state = dpcuda._heap.STATE
else:
    state = None
libc = ctypes.CDLL(None)
libc.sbrk.restype = libc.malloc.restype = ctypes.c_void_p
libc.sbrk.argtypes = (ctypes.c_ssize_t,)
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
size = 30 << 20
block = libc.malloc(size)
from_heap = block < libc.sbrk(0)
libc.free(block)
kept = libc.sbrk(0) >= block + size
print(json.dumps({"state": state, "from_heap": from_heap, "kept": from_heap and kept}))
"""


def probe(env_changes, what="dpcuda"):
    env = {k: v for k, v in os.environ.items()
           if k not in _heap._USER_SETTINGS and
           k not in ("GLIBC_TUNABLES", "DPCUDA_TUNE_MALLOC", "LD_PRELOAD")}
    env.update(env_changes)
    proc = subprocess.run([sys.executable, "-c", PROBE, what], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@glibc
def test_import_sets_glibc_thresholds_to_their_dynamic_limits():
    got = probe({})
    assert got == {"state": "set", "from_heap": True, "kept": True}


@glibc
def test_without_dpcuda_glibc_maps_the_block():
    # (the probe's control: what the first test sees is dpcuda's doing)
    assert probe({}, what="torch") == {"state": None, "from_heap": False, "kept": False}


@glibc
@pytest.mark.parametrize("env, state", [
    ({"DPCUDA_TUNE_MALLOC": "0"}, "DPCUDA_TUNE_MALLOC=0"),
    ({"DPCUDA_TUNE_MALLOC": "Off"}, "DPCUDA_TUNE_MALLOC=Off"),
    ({"MALLOC_MMAP_THRESHOLD_": "131072"}, "MALLOC_MMAP_THRESHOLD_ is set"),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"},
     "GLIBC_TUNABLES sets glibc.malloc.mmap_threshold"),
])
def test_the_users_choice_is_left_as_it_is(env, state):
    got = probe(env)
    assert got == {"state": state, "from_heap": False, "kept": False}


@glibc
def test_a_preloaded_malloc_is_left_alone(tmp_path):
    # Another malloc in front of glibc's (as jemalloc or tcmalloc by LD_PRELOAD): glibc's
    # thresholds would not be the process's, so nothing is set and STATE says why.
    source = tmp_path / "interpose.c"
    source.write_text(
        "#define _GNU_SOURCE\n#include <dlfcn.h>\n#include <stddef.h>\n"
        "void* malloc(size_t n) {\n"
        "  static void* (*real)(size_t);\n"
        "  if (!real) real = (void* (*)(size_t))dlsym(RTLD_NEXT, \"malloc\");\n"
        "  return real(n);\n}\n")
    library = tmp_path / "libinterpose.so"
    try:
        built = subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source),
                                "-ldl"], capture_output=True, text=True, timeout=60)
    except OSError:
        pytest.skip("no C compiler")
    assert built.returncode == 0, built.stderr
    got = probe({"LD_PRELOAD": str(library)})
    assert got["state"] == "the process's malloc is not glibc's (preloaded)"


def test_why_not_reads_the_environment():
    assert _heap.why_not({}) is None
    for on in ("1", "true", "ON", " yes ", ""):
        assert _heap.why_not({"DPCUDA_TUNE_MALLOC": on}) is None
    for off in ("0", " 0 ", "false", "Off", "NO"):
        assert _heap.why_not({"DPCUDA_TUNE_MALLOC": off}) == f"DPCUDA_TUNE_MALLOC={off}"
    for name in _heap._USER_SETTINGS:
        assert _heap.why_not({name: "0"}) == f"{name} is set"
    # (only the tunables that fix the thresholds, as mallopt does, are the user's choice here)
    assert _heap.why_not({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}) is None
    assert _heap.why_not({"MALLOC_ARENA_MAX": "2"}) is None
    for tunable in _heap._USER_TUNABLES:
        assert _heap.why_not({"GLIBC_TUNABLES": f"glibc.pthread.rseq=0:{tunable}=4096"}) == \
            f"GLIBC_TUNABLES sets {tunable}"
    assert _heap.tune({"DPCUDA_TUNE_MALLOC": "0"}) == "DPCUDA_TUNE_MALLOC=0"


def test_an_unclear_switch_warns_and_leaves_malloc_alone():
    with pytest.warns(RuntimeWarning, match="DPCUDA_TUNE_MALLOC='maybe' not understood"):
        state = _heap.tune({"DPCUDA_TUNE_MALLOC": "maybe"})
    assert state.startswith("DPCUDA_TUNE_MALLOC='maybe' not understood")
