"""The CPU parts of the W8A8 benchmark (scripts/bench_w8a8.py, reached through scripts/bench.py
--w8a8): argument parsing, the cells, the table from made-up timings, the agreement mark, the
replay counts. The timings themselves need a GPU (the lead's runs)."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
from _scripts import load_script

pytest.importorskip("cupy")  # bench.py imports CuPy (which imports without a GPU)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    return load_script("bench")


@pytest.fixture(scope="module")
def w8(bench):
    return bench.bench_w8a8


def test_defaults_are_the_agreed_cells(w8):
    assert w8.parse_ms(None) == [1, 16, 64, 128, 512, 2048, 4096, 8192]
    assert w8.parse_shapes(None) == [
        (4096, 4096),
        (14336, 4096),
        (4096, 14336),
        (7168, 2048),
        (24576, 1536),
        (2112, 7168),
        (8192, 8192),
    ]
    assert w8.parse_scalings(None) == w8.parse_scalings("all") == ["tensor", "token", "block", "int8"]
    assert len(w8.cells(w8.SHAPES, w8.MS)) == 56
    # every default K is a multiple of 16 (the kernels' requirement) and of 4 * 128 (torch's block scales)
    assert all(k % 512 == 0 for _, k in w8.SHAPES)


def test_parsing_restricts_and_rejects(w8):
    assert w8.parse_ms("1,16") == [1, 16]
    assert w8.parse_shapes("4096x4096, 2112X7168") == [(4096, 4096), (2112, 7168)]
    assert w8.parse_scalings("block,token") == ["block", "token"]
    for bad in ("", "0", "1,-4", "1,a"):
        with pytest.raises(ValueError, match="--w8a8-ms"):
            w8.parse_ms(bad)
    for bad in ("4096", "4096x", "4096x4096x2", "ax4"):
        with pytest.raises(ValueError, match="--w8a8-shapes"):
            w8.parse_shapes(bad)
    with pytest.raises(ValueError, match="--w8a8-scalings"):
        w8.parse_scalings("tensor,rowwise")


def test_bench_parser_takes_the_w8a8_flags(bench):
    a = bench.build_parser().parse_args(
        ["--w8a8", "--w8a8-ms", "1,16", "--w8a8-shapes", "4096x4096", "--w8a8-scalings", "block", "--no-torch"]
    )
    assert a.w8a8 and a.no_torch and a.w8a8_ms == "1,16" and a.w8a8_shapes == "4096x4096"
    assert a.w8a8_scalings == "block" and a.settle is None and not a.w8a8_fast_accum
    assert a.w8a8_budget == bench.bench_w8a8.DEFAULT_BUDGET
    b = bench.build_parser().parse_args(["--matmul", "--settle", "0"])
    assert b.settle == 0.0 and not b.w8a8


def test_list_prints_the_cells_without_a_gpu(bench, capsys):
    bench.main(["--w8a8", "--list", "--w8a8-ms", "1,4096", "--w8a8-shapes", "7168x2048,2112x7168"])
    out = capsys.readouterr().out.splitlines()
    assert out[:4] == [
        "N x K 7168x2048  M 1",
        "N x K 7168x2048  M 4096",
        "N x K 2112x7168  M 1",
        "N x K 2112x7168  M 4096",
    ]
    assert out[4] == "4 cells x 9 timings (scalings: tensor, token, block, int8)"
    bench.main(["--w8a8", "--list", "--no-torch", "--w8a8-scalings", "token"])
    assert capsys.readouterr().out.splitlines()[-1] == "56 cells x 2 timings (scalings: token)"


def test_table_from_fake_timings(bench, w8):
    cols = w8.columns(["token", "block"])
    assert cols[:4] == ["N x K", "M", "bf16 us", "bf16 TFLOP/s"] and cols[-1] == "notes"
    assert cols[4:12] == [
        "token us",
        "token TFLOP/s",
        "token x bf16",
        "token torch us",
        "token x torch",
        "token vs torch",
        "token weight GB/s",
        "token % copy",
    ]
    rows = [
        {
            "N x K": "4096x4096",
            "M": 1,
            "bf16 us": 9.87,
            "token us": 6.5,
            "token weight GB/s": 2581.0,
            "token x torch": 1.234,
            "token vs torch": w8.agreement_cell(True, 1e-3),
            "block torch us": "refused",
        },
        {"N x K": "4096x4096", "M": 4096, "block us": 205.3, "block vs torch": w8.agreement_cell(False, 0.25)},
    ]
    lines = w8.table_lines(cols, rows, bench._fmt)
    assert lines[0].count("|") == len(cols) + 1 and lines[1] == "|" + "---|" * len(cols)
    first = [c.strip() for c in lines[2].strip("|").split("|")]
    assert len(first) == len(cols)
    cell = dict(zip(cols, first))
    assert cell["M"] == "1" and cell["bf16 us"] == "9.87" and cell["token us"] == "6.50"
    assert cell["token weight GB/s"] == "2581" and cell["token x torch"] == "1.23"
    assert cell["token vs torch"] == "ok" and cell["block torch us"] == "refused"
    assert cell["block us"] == "-" and cell["notes"] == "-"
    second = dict(zip(cols, (c.strip() for c in lines[3].strip("|").split("|"))))
    assert second["block us"] == "205.3" and second["block vs torch"] == "DIFF 2.5e-01"
    # INT8 adds its speed against our FP8 per-token kernel where both ran
    cols8 = w8.columns(["token", "int8"])
    assert cols8[-2:] == ["int8 x token", "notes"] and "int8 x token" not in w8.columns(["int8"])
    row = {"token us": 100.0, "int8 us": 80.0}
    w8._int8_vs_token(row)
    assert row["int8 x token"] == 1.25
    row = {"token us": "error", "int8 us": 80.0}
    w8._int8_vs_token(row)
    assert "int8 x token" not in row


def test_agreement_mark(w8):
    yt = np.array([[1.0, -2.0], [4.0, 0.5]], dtype=np.float32)
    ok, r = w8.agreement(yt + np.float32(0.1), yt)
    assert ok and r == pytest.approx(0.1 / 4.0)
    ok, r = w8.agreement(yt * 2, yt)
    assert not ok and r == pytest.approx(1.0)
    assert w8.agreement(np.zeros((2, 2)), np.zeros((2, 2))) == (True, 0.0)
    assert w8.agreement(np.ones((1, 1)), np.zeros((1, 1)))[0] is False


def test_replay_counts(w8):
    from cupyquant import _bench

    assert _bench.reps_for(1e-3, 0.03) == 20  # light: capped
    assert _bench.reps_for(10e-3, 0.03) == 3  # heavy: the floor
    assert _bench.reps_for(2e-3, 0.03) == 15
    assert _bench.reps_for(0.0, 0.03) == 20
    # the estimate grows with M once the FLOPs pass the weight read
    e = [w8.estimate_seconds(m, 4096, 4096) for m in (1, 16, 512, 8192)]
    assert e[0] == e[1] < e[2] < e[3]


def test_header_names_peers_and_scalings(w8):
    fake = types.SimpleNamespace(__version__="2.11.0")
    h = w8.header("NVIDIA H100 80GB HBM3", fake, ["tensor", "block"], 0.2, False, 3.0e12)
    assert "torch 2.11.0 _scaled_mm" in h and "use_fast_accum=False" in h
    assert "tensor: per-tensor x per-tensor" in h and "block: 1x128 groups x 128x128 blocks" in h
    assert "copy bandwidth 3000 GB/s" in h and "0.2 s idle" in h
    h = w8.header("GPU", None, ["token"], 0.0, False, 3.0e12)
    assert "torch not available" in h and "cupy.matmul" in h


def test_errors_are_reported_once(w8, capsys):
    errs = w8.Errors()
    errs.add("block: scaled_matmul", ValueError("b: block scales need K a multiple of 16\nmore"))
    errs.add("block: scaled_matmul", ValueError("second"))
    errs.add("torch._scaled_mm refused block scaling", "Invalid scaling configuration.")
    errs.report()
    err = capsys.readouterr().err
    assert "block: scaled_matmul: ValueError: b: block scales need K a multiple of 16\n" in err
    assert "second" not in err
    assert "torch._scaled_mm refused block scaling: Invalid scaling configuration." in err


class _FakeTimer:
    def __init__(self, ours=10e-6, torch=20e-6, fail=None):
        self.t_ours, self.t_torch, self.fail = ours, torch, fail

    def ours(self, fn, args_list, est):
        if self.fail:
            raise self.fail
        for args in args_list:
            fn(*args)
        return self.t_ours, None

    def torch_graph(self, torch, fn, args_list, est):
        return self.t_torch


def _ctx(w8, timer, torch=None, mm=None):
    return {"torch": torch, "timer": timer, "mm": mm, "copy_bw": 3.0e12, "errors": w8.Errors()}


class _Q:
    nbytes = 4096 * 4096 + 4096 * 2


def test_cell_fills_a_row_from_fake_timings(w8, monkeypatch):
    import cupyquant

    calls = []
    monkeypatch.setattr(w8, "quantize_a", lambda x, t: ("qa", t))
    monkeypatch.setattr(cupyquant, "scaled_matmul", lambda a, b, out: calls.append((a, b, out.shape)), raising=False)
    x, y = np.zeros((1, 4096), np.float32), np.zeros((1, 4096), np.float32)
    row, notes = {}, []
    w8._cell("token", x, y, [_Q(), _Q()], None, 20e-6, _ctx(w8, _FakeTimer()), row, notes)
    assert len(calls) == 2 and calls[0][0] == ("qa", "token") and calls[0][2] == (1, 4096)
    assert row["token us"] == pytest.approx(10.0) and row["token x bf16"] == pytest.approx(2.0)
    assert row["token TFLOP/s"] == pytest.approx(2 * 4096 * 4096 / 10e-6 / 1e12)
    assert row["token weight GB/s"] == pytest.approx(_Q.nbytes / 10e-6 / 1e9)
    assert row["token % copy"] == pytest.approx(100 * _Q.nbytes / 10e-6 / 3.0e12)
    assert "token torch us" not in row and not notes  # no torch: the peer cells stay blank
    big_x, big_y = np.zeros((64, 4096), np.float32), np.zeros((64, 4096), np.float32)
    row = {}
    w8._cell("token", big_x, big_y, [_Q()], None, None, _ctx(w8, _FakeTimer()), row, notes)
    assert "token weight GB/s" not in row and row["token x bf16"] is None  # M > 16; no bf16 timing


def test_cell_marks_errors_and_refusals(w8, monkeypatch, capsys):
    import cupyquant

    monkeypatch.setattr(w8, "quantize_a", lambda x, t: "qa")
    monkeypatch.setattr(cupyquant, "scaled_matmul", lambda a, b, out: None, raising=False)
    x, y = np.zeros((16, 256), np.float32), np.zeros((16, 512), np.float32)
    row = {}
    ctx = _ctx(w8, _FakeTimer(fail=ValueError("b: no such scaling")))
    w8._cell("block", x, y, [_Q()], None, 1e-5, ctx, row, [])
    assert row == {"block us": "error"}
    row = {}
    w8._cell("block", x, y, ValueError("block_size"), None, 1e-5, ctx, row, [])
    assert row == {"block us": "error"}

    def refuse(ta, sa, tb, sb):
        raise RuntimeError("Invalid scaling configuration.\n- For TensorWise scaling ...")

    monkeypatch.setattr(w8, "torch_a", lambda torch, qa, t: ("ta", "sa"))
    row = {}
    ctx = dict(_ctx(w8, _FakeTimer(), torch=object(), mm=refuse), errors=ctx["errors"])
    w8._cell("block", x, y, [_Q()], [("tb", ["sb1", "sb2"])], 1e-5, ctx, row, [])
    assert row["block torch us"] == "refused" and "block x torch" not in row and row["block us"] == pytest.approx(10.0)
    ctx["errors"].report()
    err = capsys.readouterr().err
    assert "torch._scaled_mm refused block scaling: Invalid scaling configuration." in err
    assert "scaled_matmul: ValueError: b: no such scaling" in err
