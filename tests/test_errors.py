"""Bad input to every public op, one table: the exception type, an argument-naming message, and the
caller's buffers untouched afterwards.

Each row of ``TABLE`` is ``(function, bad class, call, expected type, argument)``. ``call`` takes a
``watch`` function and builds its inputs itself (so that the table is built without a GPU); every
buffer passed through ``watch`` is copied to the host before the op runs and compared byte for byte
after it raised. The message must *begin* with the argument's name (``"x must ..."``,
``"group_size=100 is not ..."``, ``"out overlaps x"``, ``"w.data must ..."``): every message of the
library is phrased that way, and a name buried later in a sentence could be the English article
``a`` or another argument.

Bad classes: ``numpy`` / ``list`` (not a CuPy array), ``dtype`` (unsupported input dtype), ``0d``,
``group_size`` / ``block_size`` / ``shape`` (sizes the op cannot take), ``noncontig``, ``device`` (an
array on a second GPU; skipped below two), ``out_shape`` / ``out_dtype`` / ``out_alias`` /
``out_numpy`` / ``out_noncontig`` / ``out_device`` (and the same for ``scale_out``), ``option``
(bad option strings and scalars). Rows named ``...-cpu`` run without a GPU: NumPy or list inputs,
host-built result objects, size helpers, and options that the wrappers check before they look at
``x`` (``dtype``, ``rounding``, weight ``symmetric``); the other rows need CuPy arrays and carry the
``gpu`` mark.

A call that breaks the signature itself (a keyword-only argument given by position, a required one
left out) gets Python's own TypeError, raised before the function runs, whose message begins with the
function's name and parentheses (``quantize_int8() takes 1 positional argument but 2 were given``,
``quantize_int8() missing 1 required keyword-only argument: 'scale'``): such rows name
``quantize_int8()``.
"""

from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest
from conftest import poisoned

import cupyquant as cq
from cupyquant.kv_cache import kv_scale_cache_shape
from cupyquant.quantized import QuantizedTensor, Scheme
from cupyquant.weight import QuantizedWeight
from cupyquant.weight.formats import weight_scheme

cupy = pytest.importorskip("cupy")

F32, F16, F64 = np.float32, np.float16, np.float64
BF16 = np.dtype(ml_dtypes.bfloat16)
U8, I8 = np.uint8, np.int8


# ------------------------------------------------------------------ inputs (built inside the rows)
def _h(shape=(4, 256), dtype=F32):
    """Distinct finite host values."""
    n = math.prod(shape)
    return np.linspace(-3.0, 5.0, max(n, 1), dtype=np.float32)[:n].reshape(shape).astype(dtype)


def _x(shape=(4, 256), dtype=F32):
    return cupy.asarray(_h(shape, dtype))


def _P(shape, dtype):
    return poisoned(shape, dtype)


def _dev1(make):
    """``make()`` with device 1 current (an array on a second GPU); skips below two GPUs."""
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs a second GPU")
    with cupy.cuda.Device(1):
        return make()


def _qw(shape=(64, 256), dtype=BF16, scheme="int4", group_size=128):
    return cq.quantize_weight(_x(shape, dtype), scheme, group_size=group_size)


def _qw_in_buffer():
    """(qw, base): an int4 weight (64, 256) whose data are the first 8192 bytes of a 32768-byte
    buffer, so that a bf16 (64, 256) view of the buffer overlaps w.data."""
    qw = _qw()
    base = _P((64 * 256 * 2,), U8)
    base[: qw.data.size] = qw.data.reshape(-1)
    qw.data = base[: qw.data.size].reshape(qw.data.shape)
    return qw, base


def _fp8_in_buffer():
    """(q, base): per-tensor FP8 of 64 float32 elements whose data are the first 64 bytes of a
    256-byte buffer, so that a float32 (64,) view of the buffer overlaps q.data."""
    base = _P((256,), U8)
    return cq.quantize_fp8(_x((64,)), out=base[:64]), base


def _group_in_buffer():
    base = _P((4096,), U8)
    return cq.quantize_groupwise(_x(), out=base[:1024].reshape(4, 256)), base


def _mx_in_buffer():
    base = _P((4096,), U8)
    return cq.quantize_mx(_x(), "float4_e2m1fn", out=base[:512].reshape(4, 128)), base


def _host_qw():
    """A QuantizedWeight whose arrays are NumPy (e.g. a checkpoint loaded on the host)."""
    scheme = weight_scheme("int4", None, 128, F16)
    return QuantizedWeight(np.full((8, 64), 0x88, U8), np.ones((8, 1), F16), None, scheme, (8, 128), F16)


def _host_qt():
    """A QuantizedTensor whose arrays are NumPy."""
    scheme = Scheme("float8_e4m3fn", "tensor", None, "float32", "scalar", "per_tensor")
    return QuantizedTensor(np.zeros(8, U8), np.ones(1, F32), scheme, (8,), F32)


def _aliased(shape, view_of_base):
    """(x, other): float32 x of ``shape`` holding _h values at the start of a zeroed buffer twice
    its size, and ``view_of_base(base)``, a view of that same buffer (so it overlaps x)."""
    n = math.prod(shape)
    base = cupy.zeros((2 * n,), F32)
    base[:n] = _x((n,))
    return base[:n].reshape(shape), view_of_base(base)


# ------------------------------------------------------------------ the table
TABLE = []


def row(fn, bad, call, exc, arg, gpu=True):
    mark = (pytest.mark.gpu,) if gpu else ()
    TABLE.append(pytest.param(fn, bad, call, exc, arg, id=f"{fn}-{bad}" + ("" if gpu else "-cpu"), marks=mark))


def cpu(fn, bad, call, exc, arg):
    row(fn, bad, call, exc, arg, gpu=False)


# quantize_fp8(x, dtype, *, scale, out): x any shape (0-d included), C-contiguous
f = "quantize_fp8"
cpu(f, "numpy", lambda w: cq.quantize_fp8(w(_h((64,)))), TypeError, "x")
cpu(f, "list", lambda w: cq.quantize_fp8([1.0, 2.0]), TypeError, "x")
cpu(f, "option_dtype_name", lambda w: cq.quantize_fp8(w(_h((64,))), "float8_e4m3"), ValueError, "dtype")
cpu(f, "option_dtype_object", lambda w: cq.quantize_fp8(w(_h((64,))), object()), TypeError, "dtype")
row(f, "dtype_int32", lambda w: cq.quantize_fp8(w(cupy.arange(64, dtype=np.int32))), TypeError, "x")
row(f, "dtype_float64", lambda w: cq.quantize_fp8(w(cupy.ones(64, F64))), TypeError, "x")
row(f, "noncontig", lambda w: cq.quantize_fp8(w(_x((128,)))[::2]), ValueError, "x")
row(f, "option_dtype_name", lambda w: cq.quantize_fp8(w(_x((64,))), "float8_e4m3"), ValueError, "dtype")
row(f, "option_dtype_not_fp8", lambda w: cq.quantize_fp8(w(_x((64,))), "int8"), ValueError, "dtype")
row(f, "option_scale_negative", lambda w: cq.quantize_fp8(w(_x((64,))), scale=-1.0), ValueError, "scale")
row(f, "option_scale_nan", lambda w: cq.quantize_fp8(w(_x((64,))), scale=float("nan")), ValueError, "scale")
row(f, "option_scale_str", lambda w: cq.quantize_fp8(w(_x((64,))), scale="1.0"), TypeError, "scale")
row(f, "option_scale_numpy", lambda w: cq.quantize_fp8(w(_x((64,))), scale=np.ones(1, F32)), TypeError, "scale")
row(f, "option_scale_dtype", lambda w: cq.quantize_fp8(w(_x((64,))), scale=cupy.ones(1, F64)), TypeError, "scale")
row(f, "option_scale_size", lambda w: cq.quantize_fp8(w(_x((64,))), scale=cupy.ones(2, F32)), ValueError, "scale")
row(
    f,
    "scale_device",
    lambda w: cq.quantize_fp8(w(_x((64,))), scale=_dev1(lambda: cupy.ones(1, F32))),
    ValueError,
    "scale",
)
row(f, "out_numpy", lambda w: cq.quantize_fp8(w(_x((64,))), out=w(np.zeros(64, U8))), TypeError, "out")
row(f, "out_shape", lambda w: cq.quantize_fp8(w(_x((64,))), out=w(_P((65,), U8))), ValueError, "out")
row(f, "out_dtype", lambda w: cq.quantize_fp8(w(_x((64,))), out=w(_P((64,), I8))), TypeError, "out")
row(f, "out_noncontig", lambda w: cq.quantize_fp8(w(_x((64,))), out=w(_P((128,), U8))[::2]), ValueError, "out")
row(f, "out_alias", lambda w: (lambda x: cq.quantize_fp8(x, out=x.view(U8)[:64]))(w(_x((64,)))), ValueError, "out")
row(f, "out_device", lambda w: cq.quantize_fp8(w(_x((64,))), out=w(_dev1(lambda: _P((64,), U8)))), ValueError, "out")

# amax(x)
f = "amax"
cpu(f, "numpy", lambda w: cq.amax(w(_h((64,)))), TypeError, "x")
cpu(f, "list", lambda w: cq.amax([1.0]), TypeError, "x")
row(f, "dtype_int32", lambda w: cq.amax(w(cupy.arange(64, dtype=np.int32))), TypeError, "x")
row(f, "noncontig", lambda w: cq.amax(w(_x((128,)))[::2]), ValueError, "x")

