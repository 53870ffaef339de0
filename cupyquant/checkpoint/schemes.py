"""The checkpoint schemes: for each ``--scheme`` name, the weight format cupyquant quantizes to, the
compressed-tensors format and quantization arguments written into ``config.json``, the tensors
written per weight (names, dtypes, shapes), and the conversions between cupyquant's plain weight
layout and compressed-tensors' tensors. NumPy only.

compressed-tensors' conventions (its ``pack_quantized``, ``naive_quantized`` and ``fp4_quantized``
compressors and ``quantization.lifecycle.forward``, and vLLM's ``compressed_tensors`` schemes that
read them), and where cupyquant's differ:

- Every scale is a decode scale, ``w ~ (q - zero_point) * weight_scale``, as cupyquant's are, except
  NVFP4's ``weight_global_scale``, an encode scale (``S_enc = 2688 / amax``, the block scales are
  ``e4m3(amax_b / 6 * S_enc)``, ``w ~ e2m1(q) * e4m3(weight_scale) / S_enc``): it is what
  :func:`cupyquant.quantize_nvfp4` returns as ``global_scale``, written as it is; loading it back
  gives the weight's ``scale_2 = float32(1 / S_enc)`` through
  :meth:`cupyquant.QuantizedWeight.from_checkpoint`.
- ``pack-quantized`` stores signed 4-bit values ``v`` in ``[-8, 7]`` as the nibble ``v + 8``,
  eight per int32 word, element 0 in the low bits: in little-endian bytes, exactly cupyquant's
  packed uint8 data (two per byte, element 0 in the low nibble), viewed as int32. Symmetric INT4:
  cupyquant's ``uint4b8`` code ``q`` is that nibble. Asymmetric: compressed-tensors computes
  ``v = clamp(round(w / s) + zp, -8, 7)`` with a signed zero point ``zp`` in ``[-8, 7]`` and
  dequantizes ``(v - zp) * s``; cupyquant's ``uint4`` codes ``q = v + 8`` and zero points
  ``z = zp + 8`` give the same ``q - z``, and the stored nibbles of both are ``q`` and ``z``. The
  zero points are packed along the output dimension (``packed_dim=0``): word ``[i, g]`` holds
  rows ``8 i .. 8 i + 7`` of group ``g`` (row ``8 i + j`` in bits ``4 j``), the rows padded to a
  multiple of 8 with the nibble 0.
- ``weight_shape`` is int64 ``[N, K]`` (``torch.tensor(weight.shape)``).
- FP8 per channel and INT8 per channel: ``weight_scale`` ``(N, 1)`` in the weight's dtype;
  FP8 128 x 128 blocks: float32 ``(ceil(N / 128), ceil(K / 128))`` (vLLM holds it in float32;
  cupyquant's block scales are float32, so no rounding is added).
- NVFP4: ``weight_packed`` uint8 ``(N, K / 2)`` (element 0 in the low nibble), ``weight_scale``
  ``float8_e4m3fn`` ``(N, K / 16)``, ``weight_global_scale`` float32 ``(1,)``; W4A4 adds the
  activations' ``input_global_scale`` float32 ``(1,)``, also an encode scale.
- MXFP4 (``mxfp4-pack-quantized``): ``weight_packed`` uint8 ``(N, K / 2)``, ``weight_scale`` uint8
  ``(N, K / 32)``, the E8M0 exponent byte ``b`` of ``2^(b - 127)``.

The codes are cupyquant's round-to-nearest quantizers' (docs/weight_only.md): INT4 ``s = amax / 7``
and INT8 ``s = amax / 127``, where llm-compressor's min-max observer divides by 7.5 and 127.5; both
are valid checkpoints of the format, which stores whatever scale was used."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

#: K per group of the INT4 schemes and block of the FP8 block scheme.
GROUP = 128
BLOCK = 128
#: The name of the written tensors' dtypes in the safetensors header.
ST_DTYPE = {
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.float16): "F16",
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int16): "I16",
    np.dtype(np.uint16): "U16",
    np.dtype(np.int32): "I32",
    np.dtype(np.uint32): "U32",
    np.dtype(np.int64): "I64",
    np.dtype(np.uint64): "U64",
    np.dtype(np.bool_): "BOOL",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
    np.dtype(ml_dtypes.float8_e5m2): "F8_E5M2",
    np.dtype(ml_dtypes.float8_e8m0fnu): "F8_E8M0",
}
NP_DTYPE = {v: k for k, v in ST_DTYPE.items()}
#: The weight dtypes a scheme takes (safetensors names).
FLOAT_WEIGHTS = ("BF16", "F16", "F32")


def _args(num_bits, type_, strategy, *, symmetric=True, group_size=None, block_structure=None, dynamic=False):
    """compressed-tensors' ``QuantizationArgs`` as its ``model_dump`` writes them into config.json."""
    return {
        "num_bits": num_bits,
        "type": type_,
        "symmetric": symmetric,
        "group_size": group_size,
        "strategy": strategy,
        "block_structure": block_structure,
        "dynamic": dynamic,
        "actorder": None,
        "observer": None if dynamic else "minmax",
        "observer_kwargs": {},
    }


