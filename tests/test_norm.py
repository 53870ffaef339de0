"""The fused (residual add +) RMSNorm + quantization on the GPU, byte for byte against
cupyquant.reference: quantized bytes, scales in their layout (padding included), the residual
written back, the normalized output, and the same bytes as the scheme's own quantizer of that
output."""

from __future__ import annotations

import functools
import zlib

import ml_dtypes
import numpy as np
import pytest
from _pdl import assert_rounds_equal, check_rounds
from conftest import assert_bits_equal, heavy_tailed, poisoned, raw_scale_words, require_arch, side_stream

import cupyquant as cq
from cupyquant import _scales, norm
from cupyquant import reference as ref

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")

BF16 = ml_dtypes.bfloat16
IN_DTYPES = [np.float32, np.float16, BF16]
E8M0 = "float8_e8m0fnu"
# (scheme, dtype, keyword arguments): every scheme, format and scale layout
CASES = [
    ("token", "float8_e4m3fn", {}),
    ("token", "float8_e5m2", {"scale_layout": "col"}),
    ("token", "int8", {}),
    ("token", "int8", {"scale_pow2": True}),
    ("token", "float8_e4m3fn", {"scale_ub": 3.0}),
    ("group", "float8_e4m3fn", {}),
    ("group", "float8_e4m3fn", {"group_size": 64, "scale_layout": "col"}),
    ("group", "float8_e4m3fn", {"group_size": 128, "scale_layout": "col", "scale_dtype": E8M0}),
    ("group", "float8_e5m2", {"group_size": 32, "scale_dtype": E8M0}),
    ("group", "int8", {"group_size": 256, "scale_pow2": True}),
    ("group", "float8_e4m3fn", {"group_size": 128, "scale_ub": 0.5}),
    ("tensor", "float8_e4m3fn", {"scale": 0.01}),
    ("tensor", "float8_e5m2", {"scale": "device:0.003"}),
    ("mx", "float8_e4m3fn", {"scale_layout": "swizzled"}),
    ("mx", "float8_e5m2", {}),
    ("mx", "float4_e2m1fn", {"scale_layout": "swizzled"}),
    ("nvfp4", None, {"global_scale": 150.0}),
    ("nvfp4", None, {"global_scale": "device:2688.0", "scale_layout": "dense"}),
    ("tensor", "float8_e4m3fn", {"scale": 0.02, "scale_layout": "scalar"}),
]


def _id(v):
    if isinstance(v, dict):
        return "-".join(f"{k}={v[k]}" for k in sorted(v)) or "default"
    return np.dtype(v).name if not isinstance(v, (str, tuple, type(None), int, bool)) else str(v)


def _seed(*parts):
    return zlib.crc32(repr(parts).encode())


def _device_kw(kw):
    """Keyword arguments with "device:v" values as one-element float32 device arrays."""
    out = {}
    for k, v in kw.items():
        if isinstance(v, str) and v.startswith("device:"):
            v = cupy.asarray([float(v[7:])], dtype=np.float32)
        out[k] = v
    return out


def _host_kw(kw):
    return {k: (np.float32(v[7:]) if isinstance(v, str) and v.startswith("device:") else v) for k, v in kw.items()}


def _weight(H, dtype, seed):
    rng = np.random.default_rng(seed)
    return (1.0 + 0.25 * rng.standard_normal(H)).astype(np.float32).astype(dtype)


@functools.lru_cache(maxsize=8)
def _inputs(shape, dtype, residual, seed):
    """(x, weight, residual or None) on the host, and the reference (y, residual_out)."""
    xh = heavy_tailed(shape, seed, dtype)
    wh = _weight(shape[-1], dtype, seed + 1)
    rh = heavy_tailed(shape, seed + 2, dtype) if residual else None
    y, z = ref.rms_norm(xh, wh, residual=rh)
    return xh, wh, rh, y, z


def expected(scheme, fmt, kw, y):
    """The reference quantization of y: (q, dense scales, S_enc or the tensor scale or None)."""
    kw = _host_kw(kw)
    layout = kw.pop("scale_layout", None)
    del layout
    if scheme in ("token", "group"):
        gs = None if scheme == "token" else kw.pop("group_size", 128)
        eq, es = ref.quantize_groupwise(y, fmt, group_size=gs, **kw)
        return eq, es, None
    if scheme == "tensor":
        eq, es = ref.quantize_fp8(y, fmt, scale=kw["scale"])
        return eq, None, es
    if scheme == "mx":
        eq, es = ref.quantize_mx(y, fmt)
        return eq, es, None
    eq, es, s_enc = ref.quantize_nvfp4(y, global_scale=kw["global_scale"])
    return eq, es, np.array([s_enc], np.float32)