# quantize_groupwise(x, dtype, *, group_size, scale_layout, scale_pow2, scale_dtype, scale_ub, out, scale_out)
f = "quantize_groupwise"
G = cq.quantize_groupwise
cpu(f, "numpy", lambda w: G(w(_h())), TypeError, "x")
cpu(f, "list", lambda w: G([1.0] * 128), TypeError, "x")
cpu(f, "option_dtype", lambda w: G(w(_h()), "float4_e2m1fn"), ValueError, "dtype")
row(f, "dtype_int8", lambda w: G(w(cupy.ones((4, 256), I8))), TypeError, "x")
row(f, "0d", lambda w: G(w(cupy.ones((), F32))), ValueError, "x")
row(f, "group_size_unsupported", lambda w: G(w(_x()), group_size=100), ValueError, "group_size")
row(f, "group_size_zero", lambda w: G(w(_x()), group_size=0), ValueError, "group_size")
row(f, "group_size_not_dividing", lambda w: G(w(_x((4, 384))), group_size=256), ValueError, "group_size")
row(f, "noncontig_last_axis", lambda w: G(w(_x((4, 512)))[:, ::2]), ValueError, "x")
row(f, "noncontig_leading", lambda w: G(w(_x((4, 6, 128)))[:, :3]), ValueError, "x")
row(f, "option_dtype", lambda w: G(w(_x()), "float4_e2m1fn"), ValueError, "dtype")
row(f, "option_layout", lambda w: G(w(_x()), scale_layout="diag"), ValueError, "scale_layout")
row(f, "option_scale_dtype", lambda w: G(w(_x()), scale_dtype="float16"), ValueError, "scale_dtype")
row(f, "option_scale_dtype_e4m3", lambda w: G(w(_x()), scale_dtype="float8_e4m3fn"), ValueError, "scale_dtype")
row(f, "option_scale_ub_negative", lambda w: G(w(_x()), scale_ub=-1.0), ValueError, "scale_ub")
row(f, "option_scale_ub_numpy", lambda w: G(w(_x()), scale_ub=np.ones(1, F32)), TypeError, "scale_ub")
row(f, "option_scale_ub_dtype", lambda w: G(w(_x()), scale_ub=cupy.ones(1, F64)), TypeError, "scale_ub")
row(f, "option_scale_ub_size", lambda w: G(w(_x()), scale_ub=cupy.ones(3, F32)), ValueError, "scale_ub")
row(f, "scale_ub_device", lambda w: G(w(_x()), scale_ub=_dev1(lambda: cupy.ones(1, F32))), ValueError, "scale_ub")
row(f, "out_numpy", lambda w: G(w(_x()), out=w(np.zeros((4, 256), U8))), TypeError, "out")
row(f, "out_shape", lambda w: G(w(_x()), out=w(_P((4, 128), U8))), ValueError, "out")
row(f, "out_dtype", lambda w: G(w(_x()), "int8", out=w(_P((4, 256), U8))), TypeError, "out")
row(f, "out_noncontig", lambda w: G(w(_x()), out=w(_P((4, 512), U8))[:, ::2]), ValueError, "out")
row(
    f,
    "out_alias",
    lambda w: (lambda x: G(x, out=x.view(U8).reshape(-1)[:1024].reshape(4, 256)))(w(_x())),
    ValueError,
    "out",
)
row(f, "out_device", lambda w: G(w(_x()), out=w(_dev1(lambda: _P((4, 256), U8)))), ValueError, "out")
row(f, "scale_out_numpy", lambda w: G(w(_x()), scale_out=w(np.zeros((4, 2), F32))), TypeError, "scale_out")
row(f, "scale_out_shape", lambda w: G(w(_x()), scale_out=w(_P((4, 3), F32))), ValueError, "scale_out")
row(f, "scale_out_dtype", lambda w: G(w(_x()), scale_out=w(_P((4, 2), F64))), TypeError, "scale_out")
row(
    f,
    "scale_out_strides",
    lambda w: G(w(_x()), scale_layout="col", scale_out=w(_P((4, 2), F32))),
    ValueError,
    "scale_out",
)
row(
    f,
    "scale_out_alias_x",
    lambda w: (lambda x, s: G(w(x), scale_out=w(s)))(*_aliased((4, 256), lambda base: base[:8].reshape(4, 2))),
    ValueError,
    "scale_out",
)
row(
    f,
    "scale_out_alias_out",
    lambda w: (lambda buf: G(w(_x()), out=buf[:1024].reshape(4, 256), scale_out=buf[:32].view(F32).reshape(4, 2)))(
        w(_P((1024,), U8))
    ),
    ValueError,
    "scale_out",
)
row(
    f,
    "scale_out_device",
    lambda w: G(w(_x()), scale_out=w(_dev1(lambda: cq.empty_scales((4, 256))))),
    ValueError,
    "scale_out",
)

# silu_mul_quantize(x, dtype, *, group_size, scale_layout, scale_ub, out, scale_out): x (..., 2H)
f = "silu_mul_quantize"
S = cq.silu_mul_quantize
cpu(f, "numpy", lambda w: S(w(_h((4, 512)))), TypeError, "x")
cpu(f, "list", lambda w: S([1.0] * 512), TypeError, "x")
cpu(f, "option_dtype", lambda w: S(w(_h((4, 512))), "float4_e2m1fn"), ValueError, "dtype")
row(f, "dtype_float64", lambda w: S(w(cupy.ones((4, 512), F64))), TypeError, "x")
row(f, "0d", lambda w: S(w(cupy.ones((), F32))), ValueError, "x")
row(f, "shape_odd_last_axis", lambda w: S(w(_x((4, 257)))), ValueError, "x")
row(f, "group_size_none", lambda w: S(w(_x((4, 512))), group_size=None), ValueError, "group_size")
row(f, "group_size_unsupported", lambda w: S(w(_x((4, 512))), group_size=96), ValueError, "group_size")
row(f, "group_size_not_dividing", lambda w: S(w(_x((4, 768))), group_size=256), ValueError, "group_size")
row(f, "noncontig", lambda w: S(w(_x((4, 1024)))[:, ::2]), ValueError, "x")
row(f, "option_dtype", lambda w: S(w(_x((4, 512))), "float4_e2m1fn"), ValueError, "dtype")
row(f, "option_layout", lambda w: S(w(_x((4, 512))), scale_layout="diag"), ValueError, "scale_layout")
row(f, "option_scale_ub_negative", lambda w: S(w(_x((4, 512))), scale_ub=-1.0), ValueError, "scale_ub")
row(f, "option_scale_ub_dtype", lambda w: S(w(_x((4, 512))), scale_ub=cupy.ones(1, F64)), TypeError, "scale_ub")
row(f, "out_numpy", lambda w: S(w(_x((4, 512))), out=w(np.zeros((4, 256), U8))), TypeError, "out")
row(f, "out_shape", lambda w: S(w(_x((4, 512))), out=w(_P((4, 512), U8))), ValueError, "out")
row(f, "out_dtype", lambda w: S(w(_x((4, 512))), out=w(_P((4, 256), F32))), TypeError, "out")
row(f, "out_noncontig", lambda w: S(w(_x((4, 512))), out=w(_P((4, 512), U8))[:, ::2]), ValueError, "out")
row(
    f,
    "out_alias",
    lambda w: (lambda x: S(x, out=x.view(U8).reshape(-1)[:1024].reshape(4, 256)))(w(_x((4, 512)))),
    ValueError,
    "out",
)
row(f, "out_device", lambda w: S(w(_x((4, 512))), out=w(_dev1(lambda: _P((4, 256), U8)))), ValueError, "out")
row(f, "scale_out_shape", lambda w: S(w(_x((4, 512))), scale_out=w(_P((4, 4), F32))), ValueError, "scale_out")
row(f, "scale_out_dtype", lambda w: S(w(_x((4, 512))), scale_out=w(_P((4, 2), F64))), TypeError, "scale_out")
row(
    f,
    "scale_out_alias_x",
    lambda w: (lambda x, s: S(w(x), scale_out=w(s)))(*_aliased((4, 512), lambda base: base[:8].reshape(4, 2))),
    ValueError,
    "scale_out",
)

# empty_scales(shape, group_size, scale_layout, scale_dtype): every check comes before the allocation
f = "empty_scales"
cpu(f, "shape_0d", lambda w: cq.empty_scales(()), ValueError, "shape")
cpu(f, "shape_int", lambda w: cq.empty_scales(256), TypeError, "shape")
cpu(f, "shape_negative", lambda w: cq.empty_scales((4, -256), None), ValueError, "shape")
cpu(f, "group_size_unsupported", lambda w: cq.empty_scales((4, 256), 100), ValueError, "group_size")
cpu(f, "group_size_not_dividing", lambda w: cq.empty_scales((4, 100), 128), ValueError, "group_size")
cpu(f, "option_layout", lambda w: cq.empty_scales((4, 256), 128, "diag"), ValueError, "scale_layout")
cpu(f, "option_scale_dtype", lambda w: cq.empty_scales((4, 256), 128, "row", "float16"), ValueError, "scale_dtype")

