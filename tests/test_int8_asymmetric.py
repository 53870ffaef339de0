"""INT8 with zero points: dynamic per-token asymmetric INT8 (``quantize_groupwise(...,
symmetric=False)``, vLLM ``dynamic_scaled_int8_azp_quant``), static per-tensor INT8 with and without
a zero point (``quantize_int8``, vLLM ``static_scaled_int8_quant``), their dequantization and
``QuantizedTensor.zero_point``. The reference against hand-worked values on the CPU; the kernels
byte for byte against the reference on the GPU (codes, scales and zero points compared as integers,
the raw scale and zero-point buffers with their padding)."""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_bits_equal, heavy_tailed, poisoned, side_stream

from cupyquant import reference as ref

IN_DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
F32_MAX = float(np.finfo(np.float32).max)
F32 = np.float32


def _id(v):
    return np.dtype(v).name if not isinstance(v, (str, tuple, type(None), int, float)) else str(v)


def _seed(*parts):
    return zlib.crc32(repr(parts).encode())


def ref_azp(xh):
    return ref.quantize_groupwise(xh, "int8", group_size=None, symmetric=False)


# ================================================================== the reference (CPU)


def test_int8_conversions_hand_worked():
    v = np.array([0.5, 1.5, -0.5, -2.5, 127.5, 128.0, -128.5, np.inf, -np.inf, np.nan, 1e-45], F32)
    assert ref.int8_rn(v).tolist() == [0, 2, 0, -2, 127, 127, -128, 127, -128, 0, 0]
    w = np.array([2.5, 3.5, -2.5, 2.0**31, -(2.0**31), 3e9, -3e9, np.inf, -np.inf, np.nan], F32)
    assert ref.int32_rn(w).tolist() == [2, 4, -2, INT32_MAX, INT32_MIN, INT32_MAX, INT32_MIN, INT32_MAX, INT32_MIN, 0]
    # int32_rn(v) + z wraps in int32 (vLLM's `float_to_int32_rn(v) + azp`), then saturates to int8
    assert ref.azp_codes(F32(np.inf), 1).tolist() == -128  # INT32_MAX + 1 wraps to INT32_MIN
    assert ref.azp_codes(F32(3e9), INT32_MIN).tolist() == -1  # INT32_MAX + INT32_MIN
    assert ref.azp_codes(np.array([1.5, -300.0, 300.0, np.nan], F32), -5).tolist() == [-3, -128, 127, -5]
    assert ref.azp_codes(F32(np.nan), 1000).tolist() == 127


def test_minus_zero_point_rounds_once():
    q = np.array([127, -128, 5, 0], np.int8)
    z = np.array([INT32_MIN, 2**24 + 1, 5, -(2**24) - 1], np.int32)
    # 2^31 + 127 -> 2^31; -(2^24 + 129): a tie between 2^24 + 128 and 2^24 + 130 -> the even 2^24 + 128
    assert ref.minus_zero_point(q, z).tolist() == [2.0**31, -(2.0**24 + 128), 0.0, 2.0**24]
    assert ref.minus_zero_point(q, z).dtype == np.float32


def test_per_token_asymmetric_hand_worked():
    x = np.array([[-1.0, 0.0, 0.5, 3.0], [0.0, 25.5, 4.95, 10.0]], F32)
    q, s, z = ref_azp(x)
    assert s.dtype == np.float32 and z.dtype == np.int32 and q.dtype == np.int8
    assert s.shape == z.shape == (2, 1)
    # row 0: s = 4 / 255; -1 / s = -63.75, z = rne(-128 + 63.75) = -64;
    # x * (1 / s) = -63.75, 0, 31.875, 191.25 -> -64, 0, 32, 191; + z -> -128, -64, -32, 127
    assert s[0, 0] == F32(4) / F32(255)
    assert z[0, 0] == -64
    assert q[0].tolist() == [-128, -64, -32, 127]
    # row 1: s = 25.5 / 255 = float32(0.1), z = -128; 4.95 times float32(1 / s) is 49.5 (rne -> 50)
    # where 4.95 / s is 49.499996 (-> 49): vLLM multiplies by the inverse, and so does the reference
    assert s[1, 0] == F32(25.5) / F32(255) == F32(0.1)
    assert z[1, 0] == -128
    assert F32(F32(4.95) / s[1, 0]) < 49.5 <= F32(F32(4.95) * (F32(1) / s[1, 0]))
    assert q[1].tolist() == [-128, 127, 50 - 128, 100 - 128]


