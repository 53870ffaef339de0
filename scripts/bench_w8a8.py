"""The W8A8 matmul table of ``scripts/bench.py --w8a8``: :func:`cupyquant.scaled_matmul` against
cuBLASLt (``torch._scaled_mm``) with the same scaling, ``torch._int_mm`` for INT8, and cuBLAS bf16,
on the same bytes.

    python scripts/bench.py --w8a8                                   # every M, shape and scaling
    python scripts/bench.py --w8a8 --w8a8-ms 1,16 --w8a8-shapes 4096x4096,14336x4096
    python scripts/bench.py --w8a8 --w8a8-scalings block --no-torch
    python scripts/bench.py --w8a8 --list                            # the cells, without a GPU

Scalings (``--w8a8-scalings``), each timed with its ``torch._scaled_mm`` counterpart:

- ``tensor``: a = ``quantize_fp8(x)``, b = ``quantize_fp8(w)``; torch: float32 scalars.
- ``token``: a = ``quantize_groupwise(x, group_size=None)`` (per token), b =
  ``quantize_weight(w, "float8_e4m3fn", group_size=None)`` (per channel); torch's row-wise scaling:
  scale_a (M, 1), scale_b (1, N) float32 (b's bf16 scales widened exactly).
- ``block``: a = ``quantize_groupwise(x, group_size=128, scale_layout="col")`` (1 x 128 groups),
  b = ``quantize_weight(w, "float8_e4m3fn", block_size=(128, 128))``; torch's block-wise scaling
  (cuBLASLt, CUDA 12.9+ on compute capability 9.0): scale_a (M, ceil(K/128)) outer-dim-major
  (strides (1, M)), scale_b (ceil(K/128), ceil(N/128)), the transpose of b's row-major
  (ceil(N/128), ceil(K/128)) block scales. A torch that refuses a cell prints "refused" there.
- ``int8``: a = ``quantize_groupwise(x, "int8", group_size=None)`` (per token), b =
  ``quantize_weight(w, "int8", group_size=None)`` (per channel); torch: ``torch._int_mm`` (cuBLAS,
  int32 out) followed by the scaling a user writes, ``(acc.float() * scale_a * scale_b).to(bf16)``
  (``_int_mm`` refuses M <= 16). The ``int8 x token`` column is our FP8 per-token time over our
  INT8 time.

Protocol: each contender's calls captured in one CUDA graph over enough weight copies to span 4x the
L2 (bf16 weights for cuBLAS rotate over their own copies), replayed a few times (``--w8a8-budget``
seconds of replays, 3 to 20), the median replay over its number of calls; ``--settle`` seconds of
idle GPU before each timing (default 0.2 here). Without torch the bf16 column is ``cupy.matmul``
timed as a loop of calls (CuPy cannot capture cuBLAS). Columns per scaling: our time, TFLOP/s
(2 M N K / t), our speed against cuBLAS bf16 and against cuBLASLt with the same scaling (their
time over ours), and for M <= 16 the weight read rate (codes + scales over our time) and its share
of the 2 GiB device-to-device copy bandwidth measured in the same run. "vs torch" compares the two
outputs once per cell: "ok" when max |ours - torch| <= max |torch| / 32, else "DIFF" and the ratio.
"""

from __future__ import annotations

import datetime
import sys
import traceback
from dataclasses import dataclass

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (7168, 2048), (24576, 1536), (2112, 7168), (8192, 8192)]
MS = [1, 16, 64, 128, 512, 2048, 4096, 8192]
#: Rows of a at or below which the table adds the weight-read rate (decode: the weight read bounds it).
DECODE_M = 16
#: Loose agreement bound between ours and torch's output, relative to max |torch's|.
AGREE = 1.0 / 32
#: Rough rates for choosing replay counts only (the H100's bf16 dense rate and HBM3 read rate).
_EST_FLOPS, _EST_BYTES = 400e12, 3.0e12
DEFAULT_SETTLE = 0.2
DEFAULT_BUDGET = 0.03


@dataclass(frozen=True)
class Scaling:
    tag: str  # the column prefix and --w8a8-scalings name
    what: str  # the header's description


SCALINGS = {
    "tensor": Scaling("tensor", "per-tensor x per-tensor"),
    "token": Scaling("token", "per-token x per-channel"),
    "block": Scaling("block", "1x128 groups x 128x128 blocks"),
    "int8": Scaling("int8", "INT8 per-token x per-channel"),
}


