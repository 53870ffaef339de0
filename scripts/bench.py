#!/usr/bin/env python3
"""Benchmark cupyquant ops against the copy-bandwidth ceiling and torch peers, on the GPU.

    python scripts/bench.py                      # every op at its shapes, bf16 in
    python scripts/bench.py --ops quant_dynamic,group128 --markdown out.md
    python scripts/bench.py --list               # the ops and their shapes
    python scripts/bench.py --matmul             # the weight-only matmul against cuBLAS (scripts/bench_matmul.py)
    python scripts/bench.py --w8a8               # the W8A8 FP8 and INT8 matmul (scripts/bench_w8a8.py)
    python scripts/bench.py --kv-cache           # the FP8 KV-cache write (scripts/bench_kv_cache.py)
    python scripts/bench.py --norm               # fused RMSNorm + quantization (scripts/bench_norm.py)
    python scripts/bench.py --host               # host time per call of every op (scripts/bench_host.py)
    python scripts/bench.py --sweep --json sweep.json --plot sweep.png --plot-ratio ratio.png
                                                 # the inference shape sweep (scripts/bench_sweep.py)

Protocol (docs/performance.md): CUDA events around each call, warm-up, median of --reps calls, inputs rotated
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_w8a8 and the others next to this file

import bench_host  # noqa: E402
import bench_kv_cache  # noqa: E402
import bench_matmul  # noqa: E402
import bench_norm  # noqa: E402
import bench_sweep  # noqa: E402
import bench_w8a8  # noqa: E402

import cupyquant as cq  # noqa: E402
from cupyquant import _bench  # noqa: E402

SIZES = {"1M": 1 << 20, "16M": 1 << 24, "256M": 1 << 28, "1G": 1 << 30}
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


@dataclass
class Op:
    """One benchmark entry: its shapes, how to make inputs, run ours, run torch's, count bytes."""

    shapes: list  # [(label, shape)]
    make: Callable  # (shape, in_dtype, fmt) -> list of argument tuples (one per rotated copy)
    ours: Callable  # (*args) -> anything
    torch_fn: Callable | None  # (torch, fmt) -> function of the torch views of args
    io_bytes: Callable  # (shape, in_itemsize) -> bytes read once + written once
    bound_bytes: Callable  # (shape, in_itemsize) -> bytes the best implementation must move
    to_torch: Callable | None = None  # (torch, args) -> torch arguments; default: DLPack each array


def _inputs(shape, in_dtype, copies):
    rng = cupy.random.default_rng(0)
    return [(rng.standard_normal(shape, dtype=np.float32).astype(in_dtype),) for _ in range(copies)]


def _rotated(shape, in_dtype, per_elem_bytes):
    return _inputs(shape, in_dtype, _bench.copies_for(int(np.prod(shape)) * per_elem_bytes))


def _n(shape):
    return int(np.prod(shape))


