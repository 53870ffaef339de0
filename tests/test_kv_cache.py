"""FP8 paged KV-cache writes and reads: the reference against hand-worked bytes, argument checks
without a GPU, and the GPU op byte for byte against the reference."""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest
from _pdl import assert_rounds_equal, check_rounds
from conftest import assert_bits_equal, heavy_tailed, poisoned, require_arch, side_stream

import cupyquant as cq
from cupyquant import _launch
from cupyquant import kv_cache as kvc
from cupyquant import reference as ref

BF16 = np.dtype(ml_dtypes.bfloat16)
IN_DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
FORMATS = ["float8_e4m3fn", "float8_e5m2"]
KV_LAYOUTS = ["NHD", "HND"]
QMAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def _id(v):
    return np.dtype(v).name if not isinstance(v, (str, tuple, int)) else str(v)


def _cache_shape(blocks, block_size, heads, head_dim, kv_layout):
    return (blocks, block_size, heads, head_dim) if kv_layout == "NHD" else (blocks, heads, block_size, head_dim)


# ------------------------------------------------------------------ the reference, by hand
def test_reference_static_bytes_and_slots():
    # 2 blocks of 2 slots, 1 head of 4: token 0 -> slot 3 (block 1, offset 1), token 1 -> hole,
    # token 2 -> slot 0, token 3 -> slot 4 (past the cache: skipped)
    key = np.array([[[1.0, -2.0, 3.0, 1000.0]], [[9.0, 9.0, 9.0, 9.0]], [[np.nan, -np.inf, 0.0, -0.0]]], np.float32)
    key = np.concatenate([key, key[:1]])
    value = -key
    kc = np.full((2, 2, 1, 4), 0x11, np.uint8)
    vc = np.full((2, 2, 1, 4), 0x22, np.uint8)
    slots = np.array([3, -1, 0, 4], np.int32)
    k2, v2, ks, vs = ref.quantize_kv_cache(key, value, kc, vc, slots, scale_k=0.5, scale_v=np.array([2.0], np.float32))
    assert ks is None and vs is None
    # key / 0.5 = 2, -4, 6, 2000 (saturates to 448) -> E4M3 0x40, 0xc8, 0x4c, 0x7e
    assert list(k2[1, 1, 0]) == [0x40, 0xC8, 0x4C, 0x7E]
    # NaN -> 0x7f, -inf -> -448 (0xfe), 0, -0
    assert list(k2[0, 0, 0]) == [0x7F, 0xFE, 0x00, 0x80]
    # value / 2 = -0.5, 1, -1.5, -500 -> 0xb0, 0x38, 0xbc, 0xfe
    assert list(v2[1, 1, 0]) == [0xB0, 0x38, 0xBC, 0xFE]
    assert (k2[0, 1] == 0x11).all() and (k2[1, 0] == 0x11).all() and (v2[0, 1] == 0x22).all()
    assert (kc == 0x11).all(), "the reference returns copies"


def test_reference_dynamic_bytes_and_scales():
    key = np.array([[[1.0, -3.0, 2.0, np.nan]], [[0.0, -0.0, 0.0, 0.0]]], np.float32)
    kc = np.zeros((1, 1, 2, 4), np.uint8)  # HND: [blocks, heads, block_size, head_dim]
    ksc = np.full((1, 1, 2), -1.0, np.float32)
    out = ref.quantize_kv_cache(
        key,
        key,
        kc,
        kc,
        np.array([1, 0], np.int64),
        scale_k="dynamic",
        scale_v="dynamic",
        kv_layout="HND",
        key_scale_cache=ksc,
        value_scale_cache=ksc,
    )
    k2, _, ks, _ = out
    s = np.float32(3) / np.float32(448)
    assert ks[0, 0, 1] == s
    # 1 / s = 149.33 -> 144 (0x71); -3 / s = -448 (0xfe); 2 / s = 298.67 -> 288 (0x79); NaN -> +448
    assert list(k2[0, 0, 1]) == [0x71, 0xFE, 0x79, 0x7E]
    # an all-zero row: the floor scale 1 / (448 * 512), zero bytes (with -0 kept)
    assert ks[0, 0, 0] == np.float32(1) / np.float32(448 * 512)
    assert list(k2[0, 0, 0]) == [0, 0x80, 0, 0]


def test_reference_dequantize_by_hand():
    cache = np.zeros((3, 2, 2, 2), np.uint8)  # NHD: 3 blocks of 2 slots, 2 heads of 2
    cache[2, 1, 1] = [0x38, 0xC0]  # 1.0, -2.0
    cache[2, 0, 0] = [0x7F, 0x40]  # NaN, 2.0
    y = ref.dequantize_kv_cache(
        cache, np.array([2, 7], np.int32), scale=np.array([0.5, 4.0], np.float32), out_dtype=np.float32
    )
    assert y.shape == (2, 2, 2, 2)
    np.testing.assert_array_equal(y[0, 1, 1], [4.0, -8.0])  # head 1: scale 4
    assert np.isnan(y[0, 0, 0, 0]) and y[0, 0, 0, 1] == 1.0  # head 0: scale 0.5
    assert np.isnan(y[1]).all() and (y[1].view(np.uint32) == 0x7FFFFFFF).all()  # id 7 is past the cache
    sc = np.full((3, 2, 2), 0.25, np.float32)
    y2 = ref.dequantize_kv_cache(cache, np.array([2], np.int64), scale="dynamic", scale_cache=sc, out_dtype=np.float16)
    assert y2.dtype == np.float16 and y2[0, 1, 1, 1] == -0.5


