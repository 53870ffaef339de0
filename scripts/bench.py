#!/usr/bin/env python3
"""Benchmark cupyquant ops against the copy-bandwidth ceiling and torch peers, on the GPU.

    python scripts/bench.py                      # every op, 1M 16M 256M 1G bf16 elements
    python scripts/bench.py --ops quant_dynamic --sizes 16M --markdown out.md

Protocol (DESIGN.md): CUDA events around each call, warm-up, median of --reps calls, inputs rotated
over enough copies to span 4x the L2, the copy bandwidth of a 2 GiB device-to-device copy measured in
the same run. GB/s counts each input read once and each output written once; "% bound" compares
with the op's own bound at the copy bandwidth (for dynamic quantization, two reads of x and one
write: 5 bytes per bf16 element). torch eager and torch.compile run the same formula on the same
buffers (through DLPack) in the same process; "x eager" / "x compile" are their times over ours.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from dataclasses import dataclass
from typing import Callable

import cupy
import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cupyquant as cq  # noqa: E402
from cupyquant import _bench  # noqa: E402

SIZES = {"1M": 1 << 20, "16M": 1 << 24, "256M": 1 << 28, "1G": 1 << 30}
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


@dataclass
class Op:
    """One benchmark entry: how to make inputs, run ours, run torch's, and count bytes."""

    make: Callable  # (n, in_dtype, fmt) -> list of argument tuples (one per rotated copy)
    ours: Callable  # (*args) -> anything
    torch_fn: Callable | None  # (torch, fmt) -> function of the torch views of args
    io_bytes: Callable  # (n, in_itemsize) -> bytes read once + written once
    bound_bytes: Callable  # (n, in_itemsize) -> bytes the best implementation must move


def _inputs(n, in_dtype, copies):
    rng = cupy.random.default_rng(0)
    return [(rng.standard_normal(n, dtype=np.float32).astype(in_dtype),) for _ in range(copies)]


def _rotated(n, in_dtype, per_elem_bytes):
    return _inputs(n, in_dtype, _bench.copies_for(n * per_elem_bytes))


def _torch_quant(torch, fmt, dynamic):
    tdt = getattr(torch, fmt)
    fmax = FP8_MAX[fmt]

    def dyn(x):  # the formula of cupyquant.reference.quantize_fp8 (TransformerEngine current scaling)
        amax = x.abs().amax().float()
        scale = torch.where((amax > 0) & torch.isfinite(amax), fmax / amax, torch.ones_like(amax))
        scale = torch.where(torch.isinf(scale), torch.full_like(scale, 3.4028234663852886e38), scale)
        q = (x.float() * scale).clamp(-fmax, fmax).to(tdt)
        return q, scale.reciprocal()

    def static(x, inv_scale):
        return (x.float() * inv_scale).clamp(-fmax, fmax).to(tdt)

    return dyn if dynamic else static


def make_ops(fmt):
    def static_make(n, dt, _fmt):
        sets = _rotated(n, dt, np.dtype(dt).itemsize + 1)
        s = cupy.asarray([0.01], dtype=np.float32)
        return [(x, s) for (x,) in sets]

    def dequant_make(n, dt, f):
        sets = _rotated(n, dt, 1 + np.dtype(dt).itemsize)
        return [(cq.quantize_fp8(x, f),) for (x,) in sets]

    def torch_dequant(torch, _fmt):
        def deq(q, scale_inv, out_dtype):
            return (q.float() * scale_inv).to(out_dtype)

        return deq

    return {
        "amax": Op(
            make=lambda n, dt, f: _rotated(n, dt, np.dtype(dt).itemsize),
            ours=lambda x: cq.amax(x),
            torch_fn=lambda torch, f: (lambda x: x.abs().amax()),
            io_bytes=lambda n, b: n * b,
            bound_bytes=lambda n, b: n * b,
        ),
        "quant_dynamic": Op(
            make=lambda n, dt, f: _rotated(n, dt, np.dtype(dt).itemsize + 1),
            ours=lambda x: cq.quantize_fp8(x, fmt),
            torch_fn=lambda torch, f: _torch_quant(torch, f, True),
            io_bytes=lambda n, b: n * (b + 1),
            bound_bytes=lambda n, b: n * (2 * b + 1),
        ),
        "quant_static": Op(
            make=static_make,
            ours=lambda x, s: cq.quantize_fp8(x, fmt, scale=s),
            torch_fn=lambda torch, f: _torch_quant(torch, f, False),
            io_bytes=lambda n, b: n * (b + 1),
            bound_bytes=lambda n, b: n * (b + 1),
        ),
        "dequant": Op(
            make=dequant_make,
            ours=lambda q: q.dequantize(),
            torch_fn=torch_dequant,
            io_bytes=lambda n, b: n * (1 + b),
            bound_bytes=lambda n, b: n * (1 + b),
        ),
    }


