#!/usr/bin/env python3
"""Every kernel family on small, odd and tail-heavy shapes: the workload that scripts/sanitize.sh
runs under compute-sanitizer (memcheck, racecheck, initcheck, synccheck).

Each call's output is also checked against cupyquant.reference, byte for byte (the matmul by the
relative-error bound of tests/test_weight.py), so a run both walks the kernels' edges (empty
tensors, one element, tails after the vector units, partial blocks and tiles, padded scale layouts,
misaligned and strided views, M from 1 to 300 in the matmul) and proves the bytes.

CuPy's memory pool is switched off (``cupy.cuda.set_allocator(None)``) unless ``--pool`` is given:
every array is then one cudaMalloc of exactly its size, so memcheck knows each array's bounds (inside
a pool block an overrun lands in a neighbour and goes unseen) and initcheck sees every output start
uninitialized (a pool block reused from an earlier array would count as written).

    PYTHONPATH=. python scripts/sanitize_cases.py [--family mx,weight] [--pool]

Exit status: 0 when every check passes, 3 when any output differs from the reference, 1 on an error.
"""

from __future__ import annotations

import argparse
import sys
import zlib

import cupy
import ml_dtypes
import numpy as np
import sanitize_hot_path

import cupyquant as cq
from cupyquant import _block_scale, _device, _plans, groupwise
from cupyquant import reference as ref
from cupyquant import weight as cqw
from cupyquant.weight import decode, sm90_gemm

BF16 = np.dtype(ml_dtypes.bfloat16)
F16, F32 = np.dtype(np.float16), np.dtype(np.float32)
IN_DTYPES = (F32, F16, BF16)
FAMILIES = ("per_tensor", "groupwise", "mx", "rms_norm", "kv_cache", "weight", "fp4_weight", "w8a8")
# Selectable by --family but not in the default run: the sm90 gemm's edge cases alone (a subset of
# "weight", to run one tool on that kernel only: racecheck takes over 7 minutes on it)
EXTRA_FAMILIES = ("weight_sm90_gemm",)
FAMILY_ALIASES = {"wgmma": "weight_sm90_gemm"}  # older names still accepted
E8M0 = "float8_e8m0fnu"
TOL = {F16: 2.0**-10, BF16: 2.0**-8}  # matmul bounds, as tests/test_weight.py derives them


class Run:
    """Counts op calls and checks; keeps the first mismatches."""

    def __init__(self):
        self.calls = 0
        self.checks = 0
        self.bad = []

    def op(self, value):
        self.calls += 1
        return value

    def same(self, what, got, want):
        self.checks += 1
        g = np.ascontiguousarray(got.get() if isinstance(got, cupy.ndarray) else np.asarray(got))
        e = np.ascontiguousarray(np.asarray(want))
        if g.shape != e.shape or g.dtype.itemsize != e.dtype.itemsize:
            self.bad.append(f"{what}: got {g.dtype} {g.shape}, expected {e.dtype} {e.shape}")
            return
        if g.size == 0:
            return
        uint = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[g.dtype.itemsize]
        gb, eb = g.view(uint), e.view(uint)
        diff = gb != eb
        if diff.any():
            i = tuple(int(v) for v in np.argwhere(diff)[0])
            self.bad.append(
                f"{what}: {int(diff.sum())} of {diff.size} differ; first at {i}: "
                f"0x{int(gb[i]):x}, expected 0x{int(eb[i]):x}"
            )

    def within(self, what, err, tol):
        self.checks += 1
        if not err <= tol:
            self.bad.append(f"{what}: relative error {err:.3g} > {tol:.3g}")


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def host_data(shape, dtype, seed, specials=False) -> np.ndarray:
    """normal * exp(2 * normal): many binades. With ``specials``, a few zeros, a negative zero,
    NaN, +-inf and a subnormal at fixed places."""
    rng = np.random.default_rng(seed)
    v = (rng.standard_normal(shape) * np.exp(2.0 * rng.standard_normal(shape))).astype(np.float32)
    if specials and v.size >= 16:
        flat = v.reshape(-1)
        flat[[1, 2, 5, 9, 12, 15]] = [0.0, -0.0, np.nan, np.inf, -np.inf, 1e-40]
    return v.astype(dtype)


def poison(shape, dtype) -> cupy.ndarray:
    """A buffer whose bytes are all 0xFF (written, so initcheck counts it as initialized)."""
    a = cupy.empty(shape, dtype=dtype)
    if a.nbytes:
        cupy.cuda.runtime.memsetAsync(a.data.ptr, 0xFF, a.nbytes, cupy.cuda.get_current_stream().ptr)
    return a


def offset_copy(h: np.ndarray) -> cupy.ndarray:
    """A device copy of h that starts one element into its allocation (misaligned for 16-byte
    vectors), ending at the allocation's last byte."""
    flat = np.concatenate([np.zeros(1, h.dtype), h.reshape(-1)])
    return cupy.asarray(flat)[1:].reshape(h.shape)