def test_reference_hnd_is_nhd_transposed():
    rng = np.random.default_rng(0)
    key = rng.standard_normal((9, 3, 8)).astype(np.float32)
    slots = rng.permutation(20)[:9].astype(np.int32)
    slots[2] = -1
    nhd = np.zeros((5, 4, 3, 8), np.uint8)
    kn, _, _, _ = ref.quantize_kv_cache(key, key, nhd, nhd, slots, scale_k=0.1, scale_v=0.1)
    kh, _, _, _ = ref.quantize_kv_cache(
        key,
        key,
        nhd.transpose(0, 2, 1, 3).copy(),
        nhd.transpose(0, 2, 1, 3).copy(),
        slots,
        scale_k=0.1,
        scale_v=0.1,
        kv_layout="HND",
    )
    np.testing.assert_array_equal(kh, kn.transpose(0, 2, 1, 3))
    yn = ref.dequantize_kv_cache(kn, np.array([1, 0]), scale=0.1, out_dtype=np.float32)
    yh = ref.dequantize_kv_cache(kh, np.array([1, 0]), scale=0.1, out_dtype=np.float32, kv_layout="HND")
    np.testing.assert_array_equal(yh, yn.transpose(0, 2, 1, 3))


def test_reference_repeated_slot_keeps_the_last_token():
    key = np.array([[[1.0]], [[2.0]]], np.float32)
    kc = np.zeros((1, 1, 1, 1), np.uint8)
    k2, _, _, _ = ref.quantize_kv_cache(key, key, kc, kc, np.array([0, 0], np.int32), scale_k=1.0, scale_v=1.0)
    assert k2[0, 0, 0, 0] == 0x40


# ------------------------------------------------------------------ checks without a GPU
def _host_args(kv_layout="NHD"):
    key = np.zeros((4, 2, 8), np.float32)
    cache = np.zeros(_cache_shape(3, 4, 2, 8, kv_layout), np.uint8)
    return key, key, cache, cache.copy(), np.arange(4, dtype=np.int32)


@pytest.mark.parametrize(
    "kw, exc, arg",
    [
        (dict(kv_layout="NDH"), ValueError, "kv_layout"),
        (dict(dtype="int8"), ValueError, "dtype"),
        (dict(scale_k="dynamik", scale_v="dynamic"), ValueError, "scale_k"),
        (dict(scale_k="dynamic"), ValueError, "scale_k and scale_v"),
        (dict(scale_k=-1.0), ValueError, "scale_k"),
        (dict(scale_v=float("nan")), ValueError, "scale_v"),
        (dict(scale_v=None), TypeError, "scale_v"),
        (dict(scale_k=np.ones(3, np.float32)), ValueError, "scale_k"),
        (dict(scale_k=np.ones(2, np.float64)), TypeError, "scale_k"),
        (dict(scale_k="dynamic", scale_v="dynamic"), ValueError, "key_scale_cache"),
        (dict(key_scale_cache=np.zeros((3, 4, 2), np.float32)), ValueError, "key_scale_cache"),
    ],
)
def test_reference_refuses_bad_options(kw, exc, arg):
    kw = dict(dict(scale_k=1.0, scale_v=1.0), **kw)
    with pytest.raises(exc, match=f"^{arg}"):
        ref.quantize_kv_cache(*_host_args(), **kw)


def test_reference_refuses_bad_arrays():
    key, value, kc, vc, slots = _host_args()
    s = dict(scale_k=1.0, scale_v=1.0)
    cases = [
        ((key.astype(np.float64), value, kc, vc, slots), TypeError, "key"),
        ((key[0], value, kc, vc, slots), ValueError, "key"),
        ((key, value[:, :1], kc, vc, slots), ValueError, "value"),
        ((key, value.astype(np.float16), kc, vc, slots), TypeError, "value"),
        ((key, value, kc.astype(np.int8), vc, slots), TypeError, "key_cache"),
        ((key, value, kc[0], vc, slots), ValueError, "key_cache"),
        ((key, value, kc, vc[:1], slots), ValueError, "value_cache"),
        ((key, value, kc[:, :, :1], vc[:, :, :1], slots), ValueError, "key_cache"),
        ((key, value, kc, vc, slots.astype(np.float32)), TypeError, "slot_mapping"),
        ((key, value, kc, vc, np.arange(5, dtype=np.int32)), ValueError, "slot_mapping"),
        ((key, value, kc, vc, slots[None]), ValueError, "slot_mapping"),
    ]
    for args, exc, arg in cases:
        with pytest.raises(exc, match=f"^{arg}"):
            ref.quantize_kv_cache(*args, **s)
    with pytest.raises(TypeError, match="^key_scale_cache"):
        sc = np.zeros((3, 4, 2), np.float64)
        ref.quantize_kv_cache(
            *_host_args(), scale_k="dynamic", scale_v="dynamic", key_scale_cache=sc, value_scale_cache=sc
        )
    with pytest.raises(ValueError, match="^scale_cache"):
        ref.dequantize_kv_cache(kc, np.zeros(1, np.int32), scale="dynamic")
    with pytest.raises(ValueError, match="^cache_dtype"):
        ref.dequantize_kv_cache(kc, np.zeros(1, np.int32), scale=1.0, cache_dtype="int8")
    with pytest.raises(TypeError, match="^out_dtype"):
        ref.dequantize_kv_cache(kc, np.zeros(1, np.int32), scale=1.0, out_dtype=np.int32)


_W = dict(scale_k=1.0, scale_v=1.0)