FLAT = [(k, (v,)) for k, v in SIZES.items()]
GROUP_SHAPES = [("4096x7168", (4096, 7168)), ("16384x16384", (16384, 16384))]
SILU_SHAPES = [("4096x2*14336", (4096, 2 * 14336)), ("16384x2*14336", (16384, 2 * 14336))]


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
    def static_make(shape, dt, _fmt):
        sets = _rotated(shape, dt, np.dtype(dt).itemsize + 1)
        s = cupy.asarray([0.01], dtype=np.float32)
        return [(x, s) for (x,) in sets]

    def dequant_make(shape, dt, f):
        sets = _rotated(shape, dt, 1 + np.dtype(dt).itemsize)
        return [(cq.quantize_fp8(x, f),) for (x,) in sets]

    def torch_dequant(torch, _fmt):
        def deq(q, scale_inv, out_dtype):
            return (q.float() * scale_inv).to(out_dtype)

        return deq

    ops = {
        "amax": Op(
            shapes=FLAT,
            make=lambda shape, dt, f: _rotated(shape, dt, np.dtype(dt).itemsize),
            ours=lambda x: cq.amax(x),
            torch_fn=lambda torch, f: lambda x: x.abs().amax(),
            io_bytes=lambda shape, b: _n(shape) * b,
            bound_bytes=lambda shape, b: _n(shape) * b,
        ),
        "quant_dynamic": Op(
            shapes=FLAT,
            make=lambda shape, dt, f: _rotated(shape, dt, np.dtype(dt).itemsize + 1),
            ours=lambda x: cq.quantize_fp8(x, fmt),
            torch_fn=lambda torch, f: _torch_quant(torch, f, True),
            io_bytes=lambda shape, b: _n(shape) * (b + 1),
            bound_bytes=lambda shape, b: _n(shape) * (2 * b + 1),
        ),
        "quant_static": Op(
            shapes=FLAT,
            make=static_make,
            ours=lambda x, s: cq.quantize_fp8(x, fmt, scale=s),
            torch_fn=lambda torch, f: _torch_quant(torch, f, False),
            io_bytes=lambda shape, b: _n(shape) * (b + 1),
            bound_bytes=lambda shape, b: _n(shape) * (b + 1),
            to_torch=lambda torch, args: (torch.from_dlpack(args[0]), torch.from_dlpack(1.0 / args[1])),
        ),
        "dequant": Op(
            shapes=FLAT,
            make=dequant_make,
            ours=lambda q: q.dequantize(),
            torch_fn=torch_dequant,
            io_bytes=lambda shape, b: _n(shape) * (1 + b),
            bound_bytes=lambda shape, b: _n(shape) * (1 + b),
            to_torch=_torch_dequant_args,
        ),
    }
    ops.update(_group_ops())
    ops.update(_mx_ops())
    return ops


def _torch_dtype(torch, dt):
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[np.dtype(dt).name]


def _torch_dequant_args(torch, args):
    (q,) = args
    fmt = q.scheme.format
    tq = torch.from_dlpack(q.data)
    tq = tq.view(torch.int8) if fmt == "int8" else tq.view(getattr(torch, fmt))
    scale = torch.from_dlpack(q.scale)
    return (tq, scale, _torch_dtype(torch, q.dtype))


