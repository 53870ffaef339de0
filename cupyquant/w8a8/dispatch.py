"""The W8A8 matmul's planner: the choice of kernel, ``"sm90"`` (kernels/scaled_mm_sm90.cu, wgmma,
compute capability 9.0; calls of at most 16 rows of a: kernels/scaled_mm_sm90_small.cu) or ``"mma"`` (kernels/scaled_mm_mma.cu, mma.sync: FP8 on compute capability
8.9 and newer, INT8 on 8.0 and newer), and the planned launch of a call's layout."""

from __future__ import annotations

import contextlib

from .. import _device
from . import mma, sm90, sm90_small

PATHS = ("sm90", "mma")

#: The path tests and benchmarks force (_forced_path); None: path() decides.
_FORCED = None


@contextlib.contextmanager
def _forced_path(path):
    """Private, for tests and benchmarks: within the block every W8A8 matmul takes ``path``
    (``"sm90"`` needs compute capability 9.0; ``"mma"`` runs on every GPU with FP8 tensor cores,
    and INT8 on those with INT8 ones). Not thread-safe: it sets a module global."""
    global _FORCED
    if path is not None and path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    saved, _FORCED = _FORCED, path
    try:
        yield
    finally:
        _FORCED = saved


def check_arch(device: int, int8: bool = False) -> _device.Caps:
    """The capabilities of ``device``; raises :class:`cupyquant.UnsupportedGPUError` where it has
    no FP8 tensor cores (``int8``: no INT8 mma.sync). Called before any allocation or launch."""
    caps = _device.caps(device)
    if int8 and not caps.int8_mma:
        raise _device.UnsupportedGPUError(
            f"scaled_matmul of INT8 operands needs compute capability 8.0 or newer (Ampere and later); device "
            f"{device} has compute capability {caps.name}"
        )
    if not int8 and not caps.fp8_mma:
        raise _device.UnsupportedGPUError(
            f"scaled_matmul needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, "
            f"Blackwell); device {device} has compute capability {caps.name}. "
            "Dequantize (cupyquant.dequantize) and multiply in 16 bits there, or use the weight-only "
            "matmul (cupyquant.matmul)."
        )
    return caps


def path(caps: _device.Caps) -> str:
    """The kernel that runs a call on a GPU of capabilities ``caps``."""
    if _FORCED is not None:
        return _FORCED
    return "sm90" if caps.wgmma else "mma"


def plan(L):
    """The planned launch of the call layout ``L`` (an operands.Layout with M and N > 0) on the
    kernel :func:`path` picks; raises UnsupportedGPUError first where the GPU cannot run it."""
    caps = check_arch(L.device, L.a_format == "int8")
    if path(caps) == "sm90":
        return sm90_small.MmSmallLaunch(L) if sm90_small.takes(L) else sm90.MmLaunch(L)
    return mma.MmLaunch(L)