@pytest.mark.parametrize(
    "fn, kw, exc, arg",
    [
        ("write", _W, TypeError, "key"),  # NumPy arrays where the op takes CuPy ones
        ("write", dict(_W, kv_layout="nhd"), ValueError, "kv_layout"),
        ("write", dict(_W, dtype="float16"), ValueError, "dtype"),
        ("write", dict(_W, check_slots=1), TypeError, "check_slots"),
        ("read", dict(scale=1.0), TypeError, "cache"),
        ("read", dict(scale=1.0, kv_layout="HDN"), ValueError, "kv_layout"),
        ("read", dict(scale=1.0, out_dtype="int8"), TypeError, "out_dtype"),
        ("read", dict(scale=1.0, cache_dtype="e4m3"), ValueError, "cache_dtype"),
        ("empty_scales", {}, TypeError, "cache"),
        ("scales_shape", dict(cache_shape=(3, 4, 2)), ValueError, "cache_shape"),
        ("scales_shape", dict(cache_shape=(3, 4, 2, 8), kv_layout="XYZ"), ValueError, "kv_layout"),
    ],
)
def test_op_checks_without_a_gpu(fn, kw, exc, arg):
    # the options are checked before the arrays, so these raise on a machine without a GPU
    key, value, kc, vc, slots = _host_args()
    calls = {
        "write": lambda: cq.quantize_kv_cache(key, value, kc, vc, slots, **kw),
        "read": lambda: cq.dequantize_kv_cache(kc, slots, **kw),
        "empty_scales": lambda: cq.empty_kv_scale_cache(kc),
        "scales_shape": lambda: kvc.kv_scale_cache_shape(**kw),
    }
    with pytest.raises(exc, match=f"^{arg}"):
        calls[fn]()


def test_launch_structs_and_teams():
    # KVWriteArgs: 12 int64 and 10 int32; KVReadArgs: 2 int64 and 10 int32 (kernels/kv_cache.cu)
    assert kvc._WRITE_ARGS.itemsize == 136 and kvc._READ_ARGS.itemsize == 56
    assert [kvc._log2_or_minus1(n) for n in (1, 2, 8, 12, 16, 0)] == [0, 1, 3, -1, 4, -1]
    assert kvc.kv_scale_cache_shape((7, 16, 8, 128), "NHD") == (7, 16, 8)
    assert kvc.kv_scale_cache_shape((7, 8, 16, 128), "HND") == (7, 8, 16)
    # lanes per row: two 8-element units per lane (vector), eight elements (scalar), at most 32
    assert [1 << kvc._team_log2(u, True) for u in (1, 2, 3, 16, 72, 1000)] == [1, 1, 2, 8, 32, 32]
    assert [1 << kvc._team_log2(u, False) for u in (1, 8, 9, 100, 300)] == [1, 1, 2, 16, 32]


def test_write_planner_takes_the_wide_kernel_where_it_applies(monkeypatch):
    """kv_cache.wide_applies and write_path: "wide" for static scales, head_dim % 16 == 0 up to 512
    and 16-byte alignment, "units8" otherwise; WRITE_PATH forces them, a bad value raises ValueError
    naming the knob."""
    ok = dict(dynamic=False, head_dim=128, x_aligned=True, cache_ptrs=(256, 4096))
    assert kvc.wide_applies(**ok)
    for head_dim in (16, 48, 80, 512):
        assert kvc.wide_applies(**dict(ok, head_dim=head_dim)), head_dim
    for bad in (
        dict(dynamic=True),
        dict(head_dim=72),
        dict(head_dim=8),
        dict(head_dim=528),
        dict(head_dim=0),
        dict(x_aligned=False),
        dict(cache_ptrs=(256, 4104)),
        dict(cache_ptrs=(264, 4096)),
    ):
        assert not kvc.wide_applies(**dict(ok, **bad)), bad
    many, few = kvc.WIDE_FROM_ROWS, kvc.WIDE_FROM_ROWS - 1
    assert kvc.write_path(True, many) == "wide"
    assert kvc.write_path(True, few) == "units8"
    assert kvc.write_path(False, many) == "units8"
    monkeypatch.setattr(kvc, "WRITE_PATH", "units8")
    assert kvc.write_path(True, many) == "units8"
    monkeypatch.setattr(kvc, "WRITE_PATH", "wide")
    assert kvc.write_path(True, 1) == "wide" and kvc.write_path(False, many) == "units8"
    monkeypatch.setattr(kvc, "WRITE_PATH", "narrow")
    with pytest.raises(ValueError, match="^kv_cache.WRITE_PATH"):
        kvc.write_path(True, many)
    assert set(kvc.WRITE_PATHS) == {"units8", "wide"}


# ------------------------------------------------------------------ the GPU op against the reference
def _cupy():
    return pytest.importorskip("cupy")


def _fused_views(cupy, tokens, heads, head_dim, dtype, seed, q_heads=2):
    """key and value as strided views of a fused qkv [tokens, q_heads + 2 heads, head_dim], and
    their host copies."""
    qkv_h = heavy_tailed((tokens, q_heads + 2 * heads, head_dim), seed, dtype)
    qkv = cupy.asarray(qkv_h)
    key = qkv[:, q_heads : q_heads + heads]
    value = qkv[:, q_heads + heads :]
    return key, value, qkv_h[:, q_heads : q_heads + heads], qkv_h[:, q_heads + heads :]


def _slots(rng, n, num_slots, slot_dtype):
    """A random mapping of n tokens into distinct slots, with holes (-1, -7) and slots past the
    cache."""
    s = rng.permutation(max(n, num_slots))[:n].astype(np.int64)  # slots >= num_slots: past the cache
    holes = rng.random(n)
    s[holes < 0.15] = -1
    s[(holes >= 0.15) & (holes < 0.2)] = -7
    s[(holes >= 0.2) & (holes < 0.25)] = num_slots + rng.integers(0, 1000, n)[(holes >= 0.2) & (holes < 0.25)]
    if n > 3:
        s[3] = np.iinfo(slot_dtype).max  # far past the cache
    return s.astype(slot_dtype)


def _scale_arg(cupy, mode, heads, seed, which):
    """(op argument, reference argument) of a scale mode."""
    rng = np.random.default_rng(seed + which)
    if mode == "float":
        return (0.0625, 0.0625) if which == 0 else (1.5, 1.5)
    if mode == "tensor":
        h = np.array([rng.uniform(0.01, 2.0)], np.float32)
        return cupy.asarray(h), h
    if mode == "head":
        h = rng.uniform(0.01, 2.0, heads).astype(np.float32)
        return cupy.asarray(h), h
    return "dynamic", "dynamic"