# quantize_mx(x, dtype, *, scale_layout, rounding, out, scale_out): x (4, 256); scales (4, 8) dense
f = "quantize_mx"
M = cq.quantize_mx
FP4 = "float4_e2m1fn"
cpu(f, "numpy", lambda w: M(w(_h())), TypeError, "x")
cpu(f, "list", lambda w: M([1.0] * 64), TypeError, "x")
cpu(f, "option_dtype", lambda w: M(w(_h()), "int8"), ValueError, "dtype")
cpu(f, "option_rounding", lambda w: M(w(_h()), rounding="nearest"), ValueError, "rounding")
row(f, "dtype_int32", lambda w: M(w(cupy.ones((4, 256), np.int32))), TypeError, "x")
row(f, "0d", lambda w: M(w(cupy.ones((), F32))), ValueError, "x")
row(f, "noncontig", lambda w: M(w(_x((256, 4))).T), ValueError, "x")
row(f, "option_dtype", lambda w: M(w(_x()), "int8"), ValueError, "dtype")
row(f, "option_dtype_e4m3fnuz", lambda w: M(w(_x()), "float8_e4m3fnuz"), ValueError, "dtype")
row(f, "option_rounding", lambda w: M(w(_x()), rounding="nearest"), ValueError, "rounding")
row(f, "option_layout", lambda w: M(w(_x()), scale_layout="row"), ValueError, "scale_layout")
row(f, "out_numpy", lambda w: M(w(_x()), out=w(np.zeros((4, 256), U8))), TypeError, "out")
row(f, "out_shape_fp4", lambda w: M(w(_x()), FP4, out=w(_P((4, 256), U8))), ValueError, "out")
row(f, "out_dtype", lambda w: M(w(_x()), out=w(_P((4, 256), I8))), TypeError, "out")
row(f, "out_noncontig", lambda w: M(w(_x()), out=w(_P((4, 512), U8))[:, ::2]), ValueError, "out")
row(
    f,
    "out_alias",
    lambda w: (lambda x: M(x, out=x.view(U8).reshape(-1)[:1024].reshape(4, 256)))(w(_x())),
    ValueError,
    "out",
)
row(f, "out_device", lambda w: M(w(_x()), out=w(_dev1(lambda: _P((4, 256), U8)))), ValueError, "out")
row(f, "scale_out_numpy", lambda w: M(w(_x()), scale_out=w(np.zeros((4, 8), U8))), TypeError, "scale_out")
row(f, "scale_out_shape", lambda w: M(w(_x()), scale_out=w(_P((4, 9), U8))), ValueError, "scale_out")
row(
    f,
    "scale_out_shape_swizzled",
    lambda w: M(w(_x()), scale_layout="swizzled", scale_out=w(_P((4, 8), U8))),
    ValueError,
    "scale_out",
)
row(f, "scale_out_dtype", lambda w: M(w(_x()), scale_out=w(_P((4, 8), I8))), TypeError, "scale_out")
row(
    f,
    "scale_out_misaligned",
    lambda w: M(w(_x()), scale_out=w(_P((48,), U8))[1:33].reshape(4, 8)),
    ValueError,
    "scale_out",
)
row(f, "scale_out_noncontig", lambda w: M(w(_x()), scale_out=w(_P((4, 16), U8))[:, ::2]), ValueError, "scale_out")
row(
    f,
    "scale_out_alias_x",
    lambda w: (lambda x, s: M(w(x), scale_out=w(s)))(
        *_aliased((4, 256), lambda base: base.view(U8)[:32].reshape(4, 8))
    ),
    ValueError,
    "scale_out",
)
row(
    f,
    "scale_out_alias_out",
    lambda w: (lambda buf: M(w(_x()), out=buf[:1024].reshape(4, 256), scale_out=buf[:32].reshape(4, 8)))(
        w(_P((1024,), U8))
    ),
    ValueError,
    "scale_out",
)
row(f, "scale_out_device", lambda w: M(w(_x()), scale_out=w(_dev1(lambda: _P((4, 8), U8)))), ValueError, "scale_out")

# quantize_nvfp4(x, *, global_scale, scale_layout, out, scale_out): x (4, 256); data (4, 128); scales (4, 16)
f = "quantize_nvfp4"
N4 = cq.quantize_nvfp4
cpu(f, "numpy", lambda w: N4(w(_h())), TypeError, "x")
cpu(f, "list", lambda w: N4([1.0] * 64), TypeError, "x")
row(f, "dtype_float64", lambda w: N4(w(cupy.ones((4, 256), F64))), TypeError, "x")
row(f, "0d", lambda w: N4(w(cupy.ones((), F32))), ValueError, "x")
row(f, "noncontig_last_axis", lambda w: N4(w(_x((256, 4))).T, global_scale=1.0), ValueError, "x")
row(f, "noncontig_dynamic", lambda w: N4(w(_x((4, 512)))[:, :256]), ValueError, "x")
row(f, "option_layout", lambda w: N4(w(_x()), scale_layout="col"), ValueError, "scale_layout")
row(f, "option_global_scale_zero", lambda w: N4(w(_x()), global_scale=0.0), ValueError, "global_scale")
row(f, "option_global_scale_inf", lambda w: N4(w(_x()), global_scale=float("inf")), ValueError, "global_scale")
row(f, "option_global_scale_str", lambda w: N4(w(_x()), global_scale="2"), TypeError, "global_scale")
row(f, "option_global_scale_numpy", lambda w: N4(w(_x()), global_scale=np.ones(1, F32)), TypeError, "global_scale")
row(f, "option_global_scale_dtype", lambda w: N4(w(_x()), global_scale=cupy.ones(1, F64)), TypeError, "global_scale")
row(f, "option_global_scale_size", lambda w: N4(w(_x()), global_scale=cupy.ones(2, F32)), ValueError, "global_scale")
row(
    f,
    "global_scale_device",
    lambda w: N4(w(_x()), global_scale=_dev1(lambda: cupy.ones(1, F32))),
    ValueError,
    "global_scale",
)
row(f, "out_numpy", lambda w: N4(w(_x()), out=w(np.zeros((4, 128), U8))), TypeError, "out")
row(f, "out_shape", lambda w: N4(w(_x()), out=w(_P((4, 256), U8))), ValueError, "out")
row(f, "out_dtype", lambda w: N4(w(_x()), out=w(_P((4, 128), I8))), TypeError, "out")
row(
    f,
    "out_alias",
    lambda w: (lambda x: N4(x, out=x.view(U8).reshape(-1)[:512].reshape(4, 128)))(w(_x())),
    ValueError,
    "out",
)
row(f, "out_device", lambda w: N4(w(_x()), out=w(_dev1(lambda: _P((4, 128), U8)))), ValueError, "out")
row(
    f,
    "scale_out_shape",
    lambda w: N4(w(_x()), scale_layout="dense", scale_out=w(_P((4, 8), U8))),
    ValueError,
    "scale_out",
)
row(
    f,
    "scale_out_dtype",
    lambda w: N4(w(_x()), scale_layout="dense", scale_out=w(_P((4, 16), I8))),
    TypeError,
    "scale_out",
)
row(
    f,
    "scale_out_alias_out",
    lambda w: (
        lambda buf: N4(w(_x()), scale_layout="dense", out=buf[:512].reshape(4, 128), scale_out=buf[:64].reshape(4, 16))
    )(w(_P((512,), U8))),
    ValueError,
    "scale_out",
)

# block_scale_shape(shape, block_size, scale_layout): pure Python
f = "block_scale_shape"
cpu(f, "shape_0d", lambda w: cq.block_scale_shape(()), ValueError, "shape")
cpu(f, "shape_int", lambda w: cq.block_scale_shape(256), TypeError, "shape")
cpu(f, "shape_negative", lambda w: cq.block_scale_shape((-4, 256)), ValueError, "shape")
cpu(f, "block_size", lambda w: cq.block_scale_shape((4, 256), 64), ValueError, "block_size")
cpu(f, "option_layout", lambda w: cq.block_scale_shape((4, 256), 32, "row"), ValueError, "scale_layout")

# quantize_weight(w, dtype, *, group_size, symmetric): w (N, K) 2-D C-contiguous
f = "quantize_weight"
QW = cq.quantize_weight
cpu(f, "numpy", lambda w: QW(w(_h((64, 256), BF16))), TypeError, "w")
cpu(f, "list", lambda w: QW([[1.0] * 64] * 4), TypeError, "w")
cpu(f, "option_dtype", lambda w: QW(w(_h((64, 256), BF16)), "int8"), ValueError, "dtype")
cpu(
    f,
    "option_symmetric",
    lambda w: QW(w(_h((64, 256), BF16)), "float8_e4m3fn", symmetric=False),
    ValueError,
    "symmetric",
)
row(f, "dtype_int32", lambda w: QW(w(cupy.ones((64, 256), np.int32))), TypeError, "w")
row(f, "0d", lambda w: QW(w(cupy.ones((), F32))), ValueError, "w")
row(f, "shape_1d", lambda w: QW(w(_x((256,), BF16))), ValueError, "w")
row(f, "shape_odd_k", lambda w: QW(w(_x((64, 33), BF16)), group_size=None), ValueError, "w")
row(f, "noncontig", lambda w: QW(w(_x((64, 512), BF16))[:, ::2]), ValueError, "w")
row(f, "group_size_unsupported", lambda w: QW(w(_x((64, 256), BF16)), group_size=256), ValueError, "group_size")
row(f, "group_size_not_dividing", lambda w: QW(w(_x((64, 192), BF16)), group_size=128), ValueError, "group_size")
row(f, "group_size_float", lambda w: QW(w(_x((64, 256), BF16)), group_size=128.0), ValueError, "group_size")
row(f, "option_dtype", lambda w: QW(w(_x((64, 256), BF16)), "int8"), ValueError, "dtype")
row(
    f,
    "option_symmetric",
    lambda w: QW(w(_x((64, 256), BF16)), "float8_e4m3fn", symmetric=False),
    ValueError,
    "symmetric",
)
cpu(f, "group_size_nvfp4", lambda w: QW(w(_h((64, 256), BF16)), "nvfp4", group_size=32), ValueError, "group_size")
row(f, "group_size_mxfp4", lambda w: QW(w(_x((64, 256), BF16)), "mxfp4", group_size=None), ValueError, "group_size")
row(f, "shape_k_nvfp4", lambda w: QW(w(_x((64, 40), BF16)), "nvfp4"), ValueError, "w")
row(f, "shape_k_mxfp4", lambda w: QW(w(_x((64, 48), BF16)), "mxfp4"), ValueError, "w")


