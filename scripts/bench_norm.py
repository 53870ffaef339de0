"""The fused RMSNorm + quantization table of ``scripts/bench.py --norm``:
:func:`cupyquant.rms_norm_quantize` (with a residual) against the copy bandwidth, the unfused pair
and ``torch.compile`` of the same formula.

    python scripts/bench.py --norm                          # every case
    python scripts/bench.py --norm --norm-cases 4096x8192 --no-torch
    python scripts/bench.py --norm --list                   # the cases, without a GPU

Each case is ``M x H`` bf16 activations, a bf16 residual (added, written back, normalized) and a
bf16 weight, quantized by one scheme: ``token`` (per-token FP8), ``group128`` (FP8, row scales),
``tensor`` (static FP8), ``mxfp8`` (swizzled), ``nvfp4`` (swizzled, given global scale).

Protocol: each contender's calls captured in one CUDA graph over enough input copies to span 4x the
L2 and replayed; the median replay over its number of calls. Bytes: x and the residual read once,
the residual written once, q and the scales written once; "% copy" is that rate over the 2 GiB
device-to-device copy bandwidth measured in the same run; "copy us" is a copy of the same bytes
(half read, half written) timed the same way, the ceiling at this size, and "% of it" our share of
it. "unfused us": the norm alone (x +
residual, written back, and y) by ``torch.compile``, plus ``quantize_groupwise`` (or the scheme's
quantizer) of y, each timed as above; "x unfused" is that sum over ours. "compile us": the whole
formula (norm and quantization) by ``torch.compile(dynamic=False)``, compiled per shape; "x compile"
its time over ours.
"""

from __future__ import annotations

import datetime
import traceback
from dataclasses import dataclass

SCHEMES = ("token", "group128", "tensor", "mxfp8", "nvfp4")
#: rows x hidden size: decode batches and prefills of 4096- and 8192-wide models
SHAPES = [(1, 4096), (16, 4096), (128, 4096), (1024, 8192), (4096, 4096), (4096, 8192), (16384, 8192)]
_MAIN_SCHEMES = ("token", "group128")  # at every shape; the others at two
_SOME_SHAPES = ((16, 4096), (4096, 8192))
STATIC_SCALE = 0.05  # the decode scale of "tensor"
GLOBAL_SCALE = 2688.0 / 20.0  # the encode scale of "nvfp4" (an amax of 20)


@dataclass(frozen=True)
class Case:
    M: int
    H: int
    scheme: str

    @property
    def label(self) -> str:
        return f"{self.M}x{self.H}"


CASES = [Case(M, H, s) for M, H in SHAPES for s in SCHEMES if s in _MAIN_SCHEMES or (M, H) in _SOME_SHAPES]
SHAPE_LABELS = tuple(f"{M}x{H}" for M, H in SHAPES)


def parse_cases(text: str | None) -> list[Case]:
    """``"4096x8192,1x4096"`` -> the cases of those shapes (every scheme at a new shape); None ->
    :data:`CASES`."""
    if text is None:
        return list(CASES)
    keep = [s.strip() for s in text.split(",") if s.strip()]
    cases = [c for c in CASES if c.label in keep]
    for label in keep:
        if label not in SHAPE_LABELS:
            M, H = (int(v) for v in label.lower().split("x"))
            cases += [Case(M, H, s) for s in SCHEMES]
    return cases


def quant_kwargs(scheme: str) -> dict:
    """rms_norm_quantize's keyword arguments for a scheme of the table."""
    return {
        "token": {"scheme": "token"},
        "group128": {"scheme": "group", "group_size": 128},
        "tensor": {"scheme": "tensor", "scale": STATIC_SCALE},
        "mxfp8": {"scheme": "mx", "scale_layout": "swizzled"},
        "nvfp4": {"scheme": "nvfp4", "global_scale": GLOBAL_SCALE},
    }[scheme]