@dataclass(frozen=True)
class CheckpointScheme:
    """One ``--scheme``: ``fmt`` cupyquant's weight format (``quantize_weight``'s ``dtype``),
    ``group_size`` / ``block_size`` its arguments, ``ct_format`` compressed-tensors' format name,
    ``weights`` and ``input_activations`` the config's quantization arguments, ``k_multiple`` what K
    must be a multiple of, ``preset`` the llm-compressor preset it corresponds to."""

    name: str
    fmt: str
    group_size: int | None
    block_size: tuple | None
    ct_format: str
    weights: dict
    input_activations: dict | None
    k_multiple: int
    preset: str

    @property
    def packed(self) -> bool:
        """Whether the codes are written as ``weight_packed`` (4-bit formats) rather than ``weight``."""
        return self.fmt in ("int4", "uint4", "nvfp4", "mxfp4")


SCHEMES = {
    s.name: s
    for s in (
        CheckpointScheme(
            "fp8", "float8_e4m3fn", None, None, "float-quantized", _args(8, "float", "channel"),
            _args(8, "float", "token", dynamic=True), 2, "FP8_DYNAMIC",
        ),
        CheckpointScheme(
            "fp8-block", "float8_e4m3fn", None, (BLOCK, BLOCK), "float-quantized",
            _args(8, "float", "block", block_structure=[BLOCK, BLOCK]),
            _args(8, "float", "group", group_size=BLOCK, dynamic=True), 1, "FP8_BLOCK",
        ),
        CheckpointScheme(
            "w8a8-int8", "int8", None, None, "int-quantized", _args(8, "int", "channel"),
            _args(8, "int", "token", dynamic=True), 1, "W8A8",
        ),
        CheckpointScheme(
            "w4a16", "int4", GROUP, None, "pack-quantized", _args(4, "int", "group", group_size=GROUP), None,
            GROUP, "W4A16",
        ),
        CheckpointScheme(
            "w4a16-asym", "uint4", GROUP, None, "pack-quantized",
            _args(4, "int", "group", symmetric=False, group_size=GROUP), None, GROUP, "W4A16_ASYM",
        ),
        CheckpointScheme(
            "nvfp4", "nvfp4", 16, None, "nvfp4-pack-quantized", _args(4, "float", "tensor_group", group_size=16),
            _args(4, "float", "tensor_group", group_size=16, dynamic="local"), 16, "NVFP4",
        ),
        CheckpointScheme(
            "nvfp4a16", "nvfp4", 16, None, "nvfp4-pack-quantized", _args(4, "float", "tensor_group", group_size=16),
            None, 16, "NVFP4A16",
        ),
        CheckpointScheme(
            "mxfp4", "mxfp4", 32, None, "mxfp4-pack-quantized", _args(4, "float", "group", group_size=32), None, 32,
            "MXFP4A16",
        ),
    )
}  # fmt: skip

#: The largest K of an INT8 weight (quantize_weight's limit).
INT8_MAX_K = 1 << 24


def scheme_named(name) -> CheckpointScheme:
    if not isinstance(name, str):
        raise TypeError(f"scheme must be a str, one of {sorted(SCHEMES)}, got {type(name).__name__}")
    if name not in SCHEMES:
        raise ValueError(f"scheme must be one of {sorted(SCHEMES)}, got {name!r}")
    return SCHEMES[name]


def shape_problem(scheme: CheckpointScheme, shape) -> str | None:
    """Why a 2-D weight of ``shape`` cannot take ``scheme`` (None when it can)."""
    N, K = shape
    if K == 0 or N == 0:
        return f"has an empty dimension, shape {tuple(shape)}"
    if K % scheme.k_multiple:
        return (
            f"has K = {K} (shape {tuple(shape)}), which scheme {scheme.name!r} needs to be a multiple of "
            f"{scheme.k_multiple}"
        )
    if scheme.fmt == "int8" and K > INT8_MAX_K:
        return f"has K = {K}, more than scheme {scheme.name!r} takes (2^24)"
    return None


