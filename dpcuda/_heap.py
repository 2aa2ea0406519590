"""glibc's malloc thresholds set at the largest values its own heuristic gives them, once, when
dpcuda is imported.

glibc serves a block below its mmap threshold from its heap and maps a larger one afresh; when
a free leaves more than its trim threshold free at the top of the heap, it hands that memory
back to the system. Both thresholds start low (128 KiB) and rise as the process frees mapped
blocks: to the size of the largest such block of up to 32 MiB, and twice that, on a 64-bit
system (mallopt(3), "M_MMAP_THRESHOLD"). Below that, a training step whose tensors of a few MiB
are freed one after another at the top of the heap gives them back to the system in every step
and faults every page in again in the next: on the 2-core AMD CPU (issue #27) a bfloat16
128x4096 silu layer with a bias faulted 736 pages a step, as much time as its GEMMs, and whether
a step does so follows from where earlier blocks happen to lie, for torch's steps as for
dpcuda's. This sets the two thresholds at those limits, 32 and 64 MiB (docs/guide.md says what
it costs in memory).

Left as it is where the user has chosen: DPCUDA_TUNE_MALLOC=0 (or false, off, no), one of glibc's
threshold variables (MALLOC_MMAP_THRESHOLD_, ...) or tunables (glibc.malloc.mmap_threshold, ...),
or another malloc in the process (preloaded), or where the C library is not glibc.
"""

import ctypes
import os
import sys
import warnings

# (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's DEFAULT_MMAP_THRESHOLD_MAX on a 64-bit system (4 MiB * sizeof(long)), and the trim
# threshold its heuristic sets with it (twice the mmap threshold).
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20

# What the user may set that this leaves alone: glibc's variables and tunables that, like
# mallopt, fix the thresholds (glibc reads them at start-up).
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                  "MALLOC_MMAP_MAX_")
_USER_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold",
                  "glibc.malloc.top_pad", "glibc.malloc.mmap_max")
_OFF = ("0", "false", "off", "no")
_ON = ("", "1", "true", "on", "yes")


def _switch(environ):
    """DPCUDA_TUNE_MALLOC as True (unset too) or False, or None where it is not understood."""
    choice = environ.get("DPCUDA_TUNE_MALLOC", "1").strip().lower()
    return True if choice in _ON else False if choice in _OFF else None


def why_not(environ=os.environ):
    """Why glibc's malloc is to be left as it is (by the environment), or None."""
    switch = _switch(environ)
    if switch is False:
        return f"DPCUDA_TUNE_MALLOC={environ['DPCUDA_TUNE_MALLOC']}"
    if switch is None:
        return (f"DPCUDA_TUNE_MALLOC={environ['DPCUDA_TUNE_MALLOC']!r} not understood "
                f"(0/false/off/no or 1/true/on/yes)")
    chosen = [k for k in _USER_SETTINGS if k in environ]
    if chosen:
        return f"{chosen[0]} is set"
    tunables = [t.split("=")[0].strip() for t in environ.get("GLIBC_TUNABLES", "").split(":")]
    chosen = [t for t in _USER_TUNABLES if t in tunables]
    if chosen:
        return f"GLIBC_TUNABLES sets {chosen[0]}"
    return None


def _glibc_malloc():
    """glibc's mallopt where the process's malloc is glibc's own, else why not."""
    if not sys.platform.startswith("linux"):
        return None, "not Linux"
    try:
        process = ctypes.CDLL(None)
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # (glibc's own: absent from musl and other C libraries)
        ours, theirs = process.malloc, libc.malloc
    except (OSError, AttributeError, TypeError):
        return None, "not glibc"
    address = [ctypes.cast(f, ctypes.c_void_p).value for f in (ours, theirs)]
    if address[0] != address[1]:
        return None, "the process's malloc is not glibc's (preloaded)"
    return libc.mallopt, None


def tune(environ=os.environ):
    """Sets glibc's mmap and trim thresholds to MMAP_THRESHOLD and TRIM_THRESHOLD, unless
    why_not(environ) says otherwise or the malloc is not glibc's. Returns what was done: "set",
    or why not."""
    reason = why_not(environ)
    if reason is not None:
        if _switch(environ) is None:
            warnings.warn(f"dpcuda: {reason}; glibc's malloc is left as it is", RuntimeWarning,
                          stacklevel=2)
        return reason
    mallopt, reason = _glibc_malloc()
    if mallopt is None:
        return reason
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # (either call stops glibc's adjustment of both thresholds)
    if not mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        return "mallopt refused the mmap threshold"
    if not mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD):
        return "mallopt refused the trim threshold (the mmap threshold is set)"
    return "set"


# What tune() did at import (benchmarks record it with their results).
STATE = tune()
