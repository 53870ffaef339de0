"""Quantizing Dask arrays chunk by chunk, as cuML's and cuDF's Dask APIs take them: a Dask array of
CuPy chunks goes through cupyquant's kernels, one task per chunk, on whichever worker (and GPU) holds
the chunk; a Dask array of NumPy chunks through :mod:`cupyquant.reference` (the same bytes, on the
CPU). Groups and blocks run along the last axis, so each chunk must hold whole rows: an array
chunked along its last axis is rechunked first, with a ``UserWarning``.

- :func:`quantize_groupwise` (per token, per group), :func:`quantize_mx` (MXFP8, MXFP4): each
  chunk on its own; the scales are ``"row"`` / ``"dense"`` (one row of scales per row of x).
- :func:`quantize_nvfp4`: the global amax is reduced over the whole array first (one small task
  per chunk and a maximum), its encode scale ``S_enc`` given to every chunk.
- Per-tensor FP8 is left out: its dynamic path multiplies by ``s = 448 / amax`` while the static
  path (a scale given to each chunk) multiplies by ``1 / (1 / s)``, which differs from ``s`` for
  about one amax in seven, so chunk-wise codes would not equal the one-array call's.

Each returns a :class:`DaskQuantized`: Dask arrays ``data`` and ``scale`` (their chunks follow x's
along the leading axes), ``global_scale`` where the scheme has one, :meth:`DaskQuantized.dequantize`
(a Dask array) and :meth:`DaskQuantized.compute`. The bytes equal the one-array call's on the
whole array. Dask is the ``dist`` extra, imported when this module is."""

from __future__ import annotations

import warnings

import numpy as np

try:
    import dask
    import dask.array as da
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f'cupyquant.dask needs Dask ({e}): pip install "cupyquant[dist]"') from e

from . import reference as ref

__all__ = ["DaskQuantized", "quantize_groupwise", "quantize_mx", "quantize_nvfp4"]


def _on_gpu(x) -> bool:
    meta = getattr(x, "_meta", None)
    return type(meta).__module__.split(".")[0] == "cupy"


def _whole_rows(x, arg: str = "x"):
    if not isinstance(x, da.Array):
        raise TypeError(f"{arg} must be a dask.array.Array (of CuPy or NumPy chunks), got {type(x).__name__}")
    if x.ndim < 1:
        raise ValueError(f"{arg} must have at least one axis, got a 0-d array")
    if len(x.chunks[-1]) > 1:
        warnings.warn(
            f"{arg} is chunked along its last axis ({x.chunks[-1]}); rechunking to whole rows (one chunk along it), "
            "as every group and block lies along that axis",
            UserWarning,
            stacklevel=3,
        )
        x = x.rechunk({x.ndim - 1: -1})
    return x


def _grid(blocks, fn) -> list:
    """``fn(block, index)`` over a grid of blocks, as nested lists (what ``da.block`` takes)."""
    out = np.empty(blocks.shape, dtype=object)
    for idx in np.ndindex(blocks.shape):
        out[idx] = fn(blocks[idx], idx)
    return out.tolist()


class DaskQuantized:
    """A Dask array quantized chunk by chunk: ``data`` and ``scale`` (Dask arrays), ``global_scale``
    (NVFP4: the float32 encode scale, a Dask array of one element; otherwise None), ``kind`` (the
    function that made it), ``shape`` and ``dtype`` of the original."""

    def __init__(self, blocks, kind: str, x, data_last: int, scale_last: int, data_dtype, scale_dtype, gpu, options):
        self._blocks, self.kind, self.shape, self.dtype = blocks, kind, x.shape, x.dtype
        self._gpu, self._options = gpu, options
        self._x_chunks = x.chunks
        meta = x._meta

        def part(i, last, dtype):
            def one(b, idx):
                shape = tuple(x.chunks[a][idx[a]] for a in range(x.ndim - 1)) + (last,)
                arr = dask.delayed(lambda q: q[i] if isinstance(q, tuple) else (q.data, q.scale)[i])(b)
                return da.from_delayed(arr, shape=shape, dtype=dtype, meta=meta[:0].astype(dtype) if gpu else None)

            return da.block(_grid(blocks, one))

        self.data = part(0, data_last, data_dtype)
        self.scale = part(1, scale_last, scale_dtype)
        self.global_scale = None

    def dequantize(self, out_dtype=None):
        """A Dask array of the dequantized values (``out_dtype`` default: the original's), chunk by
        chunk with :func:`cupyquant.dequantize` (CuPy chunks) or the reference's dequantizer."""
        out_dtype = np.dtype(self.dtype if out_dtype is None else out_dtype)
        fn = _dequantize_gpu if self._gpu else _dequantize_ref

        def one(b, idx):
            shape = tuple(self._x_chunks[a][idx[a]] for a in range(len(self.shape)))
            y = dask.delayed(fn)(b, self.kind, self._options, out_dtype, shape)
            meta = None
            if self._gpu:
                import cupy

                meta = cupy.empty((0,) * len(shape), out_dtype)
            return da.from_delayed(y, shape=shape, dtype=out_dtype, meta=meta)

        return da.block(_grid(self._blocks, one))

    def compute(self, **kwargs) -> dict:
        """``{"data", "scale", "global_scale"}`` as arrays of the chunks' type (one ``dask.compute``)."""
        data, scale, g = dask.compute(self.data, self.scale, self.global_scale, **kwargs)
        return {"data": data, "scale": scale, "global_scale": g}