def parse_counts(text: str, flag: str) -> list[int]:
    """``"1,16"`` -> [1, 16]: positive row counts, ``flag`` named in the ValueError."""
    parts = [v.strip() for v in text.split(",") if v.strip()]
    ms = [int(v) for v in parts if v.lstrip("-").isdigit()]
    if not ms or len(ms) != len(parts) or min(ms) < 1:
        raise ValueError(f"{flag} must list positive row counts, got {text!r}")
    return ms


def parse_nk(text: str, flag: str) -> list[tuple[int, int]]:
    """``"4096x4096,14336x4096"`` -> [(4096, 4096), (14336, 4096)] (N x K), ``flag`` named in the
    ValueError."""
    shapes = []
    for s in text.split(","):
        parts = s.lower().strip().split("x")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise ValueError(f"{flag} takes N x K pairs such as 4096x4096, got {s!r}")
        shapes.append((int(parts[0]), int(parts[1])))
    return shapes


def parse_ms(text: str | None) -> list[int]:
    """``"1,16"`` -> [1, 16]; None -> :data:`MS`."""
    return list(MS) if text is None else parse_counts(text, "--w8a8-ms")


def parse_shapes(text: str | None) -> list[tuple[int, int]]:
    """``"4096x4096,14336x4096"`` -> [(4096, 4096), (14336, 4096)] (N x K); None -> :data:`SHAPES`."""
    return list(SHAPES) if text is None else parse_nk(text, "--w8a8-shapes")


def parse_scalings(text: str | None) -> list[str]:
    """``"token,block"`` -> ["token", "block"]; None or ``"all"`` -> every scaling."""
    if text is None or text == "all":
        return list(SCALINGS)
    tags = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in tags if t not in SCALINGS]
    if bad or not tags:
        raise ValueError(f"--w8a8-scalings takes names from {list(SCALINGS)}, got {text!r}")
    return tags


def columns(scalings) -> list[str]:
    """The table's columns, in order (every row prints each; a missing value prints "-")."""
    cols = ["N x K", "M", "bf16 us", "bf16 TFLOP/s"]
    for t in scalings:
        cols += [
            f"{t} us",
            f"{t} TFLOP/s",
            f"{t} x bf16",
            f"{t} torch us",
            f"{t} x torch",
            f"{t} vs torch",
            f"{t} weight GB/s",
            f"{t} % copy",
        ]
        if t == "int8" and "token" in scalings:
            cols.append("int8 x token")
    return cols + ["notes"]


def table_lines(cols, rows, fmt) -> list[str]:
    """Markdown lines of ``rows`` (dicts) under ``cols``, each value through ``fmt``."""
    lines = [f"| {' | '.join(cols)} |", "|" + "---|" * len(cols)]
    lines += [f"| {' | '.join(fmt(r.get(c)) for c in cols)} |" for r in rows]
    return lines


def cells(shapes, ms):
    """The (N, K, M) cells in the order they run: shape by shape, M ascending within a shape."""
    return [(N, K, M) for N, K in shapes for M in ms]


def estimate_seconds(M: int, N: int, K: int) -> float:
    """A rough time of one bf16 call (only to pick replay counts): the larger of its FLOPs and its
    weight read at nominal rates, plus a launch."""
    return max(2.0 * M * N * K / _EST_FLOPS, 2.0 * N * K / _EST_BYTES) + 3e-6


def agreement(y, yt):
    """(ok, ratio): ``ratio`` = max |y - yt| / max |yt| (CuPy or NumPy arrays of one shape), ``ok``
    when it is within :data:`AGREE`."""
    import numpy as np

    a = y.astype(np.float32)
    b = yt.astype(np.float32)
    den = float(abs(b).max()) if b.size else 0.0
    num = float(abs(a - b).max()) if b.size else 0.0
    ratio = num / den if den > 0 else (0.0 if num == 0 else float("inf"))
    return ratio <= AGREE, ratio


def agreement_cell(ok: bool, ratio: float) -> str:
    return "ok" if ok else f"DIFF {ratio:.1e}"


