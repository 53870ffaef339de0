"""Throughput of cupyquant.checkpoint against copying the same files with cp, on the same disk, in
one run: writes a synthetic Llama-like bf16 checkpoint (8 shards, about --gb GB), then times

- ``cp -r`` of the folder (the disk's read + write throughput, page cache dropped where allowed),
- the one-GPU quantization (``scheduler=None``),
- with more than one visible GPU, the Dask run (``scheduler="cuda"``, one worker per GPU),

and prints GB/s read for each and the ratios (targets: one GPU >= 0.70 x cp; Dask on two GPUs
>= 1.6 x one GPU where the disk is not the bound). Also checks that the Dask run's shards equal
the one-GPU run's byte for byte.

    python scripts/bench_checkpoint.py --dir /tmp/ckpt_bench --gb 8 --scheme fp8-block
"""

from __future__ import annotations

import argparse
import filecmp
import json
import shutil
import subprocess
import time
from pathlib import Path

import ml_dtypes
import numpy as np

# Llama-3-8B's projections (hidden 4096, intermediate 14336, 8 KV heads of 128)
HIDDEN, INTER, KV = 4096, 14336, 1024


def layer_tensors(i: int) -> dict:
    p = f"model.layers.{i}."
    return {
        p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
        p + "self_attn.k_proj.weight": (KV, HIDDEN),
        p + "self_attn.v_proj.weight": (KV, HIDDEN),
        p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
        p + "mlp.gate_proj.weight": (INTER, HIDDEN),
        p + "mlp.up_proj.weight": (INTER, HIDDEN),
        p + "mlp.down_proj.weight": (HIDDEN, INTER),
        p + "input_layernorm.weight": (HIDDEN,),
        p + "post_attention_layernorm.weight": (HIDDEN,),
    }


def write_model(path: Path, gb: float, shards: int = 8) -> float:
    """A bf16 model of about ``gb`` GB in ``shards`` files; returns its size in GB."""
    from safetensors.numpy import save_file

    per_layer = sum(int(np.prod(s)) * 2 for s in layer_tensors(0).values())
    layers = max(shards, round(gb * 1e9 / per_layer))
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    base = (rng.standard_normal(1 << 24) * 0.02).astype(ml_dtypes.bfloat16)
    weight_map = {}
    for s in range(shards):
        tensors = {}
        for i in range(s * layers // shards, (s + 1) * layers // shards):
            for name, shape in layer_tensors(i).items():
                n = int(np.prod(shape))
                tensors[name] = np.resize(np.roll(base, i * 7919 + n), n).reshape(shape)
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))
    return sum(p.stat().st_size for p in path.glob("*.safetensors")) / 1e9


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed(fn) -> float:
    dropped = drop_caches()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0, dropped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/cupyquant_ckpt_bench")
    ap.add_argument("--gb", type=float, default=8.0)
    ap.add_argument("--scheme", default="fp8-block")
    ap.add_argument("--max-shard-size", default="1GB", help="output shards: the Dask run's unit of work")
    args = ap.parse_args()
    import cupy

    from cupyquant.checkpoint import quantize_checkpoint

    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    src = root / "src"
    size = write_model(src, args.gb)
    n_gpu = cupy.cuda.runtime.getDeviceCount()
    rows = []

    t, dropped = timed(lambda: subprocess.run(["cp", "-r", str(src), str(root / "copy")], check=True))
    rows.append(("cp -r", t))

    def one():
        quantize_checkpoint(
            src, root / "one", args.scheme, max_shard_size=args.max_shard_size, progress=False, verbose=False
        )

    rows.append(("cupyquant, 1 GPU", timed(one)[0]))
    if n_gpu > 1:

        def many():
            quantize_checkpoint(
                src, root / "dask", args.scheme, max_shard_size=args.max_shard_size, scheduler="cuda", progress=False,
                verbose=False,
            )  # fmt: skip

        rows.append((f"cupyquant, Dask {n_gpu} GPUs", timed(many)[0]))
        same = all(
            filecmp.cmp(p, root / "dask" / p.name, shallow=False) for p in sorted((root / "one").glob("*.safetensors"))
        )
    print(f"{size:.2f} GB bf16 in 8 shards, scheme {args.scheme}, page cache dropped: {dropped}")
    print(f"{'run':<28} {'seconds':>8} {'GB/s read':>10} {'x cp':>6} {'x 1 GPU':>8}")
    for name, t in rows:
        print(f"{name:<28} {t:>8.2f} {size / t:>10.2f} {rows[0][1] / t:>6.2f} {rows[1][1] / t:>8.2f}")
    if n_gpu > 1:
        print(f"Dask shards byte-identical to the one-GPU run: {same}")


if __name__ == "__main__":
    main()
