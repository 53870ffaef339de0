"""Quantizing the tensors of one output shard and writing it: the unit of work of a run, the same
function whether the shards are written one after another or as Dask tasks (so both give the same
bytes). Two backends with the same numbers: the GPU (cupyquant's kernels) and the NumPy reference
(:mod:`cupyquant.reference`, slow, for machines without a GPU)."""

from __future__ import annotations

import re
import time
import warnings

import numpy as np

from .. import reference as ref
from .files import ShardWriter, read_tensor
from .plan import Shard
from .schemes import SCHEMES, CheckpointScheme, decode, encode

#: What the report calls the scale of the error: the largest |dequantized - original| over the
#: tensor, divided by the tensor's largest |original|.
NO_GPU_WARNING = "no usable CUDA device: quantizing with the NumPy reference (cupyquant.reference), same bytes, slowly"


def gpu_device(device):
    """The CUDA device a run uses: ``device`` None picks device 0 when CuPy finds one (None when it
    does not: the reference is used), ``"cpu"`` the reference, an int that device."""
    if device == "cpu":
        return None
    if device is not None and (isinstance(device, bool) or not isinstance(device, int)):
        raise TypeError(f"device must be None, 'cpu' or a CUDA device number, got {device!r}")
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no CuPy, no driver or no device all mean the reference
        if device is not None:
            raise ValueError(f"device={device}: no usable CUDA device ({type(e).__name__}: {e})") from None
        return None
    if device is None:
        return 0 if n > 0 else None
    if not 0 <= device < n:
        raise ValueError(f"device={device}: this machine has {n} CUDA devices")
    return device


def layer_type(module: str) -> str:
    """The module name with its numbered parts (layer and expert indices) replaced by ``*``."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", module)


class ReferenceBackend:
    """cupyquant.reference on NumPy arrays."""

    name = "reference"

    def load(self, a: np.ndarray):
        return a

    def amax(self, w) -> np.float32:
        return np.float32(ref.amax(w))

    def quantize(self, w, scheme: CheckpointScheme, global_scale=None) -> dict:
        fmt = scheme.fmt
        if fmt == "nvfp4":
            d, s, g = ref.quantize_nvfp4(w, global_scale=global_scale)
            return {"data": d, "scale": s, "zero_point": None, "global_scale": np.array([g], np.float32)}
        if fmt == "mxfp4":
            d, s, _ = ref.quantize_weight_fp4(w, "mxfp4")
            return {"data": d, "scale": s, "zero_point": None}
        kw = {"block_size": scheme.block_size} if scheme.block_size else {"group_size": scheme.group_size}
        d, s, z = ref.quantize_weight(w, fmt, **kw)
        return {"data": d, "scale": s, "zero_point": z}

    def dequantize(self, parts: dict, scheme: CheckpointScheme) -> np.ndarray:
        fmt, d, s = scheme.fmt, parts["data"], parts["scale"]
        if fmt == "nvfp4":
            s2 = np.float32(1) / np.asarray(parts["global_scale"], np.float32).reshape(1)
            return ref.dequantize_weight(d, s, dtype="nvfp4", scale_2=s2)
        if fmt in ("mxfp4", "int8"):
            return ref.dequantize_weight(d, s, dtype=fmt)
        if scheme.block_size:
            return ref.dequantize_weight(d, s, dtype=fmt, block_size=scheme.block_size)
        return ref.dequantize_weight(d, s, parts["zero_point"], dtype=fmt)

    def stats(self, w, y) -> tuple:
        w64 = np.asarray(w, np.float64)
        err = np.asarray(y, np.float64) - w64
        return _stats(float((w64**2).sum()), float((err**2).sum()), float(np.abs(err).max()), float(np.abs(w64).max()))


class GpuBackend:
    """cupyquant's kernels on one CUDA device; parts come back to the host to be written."""

    name = "gpu"

    def __init__(self, device: int):
        import cupy

        self.cupy = cupy
        self.device = cupy.cuda.Device(device)

    def load(self, a: np.ndarray):
        with self.device:
            return self.cupy.asarray(a)

    def amax(self, w) -> np.float32:
        import cupyquant as cq

        with self.device:
            return np.float32(cq.amax(w).get().reshape(-1)[0])

    def quantize(self, w, scheme: CheckpointScheme, global_scale=None) -> dict:
        import cupyquant as cq

        with self.device:
            if scheme.fmt == "nvfp4":
                q = cq.quantize_nvfp4(w, global_scale=float(global_scale), scale_layout="dense")
                g = self.cupy.asnumpy(q.global_scale).astype(np.float32).reshape(1)
                return {"data": q.data.get(), "scale": q.scale.get(), "zero_point": None, "global_scale": g}
            kw = {"block_size": scheme.block_size} if scheme.block_size else {"group_size": scheme.group_size}
            if scheme.fmt in ("nvfp4", "mxfp4"):
                kw = {}
            wq = cq.quantize_weight(w, scheme.fmt, **kw)
            z = None if wq.zero_point is None else wq.zero_point.get()
            return {"data": wq.data.get(), "scale": wq.scale.get(), "zero_point": z}

    def dequantize(self, parts: dict, scheme: CheckpointScheme):
        from .load import weight_of

        with self.device:
            return weight_of(parts, scheme, dtype="float32").dequantize("float32")

    def stats(self, w, y) -> tuple:
        cp = self.cupy
        with self.device:
            w64 = w.astype(cp.float64)
            err = y.astype(cp.float64) - w64
            vals = cp.stack([(w64**2).sum(), (err**2).sum(), cp.abs(err).max(), cp.abs(w64).max()]).get()
        return _stats(*(float(v) for v in vals))


