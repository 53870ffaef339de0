"""The inference shape sweep of ``scripts/bench.py --sweep``: the activation quantizers and their
dequantization at the shapes an engine feeds them, next to ``torch.compile`` of the same formula.

Shapes: K (the row length) in :data:`KS` by M (tokens) in :data:`MS`, bfloat16 input. Ops
(:data:`OPS`): per-token FP8 and INT8, group-128 FP8 with float32 scales in the ``"row"`` and
``"col"`` layouts and with packed UE8M0 scales (``"col"``, DeepGEMM's SM100 layout), SiLU*Mul +
group-128 (K outputs from 2K inputs), MXFP8 E4M3 and NVFP4 (swizzled scales, NVFP4 with a given
global scale), and the dequantization of per-token, group-128, MXFP8 and NVFP4 results to bf16.

Each cell reports:

- ``us``: device time per call. The calls (inputs rotated over enough copies to span 4x the L2, at
  most 64) are captured in one CUDA graph of at least 64 calls, replayed, and the replay time is
  divided by the calls, so that no host time leaks in;
- ``GB/s`` and ``% copy``: input read once and outputs written once, over ``us``, and against the
  copy bandwidth measured in the same run;
- ``host us``: the wall time of one eager call on the host, from a loop of asynchronous calls (what
  an eager user pays per call; the GPU work runs behind it);
- ``compile us`` and ``x compile``: the same formula in torch ops, ``torch.compile(dynamic=False)``
  compiled for the cell's shape (dynamo's recompile limit raised, so that no shape falls back to
  eager), timed the same way; ``x compile`` is its time over ours.

``--sweep-floor`` adds, per op at M = 1, the host time of a bare launch: the op's own kernels,
recorded from one call, launched again through ``cupy.RawKernel`` with the same arguments, plus one
``cupy.empty`` per output array (scripts/bench_host.py, which does this for every public op). That
is the floor CuPy allows an op; ``host us`` is measured against it.

``--json`` keeps every cell, and ``--plot sweep.png`` (matplotlib, the ``bench`` extra) draws,
per op, GB/s against bytes moved for ours and ``torch.compile`` with the copy bandwidth as a line;
``--plot`` with ``--from-json`` draws a saved run without a GPU.
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

KS = (2048, 4096, 7168, 8192, 16384)
MS = (1, 16, 128, 1024, 4096, 16384)
#: calls captured in one graph: enough to hide the replay's own launch at M = 1
MIN_CALLS = 64
MAX_COPIES = 64
FP8_E4M3 = "float8_e4m3fn"


@dataclass(frozen=True)
class SweepOp:
    """One op of the sweep: how to make its inputs from a bf16 (M, K_in) matrix, run it, run the
    torch formula, and count the bytes it must move."""

    name: str
    width: int  # input columns per output column (2 for SiLU*Mul)
    ours: Callable  # (cq, x) -> result; x is (M, width * K)
    torch_fn: Callable  # (torch, B) -> f(*torch arguments), B the scripts/bench.py module
    out_bytes: Callable  # (M, K) -> bytes written
    prepare: Callable | None = None  # (cq, x) -> the argument of ours/torch (a dequantizer's input)
    to_torch: Callable | None = None  # (torch, prepared) -> torch arguments


_GLOBAL = 2688.0 / 4.0  # NVFP4's S_enc for amax about 4 (standard normal data)


# torch formulas: those of scripts/bench.py (B), each (torch, B) -> f(*torch arguments)
def _t_group(group, col=False, pow2=False, fmt=FP8_E4M3):
    return lambda torch, B: B._torch_group(torch, fmt, group, pow2, col)


def _t_silu(torch, B):
    return B._torch_silu(torch, FP8_E4M3)


def _t_mxfp8(torch, B):
    return B._torch_mx(torch, FP8_E4M3, True)


def _t_nvfp4(torch, B):
    f = B._torch_nvfp4(torch, True)
    return lambda x: f(x, _GLOBAL)


def _t_group_dequant(group):
    def make(torch, B):
        f = B._torch_group_dequant(torch, group)
        return lambda q, s, _gs: f(q, s, torch.bfloat16)

    return make


def _t_block_dequant(fmt, block, nv):
    def make(torch, B):
        f = B._torch_mx_dequant(torch, fmt, block, True, nv)
        return lambda q, s, gs: f(q, s, gs, torch.bfloat16)

    return make


def _dequant_args(torch, q):
    """A QuantizedTensor as the torch formulas take it: the element bytes (FP8 and INT8 viewed as
    their torch dtype), the scales, and NVFP4's global scale (None otherwise)."""
    tq = torch.from_dlpack(q.data)
    if q.scheme.format == "int8":
        tq = tq.view(torch.int8)
    gs = None if q.global_scale is None else torch.from_dlpack(q.global_scale)
    return (tq, torch.from_dlpack(q.scale), gs)


