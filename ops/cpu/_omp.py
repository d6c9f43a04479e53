"""One OpenMP thread for torch inside each of the CPU path's worker threads.

torch runs its CPU kernels (resize, normalize) on OpenMP, and each thread that calls torch gets its
own team, sized for the whole machine. With one worker thread per core, every worker's small
per-image kernels then fork a team over all cores, and the teams compete for the cores the other
workers are decoding on. So each worker thread sets its own team to one thread, through
``omp_set_num_threads`` in torch's own OpenMP runtime: that call changes the calling thread's
setting only. Not ``torch.set_num_threads``, which changes process-wide settings (the caller's
threads included). One even with fewer workers than cores: a 224 x 224 image is too small a job to
share, and a team member waiting for a busy core stalls the others (one worker with a team of 2,
under a profiler on the other core, spent 59% of its time normalising instead of about 15%).

Measured on the 2-core benchmark machine, same run: 1.96x the DataLoader with it, 1.88x without.
Where torch has no OpenMP runtime we can find (another build, another platform), nothing is done.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading

import torch

__all__ = ["limit_openmp_threads"]

_lock = threading.Lock()
_UNSET = object()
_set_num_threads: object = _UNSET


def _omp_set_num_threads():
    global _set_num_threads
    with _lock:
        if _set_num_threads is _UNSET:
            _set_num_threads = None
            if "OpenMP" in torch.__config__.parallel_info():
                lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
                for pattern in ("libgomp*.so*", "libiomp5*.so*", "libomp*.so*", "libomp*.dylib"):
                    paths = sorted(glob.glob(os.path.join(lib_dir, pattern)))
                    if paths:
                        try:
                            _set_num_threads = ctypes.CDLL(paths[0]).omp_set_num_threads
                        except (OSError, AttributeError):
                            continue
                        break
        return _set_num_threads


def limit_openmp_threads() -> None:
    """In a worker thread: run this thread's torch kernels on one OpenMP thread (its own)."""
    fn = _omp_set_num_threads()
    if fn is None:
        return
    torch.get_num_threads()  # torch sizes each thread's team lazily, on first use: let it, then override
    fn(1)