def io_bytes(c: Case, itemsize: int = 2) -> int:
    """x and the residual read, the residual written, q and the scales written."""
    n = c.M * c.H
    q = n // 2 if c.scheme == "nvfp4" else n
    scales = {"token": 4 * c.M, "group128": 4 * n // 128, "tensor": 4, "mxfp8": n // 32, "nvfp4": n // 16}[c.scheme]
    return 3 * n * itemsize + q + scales


def columns(torch: bool) -> list[str]:
    cols = ["shape", "scheme", "us", "GB/s", "% copy", "copy us", "% of it", "host us"]
    return cols + (["unfused us", "x unfused", "compile us", "x compile"] if torch else [])


def _torch_norm(torch, eps: float):
    """cupyquant.reference.rms_norm in torch ops (float32 steps; torch's sum order is its own)."""

    def norm(x, r, w):
        z = (x.float() + r.float()).to(x.dtype)
        r.copy_(z)
        zf = z.float()
        inv = 1.0 / torch.sqrt(zf.square().mean(-1, keepdim=True) + eps)
        return ((zf * inv).to(x.dtype).float() * w.float()).to(x.dtype)

    return norm


def _torch_fused(torch, bench, scheme: str, eps: float):
    """The norm and the scheme's quantizer (bench.py's torch formulas) as one function."""
    norm = _torch_norm(torch, eps)
    if scheme in ("token", "group128"):
        quant = bench._torch_group(torch, "float8_e4m3fn", None if scheme == "token" else 128)
    elif scheme == "tensor":
        static = bench._torch_quant(torch, "float8_e4m3fn", False)
        return lambda x, r, w: static(norm(x, r, w), 1.0 / STATIC_SCALE)
    elif scheme == "mxfp8":
        quant = bench._torch_mx(torch, "float8_e4m3fn", True)
    else:
        nv = bench._torch_nvfp4(torch, True)
        return lambda x, r, w: nv(norm(x, r, w), GLOBAL_SCALE)
    return lambda x, r, w: quant(norm(x, r, w))


def _own_quantizer(cq, scheme: str):
    kw = quant_kwargs(scheme)
    return {
        "token": lambda y: cq.quantize_groupwise(y, group_size=None),
        "group128": lambda y: cq.quantize_groupwise(y, group_size=128),
        "tensor": lambda y: cq.quantize_fp8(y, scale=kw["scale"]),
        "mxfp8": lambda y: cq.quantize_mx(y, scale_layout="swizzled"),
        "nvfp4": lambda y: cq.quantize_nvfp4(y, global_scale=kw["global_scale"]),
    }[scheme]


def bench_case(cupy, cq, bench, torch, formulas, c: Case, copy_bw: float, reps: int) -> dict:
    """One row; ``formulas`` is bench.py, whose torch formulas of the quantizers the peers use."""
    import ml_dtypes
    import numpy as np

    n = c.M * c.H
    copies = bench.copies_for(3 * n * 2)
    rng = cupy.random.default_rng(0)
    bf16 = ml_dtypes.bfloat16
    w = (1.0 + 0.1 * rng.standard_normal(c.H, dtype=np.float32)).astype(bf16)
    sets = [
        (rng.standard_normal((c.M, c.H), dtype=np.float32).astype(bf16), rng.standard_normal((c.M, c.H), dtype=np.float32).astype(bf16))
        for _ in range(copies)
    ]  # fmt: skip
    kw = quant_kwargs(c.scheme)

    def ours(x, r):
        cq.rms_norm_quantize(x, w, residual=r, **kw)

    calls = [sets[i % copies] for i in range(max(8, copies))]
    t = bench.time_graph(ours, calls, reps)
    nbytes = io_bytes(c)
    row = {
        "shape": c.label,
        "scheme": c.scheme,
        "us": t * 1e6,
        "GB/s": nbytes / t / 1e9,
        "% copy": 100 * nbytes / t / copy_bw,
        "copy us": (tc := bench.copy_seconds(nbytes)) * 1e6,
        "% of it": 100 * tc / t,
        "host us": bench.host_seconds_per_call(ours, sets, calls=200) * 1e6,
    }
    if torch is not None:
        row.update(_bench_torch(cupy, cq, torch, bench, formulas, c, w, sets, calls, t, reps))
    return row


def _bench_torch(cupy, cq, torch, bench, formulas, c: Case, w, sets, calls, t: float, reps: int) -> dict:
    tw = torch.from_dlpack(w)
    targs = {id(s): (torch.from_dlpack(s[0]), torch.from_dlpack(s[1]), tw) for s in sets}
    tcalls = [targs[id(s)] for s in calls]
    out = {}
    try:
        norm = torch.compile(_torch_norm(torch, 1e-6), dynamic=False)
        t_norm = bench.time_torch_graph(torch, norm, tcalls, reps)
        ys = [cupy.from_dlpack(norm(*a)) for a in tcalls[: len(sets)]]
        quant = _own_quantizer(cq, c.scheme)
        t_quant = bench.time_graph(quant, [(y,) for y in ys], reps)
        out.update({"unfused us": (t_norm + t_quant) * 1e6, "x unfused": (t_norm + t_quant) / t})
    except Exception:  # noqa: BLE001 - a peer that cannot run leaves its cells empty
        traceback.print_exc(limit=2)
    try:
        fused = torch.compile(_torch_fused(torch, formulas, c.scheme, 1e-6), dynamic=False)
        tc = bench.time_torch_graph(torch, fused, tcalls, reps)
        out.update({"compile us": tc * 1e6, "x compile": tc / t})
    except Exception:  # noqa: BLE001
        traceback.print_exc(limit=2)
    return out


def main_norm(a, bench) -> None:
    """``scripts/bench.py --norm``: ``a`` the parsed arguments, ``bench`` the bench.py module (its
    torch loader, table runner and torch formulas of the quantizers)."""
    cases = parse_cases(a.norm_cases)
    if a.list:
        print("\n".join(f"{c.label} {c.scheme}" for c in cases))
        return
    import cupy

    import cupyquant as cq
    from cupyquant import _bench

    torch = bench._load_compiling_torch(a.no_torch)
    copy_bw = _bench.copy_bandwidth()
    head = (
        f"{_bench.device_name()}, {datetime.date.today().isoformat()}; fused residual add + RMSNorm + "
        f"quantization, bf16 x / residual / weight, FP8 E4M3 (NVFP4: E2M1); CUDA-graph replay; copy "
        f"bandwidth {copy_bw / 1e9:.0f} GB/s" + ("" if torch else "; torch not available")
    )
    reps = max(5, a.reps // 5)
    bench._run_cases(
        head, columns(torch is not None), cases,
        lambda c: bench_case(cupy, cq, _bench, torch, bench, c, copy_bw, reps), a.markdown, torch,
    )  # fmt: skip