def check_scales(q, scheme, es, extra):
    layout = q.scheme.scale_layout
    if scheme in ("token", "group"):
        host = q.to_host()
        assert_bits_equal(host["scale"].view(np.uint8) if es.dtype == np.uint8 else host["scale"], es, "scales")
        assert_bits_equal(raw_scale_words(q), ref.scale_buffer(es, q.shape, layout), f"{layout} scale buffer")
    elif scheme == "tensor":
        assert_bits_equal(q.scale, extra, "tensor scale")
    else:
        want = ref.swizzle_scales(es) if layout == "swizzled" else es.reshape(q.scale.shape)
        assert_bits_equal(q.scale, want, f"{layout} block scales")
        if scheme == "nvfp4":
            assert_bits_equal(q.global_scale, extra, "S_enc")


def _poisoned_scales(scheme, kw, shape):
    """A scale_out buffer of the scheme's layout whose every byte (padding included) is 0xFF."""
    hkw = _host_kw(kw)
    layout = hkw.get("scale_layout")
    if scheme in ("token", "group"):
        gs = None if scheme == "token" else hkw.get("group_size", 128)
        s = cq.empty_scales(shape, gs, layout or "row", hkw.get("scale_dtype", "float32"))
        cupy.cuda.runtime.memset(s.data.ptr, 0xFF, s.data.mem.size - (s.data.ptr - s.data.mem.ptr))
        return s
    if scheme == "tensor":
        return poisoned((1,), np.float32)
    block = _scales.MX_BLOCK if scheme == "mx" else _scales.NV_BLOCK
    layout = layout or ("dense" if scheme == "mx" else "swizzled")
    return poisoned(_scales.block_scale_shape(shape, block, layout), np.uint8)


def run_case(xh, wh, rh, y_ref, z_ref, scheme, fmt, kw, *, x=None, normalized=True, out=False, want=None):
    """Run the fused op (on a copy of the residual), check everything against the reference and
    against the scheme's own quantizer of the normalized output. ``out``: into poisoned q and scale
    buffers; ``want``: expected(scheme, fmt, kw, y_ref), if computed already."""
    x = cupy.asarray(xh) if x is None else x
    w = cupy.asarray(wh)
    r = None if rh is None else cupy.asarray(rh)
    dkw = _device_kw(kw)
    eq, es, extra = expected(scheme, fmt, kw, y_ref) if want is None else want
    if out:
        dkw["out"] = poisoned(eq.shape, eq.dtype)
        dkw["scale_out"] = _poisoned_scales(scheme, kw, x.shape)
    res = cq.rms_norm_quantize(x, w, residual=r, scheme=scheme, dtype=fmt, return_normalized=normalized, **dkw)
    q, y = res if normalized else (res, None)
    if out:
        assert q.data is dkw["out"] and q.scale is dkw["scale_out"]
    assert_bits_equal(q.data, eq, f"{scheme} q")
    check_scales(q, scheme, es, extra)
    if rh is not None:
        assert_bits_equal(r, z_ref, "residual written back")
    if normalized:
        assert_bits_equal(y, y_ref, "normalized y")
        # the scheme's own quantizer of the GPU's y gives the same bytes and scales
        own = _own_quantizer(y, scheme, fmt, dkw)
        assert_bits_equal(q.data, own.data, "own quantizer q")
        assert_bits_equal(q.scale, own.scale, "own quantizer scale")
        assert q.scheme == own.scheme
    return q


def _own_quantizer(y, scheme, fmt, dkw):
    kw = {k: v for k, v in dkw.items() if k not in ("out", "scale_out")}
    if scheme in ("token", "group"):
        gs = None if scheme == "token" else kw.pop("group_size", 128)
        return cq.quantize_groupwise(y, fmt, group_size=gs, **kw)
    if scheme == "tensor":
        kw.pop("scale_layout", None)  # "scalar": quantize_fp8's one scale has no other layout
        return cq.quantize_fp8(y, fmt, **kw)
    if scheme == "mx":
        return cq.quantize_mx(y, fmt, **kw)
    return cq.quantize_nvfp4(y, **kw)


