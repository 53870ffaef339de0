"""The wheel carries the kernels, the type marker and the license, and an installed (non-editable) copy
finds its kernels."""

from __future__ import annotations

import ast
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
    kernels = ROOT / "kernels"
    sources = sorted(p.relative_to(kernels).as_posix() for p in kernels.rglob("*") if p.suffix in (".cu", ".cuh"))
    assert sources, "no kernel sources in the tree"
    for s in sources:
        assert f"cupyquant/kernels/{s}" in names, f"{s} missing from the wheel"
    modules = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "cupyquant").rglob("*.py"))
    for m in modules:
        assert m in names, f"{m} missing from the wheel (add its package to pyproject.toml's packages)"
    assert "cupyquant/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


@pytest.mark.slow
def test_wheel_metadata(wheel):
    z = zipfile.ZipFile(wheel)
    (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
    text = z.read(meta).decode()
    assert f"Version: {_source_version()}" in text.splitlines()
    assert "License-Expression: Apache-2.0" in text.splitlines()


def _source_version() -> str:
    """``__version__`` as a literal in cupyquant/__init__.py, the one place the version is written
    (setuptools reads it from there without importing the package)."""
    tree = ast.parse((ROOT / "cupyquant" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__version__"]:
            assert isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            return node.value.value
    raise AssertionError("cupyquant/__init__.py assigns no __version__ literal")


def test_version_is_one_literal():
    import cupyquant

    assert cupyquant.__version__ == _source_version()
    assert 'dynamic = ["version"]' in (ROOT / "pyproject.toml").read_text()


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
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert str(target) in out.stdout
