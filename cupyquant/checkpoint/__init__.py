"""Quantize a Hugging Face checkpoint into a compressed-tensors checkpoint that vLLM and SGLang load,
straight from its safetensors files, with a round-trip report; and load such a checkpoint back as
:class:`cupyquant.QuantizedWeight` objects.

``quantize_checkpoint(src, dst, scheme)`` reads the folder ``src`` (``config.json``,
``model.safetensors`` or ``model.safetensors.index.json`` and its shards) memory-mapped, quantizes
the targeted weights on the GPU with cupyquant's quantizers (or, without a GPU, with the NumPy
reference: the same bytes, slowly), writes ``dst`` (the shards, a new index, ``config.json`` with a
``quantization_config``, every other file of ``src`` copied) and the report. ``load(dst)`` gives
the weights back. The command line is ``python -m cupyquant.checkpoint SRC DST --scheme ...``;
docs/checkpoint.md has the formats, the conventions and the Dask setup.

Modules: ``schemes`` (the schemes and compressed-tensors' tensors and config), ``files``
(safetensors reading and streaming writes), ``plan`` (every check, the shards), ``engine`` (one
shard: read, quantize, write; GPU and reference backends), ``dist`` (shards as Dask tasks),
``report``, ``load``."""

from __future__ import annotations

import json
import shutil
import time

from . import dist, engine, report
from .files import CheckpointError
from .load import load, read
from .plan import DEFAULT_IGNORE, DEFAULT_MAX_SHARD, DEFAULT_TARGETS, INDEX, make_plan
from .schemes import SCHEMES, quantization_config, scheme_named

__all__ = ["SCHEMES", "CheckpointError", "load", "quantize_checkpoint", "read"]


