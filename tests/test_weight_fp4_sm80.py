"""FP4 weights (NVFP4, MXFP4) in the mma.sync gemm (weight_sm80_gemm.cu), forced on any GPU.

Every tile (M = 9, 17, 64, 65, 256, 1000: tiles of 16, 32, 64 and 128 rows, the last one partial),
a partial last weight tile (N = 200), K of one to 32 stages and the K splits that small N and long
K bring, against a float64 product of the weight decoded here from its plain bytes (E2M1 codes
times the E4M3 scale and scale_2, or 2^(b - 127)): each output is within (K 2^-23 + 2^-22)
sum_k |a w| of the exact product, plus half an ulp of the output's dtype. Where every product and
sum is exact in float32 (small integer activations, scales 1/2 to 2), the output is the exact
product rounded once, with K whole or split 1 to 3 ways."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_bits_equal

import cupyquant as cq
from cupyquant import weight as cqw
from cupyquant.weight import configs as C
from cupyquant.weight import plan
from cupyquant.weight.container import weight_scheme

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")

HALF = [np.float16, ml_dtypes.bfloat16]
FORMATS = ["nvfp4", "mxfp4"]
MS = [9, 17, 64, 65, 256, 1000]
NS = [128, 200, 4096]
KS = [128, 384, 4096]
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _id(v):
    return np.dtype(v).name if isinstance(v, type) else str(v)


def _decode(w) -> np.ndarray:
    """The float64 (N, K) values of a plain FP4 weight, from its bytes."""
    N, K = w.shape
    data = cupy.asnumpy(w.data)
    codes = np.empty((N, K), np.uint8)
    codes[:, 0::2], codes[:, 1::2] = data & 15, data >> 4
    vals = np.where(codes & 8, -1.0, 1.0) * E2M1[codes & 7]
    sb = cupy.asnumpy(w.scale)
    if w.scheme.format == "nvfp4":
        s = sb.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * float(cupy.asnumpy(w.scale_2)[0])
    else:
        s = np.ldexp(1.0, sb.astype(np.int64) - 127)
    return vals * np.repeat(s, C.FP4_BLOCK[w.scheme.format], axis=1)


def _half_ulp(y, dtype):
    """Half an ulp of each value of y (float64 values of ``dtype``) in ``dtype``."""
    emin, mant = (-14, 10) if np.dtype(dtype) == np.float16 else (-126, 7)
    _, e = cupy.frexp(cupy.abs(y))
    e = cupy.where(y == 0, emin, cupy.maximum(e - 1, emin))
    return cupy.ldexp(cupy.ones_like(y), e - mant - 1)


class _Splits:
    """Records the K splits of each sm80 gemm launch (plan.sm80_splits), or forces them."""

    def __init__(self, monkeypatch, forced=None):
        self.seen = []
        real = plan.sm80_splits

        def split(tiles, iters, blocks):
            r = real(tiles, iters, blocks) if forced is None else (forced, -(-iters // forced))
            r = (-(-iters // r[1]), r[1])
            self.seen.append(r[0])
            return r

        monkeypatch.setattr(plan, "sm80_splits", split)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", HALF, ids=_id)
def test_fp4_sm80_gemm_error_bound(monkeypatch, dtype, fmt):
    splits = _Splits(monkeypatch)
    rng = np.random.default_rng(7 + FORMATS.index(fmt))
    worst, cases = 0.0, 0
    for N in NS:
        for K in KS:
            wf = cupy.asarray(rng.standard_normal((N, K)).astype(np.float32).astype(dtype))
            w = cq.quantize_weight(wf, fmt)
            wd = cupy.asarray(_decode(w))
            wp = w.prepare()
            for i, M in enumerate(MS):
                a = cupy.asarray(rng.standard_normal((M, K)).astype(np.float32).astype(dtype))
                with cqw._forced_path("sm80_gemm"):
                    y = cq.matmul(a, wp)
                    if i == 0:
                        assert_bits_equal(cq.matmul(a, w), cupy.asnumpy(y), f"{fmt} M={M}: plain vs prepared weight")
                a64 = a.astype(cupy.float64)
                want = a64 @ wd.T
                mag = cupy.abs(a64) @ cupy.abs(wd).T
                y64 = y.astype(cupy.float64)
                bound = (K * 2.0**-23 + 2.0**-22) * mag + _half_ulp(y64, dtype)
                err = cupy.abs(y64 - want)
                ratio = float(cupy.max(err / bound))
                assert bool(cupy.all(err <= bound)), f"{fmt} M={M} N={N} K={K}: error {ratio:.3g} x the bound"
                worst, cases = max(worst, ratio), cases + 1
    assert max(splits.seen) > 1, "some shapes split K"
    print(
        f"\n{fmt} {np.dtype(dtype).name}: {cases} cases, splits {sorted(set(splits.seen))}, max error/bound {worst:.3g}"
    )


def _exact_weight(rng, fmt, N, K, dtype):
    """A plain FP4 weight of random codes whose scales are 1/2, 1 or 2 (NVFP4: scale_2 1/8), so that
    each product with small integer activations, and every sum of them, is exact in float32."""
    block = C.FP4_BLOCK[fmt]
    data = cupy.asarray(rng.integers(0, 256, (N, K // 2), dtype=np.uint8))
    if fmt == "nvfp4":
        choices = np.array([0.5, 1.0, 2.0], np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        scale_2 = cupy.asarray(np.array([0.125], np.float32))
    else:
        choices, scale_2 = np.array([126, 127, 128], np.uint8), None
    sb = cupy.asarray(rng.choice(choices, (N, K // block)))
    return cqw.QuantizedWeight(data, sb, None, weight_scheme(fmt, block, K, dtype), (N, K), dtype, scale_2=scale_2)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", HALF, ids=_id)
def test_fp4_sm80_gemm_exact(monkeypatch, dtype, fmt):
    rng = np.random.default_rng(11 + FORMATS.index(fmt))
    for N, K in ((200, 384), (4096, 640), (128, 4096)):
        w = _exact_weight(rng, fmt, N, K, dtype)
        wd = cupy.asarray(_decode(w))
        wp = w.prepare()
        for M in MS:
            a = cupy.asarray(rng.integers(-3, 4, (M, K)).astype(np.float32).astype(dtype))
            # the exact product, exact in float32, rounded once to dtype
            want = cupy.asnumpy((a.astype(cupy.float64) @ wd.T).astype(cupy.float32)).astype(dtype)
            for forced in (None, 1, 2, 3):
                with pytest.MonkeyPatch.context() as mp:
                    splits = _Splits(mp, forced)
                    with cqw._forced_path("sm80_gemm"):
                        y = cq.matmul(a, wp)
                assert_bits_equal(y, want, f"{fmt} M={M} N={N} K={K} splits {splits.seen}")