def _case_ok(H, scheme, kw):
    if scheme == "group" and H % kw.get("group_size", 128):
        return False
    if scheme == "mx" and H % 32 or scheme == "nvfp4" and H % 16:
        return False
    return True


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
@pytest.mark.parametrize("scheme,fmt,kw", CASES, ids=_id)
def test_every_scheme(scheme, fmt, kw, in_dtype, residual):
    for shape in [(3, 2048), (2, 130, 512)]:
        xh, wh, rh, y, z = _inputs(shape, in_dtype, residual, _seed(shape, in_dtype, residual))
        run_case(xh, wh, rh, y, z, scheme, fmt, kw, normalized=_seed(scheme, kw, shape) % 3 != 0)


SHAPE_CASES = [CASES[i] for i in (0, 7, 13, 16, 2, 11)]


# M = 4096 at the H where the reference is quick, and at 8192 (per token only)
ISSUE_SHAPES = [(M, H) for M in (1, 3, 128) for H in (64, 128, 2048, 4096, 5120, 7168, 8192)]
ISSUE_SHAPES += [(4096, 64), (4096, 128), (4096, 2048), (4096, 8192)]


@pytest.mark.parametrize("occupancy", norm._OCCUPANCY)
@pytest.mark.parametrize("M,H", ISSUE_SHAPES)
def test_inference_shapes(M, H, occupancy):
    """The inference sizes: bf16 with a residual, each shape under two schemes in turn, at either
    register bound of the kernels."""
    i = _seed(H, M)
    xh, wh, rh, y, z = _inputs((M, H), BF16, True, i)
    for k in range(2 if M < 4096 else 1):
        scheme, fmt, kw = SHAPE_CASES[(i + k) % len(SHAPE_CASES)]
        if M == 4096 and H == 8192:
            scheme, fmt, kw = CASES[0]
        with norm._forced_path(occupancy=occupancy):
            run_case(xh, wh, rh.copy(), y, z, scheme, fmt, kw)


@pytest.mark.parametrize("scheme, fmt, kw", [CASES[0], CASES[5], ("tensor", "float8_e4m3fn", {"scale": 0.05})])
def test_planner_occupancy_is_what_launches(scheme, fmt, kw):
    """Unforced, a plan takes norm._planned_occupancy's register bound: occupancy 2 for per-token,
    per-tensor and group scales from _OCC2_FROM_ROWS_PER_SM rows per SM up, 1 below; the launched
    instantiation is that bound's, and the bytes are the reference's either side of the line."""
    from cupyquant import _device, _dtypes, _jit, _launch

    device = cupy.cuda.Device().id
    sms = _device.sm_count(device)
    kernel = norm._KERNELS["lead" if scheme in norm._LEAD_SCHEMES else "block"]
    targs = (_dtypes.input_type(BF16).ctype, norm._SCHEME_ID[scheme], _dtypes.element_format(fmt).ctag)
    line = norm._OCC2_FROM_ROWS_PER_SM * sms
    H = 256
    for M, occ in ((line - 1, 1), (line, 2)):
        assert norm._planned_occupancy(scheme, M, sms) == occ
        xh, wh, rh, y, z = _inputs((M, H), BF16, True, _seed("occupancy", scheme, M))
        with _launch.recording() as rec:
            run_case(xh, wh, rh.copy(), y, z, scheme, fmt, kw, normalized=False)
        launched = [r[0] for r in rec if r[5] is not None]
        assert launched == [_jit.kernel(device, norm.FAMILY, kernel, *targs, occ)], (M, occ)


@pytest.mark.parametrize("occupancy", norm._OCCUPANCY)
@pytest.mark.parametrize("kernel", list(norm._KERNELS))
@pytest.mark.parametrize("in_dtype", [np.float32, BF16], ids=_id)
@pytest.mark.parametrize("M", [5, 300])
@pytest.mark.parametrize("warps", norm._WARPS)
def test_every_team(warps, M, in_dtype, kernel, occupancy):
    """Rows at the longest a team holds and one unit past it: the sum of squares has one order
    whatever the team, so every team gives the reference's bytes, at either register bound."""
    longest = norm._row_max(np.dtype(in_dtype).itemsize, warps)
    for H in (longest, longest + 8) if warps < norm._WARPS[-1] else (longest,):
        xh, wh, rh, y, z = _inputs((M, H), in_dtype, True, _seed(warps, M, in_dtype, H))
        with norm._forced_path(kernel=kernel, warps=warps, occupancy=occupancy):
            run_case(xh, wh, rh, y, z, "token", "float8_e4m3fn", {}, normalized=False)


