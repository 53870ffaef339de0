"""MXFP8, MXFP4 and NVFP4 on the GPU, byte for byte against cupyquant.reference: element bytes,
scale bytes in both layouts (padding included) from both geometries of the quantizer,
dequantization, the hardware and software conversion paths, special blocks, and argument
validation."""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest
from _pdl import assert_rounds_equal, check_rounds
from conftest import assert_bits_equal, heavy_tailed, moved_copy, poisoned, require_arch

import cupyquant as cq
from cupyquant import _block_scale, _device, _flat, _launch, _plans, _testing
from cupyquant import reference as ref

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")

IN_DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
MX_FORMATS = ["float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"]
LAYOUTS = ["dense", "swizzled"]
SHAPES = [(1, 32), (128, 4096), (300, 1000), (2, 3, 96), (5, 17), (130, 48)]


def _id(v):
    return np.dtype(v).name if not isinstance(v, (str, tuple, type(None), int)) else str(v)


def _seed(*parts):
    return zlib.crc32(repr(parts).encode())


def expected_scales(dense, layout):
    return ref.swizzle_scales(dense) if layout == "swizzled" else dense


def run_mx(xh, fmt, layout="dense", rounding="ceil", x=None):
    x = cupy.asarray(xh) if x is None else x
    eq, es = ref.quantize_mx(xh, fmt, rounding=rounding)
    out = poisoned(eq.shape, np.uint8)
    q = cq.quantize_mx(x, fmt, scale_layout=layout, rounding=rounding, out=out)
    assert q.data is out
    assert_bits_equal(q.data, eq, f"{fmt} data")
    assert_bits_equal(q.scale, expected_scales(es, layout), f"{layout} scales")
    return q, eq, es


def run_nvfp4(xh, layout="swizzled", global_scale=None, x=None):
    x = cupy.asarray(xh) if x is None else x
    gs_host = global_scale.get() if isinstance(global_scale, cupy.ndarray) else global_scale
    eq, es, eg = ref.quantize_nvfp4(xh, global_scale=gs_host)
    q = cq.quantize_nvfp4(x, global_scale=global_scale, scale_layout=layout)
    assert_bits_equal(q.data, eq, "nvfp4 data")
    assert_bits_equal(q.scale, expected_scales(es, layout), f"{layout} scales")
    assert_bits_equal(q.global_scale, np.array([eg], np.float32), "global scale")
    if global_scale is None:
        assert_bits_equal(q.amax, np.array([ref.amax(xh)], np.float32), "amax")
    return q, eq, es, eg


@pytest.fixture(params=_block_scale.GEOMETRIES)
def geometry(request, monkeypatch):
    """Each geometry of the quantizer forced in turn (_block_scale.GEOMETRY): the shapes of these
    tests are small enough that the planner alone would take the small one."""
    monkeypatch.setattr(_block_scale, "GEOMETRY", request.param)
    return request.param


