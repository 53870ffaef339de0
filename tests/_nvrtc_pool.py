"""NVRTC compiles for tests/test_jit.py in worker processes, so that a machine's cores share them.

NVRTC runs on the CPU without a GPU (through ``cupy_backends.cuda.libs.nvrtc``) and compiles one
program on one core. :class:`Pool` starts ``spawn`` workers (a fresh interpreter each: no state of
the test process is inherited but its ``sys.path`` and environment), gives them every job at once,
longest first, and hands each result to the tests that ask for it. A worker returns what the tests
check, not the PTX itself: the lowered names, the count of each string of ``needles`` in the PTX,
and the NVRTC log when asked for.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
from typing import NamedTuple


class Job(NamedTuple):
    family: str
    target: str  # "90", or "90a" for the family-specific target
    expressions: tuple
    needles: tuple = ()
    log: bool = False  # ptxas -v: registers and spills of each kernel in the log (changes no code)
    cost: float = 0.0  # expected seconds, to start the longest first


def compile_job(job: Job) -> dict:
    """Runs in a worker: :func:`cupyquant._jit.compile_for_arch` of the job's expressions."""
    from cupyquant import _jit

    ptx, log = [], ([] if job.log else None)
    lowered = _jit.compile_for_arch(job.family, job.target, job.expressions, ptx_out=ptx, log_out=log)
    return {
        "lowered": lowered,
        "counts": {n: ptx[0].count(n) for n in job.needles},
        "log": log[0] if log else None,
    }


def workers() -> int:
    """One worker a usable core, at most 8 (each holds up to about 1 GB while it compiles), or
    ``CUPYQUANT_NVRTC_WORKERS`` where set: a suite split into shards that share a machine's cores
    gives each shard its part of them."""
    given = os.environ.get("CUPYQUANT_NVRTC_WORKERS")
    if given:
        return max(1, int(given))
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        n = os.cpu_count() or 1
    return max(1, min(8, n))


class Pool:
    """Every job submitted at once, longest first; ``result(family, target)`` waits for one."""

    def __init__(self, jobs):
        jobs = sorted(jobs, key=lambda j: (-j.cost, j.family, j.target))
        self._executor = concurrent.futures.ProcessPoolExecutor(
            max_workers=min(workers(), max(1, len(jobs))), mp_context=multiprocessing.get_context("spawn")
        )
        self._futures = {(j.family, j.target): self._executor.submit(compile_job, j) for j in jobs}

    def result(self, family: str, target: str) -> dict:
        return self._futures[family, target].result()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