def tensor_layout(scheme: CheckpointScheme, shape, dtype: str) -> list:
    """``[(suffix, safetensors dtype, shape)]`` of the tensors written for one weight of ``shape``
    (N, K) and safetensors ``dtype``, in the order they are written; the suffix replaces the
    weight's ``weight``."""
    N, K = shape
    fmt = scheme.fmt
    if fmt == "float8_e4m3fn" and scheme.block_size is None:
        return [("weight", "F8_E4M3", (N, K)), ("weight_scale", dtype, (N, 1))]
    if fmt == "float8_e4m3fn":
        return [("weight", "F8_E4M3", (N, K)), ("weight_scale", "F32", (-(-N // BLOCK), -(-K // BLOCK)))]
    if fmt == "int8":
        return [("weight", "I8", (N, K)), ("weight_scale", dtype, (N, 1))]
    if fmt in ("int4", "uint4"):
        ng = K // scheme.group_size
        out = [("weight_packed", "I32", (N, K // 8)), ("weight_scale", dtype, (N, ng))]
        if fmt == "uint4":
            out.append(("weight_zero_point", "I32", (-(-N // 8), ng)))
        return out + [("weight_shape", "I64", (2,))]
    if fmt == "nvfp4":
        out = [
            ("weight_packed", "U8", (N, K // 2)),
            ("weight_scale", "F8_E4M3", (N, K // 16)),
            ("weight_global_scale", "F32", (1,)),
        ]
        if scheme.input_activations is not None:
            out.append(("input_global_scale", "F32", (1,)))
        return out
    if fmt == "mxfp4":
        return [("weight_packed", "U8", (N, K // 2)), ("weight_scale", "U8", (N, K // 32))]
    raise AssertionError(fmt)


def nbytes_of(layout) -> int:
    return sum(NP_DTYPE[dt].itemsize * int(np.prod(shape, dtype=np.int64)) for _, dt, shape in layout)


def _pack_rows(nibbles: np.ndarray) -> np.ndarray:
    """(N, C) values 0..15 packed along the rows, eight to an int32 word, row 8i + j in bits 4j."""
    N, C = nibbles.shape
    padded = np.zeros((-(-N // 8) * 8, C), np.uint32)
    padded[:N] = nibbles
    words = padded.reshape(-1, 8, C) << (4 * np.arange(8, dtype=np.uint32))[None, :, None]
    return np.bitwise_or.reduce(words, axis=1).view(np.int32)


def _unpack_rows(words: np.ndarray, N: int) -> np.ndarray:
    w = np.ascontiguousarray(words).view(np.uint32)
    nib = (w[:, None, :] >> (4 * np.arange(8, dtype=np.uint32))[None, :, None]) & 0xF
    return nib.reshape(-1, w.shape[1])[:N].astype(np.uint8)


def _pack_cols(nibbles: np.ndarray) -> np.ndarray:
    """(N, C) values 0..15 packed two per byte along C (element 0 in the low nibble), C padded to even."""
    N, C = nibbles.shape
    padded = np.zeros((N, C + C % 2), np.uint8)
    padded[:, :C] = nibbles
    return (padded[:, 0::2] | (padded[:, 1::2] << 4)).astype(np.uint8)


def _unpack_cols(packed: np.ndarray, C: int) -> np.ndarray:
    p = np.asarray(packed, np.uint8)
    out = np.empty((p.shape[0], 2 * p.shape[1]), np.uint8)
    out[:, 0::2] = p & 0xF
    out[:, 1::2] = p >> 4
    return out[:, :C]


def encode(scheme: CheckpointScheme, parts: dict, shape) -> list:
    """compressed-tensors' tensors ``[(suffix, array)]`` (in :func:`tensor_layout`'s order) of one
    weight from cupyquant's plain host parts: ``data``, ``scale``, ``zero_point`` (uint4, packed
    along K), ``global_scale`` (NVFP4's ``S_enc``, float32), ``input_global_scale`` (NVFP4 W4A4)."""
    N, K = shape
    fmt, data, scale = scheme.fmt, parts["data"], parts["scale"]
    if fmt == "float8_e4m3fn":
        return [("weight", data.view(ml_dtypes.float8_e4m3fn)), ("weight_scale", scale)]
    if fmt == "int8":
        return [("weight", data), ("weight_scale", scale)]
    if fmt in ("int4", "uint4"):
        out = [("weight_packed", np.ascontiguousarray(data).view("<i4")), ("weight_scale", scale)]
        if fmt == "uint4":
            ng = K // scheme.group_size
            out.append(("weight_zero_point", _pack_rows(_unpack_cols(parts["zero_point"], ng))))
        return out + [("weight_shape", np.array([N, K], np.int64))]
    if fmt == "nvfp4":
        out = [
            ("weight_packed", data),
            ("weight_scale", np.ascontiguousarray(scale).view(ml_dtypes.float8_e4m3fn)),
            ("weight_global_scale", np.asarray(parts["global_scale"], np.float32).reshape(1)),
        ]
        if scheme.input_activations is not None:
            out.append(("input_global_scale", np.asarray(parts["input_global_scale"], np.float32).reshape(1)))
        return out
    return [("weight_packed", data), ("weight_scale", np.ascontiguousarray(scale).view(np.uint8))]


def decode(scheme: CheckpointScheme, tensors: dict) -> dict:
    """cupyquant's plain host parts of one weight from its compressed-tensors tensors (keyed by
    suffix): ``data``, ``scale``, ``zero_point``, ``global_scale``, ``shape`` — the inverse of
    :func:`encode`. Checks the shapes and dtypes against :func:`tensor_layout`."""
    fmt = scheme.fmt
    if scheme.packed and fmt in ("int4", "uint4"):
        N, K = (int(v) for v in tensors["weight_shape"])
    elif scheme.packed:
        N, K = tensors["weight_packed"].shape[0], 2 * tensors["weight_packed"].shape[1]
    else:
        N, K = tensors["weight"].shape
    scale = tensors["weight_scale"]
    want = tensor_layout(scheme, (N, K), ST_DTYPE.get(scale.dtype, "?"))
    for suffix, dt, shp in want:
        if suffix == "input_global_scale":
            continue
        t = tensors.get(suffix)
        if t is None:
            raise ValueError(f"missing tensor {suffix!r} of a {scheme.ct_format} weight")
        if ST_DTYPE.get(t.dtype) != dt or tuple(t.shape) != tuple(shp):
            raise ValueError(f"tensor {suffix!r} is {t.dtype} {t.shape}, expected {dt} {shp} for weight ({N}, {K})")
    parts = {"shape": (N, K), "zero_point": None, "global_scale": None}
    if fmt == "float8_e4m3fn":
        parts.update(data=tensors["weight"].view(np.uint8), scale=scale)
    elif fmt == "int8":
        parts.update(data=tensors["weight"], scale=scale)
    elif fmt in ("int4", "uint4"):
        parts.update(data=np.ascontiguousarray(tensors["weight_packed"]).view(np.uint8), scale=scale)
        if fmt == "uint4":
            parts["zero_point"] = _pack_cols(_unpack_rows(tensors["weight_zero_point"], N))
    else:
        parts.update(data=tensors["weight_packed"], scale=np.ascontiguousarray(scale).view(np.uint8))
        if fmt == "nvfp4":
            parts["global_scale"] = np.asarray(tensors["weight_global_scale"], np.float32).reshape(1)
    return parts


def quantization_config(scheme: CheckpointScheme, targets, ignore) -> dict:
    """The ``quantization_config`` entry of config.json, as compressed-tensors writes it."""
    group = {
        "targets": list(targets),
        "weights": dict(scheme.weights),
        "input_activations": None if scheme.input_activations is None else dict(scheme.input_activations),
        "output_activations": None,
        "format": scheme.ct_format,
    }
    return {
        "config_groups": {"group_0": group},
        "format": scheme.ct_format,
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
    }


def scheme_of_config(qc: dict) -> CheckpointScheme:
    """The scheme whose config a ``quantization_config`` holds (one config group)."""
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        raise ValueError("config.json has no compressed-tensors quantization_config")
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"the quantization_config has {len(groups)} config groups; one is supported")
    g = groups[0]
    fmt = g.get("format") or qc.get("format")
    keys = ("num_bits", "type", "symmetric", "group_size", "strategy", "block_structure")
    for s in SCHEMES.values():
        same_w = all(g["weights"].get(k) == s.weights[k] for k in keys)
        a, sa = g.get("input_activations"), s.input_activations
        same_a = (a is None) == (sa is None) and (a is None or all(a.get(k) == sa[k] for k in keys))
        if fmt == s.ct_format and same_w and same_a:
            return s
    raise ValueError(
        f"the quantization_config's scheme (format {fmt!r}, weights {g.get('weights')}) is not one cupyquant writes"
    )
