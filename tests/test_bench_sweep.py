"""The CPU parts of the inference shape sweep (scripts/bench_sweep.py, reached through
scripts/bench.py --sweep): the cells, the bytes each op must move, the tables from made-up
timings, joining saved runs, and the picture. The timings themselves need a GPU."""

from __future__ import annotations

import json

import pytest
from _scripts import load_script

pytest.importorskip("cupy")  # bench.py imports CuPy (which imports without a GPU)


@pytest.fixture(scope="module")
def bench():
    return load_script("bench")


@pytest.fixture(scope="module")
def sweep(bench):
    return bench.bench_sweep


def test_the_cells_and_ops(sweep):
    assert sweep.KS == (2048, 4096, 7168, 8192, 16384)
    assert sweep.MS == (1, 16, 128, 1024, 4096, 16384)
    assert list(sweep.OPS) == [
        "token_fp8",
        "token_int8",
        "group128",
        "group128_col",
        "group128_ue8m0",
        "silu_group128",
        "mxfp8",
        "nvfp4",
        "token_fp8_dequant",
        "group128_dequant",
        "mxfp8_dequant",
        "nvfp4_dequant",
    ]


def test_bytes_moved(sweep):
    ops = sweep.OPS
    M, K = 3, 4096
    # bf16 in, one byte out, one float32 scale a row
    assert sweep.io_bytes(ops["token_fp8"], M, K) == 2 * M * K + M * K + 4 * M
    # float32 scales a group; "col" pads the tokens to 4; packed UE8M0 four groups a word
    assert sweep.io_bytes(ops["group128"], M, K) == 3 * M * K + 4 * M * (K // 128)
    assert sweep.io_bytes(ops["group128_col"], M, K) == 3 * M * K + 4 * 4 * (K // 128)
    assert sweep.io_bytes(ops["group128_ue8m0"], M, K) == 3 * M * K + 4 * 4 * (K // 512)
    # SiLU*Mul reads 2K columns for K outputs
    assert sweep.io_bytes(ops["silu_group128"], M, K) == 4 * M * K + M * K + 4 * M * (K // 128)
    # swizzled scales pad to 128 rows and 4 columns; FP4 is half a byte an element
    assert sweep.io_bytes(ops["mxfp8"], M, K) == 3 * M * K + 128 * (K // 32)
    assert sweep.io_bytes(ops["nvfp4"], M, K) == 2 * M * K + M * K // 2 + 128 * (K // 16)
    # a dequantizer reads what its quantizer wrote and writes bf16
    for name in ("token_fp8", "group128", "mxfp8", "nvfp4"):
        q = ops[name]
        assert sweep.in_bytes(ops[name + "_dequant"], M, K) == q.out_bytes(M, K)
        assert sweep.io_bytes(ops[name + "_dequant"], M, K) == q.out_bytes(M, K) + 2 * M * K


def _run(sweep, torch=True):
    cells = []
    for op in ("token_fp8", "nvfp4_dequant"):
        for K in (2048, 4096):
            for M in (1, 4096):
                b = sweep.io_bytes(sweep.OPS[op], M, K)
                us = 2.0 + b / 3e6
                c = {"op": op, "M": M, "K": K, "bytes": b, "us": us, "host_us": 20.0 + M / 1000}
                c.update(gbps=b / us / 1e3, pct_copy=b / us / 1e3 / 30.0)
                if torch:
                    c.update(compile_us=1.25 * us, x_compile=1.25)
                cells.append(c)
    return {"device": "GPU", "date": "d", "copy_gbps": 3000.0, "torch": "2" if torch else None, "cells": cells}


def test_markdown(sweep):
    r = _run(sweep)
    r["floor_us"] = {"token_fp8": {"2048": 9.5}}
    lines = sweep.markdown(r).splitlines()
    assert lines[0] == "| op | M | K = 2048 | K = 4096 |"
    row = next(ln for ln in lines if ln.startswith("| token_fp8 | 4096 |"))
    c = next(c for c in r["cells"] if (c["op"], c["M"], c["K"]) == ("token_fp8", 4096, 2048))
    assert row.split(" | ")[2] == f"{c['us']:.1f} / {c['pct_copy']:.0f}% / 1.25x"
    assert "| token_fp8 | 20.0 (9.5) | 20.0 |" in lines
    assert "| nvfp4_dequant | 20.0 | 20.0 |" in lines
    # without torch the cells have no ratio
    assert "x" not in sweep.markdown(_run(sweep, torch=False)).splitlines()[2].split(" | ")[2]


def test_cells_behind_torch_compile(sweep):
    """behind() lists the cells under the tie line, slowest first; none without torch's timings."""
    r = _run(sweep)
    slow = [c for c in r["cells"] if c["op"] == "token_fp8"]
    slow[0].update(compile_us=0.9 * slow[0]["us"], x_compile=0.9)
    slow[1].update(compile_us=1.01 * slow[1]["us"], x_compile=1.01)
    lines = sweep.behind(r)
    assert lines[0].startswith("| op | M | K | us |") and len(lines) == 4
    assert lines[2].startswith(f"| token_fp8 | {slow[0]['M']} | {slow[0]['K']} |") and "| 0.90 |" in lines[2]
    assert "| 1.01 |" in lines[3]
    assert sweep.behind(_run(sweep)) == [] and sweep.behind(_run(sweep, torch=False)) == []


def test_join_lets_a_later_run_replace_cells(sweep):
    first = _run(sweep)
    later = {
        "cells": [{"op": "token_fp8", "M": 1, "K": 2048, "us": 1.0, "host_us": 11.0}],
        "floor_us": {"token_fp8": {2048: 7.0}},
    }
    joined = sweep.join([first, later])
    assert len(joined["cells"]) == len(first["cells"])
    c = next(c for c in joined["cells"] if (c["op"], c["M"], c["K"]) == ("token_fp8", 1, 2048))
    assert (c["us"], c["host_us"], c["x_compile"]) == (1.0, 11.0, 1.25)
    assert joined["floor_us"] == {"token_fp8": {"2048": 7.0}}
    assert joined["device"] == "GPU"


def test_from_json_and_plot(bench, sweep, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the picture needs matplotlib (pip install '.[bench]')")
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_run(sweep)))
    png = tmp_path / "sweep.png"
    md = tmp_path / "sweep.md"
    ratio = tmp_path / "ratio.png"
    bench.main(["--from-json", str(path), "--plot", str(png), "--plot-ratio", str(ratio), "--markdown", str(md)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert ratio.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| token_fp8 | 1 |" in md.read_text()
    assert "copy bandwidth 3000 GB/s" in capsys.readouterr().out