def test_per_token_asymmetric_rows_that_vllm_divides_by_zero():
    tiny = float(np.finfo(np.float32).smallest_subnormal)
    x = np.array(
        [
            [2.0, 2.0, 2.0],  # constant: s = |c|, z = 0, q = sign(c)
            [-3.0, -3.0, -3.0],
            [0.0, -0.0, 0.0],  # all zero: s = 0, z = 0, q = 0 (vLLM's own result)
            [np.nan, np.nan, np.nan],  # no value: as an all-zero row
            [7 * tiny, 7 * tiny, np.nan],  # a subnormal constant row, exact; NaN -> 0
            [0.0, 7 * tiny, 3 * tiny],  # (hi - lo) / 255 underflows to 0: flat, q = rne_sat(x / s)
        ],
        F32,
    )
    q, s, z = ref_azp(x)
    assert s[:, 0].tolist() == [2.0, 3.0, 0.0, 0.0, 7 * tiny, 7 * tiny]
    assert z[:, 0].tolist() == [0] * 6
    assert q.tolist() == [[1, 1, 1], [-1, -1, -1], [0, 0, 0], [0, 0, 0], [1, 1, 0], [0, 1, 0]]
    y = ref.dequantize_groupwise(q, s, "int8", np.float32, zero_point=z)
    np.testing.assert_array_equal(y[:3], x[:3])  # constant rows dequantize exactly
    assert y[4, 0] == F32(7 * tiny)  # subnormal, not flushed
    # empty rows: one scale and zero point each, those of an all-zero row
    q, s, z = ref_azp(np.zeros((3, 0), np.float16))
    assert q.shape == (3, 0) and s.tolist() == [[0.0]] * 3 and z.tolist() == [[0]] * 3


def test_per_token_asymmetric_nan_and_inf_rows():
    x = np.array(
        [
            [np.nan, 1.0, -1.0, 5.0],  # NaN ignored in min / max; a NaN element codes as sat(z)
            [1.0, np.inf, 2.0, 0.5],  # s = inf: inv = 0, z = rne(-128 - 1 / inf) = -128
            [-np.inf, 1.0, 2.0, 3.0],  # s = inf, -inf / inf = NaN -> z = 0
            [np.inf, np.inf, np.inf, np.inf],  # inf - inf: s = NaN, z = 0
            [-F32_MAX, F32_MAX, 0.0, 1.0],  # hi - lo overflows: s = inf, as with an inf
        ],
        F32,
    )
    q, s, z = ref_azp(x)
    s0 = F32(6) / F32(255)
    z0 = int(ref.int32_rn(F32(-128) - F32(F32(-1) / s0)))
    assert s[0, 0] == s0 and z[0, 0] == z0 and q[0, 0] == max(-128, min(127, z0))
    assert np.isinf(s[1, 0]) and z[1, 0] == -128 and q[1].tolist() == [-128] * 4
    assert np.isinf(s[2, 0]) and z[2, 0] == 0 and q[2].tolist() == [0] * 4
    assert np.isnan(s[3, 0]) and z[3, 0] == 0 and q[3].tolist() == [0] * 4
    assert np.isinf(s[4, 0]) and z[4, 0] == -128 and q[4].tolist() == [-128] * 4
    y = ref.dequantize_groupwise(q, s, "int8", np.float32, zero_point=z)
    assert np.isnan(y[1:]).all() and np.isfinite(y[0]).all()


def test_per_token_asymmetric_round_trip_error():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((64, 300)) * 3 + rng.standard_normal((64, 1)) * 10).astype(F32)
    q, s, z = ref_azp(x)
    y = ref.dequantize_groupwise(q, s, "int8", np.float32, zero_point=z)
    # codes cover [lo, hi] in 255 steps: the error is at most half a step (plus rounding of s and z)
    assert (np.abs(y - x) <= 0.51 * s + 1e-6 * np.abs(x)).all()
    assert q.min() == -128 and q.max() == 127  # the full range is used


