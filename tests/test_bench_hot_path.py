"""The CPU parts of the fused-norm and KV-cache benchmarks (scripts/bench_norm.py and
scripts/bench_kv_cache.py, reached through scripts/bench.py --norm / --kv-cache): the cases, the
bytes each row counts, the arguments each scheme gets, and the table. The timings need a GPU."""

from __future__ import annotations

import pytest
from _scripts import load_script

pytest.importorskip("cupy")  # bench.py imports CuPy (which imports without a GPU)


@pytest.fixture(scope="module")
def bench():
    return load_script("bench")


def test_norm_cases_and_bytes(bench):
    bn = bench.bench_norm
    cases = bn.parse_cases(None)
    assert {c.scheme for c in cases} == set(bn.SCHEMES)
    assert {(c.M, c.H) for c in cases if c.scheme == "token"} == set(bn.SHAPES)
    assert [c.scheme for c in bn.parse_cases("7x64")] == list(bn.SCHEMES)  # a new shape: every scheme
    assert [c.label for c in bn.parse_cases("1x4096")] == ["1x4096", "1x4096"]
    # x and the residual read, the residual written (2 bytes each), q and the scales written
    n = 4096 * 8192
    assert bn.io_bytes(bn.Case(4096, 8192, "token")) == 6 * n + n + 4 * 4096
    assert bn.io_bytes(bn.Case(4096, 8192, "group128")) == 7 * n + 4 * n // 128
    assert bn.io_bytes(bn.Case(4096, 8192, "nvfp4")) == 6 * n + n // 2 + n // 16


def test_norm_scheme_arguments_are_the_ops(bench):
    import inspect

    import cupyquant as cq

    params = inspect.signature(cq.rms_norm_quantize).parameters
    for scheme in bench.bench_norm.SCHEMES:
        kw = bench.bench_norm.quant_kwargs(scheme)
        assert set(kw) <= set(params) and kw["scheme"] in cq.norm.SCHEMES


def test_kv_cases_and_bytes(bench):
    bk = bench.bench_kv_cache
    cases = bk.parse_cases(None)
    assert {c.mode for c in cases} == {"static", "dynamic"} and {c.kv_layout for c in cases} == {"NHD", "HND"}
    c = bk.Case(4096, 8, 128, "static")
    n = 4096 * 8 * 128
    assert bk.io_bytes(c) == 2 * 2 * n + 8 * 4096 + 2 * n
    assert bk.io_bytes(bk.Case(4096, 8, 128, "dynamic")) == bk.io_bytes(c) + 2 * 4096 * 8 * 4


def test_table(bench):
    lines = bench._table(["a", "us"], [{"a": "x", "us": 1.234}, {"a": "y"}])
    assert lines == ["| a | us |", "|---|---|", "| x | 1.23 |", "| y | - |"]


def test_list_runs_without_a_gpu(bench, capsys):
    bench.main(["--norm", "--list", "--norm-cases", "16x4096"])
    bench.main(["--kv-cache", "--list", "--kv-cache-cases", "256x8x128"])
    out = capsys.readouterr().out.split("\n")
    assert "16x4096 token" in out and "256x8x128 static NHD" in out
