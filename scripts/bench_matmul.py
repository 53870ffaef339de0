"""The weight-only matmul table of ``scripts/bench.py --matmul``: :func:`cupyquant.matmul` (bf16
activations; INT4, NVFP4, MXFP4 and FP8 weights) against cuBLAS's bf16 GEMM and against
``dequantize_weight`` followed by that GEMM, on the same bytes.

    python scripts/bench.py --matmul                                  # every shape, M and scheme
    python scripts/bench.py --matmul --matmul-ms 1,64 --matmul-shapes 4096x4096
    python scripts/bench.py --matmul --matmul-ms decode --matmul-schemes int4,nvfp4
    python scripts/bench.py --matmul --list                           # the cells, without a GPU

Schemes (``--matmul-schemes``, the names of :func:`cupyquant.quantize_weight`; the column prefix in
brackets): ``int4`` [INT4] GPTQ/Marlin ``uint4b8`` in groups of 128, ``nvfp4`` [NVFP4] E2M1 with an
E4M3 scale per 16 and a float32 ``scale_2``, ``mxfp4`` [MXFP4] E2M1 with an E8M0 scale per 32,
``float8_e4m3fn`` [FP8] E4M3 in groups of 128, and ``uint4`` [UINT4] (AWQ zero points, groups of 128).
Each weight is quantized from the same bf16 weight (bf16 scales) and prepared once
(:func:`cupyquant.prepare_weight`), as at load time.

Contenders, each a CUDA graph of back-to-back calls that cycle over copies of the weight spanning
4x the L2 (:func:`cupyquant._bench.time_graph`, ``time_torch_graph``), replayed 3 to 20 times
(``--matmul-budget`` seconds of replays), the median replay over its number of calls, ``--settle``
seconds of idle GPU before each timing:

- ours: ``cupyquant.matmul(a, w, out=y)`` on the prepared weight, captured by CuPy.
- cuBLAS: ``torch.matmul(a, w16.t())`` on bf16 weights (rotated over their own copies), captured by
  torch: cuBLAS's bf16 GEMM with float32 accumulation (``at::cuda::blas::gemm``, the GEMM of
  ``torch.nn.Linear`` without bias).
- dequant + cuBLAS: ``cupyquant.dequantize_weight(w, a.dtype, out=buf)`` of the plain weight into
  one (N, K) bf16 buffer that every call reuses, then the same cuBLAS GEMM on that buffer, both in
  one torch graph (the dequantize kernel launched on torch's capture stream, which CuPy takes
  through the CUDA stream protocol): the fallback a planner has for any shape, which the fused
  kernels must never be slower than.

Without torch only our columns are timed (CuPy cannot capture cuBLAS calls in a graph).

Columns: ``cuBLAS bf16 us`` and its ``cuBLAS TFLOP/s`` (2 M N K / t); per scheme our time, the
``path`` :func:`cupyquant.weight.matmul_path` picked, TFLOP/s, ``x cuBLAS`` (cuBLAS's time over ours,
above 1: ours is faster), ``dequant + cuBLAS us`` and ``x dequant`` (its time over ours), and for
M <= 16 ``weight GB/s`` (the prepared weight's codes, scales, zero points and ``scale_2`` over our
time) and ``% copy`` (that rate over the 2 GiB device-to-device copy bandwidth measured at the start
of the run, bytes read plus written). ``--matmul-no-pdl`` adds ``no-PDL us`` (the same calls with
``pdl=False``, on GPUs with programmatic dependent launch), ``--matmul-paths`` each kernel forced
(``decode us``, ``sm80_gemm us``, ``sm90_gemm us`` on compute capability 9.0; not FP8, which has
only the decode kernel). Once per cell our output is compared with the dequant + cuBLAS output; a
difference beyond 1/32 of the largest output is written in ``notes``.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from bench_w8a8 import Errors, agreement, agreement_cell, estimate_seconds, parse_counts, parse_nk, table_lines

#: N x K of the weights: Llama-style attention and MLP projections, 2^24 to 2^28 weights.
SHAPES = [(4096, 4096), (28672, 8192), (4096, 14336), (8192, 8192), (14336, 4096)]
#: Rows of a: decode (1, 16) through prefill.
MS = [1, 16, 32, 64, 128, 256, 1024, 4096]
#: ``--matmul-ms decode`` and ``--matmul-ms prefill``.
DECODE_MS = [1, 2, 4, 8, 16]
PREFILL_MS = [16, 32, 64, 128, 256, 1024, 4096]
#: Rows of a at or below which the table adds the weight-read rate (the weight read bounds the call).
DECODE_M = 16
#: ``_bench.settle``'s pause (its docstring: the clock after a burst at the power cap).
DEFAULT_SETTLE = 0.5
DEFAULT_BUDGET = 0.03
FP8 = "float8_e4m3fn"


@dataclass(frozen=True)
class WeightScheme:
    tag: str  # the column prefix
    what: str  # the header's description
    group_size: int | None = 128  # quantize_weight's group_size; None: the format's own blocks (FP4)
    dtype: str | None = None  # quantize_weight's dtype where the scheme's name is not it
    block_size: tuple | None = None  # quantize_weight's block_size (FP8 in 128 x 128 blocks)


SCHEMES = {
    "int4": WeightScheme("INT4", "INT4 uint4b8 g128"),
    "nvfp4": WeightScheme("NVFP4", "NVFP4 (E4M3 scales per 16)", None),
    "mxfp4": WeightScheme("MXFP4", "MXFP4 (E8M0 scales per 32)", None),
    FP8: WeightScheme("FP8", "FP8 E4M3 g128"),
    "uint4": WeightScheme("UINT4", "INT4 with zero points g128"),
    "fp8_block": WeightScheme("FP8B", "FP8 E4M3 in 128 x 128 blocks", None, FP8, (128, 128)),
}
DEFAULT_SCHEMES = ["int4", "nvfp4", "mxfp4", FP8]
#: The kernels --matmul-paths forces (sm90_gemm only where _device.caps(...).wgmma).
PATHS = ("decode", "sm80_gemm", "sm90_gemm")


def parse_ms(text: str | None) -> list[int]:
    """``"1,16"`` -> [1, 16]; ``"decode"`` -> :data:`DECODE_MS`, ``"prefill"`` -> :data:`PREFILL_MS`,
    None -> :data:`MS`."""
    if text is None:
        return list(MS)
    named = {"decode": DECODE_MS, "prefill": PREFILL_MS}
    return list(named[text]) if text in named else parse_counts(text, "--matmul-ms")


def parse_shapes(text: str | None) -> list[tuple[int, int]]:
    """``"4096x4096,14336x4096"`` -> [(4096, 4096), (14336, 4096)] (N x K); None -> :data:`SHAPES`."""
    return list(SHAPES) if text is None else parse_nk(text, "--matmul-shapes")


def parse_schemes(text: str | None) -> list[str]:
    """``"int4,nvfp4"`` -> ["int4", "nvfp4"]; None or ``"all"`` -> :data:`DEFAULT_SCHEMES`."""
    if text is None or text == "all":
        return list(DEFAULT_SCHEMES)
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in SCHEMES]
    if bad or not names:
        raise ValueError(f"--matmul-schemes takes names from {list(SCHEMES)}, got {text!r}")
    return names


def columns(schemes, torch_peers: bool = True, no_pdl: bool = False, paths=()) -> list[str]:
    """The table's columns, in order (a row missing a value prints "-"): without torch no cuBLAS
    or dequant + cuBLAS columns; ``no_pdl`` adds ``no-PDL us``, ``paths`` (kernel names) a forced
    time per kernel for every scheme but FP8."""
    cols = ["N x K", "M"] + (["cuBLAS bf16 us", "cuBLAS TFLOP/s"] if torch_peers else [])
    for s in schemes:
        t = SCHEMES[s].tag
        cols += [f"{t} us", f"{t} path", f"{t} TFLOP/s"]
        if torch_peers:
            cols += [f"{t} x cuBLAS", f"{t} dequant + cuBLAS us", f"{t} x dequant"]
        cols += [f"{t} weight GB/s", f"{t} % copy"]
        if no_pdl:
            cols.append(f"{t} no-PDL us")
        if s != FP8:
            cols += [f"{t} {p} us" for p in paths]
    return cols + ["notes"]


def cells(shapes, ms):
    """The (N, K, M) cells in the order they run: shape by shape, M ascending within a shape."""
    return [(N, K, M) for N, K in shapes for M in ms]


def timings_per_cell(schemes, torch_peers: bool = True, no_pdl: bool = False, paths=()) -> int:
    """Timings of one cell, each after a settle pause: cuBLAS, then per scheme ours, dequant +
    cuBLAS, no-PDL and the forced kernels."""
    per = 1 + (1 if torch_peers else 0) + (1 if no_pdl else 0)
    return (1 if torch_peers else 0) + sum(per + (0 if s == FP8 else len(paths)) for s in schemes)


def list_cells(shapes, ms, schemes, torch_peers=True, no_pdl=False, paths=(), settle=DEFAULT_SETTLE) -> list[str]:
    """What ``--matmul --list`` prints: the cells, the timings and the settle pauses they cost (no
    GPU needed)."""
    cs = cells(shapes, ms)
    per = timings_per_cell(schemes, torch_peers, no_pdl, paths)
    out = [f"N x K {N}x{K}  M {M}" for N, K, M in cs]
    out.append(
        f"{len(cs)} cells x {per} timings (schemes: {', '.join(schemes)}); "
        f"{len(cs) * per * settle:.0f} s of settle pauses at {settle:g} s"
    )
    return out


def header(device, torch, schemes, settle, copy_bw) -> str:
    what = "; ".join(f"{SCHEMES[s].tag}: {SCHEMES[s].what}" for s in schemes)
    peers = (
        f"peers (torch {torch.__version__}, CUDA graphs): cuBLAS bf16 GEMM (torch.matmul), "
        "dequantize_weight into one bf16 buffer + the same GEMM"
        if torch is not None
        else "torch not available: no cuBLAS columns"
    )
    return (
        f"{device}, {datetime.date.today().isoformat()}; weight-only matmul y = a @ dequant(w).T, bf16 a and y, "
        f"weights prepared; {what}; {peers}; CUDA-graph replay; {settle:g} s idle before each timing; "
        f"copy bandwidth {copy_bw / 1e9:.0f} GB/s"
    )


@dataclass
class Weights:
    """One scheme's copies of a weight: ``plain`` (quantize_weight's layout, what dequantize_weight
    reads without a conversion) and ``prepared`` (the same values, each in its own memory, what
    matmul reads)."""

    plain: list
    prepared: list


@dataclass
class Context:
    """What every cell of a run shares."""

    torch: object  # None: no cuBLAS columns
    timer: object  # _bench.GraphTimer (or a test's stand-in)
    copy_bw: float
    errors: Errors
    no_pdl: bool = False  # time pdl=False too
    paths: tuple = ()  # the kernels to force


def _weights(w, s, errors):
    """:class:`Weights` of scheme ``s`` for the bf16 weight ``w``; the exception when quantizing fails."""
    import cupyquant as cq
    from cupyquant import _bench

    sc = SCHEMES[s]
    kw = ({} if sc.group_size is None else {"group_size": sc.group_size}) | (
        {} if sc.block_size is None else {"block_size": sc.block_size}
    )
    try:
        plain = cq.quantize_weight(w, sc.dtype or s, **kw)
        plains = [plain] + [plain.copy() for _ in range(_bench.copies_for(plain.nbytes) - 1)]
        return Weights(plains, [cq.prepare_weight(p) for p in plains])
    except Exception as e:  # noqa: BLE001 - the table goes on without this scheme
        errors.add(f"{SCHEMES[s].tag}: quantize_weight / prepare_weight", e)
        return e


def _cublas(torch, timer, a, tws, est) -> float:
    """Seconds per call of cuBLAS's bf16 ``a @ w.T`` (torch.matmul) over the rotated bf16 weights
    ``tws`` (torch tensors)."""
    ta = torch.from_dlpack(a)
    return timer.torch_graph(torch, lambda w: torch.matmul(ta, w.t()), [(w,) for w in tws], est)


class _StreamHandle:
    """A raw CUDA stream offered through the CUDA stream protocol, which is how
    ``cupy.cuda.Stream.from_external`` takes a stream CuPy does not own (and never destroys)."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def _on_torch_stream(torch, streams: dict):
    """torch's current stream as a CuPy stream (one object per stream, kept in ``streams``): CuPy's
    launches inside ``with`` it go where torch's next call goes, into torch's graph while it captures."""
    import cupy

    ptr = torch.cuda.current_stream().cuda_stream
    s = streams.get(ptr)
    if s is None:
        s = streams[ptr] = cupy.cuda.Stream.from_external(_StreamHandle(ptr))
    return s


