"""Data-parallel training.

    replicate, scatter, gather, parallel_apply, all_reduce    the primitives (primitives.py)
    DataParallel(module, devices, ...)                        the wrapper (data_parallel.py)

The pieces: replicas.py keeps the replicas at the model's state, reducer.py reduces the
gradients when a backward ends, step.py (with labels.py and dist_step.py) is the one-call
convenience step.
"""

from .data_parallel import BUFFERS, REDUCERS, SPLITS, DataParallel
from .primitives import (ALGORITHMS, MAX_REPLICAS, _device, _devices, _run_all, all_reduce,
                         gather, parallel_apply, replicate, scatter, split_sizes)
from .labels import LabelError
from .replicas import ReplicaError

__all__ = ["replicate", "scatter", "gather", "parallel_apply", "all_reduce", "split_sizes",
           "DataParallel", "ReplicaError", "LabelError", "REDUCERS", "SPLITS", "ALGORITHMS", "BUFFERS",
           "MAX_REPLICAS"]