def _watch_qw(w, qw):
    for a in (qw.data, qw.scale, qw.zero_point, qw.scale_2):
        if a is not None:
            w(a)
    return qw


def _nvfp4_in_buffer():
    """(qw, base): an nvfp4 weight (64, 256) whose scale_2 is element 5 of a float32 (64, 256)
    buffer, so that the buffer as out overlaps w.scale_2."""
    q = _qw(scheme="nvfp4", group_size=16)
    base = _P((64, 256), F32)
    base.reshape(-1)[5:6] = q.scale_2
    return QuantizedWeight.from_checkpoint(q.data, q.scale, format="nvfp4", scale_2=base.reshape(-1)[5:6]), base


def _with(obj, **attrs):
    for k, v in attrs.items():
        setattr(obj, k, v)
    return obj


# dequantize_weight(w, out_dtype, *, out): w (64, 256) bf16 int4 g128
f = "dequantize_weight"
DW = cq.dequantize_weight
cpu(f, "numpy", lambda w: DW(w(np.zeros((64, 128), U8))), TypeError, "w")
cpu(f, "quantized_tensor", lambda w: DW(_host_qt()), TypeError, "w")
cpu(f, "host_arrays", lambda w: DW(_watch_qw(w, _host_qw())), TypeError, "w.data")
row(f, "option_out_dtype", lambda w: DW(_watch_qw(w, _qw()), "int8"), TypeError, "out_dtype")
row(f, "option_out_dtype_keyword", lambda w: DW(_watch_qw(w, _qw()), out_dtype=np.int32), TypeError, "out_dtype")
row(
    f,
    "data_noncontig",
    lambda w: DW((lambda q: _with(q, data=q.data[:, ::-1]))(_watch_qw(w, _qw()))),
    ValueError,
    "w.data",
)
row(
    f,
    "scales_shape",
    lambda w: DW((lambda q: _with(q, scale=cupy.ascontiguousarray(q.scale[:, :1])))(_watch_qw(w, _qw()))),
    ValueError,
    "w.scale",
)
row(f, "out_numpy", lambda w: DW(_watch_qw(w, _qw()), out=w(np.zeros((64, 256), BF16))), TypeError, "out")
row(f, "out_shape", lambda w: DW(_watch_qw(w, _qw()), out=w(_P((64, 128), BF16))), ValueError, "out")
row(f, "out_dtype", lambda w: DW(_watch_qw(w, _qw()), out=w(_P((64, 256), F32))), TypeError, "out")
row(f, "out_noncontig", lambda w: DW(_watch_qw(w, _qw()), out=w(_P((64, 512), BF16))[:, ::2]), ValueError, "out")
row(
    f,
    "out_alias",
    lambda w: (lambda q, base: DW(_watch_qw(w, q), out=w(base).view(BF16).reshape(64, 256)))(*_qw_in_buffer()),
    ValueError,
    "out",
)
row(f, "out_device", lambda w: DW(_watch_qw(w, _qw()), out=w(_dev1(lambda: _P((64, 256), BF16)))), ValueError, "out")
row(
    f,
    "out_alias_scale_2",
    lambda w: (lambda q, base: DW(_watch_qw(w, q), F32, out=w(base)))(*_nvfp4_in_buffer()),
    ValueError,
    "out",
)
row(
    f,
    "scale_2_missing",
    lambda w: DW(_with(_watch_qw(w, _qw(scheme="nvfp4", group_size=16)), scale_2=None)),
    ValueError,
    "w.scale_2",
)
row(
    f,
    "scale_2_dtype",
    lambda w: DW(_with(_watch_qw(w, _qw(scheme="nvfp4", group_size=16)), scale_2=cupy.ones(1, F64))),
    ValueError,
    "w.scale_2",
)
row(
    f,
    "scale_2_mxfp4",
    lambda w: DW(_with(_watch_qw(w, _qw(scheme="mxfp4", group_size=32)), scale_2=cupy.ones(1, F32))),
    ValueError,
    "w.scale_2",
)

# QuantizedWeight.from_checkpoint(data, scale, *, format, block_size, scale_2, global_scale, dtype): FP4
# data (64, 128) uint8 (K = 256), scales (64, 16) (nvfp4) or (64, 8) (mxfp4) uint8
f = "QuantizedWeight.from_checkpoint"
FC = QuantizedWeight.from_checkpoint
_FD, _FS = (64, 128), (64, 16)
cpu(
    f,
    "option_scale_2_missing",
    lambda w: FC(w(np.zeros(_FD, U8)), w(np.zeros(_FS, U8)), format="nvfp4"),
    ValueError,
    "scale_2",
)
cpu(
    f,
    "option_scale_2_and_global_scale",
    lambda w: FC(w(np.zeros(_FD, U8)), w(np.zeros(_FS, U8)), format="nvfp4", scale_2=1.0, global_scale=1.0),
    ValueError,
    "scale_2",
)
cpu(
    f,
    "option_scale_2_mxfp4",
    lambda w: FC(w(np.zeros(_FD, U8)), w(np.zeros((64, 8), U8)), format="mxfp4", scale_2=1.0),
    ValueError,
    "scale_2",
)
cpu(
    f,
    "option_global_scale_fp8",
    lambda w: FC(w(np.zeros((64, 256), U8)), w(np.ones((1, 2), F32)), global_scale=2.0),
    ValueError,
    "global_scale",
)
cpu(
    f,
    "block_size_nvfp4",
    lambda w: FC(w(np.zeros(_FD, U8)), w(np.zeros(_FS, U8)), format="nvfp4", block_size=(128, 128), scale_2=1.0),
    ValueError,
    "block_size",
)
cpu(
    f,
    "numpy_nvfp4",
    lambda w: FC(w(np.zeros(_FD, U8)), w(np.zeros(_FS, U8)), format="nvfp4", scale_2=1.0),
    TypeError,
    "data",
)
row(
    f,
    "data_dtype_nvfp4",
    lambda w: FC(w(cupy.zeros(_FD, I8)), w(cupy.zeros(_FS, U8)), format="nvfp4", scale_2=1.0),
    TypeError,
    "data",
)
row(
    f,
    "shape_k_nvfp4",
    lambda w: FC(w(cupy.zeros((64, 12), U8)), w(cupy.zeros((64, 1), U8)), format="nvfp4", scale_2=1.0),
    ValueError,
    "data",
)
row(
    f,
    "noncontig_nvfp4",
    lambda w: FC(w(cupy.zeros((64, 256), U8))[:, ::2], w(cupy.zeros(_FS, U8)), format="nvfp4", scale_2=1.0),
    ValueError,
    "data",
)
row(
    f,
    "scale_dtype_nvfp4",
    lambda w: FC(w(cupy.zeros(_FD, U8)), w(cupy.ones(_FS, F32)), format="nvfp4", scale_2=1.0),
    TypeError,
    "scale",
)
row(
    f,
    "scale_shape_mxfp4",
    lambda w: FC(w(cupy.zeros(_FD, U8)), w(cupy.zeros(_FS, U8)), format="mxfp4"),
    ValueError,
    "scale",
)
row(
    f,
    "option_scale_2_zero",
    lambda w: FC(w(cupy.zeros(_FD, U8)), w(cupy.zeros(_FS, U8)), format="nvfp4", scale_2=0.0),
    ValueError,
    "scale_2",
)
row(
    f,
    "option_scale_2_dtype",
    lambda w: FC(w(cupy.zeros(_FD, U8)), w(cupy.zeros(_FS, U8)), format="nvfp4", scale_2=w(cupy.ones(1, F64))),
    TypeError,
    "scale_2",
)
row(
    f,
    "option_global_scale_size",
    lambda w: FC(w(cupy.zeros(_FD, U8)), w(cupy.zeros(_FS, U8)), format="nvfp4", global_scale=w(cupy.ones(2, F32))),
    ValueError,
    "global_scale",
)
row(
    f,
    "scale_2_device",
    lambda w: FC(
        w(cupy.zeros(_FD, U8)), w(cupy.zeros(_FS, U8)), format="nvfp4", scale_2=w(_dev1(lambda: cupy.ones(1, F32)))
    ),
    ValueError,
    "scale_2",
)

