"""W8A8: matmuls of FP8 (or INT8) activations and FP8 (or INT8) weights on the tensor cores, with the
library's scales and zero points.

Modules: ``api`` (:func:`scaled_matmul`, :func:`scaled_mm`, :func:`scaled_mm_azp`), ``operands`` (argument checks and the
kernels' scale addressing), ``args`` (the kernels' argument struct), ``dispatch`` (the choice of
kernel), ``mma`` and ``sm90`` (the kernel families and their launches).
"""

from .api import scaled_matmul, scaled_mm, scaled_mm_azp
from .dispatch import UnsupportedGPUError

__all__ = ["UnsupportedGPUError", "scaled_matmul", "scaled_mm", "scaled_mm_azp"]
