"""Properties of a CUDA device that launches depend on, read once per device and kept.

Every op asks here rather than querying CuPy on each call: a device attribute query costs a few
microseconds of host time, which the small-input hot path cannot afford.
"""

from __future__ import annotations

import cupy

_arch: dict = {}
_sms: dict = {}
_smem_per_sm: dict = {}


def arch(device: int) -> str:
    """The compute capability as CuPy spells it (``"90"``)."""
    a = _arch.get(device)
    if a is None:
        a = _arch[device] = cupy.cuda.Device(device).compute_capability
    return a


def sm_count(device: int) -> int:
    """The number of streaming multiprocessors."""
    n = _sms.get(device)
    if n is None:
        n = _sms[device] = cupy.cuda.Device(device).attributes["MultiProcessorCount"]
    return n


def smem_per_sm(device: int) -> int:
    """Shared memory per multiprocessor, in bytes."""
    n = _smem_per_sm.get(device)
    if n is None:
        n = _smem_per_sm[device] = cupy.cuda.Device(device).attributes["MaxSharedMemoryPerMultiprocessor"]
    return n


def current_arch():
    """The current device's compute capability, or None without a usable device."""
    try:
        return arch(cupy.cuda.Device().id)
    except cupy.cuda.runtime.CUDARuntimeError:
        return None


def current_sm_count(default: int = 132) -> int:
    """The current device's multiprocessor count, or ``default`` (an H100 SXM) without one."""
    try:
        return sm_count(cupy.cuda.Device().id)
    except cupy.cuda.runtime.CUDARuntimeError:
        return default