# from_checkpoint, INT4: data (33, 48) uint8 (K = 96), block_size (1, 32): scales (33, 3), uint4
# zero points (33, 2) (three groups, the last byte's high nibble unused)
_ID, _IS, _IZ = (33, 48), (33, 3), (33, 2)


def _int4_fc(w, fmt="uint4", data=None, scale=None, zero_point=None, **kw):
    """from_checkpoint of an INT4 weight whose arrays default to valid CuPy ones, each watched."""
    data = w(cupy.zeros(_ID, U8)) if data is None else data
    scale = w(cupy.ones(_IS, F32)) if scale is None else scale
    if zero_point is None and fmt == "uint4":
        zero_point = w(cupy.full(_IZ, 0x88, U8))
    return FC(data, scale, format=fmt, block_size=kw.pop("block_size", (1, 32)), zero_point=zero_point, **kw)


cpu(f, "option_zero_point_missing", lambda w: FC(w(np.zeros(_ID, U8)), w(np.ones(_IS, F32)), format="uint4",
    block_size=(1, 32)), ValueError, "zero_point")  # fmt: skip
cpu(f, "option_zero_point_int4", lambda w: FC(w(np.zeros(_ID, U8)), w(np.ones(_IS, F32)), format="int4",
    block_size=(1, 32), zero_point=w(np.zeros(_IZ, U8))), ValueError, "zero_point")  # fmt: skip
cpu(f, "option_zero_point_fp8", lambda w: FC(w(np.zeros((64, 256), U8)), w(np.ones((1, 2), F32)),
    zero_point=w(np.zeros((64, 1), U8))), ValueError, "zero_point")  # fmt: skip
cpu(f, "option_zero_point_nvfp4", lambda w: FC(w(np.zeros(_FD, U8)), w(np.zeros(_FS, U8)), format="nvfp4",
    scale_2=1.0, zero_point=w(np.zeros((64, 8), U8))), ValueError, "zero_point")  # fmt: skip
cpu(f, "block_size_default_int4", lambda w: FC(w(np.zeros(_ID, U8)), w(np.ones(_IS, F32)), format="int4"),
    ValueError, "block_size")  # fmt: skip
cpu(f, "block_size_blocks_int4", lambda w: FC(w(np.zeros(_ID, U8)), w(np.ones(_IS, F32)), format="int4",
    block_size=(128, 128)), ValueError, "block_size")  # fmt: skip
cpu(f, "block_size_group_48_int4", lambda w: FC(w(np.zeros(_ID, U8)), w(np.ones(_IS, F32)), format="int4",
    block_size=(1, 48)), ValueError, "block_size")  # fmt: skip
cpu(f, "block_size_float_int4", lambda w: FC(w(np.zeros(_ID, U8)), w(np.ones(_IS, F32)), format="int4",
    block_size=(1, 32.0)), ValueError, "block_size")  # fmt: skip
cpu(f, "numpy_int4", lambda w: FC(w(np.zeros(_ID, U8)), w(np.ones(_IS, F32)), format="int4", block_size=(1, 32)),
    TypeError, "data")  # fmt: skip
cpu(f, "option_dtype_uint4", lambda w: FC(w(np.zeros(_ID, U8)), w(np.ones(_IS, F32)), format="uint4",
    block_size=(1, 32), zero_point=w(np.zeros(_IZ, U8)), dtype="int8"), TypeError, "dtype")  # fmt: skip
row(f, "data_dtype_int4", lambda w: _int4_fc(w, "int4", data=w(cupy.zeros(_ID, I8))), TypeError, "data")
row(f, "data_1d_int4", lambda w: _int4_fc(w, "int4", data=w(cupy.zeros(48, U8))), ValueError, "data")
row(f, "noncontig_int4", lambda w: _int4_fc(w, "int4", data=w(cupy.zeros((33, 96), U8))[:, ::2]), ValueError, "data")
row(f, "shape_k_empty_int4", lambda w: _int4_fc(w, "int4", data=w(cupy.zeros((33, 0), U8)),
    scale=w(cupy.ones((33, 0), F32))), ValueError, "data")  # fmt: skip
row(f, "block_size_k_int4", lambda w: _int4_fc(w, "int4", block_size=(1, 64)), ValueError, "block_size")
row(f, "scale_numpy_int4", lambda w: _int4_fc(w, "int4", scale=w(np.ones(_IS, F32))), TypeError, "scale")
row(f, "scale_dtype_uint4", lambda w: _int4_fc(w, scale=w(cupy.ones(_IS, cupy.int32))), TypeError, "scale")
row(f, "scale_shape_uint4", lambda w: _int4_fc(w, scale=w(cupy.ones((33, 6), F32))), ValueError, "scale")
row(f, "scale_shape_channel_int4", lambda w: _int4_fc(w, "int4", scale=w(cupy.ones(_IS, F32)), block_size=None),
    ValueError, "scale")  # fmt: skip
row(f, "scale_inexact_int4", lambda w: _int4_fc(w, "int4", scale=w(cupy.full(_IS, 0.1, F64))), ValueError, "scale")
row(f, "scale_device_int4", lambda w: _int4_fc(w, "int4", scale=w(_dev1(lambda: cupy.ones(_IS, F32)))), ValueError,
    "scale")  # fmt: skip
row(f, "zero_point_numpy", lambda w: _int4_fc(w, zero_point=w(np.zeros(_IZ, U8))), TypeError, "zero_point")
row(f, "zero_point_dtype", lambda w: _int4_fc(w, zero_point=w(cupy.zeros(_IZ, I8))), TypeError, "zero_point")
row(f, "zero_point_shape", lambda w: _int4_fc(w, zero_point=w(cupy.zeros((33, 3), U8))), ValueError, "zero_point")
row(f, "zero_point_shape_channel", lambda w: _int4_fc(w, scale=w(cupy.ones(33, F32)), block_size=None,
    zero_point=w(cupy.zeros(_IZ, U8))), ValueError, "zero_point")  # fmt: skip
row(f, "zero_point_device", lambda w: _int4_fc(w, zero_point=w(_dev1(lambda: cupy.zeros(_IZ, U8)))), ValueError,
    "zero_point")  # fmt: skip


# scaled_matmul(a, b, *, out_dtype, bias, out) and scaled_mm(a, b, a_scale, b_scale, ...): FP8 codes
def _fp8_qt(shape):
    return cq.quantize_fp8(_x(shape))


f = "scaled_matmul"
SM = cq.scaled_matmul
cpu(f, "a_numpy", lambda w: SM(w(_h((4, 256))), _host_qt()), TypeError, "a")
cpu(f, "a_host_arrays", lambda w: SM(_host_qt(), _host_qt()), TypeError, "a.data")
row(f, "b_not_quantized", lambda w: SM(_fp8_qt((4, 256)), w(cupy.zeros((64, 256), U8))), TypeError, "b")
row(f, "b_int4", lambda w: SM(_fp8_qt((4, 256)), _watch_qw(w, _qw())), ValueError, "b")
row(f, "shape_k", lambda w: SM(_fp8_qt((4, 128)), _watch_qw(w, _qw(scheme="float8_e4m3fn"))), ValueError, "a")
row(
    f,
    "option_out_dtype",
    lambda w: SM(_fp8_qt((4, 256)), _qw(scheme="float8_e4m3fn"), out_dtype=F64),
    TypeError,
    "out_dtype",
)
row(
    f,
    "bias_dtype",
    lambda w: SM(_fp8_qt((4, 256)), _qw(scheme="float8_e4m3fn"), bias=w(_x((64,), F32))),
    TypeError,
    "bias",
)
row(
    f,
    "out_shape",
    lambda w: SM(_fp8_qt((4, 256)), _qw(scheme="float8_e4m3fn"), out=w(_P((4, 65), BF16))),
    ValueError,
    "out",
)

f = "scaled_mm"
SMM = cq.scaled_mm
cpu(f, "a_numpy", lambda w: SMM(w(np.zeros((4, 256), U8)), w(np.zeros((64, 256), U8)), F32(1), F32(1)), TypeError, "a")
cpu(f, "option_a_format", lambda w: SMM(None, None, None, None, a_format="int8"), ValueError, "a_format")
row(
    f,
    "a_dtype",
    lambda w: SMM(w(cupy.zeros((4, 256), cupy.int16)), w(cupy.zeros((64, 256), U8)), _x((1,)), _x((1,))),
    TypeError,
    "a",
)
row(
    f,
    "b_dtype_int8_a",
    lambda w: SMM(w(cupy.zeros((4, 256), I8)), w(cupy.zeros((64, 256), U8)), _x((1,)), _x((1,))),
    TypeError,
    "b",
)
row(
    f,
    "a_scale_int8_groups",
    lambda w: SMM(w(cupy.zeros((4, 256), I8)), w(cupy.zeros((64, 256), I8)), _x((4, 2)), _x((1,))),
    ValueError,
    "a_scale",
)

