#!/usr/bin/env python3
"""W4A16 ``matmul`` against cuBLAS fp16 under sustained load: time per call, SM clock and board power.

    python scripts/sustained_matmul.py --ms 64,256,4096 --seconds 3

``scripts/bench.py`` times short bursts (a CUDA graph replayed 20 times, a few milliseconds a cell).
A serving loop keeps the GPU busy for seconds, long enough for the board's power limit to pull the
SM clock down, and how far it pulls depends on the kernel: a fp16 GEMM that streams four times the
weight bytes draws more power per FLOP than a W4A16 kernel. This script replays each contender's
graph (calls cycling over weight copies that span 4x the L2) back to back for ``--seconds``, in
batches of about 50 ms, and reports the median time per call over the last three quarters of the
batches, with the mean SM clock and power that ``nvidia-smi`` sampled (every 20 ms) over the same
window. The two contenders of a cell alternate, one after the other, in the same process.

Needs a GPU; the cuBLAS column needs torch (``torch.matmul`` on fp16, captured in a graph, as
``bench.py --matmul`` times cuBLAS in bf16). The clock and power columns need ``nvidia-smi``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = "4096x4096,14336x4096,4096x14336,28672x8192,8192x28672"


def _sampler(bus_id: str):
    """Start nvidia-smi sampling clock, power and throttle reasons to a temporary file."""
    if shutil.which("nvidia-smi") is None:
        return None, None
    f = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
    q = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active"
    p = subprocess.Popen(
        ["nvidia-smi", "-i", bus_id, f"--query-gpu={q}", "--format=csv,noheader,nounits", "-lms", "20"],
        stdout=f,
        stderr=subprocess.DEVNULL,
    )
    return p, f.name


def _samples(path: str):
    rows = []
    with open(path) as f:
        for line in f:
            p = [x.strip() for x in line.split(",")]
            try:
                ts = datetime.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                rows.append((ts, float(p[1]), float(p[2]), int(p[3], 16)))
            except (ValueError, IndexError):
                continue
    return rows


def _sustain(launch, sync, ncall: int, seconds: float):
    """Replay for ``seconds``; return (median seconds a call over the last 3/4, window start, end)."""
    launch()
    sync()
    t = time.perf_counter()
    launch()
    sync()
    per = max(1, int(0.05 / max(time.perf_counter() - t, 1e-6)))
    times, t0 = [], time.perf_counter()
    w0 = time.time()
    while time.perf_counter() - t0 < seconds:
        tb = time.perf_counter()
        for _ in range(per):
            launch()
        sync()
        times.append((time.perf_counter() - tb) / per / ncall)
    w1 = time.time()
    # the window for the clock and power samples is the part the median is taken over
    w0 = w0 + (w1 - w0) * 0.25
    return statistics.median(times[len(times) // 4 :]), w0, w1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=SHAPES, help="N x K weight shapes, comma-separated (default: the bench's five)")
    ap.add_argument("--ms", default="64,256,4096", help="activation rows M, comma-separated")
    ap.add_argument("--seconds", type=float, default=3.0, help="sustained replay per contender and cell")
    ap.add_argument("--scheme", default="int4", help="quantize_weight scheme (default int4)")
    ap.add_argument("--group-size", type=int, default=128)
    args = ap.parse_args(argv)

    import cupy
    import ml_dtypes
    import numpy as np

    import cupyquant as cq
    from cupyquant import _bench

    try:
        import torch
    except ImportError:
        torch = None
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(m) for m in args.ms.split(",")]
    dev = cupy.cuda.Device()
    name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    proc, path = _sampler(dev.pci_bus_id)
    time.sleep(0.5)
    rng = cupy.random.default_rng(0)
    rows = []
    try:
        for N, K in shapes:
            w16 = (rng.standard_normal((N, K), dtype=np.float32) * 0.02).astype(np.float16)
            q = cq.prepare_weight(
                cq.quantize_weight(w16.astype(ml_dtypes.bfloat16), args.scheme, group_size=args.group_size)
            )
            qs = [q] + [q.copy() for _ in range(_bench.copies_for(N * K // 2) - 1)]
            tws = []
            if torch is not None:
                tws = [torch.from_dlpack(w16)] + [
                    torch.from_dlpack(w16.copy()) for _ in range(_bench.copies_for(N * K * 2) - 1)
                ]
            del w16
            for M in ms:
                a16 = rng.standard_normal((M, K), dtype=np.float32).astype(np.float16)
                ab = a16.astype(ml_dtypes.bfloat16)
                yb = cupy.empty((M, N), ml_dtypes.bfloat16)
                s = cupy.cuda.Stream(non_blocking=True)
                g = _bench.capture_graph(lambda qq, ab=ab, yb=yb: cq.matmul(ab, qq, out=yb), [(qq,) for qq in qs], s)
                row = {"N x K": f"{N}x{K}", "M": M}
                row["w"] = _sustain(lambda g=g: g.launch(s), s.synchronize, len(qs), args.seconds)
                if torch is not None:
                    ta = torch.from_dlpack(a16)
                    tg = _bench.capture_torch_graph(torch, lambda w: torch.matmul(ta, w.t()), [(w,) for w in tws])
                    row["c"] = _sustain(tg.replay, torch.cuda.synchronize, len(tws), args.seconds)
                    del tg, ta
                rows.append(row)
                print(
                    f"  {N}x{K} M={M}: W4A16 {row['w'][0] * 1e6:.1f} us"
                    + (f", cuBLAS fp16 {row['c'][0] * 1e6:.1f} us" if "c" in row else ""),
                    file=sys.stderr,
                    flush=True,
                )
                del g, yb, ab, a16
            del qs, q, tws
            cupy.get_default_memory_pool().free_all_blocks()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
    samples = _samples(path) if path else []
    if path:
        os.unlink(path)

    def clk(win):
        sel = [r for r in samples if win[1] <= r[0] <= win[2]]
        if not sel:
            return "-", "-", "-"
        caps = sorted({r[3] for r in sel})
        return (
            f"{statistics.mean(r[1] for r in sel):.0f}",
            f"{statistics.mean(r[2] for r in sel):.0f}",
            "/".join(f"0x{c:x}" for c in caps),
        )

    print(
        f"Device: {name}; {args.scheme} g{args.group_size}, bf16 activations; {args.seconds:g} s of replay per "
        "contender and cell; time: median per call over the last 3/4; MHz, W: nvidia-smi means over that window; "
        "reasons: clocks_event_reasons.active seen (0x4: the software power cap)\n"
    )
    head = ["N x K", "M", "W4A16 us", "W4A16 TFLOP/s", "W4A16 MHz", "W4A16 W", "W4A16 reasons"]
    if torch is not None:
        head += ["cuBLAS fp16 us", "cuBLAS TFLOP/s", "cuBLAS MHz", "cuBLAS W", "cuBLAS reasons", "W4A16 x cuBLAS"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        N, K = (int(v) for v in r["N x K"].split("x"))
        flop = 2.0 * r["M"] * N * K
        cells = [r["N x K"], str(r["M"]), f"{r['w'][0] * 1e6:.1f}", f"{flop / r['w'][0] / 1e12:.0f}", *clk(r["w"])]
        if "c" in r:
            cells += [
                f"{r['c'][0] * 1e6:.1f}",
                f"{flop / r['c'][0] / 1e12:.0f}",
                *clk(r["c"]),
                f"{r['c'][0] / r['w'][0]:.2f}",
            ]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
