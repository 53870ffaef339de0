"""Every fact about a GPU that the library depends on, read once per device and kept: its compute
capability and what that capability offers (:class:`Caps`), its multiprocessor count and shared
memory, and the compiler targets the kernel families are built for.

No other module compares compute capabilities: it asks here (``_device.caps(device).wgmma``), and
``tests/test_structure.py`` fails when a module outside this one does. A device attribute query
costs a few microseconds of host time, which the small-input hot path cannot afford, so
:func:`caps` is one dictionary lookup after the first call on a device.
"""

from __future__ import annotations

from typing import NamedTuple

#: Compute capabilities (as CuPy spells them) whose family-specific target (``-arch=sm_100a``) has
#: the FP4 and UE8M0 conversion instructions (Blackwell): the MX, NVFP4 and fused-norm families are
#: compiled for it there.
FP4_CVT_TARGETS = ("100", "101", "103", "110", "120", "121")
#: The compute capability of the warpgroup tensor-core instructions (wgmma) and the tensor memory
#: accelerator's tiled copies: the sm90 kernels exist only as ``-arch=sm_90a`` builds.
WGMMA_TARGETS = ("90",)
#: The targets the CPU test compiles every family for with NVRTC (no GPU needed).
NVRTC_TEST_TARGETS = ("80", "89", "90", "100", "120")


class UnsupportedGPUError(RuntimeError):
    """The GPU lacks the instructions an op needs (FP8 tensor cores below compute capability 8.9,
    INT8 ones below 8.0); raised before anything is allocated or launched."""


class Caps(NamedTuple):
    """What a GPU of one compute capability offers the kernels."""

    arch: str  # the compute capability as CuPy spells it, "90"
    int8_mma: bool  # INT8 mma.sync m16n8k32 (Ampere and newer)
    fp8_mma: bool  # FP8 mma.sync and the cvt.rn.satfinite FP8 conversions (8.9 and newer)
    wgmma: bool  # warpgroup MMA, TMA tiled copies and clusters built for sm_90a (9.0 only)
    pdl: bool  # programmatic dependent launch (griddepcontrol; 9.0 and newer)
    fp4_cvt: bool  # the FP4 and UE8M0 conversion instructions (Blackwell family-specific targets)

    @property
    def name(self) -> str:
        """``"9.0"``, for messages."""
        return f"{self.arch[:-1]}.{self.arch[-1]}"


def caps_of_arch(arch: str) -> Caps:
    """The :class:`Caps` of a compute capability as CuPy spells it (``"90"``, ``"120"``)."""
    cc = int(arch)
    return Caps(arch, cc >= 80, cc >= 89, arch in WGMMA_TARGETS, cc >= 90, arch in FP4_CVT_TARGETS)


_caps: dict = {}
_sms: dict = {}
_smem_per_sm: dict = {}
_smem_per_block: dict = {}


def caps(device: int) -> Caps:
    """The :class:`Caps` of ``device``."""
    c = _caps.get(device)
    if c is None:
        import cupy

        c = _caps[device] = caps_of_arch(cupy.cuda.Device(device).compute_capability)
    return c


def arch(device: int) -> str:
    """The compute capability of ``device`` as CuPy spells it (``"90"``), for keys and messages."""
    return caps(device).arch


def sm_count(device: int) -> int:
    """The number of streaming multiprocessors."""
    n = _sms.get(device)
    if n is None:
        import cupy

        n = _sms[device] = cupy.cuda.Device(device).attributes["MultiProcessorCount"]
    return n


def smem_per_sm(device: int) -> int:
    """Shared memory per multiprocessor, in bytes."""
    n = _smem_per_sm.get(device)
    if n is None:
        import cupy

        n = _smem_per_sm[device] = cupy.cuda.Device(device).attributes["MaxSharedMemoryPerMultiprocessor"]
    return n


def smem_per_block(device: int) -> int:
    """The most shared memory a block may use (the opt-in limit a launch can raise its kernel's to),
    in bytes: 227 KB on Hopper, 163 KB on the A100, 99 KB on compute capability 8.6, 8.9 and 12.x."""
    n = _smem_per_block.get(device)
    if n is None:
        import cupy

        rt = cupy.cuda.runtime
        n = _smem_per_block[device] = rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, device)
    return n


def current_device():
    """The current device's number, or None without a usable device."""
    import cupy

    try:
        return cupy.cuda.Device().id
    except cupy.cuda.runtime.CUDARuntimeError:
        return None


def specific_arch_option(targets, device: int):
    """The family-specific ``-arch=sm_XXa`` option for a family built for the family-specific
    ``targets`` (compute capabilities), on ``device``; None where the device is none of them."""
    a = arch(device)
    return f"-arch=sm_{a}a" if a in targets else None


def require(device: int, fact: str, what: str) -> Caps:
    """``device``'s Caps; raises :class:`UnsupportedGPUError` naming ``what`` when its ``fact``
    (a :class:`Caps` field) is false."""
    c = caps(device)
    if not getattr(c, fact):
        need = {"int8_mma": "8.0", "fp8_mma": "8.9", "wgmma": "9.0", "pdl": "9.0"}[fact]
        raise UnsupportedGPUError(
            f"{what} needs compute capability {need} or newer; device {device} has compute capability {c.name}"
        )
    return c