def test_static_int8_hand_worked():
    x = np.array([0.25, 0.75, -0.25, 1000.0, np.nan, np.inf, -np.inf, -4.95], F32)
    q, s, z = ref.quantize_int8(x, scale=0.5)
    assert z is None and s.tolist() == [0.5] and s.dtype == np.float32
    # x / 0.5 = 0.5, 1.5, -0.5, 2000, NaN, inf, -inf, -9.9 -> half to even, saturate, NaN -> 0
    assert q.tolist() == [0, 2, 0, 127, 0, 127, -128, -10]
    q, s, z = ref.quantize_int8(x, scale=0.5, zero_point=3)
    assert z.tolist() == [3] and z.dtype == np.int32
    # x * (1 / 0.5) -> int32_rn -> + 3; inf: INT32_MAX + 3 wraps (vLLM's int32 sum), -128
    assert q.tolist() == [3, 5, 3, 127, 3, -128, -128, -7]
    # vLLM divides without a zero point and multiplies by 1 / s with one: -4.95 / 0.1 = -49.499996,
    # -4.95 * float32(1 / 0.1) = -49.5
    assert ref.quantize_int8(np.array([-4.95], F32), scale=0.1)[0].tolist() == [-49]
    assert ref.quantize_int8(np.array([-4.95], F32), scale=0.1, zero_point=0)[0].tolist() == [-50]
    # a scale given as an array is used as it is (as the op reads a device array): 0 and NaN too
    assert ref.quantize_int8(np.array([1.0, 0.0, -1.0], F32), scale=np.zeros(1, F32))[0].tolist() == [127, 0, -128]
    assert ref.quantize_int8(np.array([1.0], F32), scale=np.full(1, np.nan, F32))[0].tolist() == [0]


def test_static_int8_dequantize_hand_worked():
    q = np.array([-128, 0, 127], np.int8)
    assert ref.dequantize_int8(q, F32(0.5)).tolist() == [-64.0, 0.0, 63.5]
    assert ref.dequantize_int8(q, np.array([0.5], F32), np.array([-3], np.int32)).tolist() == [-62.5, 1.5, 65.0]
    y = ref.dequantize_int8(q, F32(2.0**-140), 1, np.float32)  # subnormal products are kept
    assert y.tolist() == [-129 * 2.0**-140, -(2.0**-140), 126 * 2.0**-140]
    yb = ref.dequantize_int8(q, F32(1.0), None, ml_dtypes.bfloat16)
    assert yb.dtype == np.dtype(ml_dtypes.bfloat16) and yb.astype(F32).tolist() == [-128.0, 0.0, 127.0]


def test_reference_argument_checks():
    x = np.ones((2, 8), F32)
    for kw, arg in [
        (dict(dtype="float8_e4m3fn"), "dtype"),
        (dict(group_size=128), "group_size"),
        (dict(scale_pow2=True), "scale_pow2"),
        (dict(scale_dtype="float8_e8m0fnu"), "scale_dtype"),
        (dict(scale_ub=1.0), "scale_ub"),
    ]:
        args = dict(dtype="int8", group_size=None, symmetric=False)
        args.update(kw)
        dtype = args.pop("dtype")
        with pytest.raises(ValueError, match=arg):
            ref.quantize_groupwise(x, dtype, **args)
    with pytest.raises(TypeError, match="zero_point"):
        ref.quantize_int8(x, scale=1.0, zero_point=1.5)
    with pytest.raises(ValueError, match="zero_point"):
        ref.quantize_int8(x, scale=1.0, zero_point=2**31)
    with pytest.raises(ValueError, match="scale"):
        ref.quantize_int8(x, scale=-1.0)
    with pytest.raises(ValueError, match="zero_point"):
        ref.dequantize_groupwise(np.zeros((2, 8), np.int8), np.ones((2, 1), F32), "int8", zero_point=np.zeros(2))
    with pytest.raises(ValueError, match="zero_point"):
        ref.dequantize_groupwise(np.zeros((2, 8), np.uint8), np.ones((2, 1), F32), zero_point=np.zeros((2, 1)))


def test_new_instantiations_are_registered():
    # every instantiation the wrappers can ask for is in the registry that tests/test_jit.py compiles
    # for sm_80 ... sm_120 with NVRTC
    pytest.importorskip("cupy")
    import cupyquant

    fams = cupyquant._all_families()
    gw, pt = fams["groupwise"], fams["per_tensor"]
    for t in ("float", "__half", "__nv_bfloat16"):
        assert all(f"token_quantize_azp_regs<{t}, {w}>" in gw for w in (1, 2, 4, 8, 16, 32))
        assert all(
            f"{k}<{t}, {v}>" in gw for k in ("token_quantize_azp", "token_dequantize_azp") for v in ("true", "false")
        )
        for azp in ("true", "false"):
            assert all(
                f"{k}<{t}, {azp}, {v}>" in pt for k in ("int8_quantize", "int8_dequantize") for v in ("true", "false")
            )


# ================================================================== the kernels (GPU)

gpu = pytest.mark.gpu


def _cupy():
    import cupy

    return cupy


def _poison_all(a):
    """Fill the whole allocation under ``a`` (a layout's padding included) with 0xFF."""
    cupy = _cupy()
    cupy.cuda.runtime.memsetAsync(a.data.mem.ptr, 0xFF, a.data.mem.size, cupy.cuda.get_current_stream().ptr)
    return a


