"""torch.distributed for dpcuda's reducer "dist": the process group's start from torchrun's
environment with bounded waits (init_process_group), a heartbeat that names the ranks that
stopped or died when a collective fails (Heartbeat), the check that an error is a lost peer
(is_dist_failure) and the group's orderly end (shutdown). The command line uses them; a library
user of DataParallel(reducer="dist") gets the same bounded waits from them.
"""

import os
import threading
import time

import torch

from ._text import first_line

__all__ = ["init_process_group", "JoinError", "Heartbeat", "is_dist_failure", "shutdown",
           "attempt_namespace", "shared_store_warning", "wait_for_store", "first_line"]


def init_process_group(devices, timeout):
    """torch.distributed's process group for `devices` (NCCL for CUDA devices, else gloo), from
    torchrun's environment, with every wait bounded by `timeout` seconds: a rendezvous store
    that never comes up or a peer that never joins is a JoinError with one line, not a hang
    or a C++ stack. Under torchrun with one agent, each restart attempt gets keys of its own in
    the agent's store (attempt_namespace). Returns (rank, world size); a group already
    initialised is used as it is."""
    import datetime
    import torch.distributed as dist
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError("reducer 'dist' (--reducer dist) needs torch.distributed's "
                         "environment (RANK, WORLD_SIZE): start with torchrun (e.g. torchrun "
                         "--nproc-per-node 2 -m dpcuda train --reducer dist)")
    backend = "nccl" if torch.device(devices[0]).type == "cuda" else "gloo"
    if not dist.is_initialized():
        wait = datetime.timedelta(seconds=timeout)
        namespace = attempt_namespace()
        client = namespace is not None or int(os.environ["RANK"]) != 0 or \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        if client:
            wait_for_store(timeout)
        try:
            if namespace is None:
                dist.init_process_group(backend, timeout=wait)
            else:
                store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                      is_master=False, timeout=wait)
                dist.init_process_group(backend, store=dist.PrefixStore(namespace, store),
                                        rank=int(os.environ["RANK"]),
                                        world_size=int(os.environ["WORLD_SIZE"]), timeout=wait)
        except RuntimeError as err:  # the store or a peer unreachable, a connection that failed
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            raise JoinError(f"cannot start the process group (store {where}, --timeout "
                            f"{timeout:g} s): {first_line(err)}") from None
    return dist.get_rank(), dist.get_world_size()


class JoinError(Exception):
    """The process group could not be started."""


def wait_for_store(timeout):
    """Until the rendezvous store at MASTER_ADDR:MASTER_PORT accepts a connection, at most
    `timeout` seconds: a store that never comes up is then one line (JoinError), where c10d's
    own client would log its C++ stack first. Where the address is missing or bad, torch's
    set-up says so."""
    import socket
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not addr or not port.isdigit() or not 0 < int(port) < 65536:
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((addr, int(port)), timeout=min(timeout, 5.0)):
                return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise JoinError(f"cannot start the process group: no rendezvous store at "
                                f"{addr}:{port} within --timeout {timeout:g} s "
                                f"({err.strerror or err})") from None
        time.sleep(0.2)


def attempt_namespace():
    """The store prefix of this torchrun attempt, or None for torch's own set-up.

    torchrun (torch >= 2.5, c10d rendezvous) lends its agent's TCPStore to the workers and
    keeps that store across --max-restarts, keys and all: a restarted group's process group
    then finds the keys its dead predecessor wrote (gloo's peer addresses, NCCL's id) and may
    connect to a process that is gone ("connection refused", "connect timeout"; seen here
    under load; pytorch/pytorch#135712). With one agent (one node) its restart count names
    the attempt exactly, so each attempt's process group gets keys of its own. Across nodes
    the agents' counts can disagree (pytorch/pytorch#108158), so there torch's set-up stays
    and main() warns (with --rdzv-backend c10d, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives
    every attempt a new store; torchrun's static rendezvous always shares its store)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        return None
    port = os.environ.get("MASTER_PORT", "")
    if not os.environ.get("MASTER_ADDR") or not port.isdigit() or not 0 < int(port) < 65536:
        return None  # torch's own set-up then says what is missing
    run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    return f"dpcuda/{run}/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def shared_store_warning():
    """One line for a multi-node torchrun with restarts and the agent's store shared."""
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and os.environ.get("GROUP_WORLD_SIZE", "1") != "1"
            and os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") not in ("", "0")):
        return ("warning: torchrun --max-restarts across nodes keeps its store across restarts "
                "and a restarted group can read the failed group's keys (pytorch/pytorch#135712)"
                "; start torchrun with --rdzv-backend c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
                "=1 (the static rendezvous always keeps its store)")
    return None


