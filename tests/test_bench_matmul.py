"""The CPU parts of the weight-only matmul benchmark (scripts/bench_matmul.py, reached through
scripts/bench.py --matmul): argument parsing, the cells, the columns, the table from made-up timings,
a scheme's cells filled by stand-in timers. The timings themselves need a GPU (the lead's runs)."""

from __future__ import annotations

import types

import numpy as np
import pytest
from _scripts import load_script

pytest.importorskip("cupy")  # bench.py imports CuPy (which imports without a GPU)


@pytest.fixture(scope="module")
def bench():
    return load_script("bench")


@pytest.fixture(scope="module")
def mm(bench):
    return bench.bench_matmul


def test_defaults_are_the_agreed_cells(mm):
    assert mm.parse_shapes(None) == [(4096, 4096), (28672, 8192), (4096, 14336), (8192, 8192), (14336, 4096)]
    assert mm.parse_ms(None) == [1, 16, 32, 64, 128, 256, 1024, 4096]
    assert mm.parse_schemes(None) == mm.parse_schemes("all") == ["int4", "nvfp4", "mxfp4", "float8_e4m3fn"]
    assert [mm.SCHEMES[s].tag for s in mm.DEFAULT_SCHEMES] == ["INT4", "NVFP4", "MXFP4", "FP8"]
    assert len(mm.cells(mm.SHAPES, mm.MS)) == 40
    # every default K is a multiple of 128, the prepared layout's rule for all four schemes
    assert all(k % 128 == 0 for _, k in mm.SHAPES)


def test_schemes_are_quantize_weights_names(mm):
    from cupyquant.weight.formats import SCHEME_IDS

    assert {mm.SCHEMES[s].dtype or s for s in mm.SCHEMES} == set(SCHEME_IDS)
    # INT4 and FP8 in groups of 128; the FP4 formats in their own blocks (quantize_weight takes no
    # group_size); FP8 in 128 x 128 blocks
    assert {s: (mm.SCHEMES[s].group_size, mm.SCHEMES[s].block_size) for s in mm.SCHEMES} == {
        "int4": (128, None),
        "uint4": (128, None),
        "float8_e4m3fn": (128, None),
        "nvfp4": (None, None),
        "mxfp4": (None, None),
        "fp8_block": (None, (128, 128)),
    }
    assert mm.SCHEMES["fp8_block"].dtype == "float8_e4m3fn"


def test_parsing_restricts_and_rejects(mm):
    assert mm.parse_ms("1,64") == [1, 64]
    assert mm.parse_ms("decode") == [1, 2, 4, 8, 16]
    assert mm.parse_ms("prefill") == [16, 32, 64, 128, 256, 1024, 4096]
    assert mm.parse_shapes("4096x4096, 14336X4096") == [(4096, 4096), (14336, 4096)]
    assert mm.parse_schemes("float8_e4m3fn, int4") == ["float8_e4m3fn", "int4"]
    for bad in ("", "0", "1,-4", "prefil"):
        with pytest.raises(ValueError, match="--matmul-ms"):
            mm.parse_ms(bad)
    for bad in ("4096", "4096x", "4096x4096x2", "ax4"):
        with pytest.raises(ValueError, match="--matmul-shapes"):
            mm.parse_shapes(bad)
    for bad in ("int4,fp8", "", ","):
        with pytest.raises(ValueError, match="--matmul-schemes"):
            mm.parse_schemes(bad)


def test_bench_parser_takes_the_matmul_flags(bench, mm):
    a = bench.build_parser().parse_args(["--matmul"])
    assert a.matmul and a.matmul_ms is None and a.matmul_shapes is None and a.matmul_schemes is None
    assert a.matmul_budget == mm.DEFAULT_BUDGET and a.settle is None
    assert not a.matmul_paths and not a.matmul_no_pdl and not a.w8a8
    b = bench.build_parser().parse_args(
        ["--matmul", "--matmul-ms", "1,64", "--matmul-shapes", "4096x4096", "--matmul-schemes", "int4"]
        + ["--matmul-paths", "--matmul-no-pdl", "--matmul-budget", "0.1", "--settle", "0"]
    )
    assert (b.matmul_ms, b.matmul_shapes, b.matmul_schemes) == ("1,64", "4096x4096", "int4")
    assert b.matmul_paths and b.matmul_no_pdl and b.matmul_budget == 0.1 and b.settle == 0.0


