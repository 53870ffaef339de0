"""Test hooks: kernels that only the tests launch, in a family of their own (``kernels/testing.cu``)
so that no production family compiles them.

The conversion checks run the element conversions of ``kernels/block_scale.cuh`` one float at a
time, built for the same targets as the MX and NVFP4 families (the Blackwell family-specific ones
have the FP4 and UE8M0 conversion instructions), so that the hardware path they test is the one the
quantizers use.
"""

from __future__ import annotations

import cupy
import numpy as np

from . import _device, _dtypes, _jit
from ._launch import ARG, Launch
from ._sizes import ceil_div

_BOOLS = (False, True)
_MX_TAGS = tuple(_dtypes.element_format(n).ctag for n in _dtypes.MX_NAMES)
FAMILY = _jit.register(
    "testing",
    _jit.product("cvt_check", _MX_TAGS, _BOOLS)
    + _jit.product("e8m0_check", _BOOLS)
    + _jit.product("fp4_frag_check", _dtypes.HALF_CTYPES)
    + _jit.product("fp4_scale_pairs_check", _dtypes.HALF_CTYPES),
    specific_targets=_device.FP4_CVT_TARGETS,
)


def _conversion_check(dtype, base: int, n: int, hardware: bool, patterns=None) -> cupy.ndarray:
    """Test hook: the codes of the float32 bit patterns ``base .. base + n - 1`` (or of the uint32
    device array ``patterns``) under the element conversion of ``dtype`` (``"float8_e8m0fnu"``: the
    E8M0 round-up of their magnitudes), by the hardware or the software path, as uint8."""
    if patterns is not None:
        n = patterns.size
    codes = cupy.empty((n,), dtype=np.uint8)
    device = codes.data.device_id
    if dtype == "float8_e8m0fnu":
        k = _jit.kernel(device, FAMILY, "e8m0_check", bool(hardware))
    else:
        k = _jit.kernel(device, FAMILY, "cvt_check", _dtypes.element_format(dtype).ctag, bool(hardware))
    Launch(k, (ceil_div(n, 256),), (256,), (ARG, np.uint32(base), np.int64(n), ARG))(patterns, codes)
    return codes


def _fp4_frag_check(ctype: str, base: int, n: int, words=None, regs: bool = False):
    """Test hook: weight_mma.cuh fp4_frag for the 16-bit type ``ctype`` on the words ``base .. base +
    n - 1`` (or the uint32 device array ``words``): (the number of registers that differ from the
    shift-and-mask form, and the registers as uint32 (n, 4) where ``regs``, else None)."""
    if words is not None:
        n = words.size
    out = cupy.empty((n, 4), dtype=np.uint32) if regs else None
    bad = cupy.zeros((1,), dtype=np.uint64)
    device = bad.data.device_id
    k = _jit.kernel(device, FAMILY, "fp4_frag_check", ctype)
    Launch(k, (ceil_div(n, 256),), (256,), (ARG, np.uint32(base), np.int64(n), ARG, ARG))(words, out, bad)
    return int(bad.get()[0]), out


def _fp4_scale_pairs_check(ctype: str, base: int, n: int) -> int:
    """Test hook: weight_mma.cuh fp4_scale_pairs (NVFP4) for the 16-bit type ``ctype`` on the words
    ``base .. base + n - 1``: the number of 16-bit scales that differ from fp4_scale2 of their byte
    (for the NaN bytes: that are not a NaN)."""
    bad = cupy.zeros((1,), dtype=np.uint64)
    k = _jit.kernel(bad.data.device_id, FAMILY, "fp4_scale_pairs_check", ctype)
    Launch(k, (ceil_div(n, 256),), (256,), (np.uint32(base), np.int64(n), ARG))(bad)
    return int(bad.get()[0])