def _raw_words(a, shape, layout):
    """The words of a per-token scale or zero-point allocation, padding included (uint32)."""
    cupy = _cupy()
    _, total = ref.scale_word_offsets(shape, 1, layout)
    return cupy.ndarray((total,), np.uint32, memptr=a.data).get()


def _expected_words(logical, shape, layout):
    offsets, total = ref.scale_word_offsets(shape, 1, layout)
    buf = np.zeros(total, np.uint32)
    buf[offsets.reshape(-1)] = np.ascontiguousarray(logical).view(np.uint32).reshape(-1)
    return buf


def check_azp(q, xh, layout):
    eq, es, ez = ref_azp(xh)
    assert q.data.dtype == np.int8 and q.scale.dtype == np.float32 and q.zero_point.dtype == np.int32
    assert q.zero_point.shape == q.scale.shape and q.zero_point.strides == q.scale.strides
    assert q.scheme.format == "int8" and q.scheme.granularity == "token" and q.scheme.scale_layout == layout
    assert_bits_equal(q.data, eq, "q")
    host = q.to_host()
    assert_bits_equal(host["scale"], es, "scales")
    assert_bits_equal(host["zero_point"], ez, "zero points")
    assert_bits_equal(_raw_words(q.scale, q.shape, layout), _expected_words(es, q.shape, layout), "scale buffer")
    assert_bits_equal(_raw_words(q.zero_point, q.shape, layout), _expected_words(ez, q.shape, layout), "zp buffer")
    return eq, es, ez


def run_azp(xh, layout="row", x=None):
    """Into poisoned out=, scale_out= and zero_point_out= buffers, and into allocated ones."""
    import cupyquant as cq

    cupy = _cupy()
    x = cupy.asarray(xh) if x is None else x
    out = poisoned(xh.shape, np.int8)
    s_out = _poison_all(cq.empty_scales(xh.shape, None, layout))
    z_out = _poison_all(cq.empty_scales(xh.shape, None, layout)).view(cupy.int32)
    q = cq.quantize_groupwise(
        x, "int8", group_size=None, symmetric=False, scale_layout=layout, out=out, scale_out=s_out, zero_point_out=z_out
    )
    assert q.data is out and q.scale is s_out and q.zero_point is z_out
    check_azp(q, xh, layout)
    q2 = cq.quantize_groupwise(x, "int8", group_size=None, symmetric=False, scale_layout=layout)
    check_azp(q2, xh, layout)
    return q2


@gpu
@pytest.mark.parametrize("layout", ["row", "col"])
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
@pytest.mark.parametrize(
    "shape", [(1,), (7,), (1, 1), (3, 1), (5, 33), (1, 4096), (37, 1024), (2, 3, 4097), (3, 5, 264)], ids=_id
)
def test_per_token_matches_reference(shape, in_dtype, layout):
    xh = heavy_tailed(shape, _seed(shape, in_dtype, layout), in_dtype)
    run_azp(xh, layout)
    # shifted rows (all positive, all negative) exercise zero points far from 0
    run_azp((xh.astype(F32) + 1000).astype(in_dtype), layout)
    run_azp((xh.astype(F32) - 3).astype(in_dtype), layout)


@gpu
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
def test_per_token_every_team_and_the_two_pass_kernel(in_dtype):
    from cupyquant import _group_plan

    item = np.dtype(in_dtype).itemsize
    longest = [_group_plan._token_row_max(item, w) for w in _group_plan._TOKEN_WARPS]
    for K in [8, 264] + longest + [k + 8 for k in longest] + [9, 1001]:
        for rows in (13, 300) if K <= 4096 else (2,):
            xh = heavy_tailed((rows, K), _seed(K, rows, in_dtype, "team"), in_dtype)
            run_azp(xh, "col" if K % 16 else "row")


def _special_rows(in_dtype, K):
    f16 = np.dtype(in_dtype) == np.float16
    info = np.finfo(np.float16) if f16 else np.finfo(np.float32)
    tiny, small, big = float(info.smallest_subnormal), float(info.smallest_normal), float(info.max)
    ramp = np.linspace(-1, 1, K)
    rows = [
        np.zeros(K),
        np.full(K, -0.0),
        np.full(K, 2.5),  # constant rows: s = |c|, q = sign(c)
        np.full(K, -7.0),
        np.full(K, 3 * tiny),  # subnormal constant
        np.where(np.arange(K) % 2, tiny, 0.0),  # subnormal range
        np.where(np.arange(K) % 3, small * 0.5, -tiny),
        ramp * small,  # a range near the smallest normal
        np.full(K, np.nan),
        np.where(np.arange(K) == 5, np.nan, ramp),
        np.where(np.arange(K) == 1, np.inf, ramp),
        np.where(np.arange(K) == 2, -np.inf, ramp),
        np.full(K, np.inf),
        np.where(np.arange(K) % 2, np.inf, -np.inf),
        np.where(np.arange(K) == 0, big, ramp),  # max finite
        np.where(np.arange(K) == 0, -big, np.where(np.arange(K) == 1, big, ramp)),  # range overflows
        np.where(np.arange(K) == 3, 1e4, 1e4 + ramp),  # far from 0, small range
        ramp + 100,
        ramp - 100,
    ]
    with np.errstate(over="ignore"):
        return np.array(rows, F32).astype(in_dtype)


