"""``python -m cupyquant``: a round-trip quality and bandwidth report on built-in data.

Quantizes a deterministic heavy-tailed bf16 tensor (2048 x 2048, generated here: Student-t values
times per-column magnitudes that span e^+-2, with a few outlier columns 30x larger, as LLM
activations have) with every scheme the library has (the fused SiLU*Mul takes its two column halves
as gate and up; the fused RMSNorm rows normalize each row with a built-in weight), dequantizes it,
and prints per scheme: bits per element (scales included), SNR in dB, the largest relative error
over elements that land on a value in the format's normal range (scaled |x| between the smallest
normal and the max), whether the bytes and scales equal ``cupyquant.reference`` exactly, and the
quantizer's bandwidth (input read once + output written once, on the tensor tiled to 256M elements
so that the L2 cache and launch overhead do not flatter it) with its percentage of the device's copy
bandwidth measured in the same run.

A second table reads the tensor as a (2048, 2048) weight for the weight-only schemes: bits per
weight, SNR, bytes = reference, and the M = 1 matmul time against cuBLAS fp16 on the tensor tiled
to 8192 x 8192.

A third reads the tensor as the activations of the W8A8 matmul (scaled_matmul) against a Gaussian
weight: FP8 per-token x per-channel and in 1x128 x 128x128 blocks, INT8 per-token (with and without
zero points) x per-channel: SNR against the float64 product of the bf16 operands, the kernels' error
bound checked on every element (INT8: the reference's result bit for bit), and the time of a
4096 x 4096 x 4096 call against cuBLAS bf16 (a row the GPU has no tensor cores for says so in one
line).

The same schemes quantize a whole model checkpoint (safetensors in, a compressed-tensors checkpoint
that vLLM and SGLang load out, with a per-tensor round-trip report): ``python -m
cupyquant.checkpoint SRC DST --scheme fp8-block`` (docs/checkpoint.md).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np

SHAPE = (2048, 2048)

#: Exit statuses. 2 is argparse's own for a command-line error; a mismatch has a status of its own
#: so that a script can tell "the bytes differ" from "it was called wrongly".
EXIT_OK, EXIT_NO_GPU, EXIT_USAGE, EXIT_MISMATCH = 0, 1, 2, 3
EPILOG = f"""exit status: {EXIT_OK} when every scheme's bytes and scales equal cupyquant.reference and every
W8A8 element is within its error bound; {EXIT_NO_GPU} without a usable GPU (the reason in one line);
{EXIT_USAGE} for a command-line error; {EXIT_MISMATCH} when a scheme's bytes differ from the reference or
a W8A8 element breaks its bound (its row shows NO)."""
#: The widest line of ``--help``, whatever the terminal's width.
HELP_WIDTH = 100


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
    reference: Callable  # (host x, device x, q) -> dict of expected host arrays: data, scale
    target: Callable = None  # host x (float64) -> what the dequantized output approximates (default x)


def _scale_per_element(q, host, shape):
    """float64 scale of every element of q's (host) data."""
    from cupyquant import reference as ref

    s = host["scale"]
    if s.dtype.name == "float8_e4m3fn":  # NVFP4: float(sf) / S_enc
        s = s.astype(np.float64) / float(host["global_scale"][0])
    elif s.dtype != np.float32:
        s = ref.e8m0_to_float(s.view(np.uint8))
    s = s.astype(np.float64)
    if q.scheme.granularity == "tensor":
        return np.broadcast_to(s.reshape(-1)[0], shape)
    G = q.scheme.block[0]
    return np.repeat(s, G, axis=-1)[..., : shape[-1]]


def _normal_mask(q, host, target):
    """Elements whose |target| / scale lies in the format's normal range (for INT8: |x / s| >= 16,
    where rounding bounds the relative error by 1/32)."""
    v = np.abs(target) / _scale_per_element(q, host, target.shape)
    fmt = q.format
    lo = {"float8_e4m3fn": 2.0**-6, "float8_e5m2": 2.0**-14, "int8": 16.0, "float4_e2m1fn": 1.0}[fmt.name]
    return (v >= lo) & (v <= fmt.max)