def _run_both(cupy, key, value, kh, vh, slots, *, fmt, kv_layout, mode, blocks, block_size, seed):
    """Write with the op into pre-filled caches and with the reference into copies; compare every
    byte of both caches (and both scale caches)."""
    tokens, heads, head_dim = key.shape
    rng = np.random.default_rng(seed)
    shape = _cache_shape(blocks, block_size, heads, head_dim, kv_layout)
    pre = [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(2)]
    kc, vc = cupy.asarray(pre[0]), cupy.asarray(pre[1])
    sk, sk_h = _scale_arg(cupy, mode, heads, seed, 0)
    sv, sv_h = _scale_arg(cupy, mode, heads, seed, 1)
    kw, ref_kw = {}, {}
    if mode == "dynamic":
        ksc, vsc = cq.empty_kv_scale_cache(kc, kv_layout), cq.empty_kv_scale_cache(vc, kv_layout)  # poisoned
        kw = dict(key_scale_cache=ksc, value_scale_cache=vsc)
        ref_kw = dict(key_scale_cache=ksc.get(), value_scale_cache=vsc.get())
    slots_d = cupy.asarray(slots)
    cq.quantize_kv_cache(key, value, kc, vc, slots_d, scale_k=sk, scale_v=sv, dtype=fmt, kv_layout=kv_layout, **kw)
    ek, ev, eks, evs = ref.quantize_kv_cache(
        kh, vh, pre[0], pre[1], slots, scale_k=sk_h, scale_v=sv_h, dtype=fmt, kv_layout=kv_layout, **ref_kw
    )
    assert_bits_equal(kc, ek, "key_cache")
    assert_bits_equal(vc, ev, "value_cache")
    if mode == "dynamic":
        assert_bits_equal(kw["key_scale_cache"], eks, "key_scale_cache")
        assert_bits_equal(kw["value_scale_cache"], evs, "value_scale_cache")
    return kc, vc


#: The WRITE_PATH values of the static write, forced in turn
WRITE_PATHS = ["units8", "wide"]


def _force_path(monkeypatch, path):
    monkeypatch.setattr(kvc, "WRITE_PATH", path)


def _write_kernels(fn):
    """The names of the kernels that fn() launches."""
    with _launch.recording() as rec:
        fn()
    return [r[0].name for r in rec if r[5] is not None]


@pytest.mark.gpu
@pytest.mark.parametrize("path", WRITE_PATHS)
@pytest.mark.parametrize("mode", ["float", "tensor", "head", "dynamic"])
@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
def test_write_matches_reference(in_dtype, fmt, kv_layout, mode, path, monkeypatch):
    """Each write path forced in turn (dynamic scales take kv_cache_write on every path), into
    pre-filled caches, bit for bit the reference: 3 heads, padding tokens, holes, slots past the
    cache, int32 and int64 slots."""
    cupy = _cupy()
    _force_path(monkeypatch, path)
    seed = zlib.crc32(repr((np.dtype(in_dtype).name, fmt, kv_layout, mode)).encode())
    rng = np.random.default_rng(seed)
    tokens, heads, head_dim, blocks, block_size = 301, 3, 128, 29, 16
    key, value, kh, vh = _fused_views(cupy, tokens, heads, head_dim, in_dtype, seed)
    slot_dtype = np.int64 if seed % 2 else np.int32
    slots = _slots(rng, tokens - 5, blocks * block_size, slot_dtype)  # the last 5 tokens: padding
    if mode != "dynamic":  # the forced kernel is the one launched
        kc = cupy.zeros((blocks, block_size, heads, head_dim), np.uint8)
        names = _write_kernels(
            lambda: cq.quantize_kv_cache(key, value, kc, kc.copy(), cupy.asarray(slots), scale_k=1.0, scale_v=1.0)
        )
        assert len(names) == 1 and ("write_wide" in names[0]) == (path == "wide"), (path, names)
    _run_both(
        cupy,
        key,
        value,
        kh,
        vh,
        slots,
        fmt=fmt,
        kv_layout=kv_layout,
        mode=mode,
        blocks=blocks,
        block_size=block_size,
        seed=seed,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("path", WRITE_PATHS)
@pytest.mark.parametrize("mode", ["head", "dynamic"])
@pytest.mark.parametrize("in_dtype", [np.float32, ml_dtypes.bfloat16], ids=_id)
# 1, 100, 300: the scalar path (300 dynamic: two passes over the row); 72: vector, 9 units on 8
# lanes; 1032: vector, three passes; wide where static: 16 (one lane a row), 48 (3 lanes of a team
# of 4), 80 (5 of 8), 512 (32 lanes); 72, 1032 and the scalar ones fall back to kv_cache_write
@pytest.mark.parametrize("head_dim", [1, 16, 48, 72, 80, 100, 300, 512, 1032])
def test_odd_head_dims(head_dim, in_dtype, mode, path, monkeypatch):
    cupy = _cupy()
    _force_path(monkeypatch, path)
    seed = zlib.crc32(repr((head_dim, np.dtype(in_dtype).name, mode)).encode())
    rng = np.random.default_rng(seed)
    tokens, heads, blocks, block_size = 41, 2, 7, 5  # block_size not a power of two
    key, value, kh, vh = _fused_views(cupy, tokens, heads, head_dim, in_dtype, seed, q_heads=1)
    slots = _slots(rng, tokens, blocks * block_size, np.int64)
    for kv_layout in KV_LAYOUTS:
        _run_both(
            cupy,
            key,
            value,
            kh,
            vh,
            slots,
            fmt="float8_e4m3fn",
            kv_layout=kv_layout,
            mode=mode,
            blocks=blocks,
            block_size=block_size,
            seed=seed,
        )


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [1, 3])
def test_misaligned_views_take_the_scalar_path(offset):
    cupy = _cupy()
    base_h = heavy_tailed((40 * 2 * 64 + offset,), offset, BF16)
    base = cupy.asarray(base_h)
    key = base[offset:].reshape(40, 2, 64)  # not 16-byte aligned
    kh = base_h[offset:].reshape(40, 2, 64)
    slots = _slots(np.random.default_rng(offset), 40, 48, np.int32)
    for mode in ("head", "dynamic"):
        _run_both(
            cupy,
            key,
            key,
            kh,
            kh,
            slots,
            fmt="float8_e5m2",
            kv_layout="NHD",
            mode=mode,
            blocks=3,
            block_size=16,
            seed=offset,
        )


