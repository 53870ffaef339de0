"""The sanitizer workload of the fused RMSNorm + quantization and of the KV-cache write and read
(families "rms_norm" and "kv_cache"), for scripts/sanitize_cases.py: small, odd and misaligned
shapes, every scheme and layout, each output checked against cupyquant.reference."""

from __future__ import annotations

import cupy
import ml_dtypes
import numpy as np

import cupyquant as cq
from cupyquant import reference as ref

BF16 = np.dtype(ml_dtypes.bfloat16)
IN_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), BF16)
NORM_SHAPES = [(1, 64), (3, 100), (5, 256), (130, 512), (2, 3, 2048)]
NORM_SCHEMES = [
    ("token", "float8_e4m3fn", {}),
    ("token", "int8", {"scale_layout": "col"}),
    ("group", "float8_e4m3fn", {"group_size": 64, "scale_layout": "col", "scale_dtype": "float8_e8m0fnu"}),
    ("tensor", "float8_e5m2", {"scale": 0.02}),
    ("mx", "float4_e2m1fn", {"scale_layout": "swizzled"}),
    ("nvfp4", None, {"global_scale": 100.0}),
]


def _allowed(scheme, kw, H):
    if scheme == "group" and H % kw["group_size"]:
        return False
    return not (scheme == "mx" and H % 32 or scheme == "nvfp4" and H % 16)


def _expected(scheme, fmt, kw, y):
    """The reference quantization of y, scales in the op's buffer layout."""
    kw = dict(kw)
    layout = kw.pop("scale_layout", None)
    if scheme in ("token", "group"):
        eq, es = ref.quantize_groupwise(y, fmt, group_size=kw.pop("group_size", None), **kw)
        return eq, ref.scale_buffer(es, y.shape, layout or "row")
    if scheme == "tensor":
        return ref.quantize_fp8(y, fmt, scale=kw["scale"])
    if scheme == "mx":
        eq, es = ref.quantize_mx(y, fmt)
    else:
        eq, es, _ = ref.quantize_nvfp4(y, global_scale=kw["global_scale"])
    swizzled = layout == "swizzled" or (layout is None and scheme == "nvfp4")  # the quantizers' defaults
    return eq, ref.swizzle_scales(es) if swizzled else es


def run_norm(run, h):
    """``h``: scripts/sanitize_cases.py (its data makers and checks)."""
    i = 0
    for shape in NORM_SHAPES:
        H = shape[-1]
        for scheme, fmt, kw in NORM_SCHEMES:
            if not _allowed(scheme, kw, H):
                continue
            i += 1
            dt = IN_DTYPES[i % 3]
            xh = h.host_data(shape, dt, h.seed_of("norm", shape, scheme), specials=True)
            wh = h.host_data((H,), dt, h.seed_of("norm w", shape, scheme))
            rh = h.host_data(shape, dt, h.seed_of("norm r", shape, scheme)) if i % 2 else None
            with np.errstate(all="ignore"):
                y, z = ref.rms_norm(xh, wh, residual=rh)
            eq, es = _expected(scheme, fmt, kw, y)
            views = [("", cupy.asarray(xh))] + ([("offset ", h.offset_copy(xh))] if shape == (5, 256) else [])
            for vname, x in views:
                r = None if rh is None else cupy.asarray(rh)
                q, yd = run.op(
                    cq.rms_norm_quantize(
                        x, cupy.asarray(wh), residual=r, scheme=scheme, dtype=fmt, return_normalized=True,
                        out=h.poison(eq.shape, eq.dtype), **kw,
                    )
                )  # fmt: skip
                tag = f"norm {vname}{shape} {scheme} {fmt} {dt.name}"
                run.same(f"{tag} q", q.data, eq)
                if scheme in ("token", "group"):
                    ng = 1 if scheme == "token" else H // kw["group_size"]
                    packed = kw.get("scale_dtype") == "float8_e8m0fnu"
                    words = h._raw_scales(q, shape, ng, packed, kw.get("scale_layout", "row"))
                else:
                    words = q.scale
                run.same(f"{tag} scales", words, es)
                run.same(f"{tag} y", yd, y)
                if r is not None:
                    run.same(f"{tag} residual", r, z)


