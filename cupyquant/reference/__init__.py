"""NumPy + ml_dtypes reference of every cupyquant op. Imports no CuPy. One module per family
(``per_tensor``, ``groupwise``, ``mx``, ``nvfp4``, ``norm``, ``kv_cache``, ``weight``, ``w8a8``); every public name is here.

Each function states its formula; the GPU kernels must match these bit for bit. Inputs are NumPy
arrays of float32, float16 or ml_dtypes.bfloat16. All float arithmetic is IEEE float32 with
subnormals (no flush-to-zero), as in TransformerEngine and vLLM: the kernels use explicit IEEE PTX
instructions wherever CuPy's forced ``-ftz=true`` could otherwise flush, so the reference needs no
FTZ model.

Conventions the bit patterns depend on:

- FP8 casts round to nearest even and saturate (``satfinite``): values past the max finite value,
  and +-inf, become +-max; every NaN becomes the canonical ``0x7f`` (positive), as the
  ``cvt.rn.satfinite`` instruction and CUDA's software path both do. ml_dtypes alone would give
  NaN for overflow and keep NaN signs, so :func:`cast_fp8` clamps and canonicalizes first.
- Dequantized NaNs carry CUDA's canonical patterns: ``0x7fff`` for float16 and bfloat16,
  ``0x7fffffff`` for float32 (NumPy would give ``0x7e00``/``0x7fc0``/``0x7fc00000``).
"""

from __future__ import annotations

from .._checks import WEIGHT_DTYPES, WEIGHT_GROUP_SIZES, weight_scheme
from .._layouts import pack_fp4, swizzle_offsets, swizzle_scales, swizzled_shape, unpack_fp4, unswizzle_scales
from ._common import (
    FLT_MAX,
    azp_codes,
    cast_fp8,
    e8m0_to_float,
    fp8_to_float,
    int8_rn,
    int32_rn,
    minus_zero_point,
    round_to,
)
from .groupwise import (
    FLT_EPSILON,
    GROUP_EPS,
    dequantize_groupwise,
    int8_azp_params,
    pow2_ceil,
    quantize_groupwise,
    quantize_silu_intermediate,
    scale_buffer,
    scale_word_offsets,
    silu_mul,
    silu_mul_from_exp,
    silu_mul_quantize,
    ue8m0,
)
from .kv_cache import KV_LAYOUTS, dequantize_kv_cache, kv_dynamic_scale, quantize_kv_cache
from .mx import (
    E2M1_MAX,
    MX_BLOCK,
    MX_EMAX,
    cast_e2m1,
    cast_elements,
    dequantize_mx,
    e2m1_to_float,
    e8m0_ceil,
    elements_to_float,
    mx_data_multiplier,
    mx_scale_exponent,
    quantize_mx,
)
from .norm import NORM_SCHEMES, NORM_UNIT, rms_norm, rms_norm_quantize, sum_of_squares
from .nvfp4 import NVFP4_BLOCK, NVFP4_RANGE, dequantize_nvfp4, nvfp4_global_scale, quantize_nvfp4
from .per_tensor import amax, compute_scale, dequantize_fp8, dequantize_int8, quantize_fp8, quantize_int8
from .w8a8 import (
    W8A8_BLOCK,
    W8A8_REL_ERROR,
    a_block_scales,
    b_block_scales,
    dequantize_operands,
    error_bound,
    int8_accumulate,
    round_result,
    scaled_mm,
    scaled_mm_int8,
    unpack_ue8m0_words,
)
from .weight import (
    AWQ_RANGE_FLOOR,
    FP4_WEIGHT_BLOCK,
    WEIGHT_MATMUL_REL_ERROR,
    dequantize_weight,
    dequantize_weight_blocks,
    dequantize_weight_fp4,
    dequantize_weight_int8,
    prepare_weight,
    quantize_weight,
    quantize_weight_blocks,
    quantize_weight_fp4,
    quantize_weight_int8,
    weight_code_sum,
    weight_matmul_blocks,
    weight_matmul_error_bound,
)

# Family by family, each op's helpers before it (docs/api.md lists the functions in this order).
__all__ = [
    # shared by every family: the FP8 casts and the rounding to the output dtype
    "FLT_MAX",
    "cast_fp8",
    "fp8_to_float",
    "round_to",
    # per tensor
    "amax",
    "compute_scale",
    "quantize_fp8",
    "dequantize_fp8",
    # INT8 conversions (vLLM's int8 kernels), static per-tensor INT8
    "int8_rn",
    "int32_rn",
    "azp_codes",
    "minus_zero_point",
    "quantize_int8",
    "dequantize_int8",
    # per token, per group, SiLU*Mul
    "GROUP_EPS",
    "FLT_EPSILON",
    "ue8m0",
    "pow2_ceil",
    "e8m0_to_float",
    "int8_azp_params",
    "quantize_groupwise",
    "silu_mul_from_exp",
    "silu_mul",
    "quantize_silu_intermediate",
    "silu_mul_quantize",
    "dequantize_groupwise",
    "scale_word_offsets",
    "scale_buffer",
    # MXFP8, MXFP4
    "MX_BLOCK",
    "MX_EMAX",
    "E2M1_MAX",
    "cast_e2m1",
    "e2m1_to_float",
    "cast_elements",
    "elements_to_float",
    "e8m0_ceil",
    "mx_scale_exponent",
    "mx_data_multiplier",
    "quantize_mx",
    "dequantize_mx",
    # NVFP4
    "NVFP4_BLOCK",
    "NVFP4_RANGE",
    "nvfp4_global_scale",
    "quantize_nvfp4",
    "dequantize_nvfp4",
    # the fused (residual add +) RMSNorm + quantization
    "NORM_UNIT",
    "NORM_SCHEMES",
    "sum_of_squares",
    "rms_norm",
    "rms_norm_quantize",
    # weight-only
    "WEIGHT_DTYPES",
    "WEIGHT_GROUP_SIZES",
    "AWQ_RANGE_FLOOR",
    "weight_scheme",
    "quantize_weight",
    "dequantize_weight",
    "quantize_weight_blocks",
    "dequantize_weight_blocks",
    "quantize_weight_int8",
    "weight_code_sum",
    "dequantize_weight_int8",
    "FP4_WEIGHT_BLOCK",
    "quantize_weight_fp4",
    "dequantize_weight_fp4",
    "prepare_weight",
    # the weight-only matmul of FP8 weights in 128 x 128 blocks
    "WEIGHT_MATMUL_REL_ERROR",
    "weight_matmul_blocks",
    "weight_matmul_error_bound",
    # the W8A8 matmul (FP8 and INT8)
    "W8A8_BLOCK",
    "W8A8_REL_ERROR",
    "unpack_ue8m0_words",
    "a_block_scales",
    "b_block_scales",
    "dequantize_operands",
    "scaled_mm",
    "scaled_mm_int8",
    "int8_accumulate",
    "round_result",
    "error_bound",
    # the FP8 paged KV cache
    "KV_LAYOUTS",
    "kv_dynamic_scale",
    "quantize_kv_cache",
    "dequantize_kv_cache",
    # FP4 packing and the swizzled scale layout (cupyquant._layouts)
    "pack_fp4",
    "unpack_fp4",
    "swizzled_shape",
    "swizzle_offsets",
    "swizzle_scales",
    "unswizzle_scales",
]