@gpu
@pytest.mark.parametrize("K", [256, 255, 1], ids=_id)  # the register kernel, the scalar two-pass one, K = 1
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
def test_per_token_special_values(in_dtype, K):
    xh = _special_rows(in_dtype, K)
    for layout in ("row", "col"):
        q = run_azp(xh, layout)
        # flat rows dequantize exactly; NaN and inf rows as the reference says
        _, es, ez = ref_azp(xh)
        y = q.dequantize(np.float32)
        assert_bits_equal(y, ref.dequantize_groupwise(q.data.get(), es, "int8", np.float32, zero_point=ez), "y")


@gpu
def test_per_token_empty_rows_and_no_rows():
    for shape in [(5, 0), (2, 3, 0)]:
        xh = np.zeros(shape, np.float16)
        for layout in ("row", "col"):
            q = run_azp(xh, layout)
            assert q.scale.shape == shape[:-1] + (1,) and q.dequantize().shape == shape
            assert (q.to_host()["zero_point"] == 0).all() and (q.to_host()["scale"] == 0).all()
    import cupyquant as cq

    q = cq.quantize_groupwise(_cupy().zeros((0, 16), np.float32), "int8", group_size=None, symmetric=False)
    assert q.data.shape == (0, 16) and q.zero_point.shape == (0, 1)


@gpu
def test_per_token_strided_and_misaligned_rows():
    cupy = _cupy()
    big = cupy.asarray(heavy_tailed((33, 1024 + 16), 8, ml_dtypes.bfloat16))
    for x in (big[:, :1024], big[:, 8:1032], big[:, 1:1025], big[::2, :512], big[3]):
        run_azp(x.get(), "col", x=x)


@gpu
@pytest.mark.parametrize("out_dtype", IN_DTYPES, ids=_id)
@pytest.mark.parametrize("layout", ["row", "col"])
def test_per_token_dequantize(out_dtype, layout):
    import cupyquant as cq

    cupy = _cupy()
    for shape in [(3, 1024), (2, 3, 512), (4, 4097), (5,)]:  # vector and scalar dequantization
        xh = heavy_tailed(shape, _seed(shape, layout, "dq"), np.float32)
        q = cq.quantize_groupwise(cupy.asarray(xh), "int8", group_size=None, symmetric=False, scale_layout=layout)
        out = poisoned(shape, out_dtype)
        y = cq.dequantize(q, out_dtype, out=out)
        assert y is out
        eq, es, ez = ref_azp(xh)
        assert_bits_equal(y, ref.dequantize_groupwise(eq, es, "int8", out_dtype, zero_point=ez), "y")
    # zero points far out of the int8 range: float32(q - z) rounds once (2^31 + 127 -> 2^31)
    q = cq.quantize_groupwise(cupy.ones((4, 16), np.float32), "int8", group_size=None, symmetric=False)
    q.data[...] = cupy.asarray(np.arange(64, dtype=np.int64).reshape(4, 16) * 4 - 128, dtype=np.int8)
    q.zero_point[...] = cupy.asarray([[INT32_MIN], [2**24 + 1], [INT32_MAX], [-7]], np.int32)
    q.scale[...] = cupy.asarray([[1.0], [0.5], [2.0**-140], [1e30]], np.float32)
    y = q.dequantize(out_dtype)
    host = q.to_host()
    expected = ref.dequantize_groupwise(host["data"], host["scale"], "int8", out_dtype, zero_point=host["zero_point"])
    assert_bits_equal(y, expected, "y with extreme zero points")


