"""``python -m cupyquant``: a round-trip quality and bandwidth report on built-in data.

Quantizes a deterministic heavy-tailed bf16 tensor (2048 x 2048, generated here: Student-t values
times per-column magnitudes that span e^+-2, with a few outlier columns 30x larger, as LLM
activations have) with every scheme the library has, dequantizes it, and prints per scheme: bits
per element (scales included), SNR in dB, the largest relative error over elements that land on a
value in the format's normal range (scaled |x| between the smallest normal and the max), whether
the bytes and scales equal ``cupyquant.reference`` exactly, and the quantizer's bandwidth (input read
once + output written once, on the tensor tiled to 256M elements so that the L2 cache and launch
overhead do not flatter it) with its percentage of the device's copy bandwidth measured in the same
run. Exit status: 0 when every scheme matches the reference, 2 when one does not, 1 with no GPU.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np

SHAPE = (2048, 2048)


def builtin_tensor() -> np.ndarray:
    """The built-in data: float32 on the host (the report quantizes its bf16 rounding)."""
    rng = np.random.default_rng(20261121)
    x = rng.standard_t(4, size=SHAPE)
    col = np.exp(rng.uniform(-2.0, 2.0, SHAPE[1]))
    col[rng.choice(SHAPE[1], 8, replace=False)] *= 30.0
    return (x * col).astype(np.float32)


@dataclass
class Entry:
    name: str
    quantize: Callable  # cupy array -> QuantizedTensor
    reference: Callable  # numpy array -> dict of expected host arrays, keys as QuantizedTensor fields
    normal_range: Callable  # (|x| float64, q host dict) -> mask of elements in the normal range


def _fp8_entries(xh):
    import cupyquant as cq
    from cupyquant import reference as ref

    def normal_mask(fmt, min_normal):
        def mask(ax, q):  # |x| * scale within [min normal, max finite] of the format
            v = ax / np.float64(q["scale"][0])
            return (v >= min_normal) & (v <= q["fmax"])

        return mask


    entries = []
    for fmt, label, min_normal in (("float8_e4m3fn", "E4M3", 2.0**-6), ("float8_e5m2", "E5M2", 2.0**-14)):
        entries.append(
            Entry(
                f"FP8 {label} per-tensor, dynamic",
                lambda x, f=fmt: cq.quantize_fp8(x, f),
                lambda xh, f=fmt: dict(zip(("data", "scale"), ref.quantize_fp8(xh, f))),
                normal_mask(fmt, min_normal),
            )
        )
    # a static scale as a calibration would give it: the 99.99th percentile of |x| maps to 448
    fmt = "float8_e4m3fn"
    s = float(np.float32(np.percentile(np.abs(xh.astype(np.float32)), 99.99) / 448.0))
    entries.append(
        Entry(
            "FP8 E4M3 per-tensor, static p99.99",
            lambda x: cq.quantize_fp8(x, fmt, scale=s),
            lambda xh: dict(zip(("data", "scale"), ref.quantize_fp8(xh, fmt, scale=s))),
            normal_mask(fmt, 2.0**-6),
        )
    )
    return entries


def entries(xh):
    """Every scheme of the report for host data ``xh``. A new family adds its rows here."""
    return _fp8_entries(xh)


def _gpu_or_reason():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
        return None
    except Exception as e:  # noqa: BLE001 - any failure means no usable GPU
        return f"no usable CUDA device ({type(e).__name__}: {str(e).splitlines()[0][:100]})"


def main() -> int:
    reason = _gpu_or_reason()
    if reason:
        print(f"cupyquant: the report needs a GPU, and there is {reason}.")
        return 1

    import cupy
    import ml_dtypes

    from cupyquant import _bench

    xh = builtin_tensor().astype(ml_dtypes.bfloat16)
    x = cupy.asarray(xh)
    x64 = xh.astype(np.float64)
    n = x.size
    copy_bw = _bench.copy_bandwidth(1 << 30)
    # Bandwidth on the tensor tiled 64 times (256M elements, 512 MB): past the L2 and long enough
    # that host launch overhead (a few microseconds a call) does not count.
    big = [(cupy.tile(x, (64, 1)),)]
    print(
        f"cupyquant report on {_bench.device_name()}: built-in heavy-tailed tensor {SHAPE[0]}x{SHAPE[1]} bfloat16 "
        f"(max |x| {np.abs(x64).max():.1f}, kurtosis {_kurtosis(x64):.0f}); copy bandwidth {copy_bw / 1e9:.0f} GB/s"
    )
    cols = ("scheme", "bits/elem", "SNR dB", "max rel err*", "bytes = ref", "GB/s", "% copy")
    widths = (36, 9, 7, 12, 11, 7, 6)
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    all_equal = True
    for e in entries(xh):
        q = e.quantize(x)
        y = q.dequantize(np.float32).get().astype(np.float64)
        host = q.to_host()
        host["fmax"] = q.format.max
        expected = e.reference(xh)
        equal = all(np.array_equal(_bits(host[k]), _bits(v)) for k, v in expected.items())
        all_equal &= equal
        err = y - x64
        snr = 10 * np.log10(np.sum(x64**2) / max(np.sum(err**2), 1e-300))
        mask = e.normal_range(np.abs(x64), host)
        rel = float(np.max(np.abs(err[mask]) / np.abs(x64[mask]))) if mask.any() else float("nan")
        bits = 8 * q.nbytes / n
        t = _bench.time_events(e.quantize, big, reps=20)
        gbs = big[0][0].size * (x.itemsize + q.data.nbytes / n) / t
        row = (e.name, f"{bits:.3f}", f"{snr:.2f}", f"{rel:.4f}", "yes" if equal else "NO", f"{gbs / 1e9:.0f}", f"{100 * gbs / copy_bw:.0f}")
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    print("* max |y - x| / |x| over elements whose |x| * scale lies in the format's normal range")
    print("  (E4M3 rounding bounds it by 2^-4, E5M2 by 2^-3); GB/s on the tensor tiled to 256M elements,")
    print("  counting x read once and q written once (dynamic per-tensor reads x twice: its limit is 60%)")
    return 0 if all_equal else 2


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _kurtosis(v):
    v = v.ravel() - v.mean()
    return float(np.mean(v**4) / np.mean(v**2) ** 2)


if __name__ == "__main__":
    sys.exit(main())