def quantize_a(x, tag):
    import cupyquant as cq

    if tag == "tensor":
        return cq.quantize_fp8(x)
    if tag in ("token", "int8"):
        return cq.quantize_groupwise(x, "int8" if tag == "int8" else "float8_e4m3fn", group_size=None)
    return cq.quantize_groupwise(x, "float8_e4m3fn", group_size=128, scale_layout="col")


def quantize_b(w, tag):
    import cupyquant as cq

    if tag == "tensor":
        return cq.quantize_fp8(w)
    if tag in ("token", "int8"):
        return cq.quantize_weight(w, "int8" if tag == "int8" else "float8_e4m3fn", group_size=None)
    return cq.quantize_weight(w, "float8_e4m3fn", block_size=(128, 128))


def _torch_fp8(torch, codes):
    """torch's float8_e4m3fn view of a CuPy uint8 array (the same bytes)."""
    return torch.from_dlpack(codes).view(torch.float8_e4m3fn)


def torch_a(torch, qa, tag):
    """(mat1, scale_a) for ``torch._scaled_mm`` (INT8: ``torch._int_mm``) from our quantized
    activations, the same bytes and scale values; the 1 x 128 scales are re-laid out to torch's (1, M)
    strides where ours pad M to 4."""
    ta = torch.from_dlpack(qa.data) if tag == "int8" else _torch_fp8(torch, qa.data)
    sa = torch.from_dlpack(qa.scale).float()
    if tag == "block" and sa.dim() == 2 and sa.stride() != (1, sa.shape[0]):
        sa = sa.t().contiguous().t()
    return ta, sa