def _token(fmt):
    return lambda cq, x: cq.quantize_groupwise(x, fmt, group_size=None)


def _group(layout="row", sdt="float32"):
    return lambda cq, x: cq.quantize_groupwise(x, FP8_E4M3, group_size=128, scale_layout=layout, scale_dtype=sdt)


def _mxfp8(cq, x):
    return cq.quantize_mx(x, FP8_E4M3, scale_layout="swizzled")


def _nvfp4(cq, x):
    return cq.quantize_nvfp4(x, global_scale=_GLOBAL, scale_layout="swizzled")


def _pad(n, m):
    return -(-n // m) * m


def _mx_scale_bytes(M, K, block):
    return _pad(M, 128) * _pad(K // block, 4)


OPS = {
    o.name: o
    for o in (
        SweepOp("token_fp8", 1, _token(FP8_E4M3), _t_group(None), lambda M, K: M * K + 4 * M),
        SweepOp("token_int8", 1, _token("int8"), _t_group(None, fmt="int8"), lambda M, K: M * K + 4 * M),
        SweepOp("group128", 1, _group(), _t_group(128), lambda M, K: M * K + M * K // 32),
        SweepOp("group128_col", 1, _group("col"), _t_group(128, col=True), lambda M, K: M * K + _pad(M, 4) * K // 32),
        SweepOp(
            "group128_ue8m0",
            1,
            _group("col", "float8_e8m0fnu"),
            _t_group(128, col=True, pow2=True),
            lambda M, K: M * K + _pad(M, 4) * _pad(K // 128, 4),
        ),
        SweepOp(
            "silu_group128",
            2,
            lambda cq, x: cq.silu_mul_quantize(x, FP8_E4M3, group_size=128),
            _t_silu,
            lambda M, K: M * K + M * K // 32,
        ),
        SweepOp("mxfp8", 1, _mxfp8, _t_mxfp8, lambda M, K: M * K + _mx_scale_bytes(M, K, 32)),
        SweepOp("nvfp4", 1, _nvfp4, _t_nvfp4, lambda M, K: M * K // 2 + _mx_scale_bytes(M, K, 16)),
        SweepOp(
            "token_fp8_dequant",
            1,
            lambda cq, q: q.dequantize(),
            _t_group_dequant(None),
            lambda M, K: 2 * M * K,
            prepare=_token(FP8_E4M3),
            to_torch=_dequant_args,
        ),
        SweepOp(
            "group128_dequant",
            1,
            lambda cq, q: q.dequantize(),
            _t_group_dequant(128),
            lambda M, K: 2 * M * K,
            prepare=_group(),
            to_torch=_dequant_args,
        ),
        SweepOp(
            "mxfp8_dequant",
            1,
            lambda cq, q: q.dequantize(),
            _t_block_dequant(FP8_E4M3, 32, False),
            lambda M, K: 2 * M * K,
            prepare=_mxfp8,
            to_torch=_dequant_args,
        ),
        SweepOp(
            "nvfp4_dequant",
            1,
            lambda cq, q: q.dequantize(),
            _t_block_dequant("float4_e2m1fn", 16, True),
            lambda M, K: 2 * M * K,
            prepare=_nvfp4,
            to_torch=_dequant_args,
        ),
    )
}


def in_bytes(op: SweepOp, M: int, K: int) -> int:
    """Bytes an op reads once: bf16 x, or for a dequantizer the quantized data and its scales."""
    if op.prepare is None:
        return 2 * op.width * M * K
    return OPS[op.name.removesuffix("_dequant")].out_bytes(M, K)


def io_bytes(op: SweepOp, M: int, K: int) -> int:
    return in_bytes(op, M, K) + op.out_bytes(M, K)


def host_and_floor(cq, bench, fn, args, rounds: int = 7, calls: int = 300) -> tuple:
    """Host seconds per call of ``fn(*args)`` and of its bare launches (bench_host.bare_replay: its
    recorded kernels through ``cupy.RawKernel`` with the same arguments, and ``cupy.empty`` of each
    output it returns), in alternating loops, the least of ``rounds`` each: the host's clock moves by
    up to 2x between loops a second apart, so the two are only compared when measured side by side."""
    import bench_host

    bare_replay = bench_host.bare_replay(lambda: fn(*args))
    ours = floor = float("inf")
    for _ in range(rounds):
        ours = min(ours, bench.host_seconds_per_call(fn, [args], calls=calls, rounds=1))
        floor = min(floor, bench.host_seconds_per_call(bare_replay, [()], calls=calls, rounds=1))
    return ours, floor


def run(cq, bench, torch, B, ops, ks, ms, reps: int, floor: bool, log=print, save=None) -> dict:
    """Every cell of ``ops`` x ``ks`` x ``ms``; returns the run as a JSON-ready dict, also given to
    ``save`` after each cell (so that a run cut short keeps what it measured)."""
    import cupy
    import ml_dtypes

    copy_bw = bench.copy_bandwidth()
    if torch is not None:
        B._raise_compile_limits(torch)
    cells, floors = [], {}
    result = {
        "device": bench.device_name(),
        "date": datetime.date.today().isoformat(),
        "copy_gbps": copy_bw / 1e9,
        "torch": None if torch is None else torch.__version__,
        "cells": cells,
        "floor_us": floors,
    }
    rng = cupy.random.default_rng(0)
    for name in ops:
        op = OPS[name]
        tmake = op.torch_fn(torch, B) if torch is not None else None
        for K in ks:
            for M in ms:
                copies = min(MAX_COPIES, bench.copies_for(io_bytes(op, M, K)))
                xs = [
                    rng.standard_normal((M, op.width * K), dtype=np.float32).astype(ml_dtypes.bfloat16)
                    for _ in range(copies)
                ]
                args = [(op.prepare(cq, x) if op.prepare else x,) for x in xs]
                calls = [args[i % copies] for i in range(max(MIN_CALLS, copies))]
                t = bench.time_graph(lambda a: op.ours(cq, a), calls, reps)
                if floor and M == 1:  # ours and the bare launches side by side
                    host, bare = host_and_floor(cq, bench, lambda a: op.ours(cq, a), args[0])
                    floors.setdefault(name, {})[K] = bare * 1e6
                else:
                    host = bench.host_seconds_per_call(lambda a: op.ours(cq, a), args, calls=200)
                cell = {"op": name, "M": M, "K": K, "bytes": io_bytes(op, M, K), "us": t * 1e6, "host_us": host * 1e6}
                cell["gbps"] = cell["bytes"] / t / 1e9
                cell["pct_copy"] = 100 * cell["bytes"] / t / copy_bw
                if tmake is not None:
                    to_torch = op.to_torch or (lambda torch, a: (torch.from_dlpack(a),))
                    targs = [to_torch(torch, a) for (a,) in args]
                    tcalls = [targs[i % copies] for i in range(max(MIN_CALLS, copies))]
                    t0 = time.perf_counter()
                    comp = torch.compile(tmake, dynamic=False)
                    comp(*targs[0])
                    compile_s = time.perf_counter() - t0
                    tc = bench.time_torch_graph(torch, comp, tcalls, reps)
                    cell.update(
                        compile_us=tc * 1e6,
                        x_compile=tc / t,
                        compile_host_us=bench.host_seconds_per_call(lambda *a: comp(*a), targs, calls=200) * 1e6,
                        compile_s=compile_s,
                    )
                    del targs, tcalls, comp
                cells.append(cell)
                log(_line(cell))
                if save is not None:
                    save(result)
                del xs, args, calls
                cupy.get_default_memory_pool().free_all_blocks()
                if torch is not None:
                    torch.cuda.empty_cache()
    return result


def _f(v, nd=1):
    return "-" if v is None else f"{v:.{nd}f}"


def _line(c) -> str:
    return (
        f"{c['op']:18s} M={c['M']:<6d} K={c['K']:<6d} us={_f(c['us'], 2)} %copy={_f(c['pct_copy'])} "
        f"host={_f(c['host_us'])} compile_us={_f(c.get('compile_us'), 2)} x={_f(c.get('x_compile'), 2)}"
    )


def markdown(run_: dict) -> str:
    """The run as tables: per op, M down and K across, each cell ``us / % copy / x compile``; then
    host time per call at M = 1, with the bare launches' in parentheses where measured."""
    cells = run_["cells"]
    ks = sorted({c["K"] for c in cells})
    out = []
    by = {(c["op"], c["M"], c["K"]): c for c in cells}
    ops = list(dict.fromkeys(c["op"] for c in cells))
    out.append("| op | M | " + " | ".join(f"K = {k}" for k in ks) + " |")
    out.append("|---|---|" + "---|" * len(ks))
    for op in ops:
        for M in sorted({c["M"] for c in cells if c["op"] == op}):
            row = []
            for k in ks:
                c = by.get((op, M, k))
                if c is None:
                    row.append("-")
                    continue
                x = c.get("x_compile")
                row.append(f"{_f(c['us'], 1)} / {c['pct_copy']:.0f}%" + ("" if x is None else f" / {x:.2f}x"))
            out.append(f"| {op} | {M} | " + " | ".join(row) + " |")
    floors = run_.get("floor_us") or {}
    if any(c["M"] == 1 for c in cells):
        out += ["", "| op (host us, M = 1) | " + " | ".join(f"K = {k}" for k in ks) + " |"]
        out.append("|---|" + "---|" * len(ks))
        for op in ops:
            row = []
            for k in ks:
                c, bare = by.get((op, 1, k)), (floors.get(op) or {}).get(str(k), (floors.get(op) or {}).get(k))
                row.append("-" if c is None else _f(c["host_us"]) + ("" if bare is None else f" ({_f(bare)})"))
            out.append(f"| {op} | " + " | ".join(row) + " |")
    return "\n".join(out) + "\n"


def plot(run_: dict, path: str) -> None:
    """Per op, GB/s against bytes moved, ours and torch.compile, the copy bandwidth as a line."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'cupyquant[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = run_["cells"]
    ops = list(dict.fromkeys(c["op"] for c in cells))
    cols = 4
    rows = -(-len(ops) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False, sharey=True)
    for ax, op in zip(axes.flat, ops):
        mine = sorted((c for c in cells if c["op"] == op), key=lambda c: c["bytes"])
        x = [c["bytes"] for c in mine]
        ax.plot(x, [c["gbps"] for c in mine], "o", ms=3, label="cupyquant")
        tc = [(c["bytes"], c["bytes"] / c["compile_us"] / 1e3) for c in mine if c.get("compile_us")]
        if tc:
            ax.plot(*zip(*tc), "x", ms=3, label="torch.compile")
        ax.axhline(run_["copy_gbps"], color="gray", lw=1, ls="--", label="copy")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(op, fontsize=9)
        ax.grid(True, which="both", lw=0.3)
    for ax in list(axes.flat)[len(ops) :]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("GB/s")
    for ax in axes[-1, :]:
        ax.set_xlabel("bytes moved")
    axes.flat[0].legend(fontsize=7)
    ks = tuple(sorted({c["K"] for c in cells}))
    ms = tuple(sorted({c["M"] for c in cells}))
    fig.suptitle(f"{run_['device']}, {run_['date']}: bf16 rows of K in {ks}, M in {ms}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


#: A ratio to torch.compile below this is a tie (the sweep's repeat-to-repeat spread at short cells).
TIE = 1.02


def behind(run_: dict, below: float = TIE) -> list:
    """The cells whose time over torch.compile's is under ``below``, as markdown table lines (op, M,
    K, ours and torch.compile's us, the ratio, % of copy), slowest first; no lines without torch."""
    slow = sorted((c for c in run_["cells"] if c.get("x_compile") is not None and c["x_compile"] < below),
                  key=lambda c: c["x_compile"])  # fmt: skip
    if not slow:
        return []
    out = ["| op | M | K | us | torch.compile us | x compile | % copy |", "|---|---|---|---|---|---|---|"]
    for c in slow:
        out.append(
            f"| {c['op']} | {c['M']} | {c['K']} | {_f(c['us'], 2)} | {_f(c['compile_us'], 2)} | "
            f"{c['x_compile']:.2f} | {c['pct_copy']:.0f}% |"
        )
    return out


def plot_ratio(run_: dict, path: str) -> None:
    """Per op, a grid of M (down) by K (across) whose cells are coloured by torch.compile's time over
    ours (green ahead, red behind, yellow a tie at 1.0) and labelled with the ratio."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot-ratio needs matplotlib: pip install 'cupyquant[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    cells = [c for c in run_["cells"] if c.get("x_compile") is not None]
    if not cells:
        raise SystemExit("--plot-ratio needs a run with torch.compile's timings")
    ops = list(dict.fromkeys(c["op"] for c in cells))
    ks = sorted({c["K"] for c in cells})
    ms = sorted({c["M"] for c in cells})
    by = {(c["op"], c["M"], c["K"]): c["x_compile"] for c in cells}
    norm = TwoSlopeNorm(vmin=0.5, vcenter=1.0, vmax=2.0)  # 2x and more: the deepest green
    cols = 4
    rows = -(-len(ops) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 0.42 * len(ms) * rows + 1.2 * rows), squeeze=False)
    for ax, op in zip(axes.flat, ops):
        grid = [[by.get((op, M, K), float("nan")) for K in ks] for M in ms]
        ax.imshow(grid, cmap="RdYlGn", norm=norm, aspect="auto")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if v == v:
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, weight="bold" if v < TIE else None)
        ax.set_xticks(range(len(ks)), [str(k) for k in ks], fontsize=7)
        ax.set_yticks(range(len(ms)), [str(m) for m in ms], fontsize=7)
        ax.set_title(op, fontsize=9)
    for ax in list(axes.flat)[len(ops) :]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("M", fontsize=8)
    for ax in axes[-1, :]:
        ax.set_xlabel("K", fontsize=8)
    fig.suptitle(
        f"{run_['device']}, {run_['date']}: torch.compile's time over cupyquant's (> 1: cupyquant faster; "
        f"bold: under {TIE})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def join(runs: list) -> dict:
    """Saved runs as one: the first run's header, every cell, a later run's cell replacing an
    earlier one of the same op, M and K (a rerun of some cells), and the same for the host timings
    of a later run that measured them (its ``host_us`` and bare launches)."""
    cells: dict = {}
    floors: dict = {}
    for r in runs:
        for c in r["cells"]:
            key = (c["op"], c["M"], c["K"])
            cells[key] = dict(cells.get(key, {}), **c)
        for op, per_k in (r.get("floor_us") or {}).items():
            floors.setdefault(op, {}).update({str(k): v for k, v in per_k.items()})
    return dict(runs[0], cells=list(cells.values()), floor_us=floors)


def main_sweep(a, B):
    """``scripts/bench.py --sweep`` (and ``--plot`` / ``--from-json``); ``B`` is the bench module,
    whose torch formulas, torch loader and table printer the sweep uses."""
    if a.from_json:
        runs = []
        for path in a.from_json.split(","):
            with open(path) as f:
                runs.append(json.load(f))
        run_ = join(runs)
    else:
        import cupyquant as cq
        from cupyquant import _bench

        ops = list(OPS) if a.sweep_ops == "all" else a.sweep_ops.split(",")
        unknown = [o for o in ops if o not in OPS]
        if unknown:
            raise SystemExit(f"unknown sweep ops {unknown}; the ops are {list(OPS)}")
        ks = KS if a.sweep_k is None else tuple(int(v) for v in a.sweep_k.split(","))
        ms = MS if a.sweep_m is None else tuple(int(v) for v in a.sweep_m.split(","))

        def save(r):
            with open(a.json, "w") as f:
                json.dump(r, f, indent=1)

        run_ = run(
            cq, _bench, B._load_torch(a.no_torch), B, ops, ks, ms, a.reps, a.sweep_floor, save=save if a.json else None
        )
    header = (
        f"{run_['device']}, {run_['date']}; copy bandwidth {run_['copy_gbps']:.0f} GB/s; bf16 input; "
        "cell: device us per call (CUDA graph) / % copy" + (" / x torch.compile" if run_.get("torch") else "")
    )
    lines = markdown(run_).splitlines()
    slow = behind(run_)
    if slow:
        lines += ["", f"Cells under {TIE}x torch.compile:", "", *slow]
    B._emit(header, lines, a.markdown)
    if a.plot:
        plot(run_, a.plot)
    if a.plot_ratio:
        plot_ratio(run_, a.plot_ratio)