# ---------------------------------------------------------------- bytes and scales
@pytest.mark.parametrize("rounding", ["ceil", "floor"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", MX_FORMATS)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
def test_mx_every_combination(in_dtype, fmt, layout, rounding, geometry):
    for shape in SHAPES:
        xh = heavy_tailed(shape, _seed(shape, in_dtype, fmt, layout, rounding), in_dtype)
        run_mx(xh, fmt, layout, rounding)


@pytest.mark.parametrize("gs", ["dynamic", "float", "device"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
def test_nvfp4_every_combination(in_dtype, layout, gs, geometry):
    for shape in SHAPES:
        xh = heavy_tailed(shape, _seed(shape, in_dtype, layout, gs), in_dtype)
        a = ref.amax(xh)
        g = {
            "dynamic": None,
            "float": float(ref.nvfp4_global_scale(a) * np.float32(0.75)),
            "device": cupy.asarray(np.array([ref.nvfp4_global_scale(a)], np.float32)),
        }[gs]
        run_nvfp4(xh, layout, g)


@pytest.mark.parametrize("fmt", MX_FORMATS + ["nvfp4"])
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
def test_software_path_forced(monkeypatch, in_dtype, fmt):
    """The exact software conversions give the same bytes as the hardware ones (on this GPU: FP8
    by cvt.satfinite on sm_89+; on Blackwell also FP4 and UE8M0)."""
    monkeypatch.setattr(_block_scale, "FORCE_SOFTWARE", True)
    for shape in [(128, 4096), (300, 1000)]:
        xh = heavy_tailed(shape, _seed("sw", shape, in_dtype, fmt), in_dtype)
        for layout in LAYOUTS:
            if fmt == "nvfp4":
                run_nvfp4(xh, layout)
            else:
                for rounding in ("ceil", "floor"):
                    run_mx(xh, fmt, layout, rounding)


def _special_blocks(fmt, in_dtype):
    """Rows of 32 elements (one MX block, two NVFP4 blocks) with the edge cases of the scale rules."""
    rng = np.random.default_rng(_seed("special", fmt, _id(in_dtype)))
    emax = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "float4_e2m1fn": 6.0}[fmt]
    finfo_max = float(ml_dtypes.finfo(in_dtype).max)
    tiny = float(ml_dtypes.finfo(in_dtype).smallest_subnormal)
    rows = []

    def row(v):
        rows.append(np.asarray(v, np.float64))

    row(np.zeros(32))
    r = rng.standard_normal(32)
    r[5] = np.inf
    row(r)
    r = rng.standard_normal(32)
    r[7] = -np.inf
    r[8] = np.inf
    row(r)
    r = rng.standard_normal(32)
    r[3] = np.nan
    row(r)
    r = rng.standard_normal(32)
    r[30] = np.nan
    r[0] = np.inf
    row(r)
    row(np.full(32, np.nan))
    for k in (-20, -3, 0, 1, 7):  # amax exactly elem_max * 2^k, 448 * 2^k, 6 * 2^k
        for m in (emax, 448.0, 6.0, 57344.0):
            v = m * 2.0**k
            if v < finfo_max:
                r = rng.uniform(-1, 1, 32) * v
                r[11] = -v
                row(r)
    r = rng.uniform(-1, 1, 32) * tiny * 8
    r[2] = tiny
    row(r)  # subnormal amax
    row(np.full(32, tiny))
    r = np.zeros(32)
    r[31] = tiny
    row(r)
    r = rng.uniform(-1, 1, 32) * finfo_max
    r[9] = finfo_max
    row(r)  # amax near the input max
    r = rng.uniform(-1, 1, 32) * 2.0**-120
    row(r)  # E = 0 territory for the ceil rule
    r = rng.uniform(-1, 1, 32)
    r[4] = -0.0
    r[5] = 0.0
    row(r)
    with np.errstate(over="ignore"):
        return np.stack(rows).astype(np.float32).astype(in_dtype)


@pytest.mark.parametrize("sw", [False, True], ids=["hw", "sw"])
@pytest.mark.parametrize("fmt", MX_FORMATS)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
def test_mx_special_blocks(monkeypatch, in_dtype, fmt, sw, geometry):
    monkeypatch.setattr(_block_scale, "FORCE_SOFTWARE", sw)
    xh = _special_blocks(fmt, in_dtype)
    for layout in LAYOUTS:
        for rounding in ("ceil", "floor"):
            q, eq, es = run_mx(xh, fmt, layout, rounding)
    # hand-checked anchors of the rules
    _, es = ref.quantize_mx(xh, fmt)
    assert es[0, 0] == 0  # all zero
    assert es[1, 0] == 254 and es[2, 0] == 254  # inf
    assert es[3, 0] == 255 and es[4, 0] == 255 and es[5, 0] == 255  # NaN wins over inf


@pytest.mark.parametrize("sw", [False, True], ids=["hw", "sw"])
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
def test_nvfp4_special_blocks(monkeypatch, in_dtype, sw, geometry):
    monkeypatch.setattr(_block_scale, "FORCE_SOFTWARE", sw)
    xh = _special_blocks("float4_e2m1fn", in_dtype)
    for layout in LAYOUTS:
        run_nvfp4(xh, layout, global_scale=1.0)
        run_nvfp4(xh, layout, global_scale=float(ref.NVFP4_RANGE / np.float32(3.0)))
        finite = np.where(np.isfinite(xh.astype(np.float32)), xh, 0).astype(in_dtype)
        run_nvfp4(finite, layout)  # dynamic global amax over finite data
        run_nvfp4(xh, layout)  # inf in the tensor: amax inf gives S_enc 1


def test_mx_amax_at_format_max_times_power_of_two():
    """amax = 448 * 2^k: the ceil rule multiplies by float32(1/448) and rounds the exponent up only
    if that product is not exactly 2^k; checked against the product computed here."""
    ks = np.arange(-60, 60)
    for fmt, m in (("float8_e4m3fn", 448.0), ("float8_e5m2", 57344.0), ("float4_e2m1fn", 6.0)):
        amax = (m * 2.0**ks).astype(np.float32)
        xh = np.zeros((ks.size, 32), np.float32)
        xh[:, 0] = amax
        xh[:, 1] = -amax / 3
        q, eq, es = run_mx(xh, fmt)
        prod = (amax * np.float32(1.0 / m)).astype(np.float32)
        exact = prod == (2.0**ks).astype(np.float32)
        want = np.where(exact, ks + 127, ks + 128)
        np.testing.assert_array_equal(es[:, 0].astype(int), want)


@pytest.mark.parametrize("rounding", ["ceil", "floor"])
@pytest.mark.parametrize("sw", [False, True], ids=["hw", "sw"])
def test_mxfp4_every_bf16_pattern_at_many_scales(monkeypatch, sw, rounding):
    """Every bf16 bit pattern (NaN, inf, subnormals included) quantized to MXFP4 in blocks whose
    amax is pinned to 6 * 2^k, 4.5 * 2^k or 5 * 2^k for k across the whole exponent range: the
    bf16-pair conversion of the kernel (E = 1..253) and its float fallback (E = 0, 254, 255) against
    the reference, every rounding tie at every scale."""
    monkeypatch.setattr(_block_scale, "FORCE_SOFTWARE", sw)
    pats = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    rng = np.random.default_rng(_seed("bf16-fp4", rounding))
    nblk = -(-pats.size // 31)
    rows = []
    for k in list(range(-133, 128, 6)) + [-127, -126, 125, 126, 127]:
        body = rng.permutation(np.concatenate([pats, rng.choice(pats, nblk * 31 - pats.size)]))
        body = body.reshape(nblk, 31).view(ml_dtypes.bfloat16)
        with np.errstate(over="ignore"):
            anchor = (np.float32(rng.choice([6.0, 4.5, 5.0])) * np.float32(2.0) ** k).astype(ml_dtypes.bfloat16)
        rows.append(np.concatenate([body, np.full((nblk, 1), anchor, ml_dtypes.bfloat16)], axis=1))
    xh = np.concatenate(rows)
    for layout in LAYOUTS:
        run_mx(xh, "float4_e2m1fn", layout, rounding)


# ---------------------------------------------------------------- layout
@pytest.mark.parametrize("block,quant", [(32, "mx"), (16, "nvfp4")])
def test_swizzled_offsets_and_zero_padding(block, quant):
    """Each block gets a distinct scale; the swizzled byte of (m, k) must sit at the formula's offset
    and every other byte of the buffer (rows past M, columns past Kb) must be 0."""
    M, Kb = 200, 7  # pads to 256 rows and 8 columns
    K = Kb * block - 5  # a partial last block too
    m = np.arange(M)[:, None]
    k = np.arange(Kb)[None, :]
    span = 40 if quant == "mx" else 14  # NVFP4 scales are E4M3: keep sf inside its range
    amax = 2.0 ** ((m * 5 + k * 3) % span - span // 2).astype(np.float64)
    xh = np.repeat(amax, block, axis=1)[:, :K].astype(np.float32)
    xh[:, ::3] *= -0.5
    x = cupy.asarray(xh)
    if quant == "mx":
        q = cq.quantize_mx(x, "float8_e4m3fn", scale_layout="swizzled")
        dense = cq.quantize_mx(x, "float8_e4m3fn", scale_layout="dense").scale.get()
    else:
        q = cq.quantize_nvfp4(x, global_scale=16.0, scale_layout="swizzled")
        dense = cq.quantize_nvfp4(x, global_scale=16.0, scale_layout="dense").scale.get()
    buf = q.scale.get()
    assert buf.shape == (256, 8) == cq.block_scale_shape(xh.shape, block, "swizzled")
    flat = buf.reshape(-1)
    off = (m // 128 * 2 + k // 4) * 512 + (m % 32) * 16 + (m // 32 % 4) * 4 + k % 4
    np.testing.assert_array_equal(flat[off], dense)
    assert len(np.unique(dense)) >= 12
    rest = np.ones(flat.size, bool)
    rest[off.reshape(-1)] = False
    assert not flat[rest].any(), "padding bytes of the swizzled layout must be 0"
    np.testing.assert_array_equal(q.to_host()["scale"].view(np.uint8), dense)


# ---------------------------------------------------------------- geometries
#: Rows: fewer than one scale word's 32 rows of the swizzled layout, one tile of 128 and a partial
#: second (padding rows 1 to 127 of the last tile)
GEOMETRY_MS = [1, 7, 16, 100, 128, 129, 300]
#: K: below one segment, one word of scales and one tile; whole tiles; partial tiles, blocks that K
#: does not fill and odd K (the scalar path, a half-filled last FP4 byte)
GEOMETRY_KS = [1, 17, 48, 1000, 4096, 4097, 7168]


def _quantize_in(geometry, monkeypatch, fmt, x, layout, rounding, gs):
    """Quantize ``x`` with ``_block_scale.GEOMETRY`` forced to ``geometry``, into poisoned out= and
    scale_out= buffers; checks that the quantizer launched was that geometry's."""
    monkeypatch.setattr(_block_scale, "GEOMETRY", geometry)
    block = 16 if fmt == "nvfp4" else 32
    bits = 4 if fmt in ("nvfp4", "float4_e2m1fn") else 8
    K = x.shape[-1]
    out = poisoned(x.shape[:-1] + (K if bits == 8 else -(-K // 2),), np.uint8)
    s_out = poisoned(cq.block_scale_shape(x.shape, block, layout), np.uint8)
    with _launch.recording() as rec:
        if fmt == "nvfp4":
            q = cq.quantize_nvfp4(x, global_scale=gs, scale_layout=layout, out=out, scale_out=s_out)
        else:
            q = cq.quantize_mx(x, fmt, scale_layout=layout, rounding=rounding, out=out, scale_out=s_out)
    names = [r[0].name for r in rec if r[5] is not None and "quantize" in r[0].name]
    assert len(names) == 1 and _launched_geometry(names[0]) == geometry, (geometry, names)
    assert q.data is out and q.scale is s_out
    return q


def _launched_geometry(kernel_name):
    """The quantizer geometry of a launched kernel, from its name (the "_small" / "_wide" suffixes)."""
    return "small" if "quantize_small" in kernel_name else "wide" if "quantize_wide" in kernel_name else "tile"


@pytest.mark.parametrize("fmt", MX_FORMATS + ["nvfp4"])
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
def test_geometries_bit_exact(monkeypatch, in_dtype, fmt):
    """Each geometry of the quantizer (_block_scale.GEOMETRY: the 128 x 256 tile, the small one of
    a thread per segment) on every M of GEOMETRY_MS by every K of GEOMETRY_KS, both scale layouts:
    element bytes, scale bytes (the swizzled layout's padding rows and columns included) and NVFP4's
    global scale equal the reference. MX alternates the two rounding rules, NVFP4 a given and a
    reduced global scale."""
    for i, M in enumerate(GEOMETRY_MS):
        for K in GEOMETRY_KS:
            xh = heavy_tailed((M, K), _seed("geometry", M, K, in_dtype, fmt), in_dtype)
            x = cupy.asarray(xh)
            rounding, gs = ("floor", None) if i % 2 else ("ceil", 37.5)
            if fmt == "nvfp4":
                eq, es, eg = ref.quantize_nvfp4(xh, global_scale=gs)
            else:
                eq, es = ref.quantize_mx(xh, fmt, rounding=rounding)
            for layout in LAYOUTS:
                for geometry in _block_scale.GEOMETRIES:
                    what = f"{fmt} {geometry} M={M} K={K} {layout}"
                    q = _quantize_in(geometry, monkeypatch, fmt, x, layout, rounding, gs)
                    assert_bits_equal(q.data, eq, f"{what} data")
                    assert_bits_equal(q.scale, expected_scales(es, layout), f"{what} scales")
                    if fmt == "nvfp4":
                        assert_bits_equal(q.global_scale, np.array([eg], np.float32), f"{what} global scale")


@pytest.mark.parametrize("fmt", MX_FORMATS + ["nvfp4"])
def test_geometries_views(monkeypatch, fmt):
    """Each geometry on row-strided, misaligned (the scalar path with K a multiple of 16) and 3-D
    views, with the software conversions too."""
    base = heavy_tailed((300, 1100), _seed("geometry views", fmt), ml_dtypes.bfloat16)
    xb = cupy.asarray(base)
    for M in (1, 16, 129, 300):
        views = [
            (xb[:M, :1024], base[:M, :1024]),
            (xb[:M, 1:1025], base[:M, 1:1025]),
            (xb[:M, 3:998], base[:M, 3:998]),
        ]
        if M % 4 == 0:
            views.append((xb[:M, :1024].reshape(4, M // 4, 1024), base[:M, :1024].reshape(4, M // 4, 1024)))
        for v, vh in views:
            vh = np.ascontiguousarray(vh)
            if fmt == "nvfp4":
                eq, es, _ = ref.quantize_nvfp4(vh, global_scale=100.0)
            else:
                eq, es = ref.quantize_mx(vh, fmt)
            for sw in (False, True):
                monkeypatch.setattr(_block_scale, "FORCE_SOFTWARE", sw)
                _plans.clear()  # FORCE_SOFTWARE is read when a call is planned, not part of the key
                for layout in LAYOUTS:
                    for geometry in _block_scale.GEOMETRIES:
                        what = f"{fmt} {geometry} {v.shape} strides {v.strides} {layout} sw={sw}"
                        q = _quantize_in(geometry, monkeypatch, fmt, v, layout, "ceil", 100.0)
                        assert_bits_equal(q.data, eq, f"{what} data")
                        assert_bits_equal(q.scale, expected_scales(es, layout), f"{what} scales")


def test_geometry_planner_and_override(monkeypatch):
    """Unforced, the planner takes the small geometry at 128 rows of 4096, and at 16384 rows the
    small one for MXFP8, the tile for MXFP4 and the wide one for NVFP4;
    GEOMETRY changes the geometry of the same call signature between calls (it is part of the
    plan's key), and a name that is not a geometry raises."""
    sms = _device.sm_count(cupy.cuda.Device().id)
    x = cupy.asarray(heavy_tailed((128, 4096), 3, ml_dtypes.bfloat16))
    big = cupy.zeros((16384, 4096), ml_dtypes.bfloat16)
    assert _block_scale.planned_geometry(128, 4096, sms, 4) == "small"
    assert _block_scale.planned_geometry(16384, 4096, sms, 4) == "tile"

    def launched(fn):
        with _launch.recording() as rec:
            fn()
        return [r[0].name for r in rec if r[5] is not None]

    for fmt in ("float8_e4m3fn", "float4_e2m1fn"):
        assert "quantize_small" in launched(lambda: cq.quantize_mx(x, fmt))[0]
        # MXFP8 takes the small geometry at every size, MXFP4 the tile at 16384 rows
        assert ("quantize_small" in launched(lambda: cq.quantize_mx(big, fmt))[0]) == (fmt == "float8_e4m3fn")
    assert "quantize_small" in launched(lambda: cq.quantize_nvfp4(x, global_scale=2.0))[0]
    assert "quantize_wide" in launched(lambda: cq.quantize_nvfp4(big, global_scale=2.0))[0]
    eq, es = ref.quantize_mx(x.get(), "float8_e4m3fn")
    for geometry in ("tile", "small", "wide", None, "tile"):
        monkeypatch.setattr(_block_scale, "GEOMETRY", geometry)
        names = launched(lambda: cq.quantize_mx(x, "float8_e4m3fn", scale_layout="swizzled"))
        assert _launched_geometry(names[0]) == (geometry or "small"), (geometry, names)
    q = cq.quantize_mx(x, "float8_e4m3fn", scale_layout="swizzled")
    assert_bits_equal(q.data, eq, "data")
    assert_bits_equal(q.scale, expected_scales(es, "swizzled"), "scales")
    monkeypatch.setattr(_block_scale, "GEOMETRY", "rows")
    with pytest.raises(ValueError, match="GEOMETRY"):
        cq.quantize_mx(x)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", ["float4_e2m1fn", "nvfp4"])
def test_planner_pick_is_what_launches(monkeypatch, fmt, layout):
    """With GEOMETRY unset, whatever _block_scale.planned_geometry returns is the geometry launched
    (so that a refit planner takes effect as written), and its bytes are the reference's."""
    xh = heavy_tailed((300, 4096), _seed("planner pick", fmt, layout), ml_dtypes.bfloat16)
    x = cupy.asarray(xh)
    for geometry in _block_scale.GEOMETRIES:
        monkeypatch.setattr(_block_scale, "planned_geometry", lambda rows, K, sms, bits, nvfp4=False, g=geometry: g)
        _plans.clear()  # the planner's answer is not part of the plan's key
        with _launch.recording() as rec:
            if fmt == "nvfp4":
                q = cq.quantize_nvfp4(x, global_scale=37.5, scale_layout=layout)
                eq, es, _ = ref.quantize_nvfp4(xh, global_scale=37.5)
            else:
                q = cq.quantize_mx(x, fmt, scale_layout=layout)
                eq, es = ref.quantize_mx(xh, fmt)
        names = [r[0].name for r in rec if r[5] is not None and "quantize" in r[0].name]
        assert len(names) == 1 and _launched_geometry(names[0]) == geometry, (geometry, names)
        assert_bits_equal(q.data, eq, f"{fmt} {geometry} data")
        assert_bits_equal(q.scale, expected_scales(es, layout), f"{fmt} {geometry} scales")
    _plans.clear()


@pytest.mark.parametrize("sw", [False, True], ids=["hw", "sw"])
def test_nvfp4_every_bf16_pattern_at_many_scales(monkeypatch, sw, geometry):
    """Every bf16 bit pattern within 8 binades of a block's pinned amax (6, 4.5 or 5 times 2^k, k
    across the exponent range), both signs, zeros and subnormals, in blocks of 16 under a global
    scale that puts that amax's scale at 448 (exact multipliers: every rounding tie) and one 0.7
    times that (inexact products), with rows of random patterns (NaN, inf, huge) in the same warps:
    the wide geometry's float path and its fallback to the general path, against the reference."""
    monkeypatch.setattr(_block_scale, "FORCE_SOFTWARE", sw)
    pats = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    mags = pats.view(ml_dtypes.bfloat16).astype(np.float32)
    rng = np.random.default_rng(_seed("nvfp4 bf16 patterns", sw))
    for k in (-117, -100, -60, -20, -3, 0, 3, 20, 60, 100, 120):
        for lead in (6.0, 4.5, 5.0):
            anchor = np.float32(lead * 2.0**k)
            with np.errstate(invalid="ignore"):
                near = pats[(np.abs(mags) <= anchor) & (np.abs(mags) >= anchor * np.float32(2.0**-8))]
            body = rng.permutation(np.concatenate([near, pats[:64], pats[0x8000:0x8040]]))  # +-0, subnormals
            body = np.resize(body, (-(-body.size // 240) * 16, 15)).view(ml_dtypes.bfloat16)  # rows of 16 blocks
            anchors = np.full((body.shape[0], 1), anchor, ml_dtypes.bfloat16)
            blocks = np.concatenate([body, anchors], axis=1).reshape(-1, 256)
            wild = rng.permutation(pats)[: 8 * 256].view(ml_dtypes.bfloat16).reshape(8, 256)
            xh = np.concatenate([blocks[:4], wild[:4], blocks[4:], wild[4:]])
            for s in (np.float32(2688.0) / anchor, np.float32(2688.0) / anchor * np.float32(0.7)):
                run_nvfp4(xh, "swizzled", global_scale=float(s))
                run_nvfp4(xh, "dense", global_scale=float(s))


# ---------------------------------------------------------------- views, shapes, tails
@pytest.mark.parametrize("fmt", MX_FORMATS + ["nvfp4"])
def test_strided_and_misaligned_views(fmt, geometry):
    base = heavy_tailed((64, 1100), _seed("views", fmt), ml_dtypes.bfloat16)
    xb = cupy.asarray(base)
    views = {
        "row-strided": (xb[:, :1024], base[:, :1024]),
        "offset by one element": (xb[:, 1:1025], base[:, 1:1025]),
        "odd K": (xb[:, 3:998], base[:, 3:998]),
        "3-D split rows": (xb[:, :1024].reshape(8, 8, 1024), base[:, :1024].reshape(8, 8, 1024)),
    }
    for v, vh in views.values():
        vh = np.ascontiguousarray(vh)
        for layout in LAYOUTS:
            if fmt == "nvfp4":
                run_nvfp4(vh, layout, global_scale=100.0, x=v)
            else:
                run_mx(vh, fmt, layout, x=v)


@pytest.mark.parametrize("fmt", MX_FORMATS + ["nvfp4"])
def test_empty_and_tiny(fmt, geometry):
    for shape in [(0, 64), (3, 0), (1, 1), (1, 2), (1, 15), (1, 31), (257, 1), (1, 4096 * 9 + 7)]:
        xh = heavy_tailed(shape, _seed("tiny", shape, fmt), np.float32)
        for layout in LAYOUTS:
            if fmt == "nvfp4":
                run_nvfp4(xh, layout)
            else:
                run_mx(xh, fmt, layout)


def test_nvfp4_requires_contiguous_for_dynamic_scale():
    x = cupy.ones((8, 64), dtype=np.float32)[:, :32]
    with pytest.raises(ValueError, match="x must be C-contiguous"):
        cq.quantize_nvfp4(x)
    run_nvfp4(np.ones((8, 32), np.float32), global_scale=2.0, x=x)


# ---------------------------------------------------------------- dequantization
@pytest.mark.parametrize("out_dtype", IN_DTYPES, ids=_id)
@pytest.mark.parametrize("fmt", MX_FORMATS + ["nvfp4"])
def test_dequantize(fmt, out_dtype):
    for shape in [(128, 4096), (300, 1000), (2, 3, 96), (5, 17)]:
        xh = heavy_tailed(shape, _seed("dq", shape, fmt), np.float32)
        xh.reshape(-1)[::97] = 0
        K = shape[-1]
        for layout in LAYOUTS:
            x = cupy.asarray(xh)
            if fmt == "nvfp4":
                q = cq.quantize_nvfp4(x, scale_layout=layout)
                d, s, g = ref.quantize_nvfp4(xh)
                want = ref.dequantize_nvfp4(d, s, g, out_dtype, K=K)
            else:
                q = cq.quantize_mx(x, fmt, scale_layout=layout)
                d, s = ref.quantize_mx(xh, fmt)
                want = ref.dequantize_mx(d, s, fmt, out_dtype, K=K)
            out = poisoned(shape, out_dtype)
            y = cq.dequantize(q, out_dtype, out=out)
            assert y is out
            assert_bits_equal(y, want, f"{fmt} {layout} dequantized")
            assert_bits_equal(q.dequantize(out_dtype), want, "method")


@pytest.mark.parametrize("fmt", MX_FORMATS)
def test_dequantize_special_scales(fmt):
    """Scales 0 (2^-127, subnormal products), 254 and 255 (NaN) decode as the reference says."""
    xh = _special_blocks(fmt, np.float32)
    q = cq.quantize_mx(cupy.asarray(xh), fmt)
    d, s = ref.quantize_mx(xh, fmt)
    for out_dtype in IN_DTYPES:
        assert_bits_equal(q.dequantize(out_dtype), ref.dequantize_mx(d, s, fmt, out_dtype, K=32), "dequantized")
    # hand-made scales: every E8M0 value on a row of blocks, every code byte under every scale
    # (16 rows, the bytes shifted by 16 per row)
    K = 256 * 32
    nbytes = K if fmt != "float4_e2m1fn" else K // 2
    codes = ((np.arange(nbytes)[None, :] + 16 * np.arange(16)[:, None]) % 256).astype(np.uint8)
    scales = np.tile(np.arange(256, dtype=np.uint8), (16, 1))
    q.data, q.scale, q.shape = cupy.asarray(codes), cupy.asarray(scales), (16, K)
    for out_dtype in IN_DTYPES:
        assert_bits_equal(q.dequantize(out_dtype), ref.dequantize_mx(codes, scales, fmt, out_dtype, K=K), "all E8M0")


# ---------------------------------------------------------------- dequantizer geometries
MXFP8 = ["float8_e4m3fn", "float8_e5m2"]


def _mx_dequantize_in(dq_geometry, monkeypatch, q, out_dtype, out=None):
    """Dequantize ``q`` with ``_flat.GEOMETRY`` forced to ``dq_geometry`` into ``out`` (a poisoned
    buffer when not given); checks that the kernel launched is the flat one exactly where the
    geometry is flat, the codes MXFP8 and q.data and out aligned for it (_flat.flat_aligned)."""
    monkeypatch.setattr(_flat, "GEOMETRY", dq_geometry)
    out = poisoned(q.shape, out_dtype) if out is None else out
    with _launch.recording() as rec:
        y = cq.dequantize(q, out_dtype, out=out)
    names = [r[0].name for r in rec if r[5] is not None]
    flat = dq_geometry != "rows" and q.format.bits == 8 and _flat.flat_aligned(q.data.data.ptr, out.data.ptr)
    assert len(names) == 1 and ("dequantize_flat" in names[0]) == flat, (dq_geometry, names)
    assert y is out
    return y


@pytest.mark.parametrize("dq_geometry", _flat.GEOMETRIES)
@pytest.mark.parametrize("out_dtype", IN_DTYPES, ids=_id)
@pytest.mark.parametrize("fmt", MX_FORMATS)
def test_dequantize_geometries(dq_geometry, monkeypatch, fmt, out_dtype):
    """Each geometry of the dequantizer (_flat.GEOMETRY) forced in turn, into poisoned out= buffers,
    on every M of GEOMETRY_MS by every K of GEOMETRY_KS, both scale layouts: bit for bit the
    reference (MXFP4 has the row kernel only, whatever the knob)."""
    for M in GEOMETRY_MS:
        for K in GEOMETRY_KS:
            xh = heavy_tailed((M, K), _seed("dq geometry", M, K, fmt), np.float32)
            xh.reshape(-1)[::97] = 0
            d, s = ref.quantize_mx(xh, fmt)
            want = ref.dequantize_mx(d, s, fmt, out_dtype, K=K)
            for layout in LAYOUTS:
                q = cq.quantize_mx(cupy.asarray(xh), fmt, scale_layout=layout)
                y = _mx_dequantize_in(dq_geometry, monkeypatch, q, out_dtype)
                assert_bits_equal(y, want, f"{dq_geometry} {fmt} {layout} {M}x{K}")


def test_dequantize_planner_few_long_rows():
    """Unforced, MXFP8 dequantization of at most FLAT_FEW_ROWS rows longer than 4096 codes takes the
    flat kernel (aligned arrays), shorter rows and more rows at that size the row kernel; the bytes
    are the reference's either way (poisoned out=)."""
    fmt, bf16 = "float8_e4m3fn", ml_dtypes.bfloat16
    few, from_k = _block_scale.FLAT_FEW_ROWS, _block_scale.FLAT_FEW_ROWS_FROM_K
    for (M, K), flat in [((1, 16384), True), ((few, from_k + 3), True), ((1, from_k - 1), False)] + [
        ((few + 1, 7168), False)
    ]:
        xh = heavy_tailed((M, K), _seed("dq few long", M, K), np.float32)
        d, s = ref.quantize_mx(xh, fmt)
        q = cq.quantize_mx(cupy.asarray(xh), fmt, scale_layout="swizzled")
        out = poisoned((M, K), bf16)
        with _launch.recording() as rec:
            cq.dequantize(q, bf16, out=out)
        [name] = [r[0].name for r in rec if r[5] is not None]
        assert ("dequantize_flat" in name) == flat, (M, K, name)
        assert_bits_equal(out, ref.dequantize_mx(d, s, fmt, bf16, K=K), f"{M}x{K}")


@pytest.mark.parametrize("dq_geometry", _flat.GEOMETRIES)
def test_dequantize_misaligned_views(dq_geometry, monkeypatch):
    """MXFP8 codes and out= views that do not start aligned (1, 4 and 8 bytes past; out= one
    element past): every geometry gives the reference's bytes, the flat ones through the row kernel
    where the codes are not 8-byte or out= not 16-byte aligned."""
    fmt, bf16 = "float8_e4m3fn", ml_dtypes.bfloat16
    for K in (1000, 4096):
        shape = (37, K)
        xh = heavy_tailed(shape, _seed("dq misaligned", K), np.float32)
        d, s = ref.quantize_mx(xh, fmt)
        want = ref.dequantize_mx(d, s, fmt, bf16, K=K)
        q = cq.quantize_mx(cupy.asarray(xh), fmt, scale_layout="swizzled")
        for q_offset in (0, 1, 4, 8):
            for y_offset in (0, 2):
                moved = cq.QuantizedTensor(moved_copy(q.data, q_offset), q.scale, q.scheme, q.shape, q.dtype)
                out = moved_copy(poisoned(shape, bf16), y_offset)
                y = _mx_dequantize_in(dq_geometry, monkeypatch, moved, bf16, out=out)
                assert_bits_equal(y, want, f"{dq_geometry} K={K} q+{q_offset} y+{y_offset}")


@pytest.mark.parametrize("dq_geometry", _flat.GEOMETRIES)
@pytest.mark.parametrize("fmt", MXFP8)
def test_dequantize_geometries_every_code_and_scale(dq_geometry, monkeypatch, fmt):
    """Every code byte under every E8M0 value (0: the subnormal 2^-127, 254, 255: NaN), 16 rows of
    256 blocks, the bytes shifted by 16 a row, dense and swizzled, to each output type."""
    K = 256 * 32
    codes = ((np.arange(K)[None, :] + 16 * np.arange(16)[:, None]) % 256).astype(np.uint8)
    scales = np.tile(np.arange(256, dtype=np.uint8), (16, 1))
    for layout in LAYOUTS:
        q = cq.quantize_mx(cupy.zeros((16, K), np.float32), fmt, scale_layout=layout)
        q.data = cupy.asarray(codes)
        q.scale = cupy.asarray(expected_scales(scales, layout))
        for out_dtype in IN_DTYPES:
            y = _mx_dequantize_in(dq_geometry, monkeypatch, q, out_dtype)
            want = ref.dequantize_mx(codes, scales, fmt, out_dtype, K=K)
            assert_bits_equal(y, want, f"{dq_geometry} {layout} {np.dtype(out_dtype).name}")


@pytest.mark.parametrize("dq_geometry", ["flat16", "flat32"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pdl_flat_dequantizer_waits_for_the_kernel_before(dq_geometry, monkeypatch, layout):
    """With PDL (compute capability 9.0+), the flat MXFP8 dequantizer over rounds of new codes and
    scales, each written by a kernel that lets it start at once (tests/_pdl.py), into the same out=
    buffer: bit for bit the reference of each round, in a stream and replayed from a CUDA graph."""
    require_arch("pdl")
    monkeypatch.setattr(_flat, "GEOMETRY", dq_geometry)
    R, fmt, BF16 = 4, "float8_e4m3fn", ml_dtypes.bfloat16
    shape = (133, 4096 + 512)  # a partial last block, a partial last tile of swizzled scales
    xs = [heavy_tailed(shape, _seed("pdl flat", layout, r), np.float32) for r in range(R)]
    made = [cq.quantize_mx(cupy.asarray(x), fmt, scale_layout=layout) for x in xs]
    q = cq.quantize_mx(cupy.zeros(shape, np.float32), fmt, scale_layout=layout)  # its buffers are the inputs
    y = cupy.empty(shape, BF16)
    with _launch.recording() as rec:
        cq.dequantize(q, BF16, out=y)
    assert ["dequantize_flat" in r[0].name for r in rec if r[5] is not None] == [True]

    def step():
        return [cq.dequantize(q, BF16, out=y)]

    def want(r):
        d, s = ref.quantize_mx(xs[r], fmt)
        return [ref.dequantize_mx(d, s, fmt, BF16, K=shape[-1])]

    check_rounds(
        step,
        [q.data, q.scale],
        [[m.data, m.scale] for m in made],
        lambda r, got, where: assert_rounds_equal(got, want(r), ["y"], f"{where} round {r}"),
    )


# ---------------------------------------------------------------- conversions
CHUNK = 1 << 28


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_software_conversion_equals_hardware_for_every_float(fmt):
    """All 2^32 float32 bit patterns through cvt.rn.satfinite (sm_89+) and the software path."""
    require_arch("fp8_mma")  # no FP8 conversion instruction below sm_89: both paths are the software one
    for base in range(0, 1 << 32, CHUNK):
        hw = _testing._conversion_check(fmt, base, CHUNK, True)
        sw = _testing._conversion_check(fmt, base, CHUNK, False)
        bad = int((hw != sw).sum())
        assert bad == 0, f"{fmt}: {bad} mismatches in [{base:#x}, {base + CHUNK:#x})"


def _pattern_sample():
    """Float32 bit patterns: every exponent with mantissas whose low bits are 0, 1, all ones and
    random (so every midpoint of a narrow format is included), both signs, plus random patterns."""
    rng = np.random.default_rng(7)
    e = np.arange(256, dtype=np.uint32)[:, None]
    hi = np.arange(0, 1 << 23, 1 << 12, dtype=np.uint32)[None, :]
    mant = np.concatenate([hi, hi | 1, hi | 0xFFF, hi | rng.integers(0, 1 << 12, hi.shape, dtype=np.uint32)], axis=1)
    pos = ((e << 23) | mant).reshape(-1)
    pats = np.concatenate([pos, pos | 0x80000000, rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)])
    return pats


@pytest.mark.parametrize("hardware", [False, True], ids=["sw", "hw-or-sw"])
@pytest.mark.parametrize("fmt", MX_FORMATS + ["float8_e8m0fnu"])
def test_conversions_against_reference(fmt, hardware):
    """Every element conversion (and the E8M0 round-up) against the reference over a structured
    sample of float32 patterns: exhaustive over the high mantissa bits of every exponent."""
    pats = _pattern_sample()
    got = _testing._conversion_check(fmt, 0, 0, hardware, patterns=cupy.asarray(pats))
    v = pats.view(np.float32)
    if fmt == "float8_e8m0fnu":
        want = ref.e8m0_ceil(np.abs(v))
    else:
        with np.errstate(all="ignore"):
            want = ref.cast_elements(v, fmt)
    assert_bits_equal(got, want, f"{fmt} codes")


# ---------------------------------------------------------------- host side
def test_to_host_views():
    xh = heavy_tailed((130, 100), 3, ml_dtypes.bfloat16)
    x = cupy.asarray(xh)
    q = cq.quantize_mx(x, "float4_e2m1fn", scale_layout="swizzled")
    h = q.to_host()
    d, s = ref.quantize_mx(xh, "float4_e2m1fn")
    assert h["data"].dtype == ml_dtypes.float4_e2m1fn and h["data"].shape == (130, 100)
    assert_bits_equal(h["data"].view(np.uint8), ref.unpack_fp4(d, 100), "unpacked fp4")
    assert_bits_equal(h["data_packed"], d, "packed fp4")
    assert h["scale"].dtype == ml_dtypes.float8_e8m0fnu and h["scale"].shape == (130, 4)
    assert_bits_equal(h["scale"].view(np.uint8), s, "e8m0 scales")
    assert_bits_equal(h["scale_swizzled"], ref.swizzle_scales(s), "swizzled buffer")
    q8 = cq.quantize_mx(x, "float8_e5m2")
    assert q8.to_host()["data"].dtype == ml_dtypes.float8_e5m2
    n = cq.quantize_nvfp4(x, scale_layout="dense")
    hn = n.to_host()
    assert hn["scale"].dtype == ml_dtypes.float8_e4m3fn and hn["scale"].shape == (130, 7)
    assert hn["global_scale"].dtype == np.float32 and hn["amax"].shape == (1,)
    # values: x ~ q * scale (MX) and q * scale / global_scale (NVFP4)
    approx = h["data"].astype(np.float32) * np.repeat(h["scale"].astype(np.float32), 32, axis=1)[:, :100]
    np.testing.assert_array_equal(approx, ref.dequantize_mx(d, s, "float4_e2m1fn", K=100))


def test_repr_and_scheme():
    q = cq.quantize_nvfp4(cupy.ones((4, 64), np.float16))
    assert q.scheme.format == "float4_e2m1fn" and q.scheme.block == (16,) and q.scheme.scale_dtype == "float8_e4m3fn"
    assert "swizzled" in repr(q)
    assert q.nbytes == q.data.nbytes + q.scale.nbytes + 8
    # each op module registers its own kernel family and dequantizer
    assert q.scheme.family == "nvfp4"
    assert cq.quantize_mx(cupy.ones((4, 64), np.float16)).scheme.family == "mx"
    d, s, g = ref.quantize_nvfp4(np.ones((4, 64), np.float16))
    assert_bits_equal(cq.dequantize(q), ref.dequantize_nvfp4(d, s, g, np.float16, K=64), "nvfp4 dequantize")


# ---------------------------------------------------------------- validation
def _untouched(buf, before):
    assert_bits_equal(buf, before, "caller buffer after a raising call")


def test_validation_errors():
    x = cupy.ones((4, 64), dtype=np.float32)
    out = poisoned((4, 64), np.uint8)
    before = out.get()
    cases = [
        (lambda: cq.quantize_mx(x.get()), TypeError, "x must be a cupy.ndarray"),
        (lambda: cq.quantize_mx(x.astype(np.int32)), TypeError, "x must be float32"),
        (lambda: cq.quantize_mx(x, "int8"), ValueError, "dtype='int8'"),
        (lambda: cq.quantize_mx(x, "float8_e4m3fnuz"), (ValueError, TypeError), "dtype"),
        (lambda: cq.quantize_mx(x, scale_layout="row"), ValueError, "scale_layout='row'"),
        (lambda: cq.quantize_mx(x, rounding="nearest"), ValueError, "rounding='nearest'"),
        (lambda: cq.quantize_mx(cupy.ones((), np.float32)), ValueError, "at least one dimension"),
        (lambda: cq.quantize_mx(x.T), ValueError, "contiguous last axis"),
        (lambda: cq.quantize_mx(x, out=cupy.empty((4, 32), np.uint8)), ValueError, "out must have shape"),
        (lambda: cq.quantize_mx(x, out=cupy.empty((4, 64), np.int8)), TypeError, "out must have dtype uint8"),
        (lambda: cq.quantize_mx(x, "float4_e2m1fn", out=out), ValueError, r"out must have shape \(4, 32\)"),
        (lambda: cq.quantize_mx(x, scale_out=cupy.empty((4, 3), np.uint8)), ValueError, "scale_out must be uint8"),
        (
            lambda: cq.quantize_mx(x, scale_out=cupy.empty((4, 2), np.uint8), scale_layout="swizzled"),
            ValueError,
            r"\(128, 4\)",
        ),
        (lambda: cq.quantize_mx(x, out=x.view(np.uint8)[:, :64]), ValueError, "out"),
        (lambda: cq.quantize_nvfp4(x, global_scale=-1.0), ValueError, "global_scale must be a positive finite"),
        (lambda: cq.quantize_nvfp4(x, global_scale=float("nan")), ValueError, "global_scale"),
        (lambda: cq.quantize_nvfp4(x, global_scale="2"), TypeError, "global_scale"),
        (
            lambda: cq.quantize_nvfp4(x, global_scale=cupy.ones(2, np.float32)),
            ValueError,
            "global_scale must be a float32 array of one element",
        ),
        (lambda: cq.quantize_nvfp4(x, global_scale=cupy.ones(1, np.float64)), TypeError, "global_scale"),
        (lambda: cq.quantize_nvfp4(x, scale_layout="col"), ValueError, "scale_layout"),
        (lambda: cq.quantize_nvfp4(x, out=out), ValueError, "out must have shape"),
        (lambda: cq.block_scale_shape((4, 64), 8), ValueError, "block_size=8"),
        (lambda: cq.dequantize(cq.quantize_mx(x), "int8"), TypeError, "^out_dtype must be float32"),
        (
            lambda: cq.dequantize(cq.quantize_mx(x), out=cupy.empty((4, 64), np.float16)),
            TypeError,
            "out must have dtype float32",
        ),
    ]
    for fn, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            fn()
    _untouched(out, before)


def test_scale_out_reused():
    x = cupy.asarray(heavy_tailed((300, 1000), 11, np.float16))
    for layout in LAYOUTS:
        s = poisoned(cq.block_scale_shape(x.shape, 32, layout), np.uint8)
        q = cq.quantize_mx(x, "float8_e4m3fn", scale_layout=layout, scale_out=s)
        assert q.scale is s
        _, es = ref.quantize_mx(x.get(), "float8_e4m3fn")
        assert_bits_equal(s, expected_scales(es, layout), "scale_out")
        s = poisoned(cq.block_scale_shape(x.shape, 16, layout), np.uint8)
        q = cq.quantize_nvfp4(x, scale_layout=layout, scale_out=s, global_scale=3.0)
        assert q.scale is s


def test_fp4_odd_tail_padding_nibble_is_zero():
    """With an odd K the last byte's high nibble is padding and must be 0, even where the block's
    elements become NaN codes (a NaN block: its zero padding times NaN would give code 7)."""
    xh = heavy_tailed((3, 33), 5, ml_dtypes.bfloat16)
    xh[:, 32] = np.nan
    q, eq, es = run_mx(xh, "float4_e2m1fn")
    assert (eq[:, -1] == 0x07).all() and (es[:, 1] == 255).all()


# ---------------------------------------------------------------- programmatic dependent launch
@pytest.mark.parametrize("case", ["mxfp8-dense", "mxfp4-swizzled", "nvfp4-dynamic", "nvfp4-global_scale-device"])
def test_pdl_each_kernel_waits_for_the_kernel_before(case, geometry):
    """With PDL (compute capability 9.0+), rounds of new inputs (x, and NVFP4's device global
    scale), each written by a kernel that lets the op's first kernel start at once (tests/_pdl.py):
    the quantizer (NVFP4 dynamic: memset, amax reduction and cast) and the dequantizer of its result
    are bit for bit the reference of each round, in a stream and replayed from a CUDA graph. The MX
    cases write into the same out= buffers every round."""
    require_arch("pdl")
    R, BF16 = 4, ml_dtypes.bfloat16
    shape = (133, 512)  # 133 rows: a second, partial tile of 128 rows
    xs = [heavy_tailed(shape, _seed("pdl", case, r), BF16) for r in range(R)]
    gss = [np.array([2688.0 / (10 + 5 * r)], np.float32) for r in range(R)]
    x, gs = cupy.empty(shape, BF16), cupy.empty((1,), np.float32)
    inputs, sources = [x], [[cupy.asarray(a)] for a in xs]
    y = cupy.empty(shape, np.float32)
    if case.startswith("mx"):
        fmt = "float8_e4m3fn" if case == "mxfp8-dense" else "float4_e2m1fn"
        layout = case.split("-")[1]
        q = cupy.empty(ref.quantize_mx(xs[0], fmt)[0].shape, np.uint8)
        names = ["q", "scales", "y"]

        def step():
            qt = cq.quantize_mx(x, fmt, scale_layout=layout, out=q)
            return [qt.data, qt.scale, cq.dequantize(qt, np.float32, out=y)]

        def want(r):
            eq, es = ref.quantize_mx(xs[r], fmt)
            return [eq, expected_scales(es, layout), ref.dequantize_mx(eq, es, fmt, np.float32, K=shape[-1])]
    else:
        dynamic = case == "nvfp4-dynamic"
        if not dynamic:
            inputs, sources = [x, gs], [[cupy.asarray(a), cupy.asarray(b)] for a, b in zip(xs, gss)]
        names = ["q", "scales", "global_scale", "y"] + (["amax"] if dynamic else [])

        def step():
            qt = cq.quantize_nvfp4(x, global_scale=None if dynamic else gs, scale_layout="dense")
            extra = [qt.amax] if dynamic else []
            return [qt.data, qt.scale, qt.global_scale, cq.dequantize(qt, np.float32)] + extra

        def want(r):
            eq, es, eg = ref.quantize_nvfp4(xs[r], global_scale=None if dynamic else gss[r][0])
            extra = [np.array([ref.amax(xs[r])], np.float32)] if dynamic else []
            yr = ref.dequantize_nvfp4(eq, es, eg, np.float32, K=shape[-1])
            return [eq, expected_scales(es, "dense"), np.array([eg], np.float32), yr] + extra

    check_rounds(
        step, inputs, sources, lambda r, got, where: assert_rounds_equal(got, want(r), names, f"{where} round {r}")
    )
