"""Every kernel family on tensors of more than 2^32 elements (so more than 2^31 bytes of every output
too, packed FP4 included): an element, byte or row index held in a 32-bit integer, signed or not,
wraps somewhere in each of these tensors.

The reference is NumPy and far too slow for 4 billion elements, so each test draws a few thousand
rows (or 128-row tiles, or 256-element windows) spread over the whole tensor, plus the first and the
last ones and those that straddle element 2^31 and 2^32, copies just those to the host and runs the
reference on them: every scheme here scales per row, per group or per block, so a row's bytes depend
on that row alone. The two per-tensor scales (FP8 and NVFP4's global scale) come from the amax of
the whole tensor; the input carries a planted maximum near its end, and the amax is also computed on
the device independently (the integer max of the magnitude bits, which orders non-NaN bfloat16
values), so the reference gets the global scale without seeing the tensor.

Inputs are bfloat16 made on the device (normal values times 2^k, k uniform in [-6, 6]). Each test
holds at most about 22 GB of device memory (input 8.6 GB, output, and an 8.6 GB dequantized copy)
and frees it before the next; a GPU with less free memory skips. Run them alone with
``python -m pytest -q -m large tests/test_large.py``; leave them out of a run with ``-m "not large"``.
"""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_bits_equal

import cupyquant as cq
from cupyquant import _block_scale, groupwise
from cupyquant import reference as ref

pytestmark = [pytest.mark.gpu, pytest.mark.large]

cupy = pytest.importorskip("cupy")

BF16 = np.dtype(ml_dtypes.bfloat16)
BIG = 1 << 32
CHUNK = 1 << 27  # elements per generation / reduction step (0.5 GB of float32 temporaries)
SAMPLES = 2048  # random rows (or windows) per test
TILES = 16  # random 128-row tiles per microscaling test
PEAK = 1000.0  # the planted max |x| (exact in bfloat16; the random values stay below 6.5 * 64)
TOL_BF16 = 2.0**-8  # matmul relative-error bound for bfloat16 (tests/test_weight.py gives the reasoning)


@pytest.fixture(autouse=True)
def _release_memory():
    yield
    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()


def _need(nbytes: int) -> None:
    free = cupy.cuda.Device().mem_info[0] + cupy.get_default_memory_pool().free_bytes()
    want = int(nbytes * 1.1) + (1 << 30)
    if free < want:
        pytest.skip(f"needs {want / 2**30:.1f} GiB of free device memory, {free / 2**30:.1f} GiB free")


# ------------------------------------------------------------------ inputs
def _random_bits(n: int, seed: int) -> cupy.ndarray:
    """uint16 bit patterns of ``n`` bfloat16 values made on the device: standard normal times 2^k
    (k uniform in [-6, 6]), truncated to bfloat16."""
    bits = cupy.empty((n,), dtype=np.uint16)
    rs = cupy.random.RandomState(seed)
    for s in range(0, n, CHUNK):
        m = min(CHUNK, n - s)
        f = rs.standard_normal(m, dtype=np.float32)
        f *= cupy.exp2(rs.randint(0, 13, m).astype(np.float32) - 6)
        bits[s : s + m] = (f.view(np.uint32) >> 16).astype(np.uint16)
        del f
    cupy.get_default_memory_pool().free_all_blocks()  # the chunk temporaries (~4 GB)
    return bits


def _plant_peak(bits: cupy.ndarray, index: int) -> None:
    bits[index] = int(np.array(PEAK, BF16).view(np.uint16))


def _amax_independent(bits: cupy.ndarray) -> np.float32:
    """max |x| of bfloat16 bits, as the max of the magnitude bits (no float arithmetic)."""
    top = 0
    for s in range(0, bits.size, CHUNK):
        top = max(top, int((bits[s : s + CHUNK] & 0x7FFF).max()))
    assert top < 0x7F80, "the generated input holds an inf or NaN"
    return np.float32(np.array([top], np.uint16).view(BF16)[0])


def _sample(n: int, k: int, seed: int, must=()) -> np.ndarray:
    """Sorted unique indices in [0, n): k random ones plus ``must`` (clipped into range)."""
    rng = np.random.default_rng(seed)
    idx = np.concatenate([rng.integers(0, n, k), np.asarray(list(must), dtype=np.int64)])
    return np.unique(np.clip(idx, 0, n - 1))