def _dequant_cublas(torch, timer, a, plains, buf, est) -> float:
    """Seconds per call of ``dequantize_weight(w, a.dtype, out=buf)`` then cuBLAS's ``a @ buf.T``
    (torch.matmul), over the rotated plain weights, both in one torch graph."""
    import cupyquant as cq

    ta, tbuf = torch.from_dlpack(a), torch.from_dlpack(buf)
    streams = {}

    def call(w):
        with _on_torch_stream(torch, streams):
            cq.dequantize_weight(w, a.dtype, out=buf)
        return torch.matmul(ta, tbuf.t())

    return timer.torch_graph(torch, call, [(w,) for w in plains], est)


def _vs_dequant(torch, a, w: Weights, buf, y):
    """(ok, ratio) of our output against dequantize + cuBLAS on the first copy (:func:`agreement`)."""
    import cupy

    import cupyquant as cq

    cq.matmul(a, w.prepared[0], out=y)
    cq.dequantize_weight(w.plain[0], a.dtype, out=buf)
    cupy.cuda.get_current_stream().synchronize()
    yt = torch.matmul(torch.from_dlpack(a), torch.from_dlpack(buf).t()).float()
    torch.cuda.synchronize()
    return agreement(y, cupy.from_dlpack(yt))


def scheme_cells(s, w, a, y, buf, t16, ctx: Context, row: dict, notes: list) -> None:
    """Fill ``row``'s columns of scheme ``s`` (its :class:`Weights` ``w``, or the exception that
    made them) for activations ``a`` (M, K), our call writing ``y`` (M, N); ``t16`` is cuBLAS's
    time (None without torch), ``buf`` the (N, K) dequantization buffer."""
    import cupyquant as cq
    from cupyquant import weight as _weight

    tag = SCHEMES[s].tag
    M, K = a.shape
    N = y.shape[1]
    if isinstance(w, Exception):
        row[f"{tag} us"] = "error"
        return
    est = estimate_seconds(M, N, K)
    calls = [(q,) for q in w.prepared]
    try:
        t, note = ctx.timer.ours(lambda q: cq.matmul(a, q, out=y), calls, est)
    except Exception as e:  # noqa: BLE001 - the table goes on
        ctx.errors.add(f"{tag}: matmul", e)
        row[f"{tag} us"] = "error"
        return
    if note:
        notes.append(f"{tag} {note}")
    row[f"{tag} us"] = t * 1e6
    row[f"{tag} path"] = _weight.matmul_path(M, w.prepared[0])
    row[f"{tag} TFLOP/s"] = 2.0 * M * N * K / t / 1e12
    if t16 is not None:
        row[f"{tag} x cuBLAS"] = t16 / t
    if M <= DECODE_M:
        gbs = w.prepared[0].nbytes / t
        row[f"{tag} weight GB/s"] = gbs / 1e9
        row[f"{tag} % copy"] = 100 * gbs / ctx.copy_bw
    if ctx.torch is not None:
        try:
            # the dequantize pass writes what the GEMM reads: about twice a GEMM (replay count only)
            td = _dequant_cublas(ctx.torch, ctx.timer, a, w.plain, buf, 2 * est)
            ok, ratio = _vs_dequant(ctx.torch, a, w, buf, y)
        except Exception as e:  # noqa: BLE001 - the table goes on
            ctx.errors.add(f"{tag}: dequantize_weight + cuBLAS", e)
            row[f"{tag} dequant + cuBLAS us"] = "error"
        else:
            row[f"{tag} dequant + cuBLAS us"] = td * 1e6
            row[f"{tag} x dequant"] = td / t
            if not ok:
                notes.append(f"{tag} {agreement_cell(ok, ratio)} vs dequant")
    extra = [("no-PDL", None)] if ctx.no_pdl else []
    extra += [(path, path) for path in (() if s == FP8 else ctx.paths)]
    for name, path in extra:
        pdl = False if path is None else None
        try:
            with _weight._forced_path(path):  # None: matmul_path decides
                tx, _ = ctx.timer.ours(lambda q: cq.matmul(a, q, out=y, pdl=pdl), calls, est)
        except Exception as e:  # noqa: BLE001 - the table goes on
            ctx.errors.add(f"{tag}: matmul ({name})", e)
            row[f"{tag} {name} us"] = "error"
        else:
            row[f"{tag} {name} us"] = tx * 1e6