@gpu
def test_per_token_graph_capture_and_no_sync():
    import cupyx

    import cupyquant as cq

    cupy = _cupy()
    xh = heavy_tailed((64, 512), 40, ml_dtypes.bfloat16)
    x = cupy.asarray(xh)
    qbuf = cupy.empty(x.shape, np.int8)
    sbuf = cq.empty_scales(x.shape, None, "col")
    zbuf = cq.empty_scales(x.shape, None, "col").view(cupy.int32)
    kw = dict(group_size=None, symmetric=False, scale_layout="col", out=qbuf, scale_out=sbuf, zero_point_out=zbuf)
    cq.quantize_groupwise(x, "int8", **kw).dequantize()  # compile (compiling may synchronize)
    cq.quantize_int8(x, scale=0.5, zero_point=3).dequantize()
    with cupyx.allow_synchronize(False):
        cq.quantize_groupwise(x, "int8", **kw).dequantize()
        cq.quantize_int8(x, scale=0.5, zero_point=3).dequantize()
    stream = side_stream()
    with stream:
        stream.begin_capture()
        q = cq.quantize_groupwise(x, "int8", **kw)
        graph = stream.end_capture()
    xh2 = heavy_tailed(x.shape, 41, ml_dtypes.bfloat16)
    with stream:
        x.set(xh2)
        graph.launch(stream)
    stream.synchronize()
    check_azp(q, xh2, "col")


# ------------------------------------------------------------------ static per-tensor INT8

SCALE_MODES = ["float", "device"]
ZP_MODES = ["none", "int", "device"]


def run_static(xh, scale, zp_mode, scale_mode="float", zp=-17, x=None, out=None):
    import cupyquant as cq

    cupy = _cupy()
    x = cupy.asarray(xh) if x is None else x
    out = poisoned(xh.shape, np.int8) if out is None else out
    s_arg = scale if scale_mode == "float" else cupy.asarray([scale], np.float32)
    z_arg = {"none": None, "int": zp, "device": cupy.asarray([zp], np.int32)}[zp_mode]
    q = cq.quantize_int8(x, scale=s_arg, zero_point=z_arg, out=out)
    assert q.data is out and q.shape == xh.shape and q.dtype == xh.dtype
    assert q.scheme.format == "int8" and q.scheme.granularity == "tensor" and q.scheme.block is None
    eq, es, ez = ref.quantize_int8(
        xh,
        scale=np.array([scale], np.float32) if scale_mode == "device" else scale,
        zero_point=None if zp_mode == "none" else zp,
    )
    assert_bits_equal(q.data, eq, "q")
    assert q.scale.shape == (1,) and q.scale.dtype == np.float32
    assert_bits_equal(q.scale, es, "scale")
    if ez is None:
        assert q.zero_point is None
    else:
        assert q.zero_point.shape == (1,) and q.zero_point.dtype == np.int32
        assert_bits_equal(q.zero_point, ez, "zero point")
    return q, eq, es, ez


@gpu
@pytest.mark.parametrize("zp_mode", ZP_MODES)
@pytest.mark.parametrize("scale_mode", SCALE_MODES)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
@pytest.mark.parametrize(
    "shape", [(0,), (1,), (17,), (2049,), (3, 5, 7), (2, 33, 4097), (1 << 20,), (4, 0, 3)], ids=_id
)
def test_static_matches_reference(shape, in_dtype, scale_mode, zp_mode):
    xh = heavy_tailed(shape, _seed(shape, in_dtype, scale_mode, zp_mode), in_dtype)
    q, eq, es, ez = run_static(xh, 0.37, zp_mode, scale_mode)
    out = poisoned(shape, in_dtype)
    y = q.dequantize(out=out)
    assert y is out
    assert_bits_equal(y, ref.dequantize_int8(eq, es, ez, in_dtype), "dequantized")


@gpu
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
def test_static_special_values_and_scales(in_dtype):
    f16 = np.dtype(in_dtype) == np.float16
    info = np.finfo(np.float16) if f16 else np.finfo(np.float32)
    vals = [0.0, -0.0, float(info.smallest_subnormal), float(info.smallest_normal), float(info.max), -float(info.max)]
    vals += [np.inf, -np.inf, np.nan, 1.0, -1.0, 0.5, -4.95, 63.5, 64.5, -64.5, 1e-3, 1e4]
    with np.errstate(over="ignore"):
        xh = np.tile(np.array(vals, F32), 7).astype(in_dtype)  # vector body and scalar tail
    scales = [0.5, 0.1, 1e-30, 2.0**-61, 2.0**-60, 2.0**60, 3e38, 1e-3]  # inside and outside div_by's range
    for s in scales:
        for zp_mode, zp in [("none", 0), ("int", 5), ("int", -128), ("device", INT32_MAX), ("device", INT32_MIN)]:
            run_static(xh, s, zp_mode, "float", zp)
    cupy = _cupy()
    # device scales are used as they are: 0, negative, subnormal, inf and NaN too
    for s in (0.0, -0.5, 1e-40, np.inf, np.nan):
        for zp_mode in ZP_MODES:
            q, eq, es, ez = run_static(xh, s, zp_mode, "device", 9)
            assert_bits_equal(q.dequantize(np.float32), ref.dequantize_int8(eq, es, ez, np.float32), f"y s={s}")
    # the division (no zero point) and the multiplication by 1 / s (zero point 0) differ here
    x = cupy.asarray(np.full(40, -4.95, F32).astype(in_dtype))
    if in_dtype == np.float32:
        assert (run_static(x.get(), 0.1, "none")[0].data == -49).all()
        assert (run_static(x.get(), 0.1, "int", zp=0)[0].data == -50).all()