def _dequantize_gpu(q, kind, options, out_dtype, shape):
    import cupyquant as cq

    return cq.dequantize(q, out_dtype)


def _dequantize_ref(q, kind, options, out_dtype, shape):
    data, scale = q[0], q[1]
    if kind == "groupwise":
        return ref.dequantize_groupwise(data, scale, options["dtype"], out_dtype, group_size=options["group_size"])
    if kind == "mx":
        return ref.dequantize_mx(data, scale, options["dtype"], out_dtype, K=shape[-1])
    return ref.dequantize_nvfp4(data, scale, q[2], out_dtype, K=shape[-1])


def _make(x, kind, gpu_fn, ref_fn, options, scalar=None):
    """One delayed quantization per chunk (``gpu_fn`` on CuPy chunks, ``ref_fn`` on NumPy ones);
    ``scalar`` ``(name, Dask value)``: an option computed once by a global reduction."""
    gpu = _on_gpu(x)
    blocks = x.to_delayed()
    fn = gpu_fn if gpu else ref_fn
    extra = {} if scalar is None else {scalar[0]: scalar[1]}
    qblocks = np.empty(blocks.shape, dtype=object)
    for idx in np.ndindex(blocks.shape):
        qblocks[idx] = dask.delayed(fn)(blocks[idx], **options, **extra)
    # the last dimension and dtypes of data and scale, from the reference on one row of zeros
    probe = ref_fn(np.zeros((1, x.shape[-1]), np.float32), **options, **({} if scalar is None else {scalar[0]: 1.0}))
    d, sc = probe[0], np.asarray(probe[1])
    return DaskQuantized(qblocks, kind, x, d.shape[-1], sc.shape[-1], d.dtype, sc.dtype, gpu, dict(options))


def _gw_gpu(b, dtype, group_size):
    import cupyquant as cq

    return cq.quantize_groupwise(b, dtype, group_size=group_size, scale_layout="row")


def _gw_ref(b, dtype, group_size):
    return ref.quantize_groupwise(b, dtype, group_size=group_size)[:2]


def quantize_groupwise(x, dtype="float8_e4m3fn", *, group_size=128) -> DaskQuantized:
    """Per-group (``group_size`` 32 .. 256) or per-token (None) FP8 / INT8 of each chunk
    (:func:`cupyquant.quantize_groupwise`, ``"row"`` scales)."""
    x = _whole_rows(x)
    return _make(x, "groupwise", _gw_gpu, _gw_ref, {"dtype": dtype, "group_size": group_size})


def _mx_gpu(b, dtype):
    import cupyquant as cq

    return cq.quantize_mx(b, dtype, scale_layout="dense")


def _mx_ref(b, dtype):
    return ref.quantize_mx(b, dtype)


def quantize_mx(x, dtype="float8_e4m3fn") -> DaskQuantized:
    """MXFP8 (``"float8_e4m3fn"``, ``"float8_e5m2"``) or MXFP4 (``"float4_e2m1fn"``) of each chunk
    (:func:`cupyquant.quantize_mx`, dense scales, rounding ``"ceil"``)."""
    x = _whole_rows(x)
    return _make(x, "mx", _mx_gpu, _mx_ref, {"dtype": dtype})


def _global_amax(x):
    """A Dask scalar: max |x| over the whole array, NaN ignored, per chunk by the library's amax."""
    if _on_gpu(x):
        import cupyquant as cq

        parts = x.map_blocks(lambda b: cq.amax(b).get().reshape((1,) * b.ndim), dtype=np.float32, meta=np.empty(0))
    else:
        parts = x.map_blocks(lambda b: np.full((1,) * b.ndim, ref.amax(b), np.float32), dtype=np.float32)
    return parts.max()


def _nv_gpu(b, global_scale):
    import cupyquant as cq

    return cq.quantize_nvfp4(b, global_scale=float(global_scale), scale_layout="dense")


def _nv_ref(b, global_scale):
    return ref.quantize_nvfp4(b, global_scale=global_scale)


def quantize_nvfp4(x) -> DaskQuantized:
    """NVFP4 of each chunk with the global scale of the whole array: ``S_enc = 2688 / amax(x)``
    (:func:`cupyquant.reference.nvfp4_global_scale`), reduced first; dense scales."""
    x = _whole_rows(x)
    g = dask.delayed(ref.nvfp4_global_scale)(_global_amax(x))
    q = _make(x, "nvfp4", _nv_gpu, _nv_ref, {}, scalar=("global_scale", g))
    q.global_scale = da.from_delayed(dask.delayed(lambda v: np.array([v], np.float32))(g), (1,), np.float32)
    return q