def bench_matmul(
    torch,
    shapes,
    ms,
    schemes,
    copy_bw,
    print_row,
    *,
    settle=DEFAULT_SETTLE,
    budget=DEFAULT_BUDGET,
    no_pdl=False,
    paths=(),
):
    """Every (N, K, M) cell of the table (:func:`columns`); returns the rows. ``no_pdl`` is honoured
    where the GPU has PDL, ``paths`` are the kernels to force (the caller drops sm90_gemm where it
    cannot run)."""
    import cupy
    import ml_dtypes
    import numpy as np

    from cupyquant import _bench

    bf16 = ml_dtypes.bfloat16
    ctx = Context(torch, _bench.GraphTimer(settle, budget), copy_bw, Errors(), no_pdl, tuple(paths))
    rows = []
    rng = cupy.random.default_rng(0)
    for N, K in shapes:
        w = (rng.standard_normal((N, K), dtype=np.float32) * 0.02).astype(bf16)
        weights = {s: _weights(w, s, ctx.errors) for s in schemes}
        tws = buf = None
        if torch is not None:  # cuBLAS's own copies of the bf16 weight, and the dequantization buffer
            tws = [torch.from_dlpack(v) for v in [w] + [w.copy() for _ in range(_bench.copies_for(N * K * 2) - 1)]]
            buf = cupy.empty((N, K), bf16)
        for M in ms:
            a = rng.standard_normal((M, K), dtype=np.float32).astype(bf16)
            y = cupy.empty((M, N), bf16)
            row = {"N x K": f"{N}x{K}", "M": M}
            notes = []
            t16 = None
            if torch is not None:
                try:
                    t16 = _cublas(torch, ctx.timer, a, tws, estimate_seconds(M, N, K))
                except Exception as e:  # noqa: BLE001 - the table goes on without the x cuBLAS ratios
                    ctx.errors.add("cuBLAS bf16 (torch.matmul)", e)
                    row["cuBLAS bf16 us"] = "error"
                else:
                    row.update({"cuBLAS bf16 us": t16 * 1e6, "cuBLAS TFLOP/s": 2.0 * M * N * K / t16 / 1e12})
            for s in schemes:
                scheme_cells(s, weights[s], a, y, buf, t16, ctx, row, notes)
            if notes:
                row["notes"] = "; ".join(notes)
            rows.append(row)
            print_row(row)
        del weights, tws, buf, w
        cupy.get_default_memory_pool().free_all_blocks()
        if torch is not None:
            torch.cuda.empty_cache()
    ctx.errors.report()
    return rows


