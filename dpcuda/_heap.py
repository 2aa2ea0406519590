"""glibc's malloc set where its own heuristic ends, once, when dpcuda is imported.

glibc serves a block below its mmap threshold from its heap and maps a larger one afresh; when
a free leaves more than its trim threshold free at the top of the heap, it hands that memory
back to the system. Both thresholds start low (128 KiB) and rise as the process frees mapped
blocks: to the largest such block's size, and twice that, up to 32 MiB and 64 MiB on a 64-bit
system (mallopt(3), "M_MMAP_THRESHOLD"). Until a process has freed a block that large, a
training step whose tensors of a few MiB are freed one after another at the top of the heap
gives them back to the system in every step and faults every page in again in the next: on the
2-core AMD CPU (issue #27) a bfloat16 128x4096 silu layer with a bias faulted 736 pages a step,
as much time as its GEMMs, and whether a step does so follows from where earlier blocks happen
to lie, torch's steps as well as dpcuda's. Setting the two thresholds to those limits at import
is the state glibc reaches by itself in any process that has once freed a 32 MiB block (a large
batch, a dataset's tensor): the heap keeps up to 64 MiB of free memory at its top instead of
returning it, and blocks up to 32 MiB come from it.

Left as it is where the user has chosen: DPCUDA_TUNE_MALLOC=0, any of glibc's MALLOC_ threshold
variables or a glibc.malloc tunable in the environment, or a C library that is not glibc.
"""

import ctypes
import os

# (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's DEFAULT_MMAP_THRESHOLD_MAX on a 64-bit system (4 MiB * sizeof(long)), and the trim
# threshold its heuristic sets with it (twice the mmap threshold).
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20

# What the user's environment may set that this leaves alone (glibc reads them at start-up).
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                  "MALLOC_MMAP_MAX_")


def why_not(environ=os.environ):
    """Why glibc's malloc is to be left as it is, or None where dpcuda sets its thresholds."""
    if environ.get("DPCUDA_TUNE_MALLOC", "1").strip() == "0":
        return "DPCUDA_TUNE_MALLOC=0"
    chosen = [k for k in _USER_SETTINGS if k in environ]
    if chosen:
        return f"{chosen[0]} is set"
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc"
    return None


def tune(environ=os.environ):
    """Sets glibc's mmap and trim thresholds to MMAP_THRESHOLD and TRIM_THRESHOLD, unless
    why_not(environ) says otherwise. Returns what was done: "set", or why not."""
    reason = why_not(environ)
    if reason is not None:
        return reason
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # (glibc's own: absent from musl and other C libraries)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "not glibc"
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # (mmap first: setting either one stops glibc's adjustment of both)
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and
            mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "mallopt refused"
    return "set"


# What tune() did at import (benchmarks record it with their results).
STATE = tune()