def test_list_prints_the_cells_without_a_gpu(bench, capsys):
    bench.main(["--matmul", "--list", "--matmul-ms", "1,64", "--matmul-shapes", "4096x4096,14336x4096"])
    out = capsys.readouterr().out.splitlines()
    assert out[:4] == [
        "N x K 4096x4096  M 1",
        "N x K 4096x4096  M 64",
        "N x K 14336x4096  M 1",
        "N x K 14336x4096  M 64",
    ]
    # cuBLAS, then ours and dequant + cuBLAS for each of the four schemes
    assert out[4] == (
        "4 cells x 9 timings (schemes: int4, nvfp4, mxfp4, float8_e4m3fn); 18 s of settle pauses at 0.5 s"
    )
    bench.main(["--matmul", "--list", "--no-torch", "--matmul-schemes", "int4", "--settle", "0.2"])
    assert capsys.readouterr().out.splitlines()[-1] == (
        "40 cells x 1 timings (schemes: int4); 8 s of settle pauses at 0.2 s"
    )


def test_timings_per_cell(mm):
    four = mm.DEFAULT_SCHEMES
    assert mm.timings_per_cell(four) == 9
    assert mm.timings_per_cell(four, torch_peers=False) == 4
    assert mm.timings_per_cell(four, no_pdl=True) == 13
    # the forced kernels: every scheme but FP8 (which has only the decode kernel)
    assert mm.timings_per_cell(four, paths=mm.PATHS) == 9 + 3 * 3
    assert mm.timings_per_cell(["float8_e4m3fn"], torch_peers=False, paths=mm.PATHS) == 1


def test_columns(mm):
    cols = mm.columns(["int4", "float8_e4m3fn"])
    assert cols[:4] == ["N x K", "M", "cuBLAS bf16 us", "cuBLAS TFLOP/s"] and cols[-1] == "notes"
    assert cols[4:13] == [
        "INT4 us",
        "INT4 path",
        "INT4 TFLOP/s",
        "INT4 x cuBLAS",
        "INT4 dequant + cuBLAS us",
        "INT4 x dequant",
        "INT4 weight GB/s",
        "INT4 % copy",
        "FP8 us",
    ]
    assert len(cols) == 4 + 2 * 8 + 1
    bare = mm.columns(["nvfp4"], torch_peers=False)
    assert bare == ["N x K", "M", "NVFP4 us", "NVFP4 path", "NVFP4 TFLOP/s", "NVFP4 weight GB/s", "NVFP4 % copy"] + [
        "notes"
    ]
    extra = mm.columns(["mxfp4", "float8_e4m3fn"], no_pdl=True, paths=("decode", "sm80_gemm"))
    assert extra[extra.index("MXFP4 % copy") + 1 :][:3] == ["MXFP4 no-PDL us", "MXFP4 decode us", "MXFP4 sm80_gemm us"]
    assert "FP8 no-PDL us" in extra and "FP8 decode us" not in extra