class Heartbeat:
    """The health check of a --reducer dist run: every process bumps a counter in the
    rendezvous store (torchrun's, at MASTER_ADDR:MASTER_PORT) every second from a thread of its
    own. When a collective fails or times out, the counters that stopped moving name the ranks
    that stopped (SIGSTOP, a hung machine) or died. Clock-free: it compares counts, not times."""

    INTERVAL = 1.0

    def __init__(self, store, rank, world, prefix):
        self.store, self.rank, self.world, self.prefix = store, rank, world, prefix
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="dpcuda-heartbeat",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, rank, world, timeout):
        """A heartbeat, or None where there is no store to beat in (no MASTER_ADDR/PORT)."""
        import datetime
        import torch.distributed as dist
        try:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  is_master=False,
                                  timeout=datetime.timedelta(seconds=min(timeout, 30.0)))
        except Exception:  # no store reachable: the run goes on without naming lost ranks
            return None
        # each attempt's processes count from 1 again, so a counter a dead predecessor left
        # behind is told from a live one by its not moving; the attempt (where known) only
        # keeps the keys apart
        namespace = attempt_namespace() or \
            f"dpcuda/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/"
        return cls(store, rank, world, f"{namespace}heartbeat/")

    def _beat(self):
        count = 0
        while not self._done.is_set():
            count += 1
            try:
                self.store.set(f"{self.prefix}{self.rank}", str(count))
            except Exception:
                return
            self._done.wait(self.INTERVAL)

    def _counts(self):
        counts = {}
        for r in range(self.world):
            key = f"{self.prefix}{r}"
            counts[r] = int(self.store.get(key)) if self.store.check([key]) else 0
        return counts

    def silent_ranks(self, wait=3.5):
        """The other ranks whose counter did not move for `wait` seconds ([] if unknown)."""
        try:
            before = self._counts()
            time.sleep(wait)
            after = self._counts()
        except Exception:
            return []
        return [r for r in range(self.world) if r != self.rank and after[r] == before[r]]

    def stop(self):
        """Stops the beats and joins the thread (at most 5 s)."""
        self._done.set()
        self._thread.join(timeout=5.0)
        self.store = None




def is_dist_failure(err):
    """Whether err is torch.distributed reporting a lost or silent peer (gloo/NCCL)."""
    import torch.distributed as dist
    kinds = tuple(k for k in (getattr(dist, "DistError", None),
                              getattr(dist, "DistBackendError", None),
                              getattr(dist, "DistNetworkError", None)) if k is not None)
    if kinds and isinstance(err, kinds):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(
        s in text for s in ("gloo", "nccl", "connection", "timed out", "timeout", "peer"))


def shutdown(heartbeat=None, finished=True):
    """The end of a process group's run: the heartbeat stopped, then (after a run that finished)
    the processes meet once more, bounded by the group's timeout, and the group is destroyed
    once nothing holds its C++ objects. Every thread is joined before the interpreter exits: a
    C++ thread still joinable at exit (gloo's, the store's) aborts the process ("terminate
    called without an active exception", SIGABRT), as 3 of 20 back-to-back torchrun runs did
    before this; without the last meeting, a rank tore the group down while another still
    talked in it (once in CI, 2026-11-25, tests/test_cli_dist.py)."""
    import gc

    import torch.distributed as dist
    if heartbeat is not None:
        heartbeat.stop()
    if dist.is_initialized():
        if finished:
            try:
                dist.barrier()
            except Exception:
                pass
        gc.collect()
        dist.destroy_process_group()
