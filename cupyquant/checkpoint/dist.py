"""Writing the shards of a run as Dask tasks, one task per output shard (:func:`engine.write_shard`,
the function a one-GPU run calls, so the bytes are the same): on a ``dask_cuda.LocalCUDACluster``
started here with one worker per GPU, on a cluster the caller names by its scheduler address or
passes as a ``distributed.Client``, or on one of Dask's local schedulers (``"threads"``,
``"processes"``, ``"synchronous"``). Each task writes its shard under a temporary name and renames it
when complete, so a retried task never leaves a partial shard. Dask, distributed and dask-cuda are
the ``dist`` extra, imported only here."""

from __future__ import annotations

from .engine import write_shard

LOCAL_SCHEDULERS = ("threads", "processes", "synchronous")
EXTRA = 'the "dist" extra: pip install "cupyquant[dist]" (dask[array], dask-cuda)'
#: Times Dask reruns a failed shard task before the run fails.
RETRIES = 2


def _import(name: str):
    try:
        return __import__(name, fromlist=["_"])
    except ImportError as e:
        raise ImportError(f"scheduler= needs {name}, which is not installed ({e}); install {EXTRA}") from e


def check_scheduler(scheduler) -> None:
    """TypeError or ValueError for a ``scheduler`` that names nothing this module runs on."""
    if scheduler is None or scheduler == "cuda" or scheduler in LOCAL_SCHEDULERS:
        return
    if isinstance(scheduler, str):
        if "://" not in scheduler:
            raise ValueError(
                f"scheduler must be None, 'cuda' (a LocalCUDACluster), one of {LOCAL_SCHEDULERS}, a scheduler address "
                f"such as 'tcp://host:8786' or a distributed.Client, got {scheduler!r}"
            )
        return
    if type(scheduler).__name__ != "Client":
        raise TypeError(f"scheduler must be None, a str or a distributed.Client, got {type(scheduler).__name__}")


def run(plan, scheduler, device, input_global_scale: float, bar) -> list:
    """The report rows of every shard, in shard order, the shards written by Dask tasks."""
    dask = _import("dask")
    tasks = [
        dask.delayed(write_shard, pure=False)(s, plan.dst, plan.scheme.name, device, input_global_scale)
        for s in plan.shards
    ]
    if scheduler in LOCAL_SCHEDULERS:
        results = dask.compute(*tasks, scheduler=scheduler)
        bar.update(plan.in_bytes)
        return list(results)
    distributed = _import("distributed")
    cluster = client = None
    try:
        if scheduler == "cuda":
            dask_cuda = _import("dask_cuda")
            cluster = dask_cuda.LocalCUDACluster()
            client = distributed.Client(cluster)
        elif isinstance(scheduler, str):
            client = distributed.Client(scheduler)
        else:
            client = scheduler
        futures = client.compute(tasks, retries=RETRIES)
        shard_bytes = {f.key: sum(t.nbytes for u in s.units for t in u.tensors) for f, s in zip(futures, plan.shards)}
        for f in distributed.as_completed(futures):
            bar.update(shard_bytes[f.key])
        return [f.result() for f in futures]
    finally:
        if client is not None and client is not scheduler:
            client.close()
        if cluster is not None:
            cluster.close()
