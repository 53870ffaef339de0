"""The wheel carries the kernels, and an installed (non-editable) copy finds them."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        check=True,
        cwd=out,
    )
    (whl,) = out.glob("cupyquant-*.whl")
    return whl


@pytest.mark.slow
def test_wheel_contains_every_kernel_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in (ROOT / "kernels").iterdir() if p.suffix in (".cu", ".cuh"))
    assert sources, "no kernel sources in the tree"
    for s in sources:
        assert f"cupyquant/kernels/{s}" in names, f"{s} missing from the wheel"
    assert "cupyquant/reference.py" in names


@pytest.mark.slow
def test_installed_copy_finds_its_kernels(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)], check=True
    )
    env = {k: v for k, v in os.environ.items() if k != "CUPYQUANT_KERNEL_DIR"}
    env["PYTHONPATH"] = str(target)
    code = (
        "import cupyquant, cupyquant._jit as j; d = j.kernel_dir(); print(d); "
        "assert str(d).startswith(%r), d; assert 'namespace cq' in j.source('per_tensor')" % str(target)
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert str(target) in out.stdout