def _stats(signal: float, noise: float, max_err: float, amax: float) -> tuple:
    """(SNR dB, max error / amax)."""
    snr = float("inf") if noise == 0 else (10 * np.log10(signal / noise) if signal > 0 else float("-inf"))
    rel = 0.0 if max_err == 0 else (max_err / amax if amax > 0 else float("inf"))
    return float(snr), float(rel)


def backend_for(device):
    """The backend of a run: the GPU ``device`` resolves to, or the reference (warning that it is slow)."""
    d = gpu_device(device)
    if d is None:
        if device != "cpu":
            warnings.warn(NO_GPU_WARNING, RuntimeWarning, stacklevel=3)
        return ReferenceBackend()
    return GpuBackend(d)


def nvfp4_global_scale(backend, ws) -> np.float32:
    """The encode scale shared by the weights ``ws`` of one fused group: ``2688 / max(amax)``, by
    TransformerEngine's rule (:func:`cupyquant.reference.nvfp4_global_scale`)."""
    return ref.nvfp4_global_scale(max(backend.amax(w) for w in ws))


def write_shard(shard: Shard, dst, scheme_name: str, device, input_global_scale: float, progress=None) -> list:
    """Quantize and write one planned shard under ``dst`` (temporary name, renamed when complete);
    returns the report's rows of its quantized tensors. ``progress(nbytes)`` is called after each
    source tensor."""
    scheme = SCHEMES[scheme_name]
    backend = backend_for(device) if not isinstance(device, (ReferenceBackend, GpuBackend)) else device
    rows = []
    with ShardWriter(dst / shard.name, shard.layout) as out:
        for unit in shard.units:
            if not unit.quantized:
                for t in unit.tensors:
                    out.write(t.name, read_tensor(t))
                    if progress:
                        progress(t.nbytes)
                continue
            t0 = time.perf_counter()
            ws = [backend.load(read_tensor(t)) for t in unit.tensors]
            g = nvfp4_global_scale(backend, ws) if scheme.fmt == "nvfp4" else None
            shared = (time.perf_counter() - t0) / len(ws)
            for t, w in zip(unit.tensors, ws):
                t1 = time.perf_counter()
                parts = backend.quantize(w, scheme, g)
                parts["input_global_scale"] = np.float32(input_global_scale)
                module = t.name.removesuffix(".weight")
                tensors = encode(scheme, parts, t.shape)
                for suffix, a in tensors:
                    out.write(f"{module}.{suffix}", a)
                back = decode(scheme, dict(tensors))  # what a loader reads: the report measures it
                snr, rel = backend.stats(w, backend.dequantize(back, scheme))
                n_out = sum(a.nbytes for _, a in tensors)
                numel = t.shape[0] * t.shape[1]
                rows.append(
                    {
                        "tensor": t.name,
                        "layer_type": layer_type(module),
                        "scheme": scheme.name,
                        "shape": list(t.shape),
                        "dtype": t.dtype,
                        "bits_per_weight": 8 * n_out / numel,
                        "snr_db": snr,
                        "max_rel_err": rel,
                        "bytes_in": t.nbytes,
                        "bytes_out": n_out,
                        "seconds": shared + time.perf_counter() - t1,
                        "shard": shard.name,
                    }
                )
                if progress:
                    progress(t.nbytes)
    return rows
