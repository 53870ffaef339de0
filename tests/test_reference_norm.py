"""The RMSNorm reference without a GPU: the fixed order of the sum of squares, hand-worked norms,
the rounding points of the residual and the weight product, and the quantizer composition."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cupyquant import reference as ref

BF16 = ml_dtypes.bfloat16
F32 = np.float32


def test_sum_of_squares_units_then_pairwise_tree():
    # unit 0 holds 1 and two squares of 2^-24, each lost when added left to right to 1; units 1, 2
    # and 3 hold one 2^-24 each. The tree adds unit 0 to unit 1 (1 + 2^-24 rounds to 1) and unit 2
    # to unit 3 (2^-23, exact), then the two: 1 + 2^-23. Left to right over all 32 elements would
    # give 1, and a tree inside the units 1 + 2^-22.
    h = 2.0**-12
    z = np.zeros(32, F32)
    z[[0, 1, 2]] = [1.0, h, h]
    z[[8, 16, 24]] = h
    assert ref.sum_of_squares(z) == F32(1 + 2.0**-23)
    assert F32(np.sum(z.astype(np.float64) ** 2)) != ref.sum_of_squares(z)


def test_sum_of_squares_pads_units_with_zeros():
    z = np.arange(1, 20, dtype=F32)  # 19 elements: units of 8, 8 and 3 (zero-padded), then a 4th zero unit
    p = [sum((F32(v) * F32(v) for v in z[i : i + 8]), F32(0)) for i in (0, 8, 16)]
    assert ref.sum_of_squares(z) == F32(F32(p[0] + p[1]) + F32(p[2] + F32(0)))
    assert ref.sum_of_squares(np.zeros((2, 0), F32)).tolist() == [0.0, 0.0]


def test_rms_norm_hand_worked():
    # x = (3, 4): ss = 25, mean 12.5, inv = 1 / sqrt(12.5) rounded step by step in float32
    y, z = ref.rms_norm(np.array([3, 4], F32), np.array([1, 2], F32), eps=0.0)
    inv = F32(1) / np.sqrt(F32(12.5))
    assert z is None
    assert y.tolist() == [F32(F32(3) * inv), F32(F32(F32(4) * inv) * F32(2))]


def test_residual_and_normalized_value_round_to_the_input_dtype():
    # bf16 keeps 8 significant bits: 1 + 2^-9 rounds to 1 before the norm and in the residual
    x = np.full(8, 1.0, BF16)
    r = np.full(8, 2.0**-9, BF16)
    w = np.full(8, 1.5, BF16)
    y, z = ref.rms_norm(x, w, residual=r, eps=0.0)
    assert z.dtype == BF16 and (z.astype(F32) == 1.0).all()
    assert y.dtype == BF16 and (y.astype(F32) == 1.5).all()
    # z * inv is rounded to bf16 before the weight product: eps 2^-7 makes inv = 1 / sqrt(1 + 2^-7),
    # 0.99611652 in float32, 0.99609375 in bf16; times 3, 2.98828125, rounds to 2.984375 in bf16
    y, _ = ref.rms_norm(x, np.full(8, 3.0, BF16), eps=2.0**-7)
    assert (y.astype(F32) == F32(2.984375)).all()


def test_nan_and_overflow():
    x = np.array([[3e38, 3e38, 0, 0], [np.nan, 1, 1, 1], [0, 0, 0, 0]], F32)
    y, _ = ref.rms_norm(x, np.ones(4, F32), eps=0.0)
    assert (y[0] == 0).all()  # the sum of squares overflows: inv = 1 / inf = 0
    assert np.isnan(y[1]).all()  # a NaN in the row makes the whole row NaN
    assert np.isnan(y[2]).all()  # eps 0 and a zero row: 0 * inf
    assert (y.view(np.uint32)[1] == 0x7FFFFFFF).all()  # CUDA's canonical NaN


@pytest.mark.parametrize(
    "scheme,kw",
    [
        ("token", {"dtype": "int8"}),
        ("group", {"group_size": 64, "scale_dtype": "float8_e8m0fnu"}),
        ("tensor", {"scale": 0.02}),
        ("mx", {"dtype": "float4_e2m1fn"}),
        ("nvfp4", {"global_scale": 300.0}),
    ],
)
def test_rms_norm_quantize_is_the_quantizer_of_y(scheme, kw):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 128)).astype(BF16)
    w = rng.standard_normal(128).astype(BF16)
    r = rng.standard_normal((3, 128)).astype(BF16)
    quantized, y, z = ref.rms_norm_quantize(x, w, residual=r, scheme=scheme, **kw)
    y2, z2 = ref.rms_norm(x, w, residual=r)
    assert y.view(np.uint16).tolist() == y2.view(np.uint16).tolist()
    assert z.view(np.uint16).tolist() == z2.view(np.uint16).tolist()
    direct = {
        "token": lambda: ref.quantize_groupwise(y, "int8", group_size=None),
        "group": lambda: ref.quantize_groupwise(y, group_size=64, scale_dtype="float8_e8m0fnu"),
        "tensor": lambda: ref.quantize_fp8(y, scale=0.02),
        "mx": lambda: ref.quantize_mx(y, "float4_e2m1fn"),
        "nvfp4": lambda: ref.quantize_nvfp4(y, global_scale=300.0),
    }[scheme]()
    for a, b in zip(quantized, direct):
        assert np.array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))


@pytest.mark.parametrize(
    "eps, exc",
    [
        (-1.0, ValueError),
        (-1e-30, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (np.float32("-inf"), ValueError),
        ("1e-6", TypeError),
        (True, TypeError),
        (None, TypeError),
    ],
)
def test_eps_is_checked_as_the_op_checks_it(eps, exc):
    """A negative or NaN eps gives NaN rows, an infinite one zeros: refused with rms_norm_quantize's
    own error, before any work."""
    x, w = np.ones((2, 16), F32), np.ones(16, F32)
    match = "^eps must be finite and >= 0" if exc is ValueError else "^eps must be a real number"
    with pytest.raises(exc, match=match):
        ref.rms_norm(x, w, eps=eps)
    with pytest.raises(exc, match=match):
        ref.rms_norm_quantize(x, w, eps=eps)
    with pytest.raises(exc, match=match):
        ref.rms_norm(np.ones((2, 16), np.float64), w, eps=eps)  # eps first: the x check comes after


@pytest.mark.parametrize("eps", [0, 0.0, 1e-6, np.float16(1e-3), np.int64(2)])
def test_eps_takes_every_real_number_at_or_above_zero(eps):
    y, _ = ref.rms_norm(np.array([3, 4], F32), np.array([1, 2], F32), eps=eps)
    ms = (9 + 16) / 2
    assert np.allclose(y, np.array([3, 8]) / np.sqrt(ms + float(np.float32(eps))), rtol=1e-6)


def test_reference_refuses_bad_arguments():
    x = np.ones((2, 16), F32)
    with pytest.raises(ValueError, match="scheme"):
        ref.rms_norm_quantize(x, np.ones(16, F32), scheme="block")
    with pytest.raises(ValueError, match="weight"):
        ref.rms_norm(x, np.ones(8, F32))
    with pytest.raises(ValueError, match="residual"):
        ref.rms_norm(x, np.ones(16, F32), residual=np.ones((2, 16), np.float16))
