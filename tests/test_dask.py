"""cupyquant.dask: Dask arrays quantized chunk by chunk give the one-array call's bytes. On the CPU
with NumPy chunks (the reference); on the GPU with CuPy chunks (the kernels); on two GPUs through a
dask_cuda cluster."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_bits_equal, heavy_tailed

from cupyquant import reference as ref

da = pytest.importorskip("dask.array")
cqd = pytest.importorskip("cupyquant.dask")

SHAPE = (300, 256)  # 300 rows in chunks of 64 (the last one 44), K split in two chunks: rechunked


def _x():
    return heavy_tailed(SHAPE, 5, ml_dtypes.bfloat16)


def _cases():
    return [
        ("groupwise fp8 g128", lambda x: cqd.quantize_groupwise(x, "float8_e4m3fn", group_size=128)),
        ("groupwise int8 token", lambda x: cqd.quantize_groupwise(x, "int8", group_size=None)),
        ("mxfp8", lambda x: cqd.quantize_mx(x, "float8_e4m3fn")),
        ("mxfp4", lambda x: cqd.quantize_mx(x, "float4_e2m1fn")),
        ("nvfp4", lambda x: cqd.quantize_nvfp4(x)),
    ]


def _reference(name, x):
    if name.startswith("groupwise"):
        fmt = "float8_e4m3fn" if "fp8" in name else "int8"
        d, s = ref.quantize_groupwise(x, fmt, group_size=128 if "g128" in name else None)
        y = ref.dequantize_groupwise(d, s, fmt, np.float32, group_size=128 if "g128" in name else None)
        return d, s, y
    if name.startswith("mx"):
        fmt = "float8_e4m3fn" if name == "mxfp8" else "float4_e2m1fn"
        d, s = ref.quantize_mx(x, fmt)
        return d, s, ref.dequantize_mx(d, s, fmt, np.float32)
    d, s, g = ref.quantize_nvfp4(x)
    return d, s, ref.dequantize_nvfp4(d, s, g, np.float32)


@pytest.mark.parametrize("case", range(len(_cases())), ids=[c[0] for c in _cases()])
def test_numpy_chunks_give_the_one_array_bytes(case):
    name, fn = _cases()[case]
    x = _x()
    dx = da.from_array(x, chunks=(64, 128))
    with pytest.warns(UserWarning, match="rechunking to whole rows"):
        q = fn(dx)
    got = q.compute(scheduler="threads")
    d, s, y = _reference(name, x)
    assert_bits_equal(got["data"], d, f"{name} data")
    assert_bits_equal(got["scale"], s, f"{name} scale")
    assert_bits_equal(q.dequantize("float32").compute(), y, f"{name} dequantized")
    if name == "nvfp4":
        assert got["global_scale"][0] == ref.nvfp4_global_scale(ref.amax(x))


def test_bad_input():
    with pytest.raises(TypeError, match="x must be a dask.array.Array"):
        cqd.quantize_mx(np.zeros((4, 32), np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(_cases())), ids=[c[0] for c in _cases()])
def test_cupy_chunks_give_the_one_array_bytes(case):
    import cupy

    import cupyquant as cq

    name, fn = _cases()[case]
    x = cupy.asarray(_x())
    dx = da.from_array(x, chunks=(64, 256), asarray=False)
    q = fn(dx)
    got = q.compute(scheduler="synchronous")
    if name.startswith("groupwise"):
        fmt = "float8_e4m3fn" if "fp8" in name else "int8"
        whole = cq.quantize_groupwise(x, fmt, group_size=128 if "g128" in name else None)
    elif name.startswith("mx"):
        whole = cq.quantize_mx(x, "float8_e4m3fn" if name == "mxfp8" else "float4_e2m1fn", scale_layout="dense")
    else:
        whole = cq.quantize_nvfp4(x, scale_layout="dense")
        assert_bits_equal(got["global_scale"], whole.global_scale.reshape(-1), "global_scale")
    assert_bits_equal(got["data"], whole.data, f"{name} data")
    assert_bits_equal(got["scale"], whole.scale, f"{name} scale")
    assert_bits_equal(q.dequantize("float32").compute(), cq.dequantize(whole, "float32"), f"{name} dequantized")


@pytest.mark.gpu
def test_two_gpus_give_the_one_array_bytes():
    import cupy

    import cupyquant as cq

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    dask_cuda = pytest.importorskip("dask_cuda")
    distributed = pytest.importorskip("distributed")
    x = _x()
    with dask_cuda.LocalCUDACluster(n_workers=2) as cluster, distributed.Client(cluster):
        dx = da.from_array(x, chunks=(64, 256)).map_blocks(cupy.asarray, meta=cupy.empty((0, 0), x.dtype))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = cqd.quantize_nvfp4(dx).compute()
    whole = cq.quantize_nvfp4(cupy.asarray(x), scale_layout="dense")
    assert_bits_equal(got["data"], whole.data, "data")
    assert_bits_equal(got["scale"], whole.scale, "scale")
