"""What a newcomer sees when CuPy, the driver or the GPU is missing (CPU only: the missing pieces are
simulated, CuPy by an import blocker in a subprocess, CUDA runtime errors by a stand-in module)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from cupyquant import __main__ as report

ROOT = Path(__file__).resolve().parents[1]

# Prepended to a subprocess's code: any import of cupy (or its submodules) fails as if not installed.
BLOCK_CUPY = """
import sys
class _NoCupy:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("cupy", "cupy_backends"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoCupy())
"""


def _python(code: str):
    return subprocess.run([sys.executable, "-c", BLOCK_CUPY + code], cwd=ROOT, capture_output=True, text=True)


def test_op_without_cupy_names_the_extras():
    r = _python(
        "import cupyquant, cupyquant.reference, numpy as np\n"
        "q, s = cupyquant.reference.quantize_fp8(np.ones(4, np.float32))\n"  # the reference works
        "try:\n"
        "    cupyquant.quantize_fp8\n"
        "except ModuleNotFoundError as e:\n"
        "    print(e.name); print(e)\n"
    )
    assert r.returncode == 0, r.stderr
    name, msg = r.stdout.split("\n", 1)
    assert name == "cupy"
    for part in (
        "cupyquant.quantize_fp8 needs CuPy",
        'pip install "cupyquant[cu13]"',
        'pip install "cupyquant[cu12]"',
        'from a clone of the repository: pip install ".[cu13]" or ".[cu12]"',  # the README's form
        "nvidia-smi",
        "CUDA Version",
    ):
        assert part in msg, (part, msg)


def test_report_without_cupy_says_so():
    r = _python("import runpy; runpy.run_module('cupyquant', run_name='__main__')")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr  # one line
    for part in ("CuPy is not installed", 'pip install "cupyquant[cu13]"', 'pip install ".[cu13]"'):
        assert part in r.stderr, (part, r.stderr)
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("columns", ["40", "100", "300"])
def test_report_help_exits_0_and_fits_100_columns(columns):
    env = {**os.environ, "COLUMNS": columns}
    r = subprocess.run([sys.executable, "-m", "cupyquant", "--help"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: python -m cupyquant")
    wide = [line for line in r.stdout.splitlines() if len(line) > min(100, int(columns))]
    assert not wide, wide
    text = " ".join(r.stdout.split())
    assert "exit status: 0 when every scheme's bytes" in text
    assert "1 without a usable GPU" in text and "2 for a command-line error" in text
    assert "3 when a scheme's bytes differ from the reference" in text
    assert "\n\nA second table" in r.stdout  # the description keeps its paragraphs


def test_report_exit_statuses_are_distinct(monkeypatch, capsys):
    """A mismatch exits 3, a command-line error 2 (argparse), no GPU 1, a clean report 0."""
    assert (report.EXIT_OK, report.EXIT_NO_GPU, report.EXIT_USAGE, report.EXIT_MISMATCH) == (0, 1, 2, 3)
    monkeypatch.setattr(report, "_gpu_or_reason", lambda: None)
    monkeypatch.setattr(report, "_report", lambda: False)
    assert report.main([]) == 3
    monkeypatch.setattr(report, "_report", lambda: True)
    assert report.main([]) == 0
    with pytest.raises(SystemExit) as info:
        report.main(["--no-such-flag"])
    assert info.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


class _CudaError(RuntimeError):
    def __init__(self, status):
        super().__init__(f"cuda error {status}")
        self.status = status


def _fake_cupy(monkeypatch, *, count=None, status=None, driver=0, runtime=13000):
    """Install a stand-in ``cupy`` whose getDeviceCount returns ``count`` or raises ``status``."""

    def get_count():
        if status is not None:
            raise _CudaError(status)
        return count

    rt = types.SimpleNamespace(
        CUDARuntimeError=_CudaError,
        getDeviceCount=get_count,
        driverGetVersion=lambda: driver,
        runtimeGetVersion=lambda: runtime,
    )
    monkeypatch.setitem(
        sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=rt), __version__="14.2.0")
    )


@pytest.mark.parametrize(
    "kw, libcuda, expected",
    [
        (dict(status=35, driver=0), False, "no NVIDIA driver: libcuda.so.1 was not found"),
        (dict(status=35, driver=12040), False, "no NVIDIA driver: libcuda.so.1 was not found"),
        (dict(status=35, driver=12040), True, "an NVIDIA driver for CUDA 12.4, older than the CUDA 13.0"),
        (dict(status=34), True, "the CUDA toolkit's stub"),
        (dict(status=100), True, "no CUDA device: the driver sees none"),
        (dict(count=0), True, "no CUDA device: the driver sees none"),
        (dict(status=999), True, "no usable CUDA device (cuda error 999)"),
    ],
)
def test_report_tells_driver_problems_apart(monkeypatch, kw, libcuda, expected):
    _fake_cupy(monkeypatch, **kw)
    monkeypatch.setattr(report, "_have_libcuda", lambda: libcuda)
    reason = report._gpu_or_reason()
    assert reason is not None and expected in reason, reason


def test_report_older_driver_names_the_extras(monkeypatch):
    _fake_cupy(monkeypatch, status=35, driver=12080)
    monkeypatch.setattr(report, "_have_libcuda", lambda: True)
    assert "cupyquant[cu12]" in report._gpu_or_reason()


def test_report_with_a_device_has_no_reason(monkeypatch):
    _fake_cupy(monkeypatch, count=1)
    assert report._gpu_or_reason() is None


def test_report_exit_status_without_gpu(monkeypatch, capsys):
    _fake_cupy(monkeypatch, status=100)
    assert report.main([]) == 1
    assert "cupyquant: the report needs a GPU; found no CUDA device" in capsys.readouterr().err