def run_kv_cache(run, h):
    """``h``: scripts/sanitize_cases.py (its data makers and checks)."""
    i = 0
    for tokens, heads, head_dim in [(1, 1, 8), (5, 2, 72), (9, 3, 100), (33, 4, 128)]:
        for kv_layout in ("NHD", "HND"):
            for mode in ("static", "per_head", "dynamic"):
                i += 1
                dt = IN_DTYPES[i % 3]
                fmt = ("float8_e4m3fn", "float8_e5m2")[i % 2]
                blocks, bs = 3, 16
                kh = h.host_data(
                    (tokens, heads, head_dim), dt, h.seed_of("kv k", tokens, kv_layout, mode), specials=True
                )
                vh = h.host_data((tokens, heads, head_dim), dt, h.seed_of("kv v", tokens, kv_layout, mode))
                slots = np.random.default_rng(i).permutation(blocks * bs)[:tokens].astype(np.int64)
                slots[::3] = -1
                if tokens > 1:
                    slots[1] = blocks * bs + 5  # past the cache: skipped
                shape = (blocks, bs, heads, head_dim) if kv_layout == "NHD" else (blocks, heads, bs, head_dim)
                kc, vc = h.poison(shape, np.uint8), h.poison(shape, np.uint8)
                kc_h, vc_h = kc.get(), vc.get()
                ks = vs = ks_h = vs_h = None
                if mode == "dynamic":
                    sk = sv = "dynamic"
                    ks, vs = h.poison(shape[:3], np.float32), h.poison(shape[:3], np.float32)
                    ks_h, vs_h = ks.get(), vs.get()
                elif mode == "per_head":
                    sk, sv = np.linspace(0.01, 0.05, heads).astype(np.float32), 0.03
                else:
                    sk, sv = 0.02, 0.04
                k = h.offset_copy(kh) if i % 4 == 0 else cupy.asarray(kh)
                run.op(
                    cq.quantize_kv_cache(
                        k, cupy.asarray(vh), kc, vc, cupy.asarray(slots), scale_k=cupy.asarray(sk) if mode == "per_head" else sk,
                        scale_v=sv, dtype=fmt, kv_layout=kv_layout, key_scale_cache=ks, value_scale_cache=vs,
                    )
                )  # fmt: skip
                ekc, evc, eks, evs = ref.quantize_kv_cache(
                    kh, vh, kc_h, vc_h, slots, scale_k=sk, scale_v=sv, dtype=fmt, kv_layout=kv_layout,
                    key_scale_cache=ks_h, value_scale_cache=vs_h,
                )  # fmt: skip
                tag = f"kv ({tokens}, {heads}, {head_dim}) {kv_layout} {mode} {fmt} {dt.name}"
                run.same(f"{tag} key cache", kc, ekc)
                run.same(f"{tag} value cache", vc, evc)
                if ks is not None:
                    run.same(f"{tag} key scales", ks, eks)
                ids = np.array([2, 0, 7], np.int64)  # 7: past the cache, a block of NaNs
                y = run.op(
                    cq.dequantize_kv_cache(
                        vc, cupy.asarray(ids), scale=sv if mode != "dynamic" else "dynamic", kv_layout=kv_layout,
                        cache_dtype=fmt, scale_cache=vs, out_dtype=BF16,
                    )
                )  # fmt: skip
                ey = ref.dequantize_kv_cache(
                    evc, ids, scale=sv if mode != "dynamic" else "dynamic", kv_layout=kv_layout, cache_dtype=fmt,
                    scale_cache=evs, out_dtype=BF16,
                )  # fmt: skip
                run.same(f"{tag} dequantized", y, ey)