@pytest.mark.gpu
@pytest.mark.parametrize("path", WRITE_PATHS)
@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
def test_wide_path_falls_back_on_misaligned_caches(kv_layout, path, monkeypatch):
    """Caches 8 bytes off 16-byte alignment (C-contiguous views into a larger buffer): the write
    takes kv_cache_write whatever WRITE_PATH asks, and still writes the reference's bytes; aligned
    caches take the forced path. Poisoned caches, skipped slots, per-head device scales."""
    cupy = _cupy()
    _force_path(monkeypatch, path)
    tokens, heads, head_dim, blocks, block_size = 53, 3, 64, 5, 16
    seed = zlib.crc32(repr(("misaligned", kv_layout, path)).encode())
    key, value, kh, vh = _fused_views(cupy, tokens, heads, head_dim, BF16, seed)
    slots_h = _slots(np.random.default_rng(seed), tokens, blocks * block_size, np.int32)
    shape = _cache_shape(blocks, block_size, heads, head_dim, kv_layout)
    n = int(np.prod(shape))
    s_h = np.random.default_rng(seed).uniform(0.01, 2.0, (2, heads)).astype(np.float32)
    sk, sv = cupy.asarray(s_h[0]), cupy.asarray(s_h[1])
    for offset, wide in ((8, False), (16, path == "wide")):
        bufs = [poisoned((n + 32,), np.uint8) for _ in range(2)]
        kc, vc = (b[offset : offset + n].reshape(shape) for b in bufs)
        assert (kc.data.ptr % 16 == 0) == (offset == 16)
        pre = kc.get(), vc.get()
        names = _write_kernels(
            lambda: cq.quantize_kv_cache(
                key, value, kc, vc, cupy.asarray(slots_h), scale_k=sk, scale_v=sv, kv_layout=kv_layout
            )
        )
        assert len(names) == 1 and ("write_wide" in names[0]) == wide, (offset, path, names)
        ek, ev, _, _ = ref.quantize_kv_cache(kh, vh, pre[0], pre[1], slots_h, scale_k=s_h[0], scale_v=s_h[1],
                                             kv_layout=kv_layout)  # fmt: skip
        assert_bits_equal(kc, ek, f"key_cache at offset {offset}")
        assert_bits_equal(vc, ev, f"value_cache at offset {offset}")
        for b in bufs:  # nothing outside the view
            assert (b[:offset].get() == 0xFF).all() and (b[offset + n :].get() == 0xFF).all()


