"""cupyquant: CUDA quantization kernels for CuPy arrays, byte-exact with a NumPy reference.

The public API is re-exported here. The op modules import CuPy, so they load on first use:
``import cupyquant`` and ``cupyquant.reference`` (the NumPy oracle, also loaded on first use) work
on a machine without CuPy.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "quantize_fp8": "per_tensor",
    "amax": "per_tensor",
    "quantize_int8": "per_tensor",
    "quantize_groupwise": "groupwise",
    "silu_mul_quantize": "groupwise",
    "empty_scales": "groupwise",
    "quantize_mx": "mx",
    "quantize_nvfp4": "nvfp4",
    "block_scale_shape": "mx",
    "rms_norm_quantize": "norm",
    "quantize_weight": "weight",
    "dequantize_weight": "weight",
    "prepare_weight": "weight",
    "matmul": "weight",
    "QuantizedWeight": "weight",
    "scaled_matmul": "w8a8",
    "scaled_mm": "w8a8",
    "scaled_mm_azp": "w8a8",
    "quantize_kv_cache": "kv_cache",
    "dequantize_kv_cache": "kv_cache",
    "empty_kv_scale_cache": "kv_cache",
    "dequantize": "quantized",
    "QuantizedTensor": "quantized",
    "Scheme": "quantized",
    "KernelCompileError": "_jit",
    "KernelLaunchError": "_jit",
    "CudaHeadersNotFoundError": "_jit",
    "UnsupportedGPUError": "_device",
}

#: Submodules reachable as attributes of the package, imported on first access.
_SUBMODULES = ("reference",)
#: Private modules that register kernel families: test-only kernels, and the W8A8 kernels (their
#: public functions live in cupyquant.w8a8.api).
_PRIVATE_FAMILY_MODULES = ("_testing", "w8a8.mma", "w8a8.sm90")

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cupyquant' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] not in ("cupy", "cupy_backends"):
            raise
        raise ModuleNotFoundError(
            f"cupyquant.{name} needs CuPy, which is not installed ({e}). Install cupyquant with the extra that "
            'matches the "CUDA Version" that `nvidia-smi` shows: pip install "cupyquant[cu13]" for 13.x, '
            'pip install "cupyquant[cu12]" for 12.x (from a clone of the repository: pip install ".[cu13]" or '
            '".[cu12]"). cupyquant.reference (NumPy only) works without CuPy.',
            name=e.name,
        ) from e
    globals()[name] = value
    return value


def _all_families() -> dict:
    """Every kernel family and its instantiations: imports each op module, which registers its own
    families with the loader (``cupyquant._jit.register``)."""
    from . import _jit

    for module in sorted(set(_EXPORTS.values()) - {"_jit", "_device", "quantized"}) + list(_PRIVATE_FAMILY_MODULES):
        importlib.import_module(f"{__name__}.{module}")
    return _jit.families()


def __dir__():
    return __all__ + list(_SUBMODULES)
