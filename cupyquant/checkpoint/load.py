"""Reading a compressed-tensors checkpoint that :func:`cupyquant.checkpoint.quantize_checkpoint`
wrote (or any of the same schemes): :func:`read` gives each quantized weight's plain host parts,
:func:`load` the :class:`cupyquant.QuantizedWeight` of each, on the GPU, with the exact bytes of
the files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .files import CheckpointError
from .plan import source_tensors
from .schemes import CheckpointScheme, decode, scheme_of_config, tensor_layout

#: The dtype names config.json uses for the model's dtype (``torch_dtype``, or ``dtype``).
_CONFIG_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "half": "float16"}


def _config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no config.json") from None


def model_dtype(config: dict) -> str:
    """The dtype the weights are dequantized to by default: the config's ``torch_dtype`` (or
    ``dtype``), bfloat16 when it names none that cupyquant dequantizes to."""
    name = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").removeprefix("torch.")
    return _CONFIG_DTYPES.get(name, "bfloat16")


def read(path) -> tuple:
    """``(scheme, {weight name: parts})`` of a checkpoint folder: per quantized weight (named as in
    the source model, ``<module>.weight``), cupyquant's plain host parts ``data``, ``scale``,
    ``zero_point`` (uint4, packed along K), ``global_scale`` (NVFP4's encode scale) and ``shape``,
    NumPy arrays over the files' memory maps (their bytes as written)."""
    from .files import read_tensor

    path = Path(path)
    config = _config(path)
    scheme = scheme_of_config(config.get("quantization_config"))
    tensors = {t.name: t for t in source_tensors(path)}
    key = "weight_packed" if scheme.packed else "weight_scale"
    out = {}
    for name in tensors:
        module, _, suffix = name.rpartition(".")
        if suffix != key:
            continue
        suffixes = [s for s, _, _ in tensor_layout(scheme, (1, scheme.k_multiple), "F32")]
        found = {s: read_tensor(tensors[f"{module}.{s}"]) for s in suffixes if f"{module}.{s}" in tensors}
        try:
            out[f"{module}.weight"] = decode(scheme, found)
        except ValueError as e:
            raise CheckpointError(f"{path}: weight {module!r}: {e}") from None
    return scheme, out


def weight_of(parts: dict, scheme: CheckpointScheme, *, dtype="bfloat16"):
    """The :class:`cupyquant.QuantizedWeight` of one weight's host parts, on the current device,
    through :meth:`QuantizedWeight.from_checkpoint`: FP8 (per channel or 128 x 128 blocks), INT8,
    INT4 and uint4 (groups of ``scheme.group_size``; uint4 with its zero points, already packed
    along K by :func:`read`), NVFP4 (with ``global_scale``, the checkpoint's encode scale) and
    MXFP4."""
    import cupy

    from ..weight import QuantizedWeight

    data = cupy.asarray(np.ascontiguousarray(parts["data"]))
    scale = cupy.asarray(np.ascontiguousarray(parts["scale"]))
    fmt = scheme.fmt
    if fmt in ("int4", "uint4"):
        z = parts["zero_point"]
        z = None if z is None else cupy.asarray(np.ascontiguousarray(z))
        return QuantizedWeight.from_checkpoint(
            data, scale, format=fmt, block_size=(1, scheme.group_size), zero_point=z, dtype=dtype
        )
    if fmt == "nvfp4":
        g = cupy.asarray(np.asarray(parts["global_scale"], np.float32).reshape(1))
        return QuantizedWeight.from_checkpoint(data, scale, format="nvfp4", global_scale=g, dtype=dtype)
    if fmt == "mxfp4":
        return QuantizedWeight.from_checkpoint(data, scale, format="mxfp4", dtype=dtype)
    return QuantizedWeight.from_checkpoint(data, scale, format=fmt, block_size=scheme.block_size, dtype=dtype)


def load(path, *, dtype=None, device=None) -> dict:
    """``{weight name: QuantizedWeight}`` of every quantized weight of a checkpoint folder, on the
    GPU ``device`` (default: the current one), with the files' exact bytes; ``dtype`` is what the
    weights dequantize to by default (the config's ``torch_dtype`` when None)."""
    import cupy

    scheme, weights = read(path)
    dtype = model_dtype(_config(Path(path))) if dtype is None else dtype
    with cupy.cuda.Device(device):
        return {name: weight_of(parts, scheme, dtype=dtype) for name, parts in weights.items()}
