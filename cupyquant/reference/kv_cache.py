"""FP8 paged KV-cache writes (vLLM ``reshape_and_cache_flash`` with an FP8 cache) and their
dequantizing read."""

from __future__ import annotations

import numpy as np

from .. import _checks, _dtypes
from ._common import _as_f32, cast_fp8, fp8_to_float, round_to

#: The values of ``kv_layout``: "NHD" is [blocks, block_size, heads, head_dim], "HND" [blocks, heads,
#: block_size, head_dim].
KV_LAYOUTS = _checks.KV_LAYOUTS


def _rows(x, arg: str) -> np.ndarray:
    """key or value as float32 ``[tokens, heads, head_dim]`` (exact for every input dtype)."""
    x = np.asarray(x)
    _dtypes.input_type(x.dtype, arg)
    if x.ndim != 3:
        raise ValueError(f"{arg} must have 3 dimensions [tokens, heads, head_dim], got shape {x.shape}")
    return x.astype(np.float32)


def _cache(c, arg: str) -> np.ndarray:
    c = np.asarray(c)
    if c.dtype != np.uint8:
        raise TypeError(f"{arg} must have dtype uint8 (FP8 bit patterns), got {c.dtype}")
    if c.ndim != 4:
        raise ValueError(f"{arg} must have 4 dimensions, got shape {c.shape}")
    return c


