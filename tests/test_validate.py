"""Argument validation that needs no GPU: every error names the argument it is about."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupyquant as cq
from cupyquant import _dtypes, _validate


def test_numpy_array_is_a_type_error_naming_x():
    with pytest.raises(TypeError, match=r"x must be a cupy\.ndarray.*numpy\.ndarray.*cupy\.asarray"):
        cq.quantize_fp8(np.ones(4, np.float32))


def test_numpy_array_for_amax():
    with pytest.raises(TypeError, match=r"x must be a cupy\.ndarray"):
        cq.amax(np.ones(4, np.float32))


@pytest.mark.parametrize("bad", ["float8_e4m3", "int8", "float4_e2m1fn", "bfloat16"])
def test_unsupported_format_is_a_value_error_naming_dtype(bad):
    with pytest.raises(ValueError, match=r"dtype='.*' is not supported"):
        cq.quantize_fp8(np.ones(4, np.float32), bad)


def test_format_accepts_ml_dtypes_types_and_names():
    assert _dtypes.element_format(ml_dtypes.float8_e4m3fn).name == "float8_e4m3fn"
    assert _dtypes.element_format(np.dtype(ml_dtypes.float8_e5m2)).name == "float8_e5m2"
    assert _dtypes.element_format("float8_e5m2").max == 57344.0


def test_format_that_names_no_dtype_is_a_type_error():
    with pytest.raises(TypeError, match="dtype must be a format name"):
        _dtypes.element_format(object())


@pytest.mark.parametrize("dt", [np.int32, np.int8, np.float64, np.uint8, np.complex64])
def test_integer_or_other_input_dtype_is_a_type_error(dt):
    with pytest.raises(TypeError, match=r"x must be float32, float16 or bfloat16; got"):
        _dtypes.input_type(dt, "x")


@pytest.mark.parametrize("dt", [np.float32, np.float16, ml_dtypes.bfloat16, "bfloat16", "float16"])
def test_supported_input_dtypes(dt):
    assert _dtypes.input_type(dt).dtype == np.dtype(dt)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), 1e39, 1e-46])  # 1e-46 is 0 in float32
def test_static_scale_must_be_positive_finite(bad):
    with pytest.raises(ValueError, match="scale must be a positive finite"):
        _validate.positive_finite_scalar(bad, "scale")


@pytest.mark.parametrize("bad", ["1.0", True, None, [1.0]])
def test_static_scale_type(bad):
    with pytest.raises(TypeError, match="scale must be a real number"):
        _validate.positive_finite_scalar(bad, "scale")


def test_dequantize_needs_a_quantized_tensor():
    with pytest.raises(TypeError, match="q must be a cupyquant.QuantizedTensor"):
        cq.dequantize(np.zeros(4, np.uint8))


def test_public_api_and_unknown_attribute():
    for name in cq.__all__:
        assert getattr(cq, name) is not None
    with pytest.raises(AttributeError):
        cq.not_a_function  # noqa: B018


def test_magic_division_for_col_scale_rows():
    from cupyquant._scales import magic

    rng = np.random.default_rng(3)
    divisors = (
        list(range(1, 70))
        + [127, 128, 129, 4095, 4096, 4097, 65537, (1 << 31) - 1]
        + list(rng.integers(1, 1 << 31, 40))
    )
    n = np.concatenate([np.arange(0, 5000), rng.integers(0, 1 << 31, 20000), [(1 << 31) - 1, (1 << 31) - 2]]).astype(
        object
    )
    for d in divisors:
        m, sh = magic(int(d))
        assert m < (1 << 33)  # row * m fits in 64 bits for rows below 2^31
        got = [(int(v) * m) >> sh for v in n]
        assert got == [int(v) // int(d) for v in n], d


def test_plan_memo_keeps_hashable_signatures_only():
    """cupyquant._plans.Plans: a None or unhashable signature is never stored or found; a full memo
    starts over rather than growing."""
    from cupyquant import _plans

    memo = _plans.Plans()
    assert memo.keep(None, "p") == "p" and memo.lookup(None) is None and not memo
    assert memo.keep(("x", [1]), "p") == "p" and memo.lookup(("x", [1])) is None and not memo
    assert memo.keep(("x", 1), "p") == "p" and memo.lookup(("x", 1)) == "p"
    for i in range(_plans.MAX_PLANS + 1):
        memo.keep(i, i)
    assert len(memo) <= _plans.MAX_PLANS and memo.lookup(_plans.MAX_PLANS) == _plans.MAX_PLANS