def test_table_from_fake_timings(bench, mm):
    cols = mm.columns(["int4", "nvfp4"])
    rows = [
        {
            "N x K": "4096x4096",
            "M": 1,
            "cuBLAS bf16 us": 17.04,
            "INT4 us": 4.5,
            "INT4 path": "decode",
            "INT4 x cuBLAS": 3.7867,
            "INT4 dequant + cuBLAS us": 25.3,
            "INT4 x dequant": 5.622,
            "INT4 weight GB/s": 1924.4,
            "INT4 % copy": 45.31,
            "NVFP4 dequant + cuBLAS us": "error",
        },
        {"N x K": "4096x4096", "M": 4096, "INT4 us": 173.0, "notes": "INT4 DIFF 2.5e-01 vs dequant"},
    ]
    lines = mm.table_lines(cols, rows, bench._fmt)
    assert lines[0].count("|") == len(cols) + 1 and lines[1] == "|" + "---|" * len(cols)
    cell = dict(zip(cols, (c.strip() for c in lines[2].strip("|").split("|"))))
    assert cell["M"] == "1" and cell["cuBLAS bf16 us"] == "17.0" and cell["INT4 us"] == "4.50"
    assert cell["INT4 x cuBLAS"] == "3.79" and cell["INT4 x dequant"] == "5.62" and cell["INT4 path"] == "decode"
    assert cell["INT4 weight GB/s"] == "1924" and cell["INT4 % copy"] == "45.3"
    assert cell["NVFP4 dequant + cuBLAS us"] == "error" and cell["NVFP4 us"] == "-" and cell["notes"] == "-"
    second = dict(zip(cols, (c.strip() for c in lines[3].strip("|").split("|"))))
    assert second["INT4 us"] == "173.0" and second["notes"] == "INT4 DIFF 2.5e-01 vs dequant"


def test_header_names_peers_schemes_and_bandwidth(mm):
    fake = types.SimpleNamespace(__version__="2.11.0")
    h = mm.header("NVIDIA H200", fake, ["int4", "float8_e4m3fn"], 0.5, 4.25e12)
    assert "torch 2.11.0" in h and "cuBLAS bf16 GEMM" in h and "dequantize_weight into one bf16 buffer" in h
    assert "INT4: INT4 uint4b8 g128" in h and "FP8: FP8 E4M3 g128" in h
    assert "copy bandwidth 4250 GB/s" in h and "0.5 s idle" in h
    assert "torch not available" in mm.header("GPU", None, ["nvfp4"], 0.0, 3.0e12)


def test_stream_handle_speaks_the_cuda_stream_protocol(mm):
    assert mm._StreamHandle(1234).__cuda_stream__() == (0, 1234)


class _FakeTimer:
    """Runs each call once (so that the stand-in matmul sees its arguments) and returns fixed times."""

    def __init__(self, ours=10e-6, torch=40e-6, fail=None):
        self.t_ours, self.t_torch, self.fail = ours, torch, fail
        self.calls = []

    def ours(self, fn, args_list, est):
        if self.fail:
            raise self.fail
        for args in args_list:
            fn(*args)
        self.calls.append(("ours", len(args_list)))
        return self.t_ours, None

    def torch_graph(self, torch, fn, args_list, est):
        self.calls.append(("torch", len(args_list)))
        return self.t_torch


class _Q:
    nbytes = 4096 * 4096 // 2 + 4096 * 32 * 2  # INT4 codes + bf16 scales of groups of 128


@pytest.fixture
def stubbed(mm, monkeypatch):
    """cupyquant.matmul and matmul_path replaced by recorders; the dequant + cuBLAS side by a stand-in
    that returns the timer's torch time and an agreement of ``state["agree"]``."""
    import cupyquant
    from cupyquant import weight

    state = {"matmul": [], "agree": (True, 1e-3)}

    def matmul(a, q, out=None, pdl=None):
        state["matmul"].append((q, out.shape, pdl))

    monkeypatch.setattr(cupyquant, "matmul", matmul, raising=False)
    monkeypatch.setattr(weight, "matmul_path", lambda M, w: "decode" if M <= 16 else "sm90_gemm")

    def dequant_cublas(torch, timer, a, plains, buf, est):
        return timer.torch_graph(torch, None, [(p,) for p in plains], est)

    monkeypatch.setattr(mm, "_dequant_cublas", dequant_cublas)
    monkeypatch.setattr(mm, "_vs_dequant", lambda torch, a, w, buf, y: state["agree"])
    return state


def _ctx(mm, timer, torch=None, no_pdl=False, paths=()):
    return mm.Context(torch, timer, 3.0e12, mm.Errors(), no_pdl, paths)