def strided_rows(h: np.ndarray, extra: int) -> cupy.ndarray:
    """A device view of the 2-D h whose rows are ``K + extra`` elements apart."""
    wide = np.zeros((h.shape[0], h.shape[1] + extra), h.dtype)
    wide[:, : h.shape[1]] = h
    return cupy.asarray(wide)[:, : h.shape[1]]


# ------------------------------------------------------------------ per-tensor FP8
def run_fp8(run: Run):
    shapes = [(0,), (1,), (7,), (33,), (4097,), (3, 5, 7), (2, 3, 1029)]
    for shape in shapes:
        for dt in IN_DTYPES:
            xh = host_data(shape, dt, seed_of("fp8", shape, dt.name), specials=True)
            views = [("", cupy.asarray(xh))]
            if shape in ((4097,), (3, 5, 7)):
                views.append(("offset ", offset_copy(xh)))
            for vname, x in views:
                tag = f"fp8 {vname}{shape} {dt.name}"
                run.same(f"{tag} amax", run.op(cq.amax(x)), np.array([ref.amax(xh)], np.float32))
                modes = ["dynamic"] + (["static", "device"] if dt == BF16 else [])
                for mode in modes:
                    fmts = ["float8_e4m3fn", "float8_e5m2"] if mode == "dynamic" and dt == BF16 else ["float8_e4m3fn"]
                    for fmt in fmts:
                        out = poison(shape, np.uint8)
                        if mode == "dynamic":
                            q = run.op(cq.quantize_fp8(x, fmt, out=out))
                            eq, es = ref.quantize_fp8(xh, fmt)
                        else:
                            s = 0.37 if mode == "static" else cupy.asarray([0.37], np.float32)
                            q = run.op(cq.quantize_fp8(x, fmt, scale=s, out=out))
                            eq, es = ref.quantize_fp8(xh, fmt, scale=0.37)
                        run.same(f"{tag} {mode} {fmt} q", q.data, eq)
                        run.same(f"{tag} {mode} {fmt} scale_inv", q.scale, es)
                        for odt in (dt, F32):
                            y = run.op(cq.dequantize(q, odt, out=poison(shape, odt)))
                            run.same(
                                f"{tag} {mode} {fmt} dequantized {odt.name}",
                                y,
                                ref.dequantize_fp8(q.data.get(), q.scale.get(), fmt, odt),
                            )


# ------------------------------------------------------------------ per-group, per-token, SiLU*Mul
GROUP_SHAPES = {
    32: [(1, 32), (3, 96), (5, 7, 160)],
    64: [(2, 192), (33, 64)],
    128: [(5, 384), (2, 3, 256), (1, 128)],
    256: [(3, 512)],
    # per token: token_quantize_few (few rows: odd K with single elements, one and two units a
    # thread), token_quantize_regs with one warp a row and a part-empty last block (many rows) and
    # with 32 warps a row (40000), and the two-pass kernel (65544)
    None: [(1, 1), (3, 33), (5, 4097), (2, 3, 7), (4, 1024), (300, 2048), (2, 16384), (2, 40000), (1, 65544)],
}