def norm_weight(H: int, dtype) -> np.ndarray:
    """The RMSNorm weight of the report: 1 + 0.25 sin(i), in the tensor's dtype."""
    return (1.0 + 0.25 * np.sin(np.arange(H))).astype(np.float32).astype(dtype)


def _rms_norm64(x64, w) -> np.ndarray:
    """RMSNorm in float64 (eps 1e-6): what the fused rows approximate."""
    return x64 / np.sqrt(np.mean(x64**2, axis=-1, keepdims=True) + 1e-6) * w.astype(np.float64)


def entries(xh):
    """Every scheme of the report for host data ``xh``. A new family adds its rows here."""
    import cupy

    import cupyquant as cq
    from cupyquant import groupwise
    from cupyquant import reference as ref

    def pair(t):
        return dict(zip(("data", "scale"), t))

    rows = []
    for fmt, label in (("float8_e4m3fn", "E4M3"), ("float8_e5m2", "E5M2")):
        rows.append(
            Entry(
                f"FP8 {label} per-tensor, dynamic",
                lambda x, f=fmt: cq.quantize_fp8(x, f),
                lambda h, x, q, f=fmt: pair(ref.quantize_fp8(h, f)),
            )
        )
    # a static scale as a calibration would give it: the 99.99th percentile of |x| maps to 448
    s = float(np.float32(np.percentile(np.abs(xh.astype(np.float32)), 99.99) / 448.0))
    rows.append(
        Entry(
            "FP8 E4M3 per-tensor, static p99.99",
            lambda x: cq.quantize_fp8(x, scale=s),
            lambda h, x, q: pair(ref.quantize_fp8(h, scale=s)),
        )
    )
    for fmt, label, g, kw in (
        ("float8_e4m3fn", "FP8 E4M3", None, {}),
        ("int8", "INT8", None, {}),
        ("float8_e4m3fn", "FP8 E4M3", 128, {}),
        ("float8_e4m3fn", "FP8 E4M3", 128, dict(scale_layout="col", scale_dtype="float8_e8m0fnu")),
        ("int8", "INT8", 128, {}),
    ):
        what = f"per-token (rows of {SHAPE[1]})" if g is None else f"group-{g}" + (", UE8M0 col" if kw else "")
        rows.append(
            Entry(
                f"{label} {what}",
                lambda x, f=fmt, g=g, kw=kw: cq.quantize_groupwise(x, f, group_size=g, **kw),
                lambda h, x, q, f=fmt, g=g, kw=kw: pair(
                    ref.quantize_groupwise(h, f, group_size=g, scale_dtype=kw.get("scale_dtype", "float32"))
                ),
            )
        )
    rows.append(
        Entry(
            "SiLU*Mul + FP8 E4M3 group-128",
            lambda x: cq.silu_mul_quantize(x, group_size=128),
            lambda h, x, q: pair(
                ref.quantize_silu_intermediate(groupwise._silu_mul_intermediate(x)[0].get(), group_size=128)
            ),
            target=lambda x64: ref.silu_mul(x64.astype(np.float32)).astype(np.float64),
        )
    )

    # the fused RMSNorm (no residual) with a weight around 1, then per-token or group-128 FP8
    wh = norm_weight(xh.shape[-1], xh.dtype)
    w = cupy.asarray(wh)
    for g, what in ((None, "per-token"), (128, "group-128")):
        kw = {"scheme": "token"} if g is None else {"scheme": "group", "group_size": g}
        rows.append(
            Entry(
                f"RMSNorm + FP8 E4M3 {what}",
                lambda x, kw=kw: cq.rms_norm_quantize(x, w, **kw),
                lambda h, x, q, kw=kw: pair(ref.rms_norm_quantize(h, wh, **kw)[0]),
                target=lambda x64: _rms_norm64(x64, wh),
            )
        )

    def unpacked(d, K):
        return ref.unpack_fp4(d, K)

    rows.append(
        Entry(
            "MXFP8 E4M3 block-32, swizzled E8M0",
            lambda x: cq.quantize_mx(x, "float8_e4m3fn", scale_layout="swizzled"),
            lambda h, x, q: pair(ref.quantize_mx(h, "float8_e4m3fn")),
        )
    )
    rows.append(
        Entry(
            "MXFP4 E2M1 block-32, swizzled E8M0",
            lambda x: cq.quantize_mx(x, "float4_e2m1fn", scale_layout="swizzled"),
            lambda h, x, q: dict(
                zip(
                    ("data", "scale"),
                    (lambda d, s: (unpacked(d, h.shape[-1]), s))(*ref.quantize_mx(h, "float4_e2m1fn")),
                )
            ),
        )
    )
    rows.append(
        Entry(
            "NVFP4 block-16 E4M3 + global, swizzled",
            lambda x: cq.quantize_nvfp4(x),
            lambda h, x, q: dict(
                zip(("data", "scale"), (lambda d, s, g: (unpacked(d, h.shape[-1]), s))(*ref.quantize_nvfp4(h)))
            ),
        )
    )
    return rows


