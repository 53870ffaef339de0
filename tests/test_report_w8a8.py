"""The CPU parts of the report's W8A8 section (cupyquant/_report_w8a8.py): scale expansion, float64
dequantization, the bf16 half-ulp, the error-bound ratio, the SNR, and the one line printed on a GPU
without FP8 tensor cores. The matmul itself runs on the lead's GPU."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupyquant
from cupyquant import _report_w8a8 as rw


def test_expand_scale_every_granularity():
    rows, cols = 130, 300  # neither a multiple of 128
    t = rw.expand_scale(np.array([0.5], np.float32), rows, cols)
    assert t.shape == (rows, cols) and (t == 0.5).all()
    ch = np.arange(rows, dtype=np.float32).reshape(rows, 1)
    c = rw.expand_scale(ch, rows, cols)
    assert (c == np.arange(rows)[:, None]).all()
    g = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    e = rw.expand_scale(g, rows, cols)
    assert e[5, 127] == g[5, 0] and e[5, 128] == g[5, 1] and e[5, 299] == g[5, 2]
    b = np.arange(2 * 3, dtype=np.float32).reshape(2, 3)
    e = rw.expand_scale(b, rows, cols)
    assert e[127, 127] == b[0, 0] and e[128, 127] == b[1, 0] and e[129, 299] == b[1, 2]
    # a column-major (strided) scale array gives the same values
    e2 = rw.expand_scale(np.asfortranarray(g), rows, cols)
    assert np.array_equal(e2, rw.expand_scale(g, rows, cols))
    # bf16 scales widen exactly
    s = np.array([[1 / 3]], np.float32).astype(ml_dtypes.bfloat16)
    assert rw.expand_scale(s, 2, 2)[1, 1] == float(s[0, 0])
    with pytest.raises(ValueError, match="scales along an axis"):
        rw.expand_scale(np.ones((rows, 5), np.float32), rows, cols)


def test_dequantize64_is_code_times_scale():
    codes = np.array([[0x38, 0xB8, 0x00, 0x7E]], np.uint8)  # 1.0, -1.0, 0, 448
    out = rw.dequantize64(codes, np.array([[0.25]], np.float32))
    assert out.dtype == np.float64 and out.tolist() == [[0.25, -0.25, 0.0, 112.0]]


def test_dequantize64_int8_with_zero_points():
    codes = np.array([[-128, 0, 127], [5, -5, 1]], np.int8)
    v = rw.dequantize64(codes, np.float32([[0.5], [2.0]]), zero_point=np.int32([[-128], [1]]))
    np.testing.assert_array_equal(v, [[0.0, 64.0, 127.5], [8.0, -12.0, 0.0]])
    np.testing.assert_array_equal(rw.dequantize64(codes, np.float32([0.25])), codes * 0.25)


def test_bf16_half_ulp_matches_ml_dtypes_spacing():
    bf16 = ml_dtypes.bfloat16
    for v in (1.0, 1.5, 3.0, 1000.0, 2.0**-126, 2.0**-130, 7e30):
        nxt = np.nextafter(np.array(v, bf16), np.array(np.inf, bf16))
        spacing = float(nxt) - float(np.array(v, bf16))
        assert rw.bf16_half_ulp(np.array([v]))[0] == spacing / 2, v
    assert rw.bf16_half_ulp(np.array([0.0]))[0] == 2.0**-134


def test_bound_ratio_and_snr():
    ref = np.array([[1.0, -2.0], [100.0, 0.0]])
    S = np.array([[512.0, 512.0], [512.0, 0.0]])  # 2^-9 S = 1 where S = 512
    y = ref.astype(ml_dtypes.bfloat16)  # exact values: ratio 0
    assert rw.bound_ratio(y, ref, S) == 0.0
    y2 = (ref + np.array([[0.5, 0.0], [0.0, 0.0]])).astype(ml_dtypes.bfloat16)
    assert rw.bound_ratio(y2, ref, S) == pytest.approx(0.5 / (1 + 2.0**-8))
    y3 = (ref + np.array([[0.0, 0.0], [4.0, 0.0]])).astype(ml_dtypes.bfloat16)
    assert rw.bound_ratio(y3, ref, S) > 1.0  # 4 away where the bound allows 1 + 0.25
    t = np.array([3.0, 4.0])
    assert rw.snr_db(t * 1.01, t) == pytest.approx(40.0)


def test_section_skips_without_int8_tensor_cores(monkeypatch, capsys):
    pytest.importorskip("cupy")
    import cupy

    from cupyquant.w8a8 import dispatch

    class _Dev:
        id = 0

    def old_gpu(device, int8=False):
        raise cupyquant.UnsupportedGPUError(
            "scaled_matmul of INT8 operands needs compute capability 8.0; device 0 has 7.5"
        )

    monkeypatch.setattr(cupy.cuda, "Device", lambda *a: _Dev())
    monkeypatch.setattr(dispatch, "check_arch", old_gpu)
    assert rw.w8a8_report(None, None) is True
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [
        "W8A8 matmul: skipped (scaled_matmul of INT8 operands needs compute capability 8.0; device 0 has 7.5)"
    ]