def _torch_args(torch, name, args, in_dtype):
    """The same buffers as torch tensors (zero-copy DLPack)."""
    if name == "dequant":
        (q,) = args
        tq = torch.from_dlpack(q.data)
        tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[np.dtype(in_dtype).name]
        return (tq.view(getattr(torch, q.scheme.format)), torch.from_dlpack(q.scale), tdt)
    if name == "quant_static":
        x, s = args
        return (torch.from_dlpack(x), torch.from_dlpack(1.0 / s))
    return tuple(torch.from_dlpack(a) for a in args)


def _time_torch(torch, fn, targs_list, reps):
    def record():
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    return _bench.time_events(fn, targs_list, warmup=3, reps=reps, record=record)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="amax,quant_dynamic,quant_static,dequant")
    p.add_argument("--sizes", default="1M,16M,256M,1G")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--format", default="float8_e4m3fn", choices=list(FP8_MAX))
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--no-torch", action="store_true", help="skip the torch peers")
    p.add_argument("--markdown", help="also write the table to this file")
    a = p.parse_args(argv)

    in_dtype = np.dtype(ml_dtypes.bfloat16) if a.dtype == "bfloat16" else np.dtype(a.dtype)
    b = in_dtype.itemsize
    torch = None
    if not a.no_torch:
        try:
            import torch  # noqa: F811

            if not torch.cuda.is_available():
                torch = None
        except ImportError:
            torch = None

    copy_bw = _bench.copy_bandwidth()
    header = (
        f"{_bench.device_name()}, {datetime.date.today().isoformat()}; copy bandwidth {copy_bw / 1e9:.0f} GB/s "
        f"(2 GiB device-to-device, read + write); input {a.dtype}, format {a.format}"
        + ("" if torch else "; torch peers not available")
    )
    print(header, flush=True)
    cols = ["op", "elements", "us", "GB/s", "% copy", "% bound", "host us", "eager us", "x eager", "compile us", "x compile"]
    rows = []
    ops = make_ops(a.format)
    for name in a.ops.split(","):
        op = ops[name]
        tfn = op.torch_fn(torch, a.format) if torch else None
        for size in a.sizes.split(","):
            n = SIZES[size]
            # a fresh compile per size, specialized to it (as a serving engine's static shapes)
            tcomp = torch.compile(tfn, dynamic=False) if torch else None
            args_list = op.make(n, in_dtype, a.format)
            t = _bench.time_events(op.ours, args_list, reps=a.reps)
            host = _bench.host_seconds_per_call(op.ours, args_list) if n <= (1 << 20) else None
            row = {
                "op": name,
                "elements": size,
                "us": t * 1e6,
                "GB/s": op.io_bytes(n, b) / t / 1e9,
                "% copy": 100 * op.io_bytes(n, b) / t / copy_bw,
                "% bound": 100 * op.bound_bytes(n, b) / copy_bw / t,
                "host us": None if host is None else host * 1e6,
            }
            if torch:
                targs = [_torch_args(torch, name, args, in_dtype) for args in args_list]
                te = _time_torch(torch, tfn, targs, a.reps)
                tc = _time_torch(torch, tcomp, targs, a.reps)
                row.update({"eager us": te * 1e6, "x eager": te / t, "compile us": tc * 1e6, "x compile": tc / t})
            rows.append(row)
            print("  ".join(f"{c}={_fmt(row.get(c))}" for c in cols), flush=True)
            del args_list
            cupy.get_default_memory_pool().free_all_blocks()
            if torch:
                torch.cuda.empty_cache()

    table = [f"| {' | '.join(cols)} |", "|" + "---|" * len(cols)]
    table += [f"| {' | '.join(_fmt(r.get(c)) for c in cols)} |" for r in rows]
    text = header + "\n\n" + "\n".join(table) + "\n"
    print()
    print(text)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text)


def _fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 1000 else f"{v:.0f}"
    return str(v)


if __name__ == "__main__":
    main()