def test_scheme_cells_from_fake_timings(mm, stubbed):
    w = mm.Weights([_Q(), _Q()], [_Q(), _Q()])
    a, y = np.zeros((1, 4096), np.float32), np.zeros((1, 4096), np.float32)
    timer = _FakeTimer()
    row, notes = {}, []
    mm.scheme_cells("int4", w, a, y, "buf", 20e-6, _ctx(mm, timer, torch=object()), row, notes)
    assert [c[1:] for c in stubbed["matmul"]] == [((1, 4096), None)] * 2
    assert timer.calls == [("ours", 2), ("torch", 2)]
    assert row["INT4 us"] == pytest.approx(10.0) and row["INT4 path"] == "decode"
    assert row["INT4 TFLOP/s"] == pytest.approx(2 * 4096 * 4096 / 10e-6 / 1e12)
    assert row["INT4 x cuBLAS"] == pytest.approx(2.0)
    assert row["INT4 dequant + cuBLAS us"] == pytest.approx(40.0) and row["INT4 x dequant"] == pytest.approx(4.0)
    assert row["INT4 weight GB/s"] == pytest.approx(_Q.nbytes / 10e-6 / 1e9)
    assert row["INT4 % copy"] == pytest.approx(100 * _Q.nbytes / 10e-6 / 3.0e12)
    assert not notes
    # past 16 rows no weight rate; without torch no peer columns
    big_a, big_y = np.zeros((64, 4096), np.float32), np.zeros((64, 4096), np.float32)
    row = {}
    mm.scheme_cells("nvfp4", w, big_a, big_y, None, None, _ctx(mm, _FakeTimer()), row, notes)
    assert set(row) == {"NVFP4 us", "NVFP4 path", "NVFP4 TFLOP/s"} and row["NVFP4 path"] == "sm90_gemm"


def test_scheme_cells_extra_timings(mm, stubbed):
    w = mm.Weights([_Q()], [_Q()])
    a, y = np.zeros((16, 4096), np.float32), np.zeros((16, 1024), np.float32)
    timer = _FakeTimer()
    row = {}
    ctx = _ctx(mm, timer, no_pdl=True, paths=("decode", "sm80_gemm"))
    mm.scheme_cells("mxfp4", w, a, y, None, None, ctx, row, [])
    assert [c[2] for c in stubbed["matmul"]] == [None, False, None, None]
    assert row["MXFP4 no-PDL us"] == row["MXFP4 decode us"] == row["MXFP4 sm80_gemm us"] == pytest.approx(10.0)
    row = {}
    mm.scheme_cells("float8_e4m3fn", w, a, y, None, None, ctx, row, [])
    assert "FP8 no-PDL us" in row and "FP8 decode us" not in row  # FP8 has only the decode kernel


def test_scheme_cells_mark_errors_and_disagreement(mm, stubbed, capsys):
    w = mm.Weights([_Q()], [_Q()])
    a, y = np.zeros((1, 256), np.float32), np.zeros((1, 512), np.float32)
    row, notes = {}, []
    mm.scheme_cells("int4", ValueError("K"), a, y, None, None, _ctx(mm, _FakeTimer()), row, notes)
    assert row == {"INT4 us": "error"}
    row = {}
    ctx = _ctx(mm, _FakeTimer(fail=RuntimeError("capture")))
    mm.scheme_cells("int4", w, a, y, None, None, ctx, row, notes)
    assert row == {"INT4 us": "error"}
    ctx.errors.report()
    assert "INT4: matmul: RuntimeError: capture" in capsys.readouterr().err
    stubbed["agree"] = (False, 0.25)
    row = {}
    mm.scheme_cells("nvfp4", w, a, y, "buf", 1e-5, _ctx(mm, _FakeTimer(), torch=object()), row, notes)
    assert notes == ["NVFP4 DIFF 2.5e-01 vs dequant"] and row["NVFP4 x dequant"] == pytest.approx(4.0)


class _QW:
    """A stand-in QuantizedWeight: its byte count, copies and preparation."""

    nbytes = 256 * 512 // 2 + 256 * 4 * 2

    def copy(self):
        return _QW()


