"""cupyquant: CUDA quantization kernels for CuPy arrays, byte-exact with a NumPy reference.

The public API is re-exported here. The op modules import CuPy, so they load on first use:
``import cupyquant.reference`` works on a machine without CuPy.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "quantize_fp8": "per_tensor",
    "amax": "per_tensor",
    "quantize_groupwise": "groupwise",
    "silu_mul_quantize": "groupwise",
    "empty_scales": "groupwise",
    "quantize_mx": "mx",
    "quantize_nvfp4": "mx",
    "block_scale_shape": "mx",
    "quantize_weight": "weight",
    "dequantize_weight": "weight",
    "prepare_weight": "weight",
    "matmul": "weight",
    "QuantizedWeight": "weight",
    "dequantize": "quantized",
    "QuantizedTensor": "quantized",
    "Scheme": "quantized",
    "KernelCompileError": "_jit",
    "CudaHeadersNotFound": "_jit",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cupyquant' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def _all_families() -> dict:
    """Every kernel family and its instantiations: imports each op module, which registers its own
    families with the loader (``cupyquant._jit.register``)."""
    from . import _jit

    for module in sorted(set(_EXPORTS.values()) - {"_jit", "quantized"}):
        importlib.import_module(f"{__name__}.{module}")
    return _jit.families()


def __dir__():
    return __all__