def _raw_scales(q, shape, n_groups, packed, layout) -> cupy.ndarray:
    """The whole scale allocation (padding included) as uint32 words."""
    n_cols = -(-n_groups // 4) if packed else n_groups
    _, total = ref.scale_word_offsets(shape, n_cols, layout)
    return cupy.ndarray((total,), np.uint32, memptr=q.scale.data)


def _check_group(run, tag, q, eq, es, shape, G, layout, packed, fmt, xdt):
    run.same(f"{tag} q", q.data, eq)
    ng = 1 if G is None else shape[-1] // G
    run.same(f"{tag} scale buffer", _raw_scales(q, shape, ng, packed, layout), ref.scale_buffer(es, shape, layout))
    y = run.op(cq.dequantize(q, out=poison(shape, xdt)))
    run.same(f"{tag} dequantized", y, ref.dequantize_groupwise(q.data.get(), es, fmt, xdt, group_size=G))


def run_group(run: Run):
    i = 0
    for G, shapes in GROUP_SHAPES.items():
        for shape in shapes:
            for fmt in ("float8_e4m3fn", "int8", "float8_e5m2"):
                for layout in ("row", "col"):
                    for variant in ("plain", "pow2", "e8m0"):
                        if fmt == "float8_e5m2" and (layout == "col" or variant != "plain"):
                            continue
                        i += 1
                        dt = IN_DTYPES[i % 3]
                        xh = host_data(shape, dt, seed_of("group", G, shape, fmt, layout, variant), specials=True)
                        pow2 = variant == "pow2"
                        sdt = E8M0 if variant == "e8m0" else "float32"
                        packed = sdt == E8M0
                        qdt = np.int8 if fmt == "int8" else np.uint8
                        # the library's scale allocation half the time, an empty_scales buffer the other half
                        scale_out = cq.empty_scales(shape, G, layout, sdt) if i % 2 else None
                        q = run.op(
                            cq.quantize_groupwise(
                                cupy.asarray(xh),
                                fmt,
                                group_size=G,
                                scale_layout=layout,
                                scale_pow2=pow2,
                                scale_dtype=sdt,
                                out=poison(shape, qdt),
                                scale_out=scale_out,
                            )
                        )
                        eq, es = ref.quantize_groupwise(xh, fmt, group_size=G, scale_pow2=pow2, scale_dtype=sdt)
                        _check_group(
                            run,
                            f"group G={G} {shape} {fmt} {layout} {variant} {dt.name}",
                            q,
                            eq,
                            es,
                            shape,
                            G,
                            layout,
                            packed,
                            fmt,
                            dt,
                        )
    # misaligned and strided rows (scalar paths), scale_ub as a float and as a device array
    for G, shape in ((128, (5, 384)), (None, (3, 1000)), (32, (7, 96))):
        xh = host_data(shape, BF16, seed_of("group views", G, shape))
        for vname, x in (
            ("offset", offset_copy(xh)),
            ("strided", strided_rows(xh, 3)),
            ("strided16", strided_rows(xh, 8)),
        ):
            for ub in (None, 1e-3, cupy.asarray([0.05], np.float32)):
                ub_h = ub.get() if isinstance(ub, cupy.ndarray) else ub
                q = run.op(
                    cq.quantize_groupwise(
                        x, "float8_e4m3fn", group_size=G, scale_layout="col", scale_ub=ub, out=poison(shape, np.uint8)
                    )
                )
                eq, es = ref.quantize_groupwise(xh, "float8_e4m3fn", group_size=G, scale_ub=ub_h)
                _check_group(
                    run,
                    f"group {vname} G={G} {shape} ub={ub_h}",
                    q,
                    eq,
                    es,
                    shape,
                    G,
                    "col",
                    False,
                    "float8_e4m3fn",
                    BF16,
                )
    # SiLU * Mul: x (..., 2H), output (..., H)
    for shape, G in (((1, 64), 32), ((3, 256), 128), ((5, 768), 128), ((2, 3, 192), 32), ((7, 512), 256)):
        for fmt in ("float8_e4m3fn", "int8"):
            for layout in ("row", "col"):
                i += 1
                dt = IN_DTYPES[i % 3]
                xh = (host_data(shape, dt, seed_of("silu", shape, fmt, layout)).astype(np.float32) * 0.3).astype(dt)
                x = cupy.asarray(xh)
                oshape = shape[:-1] + (shape[-1] // 2,)
                q = run.op(
                    cq.silu_mul_quantize(
                        x,
                        fmt,
                        group_size=G,
                        scale_layout=layout,
                        out=poison(oshape, np.int8 if fmt == "int8" else np.uint8),
                    )
                )
                r = run.op(groupwise._silu_mul_intermediate(x))[0].get()
                eq, es = ref.quantize_silu_intermediate(r, fmt, group_size=G)
                tag = f"silu {shape} G={G} {fmt} {layout} {dt.name}"
                run.same(f"{tag} q", q.data, eq)
                run.same(
                    f"{tag} scale buffer",
                    _raw_scales(q, oshape, oshape[-1] // G, False, layout),
                    ref.scale_buffer(es, oshape, layout),
                )

    # INT8 with zero points: per token (both layouts, poisoned zero_point_out) and static per tensor
    for shape in ((1, 1), (3, 33), (130, 48), (2, 3, 96), (7, 2048)):
        for layout in ("row", "col"):
            xh = host_data(shape, IN_DTYPES[len(shape) % 3], seed_of("azp", shape, layout), specials=True)
            x = cupy.asarray(xh)
            zbuf = cq.empty_scales(shape, None, layout).view(cupy.int32)
            zbuf[...] = -1
            q = run.op(cq.quantize_groupwise(x, "int8", group_size=None, scale_layout=layout, symmetric=False,
                                             out=poison(shape, np.int8), zero_point_out=zbuf))  # fmt: skip
            eq, es, ez = ref.quantize_groupwise(xh, "int8", group_size=None, symmetric=False)
            tag = f"int8 azp {shape} {layout}"
            run.same(f"{tag} q", q.data, eq)
            run.same(f"{tag} scale", np.ascontiguousarray(q.scale.get()), es)
            run.same(f"{tag} zero point", np.ascontiguousarray(q.zero_point.get()), ez)
        for zp in (None, 3):
            q = run.op(cq.quantize_int8(x, scale=0.05, zero_point=zp, out=poison(shape, np.int8)))
            run.same(f"int8 static {shape} zp {zp}", q.data, ref.quantize_int8(xh, scale=0.05, zero_point=zp)[0])


# ------------------------------------------------------------------ MXFP8 / MXFP4 / NVFP4
MX_SHAPES = [(1, 1), (1, 32), (3, 33), (5, 17), (130, 48), (2, 3, 96), (7, 288), (129, 1000)]


def _dense(q, shape, block):
    s = q.scale.get()
    nb = -(-shape[-1] // block)
    return ref.unswizzle_scales(s, shape[:-1], nb) if q.scheme.scale_layout == "swizzled" else s


def run_mx(run: Run):
    """The cases below in each geometry of the quantizer (_block_scale.GEOMETRY): their shapes are
    small enough that the planner alone would take the small one."""
    saved = _block_scale.GEOMETRY
    try:
        for geometry in _block_scale.GEOMETRIES:
            _block_scale.GEOMETRY = geometry
            _run_mx(run, geometry)
    finally:
        _block_scale.GEOMETRY = saved


def _run_mx(run: Run, geometry: str):
    i = 0
    for shape in MX_SHAPES:
        K = shape[-1]
        for fmt in ("float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"):
            for layout in ("dense", "swizzled"):
                for rounding in ("ceil", "floor") if fmt != "float8_e5m2" else ("ceil",):
                    i += 1
                    dt = IN_DTYPES[i % 3]
                    xh = host_data(shape, dt, seed_of("mx", shape, fmt, layout, rounding), specials=True)
                    views = [("", cupy.asarray(xh))] + ([("offset ", offset_copy(xh))] if shape == (7, 288) else [])
                    for vname, x in views:
                        eq, es = ref.quantize_mx(xh, fmt, rounding=rounding)
                        s_out = poison(cq.block_scale_shape(shape, 32, layout), np.uint8) if i % 2 else None
                        q = run.op(
                            cq.quantize_mx(
                                x,
                                fmt,
                                scale_layout=layout,
                                rounding=rounding,
                                out=poison(eq.shape, np.uint8),
                                scale_out=s_out,
                            )
                        )
                        tag = f"mx {geometry} {vname}{shape} {fmt} {layout} {rounding} {dt.name}"
                        run.same(f"{tag} data", q.data, eq)
                        run.same(f"{tag} scales", q.scale, ref.swizzle_scales(es) if layout == "swizzled" else es)
                        for odt in (F32, BF16):
                            y = run.op(cq.dequantize(q, odt, out=poison(shape, odt)))
                            run.same(
                                f"{tag} dequantized {odt.name}",
                                y,
                                ref.dequantize_mx(q.data.get(), _dense(q, shape, 32), fmt, odt, K=K),
                            )
        for layout in ("swizzled", "dense"):
            for mode in ("dynamic", "static", "device"):
                i += 1
                dt = IN_DTYPES[i % 3]
                xh = host_data(shape, dt, seed_of("nvfp4", shape, layout, mode), specials=mode != "dynamic")
                gs = None if mode == "dynamic" else (37.5 if mode == "static" else cupy.asarray([37.5], np.float32))
                x = cupy.asarray(xh)
                eq, es, eg = ref.quantize_nvfp4(xh, global_scale=None if gs is None else 37.5)
                q = run.op(cq.quantize_nvfp4(x, global_scale=gs, scale_layout=layout, out=poison(eq.shape, np.uint8)))
                tag = f"nvfp4 {geometry} {shape} {layout} {mode} {dt.name}"
                run.same(f"{tag} data", q.data, eq)
                run.same(f"{tag} scales", q.scale, ref.swizzle_scales(es) if layout == "swizzled" else es)
                run.same(f"{tag} global scale", q.global_scale, np.array([eg], np.float32))
                if gs is None:
                    run.same(f"{tag} amax", q.amax, np.array([ref.amax(xh)], np.float32))
                y = run.op(cq.dequantize(q, BF16, out=poison(shape, BF16)))
                run.same(
                    f"{tag} dequantized",
                    y,
                    ref.dequantize_nvfp4(q.data.get(), _dense(q, shape, 16), q.global_scale.get(), BF16, K=K),
                )


# ------------------------------------------------------------------ weights and the matmul
WEIGHT_SHAPES = [((1, 32), 32), ((5, 96), 32), ((3, 128), None), ((17, 384), 128), ((9, 192), 64), ((4, 2), None)]
SCHEMES = [("int4", True), ("uint4", False), ("float8_e4m3fn", True)]


def _mm_weight(run: Run, tag, scheme, sym, G, N, K, dt):
    """A quantized (N, K) weight for the matmul cases (rows scaled by 2^-4 .. 2^4), its float64
    dequantization by the reference, and the generator that made it (seeded by the arguments)."""
    rng = np.random.default_rng(seed_of(tag, scheme, G, K, dt.name))
    wh = (rng.standard_normal((N, K)) * 2.0 ** rng.uniform(-4, 4, (N, 1))).astype(np.float32).astype(dt)
    qw = run.op(cq.quantize_weight(cupy.asarray(wh), scheme, group_size=G, symmetric=sym))
    deq = ref.dequantize_weight(
        qw.data.get(), qw.scales.get(), None if qw.zeros is None else qw.zeros.get(), scheme, dt
    ).astype(np.float64)
    return qw, deq, rng


def run_weight(run: Run):
    i = 0
    for scheme, sym in SCHEMES:
        for (N, K), G in WEIGHT_SHAPES:
            i += 1
            dt = IN_DTYPES[i % 3]
            wh = host_data((N, K), dt, seed_of("weight", scheme, N, K, G), specials=True)
            qw = run.op(cq.quantize_weight(cupy.asarray(wh), scheme, group_size=G, symmetric=sym))
            d, s, z = ref.quantize_weight(wh, scheme, group_size=G, symmetric=sym)
            tag = f"weight {scheme} ({N}, {K}) G={G} {dt.name}"
            run.same(f"{tag} data", qw.data, d)
            run.same(f"{tag} scales", qw.scales, s)
            if z is not None:
                run.same(f"{tag} zeros", qw.zeros, z)
            for odt in (dt, F32):
                y = run.op(cq.dequantize_weight(qw, odt, out=poison((N, K), odt)))
                run.same(f"{tag} dequantized {odt.name}", y, ref.dequantize_weight(d, s, z, scheme, odt))
    # the matmul: M = 1 and 16 (the decode kernel), 64 and 300 (300 takes the pipelined kernel),
    # N = 100 (a partial 32-column decode tile and 128-column pipelined tile), batched and strided
    # activations, M = 0. K = 1024 gives the pipelined kernel 8 stages, so its few tiles split K in
    # two across blocks (the float32 workspace and the per-tile counter).
    for scheme, sym, G, K in (
        ("int4", True, 128, 384),
        ("int4", True, None, 256),
        ("int4", True, 32, 256),
        ("uint4", False, 64, 256),
        ("float8_e4m3fn", True, None, 320),
        ("int4", True, 128, 1024),
        ("uint4", False, 32, 1024),
    ):
        for dt in (BF16, F16):
            N = 100
            qw, deq, rng = _mm_weight(run, "mm", scheme, sym, G, N, K, dt)
            # the prepared layout (bytes against the reference) for the single calls; the batched
            # ones below pass the plain weight, which matmul converts itself
            qp = run.op(cq.prepare_weight(qw))
            pd, ps, pz = ref.prepare_weight(
                qw.data.get(), qw.scales.get(), None if qw.zeros is None else qw.zeros.get(), scheme=scheme
            )
            run.same(f"prepared data {scheme} G={G} K={K}", qp.data, pd)
            run.same(f"prepared scales {scheme} G={G} K={K}", qp.scale, ps)
            if pz is not None:
                run.same(f"prepared zeros {scheme} G={G} K={K}", qp.zero_point, pz)
            for M in (1, 16, 64, 300):
                ah = rng.standard_normal((M, K)).astype(np.float32).astype(dt)
                out = poison((M, N), dt)
                y = run.op(cq.matmul(cupy.asarray(ah), qp, out=out))
                exact = ah.astype(np.float64) @ deq.T
                err = float(np.linalg.norm(y.get().astype(np.float64) - exact) / np.linalg.norm(exact))
                run.within(f"matmul {scheme} G={G} K={K} {dt.name} M={M}", err, TOL[dt])
            if dt == BF16 and K >= 320:  # every decode configuration, forced (matmul picks one by waves)
                _decode_configs(run, qp, deq, dt, rng, f"{scheme} G={G} K={K}")
            ah = rng.standard_normal((2, 3, K)).astype(np.float32).astype(dt)
            for vname, a in (
                ("batched", cupy.asarray(ah)),
                ("strided", strided_rows(ah.reshape(6, K), 5).reshape(2, 3, K)),
                ("offset", offset_copy(ah)),
            ):
                y = run.op(cq.matmul(a, qw))
                exact = ah.reshape(6, K).astype(np.float64) @ deq.T
                err = float(np.linalg.norm(y.get().reshape(6, N).astype(np.float64) - exact) / np.linalg.norm(exact))
                run.within(f"matmul {vname} {scheme} G={G} {dt.name}", err, TOL[dt])
            run.same(f"matmul M=0 {scheme}", run.op(cq.matmul(cupy.asarray(ah[:0]), qw)), np.zeros((0, 3, N), dt))
            if scheme != "float8_e4m3fn" and _device.caps(cupy.cuda.Device().id).wgmma:
                _wgmma_edges(run, qw, deq, dt, rng)


def run_fp4_weight(run: Run):
    """NVFP4 and MXFP4 weights: quantized, dequantized and prepared bytes against the reference
    (N = 100: a partial 16-row tile), and the matmul on each kernel forced (M = 1 to 300; K = 1024
    splits K on the gemms), within the relative-error bound against the exactly dequantized weight."""
    hopper = _device.caps(cupy.cuda.Device().id).wgmma
    for fmt in ("nvfp4", "mxfp4"):
        for dt, K in ((BF16, 384), (F16, 1024)):
            N = 100
            rng = np.random.default_rng(seed_of("fp4", fmt, K))
            wh = (rng.standard_normal((N, K)) * 2.0 ** rng.uniform(-4, 4, (N, 1))).astype(np.float32).astype(dt)
            qw = run.op(cq.quantize_weight(cupy.asarray(wh), fmt))
            d, s, s2 = ref.quantize_weight(wh, fmt)
            tag = f"{fmt} ({N}, {K}) {dt.name}"
            run.same(f"{tag} data", qw.data, d)
            run.same(f"{tag} scales", qw.scale, s)
            y = run.op(cq.dequantize_weight(qw, F32, out=poison((N, K), F32)))
            deq = ref.dequantize_weight(d, s, None, fmt, F32, scale_2=s2)
            run.same(f"{tag} dequantized", y, deq)
            qp = run.op(cq.prepare_weight(qw))
            pd, ps, _ = ref.prepare_weight(d, s, scheme=fmt)
            run.same(f"{tag} prepared data", qp.data, pd)
            run.same(f"{tag} prepared scales", qp.scale, ps)
            for path in ("decode", "sm80_gemm") + (("sm90_gemm",) if hopper else ()):
                with cqw._forced_path(path):
                    for M in (1, 16, 17, 300):
                        ah = rng.standard_normal((M, K)).astype(np.float32).astype(dt)
                        out = poison((M, N), dt)
                        y = run.op(cq.matmul(cupy.asarray(ah), qp, out=out))
                        exact = ah.astype(np.float64) @ deq.astype(np.float64).T
                        err = float(np.linalg.norm(y.get().astype(np.float64) - exact) / np.linalg.norm(exact))
                        run.within(f"matmul {tag} {path} M={M}", err, TOL[dt])


def _decode_configs(run, qp, deq, dt, rng, tag):
    """The decode kernel in each of its configurations (decode.DECODE_CONFIGS), whichever
    decode.decode_config would pick for this shape; on compute capability 9.0+ also with K split 2 ways
    across a cluster (the wrapper splits R64_W8_B1 only; the others forced) and 3 ways for R64_W8_B1
    (the cluster's blocks add through distributed shared memory)."""
    N, K = qp.shape
    pick, pick_splits = decode.decode_config, decode.decode_splits
    hopper = _device.caps(cupy.cuda.Device().id).pdl
    try:
        with cqw._forced_path("decode"):
            for cfg in decode.DECODE_CONFIGS:
                decode.decode_config = lambda *args, cfg=cfg: cfg
                for splits in ((1, 2, 3) if cfg == decode.R64_W8_B1 else (1, 2)) if hopper else (1,):
                    decode.decode_splits = lambda *args, splits=splits: splits
                    _plans.clear()  # the matmul's plans hold the configuration they were made with
                    M = 13 if cfg.m_tile_rows == 16 else 3
                    ah = rng.standard_normal((M, K)).astype(np.float32).astype(dt)
                    y = run.op(cq.matmul(cupy.asarray(ah), qp, out=poison((M, N), dt)))
                    exact = ah.astype(np.float64) @ deq.T
                    err = float(np.linalg.norm(y.get().astype(np.float64) - exact) / np.linalg.norm(exact))
                    run.within(f"matmul decode config {cfg.name} splits {splits} {tag} M={M}", err, TOL[dt])
    finally:
        decode.decode_config, decode.decode_splits = pick, pick_splits
        _plans.clear()


def _wgmma_edges(run, qw, deq, dt, rng):
    """The wgmma kernel (Hopper) at sizes matmul would give the decode kernel: rows of a past M and
    weight rows past N in a tile (copies predicated off; the 128-row tile's TMA reads them as
    zeros), and K split 1, 2 and 3 ways across blocks: 2 and 3 as clusters adding through
    distributed shared memory (3 where every tile's cluster fits on the GPU at once), and 3 again
    through the workspace; each tile height (32, 64, 128 and 256 rows of a: the 128-row tile with its
    producer warpgroup and mbarrier ring)."""
    N, K = qw.shape
    saved = sm90_gemm.sm90_plan, sm90_gemm.cluster_cap
    try:
        with cqw._forced_path("sm90_gemm"):
            for bma in (32, 64, 128, 256):
                for splits, workspace in ((1, False), (2, False), (3, False), (3, True)):
                    sm90_gemm.sm90_plan = lambda M, N_, iters, sms, b=bma, s=splits, **kw: (b, min(s, iters))
                    sm90_gemm.cluster_cap = (lambda *a: None) if workspace else saved[1]
                    _plans.clear()
                    for M in (17, 130):
                        ah = rng.standard_normal((M, K)).astype(np.float32).astype(dt)
                        y = run.op(cq.matmul(cupy.asarray(ah), qw, out=poison((M, N), dt)))
                        exact = ah.astype(np.float64) @ deq.T
                        err = float(np.linalg.norm(y.get().astype(np.float64) - exact) / np.linalg.norm(exact))
                        run.within(
                            f"matmul sm90_gemm {bma} rows {qw.scheme.format} G={qw.group_size} K={K} {dt.name} M={M} "
                            f"splits={splits}{' workspace' if workspace else ''}",
                            err,
                            TOL[dt],
                        )
    finally:
        sm90_gemm.sm90_plan, sm90_gemm.cluster_cap = saved
        _plans.clear()


def run_wgmma(run: Run):
    """_wgmma_edges for three weights (INT4 groups of 128 and K = 1024, so that an unsplit tile's
    stages wrap every ring; UINT4 groups of 32, fp16; INT4 per channel): every tile height and split
    of the wgmma kernel, on Hopper only."""
    if not _device.caps(cupy.cuda.Device().id).wgmma:
        print("sanitize_cases: wgmma: this GPU has no wgmma kernel; nothing run")
        return
    for scheme, sym, G, K, dt in (
        ("int4", True, 128, 1024, BF16),
        ("uint4", False, 32, 1024, F16),
        ("int4", True, None, 256, BF16),
    ):
        _wgmma_edges(
            run,
            *_mm_weight(run, "wgmma", scheme, sym, G, 100, K, dt)[:2],
            dt,
            np.random.default_rng(seed_of("wgmma a", scheme, G, K)),
        )


# ------------------------------------------------------------------ W8A8 FP8 and INT8 matmul
def run_w8a8(run: Run):
    """scaled_mm on both kernels (the Hopper one where the GPU has it): every scaling mode, M, N and
    K tails, a K split, packed UE8M0 and column-major activation scales, bias, a poisoned out=.
    Small integer codes and power-of-two scales: every sum is exact, so y equals the reference. INT8
    (scaled_mm_azp, zero points per token) equals its reference bit for bit on any codes."""
    from cupyquant.w8a8 import dispatch

    E4 = ml_dtypes.float8_e4m3fn
    paths = ["mma"] + (["sm90"] if _device.caps(cupy.cuda.Device().id).wgmma else [])
    for M, N, K in ((1, 200, 272), (16, 256, 2048), (65, 130, 528), (130, 300, 784)):
        rng = np.random.default_rng(seed_of("w8a8", M, N, K))
        nkb = -(-K // 128)
        qa = rng.integers(-3, 4, (M, K)).astype(np.float32).astype(E4).view(np.uint8)
        qb = rng.integers(-3, 4, (N, K)).astype(np.float32).astype(E4).view(np.uint8)
        pow2 = lambda shape: (2.0 ** rng.integers(-2, 3, shape)).astype(np.float32)  # noqa: E731
        ue8 = rng.integers(125, 130, (M, nkb)).astype(np.uint8)  # 2^-2 .. 2^2
        packed = np.zeros((M, -(-nkb // 4) * 4), np.uint8)
        packed[:, :nkb] = ue8
        a_scales = {
            "tensor": pow2((1,)),
            "token-col": np.asfortranarray(pow2((M, 1))),
            "group-col": np.asfortranarray(pow2((M, nkb))),
            "group-packed": packed.view(np.int32),
        }
        b_scales = {
            "tensor": pow2((1,)),
            "channel": pow2((N, 1)),
            "block": pow2((-(-N // 128), nkb)),
            "group": pow2((N, nkb)),
        }
        bias = (rng.integers(-8, 9, N) / 16).astype(np.float16)
        for path in paths:
            for (ak, sa), (bk, sb) in zip(a_scales.items(), b_scales.items()):
                out = poison((M, N), np.float16)
                with dispatch._forced_path(path):
                    run.op(cq.scaled_mm(cupy.asarray(qa), cupy.asarray(qb), cupy.asarray(sa), cupy.asarray(sb),
                                        out_dtype="float16", bias=cupy.asarray(bias), out=out))  # fmt: skip
                r, _ = ref.scaled_mm(qa, qb, sa, sb, bias)
                run.same(f"w8a8 {path} {M}x{N}x{K} {ak} x {bk}", out, ref.round_result(r, np.float16))
        # INT8: full-range codes, per-token scales and zero points (the K split sums integers)
        a8, b8 = rng.integers(-128, 128, (M, K)).astype(np.int8), rng.integers(-128, 128, (N, K)).astype(np.int8)
        sa8, sb8 = rng.uniform(1e-3, 1e-2, M).astype(np.float32), rng.uniform(1e-3, 1e-2, N).astype(np.float32)
        z8, adj = rng.integers(-128, 128, M).astype(np.int32), b8.sum(axis=1, dtype=np.int32)
        for path in paths:
            out = poison((M, N), np.float16)
            with dispatch._forced_path(path):
                run.op(cq.scaled_mm_azp(cupy.asarray(a8), cupy.asarray(b8), cupy.asarray(sa8), cupy.asarray(sb8),
                                        cupy.asarray(adj), azp=cupy.asarray(z8), out_dtype="float16",
                                        bias=cupy.asarray(bias), out=out))  # fmt: skip
            want = ref.scaled_mm_int8(a8, b8, sa8, sb8, azp=z8, azp_adj=adj, bias=bias, out_dtype=np.float16)
            run.same(f"w8a8 int8 {path} {M}x{N}x{K}", out, want)
        if "sm90" in paths and M > 128:  # every Hopper tile forced, split where it takes one
            _sm90_tiles(run, qa, qb, a_scales, b_scales, bias, f"{M}x{N}x{K}")


def _sm90_tiles(run: Run, qa, qb, a_scales, b_scales, bias, what):
    from cupyquant.w8a8 import build, operands, sm90

    for ak, bk in (("tensor", "tensor"), ("group-col", "block"), ("group-packed", "block"), ("group-col", "group")):
        sa, sb = cupy.asarray(a_scales[ak]), cupy.asarray(b_scales[bk])
        a, b, bs = cupy.asarray(qa), cupy.asarray(qb), cupy.asarray(bias)
        L = operands.for_mm(a, b, sa, sb, "float16", bs, None, "float8_e4m3fn", "float8_e4m3fn")
        ops = build.operands(L, build.mm_arrays(a, b, sa, sb, bs, None))
        r, _ = ref.scaled_mm(qa, qb, a_scales[ak], b_scales[bk], bias)
        for cfg in sm90.CONFIGS:
            if L.mode not in sm90.modes(cfg):
                continue
            for parts, cluster in ((1, 1), (1, 2), (2, 1)) if cfg.can_split else ((1, 1), (1, 2)):
                ops.result[...] = cupy.nan
                sm90.MmLaunch(L, cfg, parts, cluster)(ops)
                run.same(
                    f"w8a8 sm90 {cfg.bm}x{cfg.bn} parts {parts} cluster {cluster} {what} {ak} x {bk}",
                    ops.result,
                    ref.round_result(r, np.float16),
                )


RUNNERS = {
    "fp4_weight": run_fp4_weight,
    "per_tensor": run_fp8,
    "groupwise": run_group,
    "mx": run_mx,
    "weight": run_weight,
    "weight_sm90_gemm": run_wgmma,
    "w8a8": run_w8a8,
    "rms_norm": lambda run: sanitize_hot_path.run_norm(run, sys.modules[__name__]),
    "kv_cache": lambda run: sanitize_hot_path.run_kv_cache(run, sys.modules[__name__]),
}

# Positive controls: one deliberately broken kernel per tool, so that a clean report is known to come
# from a sanitizer that is attached and sees our launches (scripts/sanitize.sh requires each control
# to be reported). Each is the bug class the tool exists for.
_CONTROL_SRC = r"""
extern "C" __global__ void oob_write(float* a, int n) { a[n + threadIdx.x] = 1.0f; }
extern "C" __global__ void uninit_read(const float* a, float* b) { b[threadIdx.x] = a[threadIdx.x] + 1.0f; }
extern "C" __global__ void smem_race(float* b) {
    __shared__ float s[64];
    s[threadIdx.x] = (float)threadIdx.x;
    b[threadIdx.x] = s[(threadIdx.x + 1) % 64];  // reads a neighbour's word with no barrier
}
extern "C" __global__ void divergent_barrier(float* b) {
    __shared__ float s[64];
    s[threadIdx.x] = 1.0f;
    if (threadIdx.x < 16) __syncthreads();  // only part of the block reaches the barrier
    b[threadIdx.x] = s[threadIdx.x];
}
"""


def run_control(tool: str) -> None:
    mod = cupy.RawModule(code=_CONTROL_SRC)
    a = cupy.cuda.alloc(256 * 4)  # pool off: exactly 256 floats
    b = cupy.cuda.alloc(64 * 4)
    if tool == "memcheck":
        mod.get_function("oob_write")((1,), (32,), (a, np.int32(256)))
    elif tool == "initcheck":
        mod.get_function("uninit_read")((1,), (64,), (a, b))
    elif tool == "racecheck":
        mod.get_function("smem_race")((1,), (64,), (b,))
    elif tool == "synccheck":
        mod.get_function("divergent_barrier")((1,), (64,), (b,))
    else:
        raise SystemExit(f"no control for {tool}")
    try:
        cupy.cuda.get_current_stream().synchronize()
    except cupy.cuda.runtime.CUDARuntimeError as e:  # memcheck may turn the fault into a launch error
        print(f"sanitize_cases: control {tool}: {e}")
    print(f"sanitize_cases: control {tool} launched")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--family",
        default=",".join(FAMILIES),
        help=f"comma-separated subset of {','.join(FAMILIES + EXTRA_FAMILIES)} (default: all but {','.join(EXTRA_FAMILIES)})",
    )
    p.add_argument(
        "--pool", action="store_true", help="keep CuPy's memory pool (off by default: see the module docstring)"
    )
    p.add_argument(
        "--control",
        metavar="TOOL",
        help="run only the deliberately broken kernel for TOOL "
        "(memcheck, initcheck, racecheck, synccheck): the sanitizer must report it",
    )
    args = p.parse_args(argv)
    if args.control:
        cupy.cuda.set_allocator(None)
        run_control(args.control)
        return 0
    families = [FAMILY_ALIASES.get(f, f) for f in args.family.split(",") if f]
    unknown = sorted(set(families) - set(FAMILIES) - set(EXTRA_FAMILIES))
    if unknown:
        p.error(f"unknown families {unknown}; expected some of {FAMILIES + EXTRA_FAMILIES}")
    if not args.pool:
        cupy.cuda.set_allocator(None)
    run = Run()
    for fam in families:
        RUNNERS[fam](run)
    cupy.cuda.get_current_stream().synchronize()
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    print(
        f"sanitize_cases: {','.join(families)} on {props['name'].decode()}: {run.calls} op calls, "
        f"{run.checks} checks, {len(run.bad)} mismatches"
    )
    for line in run.bad[:30]:
        print("  MISMATCH " + line)
    return 3 if run.bad else 0


if __name__ == "__main__":
    sys.exit(main())