def _group_bytes(shape, b, per_token=False, group=128):
    n = _n(shape)
    return n * (b + 1) + (shape[0] if per_token else n // group) * 4


def _torch_group(torch, fmt, group_size, pow2=False, col=False):
    """vLLM's formulas (cupyquant.reference.quantize_groupwise) in torch ops."""
    int8 = fmt == "int8"
    qmax = 127.0 if int8 else FP8_MAX[fmt]
    qmin = -128.0 if int8 else -qmax
    tdt = torch.int8 if int8 else getattr(torch, fmt)

    def grouped(x):
        M, K = x.shape
        xg = x.float().view(M, K // group_size, group_size)
        s = xg.abs().amax(-1, keepdim=True).clamp_min(1e-10) / qmax
        if pow2:
            s = torch.exp2(torch.ceil(torch.log2(s)))
        v = (xg / s).clamp(qmin, qmax)
        q = (v.round() if int8 else v).to(tdt).view(M, K)
        s = s.view(M, K // group_size)
        return q, (s.t().contiguous().t() if col else s)

    def per_token(x):
        xf = x.float()
        amax = xf.abs().amax(-1, keepdim=True)
        if int8:
            q = (xf * (127.0 / amax)).round().clamp(-128, 127).to(tdt)
            return q, amax / 127.0
        s = (amax / qmax).clamp_min(1.0 / (qmax * 512.0))
        return (xf / s).clamp(-qmax, qmax).to(tdt), s

    return per_token if group_size is None else grouped


def _torch_int8_azp(torch, _fmt):
    """vLLM's dynamic per-token INT8 with zero points (cupyquant.reference.int8_azp_params) in torch
    ops: the row's min and max, s = (max - min) / 255, z = round(-128 - min / s), q = round(x / s) + z."""

    def azp(x):
        xf = x.float()
        lo, hi = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
        s = (hi - lo) / 255.0
        z = torch.round(-128.0 - lo / s).to(torch.int32)
        q = (torch.round(xf * (1.0 / s)).to(torch.int32) + z).clamp(-128, 127).to(torch.int8)
        return q, s, z

    return azp


def _torch_group_dequant(torch, group_size):
    """Per-group (per-token for None) dequantization: q times its row's scale, to out_dtype."""

    def deq(q, s, out_dtype):
        M, K = q.shape
        G = K if group_size is None else group_size
        return (q.float().view(M, K // G, G) * s.reshape(M, K // G, 1)).view(M, K).to(out_dtype)

    return deq


def _torch_silu(torch, fmt, group_size=128):
    qmax = FP8_MAX[fmt]
    tdt = getattr(torch, fmt)

    def silu_quant(x):  # vLLM silu_and_mul_per_block_quant
        H = x.shape[-1] // 2
        g, u = x[..., :H].float(), x[..., H:].float()
        r = (g * torch.sigmoid(g) * u).view(x.shape[0], H // group_size, group_size)
        s = (r.abs().amax(-1, keepdim=True) / qmax).clamp_min(1.0 / (qmax * 512.0))
        return (r / s).clamp(-qmax, qmax).to(tdt).view(x.shape[0], H), s.view(x.shape[0], -1)

    return silu_quant


def _group_ops():
    def g_make(shape, dt, f):
        return _rotated(shape, dt, np.dtype(dt).itemsize + 1)

    def entry(fmt, group_size, shapes, layout="row", pow2=False):
        per_token = group_size is None
        return Op(
            shapes=shapes,
            make=g_make,
            ours=lambda x: cq.quantize_groupwise(x, fmt, group_size=group_size, scale_layout=layout, scale_pow2=pow2),
            torch_fn=lambda torch, f: _torch_group(torch, fmt, group_size, pow2, layout == "col"),
            io_bytes=lambda shape, b: _group_bytes(shape, b, per_token, group_size or 1),
            bound_bytes=lambda shape, b: _group_bytes(shape, b, per_token, group_size or 1),
        )

    def silu_make(shape, dt, f):
        return _rotated(shape, dt, np.dtype(dt).itemsize + 1)

    def silu_bytes(shape, b):
        out = _n(shape) // 2
        return out * (2 * b + 1) + out // 128 * 4

    def gdeq_make(shape, dt, f):
        return [
            (cq.quantize_groupwise(x, "float8_e4m3fn", group_size=128),)
            for (x,) in _rotated(shape, dt, 1 + np.dtype(dt).itemsize)
        ]

    return {
        "group128": entry("float8_e4m3fn", 128, GROUP_SHAPES),
        "group128_col": entry("float8_e4m3fn", 128, GROUP_SHAPES, "col"),
        "group128_pow2": entry("float8_e4m3fn", 128, GROUP_SHAPES, "col", True),
        "group128_int8": entry("int8", 128, GROUP_SHAPES),
        "token_fp8": entry("float8_e4m3fn", None, GROUP_SHAPES),
        "token_int8": entry("int8", None, GROUP_SHAPES),
        "token_int8_azp": Op(
            shapes=GROUP_SHAPES,
            make=g_make,
            ours=lambda x: cq.quantize_groupwise(x, "int8", group_size=None, symmetric=False),
            torch_fn=_torch_int8_azp,
            io_bytes=lambda shape, b: _group_bytes(shape, b, True) + 4 * shape[0],
            bound_bytes=lambda shape, b: _group_bytes(shape, b, True) + 4 * shape[0],
        ),
        "silu_group128": Op(
            shapes=SILU_SHAPES,
            make=silu_make,
            ours=lambda x: cq.silu_mul_quantize(x, "float8_e4m3fn", group_size=128),
            torch_fn=lambda torch, f: _torch_silu(torch, "float8_e4m3fn"),
            io_bytes=silu_bytes,
            bound_bytes=silu_bytes,
        ),
        "group128_dequant": Op(
            shapes=GROUP_SHAPES,
            make=gdeq_make,
            ours=lambda q: q.dequantize(),
            torch_fn=lambda torch, f: _torch_group_dequant(torch, 128),
            io_bytes=lambda shape, b: _n(shape) * (1 + b) + _n(shape) // 128 * 4,
            bound_bytes=lambda shape, b: _n(shape) * (1 + b) + _n(shape) // 128 * 4,
            to_torch=_torch_dequant_args,
        ),
    }


MX_SHAPES = [("8192x8192", (8192, 8192)), ("16384x16384", (16384, 16384))]
_ELEM_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "float4_e2m1fn": 6.0}
_FLT_MAX = 3.4028234663852886e38


def _mx_bytes(shape, b, fmt, block, quant=True):
    """Input read once plus output written once: elements (1 byte, or 1/2 for FP4) and one scale byte
    per block (the swizzled padding is zero for these shapes)."""
    n = _n(shape)
    elem = n if fmt != "float4_e2m1fn" else n // 2
    return n * b + elem + n // block


def _torch_swizzle(s):
    """(M, Kb) scales -> the 128x4 layout, padded with zeros to 128 rows and 4 columns: m = 128a +
    32b + c and k = 4d + e go to offset (a Kt + d) 512 + 16 c + 4 b + e."""
    import torch.nn.functional as F

    M, Kb = s.shape
    Mp, Kp = -(-M // 128) * 128, -(-Kb // 4) * 4
    if (Mp, Kp) != (M, Kb):
        s = F.pad(s, (0, Kp - Kb, 0, Mp - M))
    return s.view(Mp // 128, 4, 32, Kp // 4, 4).permute(0, 3, 2, 1, 4).reshape(Mp, Kp)


def _torch_unswizzle(s, M, Kb):
    Mp, Kp = -(-M // 128) * 128, -(-Kb // 4) * 4
    return s.reshape(Mp // 128, Kp // 4, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(Mp, Kp)[:M, :Kb]


def _torch_e2m1_codes(torch, v):
    """cupyquant.reference.cast_e2m1 without the NaN rule: round-to-nearest-even thresholds."""
    a = v.abs()
    code = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def _torch_pack_fp4(torch, codes):
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _torch_mx(torch, fmt, swizzled):
    """cupyquant.reference.quantize_mx (ceil rule, finite data) in torch ops."""
    emax = _ELEM_MAX[fmt]
    rcp = float(np.float32(1.0 / emax))

    def quant(x):
        M, K = x.shape
        xf = x.float().view(M, K // 32, 32)
        v = xf.abs().amax(-1) * rcp
        bits = v.view(torch.int32)
        e = (bits >> 23) & 0xFF
        m = bits & 0x7FFFFF
        up = (m != 0) & (e != 254) & ~((e == 0) & (m <= 0x400000))
        E = e + up.to(torch.int32)
        mult = ((254 - E.clamp(max=253)) << 23).view(torch.float32)
        y = xf * mult.unsqueeze(-1)
        if fmt == "float4_e2m1fn":
            q = _torch_pack_fp4(torch, _torch_e2m1_codes(torch, y).view(M, K))
        else:
            q = y.clamp(-emax, emax).to(getattr(torch, fmt)).view(M, K)
        s = E.to(torch.uint8)
        return q, (_torch_swizzle(s) if swizzled else s)

    return quant


def _torch_nvfp4(torch, swizzled):
    """cupyquant.reference.quantize_nvfp4 with a given global scale, in torch ops."""
    r6 = float(np.float32(1.0 / 6.0))

    def quant(x, s_enc):
        M, K = x.shape
        xf = x.float().view(M, K // 16, 16)
        amax = xf.abs().amax(-1)
        sf = (amax * (s_enc * r6)).clamp(max=448.0).to(torch.float8_e4m3fn)
        inv = (1.0 / (sf.float() * (1.0 / s_enc))).clamp(max=_FLT_MAX)
        q = _torch_pack_fp4(torch, _torch_e2m1_codes(torch, xf * inv.unsqueeze(-1)).view(M, K))
        s = sf.view(torch.uint8)
        return q, (_torch_swizzle(s) if swizzled else s)

    return quant


def _torch_mx_dequant(torch, fmt, block, swizzled, nv):
    lut = None

    def deq(q, s, gs, out_dtype):
        nonlocal lut
        M = q.shape[0]
        if fmt == "float4_e2m1fn":
            if lut is None:
                lut = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], device=q.device)
            v = torch.stack([lut[(q & 0xF).long()], lut[(q >> 4).long()]], -1).view(M, -1)
        else:
            v = q.view(getattr(torch, fmt)).float()
        K = v.shape[1]
        Kb = K // block
        s = _torch_unswizzle(s, M, Kb) if swizzled else s
        if nv:
            scale = s.view(torch.float8_e4m3fn).float() * (1.0 / gs)
        else:
            scale = (s.to(torch.int32) << 23).view(torch.float32)
        return (v.view(M, Kb, block) * scale.unsqueeze(-1)).view(M, K).to(out_dtype)

    return deq


def _mx_ops():
    def q_make(shape, dt, f):
        return _rotated(shape, dt, np.dtype(dt).itemsize + 1)

    def nv_make(shape, dt, f):
        sets = _rotated(shape, dt, np.dtype(dt).itemsize + 1)
        g = cupy.asarray([2688.0 / 4.0], dtype=np.float32)  # S_enc for amax ~4 (standard normal data)
        return [(x, g) for (x,) in sets]

    def dq_make(quant, fmt):
        def make(shape, dt, f):
            return [(quant(x),) for (x,) in _rotated(shape, dt, 1 + np.dtype(dt).itemsize)]

        return make

    def dq_to_torch(torch, args):
        (q,) = args
        gs = torch.from_dlpack(q.global_scale) if q.global_scale is not None else None
        return (torch.from_dlpack(q.data), torch.from_dlpack(q.scale), gs, _torch_dtype(torch, q.dtype))

    ops = {}
    for tag, fmt in (("mxfp8_e4m3", "float8_e4m3fn"), ("mxfp8_e5m2", "float8_e5m2"), ("mxfp4", "float4_e2m1fn")):
        nbytes = (lambda fmt: lambda shape, b: _mx_bytes(shape, b, fmt, 32))(fmt)
        for layout in ("dense", "swizzled"):
            sw = layout == "swizzled"
            name = f"{tag}_{'swz' if sw else 'dense'}"
            quant = (lambda fmt, layout: lambda x: cq.quantize_mx(x, fmt, scale_layout=layout))(fmt, layout)
            ops[name] = Op(
                shapes=MX_SHAPES,
                make=q_make,
                ours=quant,
                torch_fn=(lambda fmt, sw: lambda torch, f: _torch_mx(torch, fmt, sw))(fmt, sw),
                io_bytes=nbytes,
                bound_bytes=nbytes,
            )
            ops[name + "_dequant"] = Op(
                shapes=MX_SHAPES,
                make=dq_make(quant, fmt),
                ours=lambda q: q.dequantize(),
                torch_fn=(lambda fmt, sw: lambda torch, f: _torch_mx_dequant(torch, fmt, 32, sw, False))(fmt, sw),
                io_bytes=nbytes,
                bound_bytes=nbytes,
                to_torch=dq_to_torch,
            )
    for layout in ("dense", "swizzled"):
        sw = layout == "swizzled"
        name = f"nvfp4_{'swz' if sw else 'dense'}"
        ops[name] = Op(
            shapes=MX_SHAPES,
            make=nv_make,
            ours=(lambda layout: lambda x, g: cq.quantize_nvfp4(x, global_scale=g, scale_layout=layout))(layout),
            torch_fn=(lambda sw: lambda torch, f: _torch_nvfp4(torch, sw))(sw),
            io_bytes=lambda shape, b: _mx_bytes(shape, b, "float4_e2m1fn", 16),
            bound_bytes=lambda shape, b: _mx_bytes(shape, b, "float4_e2m1fn", 16),
        )
        quant = (lambda layout: lambda x: cq.quantize_nvfp4(x, global_scale=672.0, scale_layout=layout))(layout)
        ops[name + "_dequant"] = Op(
            shapes=MX_SHAPES,
            make=dq_make(quant, "float4_e2m1fn"),
            ours=lambda q: q.dequantize(),
            torch_fn=(lambda sw: lambda torch, f: _torch_mx_dequant(torch, "float4_e2m1fn", 16, sw, True))(sw),
            io_bytes=lambda shape, b: _mx_bytes(shape, b, "float4_e2m1fn", 16),
            bound_bytes=lambda shape, b: _mx_bytes(shape, b, "float4_e2m1fn", 16),
            to_torch=dq_to_torch,
        )
    # dynamic NVFP4: the amax pass reads x a second time; "% bound" counts that read
    ops["nvfp4_dynamic_swz"] = Op(
        shapes=MX_SHAPES,
        make=q_make,
        ours=lambda x: cq.quantize_nvfp4(x),
        torch_fn=None,
        io_bytes=lambda shape, b: _mx_bytes(shape, b, "float4_e2m1fn", 16),
        bound_bytes=lambda shape, b: _mx_bytes(shape, b, "float4_e2m1fn", 16) + _n(shape) * b,
    )
    return ops


def _time_torch(torch, fn, targs_list, reps):
    def record():
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    return _bench.time_events(fn, targs_list, warmup=3, reps=reps, record=record)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="all", help="comma-separated op names, or all")
    p.add_argument("--sizes", default=None, help="comma-separated shape labels to keep (default: each op's own)")
    p.add_argument("--list", action="store_true", help="list the ops and their shapes, then exit")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--format", default="float8_e4m3fn", choices=list(FP8_MAX))
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--no-torch", action="store_true", help="skip the torch peers")
    p.add_argument("--markdown", help="also write the table to this file")
    p.add_argument(
        "--settle",
        type=float,
        default=None,
        help="--matmul, --w8a8: seconds of idle GPU before each timing, so that the clock has recovered from the "
        f"previous heavy burst (0: none; default {bench_matmul.DEFAULT_SETTLE} for --matmul, "
        f"{bench_w8a8.DEFAULT_SETTLE} for --w8a8)",
    )
    m = p.add_argument_group("weight-only matmul (scripts/bench_matmul.py)")
    m.add_argument(
        "--matmul", action="store_true", help="the weight-only matmul against cuBLAS bf16 and dequantize + cuBLAS"
    )
    m.add_argument(
        "--matmul-schemes",
        default=None,
        help=f"comma-separated, of {', '.join(bench_matmul.SCHEMES)} (default {','.join(bench_matmul.DEFAULT_SCHEMES)})",
    )
    m.add_argument(
        "--matmul-ms",
        default=None,
        help=f"rows of a (default {','.join(map(str, bench_matmul.MS))}), or 'decode' for {bench_matmul.DECODE_MS} "
        f"or 'prefill' for {bench_matmul.PREFILL_MS}",
    )
    m.add_argument(
        "--matmul-shapes",
        default=None,
        help="N x K list (default " + ",".join(f"{n}x{k}" for n, k in bench_matmul.SHAPES) + ")",
    )
    m.add_argument(
        "--matmul-budget",
        type=float,
        default=bench_matmul.DEFAULT_BUDGET,
        help="seconds of graph replays per timing (3 to 20 replays)",
    )
    m.add_argument("--matmul-paths", action="store_true", help="also time each scheme but FP8 on each kernel forced")
    m.add_argument("--matmul-no-pdl", action="store_true", help="also time each scheme with pdl=False")
    s = p.add_argument_group("inference shape sweep (scripts/bench_sweep.py)")
    s.add_argument("--sweep", action="store_true", help="the activation quantizers at K x M, next to torch.compile")
    s.add_argument("--sweep-ops", default="all", help=f"comma-separated, of {', '.join(bench_sweep.OPS)}")
    s.add_argument("--sweep-k", default=None, help=f"row lengths (default {','.join(map(str, bench_sweep.KS))})")
    s.add_argument("--sweep-m", default=None, help=f"rows (default {','.join(map(str, bench_sweep.MS))})")
    s.add_argument("--sweep-floor", action="store_true", help="also time each op's bare kernel launches at M = 1")
    s.add_argument("--json", help="--sweep: write every cell to this file")
    s.add_argument(
        "--from-json", help="--sweep: tabulate (and --plot) saved runs (comma-separated) instead of measuring"
    )
    s.add_argument("--plot", help="--sweep: draw GB/s against bytes moved to this image (needs matplotlib)")
    s.add_argument(
        "--plot-ratio", help="--sweep: draw torch.compile's time over ours per cell, coloured, to this image"
    )
    w = p.add_argument_group("W8A8 FP8 and INT8 matmul (scripts/bench_w8a8.py)")
    w.add_argument("--w8a8", action="store_true", help="the W8A8 matmul table against cuBLASLt and cuBLAS bf16")
    w.add_argument("--w8a8-ms", default=None, help=f"rows of a (default {','.join(map(str, bench_w8a8.MS))})")
    w.add_argument(
        "--w8a8-shapes",
        default=None,
        help="N x K list (default " + ",".join(f"{n}x{k}" for n, k in bench_w8a8.SHAPES) + ")",
    )
    w.add_argument("--w8a8-scalings", default="all", help=f"comma-separated, of {', '.join(bench_w8a8.SCALINGS)}")
    w.add_argument(
        "--w8a8-budget",
        type=float,
        default=bench_w8a8.DEFAULT_BUDGET,
        help="seconds of graph replays per timing (3 to 20 replays)",
    )
    w.add_argument("--w8a8-fast-accum", action="store_true", help="torch._scaled_mm with use_fast_accum=True")
    h = p.add_argument_group("host time per call (scripts/bench_host.py)")
    h.add_argument(
        "--host", action="store_true", help="every public op's host time per call against a bare replay of its launches"
    )
    h.add_argument("--host-json", help="--host: write the rows to this file")
    k = p.add_argument_group("FP8 KV-cache write (scripts/bench_kv_cache.py)")
    k.add_argument("--kv-cache", action="store_true", help="quantize_kv_cache against the copy bandwidth and torch")
    k.add_argument(
        "--kv-cache-cases",
        default=None,
        help=f"tokens x heads x head_dim list (default {','.join(bench_kv_cache.SHAPE_LABELS)})",
    )
    n = p.add_argument_group("fused RMSNorm + quantization (scripts/bench_norm.py)")
    n.add_argument("--norm", action="store_true", help="rms_norm_quantize against the unfused pair and torch.compile")
    n.add_argument("--norm-cases", default=None, help=f"M x H list (default {','.join(bench_norm.SHAPE_LABELS)})")
    return p


def main(argv=None):
    a = build_parser().parse_args(argv)
    if a.host:
        return bench_host.main(["--json", a.host_json] if a.host_json else [])
    if a.sweep or a.from_json:
        return bench_sweep.main_sweep(a, sys.modules[__name__])
    if a.w8a8:
        return bench_w8a8.main_w8a8(a, _fmt, _emit, _load_torch)
    if a.kv_cache:
        return bench_kv_cache.main_kv_cache(a, sys.modules[__name__])
    if a.norm:
        return bench_norm.main_norm(a, sys.modules[__name__])
    if a.matmul:
        return bench_matmul.main_matmul(a, _fmt, _emit, _load_torch)
    ops = make_ops(a.format)
    if a.list:
        for name, op in ops.items():
            print(f"{name:18s} " + ", ".join(label for label, _ in op.shapes))
        return

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
    cols = [
        "op",
        "shape",
        "us",
        "GB/s",
        "% copy",
        "% bound",
        "host us",
        "eager us",
        "x eager",
        "compile us",
        "x compile",
    ]
    rows = []
    names = list(ops) if a.ops == "all" else a.ops.split(",")
    keep = None if a.sizes is None else set(a.sizes.split(","))
    for name in names:
        op = ops[name]
        tfn = op.torch_fn(torch, a.format) if torch and op.torch_fn else None
        for label, shape in op.shapes:
            if keep is not None and label not in keep:
                continue
            n = _n(shape)
            # a fresh compile per size, specialized to it (as a serving engine's static shapes)
            tcomp = torch.compile(tfn, dynamic=False) if tfn else None
            args_list = op.make(shape, in_dtype, a.format)
            t = _bench.time_events(op.ours, args_list, reps=a.reps)
            host = _bench.host_seconds_per_call(op.ours, args_list) if n <= (1 << 20) else None
            row = {
                "op": name,
                "shape": label,
                "us": t * 1e6,
                "GB/s": op.io_bytes(shape, b) / t / 1e9,
                "% copy": 100 * op.io_bytes(shape, b) / t / copy_bw,
                "% bound": 100 * op.bound_bytes(shape, b) / copy_bw / t,
                "host us": None if host is None else host * 1e6,
            }
            if tfn:
                to_torch = op.to_torch or (lambda torch, args: tuple(torch.from_dlpack(v) for v in args))
                targs = [to_torch(torch, args) for args in args_list]
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
    _emit(header, table, a.markdown)


def _emit(header, table_lines, markdown):
    """Print the header and markdown table, and write them to ``markdown`` when given."""
    text = header + "\n\n" + "\n".join(table_lines) + "\n"
    print()
    print(text)
    if markdown:
        with open(markdown, "w") as f:
            f.write(text)


def _load_torch(skip):
    if skip:
        return None
    try:
        import torch

        return torch if torch.cuda.is_available() else None
    except ImportError:
        return None


def _raise_compile_limits(torch) -> None:
    """Let torch.compile keep a compiled graph per shape (dynamic=False) without falling back to eager
    after dynamo's default recompile limits."""
    cfg = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, 4096)


def _load_compiling_torch(skip):
    """torch for the peers (None when skipped or unavailable), its compile limits raised."""
    torch = _load_torch(skip)
    if torch is not None:
        _raise_compile_limits(torch)
    return torch


def _run_cases(head, cols, cases, bench_row, markdown, torch) -> None:
    """Print ``head``, time each case (``bench_row(case)`` -> a row dict) and print its row as it
    comes, freeing the memory pools between cases, then print (and write) the markdown table."""
    print(head, flush=True)
    rows = []
    for c in cases:
        row = bench_row(c)
        rows.append(row)
        print("  ".join(f"{k}={_fmt(row.get(k))}" for k in cols), flush=True)
        cupy.get_default_memory_pool().free_all_blocks()
        if torch is not None:
            torch.cuda.empty_cache()
    _emit(head, _table(cols, rows), markdown)


def _table(cols, rows) -> list[str]:
    """A markdown table of ``rows`` (dicts) in ``cols``, cells formatted by _fmt."""
    lines = [f"| {' | '.join(cols)} |", "|" + "---|" * len(cols)]
    return lines + [f"| {' | '.join(_fmt(r.get(k)) for k in cols)} |" for r in rows]


def _fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 1000 else f"{v:.0f}"
    return str(v)


if __name__ == "__main__":
    main()
