"""The FP8 KV-cache write table of ``scripts/bench.py --kv-cache``: :func:`cupyquant.quantize_kv_cache`
against the copy bandwidth and against the same formula in torch.

    python scripts/bench.py --kv-cache                         # every case
    python scripts/bench.py --kv-cache --kv-cache-cases 4096x8x128 --no-torch
    python scripts/bench.py --kv-cache --list                  # the cases, without a GPU

Each case is ``tokens x heads x head_dim``, bf16 keys and values as strided views of a fused qkv
(``4 * heads`` query heads before them, as in a grouped-query model), a cache of ``block_size`` 16
with four times the slots the step needs, the step's tokens sent to a random permutation of them. Modes:
``static`` (one float decode scale per tensor) and ``dynamic`` (one scale per token and head,
written to the scale caches), layout "NHD" unless the row says "HND".

Protocol: each contender's calls captured in one CUDA graph over enough input and cache copies to
span 4x the L2, replayed ``--reps`` times; the median replay over its number of calls. Bytes: keys
and values read once, the slot mapping read once, cache bytes (and scales) written once; "% copy"
is the rate over the 2 GiB device-to-device copy bandwidth measured in the same run; "copy us" is a
copy of the same bytes (half read, half written) timed the same way, the ceiling at this size, and
"% of it" our share of it. Host time:
Python per call of ours (a loop of calls). torch: ``kc[slot // 16, slot % 16] = fp8(clamp(x / s))``
on uint8 views (index_put), eager and ``torch.compile(dynamic=False)`` (eager alone where compiling
fails); "x eager" / "x compile" are their times over ours. "torch" compares torch eager's caches
with ours once per row: "ok" when every byte agrees.
"""

from __future__ import annotations

import datetime
import traceback
from dataclasses import dataclass

BLOCK_SIZE = 16
#: The cache holds this many times the slots a step writes, so that the writes land scattered.
CACHE_FACTOR = 4
#: Query heads per KV head in the fused qkv the keys and values are views of.
Q_PER_KV = 4
MIN_CALLS = 8
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


@dataclass(frozen=True)
class Case:
    tokens: int
    heads: int
    head_dim: int
    mode: str  # "static" or "dynamic"
    kv_layout: str = "NHD"

    @property
    def label(self) -> str:
        return f"{self.tokens}x{self.heads}x{self.head_dim}"


#: tokens x heads x head_dim: a 4096-token prefill of an 8-KV-head model (Llama-3-8B), a decode
#: step of 256 sequences, a 16384-token prefill, and 32 heads of 128 (multi-head attention)
SHAPES = [(4096, 8, 128), (256, 8, 128), (16384, 8, 128), (4096, 32, 128)]
CASES = [Case(*s, mode) for s in SHAPES for mode in ("static", "dynamic")] + [Case(4096, 8, 128, "static", "HND")]
SHAPE_LABELS = tuple("x".join(map(str, s)) for s in SHAPES)


def parse_cases(text: str | None) -> list[Case]:
    """``"4096x8x128,256x8x128"`` -> the cases of those shapes; None -> :data:`CASES`."""
    if text is None:
        return list(CASES)
    keep = {s.strip() for s in text.split(",") if s.strip()}
    cases = [c for c in CASES if c.label in keep]
    unknown = keep - {c.label for c in CASES}
    for label in sorted(unknown):
        t, h, d = (int(v) for v in label.lower().split("x"))
        cases += [Case(t, h, d, "static"), Case(t, h, d, "dynamic")]
    return cases


def io_bytes(c: Case, itemsize: int = 2) -> int:
    """Keys and values read, the int64 slot mapping read, cache bytes (and float32 scales) written."""
    n = c.tokens * c.heads * c.head_dim
    scales = 2 * c.tokens * c.heads * 4 if c.mode == "dynamic" else 0
    return 2 * n * itemsize + c.tokens * 8 + 2 * n + scales


def columns(torch: bool) -> list[str]:
    cols = ["case", "mode", "layout", "us", "GB/s", "% copy", "copy us", "% of it", "host us"]
    return cols + (["eager us", "x eager", "compile us", "x compile", "torch"] if torch else [])


