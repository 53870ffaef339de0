"""The W8A8 matmul's choice of kernel and its launch: ``"sm90"`` (kernels/scaled_mm_sm90.cu, wgmma,
compute capability 9.0) or ``"mma"`` (kernels/scaled_mm_mma.cu, mma.sync: FP8 on compute capability
8.9 and newer, INT8 on 8.0 and newer)."""

from __future__ import annotations

import contextlib

from .. import _device
from .args import INT8_ID, Operands

PATHS = ("sm90", "mma")
#: compute capabilities with FP8 tensor cores, as CuPy spells them
FP8_ARCHS = ("89", "90", "100", "101", "103", "110", "120", "121")
#: compute capabilities with INT8 mma.sync m16n8k32 (Ampere and newer)
INT8_ARCHS = ("80", "86", "87", "88") + FP8_ARCHS

#: The path tests and benchmarks force (_forced_path); None: path() decides.
_FORCED = None


class UnsupportedGPUError(RuntimeError):
    """The GPU has no tensor cores for the operands: FP8 needs compute capability 8.9, INT8 8.0."""


@contextlib.contextmanager
def _forced_path(path):
    """Private, for tests and benchmarks: within the block every W8A8 matmul takes ``path``
    (``"sm90"`` needs compute capability 9.0; ``"mma"`` runs on every GPU of :data:`FP8_ARCHS`, and
    INT8 on those of :data:`INT8_ARCHS`).
    Not thread-safe: it sets a module global."""
    global _FORCED
    if path is not None and path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    saved, _FORCED = _FORCED, path
    try:
        yield
    finally:
        _FORCED = saved


def check_arch(device: int, int8: bool = False) -> str:
    """The compute capability of ``device`` (``"90"``); raises :class:`UnsupportedGPUError` where
    it has no FP8 tensor cores (``int8``: no INT8 mma.sync). Called before any allocation or launch."""
    arch = _device.arch(device)
    if int8 and arch not in INT8_ARCHS:
        raise UnsupportedGPUError(
            f"scaled_matmul of INT8 operands needs compute capability 8.0 or newer (Ampere and later); device "
            f"{device} has compute capability {arch[:-1]}.{arch[-1]}"
        )
    if not int8 and arch not in FP8_ARCHS:
        raise UnsupportedGPUError(
            f"scaled_matmul needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, "
            f"Blackwell); device {device} has compute capability {arch[:-1]}.{arch[-1]}. "
            "Dequantize (cupyquant.dequantize) and multiply in 16 bits there, or use the weight-only "
            "matmul (cupyquant.matmul)."
        )
    return arch


def path(ops: Operands, arch: str) -> str:
    """The kernel that runs ``ops`` on a GPU of compute capability ``arch``."""
    if _FORCED is not None:
        return _FORCED
    return "sm90" if arch == "90" else "mma"


def run(ops: Operands) -> None:
    """Launch the matmul of ``ops`` on the current stream (writes ``ops.out2``)."""
    arch = check_arch(ops.device, ops.a_format == INT8_ID)
    if path(ops, arch) == "sm90":
        from . import sm90

        sm90.launch(ops)
    else:
        from . import mma

        mma.launch(ops)
