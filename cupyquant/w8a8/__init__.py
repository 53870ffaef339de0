"""W8A8: matmuls of FP8 (or INT8) activations and FP8 (or INT8) weights on the tensor cores, with the
library's scales and zero points.

Modules: ``args`` (the kernels' argument struct and numbers), ``operands`` (argument checks, the
kernels' view of a call and its scale addressing), ``build`` (a call's operands from its arrays), one module per kernel,
each holding its tile table, its cost model and the plan of its launch: ``sm90``, ``sm90_small`` (at most 16
rows of a on Hopper) and ``mma``;
``dispatch`` (the choice of kernel) and ``api`` (:func:`scaled_matmul`, :func:`scaled_mm`,
:func:`scaled_mm_azp`, with their plans memoized per argument signature).
"""

from .api import scaled_matmul, scaled_mm, scaled_mm_azp

__all__ = ["scaled_matmul", "scaled_mm", "scaled_mm_azp"]