# quantize_int8(x, *, scale, zero_point, out): the static scale is required, by keyword
f = "quantize_int8"
I8Q = cq.quantize_int8
cpu(f, "numpy", lambda w: I8Q(w(_h((64,))), scale=0.5), TypeError, "x")
cpu(f, "scale_positional", lambda w: I8Q(w(_h((64,))), 0.5), TypeError, "quantize_int8()")
cpu(f, "scale_and_zero_point_positional", lambda w: I8Q(w(_h((64,))), 0.5, 3), TypeError, "quantize_int8()")
cpu(f, "scale_missing", lambda w: I8Q(w(_h((64,)))), TypeError, "quantize_int8()")
cpu(f, "scale_missing_with_zero_point", lambda w: I8Q(w(_h((64,))), zero_point=3), TypeError, "quantize_int8()")
row(f, "dtype_int32", lambda w: I8Q(w(cupy.arange(64, dtype=np.int32)), scale=0.5), TypeError, "x")
row(f, "noncontig", lambda w: I8Q(w(_x((128,)))[::2], scale=0.5), ValueError, "x")
row(f, "scale_positional", lambda w: I8Q(w(_x((64,))), 0.5), TypeError, "quantize_int8()")
row(f, "scale_missing", lambda w: I8Q(w(_x((64,))), out=w(_P((64,), I8))), TypeError, "quantize_int8()")
row(f, "option_scale_none", lambda w: I8Q(w(_x((64,))), scale=None), TypeError, "scale")
row(f, "option_scale_negative", lambda w: I8Q(w(_x((64,))), scale=-1.0), ValueError, "scale")
row(f, "option_zero_point_float", lambda w: I8Q(w(_x((64,))), scale=0.5, zero_point=1.5), TypeError, "zero_point")
row(f, "option_zero_point_range", lambda w: I8Q(w(_x((64,))), scale=0.5, zero_point=2**31), ValueError, "zero_point")
row(f, "out_dtype", lambda w: I8Q(w(_x((64,))), scale=0.5, out=w(_P((64,), U8))), TypeError, "out")

f = "scaled_mm_azp"
SMA = cq.scaled_mm_azp
_I32 = np.int32
cpu(f, "a_numpy", lambda w: SMA(w(np.zeros((4, 256), I8)), None, None, None, None), TypeError, "a")
row(
    f,
    "a_dtype",
    lambda w: SMA(w(cupy.zeros((4, 256), U8)), w(cupy.zeros((64, 256), I8)), _x((1,)), _x((1,)), cupy.zeros(64, _I32)),
    TypeError,
    "a",
)
row(
    f,
    "azp_adj_dtype",
    lambda w: SMA(w(cupy.zeros((4, 256), I8)), w(cupy.zeros((64, 256), I8)), _x((1,)), _x((1,)), w(_x((64,)))),
    TypeError,
    "azp_adj",
)
row(
    f,
    "azp_adj_shape",
    lambda w: SMA(
        w(cupy.zeros((4, 256), I8)), w(cupy.zeros((64, 256), I8)), _x((1,)), _x((1,)), w(cupy.zeros(63, _I32))
    ),
    ValueError,
    "azp_adj",
)
row(
    f,
    "azp_shape",
    lambda w: SMA(
        w(cupy.zeros((4, 256), I8)), w(cupy.zeros((64, 256), I8)), _x((4,)), _x((1,)), cupy.zeros(64, _I32),
        azp=w(cupy.zeros(3, _I32)),
    ),
    ValueError,
    "azp",
)  # fmt: skip
row(
    f,
    "azp_dtype",
    lambda w: SMA(
        w(cupy.zeros((4, 256), I8)), w(cupy.zeros((64, 256), I8)), _x((4,)), _x((1,)), cupy.zeros(64, _I32),
        azp=w(cupy.zeros(4, np.int64)),
    ),
    TypeError,
    "azp",
)  # fmt: skip
row(
    f,
    "out_shape",
    lambda w: SMA(
        w(cupy.zeros((4, 256), I8)), w(cupy.zeros((64, 256), I8)), _x((4,)), _x((1,)), cupy.zeros(64, _I32),
        out=w(_P((4, 65), BF16)),
    ),
    ValueError,
    "out",
)  # fmt: skip
row(
    f,
    "a_scale_shape",
    lambda w: SMM(w(cupy.zeros((4, 256), U8)), w(cupy.zeros((64, 256), U8)), _x((3,)), _x((1,))),
    ValueError,
    "a_scale",
)
row(
    f,
    "b_scale_shape",
    lambda w: SMM(w(cupy.zeros((4, 256), U8)), w(cupy.zeros((64, 256), U8)), _x((1,)), _x((63,))),
    ValueError,
    "b_scale",
)
row(
    f,
    "shape_k",
    lambda w: SMM(w(cupy.zeros((4, 200), U8)), w(cupy.zeros((64, 200), U8)), _x((1,)), _x((1,))),
    ValueError,
    "a",
)


# matmul(a, w, *, out): a (4, 256) bf16, w (64, 256) int4 g128 -> (4, 64)
f = "matmul"
MM = cq.matmul
row(f, "a_numpy", lambda w: MM(w(_h((4, 256), BF16)), _watch_qw(w, _qw())), TypeError, "a")
row(f, "a_list", lambda w: MM([[1.0] * 256] * 4, _watch_qw(w, _qw())), TypeError, "a")
row(f, "a_dtype_float32", lambda w: MM(w(_x((4, 256), F32)), _watch_qw(w, _qw())), TypeError, "a")
row(f, "a_dtype_int16", lambda w: MM(w(cupy.ones((4, 256), np.int16)), _watch_qw(w, _qw())), TypeError, "a")
row(f, "a_0d", lambda w: MM(w(_x((1,), BF16).reshape(())), _watch_qw(w, _qw())), ValueError, "a")
row(f, "a_shape_k", lambda w: MM(w(_x((4, 128), BF16)), _watch_qw(w, _qw())), ValueError, "a")
row(f, "a_device", lambda w: MM(w(_dev1(lambda: _x((4, 256), BF16))), _watch_qw(w, _qw())), ValueError, "a")
row(f, "w_not_quantized", lambda w: MM(w(_x((4, 256), BF16)), w(_x((64, 256), BF16))), TypeError, "w")
row(f, "w_host_arrays", lambda w: MM(w(_x((4, 128), F16)), _watch_qw(w, _host_qw())), TypeError, "w.data")
row(f, "w_scales_dtype", lambda w: MM(w(_x((4, 256), F16)), _watch_qw(w, _qw())), TypeError, "w")
row(f, "block_size_k", lambda w: MM(w(_x((4, 96), BF16)), _watch_qw(w, _qw((64, 96), group_size=32))), ValueError, "w")
row(
    f,
    "w_data_noncontig",
    lambda w: MM(w(_x((4, 256), BF16)), (lambda q: _with(q, data=q.data[:, ::-1]))(_watch_qw(w, _qw()))),
    ValueError,
    "w.data",
)
row(
    f,
    "out_numpy",
    lambda w: MM(w(_x((4, 256), BF16)), _watch_qw(w, _qw()), out=w(np.zeros((4, 64), BF16))),
    TypeError,
    "out",
)
row(
    f,
    "out_shape",
    lambda w: MM(w(_x((4, 256), BF16)), _watch_qw(w, _qw()), out=w(_P((4, 65), BF16))),
    ValueError,
    "out",
)
row(f, "out_dtype", lambda w: MM(w(_x((4, 256), BF16)), _watch_qw(w, _qw()), out=w(_P((4, 64), F32))), TypeError, "out")
row(
    f,
    "out_noncontig",
    lambda w: MM(w(_x((4, 256), BF16)), _watch_qw(w, _qw()), out=w(_P((4, 128), BF16))[:, ::2]),
    ValueError,
    "out",
)
row(
    f,
    "out_alias_a",
    lambda w: (lambda a: MM(a, _watch_qw(w, _qw()), out=a.reshape(-1)[:256].reshape(4, 64)))(w(_x((4, 256), BF16))),
    ValueError,
    "out",
)
row(
    f,
    "out_alias_w",
    lambda w: (lambda q: MM(w(_x((4, 256), BF16)), q, out=q.data.reshape(-1).view(BF16)[:256].reshape(4, 64)))(
        _watch_qw(w, _qw())
    ),
    ValueError,
    "out",
)
row(
    f,
    "out_device",
    lambda w: MM(w(_x((4, 256), BF16)), _watch_qw(w, _qw()), out=w(_dev1(lambda: _P((4, 64), BF16)))),
    ValueError,
    "out",
)
row(
    f,
    "w_prepared_data_shape",
    lambda w: MM(w(_x((4, 256), BF16)), (lambda q: _with(q, data=q.data[:1]))(_watch_qw(w, _qw().prepare()))),
    ValueError,
    "w.data",
)
row(
    f,
    "w_prepared_scales_shape",
    lambda w: MM(
        w(_x((4, 256), BF16)),
        (lambda q: _with(q, scale=cupy.ascontiguousarray(q.scale[:, :1])))(_watch_qw(w, _qw().prepare())),
    ),
    ValueError,
    "w.scale",
)