# ------------------------------------------------------------------ both kernels, both team rules
#: norm._forced_path settings that the tests below run each case under: the block-synchronized
#: kernel with either team rule, and the lead kernel with the fill rule, its weight staged in shared
#: memory or prefetched; then both kernels at the 32-register bound (occupancy 2).
PATHS = [
    {"kernel": "block", "teams": "few", "weight": "prefetch"},
    {"kernel": "block", "teams": "fill", "weight": "prefetch"},
    {"kernel": "lead", "teams": "fill", "weight": "async"},
    {"kernel": "lead", "teams": "fill", "weight": "prefetch"},
    {"kernel": "block", "teams": "fill", "weight": "prefetch", "occupancy": 2},
    {"kernel": "lead", "teams": "fill", "weight": "async", "occupancy": 2},
]
PATH_ROWS = (1, 3, 16, 127, 128, 129)
#: a unit, an odd size (the element path), one unit past 512 and 2048, the model sizes, one unit
#: past 8192 (16-bit types), the longest row of a 16-bit type
PATH_H = (8, 100, 520, 2056, 4096, 5120, 8200, 16384)


def run_paths(xh, wh, rh, y, z, cases, paths=PATHS):
    """Each case on each path into poisoned buffers, the reference computed once a case."""
    for scheme, fmt, kw in cases:
        want = expected(scheme, fmt, kw, y)
        for path in paths:
            try:
                with norm._forced_path(**path):
                    run_case(xh, wh, rh, y, z, scheme, fmt, kw, out=True, want=want)
            except AssertionError as e:
                raise AssertionError(f"{path} {scheme} {fmt} {kw}: {e}") from e


def _cases_for(H, seed, n=2):
    ok = [c for c in CASES if _case_ok(H, c[0], c[2])]
    return [ok[(seed + k * 7) % len(ok)] for k in range(n)]


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
@pytest.mark.parametrize("H", PATH_H)
@pytest.mark.parametrize("M", PATH_ROWS)
def test_paths_few_rows(M, H, in_dtype, residual):
    """Both kernels and team rules at the few-rows sizes where the rules differ, every dtype, two
    schemes a shape (all of them across the shapes), bit for bit with the reference."""
    if H > norm._row_max(np.dtype(in_dtype).itemsize, norm._WARPS[-1]):
        pytest.skip("longer than the fused kernel holds")
    seed = _seed(M, H, in_dtype, residual)
    xh, wh, rh, y, z = _inputs((M, H), in_dtype, residual, seed)
    run_paths(xh, wh, rh, y, z, _cases_for(H, seed))


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
@pytest.mark.parametrize("H", [64, 520, 2048])
def test_paths_many_rows(H, in_dtype, residual):
    """4096 rows: the narrow teams of both rules, several rows to a block below 256 threads."""
    seed = _seed(4096, H, in_dtype, residual)
    xh, wh, rh, y, z = _inputs((4096, H), in_dtype, residual, seed)
    run_paths(xh, wh, rh, y, z, _cases_for(H, seed))


