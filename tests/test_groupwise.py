"""Per-token / per-group FP8 and INT8 and the fused SiLU*Mul quantizer on the GPU, byte for byte
against cupyquant.reference (bytes, logical scales, and the raw scale buffer with its padding)."""

from __future__ import annotations

import itertools
import zlib

import ml_dtypes
import numpy as np
import pytest
from _pdl import assert_rounds_equal, check_rounds
from conftest import assert_bits_equal, heavy_tailed, moved_copy, poisoned, raw_scale_words, require_arch, side_stream

import cupyquant as cq
from cupyquant import _flat, _group_plan, _launch, groupwise
from cupyquant import reference as ref

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")

IN_DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
FORMATS = ["float8_e4m3fn", "float8_e5m2", "int8"]
GROUPS = [32, 64, 128, 256, None]
E8M0 = "float8_e8m0fnu"


def _id(v):
    return np.dtype(v).name if not isinstance(v, (str, tuple, type(None), int)) else str(v)


def _seed(*parts):
    return zlib.crc32(repr(parts).encode())


def check(q, eq, es, layout):
    """Bytes, logical scales and the raw layout (padding zero) of q against the reference."""
    assert_bits_equal(q.data, eq, "q")
    host = q.to_host()
    if es.dtype == np.uint8:  # UE8M0 bytes
        assert_bits_equal(host["scale"].view(np.uint8), es, "ue8m0 scales")
    else:
        assert_bits_equal(host["scale"], es, "scales")
    assert_bits_equal(raw_scale_words(q), ref.scale_buffer(es, q.shape, layout), f"{layout} scale buffer")


def run_groupwise(xh, fmt, group_size, layout="row", pow2=False, scale_dtype="float32", scale_ub=None, **kw):
    x = cupy.asarray(xh)
    out = poisoned(xh.shape, np.int8 if fmt == "int8" else np.uint8)
    q = cq.quantize_groupwise(
        x,
        fmt,
        group_size=group_size,
        scale_layout=layout,
        scale_pow2=pow2,
        scale_dtype=scale_dtype,
        scale_ub=scale_ub,
        out=out,
        **kw,
    )
    assert q.data is out
    ub_host = None if scale_ub is None else (scale_ub.get() if isinstance(scale_ub, cupy.ndarray) else scale_ub)
    eq, es = ref.quantize_groupwise(
        xh, fmt, group_size=group_size, scale_pow2=pow2, scale_dtype=scale_dtype, scale_ub=ub_host
    )
    check(q, eq, es, layout)
    return q, eq, es


def token_paths(monkeypatch, group_size):
    """Per token (``group_size`` None): each per-token kernel forced in turn (groupwise.TOKEN_PATH,
    "few" wherever the row fits); per group: the planner's path once."""
    for path in groupwise.TOKEN_PATHS if group_size is None else (None,):
        monkeypatch.setattr(groupwise, "TOKEN_PATH", path)
        yield path


@pytest.fixture(params=groupwise.TOKEN_PATHS)
def token_path(request, monkeypatch):
    """The per-token kernel forced for the whole test (groupwise.TOKEN_PATH)."""
    monkeypatch.setattr(groupwise, "TOKEN_PATH", request.param)
    return request.param


@pytest.fixture(params=groupwise.GROUP_COL_PATHS)
def col_path(request, monkeypatch):
    """The per-group quantizer's geometry for "col" scales forced for the whole test
    (groupwise.GROUP_COL_PATH; "row" scales take "wide" either way)."""
    monkeypatch.setattr(groupwise, "GROUP_COL_PATH", request.param)
    return request.param


@pytest.fixture(params=groupwise.SILU_PATHS)
def silu_path(request, monkeypatch):
    """The SiLU*Mul path forced for the whole test (groupwise.SILU_PATH)."""
    monkeypatch.setattr(groupwise, "SILU_PATH", request.param)
    return request.param


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("layout", ["row", "col"])
@pytest.mark.parametrize("group_size", GROUPS, ids=_id)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
def test_every_combination(in_dtype, fmt, group_size, layout, pow2, monkeypatch, col_path):
    for _ in token_paths(monkeypatch, group_size):
        for shape in [(1, 256), (37, 1024)]:
            xh = heavy_tailed(shape, _seed(shape, in_dtype, fmt, group_size, layout, pow2), in_dtype)
            run_groupwise(xh, fmt, group_size, layout, pow2)


@pytest.mark.parametrize("layout", ["row", "col"])
@pytest.mark.parametrize("group_size", GROUPS, ids=_id)
@pytest.mark.parametrize("fmt", FORMATS)
def test_ue8m0_packed_scales(fmt, group_size, layout, monkeypatch, col_path):
    # 3 and 5 groups per row leave unused bytes in the last packed word; 3-D exercises batches
    for _ in token_paths(monkeypatch, group_size):
        for shape in [(5, 384), (2, 3, 1280), (1, 128 * 9)]:
            if group_size and shape[-1] % group_size:
                continue
            xh = heavy_tailed(shape, _seed(shape, fmt, group_size, layout), ml_dtypes.bfloat16)
            q, _, _ = run_groupwise(xh, fmt, group_size, layout, scale_dtype=E8M0)
            assert q.scale.dtype == np.int32


@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
@pytest.mark.parametrize("shape", [(1, 128), (3, 16384), (129, 4096), (2, 5, 1024), (7, 3, 2, 256)], ids=_id)
def test_shapes(shape, in_dtype, col_path):
    xh = heavy_tailed(shape, _seed(shape, in_dtype), in_dtype)
    for fmt, g, layout in [("float8_e4m3fn", 128, "col"), ("int8", 64, "row"), ("float8_e5m2", None, "col")]:
        run_groupwise(xh, fmt, g, layout)


@pytest.mark.parametrize("K", [1, 7, 100, 4097, 16385])
@pytest.mark.parametrize("fmt", FORMATS)
def test_per_token_any_k(K, fmt, token_path):
    xh = heavy_tailed((5, K), _seed(K, fmt), np.float16)
    for layout, pow2 in [("row", False), ("col", True)]:
        run_groupwise(xh, fmt, None, layout, pow2)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