@gpu
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
@pytest.mark.parametrize("offset", [1, 3, 8])
def test_static_views_at_odd_offsets(in_dtype, offset):
    cupy = _cupy()
    base = cupy.asarray(heavy_tailed((5000,), offset, in_dtype))
    x = base[offset:]
    for zp_mode in ZP_MODES:
        q, eq, es, ez = run_static(x.get(), 0.02, zp_mode, x=x)
        big = poisoned((x.size + 1,), np.int8)
        q2, *_ = run_static(x.get(), 0.02, zp_mode, x=x, out=big[1:])
        ybig = poisoned((x.size + 1,), in_dtype)
        y = q2.dequantize(out=ybig[1:])
        assert_bits_equal(y, ref.dequantize_int8(eq, es, ez, in_dtype), "dequantized into a misaligned out")


@gpu
def test_static_every_code_dequantizes_exactly():
    import cupyquant as cq

    cupy = _cupy()
    qb = np.tile(np.arange(-128, 128, dtype=np.int8), 9)
    for s, zp in [(1.0, None), (1e-3, 3), (2.0**-140, -100), (1e36, 77), (0.25, INT32_MIN), (0.5, 2**24 + 1)]:
        q = cq.quantize_int8(cupy.zeros(qb.shape, np.float32), scale=s, zero_point=zp)
        q.data[...] = cupy.asarray(qb)
        for out_dtype in IN_DTYPES:
            expected = ref.dequantize_int8(qb, np.float32(s), zp, out_dtype)
            assert_bits_equal(q.dequantize(out_dtype), expected, f"{np.dtype(out_dtype).name} s={s} z={zp}")


# ------------------------------------------------------------------ arguments (GPU arrays, no launch)


@gpu
def test_per_token_bad_arguments_leave_buffers_untouched():
    import cupyquant as cq

    cupy = _cupy()
    x = cupy.asarray(heavy_tailed((6, 512), 13, np.float32))
    out = poisoned(x.shape, np.int8)
    s_out = _poison_all(cq.empty_scales(x.shape, None, "col"))
    z_out = _poison_all(cq.empty_scales(x.shape, None, "col")).view(cupy.int32)

    def raw():
        return out.get(), _raw_words(s_out, x.shape, "col"), _raw_words(z_out, x.shape, "col")

    before = raw()
    bad = [
        (dict(dtype="float8_e4m3fn"), ValueError, "dtype"),
        (dict(group_size=128), ValueError, "group_size"),
        (dict(scale_pow2=True), ValueError, "scale_pow2"),
        (dict(scale_dtype="float8_e8m0fnu", scale_out=None), ValueError, "scale_dtype"),
        (dict(scale_ub=1.0), ValueError, "scale_ub"),
        (dict(scale_ub=cupy.ones(1, np.float32)), ValueError, "scale_ub"),
        (dict(symmetric="no"), TypeError, "symmetric"),
        (dict(symmetric=None), TypeError, "symmetric"),
        (dict(symmetric=True), ValueError, "zero_point_out"),
        (dict(zero_point_out=cq.empty_scales(x.shape, None, "col")), TypeError, "zero_point_out"),  # float32
        (dict(zero_point_out=cq.empty_scales(x.shape, None, "row").view(cupy.int32)), ValueError, "zero_point_out"),
        (dict(zero_point_out=cupy.zeros((6, 2), np.int32)), ValueError, "zero_point_out"),
        (dict(zero_point_out=np.zeros((6, 1), np.int32)), TypeError, "zero_point_out"),
        (dict(zero_point_out=s_out.view(cupy.int32)), ValueError, "zero_point_out overlaps scale_out"),
        (dict(zero_point_out=x.view(cupy.int32)[:, :1]), ValueError, "zero_point_out"),
        (dict(scale_out=cupy.zeros((6, 1), np.float32)), ValueError, "scale_out"),  # row strides for col
        (dict(out=cupy.zeros(x.shape, np.uint8)), TypeError, "out"),
        (dict(x=x.get()), TypeError, "x"),
        (dict(x=x.astype(np.int32)), TypeError, "x"),
    ]
    for kw, exc, what in bad:
        args = dict(
            x=x, dtype="int8", group_size=None, symmetric=False, scale_layout="col", out=out, scale_out=s_out,
            zero_point_out=z_out,
        )  # fmt: skip
        args.update(kw)
        with pytest.raises(exc, match=what):
            cq.quantize_groupwise(args.pop("x"), args.pop("dtype"), **args)
        for a, b in zip(raw(), before):
            np.testing.assert_array_equal(a, b)