def _index_array(a, arg: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype not in (np.int32, np.int64):
        raise TypeError(f"{arg} must have dtype int32 or int64, got {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"{arg} must be 1-D, got shape {a.shape}")
    return a.astype(np.int64)


def _static_scale(v, arg: str, heads: int) -> np.ndarray:
    """A static decode scale as float32 of shape (heads,): a positive finite real, or a float32 array
    of shape (1,) or (heads,) (NumPy here, where the op takes CuPy), read as it is."""
    if isinstance(v, np.ndarray):
        if v.dtype != np.float32:
            raise TypeError(f"{arg} must be a float32 array, got {v.dtype}")
        if v.shape not in ((1,), (heads,)):
            raise ValueError(f"{arg} must have shape (1,) or ({heads},) (one scale, or one per head), got {v.shape}")
        return np.broadcast_to(v, (heads,)).astype(np.float32)
    return np.full(heads, _checks.positive_finite_scalar(v, arg), np.float32)


def _is_dynamic(v, arg: str) -> bool:
    if isinstance(v, str):
        if v != "dynamic":
            raise ValueError(f"{arg}={v!r} is not supported; expected 'dynamic', a positive float or a float32 array")
        return True
    return False


def _in_block_view(c: np.ndarray, hnd: bool) -> np.ndarray:
    """A cache (or scale cache) seen as [blocks, block_size, heads, ...] whatever its layout."""
    return np.swapaxes(c, 1, 2) if hnd else c


def kv_dynamic_scale(rows, dtype="float8_e4m3fn") -> np.ndarray:
    """vLLM's dynamic per-token FP8 scale of each row (last axis): ``amax = max|x|`` (NaN ignored, 0
    for an all-NaN row), ``s = fmaxf(amax / qmax, 1 / (qmax * 512))`` in IEEE float32."""
    fmt = _dtypes.element_format(dtype, allowed=_dtypes.FP8_NAMES)
    xf = _as_f32(rows)
    qmax = np.float32(fmt.max)
    with np.errstate(all="ignore"):
        amax = np.fmax.reduce(np.abs(xf), axis=-1, initial=np.float32(0)).astype(np.float32)
        return np.fmax(amax / qmax, np.float32(1) / (qmax * np.float32(512))).astype(np.float32)


def quantize_kv_cache(
    key,
    value,
    key_cache,
    value_cache,
    slot_mapping,
    *,
    scale_k,
    scale_v,
    dtype="float8_e4m3fn",
    kv_layout="NHD",
    key_scale_cache=None,
    value_scale_cache=None,
):
    """The FP8 paged KV-cache write; returns updated copies ``(key_cache, value_cache,
    key_scale_cache, value_scale_cache)`` (the scale caches None unless dynamic).

    ``key``, ``value``: ``[tokens, heads, head_dim]`` float32/float16/bfloat16. Caches: uint8
    ``[blocks, block_size, heads, head_dim]`` (``kv_layout="NHD"``) or ``[blocks, heads, block_size,
    head_dim]`` ("HND"); scale caches float32, the cache's shape without head_dim. ``slot_mapping``:
    int32 or int64 of ``n <= tokens`` entries. For token ``t < n`` with ``slot = slot_mapping[t]`` in
    ``[0, blocks * block_size)`` and each head ``h``, the row ``x = key[t, h, :]`` (and likewise
    ``value``) goes to block ``slot // block_size``, offset ``slot % block_size``, head ``h``:

    - static (``scale_k`` a positive float or a float32 array of shape (1,) or (heads,), the decode
      scale ``s`` of head ``h``, ``x ~ float(q) * s``): ``q = cast_fp8(float32(x) / s)``, an IEEE
      float32 division, round to nearest even, saturating (vLLM ``scaled_fp8_conversion``); NaN
      gives 0x7f.
    - dynamic (``"dynamic"`` for both): ``s = kv_dynamic_scale(x)``, i.e.
      ``fmaxf(max|x| / qmax, 1 / (qmax * 512))`` with NaN ignored;
      ``q = cast_fp8(fminf(float32(x) / s, qmax))`` (a NaN element becomes +qmax); ``s`` is
      written to the scale cache at the same block, offset and head.

    Other slots (negative, or past the cache) write nothing; every other byte keeps its value.
    Repeated slots are written in token order here (the last one stays); the GPU op leaves which one
    lands unspecified.
    """
    fmt = _dtypes.element_format(dtype, allowed=_dtypes.FP8_NAMES)
    hnd = _checks.kv_layout_is_hnd(kv_layout)
    dyn_k, dyn_v = _is_dynamic(scale_k, "scale_k"), _is_dynamic(scale_v, "scale_v")
    if dyn_k != dyn_v:
        raise ValueError("scale_k and scale_v must both be 'dynamic' or both static")
    k, v = _rows(key, "key"), _rows(value, "value")
    if np.asarray(value).dtype != np.asarray(key).dtype:
        raise TypeError(f"value must have key's dtype {np.asarray(key).dtype}, got {np.asarray(value).dtype}")
    if v.shape != k.shape:
        raise ValueError(f"value must have key's shape {k.shape}, got {v.shape}")
    tokens, heads, head_dim = k.shape
    kc = _in_block_view(_cache(key_cache, "key_cache").copy(), hnd)
    vc = _in_block_view(_cache(value_cache, "value_cache").copy(), hnd)
    if vc.shape != kc.shape:
        raise ValueError(f"value_cache must have key_cache's shape, got {np.shape(value_cache)}")
    blocks, block_size, c_heads, c_dim = kc.shape
    if (c_heads, c_dim) != (heads, head_dim):
        raise ValueError(f"key_cache must hold {heads} heads of {head_dim} (key's), got {c_heads} of {c_dim}")
    slots = _index_array(slot_mapping, "slot_mapping")
    if slots.size > tokens:
        raise ValueError(f"slot_mapping must have at most key's {tokens} tokens, got {slots.size}")
    ksc = vsc = None
    if dyn_k:
        sshape = np.shape(key_cache)[:3]
        scs = []
        for sc, arg in ((key_scale_cache, "key_scale_cache"), (value_scale_cache, "value_scale_cache")):
            if sc is None:
                raise ValueError(f"{arg} is needed with scale_k='dynamic'")
            sc = np.asarray(sc)
            if sc.dtype != np.float32:
                raise TypeError(f"{arg} must have dtype float32, got {sc.dtype}")
            _checks.shape_of(sc, arg, sshape)
            scs.append(_in_block_view(sc.copy(), hnd))
        ksc, vsc = scs
    else:
        if key_scale_cache is not None or value_scale_cache is not None:
            raise ValueError("key_scale_cache and value_scale_cache are only for scale_k='dynamic'")
        sk = _static_scale(scale_k, "scale_k", heads)
        sv = _static_scale(scale_v, "scale_v", heads)

    t = np.flatnonzero((slots >= 0) & (slots < blocks * block_size))
    b, o = slots[t] // block_size, slots[t] % block_size
    qmax = np.float32(fmt.max)
    for x, cache, sc, s_static in ((k, kc, ksc, None if dyn_k else sk), (v, vc, vsc, None if dyn_v else sv)):
        rows = x[t]  # [written tokens, heads, head_dim]
        with np.errstate(all="ignore"):
            if s_static is None:
                s = kv_dynamic_scale(rows, fmt.name)
                q = cast_fp8(np.fmin((rows / s[..., None]).astype(np.float32), qmax), fmt.name)
                sc[b, o] = s  # in token order: a repeated slot keeps the last token
            else:
                q = cast_fp8((rows / s_static[:, None]).astype(np.float32), fmt.name)
        cache[b, o] = q
    back = (lambda c: None if c is None else _in_block_view(c, hnd).copy()) if hnd else (lambda c: c)
    return back(kc), back(vc), back(ksc), back(vsc)


def dequantize_kv_cache(
    cache, block_ids, *, scale, kv_layout="NHD", out_dtype="bfloat16", cache_dtype="float8_e4m3fn", scale_cache=None
) -> np.ndarray:
    """The dequantizing read of cache blocks: ``y[i] = round_to(fp8_to_float(cache[block_ids[i]]) * s,
    out_dtype)``, the product in IEEE float32, ``s`` the static scale of the element's head (a positive
    float, or a float32 array of shape (1,) or (heads,)) or, for ``scale="dynamic"``, the entry of
    ``scale_cache`` at the element's block, offset and head. An id outside ``[0, blocks)`` gives a
    block of NaNs. The result has the cache's layout: ``[n, block_size, heads, head_dim]`` ("NHD")
    or ``[n, heads, block_size, head_dim]`` ("HND")."""
    fmt = _dtypes.element_format(cache_dtype, "cache_dtype", allowed=_dtypes.FP8_NAMES)
    out_t = _dtypes.input_type(out_dtype, "out_dtype")
    hnd = _checks.kv_layout_is_hnd(kv_layout)
    c = _in_block_view(_cache(cache, "cache"), hnd)
    blocks, block_size, heads, head_dim = c.shape
    ids = _index_array(block_ids, "block_ids")
    ok = (ids >= 0) & (ids < blocks)
    safe = np.where(ok, ids, 0)
    if _is_dynamic(scale, "scale"):
        if scale_cache is None:
            raise ValueError("scale_cache is needed with scale='dynamic'")
        sc = np.asarray(scale_cache)
        if sc.dtype != np.float32:
            raise TypeError(f"scale_cache must have dtype float32, got {sc.dtype}")
        _checks.shape_of(sc, "scale_cache", np.shape(cache)[:3])
        s = _in_block_view(sc, hnd)[safe][..., None] if blocks else np.zeros((ids.size, block_size, heads, 1))
    else:
        if scale_cache is not None:
            raise ValueError("scale_cache is only for scale='dynamic'")
        s = _static_scale(scale, "scale", heads)[:, None]
    q = c[safe] if blocks else np.zeros((ids.size, block_size, heads, head_dim), np.uint8)
    with np.errstate(all="ignore"):
        v = (fp8_to_float(q, fmt.name) * np.asarray(s, np.float32)).astype(np.float32)
    v = np.where(ok[:, None, None, None], v, np.float32(np.nan)).astype(np.float32)
    return np.ascontiguousarray(_in_block_view(round_to(v, out_t.dtype), hnd))