def test_a_stubbed_run_writes_the_table(bench, mm, stubbed, monkeypatch, tmp_path, capsys):
    """bench.py --matmul end to end with the GPU's parts replaced: NumPy arrays for CuPy's, fixed
    times for the timings, a stand-in torch."""
    import cupy

    import cupyquant
    from cupyquant import _bench, _device

    rng = np.random.default_rng(0)
    monkeypatch.setattr(
        cupy.random, "default_rng", lambda seed: types.SimpleNamespace(standard_normal=rng.standard_normal)
    )
    monkeypatch.setattr(cupy, "empty", np.empty)
    monkeypatch.setattr(cupy, "get_default_memory_pool", lambda: types.SimpleNamespace(free_all_blocks=lambda: None))
    monkeypatch.setattr(cupy.cuda, "Device", lambda: types.SimpleNamespace(id=0))
    monkeypatch.setattr(_device, "caps", lambda device: types.SimpleNamespace(pdl=True, wgmma=False))
    timers = []
    monkeypatch.setattr(_bench, "GraphTimer", lambda settle, budget: timers.append(_FakeTimer()) or timers[-1])
    monkeypatch.setattr(_bench, "copies_for", lambda nbytes: 2)
    monkeypatch.setattr(_bench, "copy_bandwidth", lambda: 3.0e12)
    monkeypatch.setattr(_bench, "device_name", lambda: "GPU")
    quantized = []
    monkeypatch.setattr(
        cupyquant, "quantize_weight", lambda w, s, **kw: quantized.append((s, kw)) or _QW(), raising=False
    )
    monkeypatch.setattr(cupyquant, "prepare_weight", lambda q: q, raising=False)
    torch = types.SimpleNamespace(
        __version__="2.11.0", from_dlpack=lambda v: v, cuda=types.SimpleNamespace(empty_cache=lambda: None)
    )
    monkeypatch.setattr(bench, "_load_torch", lambda skip: torch)
    out = tmp_path / "matmul.md"
    args = ["--matmul", "--matmul-ms", "1,64", "--matmul-shapes", "256x512", "--matmul-schemes", "int4,float8_e4m3fn"]
    bench.main(args + ["--matmul-no-pdl", "--matmul-paths", "--settle", "0", "--markdown", str(out)])
    assert quantized == [("int4", {"group_size": 128}), ("float8_e4m3fn", {"group_size": 128})]
    head, _, table = out.read_text().partition("\n\n")
    assert head.startswith("GPU, ") and "copy bandwidth 3000 GB/s" in head and "torch 2.11.0" in head
    lines = table.splitlines()
    cols = [c.strip() for c in lines[0].strip("|").split("|")]
    # no sm90_gemm column where the GPU has no wgmma; no notes column where every cell agreed
    assert cols == mm.columns(["int4", "float8_e4m3fn"], True, True, ("decode", "sm80_gemm"))[:-1]
    rows = [dict(zip(cols, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]
    assert [r["M"] for r in rows] == ["1", "64"]
    assert rows[0]["cuBLAS bf16 us"] == "40.0" and rows[0]["INT4 us"] == "10.0" and rows[0]["INT4 x cuBLAS"] == "4.00"
    assert rows[0]["FP8 dequant + cuBLAS us"] == "40.0" and rows[0]["FP8 x dequant"] == "4.00"
    assert rows[0]["INT4 % copy"] != "-" and rows[1]["INT4 % copy"] == "-"
    assert rows[1]["INT4 sm80_gemm us"] == "10.0" and rows[1]["FP8 no-PDL us"] == "10.0"
    # per cell: cuBLAS, then per scheme ours, dequant + cuBLAS, no-PDL and (INT4) two forced kernels
    assert len(timers[0].calls) == 2 * mm.timings_per_cell(["int4", "float8_e4m3fn"], True, True, ("decode", "x"))
    assert "INT4 us=10.0" in capsys.readouterr().out
