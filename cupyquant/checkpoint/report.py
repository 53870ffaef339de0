"""The round-trip report of a run: per quantized tensor the scheme, bits per weight, SNR and largest
error of the dequantized weight (read back from the written tensors) against the original, bytes in
and out and time; a summary per layer type; written as JSON and CSV beside the checkpoint, shown as
a table, and drawn (SNR per tensor) with matplotlib when asked."""

from __future__ import annotations

import csv
import json
from pathlib import Path

REPORT = "cupyquant_report"
#: The CSV's columns, one row per quantized tensor.
COLUMNS = (
    "tensor", "layer_type", "scheme", "shape", "dtype", "bits_per_weight", "snr_db", "max_rel_err", "bytes_in",
    "bytes_out", "seconds", "shard",
)  # fmt: skip


def summarize(rows: list) -> list:
    """One row per layer type: tensors, weights, bits per weight, SNR (min and the SNR of the
    summed signal and noise is not kept per tensor, so the mean of the tensors' dB), the largest
    max_rel_err, bytes in and out, seconds."""
    groups = {}
    for r in rows:
        groups.setdefault(r["layer_type"], []).append(r)
    out = []
    for lt, rs in groups.items():
        n_w = sum(r["shape"][0] * r["shape"][1] for r in rs)
        b_out = sum(r["bytes_out"] for r in rs)
        out.append(
            {
                "layer_type": lt,
                "tensors": len(rs),
                "weights": n_w,
                "bits_per_weight": 8 * b_out / n_w,
                "snr_db_mean": sum(r["snr_db"] for r in rs) / len(rs),
                "snr_db_min": min(r["snr_db"] for r in rs),
                "max_rel_err": max(r["max_rel_err"] for r in rs),
                "bytes_in": sum(r["bytes_in"] for r in rs),
                "bytes_out": b_out,
                "seconds": sum(r["seconds"] for r in rs),
            }
        )
    return out


def write(dst: Path, rows: list, summary: dict) -> tuple:
    """``cupyquant_report.json`` (``{"summary", "layer_types", "tensors"}``) and
    ``cupyquant_report.csv`` (the tensors) under ``dst``; returns their paths."""
    dst = Path(dst)
    jpath, cpath = dst / f"{REPORT}.json", dst / f"{REPORT}.csv"
    doc = {"summary": summary, "layer_types": summarize(rows), "tensors": rows}
    jpath.write_text(json.dumps(doc, indent=1) + "\n")
    with open(cpath, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("x".join(map(str, r[k])) if k == "shape" else r[k]) for k in COLUMNS})
    return jpath, cpath


def table(rows: list, summary: dict) -> str:
    """The per-layer-type table and the run's totals, as text."""
    head = f"{'layer type':<44} {'tensors':>7} {'bits/w':>7} {'SNR dB':>7} {'min SNR':>7} {'max rel err':>11} {'MB in':>9} {'MB out':>9}"
    lines = [head]
    for s in summarize(rows):
        lines.append(
            f"{s['layer_type'][:44]:<44} {s['tensors']:>7} {s['bits_per_weight']:>7.3f} {s['snr_db_mean']:>7.2f} "
            f"{s['snr_db_min']:>7.2f} {s['max_rel_err']:>11.4f} {s['bytes_in'] / 1e6:>9.2f} {s['bytes_out'] / 1e6:>9.2f}"
        )
    lines.append(
        f"{summary['tensors_quantized']} tensors quantized with {summary['scheme']} ({summary['backend']}), "
        f"{summary['tensors_copied']} copied; {summary['bytes_in'] / 1e9:.3f} GB in, {summary['bytes_out'] / 1e9:.3f} GB out "
        f"in {summary['shards']} shards; {summary['seconds']:.2f} s ({summary['gb_per_s']:.3f} GB/s read)"
    )
    return "\n".join(lines)


def plot(dst: Path, rows: list) -> Path:
    """``cupyquant_report.png``: SNR per quantized tensor, in file order, colored by layer type
    (matplotlib, the ``bench`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            f'plot=True needs matplotlib, which is not installed ({e}): pip install "cupyquant[bench]"'
        ) from e
    path = Path(dst) / f"{REPORT}.png"
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.06), 4))
    for lt in dict.fromkeys(r["layer_type"] for r in rows):
        idx = [i for i, r in enumerate(rows) if r["layer_type"] == lt]
        ax.scatter(idx, [rows[i]["snr_db"] for i in idx], s=8, label=lt)
    ax.set_xlabel("quantized tensor (file order)")
    ax.set_ylabel("SNR (dB)")
    ax.set_title(f"{rows[0]['scheme'] if rows else ''}: SNR of each dequantized weight")
    if len({r["layer_type"] for r in rows}) <= 12:
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
