"""``python -m cupyquant.checkpoint SRC DST --scheme SCHEME``: quantize a Hugging Face model folder
into a compressed-tensors checkpoint (:func:`cupyquant.checkpoint.quantize_checkpoint`). Exit status
0 on success, 2 for a command-line error or an input that cannot be used (nothing written)."""

from __future__ import annotations

import argparse
import sys

from . import DEFAULTS, SCHEMES, quantize_checkpoint


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cupyquant.checkpoint",
        description="Quantize the linear weights of a Hugging Face safetensors model folder into a "
        "compressed-tensors checkpoint (vLLM, SGLang), with a round-trip report.",
        epilog="exit status: 0 done; 2 command-line error or unusable input (nothing written under DST)",
    )
    p.add_argument("src", help="the model folder: config.json and model.safetensors or an index and its shards")
    p.add_argument("dst", help="the folder to write (created; must be empty unless --overwrite)")
    p.add_argument("--scheme", required=True, choices=sorted(SCHEMES), help="the quantization scheme")
    p.add_argument(
        "--targets", nargs="+", default=None, help=f"modules to quantize (default {' '.join(DEFAULTS['targets'])})"
    )
    p.add_argument(
        "--ignore", nargs="*", default=None, help=f"modules to leave (default {' '.join(DEFAULTS['ignore'])})"
    )
    p.add_argument("--max-shard-size", default=DEFAULTS["max_shard_size"], help="largest output shard (default 5GB)")
    p.add_argument("--cpu", action="store_true", help="quantize with the NumPy reference even where a GPU is present")
    p.add_argument("--device", type=int, default=None, help="the CUDA device (default 0)")
    p.add_argument(
        "--dask", action="store_true", help="one Dask task per shard on a LocalCUDACluster (one worker a GPU)"
    )
    p.add_argument("--scheduler-address", default=None, help="run the Dask tasks on this cluster (tcp://host:8786)")
    p.add_argument(
        "--input-global-scale",
        type=float,
        default=1.0,
        help="nvfp4 (W4A4): the activations' encode scale (default 1.0)",
    )
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty DST")
    p.add_argument("--plot", action="store_true", help="draw cupyquant_report.png (matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    scheduler = args.scheduler_address or ("cuda" if args.dask else None)
    device = "cpu" if args.cpu else args.device
    try:
        quantize_checkpoint(
            args.src, args.dst, args.scheme, targets=args.targets, ignore=args.ignore,
            max_shard_size=args.max_shard_size, device=device, scheduler=scheduler,
            input_global_scale=args.input_global_scale, overwrite=args.overwrite, progress=not args.no_progress,
            plot=args.plot,
        )  # fmt: skip
    except (TypeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