def _boundary_rows(K: int, rows: int):
    """The first and last rows and those holding elements 2^31 - 1, 2^31, 2^32 - 1 and 2^32."""
    return [0, 1, (2**31 - 1) // K, 2**31 // K, (2**32 - 1) // K, 2**32 // K, rows - 2, rows - 1]


def _rows(a: cupy.ndarray, rows) -> np.ndarray:
    """Rows of a 2-D device array, copied one by one (no device gather over the huge array)."""
    return np.stack([a[int(r)].get() for r in rows])


def _tiles(a: cupy.ndarray, tiles, n_rows: int) -> np.ndarray:
    return np.concatenate([a[int(t) * 128 : min(int(t) * 128 + 128, n_rows)].get() for t in tiles])


def _check(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert_bits_equal(got[name], want[name], name)


# ------------------------------------------------------------------ per-tensor FP8
def _fp8_case(offset: int, fmt: str):
    n = BIG + BIG // 4096 + 37 + offset  # 2^32 + 2^20 + 37: a 5-element tail after the 8-element units
    bits = _random_bits(n, seed=1 + offset)
    plant = n - 12345
    _plant_peak(bits, plant)
    amax_dev = _amax_independent(bits[offset:])
    x = bits.view(BF16)[offset:]  # offset 1: a 2-byte misaligned view takes the scalar paths
    m = x.size
    assert m > BIG
    q = cq.quantize_fp8(x, fmt)
    y = cq.dequantize(q)
    W = 256
    starts = _sample(
        m - W + 1, SAMPLES, seed=2, must=[0, 2**31 - W // 2, 2**32 - W // 2, plant - offset - W // 2, m - W]
    )
    xs = np.concatenate([x[s : s + W].get() for s in starts])
    got = {
        "q": np.concatenate([q.data[s : s + W].get() for s in starts]),
        "scale_inv": q.scale.get(),
        "amax": q.amax.get(),
        "independent amax": np.array([amax_dev], np.float32),
        "dequantized": np.concatenate([y[s : s + W].get() for s in starts]),
    }
    del x, q, y, bits
    # the windows plus the planted peak have the whole tensor's amax, so the dynamic reference
    # computes the same scale
    eq, es = ref.quantize_fp8(np.append(xs, np.array([PEAK], BF16)), fmt)
    want = {
        "q": eq[:-1],
        "scale_inv": es,
        "amax": np.array([PEAK], np.float32),
        "independent amax": np.array([PEAK], np.float32),
        "dequantized": ref.dequantize_fp8(got["q"], got["scale_inv"], fmt, BF16),
    }
    return got, want


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset1"])
def test_per_tensor(offset):
    _need(5 * (BIG + BIG // 4096))
    _check(*_fp8_case(offset, "float8_e4m3fn"))


# ------------------------------------------------------------------ per-group / per-token / SiLU*Mul
def _groupwise_case(shape, fmt, group_size, layout):
    K = shape[-1]
    n = int(np.prod(shape))
    n_rows = n // K
    assert n > BIG
    bits = _random_bits(n, seed=3)
    x = bits.view(BF16).reshape(shape)
    q = cq.quantize_groupwise(x, fmt, group_size=group_size, scale_layout=layout)
    y = cq.dequantize(q)
    M = shape[-2]
    B = n_rows // M
    rows = _sample(n_rows, SAMPLES, seed=4, must=_boundary_rows(K, n_rows) + [M - 1, M, 2 * M - 1, 2 * M])
    x2, q2, y2 = x.reshape(n_rows, K), q.data.reshape(n_rows, K), y.reshape(n_rows, K)
    xs = _rows(x2, rows)
    ng = 1 if group_size is None else K // group_size
    # scale words at the layout's offsets (README): row: (row * ng + g); col: each batch a
    # row-major (ng, M_pad) block, M_pad = round_up(M, 4), its padding words zero
    M_pad = -(-M // 4) * 4 if layout == "col" else M
    b, m = np.divmod(rows, M)
    g = np.arange(ng)
    words = b[:, None] * ng * M_pad + g[None, :] * M_pad + m[:, None] if layout == "col" else rows[:, None] * ng + g
    raw = cupy.ndarray((B * ng * M_pad,), np.uint32, memptr=q.scale.data)
    got = {
        "q": _rows(q2, rows),
        "scales": raw[cupy.asarray(words)].get(),
        "dequantized": _rows(y2, rows),
    }
    if layout == "col" and M_pad > M:
        pad = [bb * ng * M_pad + gg * M_pad + mm for bb in range(B) for gg in range(ng) for mm in range(M, M_pad)]
        got["col padding"] = raw[cupy.asarray(pad)].get()
    del x, q, y, bits, x2, q2, y2, raw
    eq, es = ref.quantize_groupwise(xs, fmt, group_size=group_size)
    want = {
        "q": eq,
        "scales": es.view(np.uint32),
        "dequantized": ref.dequantize_groupwise(
            got["q"], got["scales"].view(np.float32), fmt, BF16, group_size=group_size
        ),
    }
    if "col padding" in got:
        want["col padding"] = np.zeros_like(got["col padding"])
    return got, want


def _silu_case(H, fmt, group_size):
    rows_n = BIG // (2 * H) + 3
    n = rows_n * 2 * H
    bits = _random_bits(n, seed=5)
    x = bits.view(BF16).reshape(rows_n, 2 * H)
    q = cq.silu_mul_quantize(x, fmt, group_size=group_size)
    assert x.size > BIG and q.data.size > BIG // 2
    rows = _sample(rows_n, SAMPLES, seed=6, must=_boundary_rows(2 * H, rows_n) + _boundary_rows(H, rows_n))
    xs = _rows(x, rows)
    got = {"q": _rows(q.data, rows), "scales": _rows(q.scale, rows)}
    del x, q, bits
    # the fused intermediate of the sampled rows, from the same device function (CUDA's expf is
    # not correctly rounded; tests/test_groupwise.py checks that function against NumPy)
    r = groupwise._silu_mul_intermediate(cupy.asarray(xs))[0].get()
    eq, es = ref.quantize_silu_intermediate(r, fmt, group_size=group_size)
    return got, {"q": eq, "scales": es}


GROUP_CASES = {
    # 3 x 199729 x 7168: odd M, so the col layout pads each batch's groups by 3 words
    "col_3d_fp8_g128": lambda: _groupwise_case((3, -(-(BIG + 1) // (3 * 7168)), 7168), "float8_e4m3fn", 128, "col"),
    # per-token INT8 with an odd K: the scalar paths (quantize and dequantize)
    "token_int8_odd_k": lambda: _groupwise_case((BIG // 16383 + 2, 16383), "int8", None, "row"),
    # Llama's 14336: input 4.3e9 elements, output 2.1e9
    "silu_fp8_g128": lambda: _silu_case(14336, "float8_e4m3fn", 128),
}


@pytest.mark.parametrize("case", list(GROUP_CASES))
def test_groupwise(case):
    _need(5 * BIG + (1 << 30))
    _check(*GROUP_CASES[case]())


# ------------------------------------------------------------------ MXFP8 / MXFP4 / NVFP4
def _mx_case(fmt, rows_n, K, layout, nvfp4=False):
    n = rows_n * K
    assert n > BIG
    bits = _random_bits(n, seed=7)
    if nvfp4:
        _plant_peak(bits, max(0, rows_n - 1000) * K + 5)
        amax_dev = _amax_independent(bits)
    x = bits.view(BF16).reshape(rows_n, K)
    block = 16 if nvfp4 else 32
    q = cq.quantize_nvfp4(x, scale_layout=layout) if nvfp4 else cq.quantize_mx(x, fmt, scale_layout=layout)
    y = cq.dequantize(q)
    n_tiles = -(-rows_n // 128)
    tiles = _sample(n_tiles, TILES, seed=8, must=[r // 128 for r in _boundary_rows(K, rows_n)])
    nb = -(-K // block)
    xs = _tiles(x, tiles, rows_n)
    got = {"data": _tiles(q.data, tiles, rows_n), "dequantized": _tiles(y, tiles, rows_n)}
    if layout == "swizzled":
        T = -(-nb // 4) * 512  # bytes of one 128-row tile of the swizzled layout, padding included
        flat = q.scale.reshape(-1)
        got["scales"] = np.concatenate([flat[int(t) * T : int(t) * T + T].get() for t in tiles])
    else:
        got["scales"] = _tiles(q.scale, tiles, rows_n)
    if nvfp4:
        got["global_scale"] = q.global_scale.get()
        got["amax"] = q.amax.get()
        got["independent amax"] = np.array([amax_dev], np.float32)
    del x, q, y, bits
    # the reference per tile (the tiles are independent 128-row blocks of the layout)
    starts = np.concatenate([[0], np.cumsum([min(128, rows_n - t * 128) for t in tiles])])
    want = {"data": [], "scales": [], "dequantized": []}
    s_enc = ref.nvfp4_global_scale(PEAK) if nvfp4 else None
    for i in range(len(tiles)):
        xt = xs[starts[i] : starts[i + 1]]
        if nvfp4:
            d, s, g = ref.quantize_nvfp4(xt, global_scale=s_enc)
        else:
            d, s = ref.quantize_mx(xt, fmt)
        want["data"].append(d)
        want["scales"].append(ref.swizzle_scales(s).reshape(-1) if layout == "swizzled" else s)
        gd = got["data"][starts[i] : starts[i + 1]]
        if layout == "swizzled":
            gs = ref.unswizzle_scales(got["scales"][i * T : (i + 1) * T], (len(xt),), nb)
        else:
            gs = got["scales"][starts[i] : starts[i + 1]]
        if nvfp4:
            want["dequantized"].append(ref.dequantize_nvfp4(gd, gs, got["global_scale"], BF16, K=K))
        else:
            want["dequantized"].append(ref.dequantize_mx(gd, gs, fmt, BF16, K=K))
    want = {k: np.concatenate(v) for k, v in want.items()}
    if nvfp4:
        want["global_scale"] = np.array([s_enc], np.float32)
        want["amax"] = np.array([PEAK], np.float32)
        want["independent amax"] = np.array([PEAK], np.float32)
    return got, want


MX_CASES = {
    # MXFP4, 128x4 swizzled scales, 77 rows in the last tile; packed data 2.1e9 bytes
    "mxfp4_swizzled": lambda: _mx_case("float4_e2m1fn", BIG // 4096 + 77, 4096, "swizzled"),
    # MXFP8 with K = 1000: the scalar path and a partial last block in every row
    "mxfp8_dense_k1000": lambda: _mx_case("float8_e4m3fn", BIG // 1000 + 3, 1000, "dense"),
    # NVFP4 with the global amax reduced on the device; 129 blocks a row (a partial 4-column unit)
    "nvfp4_swizzled_dynamic": lambda: _mx_case(None, BIG // 2064 + 5, 2064, "swizzled", nvfp4=True),
    # NVFP4 in the wide geometry (_block_scale.GEOMETRY, set by test_mx): 77 rows in the last tile
    "nvfp4_swizzled_wide": lambda: _mx_case(None, BIG // 4096 + 77, 4096, "swizzled", nvfp4=True),
}


@pytest.mark.parametrize("case", list(MX_CASES))
def test_mx(case, monkeypatch):
    _need(5 * BIG + (1 << 30))
    if case.endswith("_wide"):
        monkeypatch.setattr(_block_scale, "GEOMETRY", "wide")
    _check(*MX_CASES[case]())


# ------------------------------------------------------------------ weights
def _weight_case(scheme, group_size):
    N, K = BIG // 8192 + 3, 8192  # 2^19 + 3 rows, 2^32 + 24576 elements; N > 65535 (the dequantizer's grid)
    assert N * K > BIG
    bits = _random_bits(N * K, seed=9)
    w = bits.view(BF16).reshape(N, K)
    sym = scheme != "uint4"
    qw = cq.quantize_weight(w, scheme, group_size=group_size, symmetric=sym)
    y = qw.dequantize()
    rows = _sample(N, SAMPLES, seed=10, must=_boundary_rows(K, N))
    ws = _rows(w, rows)
    got = {"data": _rows(qw.data, rows), "scales": _rows(qw.scale, rows), "dequantized": _rows(y, rows)}
    if qw.zeros is not None:
        got["zeros"] = _rows(qw.zero_point, rows)
    del w, y, bits
    gc.collect()
    # the matmul over all N output columns (each weight byte read), checked at the sampled ones
    rng = np.random.default_rng(11)
    errors = {}
    for M in (1, 16, 64):  # the decode path, and M = 64 for a large-M path
        a = rng.standard_normal((M, K)).astype(np.float32).astype(BF16)
        out = cq.matmul(cupy.asarray(a), qw)
        assert out.shape == (M, N)
        errors[M] = (a, out.get()[:, rows])
    del qw, out
    d, s, z = ref.quantize_weight(ws, scheme, group_size=group_size, symmetric=sym)
    want = {
        "data": d,
        "scales": s,
        "dequantized": ref.dequantize_weight(got["data"], got["scales"], got.get("zeros"), scheme, BF16),
    }
    if z is not None:
        want["zeros"] = z
    deq = want["dequantized"].astype(np.float64)
    rel = {}
    for M, (a, ym) in errors.items():
        exact = a.astype(np.float64) @ deq.T
        rel[M] = float(np.linalg.norm(ym.astype(np.float64) - exact) / np.linalg.norm(exact))
    return got, want, rel


@pytest.mark.parametrize(
    "scheme, group_size",
    [("int4", 128), ("uint4", 64), ("float8_e4m3fn", None)],
    ids=["int4_g128", "uint4_g64", "fp8_per_channel"],
)
def test_weight(scheme, group_size):
    _need(5 * BIG + (1 << 30))
    got, want, rel = _weight_case(scheme, group_size)
    _check(got, want)
    for M, err in rel.items():
        assert err <= TOL_BF16, f"matmul M={M}: relative error {err:.3g} over the sampled columns > {TOL_BF16:.3g}"
