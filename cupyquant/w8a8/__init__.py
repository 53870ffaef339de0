"""W8A8: matmuls of FP8 activations and FP8 weights on the tensor cores, with the library's scales.

Modules: ``api`` (:func:`scaled_matmul`, :func:`scaled_mm`), ``operands`` (argument checks and the
kernels' scale addressing), ``args`` (the kernels' argument struct), ``dispatch`` (the choice of
kernel), ``mma`` and ``sm90`` (the kernel families and their launches).
"""

from .api import scaled_matmul, scaled_mm
from .dispatch import UnsupportedGPUError

__all__ = ["UnsupportedGPUError", "scaled_matmul", "scaled_mm"]