def main_matmul(a, fmt, emit, load_torch) -> None:
    """``scripts/bench.py --matmul``: ``a`` the parsed arguments; ``fmt``, ``emit`` and
    ``load_torch`` bench.py's cell formatter, table writer and torch loader."""
    shapes = parse_shapes(a.matmul_shapes)
    ms = parse_ms(a.matmul_ms)
    schemes = parse_schemes(a.matmul_schemes)
    settle = DEFAULT_SETTLE if a.settle is None else a.settle
    if a.list:
        paths = PATHS if a.matmul_paths else ()
        print("\n".join(list_cells(shapes, ms, schemes, not a.no_torch, a.matmul_no_pdl, paths, settle)))
        return
    import cupy

    from cupyquant import _bench, _device

    torch = load_torch(a.no_torch)
    caps = _device.caps(cupy.cuda.Device().id)
    no_pdl = a.matmul_no_pdl and caps.pdl  # elsewhere pdl=False is what matmul does anyway
    paths = tuple(p for p in PATHS if p != "sm90_gemm" or caps.wgmma) if a.matmul_paths else ()
    copy_bw = _bench.copy_bandwidth()
    head = header(_bench.device_name(), torch, schemes, settle, copy_bw)
    print(head, flush=True)
    cols = columns(schemes, torch is not None, no_pdl, paths)

    def print_row(row):
        print("  ".join(f"{c}={fmt(row.get(c))}" for c in cols if c in row), flush=True)

    rows = bench_matmul(
        torch, shapes, ms, schemes, copy_bw, print_row, settle=settle, budget=a.matmul_budget, no_pdl=no_pdl,
        paths=paths,
    )  # fmt: skip
    if not any("notes" in r for r in rows):
        cols = cols[:-1]
    emit(head, table_lines(cols, rows, fmt), a.markdown)