INSTALL_HINT = (
    'pip install "cupyquant[cu13]" if `nvidia-smi` shows "CUDA Version: 13.x", '
    'pip install "cupyquant[cu12]" if it shows 12.x (from a clone of the repository: '
    'pip install ".[cu13]" or ".[cu12]")'
)
_CUDA_ERROR_INSUFFICIENT_DRIVER = 35  # cudaErrorInsufficientDriver
_CUDA_ERROR_NO_DEVICE = 100  # cudaErrorNoDevice
_CUDA_ERROR_STUB_LIBRARY = 34  # cudaErrorStubLibrary: a toolkit's stub libcuda, no driver


def _have_libcuda() -> bool:
    """Whether the NVIDIA driver's library (libcuda.so.1) loads."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def _gpu_or_reason():
    """None when a CUDA device is usable, else a sentence saying why not and what to do."""
    try:
        import cupy
    except ImportError as e:
        return f"CuPy is not installed ({e}): {INSTALL_HINT}."
    runtime = cupy.cuda.runtime
    try:
        n = runtime.getDeviceCount()
    except runtime.CUDARuntimeError as e:
        status = getattr(e, "status", None)
        if status == _CUDA_ERROR_INSUFFICIENT_DRIVER:
            try:
                driver = runtime.driverGetVersion()
            except Exception:  # noqa: BLE001 - no driver to ask
                driver = 0
            if driver == 0 or not _have_libcuda():
                return (
                    "no NVIDIA driver: libcuda.so.1 was not found (install the NVIDIA driver; `nvidia-smi` checks it)"
                )
            return (
                f"an NVIDIA driver for CUDA {_cuda_version(driver)}, older than the CUDA "
                f"{_cuda_version(runtime.runtimeGetVersion())} that this CuPy ({cupy.__version__}) is built for: "
                f"update the driver, or install the extra that matches it ({INSTALL_HINT})"
            )
        if status == _CUDA_ERROR_NO_DEVICE:
            return "no CUDA device: the driver sees none (check CUDA_VISIBLE_DEVICES and `nvidia-smi`)"
        if status == _CUDA_ERROR_STUB_LIBRARY:
            return "no NVIDIA driver: the libcuda found is the CUDA toolkit's stub (install the NVIDIA driver)"
        return f"no usable CUDA device ({str(e).splitlines()[0][:200]})"
    except Exception as e:  # noqa: BLE001 - any other failure means no usable GPU
        return f"no usable CUDA device ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    if n < 1:
        return "no CUDA device: the driver sees none (check CUDA_VISIBLE_DEVICES and `nvidia-smi`)"
    return None


def _parse_args(argv):
    import argparse
    import shutil
    import textwrap

    class Formatter(argparse.HelpFormatter):
        """argparse's help at most HELP_WIDTH columns wide (narrower on a narrower terminal), the
        description's and epilog's paragraphs kept apart and each refilled to that width."""

        def __init__(self, prog):
            super().__init__(prog, width=min(HELP_WIDTH, shutil.get_terminal_size().columns - 2))

        def _fill_text(self, text, width, indent):
            paragraphs = (" ".join(p.split()) for p in text.strip().split("\n\n"))
            return "\n\n".join(
                textwrap.fill(p, width, initial_indent=indent, subsequent_indent=indent) for p in paragraphs
            )

    p = argparse.ArgumentParser(
        prog="python -m cupyquant", description=__doc__, epilog=EPILOG, formatter_class=Formatter
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Parse the command line, check for a GPU, print the report; returns the exit status (EPILOG)."""
    _parse_args(argv)
    reason = _gpu_or_reason()
    if reason:
        print(f"cupyquant: the report needs a GPU; found {reason}.", file=sys.stderr)
        return EXIT_NO_GPU
    return EXIT_OK if _report() else EXIT_MISMATCH