def quantize_checkpoint(
    src,
    dst,
    scheme: str,
    *,
    targets=None,
    ignore=None,
    max_shard_size=DEFAULT_MAX_SHARD,
    device=None,
    scheduler=None,
    input_global_scale: float = 1.0,
    overwrite: bool = False,
    progress: bool = True,
    plot: bool = False,
    verbose: bool = True,
) -> dict:
    """Quantize the linear weights of the model folder ``src`` into a compressed-tensors checkpoint
    in ``dst``.

    Parameters
    ----------
    src, dst : str or pathlib.Path
        The source model folder, and the folder to write (created; if it exists it must be empty,
        unless ``overwrite``).
    scheme : str
        One of :data:`SCHEMES`: ``"fp8"`` (FP8 per channel, dynamic per-token FP8 activations),
        ``"fp8-block"`` (FP8 in 128 x 128 blocks, dynamic 1 x 128 activations), ``"w8a8-int8"``
        (INT8 per channel, dynamic per-token INT8 activations), ``"w4a16"`` (INT4 groups of 128,
        symmetric), ``"w4a16-asym"`` (uint4 groups of 128 with zero points), ``"nvfp4"`` (W4A4:
        NVFP4 weights and activations), ``"nvfp4a16"`` (NVFP4 weights only), ``"mxfp4"`` (MXFP4
        weights only).
    targets : sequence of str, optional
        What to quantize, compressed-tensors' patterns: ``"Linear"`` (the default) takes every
        2-D ``*.weight`` tensor; ``"re:<regex>"`` a module name (the tensor name without
        ``.weight``) it matches from the start; any other string that module name exactly.
    ignore : sequence of str, optional
        Modules left as they are, the same patterns; default :data:`plan.DEFAULT_IGNORE`
        (``lm_head``, embeddings, norms, MoE routers).
    max_shard_size : int or str
        The largest output shard, in bytes or as ``"5GB"`` (the default, transformers' own); a
        single weight larger than that gets a shard of its own.
    device : None, "cpu" or int
        None: GPU 0 if CuPy finds one, else the NumPy reference (with a ``RuntimeWarning``);
        ``"cpu"``: the reference; an int: that GPU.
    scheduler : None, str or distributed.Client
        None: the shards one after another in this process. ``"cuda"``: Dask tasks, one per
        shard, on a ``dask_cuda.LocalCUDACluster`` (one worker per GPU) started for the run; a
        scheduler address (``"tcp://host:8786"``) or a ``distributed.Client``: on that cluster;
        ``"threads"``, ``"processes"``, ``"synchronous"``: Dask's local schedulers. Every way
        writes the same bytes. Needs the ``dist`` extra.
    input_global_scale : float
        ``"nvfp4"`` (W4A4) only: the activations' encode scale written as every layer's
        ``input_global_scale`` (``2688 / activation amax``; 1.0 covers activations up to 2688
        without calibration data).
    overwrite, progress, plot, verbose : bool
        Write into a non-empty ``dst``; show a progress bar (tqdm) over the bytes read; draw
        ``cupyquant_report.png`` (matplotlib); print the report's table.

    Returns
    -------
    dict
        The report: ``summary`` (the run's totals), ``layer_types``, ``tensors`` (one row per
        quantized tensor), as written to ``cupyquant_report.json``.

    Raises
    ------
    TypeError, ValueError
        Before anything is written under ``dst``: an argument of the wrong type or value; a
        missing or malformed file in ``src`` (:class:`CheckpointError`, a ValueError, naming it);
        a targeted tensor that is not a 2-D float weight or whose shape the scheme cannot take
        (naming the tensor); a ``dst`` that is ``src``, a file, or not empty.
    ImportError
        ``scheduler`` given without Dask installed, ``plot`` without matplotlib.
    """
    sch = scheme_named(scheme)
    dist.check_scheduler(scheduler)
    if sch.input_activations is None or sch.fmt != "nvfp4":
        pass
    elif not (isinstance(input_global_scale, (int, float)) and 0 < input_global_scale < float("inf")):
        raise ValueError(f"input_global_scale must be a positive finite number, got {input_global_scale!r}")
    plan = make_plan(src, dst, sch, targets=targets, ignore=ignore, max_shard_size=max_shard_size, overwrite=overwrite)
    if scheduler is None:
        backend = engine.backend_for(device)
        work = backend
        backend_name = backend.name
    else:
        engine.gpu_device(device)  # checks the argument here; the workers pick their own GPU
        work = device
        backend_name = "reference" if device == "cpu" else "dask workers"
    plan.dst.mkdir(parents=True, exist_ok=True)
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    with tqdm(
        total=plan.in_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=sch.name, disable=not progress
    ) as bar:
        if scheduler is None:
            per_shard = [
                engine.write_shard(s, plan.dst, sch.name, work, input_global_scale, bar.update) for s in plan.shards
            ]
        else:
            per_shard = dist.run(plan, scheduler, work, input_global_scale, bar)
    rows = [r for rs in per_shard for r in rs]
    _write_metadata(plan)
    seconds = time.perf_counter() - t0
    out_bytes = sum(s.nbytes for s in plan.shards)
    summary = {
        "src": str(plan.src),
        "dst": str(plan.dst),
        "scheme": sch.name,
        "format": sch.ct_format,
        "backend": backend_name,
        "tensors_quantized": len(rows),
        "tensors_copied": len(plan.tensors) - len(plan.quantized),
        "shards": len(plan.shards),
        "bytes_in": plan.in_bytes,
        "bytes_out": out_bytes,
        "seconds": seconds,
        "gb_per_s": plan.in_bytes / seconds / 1e9 if seconds > 0 else 0.0,
    }
    report.write(plan.dst, rows, summary)
    if plot:
        report.plot(plan.dst, rows)
    if verbose:
        print(report.table(rows, summary))
    return {"summary": summary, "layer_types": report.summarize(rows), "tensors": rows}


def _write_metadata(plan) -> None:
    """The index (several shards), config.json with its quantization_config, and the other files."""
    if len(plan.shards) > 1:
        weight_map = {name: s.name for s in plan.shards for name, _, _ in s.layout}
        index = {"metadata": {"total_size": sum(s.nbytes for s in plan.shards)}, "weight_map": weight_map}
        (plan.dst / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    config = dict(plan.config)
    config["quantization_config"] = quantization_config(plan.scheme, plan.targets, plan.ignored)
    (plan.dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for p in plan.extra_files:
        if p.is_dir():
            shutil.copytree(p, plan.dst / p.name, dirs_exist_ok=True)
        else:
            shutil.copy2(p, plan.dst / p.name)


# documented defaults, for the command line's help
DEFAULTS = {"targets": DEFAULT_TARGETS, "ignore": DEFAULT_IGNORE, "max_shard_size": "5GB"}