def test_per_token_every_team(in_dtype, fmt, token_path):
    # token_quantize_regs at every team size (warps per row), each at its longest row and at the
    # first row that needs the next team; 13 rows leave a block of the one- and two-warp teams part
    # empty; past the longest team, the two-pass kernel with 16-byte loads. Forced to "few", the
    # rows that fit token_quantize_few take it at 13 and 300 rows.
    item = np.dtype(in_dtype).itemsize
    longest = [_group_plan._token_row_max(item, w) for w in _group_plan._TOKEN_WARPS]
    for K in [8, 264] + longest + [k + 8 for k in longest]:
        for rows in (13, 300) if K <= 4096 else (2,):  # few rows (wide teams) and many
            xh = heavy_tailed((rows, K), _seed(K, rows, in_dtype, fmt, "team"), in_dtype)
            run_groupwise(xh, fmt, None, "row" if K % 16 else "col", K % 3 == 0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_per_token_empty_rows(fmt, token_path):
    # K = 0 per token: each row still gets one scale, that of an all-zero row (FP8 1 / (qmax * 512),
    # INT8 0), written over a poisoned buffer in every layout, padding included
    xh = np.zeros((5, 0), np.float16)
    for layout, sdt in [("row", "float32"), ("col", "float32"), ("row", E8M0), ("col", E8M0)]:
        s_out = cq.empty_scales(xh.shape, None, layout, sdt)
        s_out.data.memset_async(0xFF, s_out.data.mem.size)
        q, _, es = run_groupwise(xh, fmt, None, layout, scale_dtype=sdt, scale_out=s_out)
        assert q.scale is s_out and es.shape == (5, 1)
        assert cq.dequantize(q).shape == (5, 0)


# ------------------------------------------------------------------ per token, few rows (token_quantize_few)
# Rows of one and two units a thread (up to 8192 and 16384 elements), each at its first and last
# block size and odd K (single-element loads, zero past K).
FEW_KS = [1, 7, 9, 255, 256, 257, 2048, 4096, 4100, 7168, 8192, 8200, 16384]


def _poisoned_scales(shape, layout, scale_dtype="float32"):
    s_out = cq.empty_scales(shape, None, layout, scale_dtype)
    s_out.data.memset_async(0xFF, s_out.data.mem.size)
    return s_out


def _each_token_path(monkeypatch, xh, fmt, layout="row", pow2=False, scale_dtype="float32", **kw):
    """The per-token quantization of ``xh`` by token_quantize_few (at its planned units a thread,
    and forced to two), then by the other kernels, each into poisoned out= and scale_out=
    buffers and checked against the reference; the kernels' bytes and scale buffers are the same."""
    assert _group_plan._token_few(xh.shape[-1], 1, "few") is not None, "the row fits token_quantize_few"
    got = []
    for path, units in (("few", None), ("few", 2), ("regs", None)):
        monkeypatch.setattr(groupwise, "TOKEN_PATH", path)
        monkeypatch.setattr(groupwise, "TOKEN_FEW_UNITS", units)
        s_out = _poisoned_scales(xh.shape, layout, scale_dtype)
        q, _, _ = run_groupwise(xh, fmt, None, layout, pow2, scale_dtype, scale_out=s_out, **kw)
        assert q.scale is s_out
        got.append((path, units, q.data.get(), raw_scale_words(q)))
    for path, units, data, words in got[1:]:
        assert_bits_equal(data, got[0][2], f"q of {path} (units {units}) against few")
        assert_bits_equal(words, got[0][3], f"scale buffer of {path} (units {units}) against few")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
def test_per_token_few_rows(in_dtype, fmt, monkeypatch):
    for K in FEW_KS:
        for rows, layout in ((1, "row"), (5, "col")):
            xh = heavy_tailed((rows, K), _seed(K, rows, in_dtype, fmt, "few"), in_dtype)
            _each_token_path(monkeypatch, xh, fmt, layout, pow2=K % 2 == 1)


def test_per_token_planner_and_override(monkeypatch):
    """Unforced, per-token quantization takes token_quantize_few up to _TOKEN_FEW_KERNEL_ROWS rows
    and token_quantize_regs above; TOKEN_PATH and TOKEN_FEW_UNITS change the kernel of the same
    call signature between calls (they are part of the plan's key); a bad value raises ValueError
    naming the knob before anything is launched."""
    few_rows = _group_plan._TOKEN_FEW_KERNEL_ROWS
    x = cupy.asarray(heavy_tailed((few_rows, 4096), 5, ml_dtypes.bfloat16))
    many = cupy.asarray(heavy_tailed((few_rows + 1, 4096), 6, ml_dtypes.bfloat16))

    def launched(a):
        with _launch.recording() as rec:
            cq.quantize_groupwise(a, group_size=None)
        return [(r[0].name, r[2]) for r in rec if r[5] is not None]

    assert "token_quantize_few" in launched(x)[0][0]
    assert "token_quantize_regs" in launched(many)[0][0]
    for path, units, kernel, block in [
        ("regs", None, "token_quantize_regs", None),
        ("few", None, "token_quantize_few", (512, 1, 1)),
        ("few", 2, "token_quantize_few", (256, 1, 1)),
        (None, None, "token_quantize_few", (512, 1, 1)),
    ]:
        monkeypatch.setattr(groupwise, "TOKEN_PATH", path)
        monkeypatch.setattr(groupwise, "TOKEN_FEW_UNITS", units)
        [(name, got_block)] = launched(x)
        assert kernel in name and (block is None or got_block == block), (path, units, name, got_block)
        assert ("token_quantize_few" in launched(many)[0][0]) == (path == "few")
    monkeypatch.setattr(groupwise, "TOKEN_FEW_UNITS", None)
    for knob, bad in (("TOKEN_PATH", "rows"), ("TOKEN_FEW_UNITS", 3)):
        monkeypatch.setattr(groupwise, knob, bad)
        with pytest.raises(ValueError, match=knob):
            cq.quantize_groupwise(x, group_size=None)
        monkeypatch.setattr(groupwise, knob, None)


def _special_long_rows(in_dtype, K):
    """Rows of K elements whose specials sit in a late warp of a block, so that only the cross-warp
    max sees them: zeros, -0 with subnormals, NaN, +-inf, the type's max, one subnormal among
    zeros, the formats' limits."""
    info = np.finfo(np.float16) if np.dtype(in_dtype) == np.float16 else np.finfo(np.float32)
    tiny, small, big = float(info.smallest_subnormal), float(info.smallest_normal), float(info.max)
    late = K - 3
    rows = np.zeros((8, K), np.float32)
    rows[1, : K // 2], rows[1, K // 2 :] = -0.0, tiny
    rows[2] = np.linspace(-1, 1, K)
    rows[2, late] = np.nan
    rows[3] = np.linspace(-2, 2, K)
    rows[3, late], rows[3, 1] = np.inf, -np.inf
    rows[4] = np.linspace(-1, 1, K)
    rows[4, late] = -big
    rows[5, late] = tiny
    rows[6, :] = small * 0.5
    rows[6, late] = small
    rows[7, :4] = [448.0, 57344.0, 127.0, 0.5]
    rows[7, late] = -3.0
    with np.errstate(over="ignore"):
        return rows.astype(in_dtype)


@pytest.mark.parametrize("K", [4096, 4100, 8200], ids=_id)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
def test_per_token_few_rows_special_values(in_dtype, fmt, K, monkeypatch):
    xh = _special_long_rows(in_dtype, K)
    for layout, pow2, sdt in [("row", False, "float32"), ("col", True, "float32"), ("col", True, E8M0)]:
        _each_token_path(monkeypatch, xh, fmt, layout, pow2, sdt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_per_token_few_rows_scale_ub(fmt, monkeypatch):
    xh = heavy_tailed((3, 4096), _seed(fmt, "few ub"), ml_dtypes.bfloat16)
    amax = float(np.abs(xh.astype(np.float32)).max())
    for ub in (amax * 0.01, amax * 100):  # active, inactive
        _each_token_path(monkeypatch, xh, fmt, "row", scale_ub=ub)
        _each_token_path(monkeypatch, xh, fmt, "col", True, scale_ub=cupy.asarray([ub], np.float32))


def test_per_token_few_rows_strided_and_misaligned(monkeypatch):
    big = cupy.asarray(heavy_tailed((7, 4096 + 16), 9, ml_dtypes.bfloat16))
    views = (big[:, :4096], big[:, 8:4104], big[:, 1:4097], big[::2, :4096], big[:, 3:4100])
    for x in views:  # 16-byte aligned rows (vector loads), odd offsets and K (single elements)
        xh = x.get()
        for fmt in FORMATS:
            got = []
            for path in groupwise.TOKEN_PATHS:
                monkeypatch.setattr(groupwise, "TOKEN_PATH", path)
                q = cq.quantize_groupwise(x, fmt, group_size=None, scale_layout="col")
                eq, es = ref.quantize_groupwise(xh, fmt, group_size=None)
                check(q, eq, es, "col")
                got.append(q.data.get())
            assert_bits_equal(got[0], got[1], "few against regs")


def _special_rows(in_dtype):
    info = np.finfo(np.float16) if np.dtype(in_dtype) == np.float16 else np.finfo(np.float32)
    tiny, small, big = float(info.smallest_subnormal), float(info.smallest_normal), float(info.max)
    rows = [
        np.zeros(256),  # all-zero groups
        np.r_[np.full(128, -0.0), np.full(128, tiny)],  # -0 and subnormal-only groups
        np.r_[np.full(127, 1.0), [np.nan], np.full(128, small * 0.5)],  # NaN in a group
        np.r_[[np.inf], np.ones(127), [-np.inf], np.ones(127)],
        np.r_[[big, -big], np.linspace(-1, 1, 254)],
        np.r_[[448.0, 57344.0, 127.0, 0.5], np.full(252, 3.0)],
    ]
    with np.errstate(over="ignore"):
        return np.array(rows, np.float32).astype(in_dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
@pytest.mark.parametrize("group_size", [32, 128, None], ids=_id)
def test_special_values(in_dtype, fmt, group_size, monkeypatch, col_path):
    xh = _special_rows(in_dtype)
    for _ in token_paths(monkeypatch, group_size):
        for layout, pow2, sdt in [("row", False, "float32"), ("col", True, "float32"), ("col", True, E8M0)]:
            run_groupwise(xh, fmt, group_size, layout, pow2, scale_dtype=sdt)


@pytest.mark.parametrize("group_size", [64, None], ids=_id)
@pytest.mark.parametrize("fmt", FORMATS)
def test_scale_ub(fmt, group_size, monkeypatch, col_path):
    xh = heavy_tailed((9, 512), _seed(fmt, group_size, "ub"), ml_dtypes.bfloat16)
    amax = float(np.abs(xh.astype(np.float32)).max())
    for _ in token_paths(monkeypatch, group_size):
        for ub in (amax * 0.01, amax * 100):  # active, inactive
            run_groupwise(xh, fmt, group_size, "row", scale_ub=ub)
            run_groupwise(xh, fmt, group_size, "col", scale_ub=cupy.asarray([ub], np.float32))
    # the active bound really clamped something
    assert not np.array_equal(
        ref.quantize_groupwise(xh, fmt, group_size=group_size)[0],
        ref.quantize_groupwise(xh, fmt, group_size=group_size, scale_ub=amax * 0.01)[0],
    )


def test_col_layout_strides_and_offsets(col_path):
    B, M, K, G = 2, 5, 768, 128
    xh = heavy_tailed((B, M, K), 3, np.float32)
    q = cq.quantize_groupwise(cupy.asarray(xh), group_size=G, scale_layout="col")
    NG, M_pad = K // G, 8
    assert q.scale.shape == (B, M, NG)
    assert q.scale.strides == (NG * M_pad * 4, 4, M_pad * 4)
    assert q.scale.data.ptr % 16 == 0
    words = raw_scale_words(q).view(np.float32)
    _, es = ref.quantize_groupwise(xh, group_size=G)
    for b, m, g in itertools.product(range(B), range(M), range(NG)):
        assert words[b * NG * M_pad + g * M_pad + m] == es[b, m, g]
    for b, m, g in itertools.product(range(B), range(M, M_pad), range(NG)):
        assert words.view(np.uint32)[b * NG * M_pad + g * M_pad + m] == 0  # padding rows are zero


def test_packed_ue8m0_byte_positions(col_path):
    M, K, G = 3, 6 * 128, 128  # 6 groups: words hold groups 0-3 and 4-5 (+ two zero bytes)
    xh = heavy_tailed((M, K), 4, ml_dtypes.bfloat16)
    q = cq.quantize_groupwise(cupy.asarray(xh), group_size=G, scale_layout="col", scale_dtype=E8M0)
    _, e = ref.quantize_groupwise(xh, group_size=G, scale_dtype=E8M0)
    raw = raw_scale_words(q).view(np.uint8)
    M_pad = 4
    for m, g in itertools.product(range(M), range(6)):
        assert raw[4 * ((g // 4) * M_pad + m) + g % 4] == e[m, g]
    for m in range(M):
        assert raw[4 * (1 * M_pad + m) + 2] == 0 and raw[4 * (1 * M_pad + m) + 3] == 0


@pytest.mark.parametrize("layout", ["row", "col"])
@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
def test_ue8m0_words_of_whole_warps(group_size, layout, col_path):
    """Rows of whole warps (K a multiple of 512: blockDim.x a multiple of 32) store their UE8M0
    scales a packed word at a time (groups of up to 128: store_packed_scales_warp), the "col"
    padding rows zeroed by the word's other lanes; group 256 keeps store_scale. Over poisoned
    scale buffers: one row (three padding rows), three, batches of three, and blocks of several rows."""
    for shape in [(1, 4096), (3, 2048), (2, 3, 1024), (6, 512), (2, 1, 512)]:
        xh = heavy_tailed(shape, _seed(shape, group_size, layout, "warp words"), ml_dtypes.bfloat16)
        s_out = cq.empty_scales(shape, group_size, layout, E8M0)
        s_out.data.memset_async(0xFF, s_out.data.mem.size)
        q, _, _ = run_groupwise(xh, "float8_e4m3fn", group_size, layout, scale_dtype=E8M0, scale_out=s_out)
        assert q.scale is s_out


def test_strided_and_misaligned_rows(monkeypatch, col_path):
    big = cupy.asarray(heavy_tailed((33, 1024 + 16), 8, ml_dtypes.bfloat16))
    for x in (big[:, :1024], big[:, 8:1032], big[:, 1:1025], big[::2, :512]):  # vector and scalar paths
        xh = x.get()
        for g in (128, None):
            for _ in token_paths(monkeypatch, g):
                q = cq.quantize_groupwise(x, group_size=g, scale_layout="col")
                eq, es = ref.quantize_groupwise(xh, group_size=g)
                check(q, eq, es, "col")


def test_out_and_scale_out_buffers(col_path):
    xh = heavy_tailed((6, 512), 12, np.float16)
    x = cupy.asarray(xh)
    s_out = cq.empty_scales(x.shape, 128, "col", E8M0)
    out = poisoned(x.shape, np.uint8)
    q = cq.quantize_groupwise(x, group_size=128, scale_layout="col", scale_dtype=E8M0, out=out, scale_out=s_out)
    assert q.data is out and q.scale is s_out
    eq, es = ref.quantize_groupwise(xh, group_size=128, scale_dtype=E8M0)
    check(q, eq, es, "col")


def test_bad_scale_out_and_out_leave_buffers_untouched(col_path):
    x = cupy.asarray(heavy_tailed((6, 512), 13, np.float32))
    out = poisoned(x.shape, np.uint8)
    good = cq.empty_scales(x.shape, 128, "col")
    before_out, before_s = out.get(), cupy.ndarray((32,), np.uint32, memptr=good.data).get()
    bad = [
        dict(scale_out=cupy.zeros((6, 4), np.float32)),  # row strides where col is asked for
        dict(scale_out=cq.empty_scales(x.shape, 64, "col")),
        dict(group_size=96),
        dict(group_size=48),
        dict(scale_layout="diag"),
        dict(scale_dtype="float16"),
        dict(dtype="float4_e2m1fn"),
        dict(scale_ub=-1.0),
        dict(scale_ub=cupy.ones(3, np.float32)),
    ]
    for kw in bad:
        args = dict(group_size=128, scale_layout="col", out=out, scale_out=good)
        args.update(kw)
        dtype = args.pop("dtype", "float8_e4m3fn")
        with pytest.raises((TypeError, ValueError)):
            cq.quantize_groupwise(x, dtype, **args)
        np.testing.assert_array_equal(out.get(), before_out)
        np.testing.assert_array_equal(cupy.ndarray((32,), np.uint32, memptr=good.data).get(), before_s)


def test_validation_messages():
    x = cupy.ones((4, 384), np.float32)
    with pytest.raises(ValueError, match="group_size=256 does not divide the last axis"):
        cq.quantize_groupwise(x, group_size=256)
    with pytest.raises(ValueError, match="must have a contiguous last axis"):
        cq.quantize_groupwise(cupy.ones((4, 768), np.float32)[:, ::2])
    with pytest.raises(ValueError, match="leading axes must collapse"):
        cq.quantize_groupwise(cupy.ones((4, 6, 128), np.float32)[:, :3])
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16"):
        cq.quantize_groupwise(cupy.ones((4, 128), np.int8))
    with pytest.raises(ValueError, match="last axis must be even"):
        cq.silu_mul_quantize(cupy.ones((4, 257), np.float32))
    with pytest.raises(ValueError, match="group_size=128 does not divide"):
        cq.silu_mul_quantize(cupy.ones((4, 2 * 192), np.float32), group_size=128)


# ------------------------------------------------------------------ fused SiLU * Mul


def _ulp_distance(a, b):
    ai = a.view(np.int32).astype(np.int64)
    bi = b.view(np.int32).astype(np.int64)
    ai = np.where(ai < 0, -(ai & 0x7FFFFFFF), ai)
    bi = np.where(bi < 0, -(bi & 0x7FFFFFFF), bi)
    return np.abs(ai - bi)


def check_intermediate(xh, r, e):
    """The device intermediate against NumPy. Only CUDA's expf is inexact: (a) e = expf(-gate) is
    within 2 ulp of the correctly rounded exp (CUDA's documented maximum error for expf); (b) every
    later step is IEEE float32, so r recomputed on the host from the device's e matches bit for bit.
    (End to end, r itself may differ from a host r by a few ulp: the expf error passes through four
    roundings; 4 ulp was seen.)"""
    xf = xh.astype(np.float32)
    H = xf.shape[-1] // 2
    gate, up = xf[..., :H], xf[..., H:]
    with np.errstate(over="ignore"):
        e_np = np.exp(-gate.astype(np.float64)).astype(np.float32)
    # CuPy's forced -ftz=true flushes expf results below FLT_MIN to zero; 1 + e rounds to 1 either
    # way, so r is unaffected (and checked bit for bit below). Compare e where it is normal.
    finite = np.isfinite(e_np) & np.isfinite(e) & (e_np >= np.finfo(np.float32).smallest_normal)
    dist = _ulp_distance(e[finite], e_np[finite])
    assert dist.size == 0 or dist.max() <= 2, f"expf off by {dist.max()} ulp"
    assert_bits_equal(np.isfinite(e), np.isfinite(e_np), "expf overflow pattern")
    r_host = ref.silu_mul_from_exp(gate, up, e)
    both_nan = np.isnan(r) & np.isnan(r_host)  # NaN payloads differ (CUDA's 0x7fffffff); r quantizes the same
    assert_bits_equal(np.where(both_nan, 0, r), np.where(both_nan, 0, r_host), "r from the device's expf")


@pytest.mark.parametrize("layout", ["row", "col"])
@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
def test_silu_mul_quantize(in_dtype, fmt, group_size, layout, silu_path):
    shape = (11, 2 * 1024)
    xh = (heavy_tailed(shape, _seed(in_dtype, fmt, group_size, layout), np.float32) * 0.3).astype(in_dtype)
    x = cupy.asarray(xh)
    out = poisoned((11, 1024), np.int8 if fmt == "int8" else np.uint8)
    q = cq.silu_mul_quantize(x, fmt, group_size=group_size, scale_layout=layout, out=out)
    r, e = (a.get() for a in groupwise._silu_mul_intermediate(x))
    check_intermediate(xh, r, e)
    # (c) the fused bytes and scales are exactly the reference quantization of that intermediate
    eq, es = ref.quantize_silu_intermediate(r, fmt, group_size=group_size)
    check(q, eq, es, layout)
    assert q.shape == (11, 1024) and q.dtype == np.dtype(in_dtype)


@pytest.mark.parametrize("fmt", FORMATS)
def test_silu_mul_scale_ub_and_specials(fmt, silu_path):
    """Specials, and gates whose 1 + expf(-gate) leaves rcp.rn's fast path (>= 2^126, inf, NaN: the
    batched path's exact fallback for the whole 16 elements of a thread) next to elements that do
    not, against the reference quantization of the device's own intermediate."""
    H = 256
    rng = np.random.default_rng(5)
    xh = rng.standard_normal((8, 2 * H)).astype(np.float32) * 4
    xh[1, :H] = 0  # silu(0) = 0: an all-zero group, the minimum scale
    xh[2, 5] = 100.0  # a large gate
    xh[3, :3] = [-100.0, np.inf, -np.inf]
    xh[4, H + 7] = np.nan
    xh[5, :H] = 1e-42  # subnormal gates
    xh[6, 17] = np.nan  # a NaN gate: 1 + e is NaN
    xh[6, 40] = -87.4  # 1 + expf(87.4) just past 2^126
    xh[6, 41] = -87.3  # and just below
    xh[7, 16:32] = np.linspace(-90.0, -85.0, 16)  # one thread's 16 across the boundary
    x = cupy.asarray(xh)
    r, e = (a.get() for a in groupwise._silu_mul_intermediate(x))
    check_intermediate(xh, r, e)
    for ub in (None, 1e-3, cupy.asarray([1e-3], np.float32), 1e30):
        q = cq.silu_mul_quantize(x, fmt, group_size=64, scale_ub=ub, scale_layout="col")
        ub_h = ub.get() if isinstance(ub, cupy.ndarray) else ub
        eq, es = ref.quantize_silu_intermediate(r, fmt, group_size=64, scale_ub=ub_h)
        check(q, eq, es, "col")


def test_silu_mul_3d_and_odd_rows(silu_path):
    xh = heavy_tailed((3, 7, 2 * 384), 21, ml_dtypes.bfloat16)
    x = cupy.asarray(xh)
    q = cq.silu_mul_quantize(x, "float8_e4m3fn", group_size=128, scale_layout="col")
    r = groupwise._silu_mul_intermediate(x)[0].get()
    eq, es = ref.quantize_silu_intermediate(r, "float8_e4m3fn", group_size=128)
    check(q, eq, es, "col")
    assert q.scale.shape == (3, 7, 3)


@pytest.mark.parametrize("op", ["group", "silu"])
def test_group_quantizers_block_threads(op, monkeypatch):
    """group_quantize and silu_mul_quantize launch 128-thread blocks where 256-thread blocks would
    be fewer than the SMs (_group_plan.quantize_threads) and 256 beyond; the bytes are the
    reference's at both sizes and with the small grid's size forced to 256 (plans cleared: the
    size is not part of a plan's key)."""
    from cupyquant import _device, _plans

    sms = _device.sm_count(cupy.cuda.Device().id)
    K = 2048
    big = 2 * sms * 256 // (K // 16)  # rows at which 256-thread blocks number 2x the SMs
    fmt, BF16 = "float8_e4m3fn", ml_dtypes.bfloat16

    def run(x):
        with _launch.recording() as rec:
            q = cq.silu_mul_quantize(x, fmt) if op == "silu" else cq.quantize_groupwise(x, fmt, group_size=128)
        [block] = [r[2] for r in rec if r[5] is not None]
        return q, block[0] * block[1]

    for rows, threads in ((1, 128), (16, 128), (big, 256)):
        width = 2 * K if op == "silu" else K
        xh = heavy_tailed((rows, width), _seed("threads", op, rows), BF16)
        x = cupy.asarray(xh)
        monkeypatch.setattr(_group_plan, "_SMALL_GRID_THREADS", 128)
        _plans.clear()
        assert _group_plan.quantize_threads(rows, K // 16, sms) == threads
        q, launched = run(x)
        assert launched == threads, (rows, launched)
        if op == "silu":
            eq, es = ref.quantize_silu_intermediate(groupwise._silu_mul_intermediate(x)[0].get(), fmt, group_size=128)
        else:
            eq, es = ref.quantize_groupwise(xh, fmt, group_size=128)
        check(q, eq, es, "row")
        monkeypatch.setattr(_group_plan, "_SMALL_GRID_THREADS", 256)
        _plans.clear()
        q256, launched = run(x)
        assert launched == 256
        assert_bits_equal(q256.data, q.data, f"{op} {rows} rows, codes at 256 threads")
        assert_bits_equal(q256.scale, q.scale, f"{op} {rows} rows, scales at 256 threads")
    _plans.clear()


def test_group_col_path_planner_and_override(monkeypatch):
    """Unforced, "col" group scales take the planner's geometry ("tall" from
    GROUP_COL_TALL_FROM_ROWS rows); "tall" takes group_quantize_tall for "col" scales, float32 and packed UE8M0, with blockDim (G / 16, threads *
    16 / G) (threads: quantize_threads' 128 or 256), and leaves "row" scales on group_quantize. The
    knob is part of the plan's key (the same call signature changes kernel between calls), the bytes
    and the whole scale buffer are the reference's either way; a bad value raises ValueError naming
    the knob."""
    from cupyquant import _device

    sms = _device.sm_count(cupy.cuda.Device().id)

    def launched(x, **kw):
        with _launch.recording() as rec:
            q = cq.quantize_groupwise(x, group_size=128, **kw)
        [(name, block)] = [(r[0].name, r[2]) for r in rec if r[5] is not None]
        return q, name, block

    big = 2 * sms * 256 // (1024 // 16) + 3  # 256-thread blocks, twice the SMs, a partial block of rows
    for shape in [(3, 2048), (16, 2048), (129, 1024), (3, 37, 512), (big, 1024)]:  # few rows; batches; 256 threads
        xh = heavy_tailed(shape, _seed("col path", shape), ml_dtypes.bfloat16)
        x = cupy.asarray(xh)
        rows = int(np.prod(shape[:-1]))
        threads = _group_plan.quantize_threads(rows, shape[-1] // 16, sms)
        for sdt in ("float32", E8M0):
            eq, es = ref.quantize_groupwise(xh, group_size=128, scale_dtype=sdt)
            for path in (None, *groupwise.GROUP_COL_PATHS, None):
                monkeypatch.setattr(groupwise, "GROUP_COL_PATH", path)
                q, name, block = launched(x, scale_layout="col", scale_dtype=sdt)
                took = groupwise._group_col_path(rows, path)
                assert ("group_quantize_tall" in name) == (took == "tall"), (shape, path, name)
                if took == "tall":
                    assert tuple(block) == (8, threads // 8, 1), (shape, block)
                check(q, eq, es, "col")
                q, name, _ = launched(x, scale_layout="row", scale_dtype=sdt)
                assert "group_quantize_tall" not in name
                check(q, eq, es, "row")
    monkeypatch.setattr(groupwise, "GROUP_COL_PATH", "rows")
    with pytest.raises(ValueError, match="GROUP_COL_PATH"):
        cq.quantize_groupwise(x, group_size=128, scale_layout="col")


def test_silu_planner_and_override(monkeypatch):
    """Unforced, silu_mul_quantize launches the batched instantiation at every size; SILU_PATH
    changes the kernel of the same call signature between calls (part of the plan's key), the bytes
    identical; a bad value raises ValueError naming the knob."""
    from cupyquant import _dtypes, _jit

    BF16, fmt = ml_dtypes.bfloat16, "float8_e4m3fn"
    device = cupy.cuda.Device().id
    targs = (_dtypes.input_type(BF16).ctype, _dtypes.element_format(fmt).ctag, True)

    def want(batched):
        return _jit.kernel(device, groupwise.FAMILY, "silu_mul_quantize", *targs, batched)

    def run(x):
        with _launch.recording() as rec:
            q = cq.silu_mul_quantize(x, fmt)
        [k] = [r[0] for r in rec if r[5] is not None]
        return q, k

    for rows in (1, 1024, 1025):
        xh = heavy_tailed((rows, 2 * 1024), _seed("silu planner", rows), BF16)
        x = cupy.asarray(xh)
        eq, es = ref.quantize_silu_intermediate(groupwise._silu_mul_intermediate(x)[0].get(), fmt, group_size=128)
        assert _group_plan._silu_batched(rows)
        got = {}
        for path in (None, *groupwise.SILU_PATHS):
            monkeypatch.setattr(groupwise, "SILU_PATH", path)
            q, k = run(x)
            batched = path != "per_element"
            assert k is want(batched), (rows, path, k.name)
            check(q, eq, es, "row")
            got[path] = q
        assert_bits_equal(got["batched"].data, got["per_element"].data, f"{rows} rows, codes of the two paths")
    monkeypatch.setattr(groupwise, "SILU_PATH", "fast")
    with pytest.raises(ValueError, match="SILU_PATH"):
        cq.silu_mul_quantize(x, fmt)


_RCP_SWEEP = r"""
// counts[0]: inputs that take rcp.rn's fast path (rcp_fast_ok); counts[1]: of them, those whose
// rcp_fast differs from rcp_rn in any bit.
extern "C" __global__ void rcp_sweep(unsigned long long* counts) {
    unsigned long long fast = 0, bad = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < (1ull << 32);
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const float a = __uint_as_float((unsigned)i);
        if (cq::rcp_fast_ok(a)) {
            ++fast;
            bad += __float_as_uint(cq::rcp_fast(a)) != __float_as_uint(cq::rcp_rn(a));
        }
    }
    atomicAdd(counts, fast);
    atomicAdd(counts + 1, bad);
}
// rcp_rn_n<16> on the 16 values of thread t, and rcp_rn on each
extern "C" __global__ void rcp_n(const float* a, float* r16, float* r1, int n) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    cq::rcp_rn_n<16>(a + 16 * t, r16 + 16 * t);
    for (int i = 0; i < 16; ++i) r1[16 * t + i] = cq::rcp_rn(a[16 * t + i]);
}
"""


def test_rcp_fast_matches_rcp_rn_everywhere_it_is_taken():
    """rcp_fast (common.cuh: MUFU.RCP and one Newton step, ptxas's own rcp.rn.f32 fast path) equals
    rcp_rn bit for bit for every one of the 2^32 float32 inputs that rcp_fast_ok admits, which are
    exactly the normal values with |a| in [2^-126, 2^126); rcp_rn_n<16> equals rcp_rn on each value,
    with and without values outside that range among the 16."""
    from cupyquant import _jit

    src = "#include <cuda_fp8.h>\n" + (_jit.kernel_dir() / "common.cuh").read_text() + _RCP_SWEEP
    mod = cupy.RawModule(code=src, options=_jit.options())
    counts = cupy.zeros(2, np.uint64)
    mod.get_function("rcp_sweep")((4096,), (256,), (counts,))
    fast, bad = (int(c) for c in counts.get())
    assert fast == 2 * 252 * (1 << 23), fast  # both signs, exponent fields 1..252, every mantissa
    assert bad == 0, f"rcp_fast differs from rcp_rn on {bad} inputs"

    rng = np.random.default_rng(3)
    n = 4096
    a = (rng.standard_normal(16 * n) * np.exp(rng.uniform(-80, 80, 16 * n))).astype(np.float32)
    odd = np.array(
        [
            0.0,
            -0.0,
            1e-40,
            -1e-45,
            2.0**-126,
            2.0**126,
            -(2.0**126),
            np.nextafter(2.0**126, 0),
            3.4e38,
            np.inf,
            -np.inf,
            np.nan,
        ],
        np.float32,
    )
    a[: 16 * len(odd) : 16] = odd  # one out-of-range value among 15 ordinary ones ...
    a[16 * len(odd) : 32 * len(odd)] = np.repeat(odd, 16)[: 16 * len(odd)]  # ... and threads of them
    r16, r1 = cupy.empty(16 * n, np.float32), cupy.empty(16 * n, np.float32)
    mod.get_function("rcp_n")((n // 128,), (128,), (cupy.asarray(a), r16, r1, np.int32(n)))
    assert_bits_equal(r16.get(), r1.get(), "rcp_rn_n<16> against rcp_rn")


# ------------------------------------------------------------------ dequantization


@pytest.mark.parametrize("out_dtype", IN_DTYPES, ids=_id)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "group_size, layout, sdt",
    [
        (128, "row", "float32"),
        (32, "col", "float32"),
        (64, "col", E8M0),
        (256, "row", E8M0),
        (None, "row", "float32"),
        (None, "col", E8M0),
    ],
    ids=_id,
)
def test_dequantize(out_dtype, fmt, group_size, layout, sdt):
    for shape in [(3, 1024), (2, 3, 512)]:
        xh = heavy_tailed(shape, _seed(shape, fmt, group_size, layout, sdt), np.float32)
        q = cq.quantize_groupwise(cupy.asarray(xh), fmt, group_size=group_size, scale_layout=layout, scale_dtype=sdt)
        out = poisoned(shape, out_dtype)
        y = cq.dequantize(q, out_dtype, out=out)
        eq, es = ref.quantize_groupwise(xh, fmt, group_size=group_size, scale_dtype=sdt)
        assert_bits_equal(y, ref.dequantize_groupwise(eq, es, fmt, out_dtype, group_size=group_size), "y")


def test_dequantize_per_token_odd_k():
    xh = heavy_tailed((4, 4097), 30, np.float16)
    q = cq.quantize_groupwise(cupy.asarray(xh), "int8", group_size=None)
    eq, es = ref.quantize_groupwise(xh, "int8", group_size=None)
    assert_bits_equal(q.dequantize(), ref.dequantize_groupwise(eq, es, "int8", np.float16), "y")


# ------------------------------------------------------------------ dequantizer geometries
#: (group_size, scale layout, scale dtype, Ks): per token any K (below one piece of 8 codes, rows
#: that end inside a piece, whole pieces), per group the Ks the group sizes divide
GEOMETRY_CASES = [
    (None, "row", "float32", [1, 15, 16, 17, 1000, 4096, 4097, 7168]),
    (None, "col", E8M0, [16, 33, 7168]),
    (32, "col", "float32", [32, 96, 7168]),
    (128, "row", "float32", [128, 384, 4096, 7168]),
    (128, "col", E8M0, [128, 7168]),
    (256, "row", E8M0, [256, 768, 8192]),
]
GEOMETRY_ROWS = [1, 3, 37]


def dequantize_in(dq_geometry, monkeypatch, q, out_dtype, out=None):
    """Dequantize ``q`` with ``_flat.GEOMETRY`` forced to ``dq_geometry`` into ``out`` (a poisoned
    buffer when not given); checks that the kernel launched is the flat one exactly where the
    geometry is flat and q.data and out are aligned for it (_flat.flat_aligned)."""
    monkeypatch.setattr(_flat, "GEOMETRY", dq_geometry)
    out = poisoned(q.shape, out_dtype) if out is None else out
    with _launch.recording() as rec:
        y = cq.dequantize(q, out_dtype, out=out)
    names = [r[0].name for r in rec if r[5] is not None]
    flat = dq_geometry != "rows" and _flat.flat_aligned(q.data.data.ptr, out.data.ptr)
    assert len(names) == 1 and ("dequantize_flat" in names[0]) == flat, (dq_geometry, names)
    assert y is out
    return y


@pytest.mark.parametrize("dq_geometry", _flat.GEOMETRIES)
@pytest.mark.parametrize("out_dtype", IN_DTYPES, ids=_id)
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_geometries(dq_geometry, monkeypatch, fmt, out_dtype):
    """Each geometry of the dequantizer (_flat.GEOMETRY) forced in turn, into poisoned out= buffers,
    bit for bit the reference: per token and per group, float32 and UE8M0 scales in both layouts,
    partial blocks of rows, rows that end inside a piece of 8 codes, a last piece cut short."""
    for group_size, layout, sdt, ks in GEOMETRY_CASES:
        for K in ks:
            for rows in GEOMETRY_ROWS:
                shape = (rows, K)
                xh = heavy_tailed(shape, _seed("geometry", shape, fmt, group_size, layout, sdt), np.float32)
                xh.reshape(-1)[::97] = 0
                eq, es = ref.quantize_groupwise(xh, fmt, group_size=group_size, scale_dtype=sdt)
                q = cq.quantize_groupwise(
                    cupy.asarray(xh), fmt, group_size=group_size, scale_layout=layout, scale_dtype=sdt
                )
                y = dequantize_in(dq_geometry, monkeypatch, q, out_dtype)
                want = ref.dequantize_groupwise(eq, es, fmt, out_dtype, group_size=group_size)
                assert_bits_equal(y, want, f"{dq_geometry} {shape} {group_size} {layout} {sdt}")


@pytest.mark.parametrize("dq_geometry", _flat.GEOMETRIES)
def test_dequantize_misaligned_views(dq_geometry, monkeypatch):
    """Codes and out= views that do not start aligned (1, 4 and 8 bytes past; out= one element
    past): every geometry gives the reference's bytes, the flat ones through the row kernel where
    the codes are not 8-byte or out= not 16-byte aligned."""
    fmt, bf16 = "float8_e4m3fn", ml_dtypes.bfloat16
    for group_size, K in ((128, 1024), (None, 1000), (None, 4097)):
        shape = (37, K)
        xh = heavy_tailed(shape, _seed("misaligned", K, group_size), np.float32)
        eq, es = ref.quantize_groupwise(xh, fmt, group_size=group_size)
        want = ref.dequantize_groupwise(eq, es, fmt, bf16, group_size=group_size)
        q = cq.quantize_groupwise(cupy.asarray(xh), fmt, group_size=group_size)
        for q_offset in (0, 1, 4, 8):
            for y_offset in (0, 2):
                moved = cq.QuantizedTensor(moved_copy(q.data, q_offset), q.scale, q.scheme, q.shape, q.dtype)
                out = moved_copy(poisoned(shape, bf16), y_offset)
                y = dequantize_in(dq_geometry, monkeypatch, moved, bf16, out=out)
                assert_bits_equal(y, want, f"{dq_geometry} K={K} q+{q_offset} y+{y_offset}")


@pytest.mark.parametrize("dq_geometry", _flat.GEOMETRIES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_every_code_and_special_scales(dq_geometry, monkeypatch, fmt):
    """Every code byte (zeros, subnormals, the largest, inf/NaN codes) under scales that include 0,
    -0, inf, NaN, float32 subnormals and 2^100, per token and per group of 128, to each output
    type."""
    rows, K = 16, 4096
    codes = ((np.arange(K)[None, :] + 16 * np.arange(rows)[:, None]) % 256).astype(np.uint8)
    if fmt == "int8":
        codes = codes.view(np.int8)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, 2.0**-149, 2.0**100, -3.5], np.float32)
    rng = np.random.default_rng(_seed("special scales", fmt))
    for group_size in (None, 128):
        ng = 1 if group_size is None else K // group_size
        scales = (rng.standard_normal((rows, ng)) * 8).astype(np.float32)
        scales.reshape(-1)[: min(specials.size, scales.size)] = specials[: scales.size]
        q = cq.quantize_groupwise(cupy.zeros((rows, K), np.float32), fmt, group_size=group_size)
        assert q.scale.shape == (rows, ng) and q.scale.flags.c_contiguous
        q.data[...] = cupy.asarray(codes)
        q.scale[...] = cupy.asarray(scales)
        for out_dtype in IN_DTYPES:
            y = dequantize_in(dq_geometry, monkeypatch, q, out_dtype)
            want = ref.dequantize_groupwise(codes, scales, fmt, out_dtype, group_size=group_size)
            assert_bits_equal(y, want, f"{dq_geometry} {group_size} {np.dtype(out_dtype).name}")


def launched_flat(fn):
    """(result of ``fn()``, whether the one kernel it launched is a flat dequantizer)."""
    with _launch.recording() as rec:
        y = fn()
    names = [r[0].name for r in rec if r[5] is not None]
    assert len(names) == 1, names
    return y, "dequantize_flat" in names[0]


def test_dequantize_planner_picks_the_flat_kernel_for_large_aligned_tensors(monkeypatch):
    """With _flat.GEOMETRY unset, the planner's geometry is the one launched: "rows" for a few rows,
    _flat.PLANNED_FLAT from FLAT_FROM_BLOCKS_PER_SM blocks of it per SM, "rows" for an out= that is not
    16-byte aligned; the bytes are the row kernel's every time."""
    from cupyquant import _device

    sms = _device.sm_count(cupy.cuda.Device().id)
    per_block = 8 * _flat.FLAT_THREADS * _flat.PIECES[_flat.PLANNED_FLAT]
    big = -(-_flat.FLAT_FROM_BLOCKS_PER_SM * sms * per_block // 4096)  # rows of 4096 at the planner's line
    E4, BF16 = "float8_e4m3fn", ml_dtypes.bfloat16
    for rows, flat in ((16, False), (big, True)):
        monkeypatch.setattr(_flat, "GEOMETRY", None)
        shape = (rows, 4096)
        assert (_flat.planned_geometry(rows * 4096, True, sms) == _flat.PLANNED_FLAT) == flat
        q = cq.quantize_groupwise(cupy.asarray(heavy_tailed(shape, _seed("planner", rows), BF16)), E4, group_size=128)
        y, launched = launched_flat(lambda: cq.dequantize(q, BF16))
        assert launched == flat
        out = moved_copy(poisoned(shape, BF16), 2)
        y2, launched = launched_flat(lambda: cq.dequantize(q, BF16, out=out))
        assert not launched
        assert_bits_equal(y2, y, f"{rows} rows, misaligned out=")
        assert_bits_equal(y, dequantize_in("rows", monkeypatch, q, BF16), f"{rows} rows, planner's pick against rows")


@pytest.mark.parametrize("dq_geometry", ["flat16", "flat32"])
@pytest.mark.parametrize("group_size", [128, None])
def test_pdl_flat_dequantizer_waits_for_the_kernel_before(dq_geometry, monkeypatch, group_size):
    """With PDL (compute capability 9.0+), the flat dequantizer over rounds of new codes and scales,
    each written by a kernel that lets it start at once (tests/_pdl.py), into the same out= buffer:
    bit for bit the reference of each round, in a stream and replayed from a CUDA graph."""
    require_arch("pdl")
    monkeypatch.setattr(_flat, "GEOMETRY", dq_geometry)
    R, E4, BF16 = 4, "float8_e4m3fn", ml_dtypes.bfloat16
    shape = (37, 4096 + 512)  # a partial last block
    made = [
        cq.quantize_groupwise(
            cupy.asarray(heavy_tailed(shape, _seed("pdl flat", r), np.float32)), E4, group_size=group_size
        )
        for r in range(R)
    ]
    q = cq.quantize_groupwise(cupy.zeros(shape, np.float32), E4, group_size=group_size)  # its buffers are the inputs
    y = cupy.empty(shape, BF16)
    host = [(m.data.get(), m.to_host()["scale"]) for m in made]
    with _launch.recording() as rec:
        cq.dequantize(q, BF16, out=y)
    assert ["dequantize_flat" in r[0].name for r in rec if r[5] is not None] == [True]

    def step():
        return [cq.dequantize(q, BF16, out=y)]

    def want(r):
        return [ref.dequantize_groupwise(host[r][0], host[r][1], E4, BF16, group_size=group_size)]

    check_rounds(
        step,
        [q.data, q.scale],
        [[m.data, m.scale] for m in made],
        lambda r, got, where: assert_rounds_equal(got, want(r), ["y"], f"{where} round {r}"),
    )


# ------------------------------------------------------------------ streams, graphs, no sync


def test_graph_capture_and_no_sync(col_path):
    import cupyx

    xh = heavy_tailed((64, 2 * 512), 40, ml_dtypes.bfloat16)
    x = cupy.asarray(xh)
    qbuf = cupy.empty((64, 1024), np.uint8)
    sbuf = cq.empty_scales((64, 1024), 128, "col")
    sq = cupy.empty((64, 512), np.uint8)
    ss = cq.empty_scales((64, 512), 128, "row")
    cq.quantize_groupwise(x, group_size=128, scale_layout="col", out=qbuf, scale_out=sbuf)  # compile
    cq.silu_mul_quantize(x, group_size=128, out=sq, scale_out=ss)
    with cupyx.allow_synchronize(False):
        cq.quantize_groupwise(x, group_size=128, scale_layout="col", out=qbuf, scale_out=sbuf).dequantize()
        cq.silu_mul_quantize(x, group_size=128, out=sq, scale_out=ss)
    stream = side_stream()
    with stream:
        stream.begin_capture()
        q = cq.quantize_groupwise(x, group_size=128, scale_layout="col", out=qbuf, scale_out=sbuf)
        qs = cq.silu_mul_quantize(x, group_size=128, out=sq, scale_out=ss)
        graph = stream.end_capture()
    xh2 = heavy_tailed(x.shape, 41, ml_dtypes.bfloat16)
    with stream:  # the new data on the graph's stream (a non-blocking stream does not wait for the default one)
        x.set(xh2)
        graph.launch(stream)
    stream.synchronize()
    eq, es = ref.quantize_groupwise(xh2, group_size=128)
    check(q, eq, es, "col")
    r = groupwise._silu_mul_intermediate(x)[0].get()
    eq, es = ref.quantize_silu_intermediate(r, group_size=128)
    check(qs, eq, es, "row")


# ------------------------------------------------------------------ the hoisted-reciprocal division

_DIV_SWEEP = r"""
extern "C" __global__ void div_sweep(const float* s_list, int n_s, const float* x_list, long long n_x,
                                     unsigned long long* bad) {
    const float s = s_list[blockIdx.y];
    const float r = cq::div_rn(1.0f, s);
    unsigned n_bad = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n_x; i += (long long)gridDim.x * blockDim.x) {
        const float x = x_list[i];
        n_bad += __float_as_uint(cq::div_by(x, s, r)) != __float_as_uint(cq::div_rn(x, s));
    }
    if (n_bad) atomicAdd(bad, (unsigned long long)n_bad);
}
"""


def test_div_by_matches_ieee_division_sampled():
    # scripts/verify_fast_division.py checks all 2^46 significand pairs; here: every significand of x
    # in one binade against 48 scales, and random x of both signs over 60 binades, zeros and values
    # near FLT_MAX (quotients that stay finite and normal: the range div_by is used for) against 16.
    from cupyquant import _jit

    src = "#include <cuda_fp8.h>\n" + (_jit.kernel_dir() / "common.cuh").read_text() + _DIV_SWEEP
    k = cupy.RawKernel(src, "div_sweep", options=_jit.options())
    rng = np.random.default_rng(11)
    scales = np.concatenate(
        [
            1 + rng.random(40),
            [1.0, 1.5, np.nextafter(2.0, 1), 448.0 / 3, 1e-10 / 448, 2.0**-33, 1e30, 1.0 / 229376],
        ]
    ).astype(np.float32)
    xs = (0x3F800000 + np.arange(1 << 23, dtype=np.uint32)).view(np.float32)
    bad = cupy.zeros(1, np.uint64)
    k(
        (1024, len(scales)),
        (256,),
        (cupy.asarray(scales), np.int32(len(scales)), cupy.asarray(xs), np.int64(xs.size), bad),
    )
    wild = (rng.standard_normal(1 << 20) * np.exp(rng.uniform(-60, 80, 1 << 20))).astype(np.float32)
    wild[:6] = [0.0, -0.0, 3.4e38, -3.4e38, 2.0**-90, -(2.0**-90)]
    small_scales = (1 + rng.random(16) * 10).astype(np.float32)  # x / s stays finite and normal
    k((256, 16), (256,), (cupy.asarray(small_scales), np.int32(16), cupy.asarray(wild), np.int64(wild.size), bad))
    assert int(bad.get()[0]) == 0


# ------------------------------------------------------------------ programmatic dependent launch
@pytest.mark.parametrize(
    "case",
    [
        "fp8-g128",
        "fp8-g128-col-wide",
        "fp8-g128-col-tall",
        "ue8m0-g128-col-wide",
        "ue8m0-g128-col-tall",
        "fp8-token-few-scale_ub-device",
        "fp8-token-regs-scale_ub-device",
        "int8-token-azp",
        "silu-per_element-fp8-g128",
        "silu-batched-fp8-g128",
    ],
)
def test_pdl_each_kernel_waits_for_the_kernel_before(case, monkeypatch):
    """With PDL (compute capability 9.0+), rounds of new inputs (x, and the device scale_ub), each
    written by a kernel that lets the op's kernel start at once (tests/_pdl.py): the quantizer and
    the dequantizer of its result (SiLU*Mul: the quantizer alone, against the reference quantization
    of the device's own intermediate, as test_silu_mul_quantize) are bit for bit the reference of
    each round, in a stream and replayed from a CUDA graph. The group case writes into the same out=
    and scale_out= buffers every round; the per-token FP8 cases force each per-token kernel
    (token_quantize_few, token_quantize_regs), the SiLU*Mul cases each path (groupwise.SILU_PATH), the
    "col" group cases (float32 and packed UE8M0 scales) each geometry (groupwise.GROUP_COL_PATH)."""
    require_arch("pdl")
    R, BF16 = 4, ml_dtypes.bfloat16
    silu = case.startswith("silu")
    shape = (37, 2 * 512) if silu else (37, 512)  # 37 rows: a partial block of rows
    xs = [
        (heavy_tailed(shape, _seed("pdl", case, r), np.float32) * (0.3 if silu else 1.0)).astype(BF16) for r in range(R)
    ]
    ubs = [np.array([0.5 + r], np.float32) for r in range(R)]
    x, ub = cupy.empty(shape, BF16), cupy.empty((1,), np.float32)
    inputs, sources = [x], [[cupy.asarray(a)] for a in xs]
    E4 = "float8_e4m3fn"
    if case == "fp8-g128":
        q, s, y = cupy.empty(shape, np.uint8), cq.empty_scales(shape, 128), cupy.empty(shape, np.float32)
        names = ["q", "scales", "y"]

        def step():
            qt = cq.quantize_groupwise(x, E4, group_size=128, out=q, scale_out=s)
            return [qt.data, qt.scale, cq.dequantize(qt, np.float32, out=y)]

        def want(r):
            eq, es = ref.quantize_groupwise(xs[r], E4, group_size=128)
            return [eq, es, ref.dequantize_groupwise(eq, es, E4, np.float32, group_size=128)]
    elif "-g128-col-" in case:
        monkeypatch.setattr(groupwise, "GROUP_COL_PATH", case.split("-")[-1])
        sdt = E8M0 if case.startswith("ue8m0") else "float32"
        q, s = cupy.empty(shape, np.uint8), cq.empty_scales(shape, 128, "col", sdt)
        names = ["q", "scales", "y"]

        def step():
            qt = cq.quantize_groupwise(x, E4, group_size=128, scale_layout="col", scale_dtype=sdt, out=q, scale_out=s)
            assert qt.scale is s
            words = cupy.ndarray((ref.scale_word_offsets(shape, s.shape[-1], "col")[1],), np.uint32, memptr=s.data)
            return [qt.data, words, cq.dequantize(qt, np.float32)]  # the whole buffer: padding included

        def want(r):
            eq, es = ref.quantize_groupwise(xs[r], E4, group_size=128, scale_dtype=sdt)
            y = ref.dequantize_groupwise(eq, es, E4, np.float32, group_size=128)
            return [eq, ref.scale_buffer(es, shape, "col"), y]
    elif case.startswith("fp8-token-"):
        monkeypatch.setattr(groupwise, "TOKEN_PATH", case.split("-")[2])
        inputs, sources = [x, ub], [[cupy.asarray(a), cupy.asarray(b)] for a, b in zip(xs, ubs)]
        names = ["q", "scales", "y"]

        def step():
            qt = cq.quantize_groupwise(x, E4, group_size=None, scale_ub=ub)
            return [qt.data, qt.scale, cq.dequantize(qt, np.float32)]

        def want(r):
            eq, es = ref.quantize_groupwise(xs[r], E4, group_size=None, scale_ub=float(ubs[r][0]))
            return [eq, es, ref.dequantize_groupwise(eq, es, E4, np.float32)]
    elif case == "int8-token-azp":
        names = ["q", "scales", "zero_points", "y"]

        def step():
            qt = cq.quantize_groupwise(x, "int8", group_size=None, symmetric=False)
            return [qt.data, qt.scale, qt.zero_point, cq.dequantize(qt, np.float32)]

        def want(r):
            eq, es, ez = ref.quantize_groupwise(xs[r], "int8", group_size=None, symmetric=False)
            return [eq, es, ez, ref.dequantize_groupwise(eq, es, "int8", np.float32, zero_point=ez)]
    else:
        monkeypatch.setattr(groupwise, "SILU_PATH", case.split("-")[1])
        names = ["q", "scales"]
        intermediates = [groupwise._silu_mul_intermediate(cupy.asarray(a))[0].get() for a in xs]

        def step():
            qt = cq.silu_mul_quantize(x, E4, group_size=128)
            return [qt.data, qt.scale]

        def want(r):
            return list(ref.quantize_silu_intermediate(intermediates[r], E4, group_size=128))

    check_rounds(
        step, inputs, sources, lambda r, got, where: assert_rounds_equal(got, want(r), names, f"{where} round {r}")
    )
