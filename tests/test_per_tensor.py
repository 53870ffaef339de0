"""Per-tensor FP8 on the GPU, byte for byte against cupyquant.reference."""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest
from _pdl import assert_rounds_equal, check_rounds
from conftest import assert_bits_equal, heavy_tailed, poisoned, require_arch, side_stream

import cupyquant as cq
from cupyquant import reference as ref

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")

IN_DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
FORMATS = ["float8_e4m3fn", "float8_e5m2"]
SHAPES = [(0,), (1,), (7,), (8,), (1023,), (2048,), (2049,), (1 << 20,), (3, 5, 7), (2, 33, 4097)]
MODES = ["dynamic", "static_float", "static_device"]
F32_MAX = float(np.finfo(np.float32).max)


def _id(v):
    return np.dtype(v).name if not isinstance(v, (str, tuple)) else str(v)


def _quantize_both(xh, fmt, mode, static_scale=0.37, **kw):
    """Run the op on the GPU (into a poisoned out= buffer) and the reference on the host."""
    x = cupy.asarray(xh)
    out = poisoned(xh.shape, np.uint8)
    if mode == "dynamic":
        q = cq.quantize_fp8(x, fmt, out=out, **kw)
        eq, es = ref.quantize_fp8(xh, fmt)
    else:
        s = static_scale if mode == "static_float" else cupy.asarray([static_scale], dtype=np.float32)
        q = cq.quantize_fp8(x, fmt, scale=s, out=out, **kw)
        eq, es = ref.quantize_fp8(xh, fmt, scale=static_scale)
    assert q.data is out
    return q, eq, es


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_quantize_matches_reference(shape, in_dtype, fmt, mode):
    seed = zlib.crc32(repr((shape, np.dtype(in_dtype).name, fmt, mode)).encode())
    xh = heavy_tailed(shape, seed, in_dtype)
    q, eq, es = _quantize_both(xh, fmt, mode)
    assert q.data.shape == shape and q.data.dtype == np.uint8
    assert q.scale.shape == (1,) and q.scale.dtype == np.float32
    assert_bits_equal(q.data, eq, "q")
    assert_bits_equal(q.scale, es, "scale_inv")
    if mode == "dynamic":
        assert_bits_equal(q.amax, np.array([ref.amax(xh)], np.float32), "amax")
    assert q.shape == shape and q.dtype == np.dtype(in_dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("out_dtype", IN_DTYPES, ids=_id)
# 4093 and 66043 leave every tail length of the two-units-per-thread dequantizer somewhere
@pytest.mark.parametrize("shape", [(0,), (1,), (17,), (2049,), (4093,), (66043,), (1 << 20,), (3, 5, 7)], ids=_id)
def test_dequantize_matches_reference(shape, out_dtype, fmt):
    xh = heavy_tailed(shape, 11, np.float32)
    q = cq.quantize_fp8(cupy.asarray(xh), fmt)
    out = poisoned(shape, out_dtype)
    y = cq.dequantize(q, out_dtype, out=out)
    assert y is out
    expected = ref.dequantize_fp8(q.data.get(), q.scale.get(), fmt, out_dtype)
    assert_bits_equal(y, expected, "dequantized")


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_fp8_pattern_dequantizes_exactly(fmt):
    # all 256 bit patterns (NaNs and e5m2 infs included), with a scale whose products go subnormal
    qb = np.tile(np.arange(256, dtype=np.uint8), 9)
    for s in (1.0, 1e-3, 2e-38, 1e30, 1e35):  # 2e-38: subnormal products; 1e35: overflow to inf
        q = cq.quantize_fp8(cupy.zeros(qb.shape, np.float32), fmt, scale=s)
        q.data[...] = cupy.asarray(qb)
        for out_dtype in IN_DTYPES:
            y = q.dequantize(out_dtype)
            assert_bits_equal(y, ref.dequantize_fp8(qb, np.float32(s), fmt, out_dtype), f"{out_dtype} s={s}")


def test_dequantize_defaults_to_original_dtype():
    x = cupy.asarray(heavy_tailed((100,), 3, ml_dtypes.bfloat16))
    y = cq.quantize_fp8(x).dequantize()
    assert y.dtype == np.dtype(ml_dtypes.bfloat16) and y.shape == (100,)


def _specials(in_dtype, fmt):
    fmax = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}[fmt]
    info = np.finfo(np.float32) if np.dtype(in_dtype) != np.float16 else np.finfo(np.float16)
    tiny, small = float(info.smallest_subnormal), float(info.smallest_normal)
    # Subnormal inputs from the smallest to just under the smallest normal: times a large scale
    # (up to FLT_MAX) the big ones land on nonzero FP8 values, so flushing them would show.
    vals = [
        0.0,
        -0.0,
        tiny,
        -tiny,
        3 * tiny,
        small * 0.75,
        -small * 0.3,
        small * 0.05,
        small,
        fmax,
        -fmax,
        fmax * 1.01,
        -fmax * 3,
        float(info.max),
        -float(info.max),
        1.0,
        -1.0,
        0.5,
        1e-3,
    ]
    with np.errstate(over="ignore"):  # float32 max rounds to inf in bfloat16: one more special
        return np.array(vals, dtype=np.float32).astype(in_dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
@pytest.mark.parametrize("extra", ["none", "inf", "-inf", "nan", "all_zero", "all_nan", "subnormal_only"])
def test_special_values(in_dtype, fmt, mode, extra):
    base = _specials(in_dtype, fmt)
    if extra == "all_zero":
        xh = np.array([0.0, -0.0] * 20, np.float32).astype(in_dtype)
    elif extra == "all_nan":
        xh = np.full(37, np.nan, np.float32).astype(in_dtype)
    elif extra == "subnormal_only":
        xh = np.tile(base[2:8], 11)  # 66 elements: four vectors and a two-element tail
    else:
        add = {"none": [], "inf": [np.inf], "-inf": [-np.inf], "nan": [np.nan]}[extra]
        xh = np.concatenate([base, np.array(add, np.float32).astype(in_dtype)])
        xh = np.tile(xh, 5)  # vector body and scalar tail both see them
    q, eq, es = _quantize_both(xh, fmt, mode, static_scale=0.0625)
    assert_bits_equal(q.data, eq, f"q ({extra})")
    assert_bits_equal(q.scale, es, "scale_inv")
    y = q.dequantize(np.float32)
    assert_bits_equal(y, ref.dequantize_fp8(eq, es, fmt, np.float32), "dequantized")


@pytest.mark.parametrize("in_dtype", [np.float32, ml_dtypes.bfloat16], ids=_id)  # float16 can't hold 1e-38
def test_tiny_amax_gives_flt_max_scale(in_dtype):
    xh = np.array([1e-38, -5e-39, 0.0] * 7, np.float32).astype(in_dtype)
    q, eq, es = _quantize_both(xh, "float8_e4m3fn", "dynamic")
    assert ref.compute_scale(ref.amax(xh)) == np.float32(F32_MAX)
    assert_bits_equal(q.data, eq, "q")
    assert_bits_equal(q.scale, es, "scale_inv (a subnormal 1/FLT_MAX, not flushed)")
    assert q.scale.get()[0] != 0


@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
@pytest.mark.parametrize("offset", [1, 3, 5, 8, 15])
def test_views_at_odd_offsets_take_the_scalar_path(in_dtype, offset):
    base = cupy.asarray(heavy_tailed((5000,), offset, in_dtype))
    x = base[offset:]
    xh = x.get()
    for fmt in FORMATS:
        out = poisoned(x.shape, np.uint8)
        q = cq.quantize_fp8(x, fmt, out=out)
        eq, es = ref.quantize_fp8(xh, fmt)
        assert_bits_equal(q.data, eq, "q")
        assert_bits_equal(q.scale, es, "scale_inv")
        # a misaligned out= and a misaligned dequantize output
        big = poisoned((x.size + 1,), np.uint8)
        q2 = cq.quantize_fp8(x, fmt, out=big[1:])
        assert_bits_equal(q2.data, eq, "q into misaligned out")
        ybig = poisoned((x.size + 1,), in_dtype)
        y = cq.dequantize(q2, out=ybig[1:])
        assert_bits_equal(y, ref.dequantize_fp8(eq, es, fmt, in_dtype), "dequantized into misaligned out")
        assert_bits_equal(cq.amax(x), np.array([ref.amax(xh)], np.float32), "amax of a view")


@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
def test_amax_alone(in_dtype):
    for n in (0, 1, 9, 4096, 100_003, 1 << 22, 9 * _amax_stride_vectors() * 16 // np.dtype(in_dtype).itemsize + 7):
        xh = heavy_tailed((n,), n, in_dtype)
        assert_bits_equal(cq.amax(cupy.asarray(xh)), np.array([ref.amax(xh)], np.float32), f"amax n={n}")


def _amax_stride_vectors():
    from cupyquant import per_tensor

    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    return sms * per_tensor.AMAX_BLOCKS_PER_SM * per_tensor.AMAX_BLOCK


@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
def test_amax_max_element_anywhere(in_dtype):
    # Large enough that the grid-stride loop runs two full unrolled iterations, its remainder loop
    # and the scalar tail; the max sits in each unrolled slot, the remainder and the tail in turn.
    per_vec = 16 // np.dtype(in_dtype).itemsize
    stride = _amax_stride_vectors()
    n = (2 * 4 * stride + stride // 2) * per_vec + per_vec - 1
    x = cupy.zeros(n, in_dtype)
    positions = [0, 1, n - 1, n - per_vec + 1, 8 * stride * per_vec + 5]
    positions += [(it * 4 + u) * stride * per_vec + 3 * per_vec + 1 for it in (0, 1) for u in range(4)]
    for pos in positions:
        x[pos] = -7.5
        assert cq.amax(x).get()[0] == 7.5, pos
        x[pos] = 0


def test_cuda_graph_capture_replays():
    xh = heavy_tailed((3, 4099), 5, ml_dtypes.bfloat16)
    x = cupy.asarray(xh)
    qbuf = cupy.empty(x.shape, np.uint8)
    ybuf = cupy.empty(x.shape, ml_dtypes.bfloat16)
    cq.quantize_fp8(x, out=qbuf).dequantize(out=ybuf)  # compile outside the capture
    stream = side_stream()
    with stream:
        stream.begin_capture()
        q = cq.quantize_fp8(x, out=qbuf)
        cq.dequantize(q, out=ybuf)
        graph = stream.end_capture()
    for seed in (6, 7):  # new data in the same buffer: the replay recomputes amax and scale
        xh = heavy_tailed(x.shape, seed, ml_dtypes.bfloat16)
        # the new data and the poison go on the graph's stream: a non-blocking stream does not wait
        # for the legacy default stream, so a fill issued there can land after the replay (when
        # other work shares the GPU every byte then reads back 0xFF)
        with stream:
            x.set(xh)
            qbuf.fill(0xFF)
            graph.launch(stream)
        stream.synchronize()
        eq, es = ref.quantize_fp8(xh)
        assert_bits_equal(qbuf, eq, "graph replay q")
        assert_bits_equal(q.scale, es, "graph replay scale")
        assert_bits_equal(ybuf, ref.dequantize_fp8(eq, es, "float8_e4m3fn", ml_dtypes.bfloat16), "graph replay y")


_SPIN = r"""
extern "C" __global__ void spin_then_fill(float* x, long long n, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    for (long long i = threadIdx.x; i < n; i += blockDim.x) x[i] = (float)((i * 37) % 1001) - 500.0f;
}
"""


def test_launches_on_the_current_stream():
    # A slow kernel writes x on stream s; the op, called under `with s`, must run after it. Had it
    # gone to another stream it would read the stale zeros.
    n = 1 << 16
    spin = cupy.RawKernel(_SPIN, "spin_then_fill")
    x = cupy.zeros(n, np.float32)
    s = side_stream()
    with s:
        spin((1,), (256,), (x, np.int64(n), np.int64(200_000_000)))  # ~0.1 s
        q = cq.quantize_fp8(x)
        y = q.dequantize()
    s.synchronize()
    xh = ((np.arange(n) * 37) % 1001 - 500).astype(np.float32)
    eq, es = ref.quantize_fp8(xh)
    assert_bits_equal(q.data, eq, "q")
    assert_bits_equal(q.scale, es, "scale")
    assert_bits_equal(y, ref.dequantize_fp8(eq, es, "float8_e4m3fn", np.float32), "y")


def test_no_host_synchronization():
    import cupyx

    x = cupy.asarray(heavy_tailed((4096,), 1, np.float16))
    cq.quantize_fp8(x).dequantize()  # compile first (compiling may synchronize)
    with cupyx.allow_synchronize(False):
        q = cq.quantize_fp8(x)
        q.dequantize()
        cq.quantize_fp8(x, scale=0.5)
        cq.quantize_fp8(x, scale=cupy.ones(1, np.float32))
        cq.amax(x)


def test_bad_input_leaves_out_untouched():
    x = cupy.asarray(heavy_tailed((64,), 2, np.float32))
    out = poisoned((64,), np.uint8)
    before = out.get()
    bad_calls = [
        dict(dtype="int8"),
        dict(scale=-1.0),
        dict(scale=cupy.ones(2, np.float32)),
        dict(scale=cupy.ones(1, np.float64)),
    ]
    for kw in bad_calls:
        with pytest.raises((TypeError, ValueError)):
            cq.quantize_fp8(x, out=out, **kw)
        np.testing.assert_array_equal(out.get(), before)
    with pytest.raises(ValueError, match="out must have shape"):
        cq.quantize_fp8(x, out=poisoned((65,), np.uint8))
    with pytest.raises(TypeError, match="out must have dtype uint8"):
        cq.quantize_fp8(x, out=cupy.empty(64, np.int8))
    with pytest.raises(ValueError, match="out overlaps x"):
        cq.quantize_fp8(x, out=x.view(np.uint8)[:64])


def test_gpu_validation_errors_name_the_argument():
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16"):
        cq.quantize_fp8(cupy.ones(8, np.int32))
    with pytest.raises(ValueError, match="x must be C-contiguous"):
        cq.quantize_fp8(cupy.ones((8, 8), np.float32)[:, ::2])
    q = cq.quantize_fp8(cupy.ones(8, np.float32))
    with pytest.raises(TypeError, match="^out_dtype must be float32, float16 or bfloat16"):
        q.dequantize(np.int8)
    with pytest.raises(ValueError, match="out must have shape"):
        q.dequantize(np.float32, out=cupy.empty(9, np.float32))


def test_to_host_and_nbytes():
    xh = heavy_tailed((10, 3), 9, np.float16)
    q = cq.quantize_fp8(cupy.asarray(xh), "float8_e5m2")
    h = q.to_host()
    assert h["data"].dtype == np.dtype(ml_dtypes.float8_e5m2) and h["data"].shape == (10, 3)
    eq, es = ref.quantize_fp8(xh, "float8_e5m2")
    assert_bits_equal(h["data"].view(np.uint8), eq, "host data")
    assert_bits_equal(h["scale"], es, "host scale")
    assert q.nbytes == 30 + 4 + 4
    assert "float8_e5m2" in repr(q)


def test_leading_dims_and_dlpack_to_torch():
    torch = pytest.importorskip("torch")
    xt = torch.randn(4, 7, 129, dtype=torch.bfloat16, device="cuda")
    x = cupy.from_dlpack(xt)
    assert x.data.ptr == xt.data_ptr()  # no copy
    q = cq.quantize_fp8(x)
    qt = torch.from_dlpack(q.data).view(torch.float8_e4m3fn)
    # the scale as an IEEE float32 quotient on the host (torch would compute 448 / amax on the device
    # as a reciprocal times 448, which can miss by one ulp); torch's float32 product and its RN cast
    # with saturation then match ours
    scale = np.float32(448.0) / np.float32(xt.abs().amax().float().item())
    ref_q = (xt.float() * float(scale)).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(qt.view(torch.uint8), ref_q.view(torch.uint8))


# ------------------------------------------------------------------ programmatic dependent launch
@pytest.mark.parametrize("case", ["fp8-dynamic", "fp8-static-device", "int8-zero-point-device"])
def test_pdl_each_kernel_waits_for_the_kernel_before(case):
    """With PDL (compute capability 9.0+), rounds of new inputs (x, the device scale and zero point),
    each written by a kernel that lets the op's first kernel start at once (tests/_pdl.py): the
    quantizer (memset, amax reduction and cast when dynamic) and the dequantizer of its result, into
    the same out= buffers every round, are bit for bit the reference of each round, in a stream and
    replayed from a CUDA graph."""
    require_arch("pdl")
    shape, R = (37, 515), 4  # 515: the vector path's tail thread
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    xs = [heavy_tailed(shape, 700 + r, ml_dtypes.bfloat16) for r in range(R)]
    ss = [np.array([rng.uniform(0.005, 0.05)], np.float32) for _ in range(R)]
    zs = [np.array([rng.integers(-20, 20)], np.int32) for _ in range(R)]
    x = cupy.empty(shape, ml_dtypes.bfloat16)
    s, z = cupy.empty((1,), np.float32), cupy.empty((1,), np.int32)
    int8 = case.startswith("int8")
    q, y = cupy.empty(shape, np.int8 if int8 else np.uint8), cupy.empty(shape, np.float32)
    if case == "fp8-dynamic":
        inputs, sources = [x], [[cupy.asarray(a)] for a in xs]
        names = ["q", "scale_inv", "amax", "y"]

        def step():
            qt = cq.quantize_fp8(x, out=q)
            return [qt.data, qt.scale, qt.amax, cq.dequantize(qt, np.float32, out=y)]

        def want(r):
            eq, es = ref.quantize_fp8(xs[r])
            amax = np.array([ref.amax(xs[r])], np.float32)
            return [eq, es, amax, ref.dequantize_fp8(eq, es, "float8_e4m3fn", np.float32)]
    elif case == "fp8-static-device":
        inputs, sources = [x, s], [[cupy.asarray(a), cupy.asarray(b)] for a, b in zip(xs, ss)]
        names = ["q", "scale_inv", "y"]

        def step():
            qt = cq.quantize_fp8(x, scale=s, out=q)
            return [qt.data, qt.scale, cq.dequantize(qt, np.float32, out=y)]

        def want(r):
            eq, es = ref.quantize_fp8(xs[r], scale=float(ss[r][0]))
            return [eq, es, ref.dequantize_fp8(eq, es, "float8_e4m3fn", np.float32)]
    else:
        inputs = [x, s, z]
        sources = [[cupy.asarray(a), cupy.asarray(b), cupy.asarray(c)] for a, b, c in zip(xs, ss, zs)]
        names = ["q", "scale", "zero_point", "y"]

        def step():
            qt = cq.quantize_int8(x, scale=s, zero_point=z, out=q)
            return [qt.data, qt.scale, qt.zero_point, cq.dequantize(qt, np.float32, out=y)]

        def want(r):
            eq, es, ez = ref.quantize_int8(xs[r], scale=ss[r][0], zero_point=int(zs[r][0]))
            return [eq, es, ez, ref.dequantize_int8(eq, es, ez, np.float32)]

    check_rounds(
        step, inputs, sources, lambda r, got, where: assert_rounds_equal(got, want(r), names, f"{where} round {r}")
    )