def _torch_write(torch, fmt: str, mode: str, block_size: int):
    """The write in torch ops (NHD caches as uint8): ``q = fp8(clamp(x / s))``, index_put at
    (slot // block_size, slot % block_size); dynamic with vLLM's per-token scale rule. Scales are
    device tensors, so that ``x / s`` is a true division (torch multiplies by the reciprocal of a
    host scalar)."""
    f8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}[fmt]
    qmax = FP8_MAX[fmt]

    def quant(x, s):
        return (x.float() / s).clamp(-qmax, qmax).to(f8).view(torch.uint8)

    def static(key, value, kc, vc, slots, sk, sv, ksc, vsc):
        b, o = slots // block_size, slots % block_size
        kc[b, o] = quant(key, sk)
        vc[b, o] = quant(value, sv)

    def dynamic(key, value, kc, vc, slots, qmax_t, floor_t, ksc, vsc):
        b, o = slots // block_size, slots % block_size
        for x, c, sc in ((key, kc, ksc), (value, vc, vsc)):
            s = torch.maximum(x.float().abs().amax(-1) / qmax_t, floor_t)
            c[b, o] = quant(x, s[..., None])
            sc[b, o] = s

    return static if mode == "static" else dynamic


def _make_sets(cupy, cq, c: Case, fmt: str, copies: int):
    """``copies`` argument sets of ours: (qkv, key, value, kc, vc, slots, ksc, vsc)."""
    import ml_dtypes
    import numpy as np

    rng = cupy.random.default_rng(0)
    nprng = np.random.default_rng(0)
    qh = Q_PER_KV * c.heads
    blocks = -(-CACHE_FACTOR * c.tokens // BLOCK_SIZE)
    shape = (blocks, BLOCK_SIZE, c.heads, c.head_dim)
    if c.kv_layout == "HND":
        shape = (blocks, c.heads, BLOCK_SIZE, c.head_dim)
    sets = []
    for _ in range(copies):
        qkv = rng.standard_normal((c.tokens, qh + 2 * c.heads, c.head_dim), dtype=np.float32).astype(ml_dtypes.bfloat16)
        kc, vc = cupy.zeros(shape, np.uint8), cupy.zeros(shape, np.uint8)
        ksc = vsc = None
        if c.mode == "dynamic":
            ksc, vsc = cq.empty_kv_scale_cache(kc, c.kv_layout), cq.empty_kv_scale_cache(vc, c.kv_layout)
        slots = cupy.asarray(nprng.permutation(blocks * BLOCK_SIZE)[: c.tokens].astype(np.int64))
        sets.append((qkv, qkv[:, qh : qh + c.heads], qkv[:, qh + c.heads :], kc, vc, slots, ksc, vsc))
    return sets


def bench_case(cupy, cq, bench, torch, c: Case, fmt: str, copy_bw: float, reps: int) -> dict:
    """One row: ours (and torch's, NHD only) timed as CUDA-graph replays."""
    copies = bench.copies_for(io_bytes(c) + 2 * CACHE_FACTOR * c.tokens * c.heads * c.head_dim)
    sets = _make_sets(cupy, cq, c, fmt, copies)
    dyn = c.mode == "dynamic"
    sk, sv = ("dynamic", "dynamic") if dyn else (0.05, 0.04)

    def ours(_qkv, key, value, kc, vc, slots, ksc, vsc):
        cq.quantize_kv_cache(
            key,
            value,
            kc,
            vc,
            slots,
            scale_k=sk,
            scale_v=sv,
            dtype=fmt,
            kv_layout=c.kv_layout,
            key_scale_cache=ksc,
            value_scale_cache=vsc,
        )

    calls = [sets[i % copies] for i in range(max(MIN_CALLS, copies))]
    t = bench.time_graph(ours, calls, reps)
    nbytes = io_bytes(c)
    row = {
        "case": c.label,
        "mode": c.mode,
        "layout": c.kv_layout,
        "us": t * 1e6,
        "GB/s": nbytes / t / 1e9,
        "% copy": 100 * nbytes / t / copy_bw,
        "copy us": (tc := bench.copy_seconds(nbytes)) * 1e6,
        "% of it": 100 * tc / t,
        "host us": bench.host_seconds_per_call(ours, sets, calls=200) * 1e6,
    }
    if torch is not None and c.kv_layout == "NHD":
        row.update(_bench_torch(cupy, torch, bench, c, fmt, sets, calls, ours, t, reps))
    return row


def _bench_torch(cupy, torch, bench, c: Case, fmt: str, sets, calls, ours, t: float, reps: int) -> dict:
    fn = _torch_write(torch, fmt, c.mode, BLOCK_SIZE)
    dev = torch.device("cuda", cupy.cuda.runtime.getDevice())
    if c.mode == "dynamic":
        qmax = FP8_MAX[fmt]
        extra = (torch.tensor(qmax, device=dev), torch.tensor(1.0 / (qmax * 512.0), device=dev, dtype=torch.float32))
    else:
        extra = (torch.tensor([0.05], device=dev), torch.tensor([0.04], device=dev))

    def to_torch(s):
        _qkv, key, value, kc, vc, slots, ksc, vsc = s
        conv = [torch.from_dlpack(a) if a is not None else None for a in (key, value, kc, vc, slots, ksc, vsc)]
        return (*conv[:5], *extra, *conv[5:])

    targs = {id(s): to_torch(s) for s in sets}
    tcalls = [targs[id(s)] for s in calls]
    out = {}
    try:
        te = bench.time_torch_graph(torch, fn, tcalls, reps)
        out.update({"eager us": te * 1e6, "x eager": te / t})
    except Exception as e:  # noqa: BLE001 - a peer that cannot run leaves its cells empty
        out["torch"] = f"eager failed: {type(e).__name__}"
        return out
    try:
        comp = torch.compile(fn, dynamic=False)
        comp(*tcalls[0])
        tc = bench.time_torch_graph(torch, comp, tcalls, reps)
        out.update({"compile us": tc * 1e6, "x compile": tc / t})
    except Exception as e:  # noqa: BLE001
        out["compile us"] = None
        traceback.print_exc(limit=1)
        out["torch"] = f"compile failed: {type(e).__name__}; "
    # one step each from the same caches' state: every byte must agree
    s = sets[0]
    written = [a for a in (s[3], s[4], s[6], s[7]) if a is not None]  # the caches and scale caches
    saved = [a.copy() for a in written]
    ours(*s)
    mine = [a.get() for a in written]
    for a, b in zip(written, saved):
        a[...] = b
    cupy.cuda.Device().synchronize()
    fn(*targs[id(s)])
    torch.cuda.synchronize()
    diff = sum(int((x.view("u1") != a.get().view("u1")).sum()) for x, a in zip(mine, written))
    out["torch"] = out.get("torch", "") + ("ok" if diff == 0 else f"{diff} bytes differ")
    return out


def main_kv_cache(a, bench) -> None:
    """``scripts/bench.py --kv-cache``: ``a`` the parsed arguments, ``bench`` the bench.py module (its
    torch loader and table runner)."""
    cases = parse_cases(a.kv_cache_cases)
    if a.list:
        print("\n".join(f"{c.label} {c.mode} {c.kv_layout}" for c in cases))
        return
    import cupy

    import cupyquant as cq
    from cupyquant import _bench

    torch = bench._load_compiling_torch(a.no_torch)
    copy_bw = _bench.copy_bandwidth()
    head = (
        f"{_bench.device_name()}, {datetime.date.today().isoformat()}; FP8 KV-cache write ({a.format}), bf16 "
        f"keys/values (strided views of a fused qkv), block_size {BLOCK_SIZE}, a random permutation of "
        f"{CACHE_FACTOR}x the slots; CUDA-graph replay; copy bandwidth {copy_bw / 1e9:.0f} GB/s"
        + ("" if torch else "; torch not available")
    )
    reps = max(5, a.reps // 5)
    bench._run_cases(
        head, columns(torch is not None), cases,
        lambda c: bench_case(cupy, cq, _bench, torch, c, a.format, copy_bw, reps), a.markdown, torch,
    )  # fmt: skip