@pytest.mark.gpu
def test_planner_pick_is_what_launches(monkeypatch):
    """With WRITE_PATH unset, the write launches the planner's kernel: kv_cache_write_wide with one
    row a lane (its grid) for static scales on aligned arrays from WIDE_FROM_ROWS rows up,
    kv_cache_write below, for dynamic scales, a head_dim that 16 does not divide and x off 16-byte
    alignment."""
    cupy = _cupy()
    monkeypatch.setattr(kvc, "WRITE_PATH", None)

    def launched(key, value, kc, **kw):
        kw = kw or dict(scale_k=0.5, scale_v=0.25)
        slots = cupy.arange(key.shape[0], dtype=np.int64)
        with _launch.recording() as rec:
            cq.quantize_kv_cache(key, value, kc, kc.copy(), slots, **kw)
        [(name, grid)] = [(r[0].name, r[1]) for r in rec if r[5] is not None]
        return name, grid

    tokens = -(-kvc.WIDE_FROM_ROWS // 8)  # 8 heads: the planner's line
    key, value, _, _ = _fused_views(cupy, tokens, 8, 128, BF16, 11)
    kc = cupy.zeros((19, 16, 8, 128), np.uint8)
    name, grid = launched(key, value, kc)
    assert "write_wide" in name, name
    rows_per_block = 256 // 8  # teams of 8 lanes at head_dim 128, one row each
    assert tuple(grid)[:2] == (-(-tokens * 8 // rows_per_block), 2), grid
    name, _ = launched(key[: tokens - 1], value[: tokens - 1], kc)  # below the line
    assert "write_wide" not in name and "kv_cache_write" in name, name
    sc = cq.empty_kv_scale_cache(kc)
    name, _ = launched(key, value, kc, scale_k="dynamic", scale_v="dynamic", key_scale_cache=sc,
                       value_scale_cache=cq.empty_kv_scale_cache(kc))  # fmt: skip
    assert "write_wide" not in name and "kv_cache_write" in name, name
    k72, v72, _, _ = _fused_views(cupy, 40, 2, 72, BF16, 12)
    name, _ = launched(k72, v72, cupy.zeros((3, 16, 2, 72), np.uint8))
    assert "write_wide" not in name and "kv_cache_write" in name, name
    base = cupy.zeros(40 * 2 * 64 + 4, dtype=BF16)
    off = base[4:].reshape(40, 2, 64)  # 8 bytes off 16-byte alignment
    name, _ = launched(off, off, cupy.zeros((3, 16, 2, 64), np.uint8))
    assert "write_wide" not in name and "kv_cache_write" in name, name


def _special_rows(in_dtype, fmt, scale):
    """Rows of 16 holding 0, -0, subnormals of the input dtype, FP8 max * scale, overflow, inf, NaN;
    then an all-zero, an all-NaN, an inf row and one of subnormals only (for the dynamic scale)."""
    info = np.finfo(np.float16) if np.dtype(in_dtype) == np.float16 else np.finfo(np.float32)
    tiny, small, big = float(info.smallest_subnormal), float(info.smallest_normal), float(info.max)
    fmax = QMAX[fmt] * scale
    v = [0.0, -0.0, tiny, -3 * tiny, small * 0.75, small, fmax, -fmax, fmax * 1.06, -fmax * 4, big, -big]
    v += [np.inf, -np.inf, np.nan, 1.0]
    rows = [v, v[::-1], [0.0] * 16, [np.nan] * 16, [np.inf] + [1.0] * 15, [tiny, -small * 0.5] * 8]
    with np.errstate(over="ignore"):
        return np.array(rows, np.float32).astype(in_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["float", "dynamic"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
def test_special_values(in_dtype, fmt, mode):
    cupy = _cupy()
    rows = _special_rows(in_dtype, fmt, 0.0625)  # the "float" key scale
    heads = 2
    kh = np.stack([rows, rows[::-1]], axis=1)  # [6 tokens, 2 heads, 16]
    vh = -kh
    key, value = cupy.asarray(kh), cupy.asarray(vh)
    slots = np.array([5, 0, 3, 9, 1, 7], np.int32)
    for kv_layout in KV_LAYOUTS:
        _run_both(
            cupy, key, value, kh, vh, slots, fmt=fmt, kv_layout=kv_layout, mode=mode, blocks=3, block_size=4, seed=heads
        )


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["head", "dynamic"])
@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("out_dtype", IN_DTYPES, ids=_id)
def test_dequantize_matches_reference(out_dtype, fmt, kv_layout, mode):
    cupy = _cupy()
    seed = zlib.crc32(repr((np.dtype(out_dtype).name, fmt, kv_layout, mode)).encode())
    rng = np.random.default_rng(seed)
    blocks, block_size, heads, head_dim = 13, 16, 3, 72 if mode == "head" else 100
    shape = _cache_shape(blocks, block_size, heads, head_dim, kv_layout)
    ch = rng.integers(0, 256, shape, dtype=np.uint8)  # every bit pattern, NaNs included
    cache = cupy.asarray(ch)
    ids_h = np.array([4, 0, 12, -1, 13, 4, 7], np.int64 if seed % 2 else np.int32)  # -1, 13: NaN blocks
    if mode == "dynamic":
        # scales from 1e-35 to 5e34: products go subnormal and overflow to inf
        sc_h = np.exp(rng.uniform(-80, 80, shape[:3])).astype(np.float32)
        scale, scale_h, kw, rkw = "dynamic", "dynamic", dict(scale_cache=cupy.asarray(sc_h)), dict(scale_cache=sc_h)
    else:
        scale_h = rng.uniform(0.01, 2.0, heads).astype(np.float32)
        scale, kw, rkw = cupy.asarray(scale_h), {}, {}
    y = cq.dequantize_kv_cache(
        cache, cupy.asarray(ids_h), scale=scale, kv_layout=kv_layout, out_dtype=out_dtype, cache_dtype=fmt, **kw
    )
    e = ref.dequantize_kv_cache(
        ch, ids_h, scale=scale_h, kv_layout=kv_layout, out_dtype=out_dtype, cache_dtype=fmt, **rkw
    )
    assert y.dtype == np.dtype(out_dtype) and y.shape == e.shape
    assert_bits_equal(y, e, "dequantized")
    out = poisoned(e.shape, out_dtype)
    y2 = cq.dequantize_kv_cache(
        cache,
        cupy.asarray(ids_h),
        scale=scale,
        kv_layout=kv_layout,
        out_dtype=out_dtype,
        cache_dtype=fmt,
        out=out,
        **kw,
    )
    assert y2 is out
    assert_bits_equal(out, e, "dequantized into out")


@pytest.mark.gpu
def test_round_trip_through_the_cache():
    cupy = _cupy()
    key, value, kh, vh = _fused_views(cupy, 64, 4, 128, BF16, 3)
    kc = cupy.zeros((4, 16, 4, 128), np.uint8)
    vc = cupy.zeros_like(kc)
    ksc, vsc = cq.empty_kv_scale_cache(kc), cq.empty_kv_scale_cache(vc)
    slots = cupy.arange(64, dtype=np.int32)
    cq.quantize_kv_cache(
        key, value, kc, vc, slots, scale_k="dynamic", scale_v="dynamic", key_scale_cache=ksc, value_scale_cache=vsc
    )
    y = cq.dequantize_kv_cache(kc, cupy.arange(4), scale="dynamic", scale_cache=ksc, out_dtype=np.float32)
    x = kh.astype(np.float32).reshape(4, 16, 4, 128)
    err = np.abs(y.get() - x) / np.abs(x).max(axis=-1, keepdims=True)
    assert err.max() <= 2.0**-4  # E4M3: 3 mantissa bits


@pytest.mark.gpu
def test_check_slots_refuses_before_writing():
    cupy = _cupy()
    key, value, _, _ = _fused_views(cupy, 8, 2, 16, np.float16, 4)
    kc = poisoned((2, 4, 2, 16), np.uint8)
    vc = poisoned((2, 4, 2, 16), np.uint8)
    for bad, what in (([0, 1, 2, 3, -1, 5, 1, 7], "repeats slot 1"), ([0, 1, 2, 8, -1, 5, 6, 7], r"\[3\] = 8 is past")):
        slots = cupy.asarray(np.array(bad, np.int32))
        before = kc.get(), vc.get()
        with pytest.raises(ValueError, match=f"^slot_mapping ?{what}"):
            cq.quantize_kv_cache(key, value, kc, vc, slots, scale_k=1.0, scale_v=1.0, check_slots=True)
        assert (kc.get() == before[0]).all() and (vc.get() == before[1]).all()
        cq.quantize_kv_cache(key, value, kc, vc, slots, scale_k=1.0, scale_v=1.0)  # unchecked: no error
    ok = cupy.asarray(np.array([0, 1, -1, -1, 4, 5, 6, 7], np.int64))
    cq.quantize_kv_cache(key, value, kc, vc, ok, scale_k=1.0, scale_v=1.0, check_slots=True)


@pytest.mark.gpu
def test_cuda_graph_capture_replays_and_no_sync():
    cupy = _cupy()
    import cupyx

    tokens, heads, head_dim, blocks, bs = 50, 2, 128, 8, 16
    key, value, _, _ = _fused_views(cupy, tokens, heads, head_dim, BF16, 5)
    kc, vc = cupy.zeros((blocks, bs, heads, head_dim), np.uint8), cupy.zeros((blocks, bs, heads, head_dim), np.uint8)
    ksc, vsc = cq.empty_kv_scale_cache(kc), cq.empty_kv_scale_cache(vc)
    kc2, vc2 = cupy.zeros_like(kc), cupy.zeros_like(vc)
    s_head = cupy.asarray(np.array([0.5, 0.25], np.float32))
    slots = cupy.zeros(tokens, np.int64)
    dyn = dict(scale_k="dynamic", scale_v="dynamic", key_scale_cache=ksc, value_scale_cache=vsc)

    def step():
        cq.quantize_kv_cache(key, value, kc, vc, slots, **dyn)
        cq.quantize_kv_cache(key, value, kc2, vc2, slots, scale_k=s_head, scale_v=0.75, kv_layout="NHD")

    step()  # compile outside the capture
    with cupyx.allow_synchronize(False):
        step()
    stream = side_stream()
    with stream:
        stream.begin_capture()
        step()
        graph = stream.end_capture()
    for seed in (6, 7):  # new data and new slots in the same buffers
        rng = np.random.default_rng(seed)
        qkv_h = heavy_tailed((tokens, 2 + 2 * heads, head_dim), seed, BF16)
        slots_h = _slots(rng, tokens, blocks * bs, np.int64)
        pre = [a.get() for a in (kc, vc, ksc, vsc, kc2, vc2)]
        with stream:
            key.base.set(qkv_h)
            slots.set(slots_h)
            graph.launch(stream)
        stream.synchronize()
        kh, vh = qkv_h[:, 2 : 2 + heads], qkv_h[:, 2 + heads :]
        e = ref.quantize_kv_cache(
            kh,
            vh,
            pre[0],
            pre[1],
            slots_h,
            scale_k="dynamic",
            scale_v="dynamic",
            key_scale_cache=pre[2],
            value_scale_cache=pre[3],
        )
        for got, want, what in zip((kc, vc, ksc, vsc), e, ("kc", "vc", "ksc", "vsc")):
            assert_bits_equal(got, want, f"graph replay {what}")
        e2 = ref.quantize_kv_cache(
            kh, vh, pre[4], pre[5], slots_h, scale_k=np.array([0.5, 0.25], np.float32), scale_v=0.75
        )
        assert_bits_equal(kc2, e2[0], "graph replay kc (static)")
        assert_bits_equal(vc2, e2[1], "graph replay vc (static)")


@pytest.mark.gpu
def test_empty_inputs_launch_nothing():
    cupy = _cupy()
    kc = poisoned((2, 4, 2, 8), np.uint8)
    key = cupy.zeros((0, 2, 8), np.float32)
    cq.quantize_kv_cache(key, key, kc, kc.copy(), cupy.zeros(0, np.int32), scale_k=1.0, scale_v=1.0)
    key = cupy.ones((3, 2, 8), np.float32)
    cq.quantize_kv_cache(key, key, kc, kc.copy(), cupy.zeros(0, np.int32), scale_k=1.0, scale_v=1.0)  # all padding
    assert (kc.get() == 0xFF).all()
    y = cq.dequantize_kv_cache(kc, cupy.zeros(0, np.int32), scale=1.0)
    assert y.shape == (0, 4, 2, 8)


@pytest.mark.gpu
def test_bad_arguments_name_themselves_and_leave_the_caches_untouched():
    cupy = _cupy()
    key, value, _, _ = _fused_views(cupy, 6, 2, 16, np.float32, 8)
    kc, vc = poisoned((2, 4, 2, 16), np.uint8), poisoned((2, 4, 2, 16), np.uint8)
    slots = cupy.arange(6, dtype=np.int32)
    sc = cq.empty_kv_scale_cache(kc)
    base = dict(scale_k=1.0, scale_v=1.0)
    D = dict(scale_k="dynamic", scale_v="dynamic")
    cases = [
        ((key.astype(np.float64), value, kc, vc, slots), base, TypeError, "key"),
        ((key, value[:3], kc, vc, slots), base, ValueError, "value"),
        ((key, value.astype(np.float16), kc, vc, slots), base, TypeError, "value"),
        ((key[:, :, ::2], value[:, :, ::2], kc, vc, slots), base, ValueError, "key"),
        ((key, value, kc.view(np.int8), vc, slots), base, TypeError, "key_cache"),
        ((key, value, kc, cupy.zeros((4, 4, 2, 16), np.uint8)[::2], slots), base, ValueError, "value_cache"),
        ((key, value, kc, vc.reshape(2, 2, 4, 16), slots), base, ValueError, "value_cache"),
        ((key, value, kc, vc, slots), dict(base, kv_layout="HND"), ValueError, "key_cache"),
        ((key, value, kc, vc, slots.astype(np.uint32)), base, TypeError, "slot_mapping"),
        ((key, value, kc, vc, cupy.arange(7, dtype=np.int32)), base, ValueError, "slot_mapping"),
        ((key, value, kc, vc, cupy.arange(12, dtype=np.int32)[::2]), base, ValueError, "slot_mapping"),
        ((key, value, kc, vc, slots), dict(base, scale_k=cupy.ones(3, np.float32)), ValueError, "scale_k"),
        ((key, value, kc, vc, slots), dict(base, scale_v=cupy.ones(2, np.float64)), TypeError, "scale_v"),
        ((key, value, kc, vc, slots), dict(base, scale_v=np.ones(1, np.float32)), TypeError, "scale_v"),
        ((key, value, kc, vc, slots), dict(base, scale_k=0.0), ValueError, "scale_k"),
        ((key, value, kc, vc, slots), dict(base, scale_k="dynamic"), ValueError, "scale_k and scale_v"),
        ((key, value, kc, vc, slots), D, ValueError, "key_scale_cache"),
        (
            (key, value, kc, vc, slots),
            dict(D, key_scale_cache=sc, value_scale_cache=sc[:1]),
            ValueError,
            "value_scale_cache",
        ),
        (
            (key, value, kc, vc, slots),
            dict(D, key_scale_cache=sc, value_scale_cache=sc.astype(np.float16)),
            TypeError,
            "value_scale_cache",
        ),
        ((key, value, kc, vc, slots), dict(base, key_scale_cache=sc), ValueError, "key_scale_cache"),
        ((key, value, kc, kc, slots), base, ValueError, "value_cache overlaps key_cache"),
        (
            (key, value, kc, vc, slots),
            dict(D, key_scale_cache=sc, value_scale_cache=sc),
            ValueError,
            "value_scale_cache overlaps",
        ),
        (
            (key, value, key.base.view(np.uint8).reshape(-1)[:256].reshape(2, 4, 2, 16), vc, slots),
            base,
            ValueError,
            "key_cache overlaps key",
        ),
    ]
    before = kc.get(), vc.get()
    for args, kw, exc, arg in cases:
        with pytest.raises(exc, match=f"^{arg}"):
            cq.quantize_kv_cache(*args, **kw)
        assert (kc.get() == before[0]).all() and (vc.get() == before[1]).all(), arg
    ids = cupy.zeros(2, np.int32)
    with pytest.raises(ValueError, match="^scale_cache"):
        cq.dequantize_kv_cache(kc, ids, scale="dynamic")
    with pytest.raises(ValueError, match="^scale_cache"):
        cq.dequantize_kv_cache(kc, ids, scale=1.0, scale_cache=sc)
    with pytest.raises(TypeError, match="^block_ids"):
        cq.dequantize_kv_cache(kc, ids.astype(np.float32), scale=1.0)
    with pytest.raises(ValueError, match="^out"):
        cq.dequantize_kv_cache(kc, ids, scale=1.0, out=cupy.empty((3, 4, 2, 16), BF16))


# ------------------------------------------------------------------ programmatic dependent launch
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["head", "dynamic"])
def test_pdl_each_kernel_waits_for_the_kernel_before(mode):
    """With PDL (compute capability 9.0+), rounds of new inputs (key, value, slot_mapping, the
    caches' prior bytes, the per-head device scales or the scale caches' prior values), each written
    by a kernel that lets the write kernel start at once (tests/_pdl.py): the caches after the write
    and the dequantizing read of every block of the key cache are bit for bit the reference of each
    round, in a stream and replayed from a CUDA graph."""
    cupy = _cupy()
    require_arch("pdl")
    R, tokens, heads, head_dim, blocks, block_size = 4, 37, 3, 128, 13, 16
    rng = np.random.default_rng(zlib.crc32(mode.encode()))
    shape = _cache_shape(blocks, block_size, heads, head_dim, "NHD")
    rounds = []
    for r in range(R):
        kh, vh = (heavy_tailed((tokens, heads, head_dim), 40 * r + i, BF16) for i in range(2))
        slots = _slots(rng, tokens - 3, blocks * block_size, np.int32)
        pre = [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(2)]
        if mode == "head":
            extra = [rng.uniform(0.01, 2.0, heads).astype(np.float32) for _ in range(2)]
        else:
            extra = [rng.uniform(0.01, 2.0, shape[:3]).astype(np.float32) for _ in range(2)]
        rounds.append([kh, vh, slots] + pre + extra)
    bufs = [cupy.empty(a.shape, a.dtype) for a in rounds[0]]
    key, value, slots_d, kc, vc, e0, e1 = bufs
    ids_h = np.arange(blocks, dtype=np.int32)
    ids = cupy.asarray(ids_h)
    names = ["key_cache", "value_cache", "y"] + (["key_scale_cache", "value_scale_cache"] if mode == "dynamic" else [])

    def step():
        if mode == "head":
            cq.quantize_kv_cache(key, value, kc, vc, slots_d, scale_k=e0, scale_v=e1)
            return [kc, vc, cq.dequantize_kv_cache(kc, ids, scale=e0)]
        kw = dict(key_scale_cache=e0, value_scale_cache=e1)
        cq.quantize_kv_cache(key, value, kc, vc, slots_d, scale_k="dynamic", scale_v="dynamic", **kw)
        return [kc, vc, cq.dequantize_kv_cache(kc, ids, scale="dynamic", scale_cache=e0), e0, e1]

    def want(r):
        kh, vh, slots, pk, pv, x0, x1 = rounds[r]
        if mode == "head":
            ek, ev, _, _ = ref.quantize_kv_cache(kh, vh, pk, pv, slots, scale_k=x0, scale_v=x1)
            return [ek, ev, ref.dequantize_kv_cache(ek, ids_h, scale=x0)]
        kw = dict(key_scale_cache=x0, value_scale_cache=x1)
        ek, ev, eks, evs = ref.quantize_kv_cache(kh, vh, pk, pv, slots, scale_k="dynamic", scale_v="dynamic", **kw)
        return [ek, ev, ref.dequantize_kv_cache(ek, ids_h, scale="dynamic", scale_cache=eks), eks, evs]

    sources = [[cupy.asarray(a) for a in rd] for rd in rounds]
    check_rounds(
        step, bufs, sources, lambda r, got, where: assert_rounds_equal(got, want(r), names, f"{where} round {r}")
    )
