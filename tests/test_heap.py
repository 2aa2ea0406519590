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
           if k not in _heap._USER_SETTINGS and k not in ("GLIBC_TUNABLES", "DPCUDA_TUNE_MALLOC")}
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
    ({"MALLOC_MMAP_THRESHOLD_": "131072"}, "MALLOC_MMAP_THRESHOLD_ is set"),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"},
     "GLIBC_TUNABLES sets glibc.malloc"),
])
def test_the_users_choice_is_left_as_it_is(env, state):
    got = probe(env)
    assert got == {"state": state, "from_heap": False, "kept": False}


def test_why_not_reads_the_environment():
    assert _heap.why_not({}) is None
    assert _heap.why_not({"DPCUDA_TUNE_MALLOC": "1"}) is None
    assert _heap.why_not({"DPCUDA_TUNE_MALLOC": " 0 "}) == "DPCUDA_TUNE_MALLOC=0"
    for name in _heap._USER_SETTINGS:
        assert _heap.why_not({name: "0"}) == f"{name} is set"
    assert _heap.why_not({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}) is None
    assert _heap.why_not({"GLIBC_TUNABLES": "glibc.pthread.rseq=0:glibc.malloc.tcache_count=0"}) \
        == "GLIBC_TUNABLES sets glibc.malloc"
    assert _heap.tune({"DPCUDA_TUNE_MALLOC": "0"}) == "DPCUDA_TUNE_MALLOC=0"