@gpu
def test_static_bad_arguments_leave_out_untouched():
    import cupyquant as cq

    cupy = _cupy()
    x = cupy.asarray(heavy_tailed((64,), 2, np.float32))
    out = poisoned((64,), np.int8)
    before = out.get()
    bad = [
        (dict(scale=None), TypeError, "scale"),
        (dict(scale=-1.0), ValueError, "scale"),
        (dict(scale=float("nan")), ValueError, "scale"),
        (dict(scale=0.0), ValueError, "scale"),
        (dict(scale="1"), TypeError, "scale"),
        (dict(scale=cupy.ones(1, np.float64)), TypeError, "scale"),
        (dict(scale=cupy.ones(2, np.float32)), ValueError, "scale"),
        (dict(zero_point=1.5), TypeError, "zero_point"),
        (dict(zero_point=True), TypeError, "zero_point"),
        (dict(zero_point=2**31), ValueError, "zero_point"),
        (dict(zero_point=-(2**31) - 1), ValueError, "zero_point"),
        (dict(zero_point=cupy.ones(1, np.int64)), TypeError, "zero_point"),
        (dict(zero_point=cupy.ones(2, np.int32)), ValueError, "zero_point"),
        (dict(zero_point=np.ones(1, np.int32)), TypeError, "zero_point"),
        (dict(zero_point=out.view(np.int32)[:1]), ValueError, "out overlaps zero_point"),
        (dict(scale=out.view(np.float32)[:1]), ValueError, "out overlaps scale"),
        (dict(out=cupy.empty(64, np.uint8)), TypeError, "out"),
        (dict(out=poisoned((65,), np.int8)), ValueError, "out"),
        (dict(out=x.view(np.int8)[:64]), ValueError, "out overlaps x"),
        (dict(x=x.get()), TypeError, "x"),
        (dict(x=cupy.ones((8, 8), np.float32)[:, ::2]), ValueError, "x must be C-contiguous"),
    ]
    for kw, exc, what in bad:
        args = dict(x=x, scale=0.5, zero_point=3, out=out)
        args.update(kw)
        with pytest.raises(exc, match=what):
            cq.quantize_int8(args.pop("x"), **args)
        np.testing.assert_array_equal(out.get(), before)


@gpu
def test_zero_point_attribute_and_dequantize_checks():
    import cupyquant as cq
    from cupyquant.quantized import QuantizedTensor

    cupy = _cupy()
    xh = heavy_tailed((10, 3), 9, np.float16)
    x = cupy.asarray(xh)
    q = cq.quantize_groupwise(x, "int8", group_size=None, symmetric=False, scale_layout="col")
    assert q.nbytes == 30 + 10 * 4 + 10 * 4
    assert "zero_point=int32" in repr(q) and "zero_point" not in repr(cq.quantize_groupwise(x, "int8", group_size=None))
    assert cq.quantize_groupwise(x, "int8", group_size=None).zero_point is None
    p = cq.quantize_int8(x, scale=0.1, zero_point=2)
    assert p.nbytes == 30 + 4 + 4 and p.to_host()["zero_point"].tolist() == [2]
    assert cq.quantize_int8(x, scale=0.1).to_host().keys() == {"data", "scale"}
    # positional construction without a zero point keeps working; the keyword comes last
    qs = QuantizedTensor(q.data, q.scale, q.scheme, q.shape, q.dtype)
    assert qs.zero_point is None
    bad = [
        (q.zero_point.astype(np.int64), TypeError, "q.zero_point must have dtype int32"),
        (cupy.zeros((10, 1), np.int32), ValueError, "shape and strides of q.scale"),  # row strides, col scale
        (q.zero_point.get(), TypeError, "q.zero_point"),
    ]
    for z, exc, what in bad:
        with pytest.raises(exc, match=what):
            QuantizedTensor(q.data, q.scale, q.scheme, q.shape, q.dtype, zero_point=z).dequantize()
    fp8 = cq.quantize_groupwise(x, "float8_e4m3fn", group_size=None)
    with pytest.raises(ValueError, match="q.zero_point is for int8"):
        QuantizedTensor(fp8.data, fp8.scale, fp8.scheme, fp8.shape, fp8.dtype, zero_point=q.zero_point).dequantize()
