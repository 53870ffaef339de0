"""Weight-only quantization (INT4 as GPTQ/Marlin and AWQ, FP8 for W8A16 in groups, per channel or
in 128 x 128 blocks with float32 scales, NVFP4 and MXFP4) and the matmul that dequantizes the
weights in registers; also the weights of the W8A8 matmul (:func:`cupyquant.scaled_matmul`): FP8
in 128 x 128 blocks (which both matmuls take) and INT8 per output channel (with their code sums),
which the weight-only matmul does not take.

Kernels: ``kernels/weight_quant.cu`` (quantize, dequantize), ``kernels/weight_decode.cu`` (the
matmul for few rows of activations), ``kernels/weight_sm80_gemm.cu`` and
``kernels/weight_sm90_gemm.cu`` (the matmul for more rows); FP4 weights are quantized by the
NVFP4 and MX kernels (``kernels/nvfp4.cu``, ``kernels/mx.cu``). Reference:
:func:`cupyquant.reference.quantize_weight` and :func:`cupyquant.reference.dequantize_weight`.

Modules, each importing only those before it: ``formats`` (the formats, their kernel numbers and
schemes), ``quant`` (the kernels of ``weight_quant.cu``), ``layout`` (the copies between the two
data layouts), ``checks`` (a weight's array invariants), ``checkpoint`` (parsing
:meth:`QuantizedWeight.from_checkpoint`'s arguments), ``container`` (:class:`QuantizedWeight`),
``quantize`` (:func:`quantize_weight`, :func:`dequantize_weight`, :func:`prepare_weight`); then one
module per matmul kernel, each holding its configuration table (rows are template arguments), its
cost model and the plan of its launches: ``decode``, ``sm80_gemm``, ``sm90_gemm`` (on ``problem``,
what they share); and ``dispatch`` (:func:`matmul`, :func:`matmul_path`: the thresholds between the
kernels and the planner). Only the names exported here are public.

Layouts. The plain layout is the interchange format (what :func:`quantize_weight` returns, what
:meth:`QuantizedWeight.to_host` gives, what to store): ``w`` is ``(N, K)`` in PyTorch Linear's
``[out, in]`` order; INT4 data ``(N, K / 2)`` uint8 with element 0 in the low nibble, FP8 data
``(N, K)`` uint8, INT8 data ``(N, K)`` int8 (with int32 code sums ``(N,)``); scales ``(N, K / G)``
(``G`` the group size) in the weight's dtype, by which ``q - z`` is multiplied; uint4 zero points
``(N, ceil(K / G / 2))`` uint8, packed like the data. FP4: data ``(N, K / 2)`` uint8 of E2M1 codes
(packed as INT4's), scales ``(N, K / B)`` uint8, the E4M3 (NVFP4, ``B = 16``) or E8M0 (MXFP4,
``B = 32``) byte of each block of B along K, and NVFP4's float32 ``scale_2`` ``(1,)``:
``w ~ e2m1(q) * e4m3(s) * scale_2`` or ``w ~ e2m1(q) * 2^(s - 127)``.

The matmul kernels read the prepared layout that :func:`prepare_weight` makes on the GPU (once, at
load time, as Marlin's repacking): the rows in tiles of 16 (the last padded with zero rows), each
tile's K cut into chunks of 128 INT4 or 64 FP8 elements (64 bytes a row) stored one after the
other, 1 KB a chunk. INT4 data ``(ceil(N / 16), K / 128, 2, 32, 16)`` uint8 in fragment order: each
32-bit word holds the 8 codes that one lane of a warp feeds to one k16 tensor-core step (rows g and
g + 8 of the tile, k ``2t, 2t + 1, 2t + 8, 2t + 9`` of the step), arranged so that a shift and a
lop3 take out two codes at once, and each 16-byte piece holds the four lanes' words of one step,
so that the two pieces ``4 g + j`` of a chunk hold every code of rows g and g + 8 at k
``32 j .. 32 j + 31``; where the groups are whole chunks (``group_size`` a multiple of 128, or
per-channel), each chunk's 4 x 4 blocks of 8 k are transposed first, so that the four lanes of the
decode kernel that share a row read its activations 64 contiguous bytes at a time
(:func:`cupyquant.reference.prepare_weight` has the exact map). FP8
data ``(ceil(N / 16), K / 64, 16, 64)``: the 16 rows x 64 bytes of a chunk. Scales
``(ceil(N / 16), K / G, 16)`` (a tile's 16 scales of a group together; FP8 in 128 x 128 blocks:
float32 ``(ceil(N / 16), ceil(K / 128), 16)``, each block scale repeated for the rows of its block); uint4 zero points
``(ceil(N / 16), K / G, 8)`` uint8 (row ``i`` of the tile in the low nibble of byte ``i / 2`` when
``i`` is even, the high one when odd). FP4 data: INT4's fragment order, always with the chunks'
4 x 4 blocks of 8 k transposed; FP4 scales ``(ceil(N / 16), K / 128, 16, 128 / B)`` uint8: each
tile's bytes of a chunk together, a row's ``128 / B`` bytes (the chunk's blocks in k order)
contiguous; ``scale_2`` unchanged. It is private to the kernels and may change between
versions; :func:`matmul` takes a plain weight too, converting it on every call (a copy of the
weight: prepare once instead).
"""

from __future__ import annotations

from ..quantized import register_container
from .container import QuantizedWeight
from .dispatch import _forced_path as _forced_path  # private: tests and benchmarks force a kernel
from .dispatch import matmul, matmul_path
from .quantize import dequantize_weight, prepare_weight, quantize_weight

__all__ = ["QuantizedWeight", "dequantize_weight", "matmul", "matmul_path", "prepare_weight", "quantize_weight"]

register_container(QuantizedWeight, dequantize_weight)