@pytest.mark.parametrize("occupancy", norm._OCCUPANCY)
@pytest.mark.parametrize("weight", ["async", "prefetch"])
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
@pytest.mark.parametrize("warps", norm._WARPS)
def test_lead_every_team(warps, in_dtype, weight, occupancy):
    """The lead kernel on each team size (forced) at the longest row it holds, half of it plus a
    unit (idle lanes, a slot left empty) and one unit, 129 rows (several rows to a block, a last
    block part full), for the schemes it takes: per token (a team exchange after the norm; FP8 and
    INT8, a bound on the scale) and static per tensor (a given and a device scale)."""
    longest = norm._row_max(np.dtype(in_dtype).itemsize, warps)
    for H in sorted({8, longest // 2 + 16, longest}):
        seed = _seed(warps, in_dtype, H)
        xh, wh, rh, y, z = _inputs((129, H), in_dtype, True, seed)
        cases = [CASES[0], CASES[2], CASES[4], CASES[11], CASES[12]]
        paths = [{"kernel": "lead", "warps": warps, "weight": weight, "occupancy": occupancy}]
        run_paths(xh, wh, rh, y, z, [c for c in cases if _case_ok(H, c[0], c[2])], paths)


@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
@pytest.mark.parametrize("H", [1, 7, 100, 4095])
def test_odd_h_on_the_element_path(H, in_dtype):
    xh, wh, rh, y, z = _inputs((4, H), in_dtype, True, _seed(H, in_dtype))
    for scheme, fmt, kw in (CASES[0], CASES[2], CASES[11]):
        run_case(xh, wh, rh, y, z, scheme, fmt, kw)


@pytest.mark.parametrize("occupancy", norm._OCCUPANCY)
@pytest.mark.parametrize("scheme,fmt,kw", [CASES[i] for i in (0, 7, 11, 15, 16)], ids=_id)
def test_misaligned_and_strided_rows(scheme, fmt, kw, occupancy):
    base = heavy_tailed((2, 3, 257), 11, BF16)
    x = cupy.asarray(base)[:, :, 1:]  # rows start 2 bytes past 16-byte alignment, row stride 257
    xh = base[:, :, 1:]
    wh = _weight(256, BF16, 3)
    rh = heavy_tailed(xh.shape, 12, BF16)
    y, z = ref.rms_norm(xh, wh, residual=rh)
    with norm._forced_path(occupancy=occupancy):
        run_case(xh, wh, rh, y, z, scheme, fmt, kw, x=x)
        # strided rows (every other row of a larger array): 16-byte aligned, the vector path
        big = heavy_tailed((8, 256), 13, BF16)
        y, _ = ref.rms_norm(big[::2], wh)
        run_case(big[::2], wh, None, y, None, scheme, fmt, kw, x=cupy.asarray(big)[::2])


def _special_rows(dtype, H):
    info = ml_dtypes.finfo(dtype) if dtype == BF16 else np.finfo(dtype)
    tiny = float(info.smallest_subnormal)
    big = float(info.max)
    rows = [
        np.zeros(H),
        np.full(H, tiny),
        np.where(np.arange(H) % 3 == 0, tiny, -2 * tiny),
        np.full(H, big),
        np.where(np.arange(H) % 5 == 0, -big, 1.0),
        np.where(np.arange(H) == 7, np.inf, 0.5),
        np.where(np.arange(H) == 9, np.nan, -0.25),
        np.where(np.arange(H) % 2 == 0, 448.0, -1e-3),
    ]
    with np.errstate(over="ignore"):
        return np.stack(rows).astype(np.float32).astype(dtype)


@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
@pytest.mark.parametrize("scheme,fmt,kw", CASES, ids=_id)
def test_special_values(scheme, fmt, kw, in_dtype):
    H = 256
    xh = _special_rows(in_dtype, H)
    wh = _weight(H, in_dtype, 5)
    wh[3], wh[4], wh[5] = 0, np.inf, np.nan  # a weight column of each special value
    for rh in (None, _special_rows(in_dtype, H)[::-1].copy()):
        with np.errstate(all="ignore"):
            y, z = ref.rms_norm(xh, wh, residual=rh)
        run_case(xh, wh, rh, y, z, scheme, fmt, kw, normalized=True)


def test_eps_zero_and_large():
    xh = _special_rows(BF16, 64)
    wh = _weight(64, BF16, 9)
    for eps in (0.0, 1e-5, 10.0):
        with np.errstate(all="ignore"):
            y, _ = ref.rms_norm(xh, wh, eps=eps)
        q, yd = cq.rms_norm_quantize(cupy.asarray(xh), cupy.asarray(wh), eps=eps, return_normalized=True)
        assert_bits_equal(yd, y, f"y at eps={eps}")
        eq, es = ref.quantize_groupwise(y, "float8_e4m3fn", group_size=None)
        assert_bits_equal(q.data, eq, f"q at eps={eps}")


@pytest.mark.parametrize("scheme,fmt,kw", CASES, ids=_id)
def test_caller_buffers(scheme, fmt, kw):
    xh, wh, rh, y, z = _inputs((6, 1024), BF16, True, 21)
    q = run_case(xh, wh, rh, y, z, scheme, fmt, kw, out=True)
    # scale_out: a poisoned buffer of the returned scale's layout is filled the same way
    s = poisoned(q.scale.shape, q.scale.dtype) if scheme not in ("token", "group") else None
    if s is None:
        gkw = _host_kw(kw)
        s = cq.empty_scales(
            xh.shape, None if scheme == "token" else gkw.get("group_size", 128), gkw.get("scale_layout", "row"),
            gkw.get("scale_dtype", "float32"),
        )  # fmt: skip
        cupy.cuda.runtime.memset(s.data.ptr, 0xFF, s.data.mem.size - (s.data.ptr - s.data.mem.ptr))
    q2 = cq.rms_norm_quantize(
        cupy.asarray(xh), cupy.asarray(wh), scheme=scheme, dtype=fmt, scale_out=s, residual=cupy.asarray(rh),
        **_device_kw(kw),
    )  # fmt: skip
    assert q2.scale is s
    assert_bits_equal(q2.data, q.data, "q with scale_out")
    assert_bits_equal(q2.scale, q.scale, "scale_out")


@pytest.mark.parametrize("scheme,fmt,kw", [CASES[i] for i in (0, 7, 11, 13, 16)], ids=_id)
def test_dequantizes(scheme, fmt, kw):
    xh, wh, _, y, _ = _inputs((5, 512), BF16, False, 31)
    q = cq.rms_norm_quantize(cupy.asarray(xh), cupy.asarray(wh), scheme=scheme, dtype=fmt, **_device_kw(kw))
    own = _own_quantizer(cupy.asarray(y), scheme, fmt, _device_kw(kw))
    assert_bits_equal(q.dequantize(), own.dequantize(), "dequantized")


def test_cuda_graph_replay_updates_the_residual():
    xh, wh, rh, _, _ = _inputs((4, 2048), BF16, True, 41)
    x, w, r = cupy.asarray(xh), cupy.asarray(wh), cupy.asarray(rh)
    qbuf = cupy.empty(x.shape, np.uint8)
    sbuf = cq.empty_scales(x.shape, 128)
    cq.rms_norm_quantize(x, w, residual=cupy.zeros_like(r), scheme="group", out=qbuf, scale_out=sbuf)  # compile
    stream = side_stream()
    with stream:
        stream.begin_capture()
        cq.rms_norm_quantize(x, w, residual=r, scheme="group", out=qbuf, scale_out=sbuf)
        graph = stream.end_capture()
    expect_r = rh
    for _ in range(2):  # each replay adds x to the residual again
        with stream:
            qbuf.fill(0xFF)
            graph.launch(stream)
        stream.synchronize()
        y, expect_r = ref.rms_norm(xh, wh, residual=expect_r)
        eq, es = ref.quantize_groupwise(y, "float8_e4m3fn", group_size=128)
        assert_bits_equal(r, expect_r, "residual after replay")
        assert_bits_equal(qbuf, eq, "q after replay")
        assert_bits_equal(sbuf, es, "scales after replay")


def test_plans_are_memoized():
    """One plan per signature: a repeated call, and a device scale of the same shape (its value is
    read on the device, its address given at each call), reuse theirs."""
    x = cupy.asarray(heavy_tailed((3, 256), 1, BF16))
    w = cupy.asarray(_weight(256, BF16, 2))
    norm._PLANS.clear()
    cq.rms_norm_quantize(x, w)
    cq.rms_norm_quantize(x, w)
    assert len(norm._PLANS) == 1
    s1, s2 = cupy.ones(1, np.float32), cupy.full(1, 2.0, np.float32)
    q1 = cq.rms_norm_quantize(x, w, scheme="tensor", scale=s1)
    q2 = cq.rms_norm_quantize(x, w, scheme="tensor", scale=s2)
    assert len(norm._PLANS) == 2
    assert float(q1.scale[0]) == 1.0 and float(q2.scale[0]) == 2.0, "each call's own scale"


def _untouched(a, before):
    assert_bits_equal(a, before, "a buffer after a refused call")


def test_validation_errors():
    x = cupy.asarray(heavy_tailed((4, 256), 1, BF16))
    w = cupy.asarray(_weight(256, BF16, 2))
    r = cupy.asarray(heavy_tailed((4, 256), 3, BF16))
    r_before = r.copy()
    bad = [
        (ValueError, "scheme", lambda: cq.rms_norm_quantize(x, w, scheme="block")),
        (ValueError, "group_size", lambda: cq.rms_norm_quantize(x, w, group_size=128)),
        (ValueError, "group_size", lambda: cq.rms_norm_quantize(x, w, scheme="group", group_size=96)),
        (ValueError, "scale_ub", lambda: cq.rms_norm_quantize(x, w, scheme="mx", scale_ub=1.0)),
        (ValueError, "scale=", lambda: cq.rms_norm_quantize(x, w, scheme="tensor")),
        (ValueError, "scale", lambda: cq.rms_norm_quantize(x, w, scheme="tensor", scale=-1.0)),
        (ValueError, "dtype", lambda: cq.rms_norm_quantize(x, w, scheme="tensor", dtype="int8", scale=1.0)),
        (ValueError, "global_scale", lambda: cq.rms_norm_quantize(x, w, scheme="nvfp4")),
        (ValueError, "dtype", lambda: cq.rms_norm_quantize(x, w, scheme="nvfp4", dtype="float8_e4m3fn")),
        (ValueError, "scale_layout", lambda: cq.rms_norm_quantize(x, w, scheme="mx", scale_layout="row")),
        (ValueError, "scale_layout", lambda: cq.rms_norm_quantize(x, w, scale_layout="swizzled")),
        (
            ValueError,
            "scale_layout",
            lambda: cq.rms_norm_quantize(x, w, scheme="tensor", scale=1.0, scale_layout="row"),
        ),
        (ValueError, "scale_layout", lambda: cq.rms_norm_quantize(x, w, scale_layout="scalar")),
        (ValueError, "weight", lambda: cq.rms_norm_quantize(x, w[:128])),
        (TypeError, "weight", lambda: cq.rms_norm_quantize(x, w.astype(np.float32))),
        (TypeError, "weight", lambda: cq.rms_norm_quantize(x, w.get())),
        (ValueError, "residual", lambda: cq.rms_norm_quantize(x, w, residual=r[:2])),
        (ValueError, "residual", lambda: cq.rms_norm_quantize(x, w, residual=x)),
        (TypeError, "x", lambda: cq.rms_norm_quantize(x.get(), w)),
        (TypeError, "x", lambda: cq.rms_norm_quantize(x.astype(np.int32), w)),
        (ValueError, "eps", lambda: cq.rms_norm_quantize(x, w, eps=-1.0, residual=r)),
        (TypeError, "eps", lambda: cq.rms_norm_quantize(x, w, eps="1e-6", residual=r)),
        (ValueError, "multiple of 32", lambda: cq.rms_norm_quantize(x[:, :48], w[:48], scheme="mx")),
        (ValueError, "longer", lambda: cq.rms_norm_quantize(cupy.zeros((1, 16392), BF16), cupy.zeros(16392, BF16))),
        (ValueError, "out", lambda: cq.rms_norm_quantize(x, w, out=cupy.empty((4, 255), np.uint8), residual=r)),
        (ValueError, "out", lambda: cq.rms_norm_quantize(x, w, out=r.view(np.uint8)[:, :256], residual=r)),
        (ValueError, "contiguous", lambda: cq.rms_norm_quantize(x[:, ::2], w[::2])),
    ]
    for exc, words, call in bad:
        with pytest.raises(exc, match=words):
            call()
        _untouched(r, r_before)


def test_empty_rows():
    for scheme, fmt, kw in CASES:
        x = cupy.zeros((0, 256), BF16)
        q = cq.rms_norm_quantize(x, cupy.ones(256, BF16), scheme=scheme, dtype=fmt, **_device_kw(kw))
        assert q.data.shape[0] == 0
        if scheme == "tensor":
            assert_bits_equal(q.scale, np.array([np.float32(_host_kw(kw)["scale"])]), "tensor scale")
        if scheme == "nvfp4":
            assert_bits_equal(q.global_scale, np.array([np.float32(_host_kw(kw)["global_scale"])]), "S_enc")


# ------------------------------------------------------------------ the packed 16-bit steps
_ADD2_SWEEP = r"""
// bad[k]: of the 2^32 pairs (a, b) of T's bits (k = 0 bf16, 1 f16), those where add2_rn's low or
// high half differs from the float32 sum rounded to T by pack2_rn.
template <typename T> __device__ float bits_to_float(unsigned h);
template <> __device__ float bits_to_float<__nv_bfloat16>(unsigned h) { return __uint_as_float(h << 16); }
template <> __device__ float bits_to_float<__half>(unsigned h) { return __half2float(__ushort_as_half((unsigned short)h)); }
template <typename T> __device__ void add2_sweep(unsigned long long* bad) {
    unsigned long long n = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < (1ull << 32);
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned a = (unsigned)i & 0xffffu, b = (unsigned)(i >> 16);
        const float fa = bits_to_float<T>(a), fb = bits_to_float<T>(b);
        const unsigned want = pack2_rn<T>(add_rn(fa, fb), add_rn(fb, fa));
        n += add2_rn<T>(a | (b << 16), b | (a << 16)) != want;
    }
    atomicAdd(bad, n);
}
extern "C" __global__ void add2_sweep_bf16(unsigned long long* bad) { add2_sweep<__nv_bfloat16>(bad); }
extern "C" __global__ void add2_sweep_f16(unsigned long long* bad) { add2_sweep<__half>(bad + 1); }
"""


def test_add2_rn_matches_float_sum():
    """rms_norm.cu's add2_rn (the residual add of two 16-bit values by one packed instruction) equals
    the float32 sum rounded to the type by pack2_rn, bit for bit, for all 2^32 pairs of bf16 and of
    f16 values (NaNs, infinities, zeros of both signs and subnormals included)."""
    from cupyquant import _jit

    mod = cupy.RawModule(code=_jit.source("rms_norm") + _ADD2_SWEEP, options=_jit.options())
    bad = cupy.zeros(2, np.uint64)
    for name in ("add2_sweep_bf16", "add2_sweep_f16"):
        mod.get_function(name)((4096,), (256,), (bad,))
    assert [int(b) for b in bad.get()] == [0, 0], f"add2_rn differs from the float32 sum (bf16, f16): {bad.get()}"


# ------------------------------------------------------------------ programmatic dependent launch
@pytest.mark.parametrize("occupancy", norm._OCCUPANCY)
@pytest.mark.parametrize(
    "scheme, kernel", [("token", "lead"), ("token", "block"), ("group", "block"), ("nvfp4", "block")]
)
def test_pdl_the_kernel_waits_for_the_kernel_before(scheme, kernel, occupancy):
    """With PDL (compute capability 9.0+), rounds of new inputs (x, the residual, the weight, and
    NVFP4's device global scale), each written by a kernel that lets the fused kernel start at once
    (tests/_pdl.py): the quantized bytes and scales, the normalized output, and the residual written
    back are bit for bit the reference of each round, in a stream and replayed from a CUDA graph (the
    weight, read after the norm and prefetched before it, among the inputs rewritten)."""
    require_arch("pdl")
    R, shape = 4, (37, 2048)
    rounds = [_inputs(shape, BF16, True, 300 + 7 * r) for r in range(R)]
    gss = [np.array([2688.0 / (3 + r)], np.float32) for r in range(R)]
    x, w, res, gs = (
        cupy.empty(shape, BF16),
        cupy.empty(shape[-1:], BF16),
        cupy.empty(shape, BF16),
        cupy.empty((1,), np.float32),
    )
    inputs = [x, w, res] + ([gs] if scheme == "nvfp4" else [])
    sources = [
        [cupy.asarray(xh), cupy.asarray(wh), cupy.asarray(rh)] + ([cupy.asarray(g)] if scheme == "nvfp4" else [])
        for (xh, wh, rh, _, _), g in zip(rounds, gss)
    ]
    names = ["q", "scales", "y", "residual"] + (["global_scale"] if scheme == "nvfp4" else [])
    kw = {"token": {}, "group": {"group_size": 128}, "nvfp4": {"global_scale": gs, "scale_layout": "dense"}}[scheme]
    q = cupy.empty(shape if scheme != "nvfp4" else (shape[0], shape[1] // 2), np.uint8)

    def step():
        qt, y = cq.rms_norm_quantize(x, w, residual=res, scheme=scheme, return_normalized=True, out=q, **kw)
        return [qt.data, qt.scale.reshape(-1), y, res] + ([qt.global_scale] if scheme == "nvfp4" else [])

    def want(r):
        _, _, _, y, z = rounds[r]
        if scheme != "nvfp4":
            eq, es = ref.quantize_groupwise(y, "float8_e4m3fn", group_size=128 if scheme == "group" else None)
            return [eq, es.reshape(-1), y, z]
        eq, es, eg = ref.quantize_nvfp4(y, global_scale=gss[r][0])
        return [eq, es.reshape(-1), y, z, np.array([eg], np.float32)]

    with norm._forced_path(kernel=kernel, occupancy=occupancy):
        check_rounds(
            step, inputs, sources, lambda r, got, where: assert_rounds_equal(got, want(r), names, f"{where} round {r}")
        )