def _report() -> bool:
    """Print the three tables; True when every scheme matches the reference and every W8A8 element
    is within its bound."""
    import cupy
    import ml_dtypes

    from cupyquant import _bench

    xh = builtin_tensor().astype(ml_dtypes.bfloat16)
    x = cupy.asarray(xh)
    x64 = xh.astype(np.float64)
    copy_bw = _bench.copy_bandwidth(1 << 30)
    # Bandwidth on the tensor tiled 64 times (256M elements, 512 MB): past the L2 and long enough
    # that host launch overhead (a few microseconds a call) does not count.
    big = [(cupy.tile(x, (64, 1)),)]
    print(
        f"cupyquant report on {_bench.device_name()}: built-in heavy-tailed tensor {SHAPE[0]}x{SHAPE[1]} bfloat16 "
        f"(max |x| {np.abs(x64).max():.1f}, kurtosis {_kurtosis(x64):.0f}); copy bandwidth {copy_bw / 1e9:.0f} GB/s"
    )
    cols = ("scheme", "bits/elem", "SNR dB", "max rel err*", "bytes = ref", "GB/s", "% copy")
    widths = (40, 9, 7, 12, 11, 7, 6)
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    all_equal = True
    for e in entries(xh):
        q = e.quantize(x)
        y = q.dequantize(np.float32).get().astype(np.float64)
        host = q.to_host()
        expected = e.reference(xh, x, q)
        equal = np.array_equal(_bits(host["data"]), _bits(expected["data"]))
        equal &= np.array_equal(_bits(host["scale"]), _bits(expected["scale"]))
        all_equal &= equal
        target = x64 if e.target is None else e.target(x64)
        err = y - target
        snr = 10 * np.log10(np.sum(target**2) / max(np.sum(err**2), 1e-300))
        mask = _normal_mask(q, host, target)
        rel = float(np.max(np.abs(err[mask]) / np.abs(target[mask]))) if mask.any() else float("nan")
        bits = 8 * q.nbytes / target.size
        qb = e.quantize(big[0][0])
        t = _bench.time_events(e.quantize, big, reps=20)
        gbs = (big[0][0].nbytes + qb.nbytes) / t
        del qb
        row = (
            e.name,
            f"{bits:.3f}",
            f"{snr:.2f}",
            f"{rel:.4f}",
            "yes" if equal else "NO",
            f"{gbs / 1e9:.0f}",
            f"{100 * gbs / copy_bw:.0f}",
        )
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    print("* max |y - x| / |x| over elements whose |x| / scale lies in the format's normal range (INT8:")
    print("  |x| / scale >= 16); E4M3 rounding bounds it by 2^-4, E5M2 by 2^-3, INT8 there by 2^-5, E2M1")
    print("  (|x| / scale in [1, 6]) by 2^-2.")
    print("  SiLU*Mul is measured against silu(gate) * up of the tensor's two column halves, RMSNorm against the")
    print("  float64 norm of the rows times the report's weight (1 + 0.25 sin(column)).")
    print(f"  GB/s on the tensor tiled to {64 * SHAPE[0]} x {SHAPE[1]} (256M elements), counting x read once and q")
    print("  and its scales written once (dynamic per-tensor reads x twice: its limit is 60% of the copy figure)")
    all_equal &= weight_report(xh, x)
    from cupyquant import _report_w8a8

    all_equal &= _report_w8a8.w8a8_report(xh, x)
    return bool(all_equal)