def torch_b(torch, qb, tag):
    """(mat2, [scale_b candidates]) for ``torch._scaled_mm``: mat2 is b's (K, N) column-major view;
    the block scales are offered as the transposed (ceil(N/128), ceil(K/128)) array and, where
    ceil(K/128) is not a multiple of 4, with its rows padded to a multiple of 4 (the two stride
    rules torch versions have checked)."""
    tb = (torch.from_dlpack(qb.data) if tag == "int8" else _torch_fp8(torch, qb.data)).t()
    s = torch.from_dlpack(qb.scale).float()
    N = qb.shape[0]
    if tag == "tensor":
        return tb, [s.reshape(-1)[:1]]
    if tag in ("token", "int8"):
        return tb, [s.reshape(1, N).contiguous()]
    nb, kb = s.shape
    out = [s.contiguous().t()]
    if kb % 4:
        padded = torch.zeros((nb, -(-kb // 4) * 4), dtype=torch.float32, device=s.device)
        padded[:, :kb].copy_(s)
        out.append(padded[:, :kb].t())
    return tb, out


def _scaled_mm(torch, fast_accum):
    def mm(ta, sa, tb, sb):
        if ta.dtype == torch.int8:  # cuBLAS's int32 product, then the scaling as a user writes it
            return (torch._int_mm(ta, tb).float() * sa.reshape(-1, 1) * sb).to(torch.bfloat16)
        return torch._scaled_mm(ta, tb, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)

    return mm


def _probe(mm, ta, sa, tb, candidates):
    """The first scale_b candidate torch accepts and its output, or (None, the refusal's first line)."""
    err = "refused"
    for sb in candidates:
        try:
            return sb, mm(ta, sa, tb, sb)
        except (RuntimeError, ValueError, TypeError) as e:
            err = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
    return None, err


def _cublas_bf16(torch, timer, x, ws, y, est):
    """cuBLAS bf16 ``x @ w.T`` over the rotated bf16 weights: torch.matmul in a CUDA graph, else
    cupy.matmul in a loop."""
    if torch is not None:
        tx = torch.from_dlpack(x)
        tws = [torch.from_dlpack(w) for w in ws]
        return timer.torch_graph(torch, lambda w: torch.matmul(tx, w.t()), [(w,) for w in tws], est)
    import cupy

    try:
        cupy.matmul(x, ws[0].T, out=y)
    except (TypeError, ValueError, NotImplementedError):  # a CuPy without bf16 matmul: no bf16 column
        return None
    return timer.loop(lambda w: cupy.matmul(x, w.T, out=y), [(w,) for w in ws], est)


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:160]}" if text else type(e).__name__


class Errors:
    """Failures of one scaling (quantization, our call, torch's refusal), reported once each on
    stderr at the end while the table goes on: a cell that fails prints "error" or "refused"."""

    def __init__(self):
        self.seen = {}

    def add(self, key, e):
        if key not in self.seen:
            self.seen[key] = e if isinstance(e, str) else first_line(e)
            if not isinstance(e, str):
                traceback.print_exception(e, file=sys.stderr)

    def report(self):
        for key, why in self.seen.items():
            print(f"{key}: {why}", file=sys.stderr)


def _weights(ws, n8, t, torch, errors):
    """(quantized copies, torch operands per copy) of scaling ``t``; (exception, None) when it fails."""
    try:
        qs = [quantize_b(ws[i % len(ws)], t) for i in range(n8)]  # equal values, each in its own memory
    except Exception as e:  # noqa: BLE001 - the table goes on without this scaling
        errors.add(f"{t}: quantizing b", e)
        return e, None
    if torch is None:
        return qs, None
    return qs, [torch_b(torch, q, t) for q in qs]


def _cell(t, x, y, qs, tbs, t16, ctx, row, notes):
    """Fill ``row``'s columns of scaling ``t`` for activations ``x`` (our call writes ``y``)."""
    import cupy

    import cupyquant as cq

    torch, timer, mm, copy_bw, errors = ctx["torch"], ctx["timer"], ctx["mm"], ctx["copy_bw"], ctx["errors"]
    M, N = y.shape
    K = x.shape[1]
    flop = 2.0 * M * N * K
    est = estimate_seconds(M, N, K)
    if isinstance(qs, Exception):
        row[f"{t} us"] = "error"
        return
    try:
        qa = quantize_a(x, t)
        tt, note = timer.ours(lambda q: cq.scaled_matmul(qa, q, out=y), [(q,) for q in qs], est)
    except Exception as e:  # noqa: BLE001 - the table goes on
        errors.add(f"{t}: scaled_matmul", e)
        row[f"{t} us"] = "error"
        return
    if note:
        notes.append(f"{t} {note}")
    row[f"{t} us"] = tt * 1e6
    row[f"{t} TFLOP/s"] = flop / tt / 1e12
    row[f"{t} x bf16"] = None if t16 is None else t16 / tt
    if M <= DECODE_M:
        gbs = qs[0].nbytes / tt
        row[f"{t} weight GB/s"] = gbs / 1e9
        row[f"{t} % copy"] = 100 * gbs / copy_bw
    if torch is None:
        return
    ta, sa = torch_a(torch, qa, t)
    tb0, cands = tbs[0]
    sb0, yt = _probe(mm, ta, sa, tb0, cands)
    if sb0 is None:
        row[f"{t} torch us"] = "refused"
        errors.add(f"torch._scaled_mm refused {t} scaling", yt)
        return
    pick = next(i for i, c in enumerate(cands) if c is sb0)
    ok, ratio = agreement(y, cupy.from_dlpack(yt.float()))
    row[f"{t} vs torch"] = agreement_cell(ok, ratio)
    del yt
    targs = [(tb, cs[pick]) for tb, cs in tbs]
    try:
        tp = timer.torch_graph(torch, lambda tb, sb: mm(ta, sa, tb, sb), targs, est)
    except Exception as e:  # noqa: BLE001 - accepted eagerly but not in a graph: the table goes on
        errors.add(f"torch._scaled_mm {t} in a CUDA graph", e)
        row[f"{t} torch us"] = "error"
        return
    row[f"{t} torch us"] = tp * 1e6
    row[f"{t} x torch"] = tp / tt


def _int8_vs_token(row):
    """Our FP8 per-token time over our INT8 time, where the row has both."""
    tok, i8 = row.get("token us"), row.get("int8 us")
    if isinstance(tok, float) and isinstance(i8, float):
        row["int8 x token"] = tok / i8


def bench_w8a8(
    torch, shapes, ms, scalings, copy_bw, print_row, settle=DEFAULT_SETTLE, budget=DEFAULT_BUDGET, fast_accum=False
):
    """Every (N, K, M) cell of the table (:func:`columns`); returns the rows."""
    import cupy
    import ml_dtypes
    import numpy as np

    from cupyquant import _bench

    bf16 = ml_dtypes.bfloat16
    errors = Errors()
    ctx = {
        "torch": torch,
        "timer": _bench.GraphTimer(settle, budget),
        "mm": _scaled_mm(torch, fast_accum) if torch is not None else None,
        "copy_bw": copy_bw,
        "errors": errors,
    }
    rows = []
    rng = cupy.random.default_rng(0)
    for N, K in shapes:
        w = rng.standard_normal((N, K), dtype=np.float32).astype(bf16)
        ws = [w] + [w.copy() for _ in range(_bench.copies_for(N * K * 2) - 1)]
        n8 = _bench.copies_for(N * K)
        weights = {t: _weights(ws, n8, t, torch, errors) for t in scalings}
        for M in ms:
            x = rng.standard_normal((M, K), dtype=np.float32).astype(bf16)
            y = cupy.empty((M, N), bf16)
            t16 = _cublas_bf16(torch, ctx["timer"], x, ws, y, estimate_seconds(M, N, K))
            row = {"N x K": f"{N}x{K}", "M": M}
            notes = []
            if t16 is None:
                notes.append("cupy.matmul has no bf16 GEMM")
            else:
                row.update({"bf16 us": t16 * 1e6, "bf16 TFLOP/s": 2.0 * M * N * K / t16 / 1e12})
            for t in scalings:
                qs, tbs = weights[t]
                _cell(t, x, y, qs, tbs, t16, ctx, row, notes)
            _int8_vs_token(row)
            if notes:
                row["notes"] = "; ".join(notes)
            rows.append(row)
            print_row(row)
        del weights, ws
        cupy.get_default_memory_pool().free_all_blocks()
        if torch is not None:
            torch.cuda.empty_cache()
    errors.report()
    return rows


def header(device, torch, scalings, settle, fast_accum, copy_bw) -> str:
    peers = (
        f"peers: cuBLAS bf16 (torch.matmul, CUDA graph) and torch {torch.__version__} _scaled_mm "
        f"(cuBLASLt, use_fast_accum={fast_accum}) and _int_mm (cuBLAS, INT8, then torch's scaling)"
        if torch is not None
        else "peers: cuBLAS bf16 (cupy.matmul, a loop of calls); torch not available"
    )
    what = "; ".join(f"{t}: {SCALINGS[t].what}" for t in scalings)
    return (
        f"{device}, {datetime.date.today().isoformat()}; W8A8 matmul y = a @ b.T (FP8 e4m3, INT8), bf16 out; {what}; "
        f"{peers}; CUDA-graph replay; {settle:g} s idle before each timing; copy bandwidth {copy_bw / 1e9:.0f} GB/s"
    )


def list_cells(shapes, ms, scalings, torch_peers=True) -> list[str]:
    """What ``--w8a8 --list`` prints: the cells and the number of timings (no GPU needed)."""
    cs = cells(shapes, ms)
    per_cell = 1 + len(scalings) * (2 if torch_peers else 1)
    out = [f"N x K {N}x{K}  M {M}" for N, K, M in cs]
    out.append(f"{len(cs)} cells x {per_cell} timings (scalings: {', '.join(scalings)})")
    return out


def main_w8a8(a, fmt, emit, load_torch) -> None:
    """``scripts/bench.py --w8a8``: ``a`` the parsed arguments; ``fmt``, ``emit`` and ``load_torch``
    bench.py's cell formatter, table writer and torch loader."""
    shapes = parse_shapes(a.w8a8_shapes)
    ms = parse_ms(a.w8a8_ms)
    scalings = parse_scalings(a.w8a8_scalings)
    if a.list:
        print("\n".join(list_cells(shapes, ms, scalings, not a.no_torch)))
        return
    from cupyquant import _bench

    settle = DEFAULT_SETTLE if a.settle is None else a.settle
    torch = load_torch(a.no_torch)
    copy_bw = _bench.copy_bandwidth()
    head = header(_bench.device_name(), torch, scalings, settle, a.w8a8_fast_accum, copy_bw)
    print(head, flush=True)
    cols = columns(scalings)

    def print_row(row):
        print("  ".join(f"{c}={fmt(row.get(c))}" for c in cols if c in row), flush=True)

    rows = bench_w8a8(
        torch,
        shapes,
        ms,
        scalings,
        copy_bw,
        print_row,
        settle=settle,
        budget=a.w8a8_budget,
        fast_accum=a.w8a8_fast_accum,
    )
    if not any("notes" in r for r in rows):
        cols = cols[:-1]
    emit(head, table_lines(cols, rows, fmt), a.markdown)