# prepare_weight(w): a QuantizedWeight whose K is whole chunks (128 INT4, 64 FP8)
f = "prepare_weight"
PW = cq.prepare_weight
cpu(f, "numpy", lambda w: PW(w(np.zeros((64, 128), U8))), TypeError, "w")
cpu(f, "host_arrays", lambda w: PW(_watch_qw(w, _host_qw())), TypeError, "w.data")
row(f, "k_not_whole_chunks", lambda w: PW(_watch_qw(w, _qw((64, 96), group_size=32))), ValueError, "w")
row(
    f,
    "data_noncontig",
    lambda w: PW((lambda q: _with(q, data=q.data[:, ::-1]))(_watch_qw(w, _qw()))),
    ValueError,
    "w.data",
)
row(
    f,
    "scales_shape",
    lambda w: PW((lambda q: _with(q, scale=cupy.ascontiguousarray(q.scale[:, :1])))(_watch_qw(w, _qw()))),
    ValueError,
    "w.scale",
)
row(
    f,
    "zeros_missing",
    lambda w: PW((lambda q: _with(q, zero_point=None))(_watch_qw(w, _qw(scheme="uint4")))),
    ValueError,
    "w.zero_point",
)


def _watch_q(w, q):
    for a in (q.data, q.scale, q.amax, q.global_scale):
        if a is not None:
            w(a)
    return q


# dequantize(q, out_dtype, *, out), and the methods
f = "dequantize"
D = cq.dequantize
cpu(f, "numpy", lambda w: D(w(np.zeros(8, U8))), TypeError, "q")
cpu(f, "host_arrays", lambda w: D(_watch_q(w, _host_qt())), TypeError, "q.data")
row(f, "option_out_dtype", lambda w: D(_watch_q(w, cq.quantize_fp8(_x((64,)))), "int8"), TypeError, "out_dtype")
row(
    f,
    "option_out_dtype_fp8",
    lambda w: D(_watch_q(w, cq.quantize_fp8(_x((64,)))), "float8_e4m3fn"),
    TypeError,
    "out_dtype",
)
row(f, "option_out_dtype_keyword", lambda w: D(_watch_q(w, G(_x())), out_dtype=np.float64), TypeError, "out_dtype")
row(f, "option_out_dtype_weight", lambda w: D(_watch_qw(w, _qw()), out_dtype="int8"), TypeError, "out_dtype")
row(f, "out_numpy", lambda w: D(_watch_q(w, cq.quantize_fp8(_x((64,)))), out=w(np.zeros(64, F32))), TypeError, "out")
row(f, "out_shape_fp8", lambda w: D(_watch_q(w, cq.quantize_fp8(_x((64,)))), out=w(_P((65,), F32))), ValueError, "out")
row(f, "out_dtype_fp8", lambda w: D(_watch_q(w, cq.quantize_fp8(_x((64,)))), out=w(_P((64,), F16))), TypeError, "out")
row(
    f,
    "out_noncontig_fp8",
    lambda w: D(_watch_q(w, cq.quantize_fp8(_x((64,)))), out=w(_P((128,), F32))[::2]),
    ValueError,
    "out",
)
row(
    f,
    "out_alias_fp8",
    lambda w: (lambda q, base: D(_watch_q(w, q), out=w(base).view(F32)))(*_fp8_in_buffer()),
    ValueError,
    "out",
)
row(
    f,
    "out_device_fp8",
    lambda w: D(_watch_q(w, cq.quantize_fp8(_x((64,)))), out=w(_dev1(lambda: _P((64,), F32)))),
    ValueError,
    "out",
)
row(f, "out_shape_group", lambda w: D(_watch_q(w, G(_x())), out=w(_P((4, 128), F32))), ValueError, "out")
row(f, "out_dtype_group", lambda w: D(_watch_q(w, G(_x())), out=w(_P((4, 256), BF16))), TypeError, "out")
row(
    f,
    "out_alias_group",
    lambda w: (lambda q, base: D(_watch_q(w, q), out=w(base).view(F32).reshape(4, 256)))(*_group_in_buffer()),
    ValueError,
    "out",
)
row(f, "out_shape_mx", lambda w: D(_watch_q(w, M(_x(), FP4)), out=w(_P((4, 128), F32))), ValueError, "out")
row(f, "out_dtype_mx", lambda w: D(_watch_q(w, M(_x(), FP4)), out=w(_P((4, 256), F16))), TypeError, "out")
row(
    f,
    "out_alias_mx",
    lambda w: (lambda q, base: D(_watch_q(w, q), out=w(base).view(F32).reshape(4, 256)))(*_mx_in_buffer()),
    ValueError,
    "out",
)
row(f, "out_shape_nvfp4", lambda w: D(_watch_q(w, N4(_x())), out=w(_P((4, 128), F32))), ValueError, "out")
row(f, "out_dtype_weight", lambda w: D(_watch_qw(w, _qw()), out=w(_P((64, 256), F32))), TypeError, "out")

f = "QuantizedTensor.dequantize"
row(
    f,
    "option_out_dtype",
    lambda w: _watch_q(w, cq.quantize_fp8(_x((64,)))).dequantize(out_dtype="int8"),
    TypeError,
    "out_dtype",
)
row(f, "out_shape", lambda w: _watch_q(w, G(_x())).dequantize(out=w(_P((4, 255), F32))), ValueError, "out")
row(f, "out_dtype", lambda w: _watch_q(w, M(_x())).dequantize(out=w(_P((4, 256), I8))), TypeError, "out")

f = "QuantizedWeight.dequantize"
row(f, "option_out_dtype", lambda w: _watch_qw(w, _qw()).dequantize("float8_e4m3fn"), TypeError, "out_dtype")
row(f, "option_out_dtype_keyword", lambda w: _watch_qw(w, _qw()).dequantize(out_dtype="int8"), TypeError, "out_dtype")
row(f, "out_shape", lambda w: _watch_qw(w, _qw()).dequantize(out=w(_P((64, 255), BF16))), ValueError, "out")


# rms_norm_quantize(x, weight, *, eps, residual, scheme, dtype, group_size, ...): x (4, 256) bf16
f = "rms_norm_quantize"
R = cq.rms_norm_quantize


def _wn(H=256):
    return cupy.ones((H,), BF16)


cpu(f, "numpy", lambda w: R(w(_h((4, 256), BF16)), np.ones(256, BF16)), TypeError, "x")
cpu(f, "option_scheme", lambda w: R(w(_h((4, 256), BF16)), None, scheme="block"), ValueError, "scheme")
cpu(
    f, "option_group_size_for_token", lambda w: R(w(_h((4, 256), BF16)), None, group_size=128), ValueError, "group_size"
)
cpu(
    f,
    "option_scale_for_group",
    lambda w: R(w(_h((4, 256), BF16)), None, scheme="group", scale=1.0),
    ValueError,
    "scale",
)
row(f, "dtype_float64", lambda w: R(w(cupy.ones((4, 256), F64)), _wn()), TypeError, "x")
row(f, "0d", lambda w: R(w(cupy.ones((), BF16)), _wn()), ValueError, "x")
row(f, "noncontig", lambda w: R(w(_x((4, 512), BF16))[:, ::2], _wn()), ValueError, "x")
row(f, "shape_mx_not_whole_blocks", lambda w: R(w(_x((4, 48), BF16)), _wn(48), scheme="mx"), ValueError, "x")
row(f, "shape_too_long", lambda w: R(w(_x((1, 16392), BF16)), _wn(16392)), ValueError, "x")
row(f, "weight_numpy", lambda w: R(w(_x((4, 256), BF16)), np.ones(256, BF16)), TypeError, "weight")
row(f, "weight_shape", lambda w: R(w(_x((4, 256), BF16)), _wn(128)), ValueError, "weight")
row(f, "weight_dtype", lambda w: R(w(_x((4, 256), BF16)), cupy.ones(256, F32)), TypeError, "weight")
row(
    f,
    "residual_shape",
    lambda w: R(w(_x((4, 256), BF16)), _wn(), residual=w(_x((2, 256), BF16))),
    ValueError,
    "residual",
)
row(
    f, "residual_dtype", lambda w: R(w(_x((4, 256), BF16)), _wn(), residual=w(_x((4, 256), F32))), TypeError, "residual"
)
row(f, "residual_alias", lambda w: (lambda x: R(x, _wn(), residual=x))(w(_x((4, 256), BF16))), ValueError, "residual")
row(f, "group_size", lambda w: R(w(_x((4, 256), BF16)), _wn(), scheme="group", group_size=96), ValueError, "group_size")
row(f, "option_scale_missing", lambda w: R(w(_x((4, 256), BF16)), _wn(), scheme="tensor"), ValueError, "scale")
row(
    f,
    "option_global_scale_missing",
    lambda w: R(w(_x((4, 256), BF16)), _wn(), scheme="nvfp4"),
    ValueError,
    "global_scale",
)
row(
    f,
    "option_dtype",
    lambda w: R(w(_x((4, 256), BF16)), _wn(), scheme="tensor", dtype="int8", scale=1.0),
    ValueError,
    "dtype",
)
row(
    f,
    "option_layout",
    lambda w: R(w(_x((4, 256), BF16)), _wn(), scheme="mx", scale_layout="row"),
    ValueError,
    "scale_layout",
)
row(
    f,
    "option_layout_tensor",
    lambda w: R(w(_x((4, 256), BF16)), _wn(), scheme="tensor", scale=1.0, scale_layout="row"),
    ValueError,
    "scale_layout",
)
row(
    f,
    "option_layout_scalar",
    lambda w: R(w(_x((4, 256), BF16)), _wn(), scale_layout="scalar"),
    ValueError,
    "scale_layout",
)
row(f, "option_eps", lambda w: R(w(_x((4, 256), BF16)), _wn(), eps=-1.0), ValueError, "eps")
row(f, "out_shape", lambda w: R(w(_x((4, 256), BF16)), _wn(), out=w(_P((4, 255), U8))), ValueError, "out")
row(
    f,
    "out_alias",
    lambda w: (
        lambda r: R(w(_x((4, 256), BF16)), _wn(), residual=r, out=r.view(U8).reshape(-1)[:1024].reshape(4, 256))
    )(w(_x((4, 256), BF16))),
    ValueError,
    "out",
)
row(
    f,
    "scale_out_shape",
    lambda w: R(w(_x((4, 256), BF16)), _wn(), scheme="mx", scale_out=w(_P((4, 4), U8))),
    ValueError,
    "scale_out",
)