WEIGHT_SCHEMES = (
    ("int4", 128),
    ("uint4", 128),
    ("int4", None),
    ("float8_e4m3fn", 128),
    ("float8_e4m3fn", None),
    ("nvfp4", 16),
    ("mxfp4", 32),
)
FP4_SCHEMES = ("nvfp4", "mxfp4")  # blocks of 16 and 32 fixed by the format (group_size left at its default)
MATMUL_TILE = (4, 4)  # the built-in tensor tiled to an 8192 x 8192 weight for the matmul timing


def weight_report(xh, x) -> bool:
    """The weight-only schemes on the built-in tensor read as a (N, K) = (2048, 2048) weight: bits
    per weight, SNR of the dequantized weight, bytes = reference, and the M = 1 matmul time against
    cuBLAS fp16 on the tensor tiled to 8192 x 8192 (CUDA-graph replay, weights rotated past the L2)."""
    import cupy

    import cupyquant as cq
    from cupyquant import _bench
    from cupyquant import reference as ref

    x64 = xh.astype(np.float64)
    big = cupy.tile(x, MATMUL_TILE)
    N, K = big.shape
    a16 = cupy.random.default_rng(1).standard_normal((1, K), dtype=np.float32).astype(np.float16)
    ab = a16.astype(xh.dtype)
    w16 = [big.astype(np.float16) for _ in range(max(1, _bench.copies_for(N * K * 2)))]
    y16 = cupy.empty((1, N), np.float16)
    # cuBLAS cannot be captured in a CUDA graph through CuPy: a loop of calls, GPU-bound at this size
    t_cublas = _bench.time_loop(lambda w: cupy.matmul(a16, w.T, out=y16), [(w,) for w in w16], calls=40)
    del w16
    print()
    print(
        f"weight-only: the tensor as a (N, K) = {SHAPE} weight; matmul M = 1 on it tiled to {N}x{K}, "
        f"bf16 activations, vs cuBLAS fp16 ({t_cublas * 1e6:.1f} us)"
    )
    cols = ("scheme", "bits/weight", "SNR dB", "bytes = ref", "matmul us", "x cuBLAS")
    widths = (28, 11, 7, 11, 9, 8)
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    all_equal = True
    yb = cupy.empty((1, N), xh.dtype)
    for scheme, g in WEIGHT_SCHEMES:
        kw = {} if scheme in FP4_SCHEMES else {"group_size": g}
        qw = cq.quantize_weight(x, scheme, **kw)
        d, s, z = ref.quantize_weight(xh, scheme, **kw)  # FP4: z is scale_2 (None for MXFP4)
        h = qw.to_host()
        equal = np.array_equal(h["data"], d) and np.array_equal(_bits(h["scales"]), _bits(s))
        if scheme in FP4_SCHEMES:
            equal &= (z is None) == (h["scale_2"] is None) and (
                z is None or np.array_equal(_bits(h["scale_2"]), _bits(z))
            )
        else:
            equal &= (z is None) == (h["zeros"] is None) and (z is None or np.array_equal(cupy.asnumpy(qw.zeros), z))
        all_equal &= equal
        y = qw.dequantize(np.float32).get().astype(np.float64)
        snr = 10 * np.log10(np.sum(x64**2) / max(np.sum((y - x64) ** 2), 1e-300))
        qb = cq.prepare_weight(cq.quantize_weight(big, scheme, **kw))
        copies = [qb] + [qb.copy() for _ in range(max(0, _bench.copies_for(qb.nbytes) - 1))]
        t = _bench.time_graph(lambda q: cq.matmul(ab, q, out=yb), [(q,) for q in copies])
        del copies, qb
        name = f"{scheme} " + ("per-channel" if g is None else f"block-{g}" if scheme in FP4_SCHEMES else f"group-{g}")
        row = (
            name,
            f"{8 * qw.nbytes / xh.size:.3f}",
            f"{snr:.2f}",
            "yes" if equal else "NO",
            f"{t * 1e6:.1f}",
            f"{t_cublas / t:.2f}",
        )
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    cupy.get_default_memory_pool().free_all_blocks()
    return all_equal


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _kurtosis(v):
    v = v.ravel() - v.mean()
    return float(np.mean(v**4) / np.mean(v**2) ** 2)


if __name__ == "__main__":
    sys.exit(main())