# quantize_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, scale_k, scale_v, ...):
# key/value (4, 2, 64) bf16 into caches (3, 4, 2, 64) "NHD"
f = "quantize_kv_cache"
K = cq.quantize_kv_cache


def _kv(w, **kw):
    args = dict(
        key=w(_x((4, 2, 64), BF16)),
        value=w(_x((4, 2, 64), BF16)),
        key_cache=w(_P((3, 4, 2, 64), U8)),
        value_cache=w(_P((3, 4, 2, 64), U8)),
        slot_mapping=cupy.asarray([0, 5, -1, 9], np.int64),
        scale_k=0.1,
        scale_v=0.1,
    )
    args.update(kw)
    return K(
        args.pop("key"), args.pop("value"), args.pop("key_cache"), args.pop("value_cache"), args.pop("slot_mapping"),
        **args,
    )  # fmt: skip


cpu(
    f,
    "numpy",
    lambda w: K(np.ones((4, 2, 64), F32), None, None, None, None, scale_k=0.1, scale_v=0.1),
    TypeError,
    "key",
)
row(f, "dtype_float64", lambda w: _kv(w, key=cupy.ones((4, 2, 64), F64)), TypeError, "key")
row(f, "shape_2d", lambda w: _kv(w, key=cupy.ones((4, 128), BF16)), ValueError, "key")
row(f, "value_shape", lambda w: _kv(w, value=w(_x((4, 2, 32), BF16))), ValueError, "value")
row(f, "cache_dtype", lambda w: _kv(w, key_cache=w(_P((3, 4, 2, 64), F32))), TypeError, "key_cache")
row(f, "slot_mapping_dtype", lambda w: _kv(w, slot_mapping=cupy.zeros(4, F32)), TypeError, "slot_mapping")
row(
    f,
    "slot_mapping_repeat",
    lambda w: _kv(w, slot_mapping=cupy.asarray([1, 1, 2, 3]), check_slots=True),
    ValueError,
    "slot_mapping",
)
cpu(
    f,
    "option_kv_layout",
    lambda w: K(w(np.ones((4, 2, 64), F32)), None, None, None, None, scale_k=0.1, scale_v=0.1, kv_layout="HDN"),
    ValueError,
    "kv_layout",
)
row(f, "option_kv_layout", lambda w: _kv(w, kv_layout="HDN"), ValueError, "kv_layout")
row(f, "option_kv_layout_lowercase", lambda w: _kv(w, kv_layout="nhd"), ValueError, "kv_layout")
row(f, "option_scale_k", lambda w: _kv(w, scale_k=-1.0), ValueError, "scale_k")
row(f, "option_scale_mixed", lambda w: _kv(w, scale_k="dynamic"), ValueError, "scale_k")
row(f, "option_dtype", lambda w: _kv(w, dtype="int8"), ValueError, "dtype")
row(
    f,
    "out_alias",
    lambda w: (lambda c: _kv(w, key_cache=c, value_cache=c))(w(_P((3, 4, 2, 64), U8))),
    ValueError,
    "value_cache",
)

# dequantize_kv_cache(cache, block_ids, *, scale, kv_layout, out_dtype, cache_dtype, scale_cache, out)
f = "dequantize_kv_cache"
DK = cq.dequantize_kv_cache
cpu(f, "numpy", lambda w: DK(np.zeros((3, 4, 2, 64), U8), np.zeros(1, np.int64), scale=0.1), TypeError, "cache")
row(f, "cache_dtype", lambda w: DK(w(_P((3, 4, 2, 64), F32)), cupy.zeros(1, np.int64), scale=0.1), TypeError, "cache")
row(f, "block_ids_dtype", lambda w: DK(w(_P((3, 4, 2, 64), U8)), cupy.zeros(1, F32), scale=0.1), TypeError, "block_ids")
cpu(
    f,
    "option_out_dtype",
    lambda w: DK(w(np.zeros((3, 4, 2, 64), U8)), np.zeros(1, np.int64), scale=0.1, out_dtype="int8"),
    TypeError,
    "out_dtype",
)
row(
    f,
    "option_out_dtype",
    lambda w: DK(w(_P((3, 4, 2, 64), U8)), cupy.zeros(1, np.int64), scale=0.1, out_dtype="int8"),
    TypeError,
    "out_dtype",
)
cpu(
    f,
    "option_kv_layout",
    lambda w: DK(w(np.zeros((3, 4, 2, 64), U8)), np.zeros(1, np.int64), scale=0.1, kv_layout="HDN"),
    ValueError,
    "kv_layout",
)
row(
    f,
    "option_kv_layout",
    lambda w: DK(w(_P((3, 4, 2, 64), U8)), cupy.zeros(1, np.int64), scale=0.1, kv_layout=None),
    ValueError,
    "kv_layout",
)
row(
    f,
    "option_scale_cache_missing",
    lambda w: DK(w(_P((3, 4, 2, 64), U8)), cupy.zeros(1, np.int64), scale="dynamic"),
    ValueError,
    "scale_cache",
)
row(
    f,
    "out_shape",
    lambda w: DK(w(_P((3, 4, 2, 64), U8)), cupy.zeros(1, np.int64), scale=0.1, out=w(_P((1, 4, 2, 32), BF16))),
    ValueError,
    "out",
)

# empty_kv_scale_cache(cache, kv_layout)
f = "empty_kv_scale_cache"
EK = cq.empty_kv_scale_cache
cpu(f, "numpy", lambda w: EK(np.zeros((3, 4, 2, 64), U8)), TypeError, "cache")
row(f, "option_kv_layout", lambda w: EK(cupy.zeros((3, 4, 2, 64), U8), "XYZ"), ValueError, "kv_layout")
row(
    f,
    "option_kv_layout_keyword",
    lambda w: EK(cupy.zeros((3, 4, 2, 64), U8), kv_layout="hnd"),
    ValueError,
    "kv_layout",
)

# kv_scale_cache_shape(cache_shape, kv_layout): pure Python
f = "kv_scale_cache_shape"
cpu(f, "option_kv_layout", lambda w: kv_scale_cache_shape((3, 4, 2, 64), kv_layout="XYZ"), ValueError, "kv_layout")
cpu(f, "shape", lambda w: kv_scale_cache_shape((3, 4, 2)), ValueError, "cache_shape")


# ------------------------------------------------------------------ the test
def _snapshot(a):
    return np.array(a, copy=True) if isinstance(a, np.ndarray) else a.get()


def _bytes(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def _names(msg: str, arg: str) -> bool:
    """The message begins with the argument's name as a whole word (``x``, ``x's``, ``w.data``,
    ``group_size=100``; not ``x_scale`` or ``xs``)."""
    return re.match(re.escape(arg) + r"(?![\w])", msg) is not None


@pytest.mark.parametrize("fn, bad, call, exc, arg", TABLE)
def test_bad_input(fn, bad, call, exc, arg):
    watched = []

    def watch(a):
        watched.append((a, _snapshot(a)))
        return a

    try:
        call(watch)
    except Exception as e:  # noqa: BLE001 - a wrong exception type is what this test reports
        err = e
    else:
        err = None
    problems = []
    if err is None:
        problems.append(f"no exception (expected {exc.__name__} naming {arg!r})")
    elif not isinstance(err, exc):
        problems.append(f"expected {exc.__name__} naming {arg!r}, got {type(err).__name__}: {err}")
    elif not _names(str(err), arg):
        problems.append(f"{type(err).__name__} message does not begin with {arg!r}: {err}")
    for i, (a, before) in enumerate(watched):
        if _bytes(_snapshot(a)) != _bytes(before):
            problems.append(f"watched buffer {i} ({type(a).__module__}.{type(a).__name__} {a.dtype} {a.shape}) changed")
    assert not problems, f"{fn} with bad {bad}: " + "; ".join(problems)


def test_table_covers_every_public_function():
    public = {name for name in cq.__all__ if name[0].islower() and not name.startswith("__")}
    covered = {p.values[0] for p in TABLE}
    assert public <= covered, f"no bad-input rows for {sorted(public - covered)}"
    ids = [p.id for p in TABLE]
    assert len(ids) == len(set(ids)), "duplicate row ids"


def test_message_check_is_a_whole_word():
    assert _names("x must be a cupy.ndarray", "x")
    assert _names("x's last axis must be even", "x")
    assert _names("group_size=100 is not supported", "group_size")
    assert _names("w.data must be C-contiguous", "w.data")
    assert not _names("x_scale must be", "x")
    assert not _names("w must be a QuantizedWeight", "a")
    assert not _names("scale_out must be float32", "scale")
