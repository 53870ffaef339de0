"""QuantizedWeight: a quantized weight, its scales and zero points, the scheme that made them, and
its data layout; :func:`check_weight`, the invariants every op checks it against.

The methods that convert or dequantize a weight call the modules below this one (``layout``,
``quant``, ``checkpoint``), which take a weight and make new ones through ``_with``, so that this
module imports none of the functions that make weights from scratch (``quantize``)."""

from __future__ import annotations

import numpy as np

from .. import _plans
from ..quantized import Scheme
from . import checkpoint, checks, layout, quant
from .formats import CHUNK, DATA_LAYOUTS, DEFAULT_BLOCK_SIZE, FP4_SCALE_DTYPES


class QuantizedWeight:
    """A weight quantized by :func:`quantize_weight` (or read from a checkpoint by
    :meth:`from_checkpoint`): ``w ~ (q - zero_point) * scale`` per group, or per 2-D block; FP4
    ``w ~ e2m1(q) * scale`` (times ``scale_2`` for NVFP4).

    Attributes
    ----------
    data : cupy.ndarray
        The codes ``q``, uint8 ``(N, K / 2)`` (INT4, or FP4's E2M1 codes; element 0 in the low
        nibble) or ``(N, K)`` (FP8 bytes), or int8 ``(N, K)`` (INT8 codes, any K); prepared:
        ``(ceil(N / 16), K / 128, 2, 32, 16)`` (INT4 and FP4) or ``(ceil(N / 16), K / 64, 16, 64)``
        (FP8) (the module's docstring).
    scale : cupy.ndarray
        Dequantization scales, multiplied into ``q - zero_point``: ``(N, K / group_size)`` in the
        original weight's dtype (from a checkpoint: the checkpoint's dtype); prepared:
        ``(ceil(N / 16), K / group_size, 16)``. Block weights: float32
        ``(ceil(N / 128), ceil(K / 128))``, the scale of rows ``128 i ..`` and columns ``128 j ..``
        at ``[i, j]`` (DeepSeek-V3's ``weight_scale_inv``). FP4: the scale bytes, uint8
        ``(N, K / block)`` (NVFP4: E4M3, block 16; MXFP4: E8M0 ``2^(b - 127)``, block 32), the byte
        of row n and k at ``[n, k // block]``; prepared: ``(ceil(N / 16), K / 128, 16, 128 / block)``.
    zero_point : cupy.ndarray or None
        uint4 only: the codes of zero, uint8 ``(N, ceil(K / group_size / 2))``, packed like the
        data; prepared: ``(ceil(N / 16), K / group_size, 8)``. int4 has the implicit zero point 8,
        FP8 and INT8 none.
    code_sum : cupy.ndarray or None
        INT8 weights only: ``sum_k q[n, k]`` per output channel, int32 ``(N,)``, exact, on the
        data's device; None for every other format. Computed once when the weight is made
        (:func:`quantize_weight`, :meth:`from_checkpoint`, or the constructor when not given), so
        that a W8A8 GEMM with asymmetric INT8 activations can remove their zero points as
        ``acc - z(m) * code_sum(n)`` (vLLM's ``azp_adj``) without reading the weight again. Kept
        with the weight by :meth:`copy` and :meth:`to_host`; if you write into ``data``, rebuild
        the weight (or its ``code_sum``).
    scale_2 : cupy.ndarray or None
        NVFP4 only: the float32 ``(1,)`` decode scale of the whole weight (ModelOpt's
        ``weight_scale_2``), ``w ~ e2m1(q) * (e4m3(scale) * scale_2)``; from :func:`quantize_weight`
        ``float32(1 / S_enc)``, ``S_enc`` the global scale of :func:`cupyquant.quantize_nvfp4`
        (from :meth:`from_checkpoint`: the one given, or ``1 / global_scale``). Kept by
        :meth:`copy` (copied), :meth:`prepare` and :meth:`plain`, given by :meth:`to_host`. None for
        every other format.
    scheme : Scheme
        ``format`` ``"int4"`` (symmetric, codes ``q - 8``), ``"uint4"`` (asymmetric, ``q - z``),
        ``"float8_e4m3fn"``, ``"int8"`` (symmetric, W8A8 INT8: one scale per output channel, plain
        layout only), ``"nvfp4"`` or ``"mxfp4"``; ``granularity`` ``"group"``, ``"channel"`` (one
        scale per output channel) or ``"block"`` (FP8 in 2-D blocks); ``block`` ``(group_size,)``
        (``(K,)`` per channel, ``(128, 128)`` for blocks, ``(16,)`` NVFP4, ``(32,)`` MXFP4);
        ``scale_dtype`` the scales' dtype name (the weight's, float32 for blocks,
        ``"float8_e4m3fn"`` NVFP4, ``"float8_e8m0fnu"`` MXFP4); ``scale_layout`` ``"row"`` (a
        row-major grid of scales) or ``"dense"`` (the FP4 scale bytes, as the MX and NVFP4
        quantizers call the same layout); ``family`` ``"weight_quant"``.
    data_layout : str
        ``"plain"`` (from :func:`quantize_weight` and :meth:`from_checkpoint`: the shapes above) or
        ``"prepared"`` (from :func:`prepare_weight`: every array in the matmul kernels' tile order,
        the shapes after "prepared" above).
    group_size : int or None
        K per scale; ``None``: one scale per output channel; 128 for 128 x 128 blocks.
    block_size : tuple or None
        ``(128, 128)`` for block weights, else None.
    shape : tuple
        ``(N, K)`` of the original weight.
    dtype : numpy.dtype
        The original weight's dtype (from a checkpoint: the one given), :meth:`dequantize`'s
        default; the scales' too, except for block weights and checkpoint scales.

    Notes
    -----
    ``QuantizedWeight(data, scale, zero_point, scheme, shape, dtype, *, data_layout="plain",
    code_sum=None, scale_2=None)`` wraps arrays as they are (:func:`check_weight` is what the ops
    check them against). An INT8 weight made without ``code_sum`` gets it computed from ``data`` (a
    CuPy int8 ``(N, K)`` C-contiguous array; otherwise it stays None and the ops name what is
    wrong).
    """

    def __init__(
        self, data, scale, zero_point, scheme, shape, dtype, *, data_layout="plain", code_sum=None, scale_2=None
    ):
        if not isinstance(scheme, Scheme):
            raise TypeError(f"scheme must be a cupyquant.Scheme, got {type(scheme).__name__}")
        if data_layout not in DATA_LAYOUTS:
            raise ValueError(f"data_layout must be one of {DATA_LAYOUTS}, got {data_layout!r}")
        if code_sum is None and scheme.format == "int8":
            code_sum = quant.code_sums(data)
        # a new object has nothing derived to drop: its attributes are set without __setattr__
        self.__dict__.update(
            data=data, scale=scale, zero_point=zero_point, scheme=scheme, shape=tuple(shape), dtype=np.dtype(dtype),
            data_layout=data_layout, code_sum=code_sum, scale_2=scale_2,
        )  # fmt: skip

    # What the ops keep with a weight, made again when any of its arrays or attributes is replaced
    # (__setattr__) and never copied (__getstate__, which copy, deepcopy and pickle use): whether a
    # matmul has read its present arrays (dispatch.early_ok), the signature its plans are keyed on,
    # and the float32 copy of 16-bit scales the W8A8 kernels read.
    _read = False
    _sig = None
    _f32_scale = None
    _DERIVED = ("_read", "_sig", "_f32_scale")

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        if name[0] != "_":
            d = self.__dict__
            for k in self._DERIVED:
                d.pop(k, None)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in self._DERIVED}

    def _signature(self) -> tuple:
        """What a plan depends on of this weight: its scheme, shape, dtype, data layout and the
        signature of each array (unhashable, so never memoized, if one is not a CuPy array)."""
        sig = self._sig
        if sig is None:
            from .. import _validate

            arrays = (self.data, self.scale, self.zero_point, self.scale_2, self.code_sum)
            sig = (self.scheme, self.shape, self.dtype, self.data_layout) + tuple(map(_validate.array_key, arrays))
            self._sig = sig
        return sig

    @classmethod
    def from_checkpoint(
        cls,
        data,
        scale,
        *,
        format: str = "float8_e4m3fn",
        block_size=DEFAULT_BLOCK_SIZE,
        zero_point=None,
        scale_2=None,
        global_scale=None,
        dtype="bfloat16",
    ) -> "QuantizedWeight":
        """A :class:`QuantizedWeight` from a checkpoint's codes and scales, as they are (no quantization).

        Parameters
        ----------
        data : cupy.ndarray
            uint8 ``(N, K)``, the E4M3 codes (a checkpoint's ``float8_e4m3fn`` tensor viewed as uint8),
            or for ``format="int8"`` int8 ``(N, K)`` (compressed-tensors W8A8 INT8 ``weight``, any
            K up to 2^24), or for ``"int4"`` and ``"uint4"`` uint8 ``(N, K / 2)``, the 4-bit codes
            two per byte (element ``2 i`` of a row in the low nibble of byte ``i``; int4: the code
            ``q = v + 8`` of the signed value ``v``; compressed-tensors' ``pack-quantized``
            ``weight_packed`` int32 words viewed as uint8 on a little-endian host), or for
            ``"nvfp4"`` and ``"mxfp4"`` uint8 ``(N, K / 2)``, the packed E2M1 codes (element ``2 i``
            of a row in the low nibble of byte ``i``: ModelOpt's ``weight``, compressed-tensors'
            ``weight_packed``), ``K = 2 * data.shape[1]`` a nonzero multiple of the block (16
            NVFP4, 32 MXFP4); C-contiguous. Used as it is (not copied).
        scale : cupy.ndarray
            The decode scales, ``w ~ fp8(q) * scale`` (DeepSeek-V3's ``weight_scale_inv``),
            ``w ~ q * scale`` (INT8: compressed-tensors' per-channel ``weight_scale``) or
            ``w ~ (q - 8) * scale`` (int4; uint4 ``(q - zero_point) * scale``), on
            ``data``'s device: for ``block_size=(128, 128)`` ``(ceil(N / 128), ceil(K / 128))``; for
            ``(1, G)`` ``(N, K / G)``; for None ``(N,)`` or ``(N, 1)``. float32, float16 or bfloat16
            (float64 where every value is a float32). Block weights keep float32 scales (float16 and
            bfloat16 convert exactly); group and channel weights keep the scales' dtype (float64 becomes
            float32). A conversion that would round raises instead. Their values are not checked.
            FP4: the scale bytes ``(N, K / block)``, uint8 or a CuPy array of the format's ml_dtypes
            type (``float8_e4m3fn`` NVFP4, ``float8_e8m0fnu`` MXFP4), held as a uint8 view (a
            non-contiguous one as a contiguous copy).
        format : str
            ``"float8_e4m3fn"``, ``"int8"`` (with ``block_size=None``), ``"nvfp4"``
            (``w ~ e2m1(q) * (e4m3(scale) * scale_2)``), ``"mxfp4"``
            (``w ~ e2m1(q) * 2^(scale - 127)``), ``"int4"`` (symmetric, the implicit zero point 8) or
            ``"uint4"`` (with ``zero_point``), the last two with ``block_size`` ``(1, G)`` or None.
        block_size : (128, 128), (1, G) or None
            ``(128, 128)``: 2-D blocks (any N and K; the weight of :func:`quantize_weight` with
            ``block_size=(128, 128)``); ``(1, G)``, G in 32, 64, 128 dividing K: groups of G along K
            (``group_size=G``); None: one scale per output channel (``group_size=None``), the only
            choice for ``"int8"`` (pass it: the default ``(128, 128)`` is a ValueError there).
            ``"int4"`` and ``"uint4"`` take ``(1, G)`` or None, and no default: pass one.
            ``"nvfp4"`` and ``"mxfp4"`` have their own blocks (1 x 16, 1 x 32): leave ``block_size``
            at its default, or pass None or ``(1, 16)`` / ``(1, 32)``; anything else (an explicit
            ``(128, 128)`` included) is a ValueError.
        zero_point : cupy.ndarray, optional
            ``"uint4"`` only, and needed there: the codes of zero, uint8 ``(N, ceil(K / G / 2))``
            (``K / G`` is 1 for one scale per channel), two per byte along K like the data, on
            ``data``'s device (a non-contiguous one held as a contiguous copy): the weight's
            ``zero_point`` as :func:`quantize_weight` gives it. compressed-tensors packs its
            ``weight_zero_point`` along N instead (eight rows an int32 word, each nibble the signed
            zero point plus 8): unpack and repack it along K first, as
            :func:`cupyquant.checkpoint.read` does.
        scale_2 : float or cupy.ndarray, optional
            ``"nvfp4"`` only, exclusive with ``global_scale``: the decode scale of the whole weight
            (ModelOpt's ``weight_scale_2``), a positive finite float or a float32 CuPy array of one
            element on ``data``'s device (its value is not checked; held as a ``(1,)`` view, not
            copied).
        global_scale : float or cupy.ndarray, optional
            ``"nvfp4"`` only, exclusive with ``scale_2``: the encode scale ``S_enc`` as
            :func:`cupyquant.quantize_nvfp4` and compressed-tensors' ``weight_global_scale`` store
            it (``2688 / amax``), a positive finite float or a float32 CuPy array of one element;
            the weight's ``scale_2`` is then ``float32(1 / S_enc)``, correctly rounded (subnormals
            kept), computed on the device for an array (one launch, no host synchronization).
        dtype : {"bfloat16", "float16", "float32"}
            The dtype :meth:`QuantizedWeight.dequantize` returns by default (the weight's ``dtype``).

        Returns
        -------
        QuantizedWeight
            Plain layout, ``zero_point`` None (uint4: the one given), ``scheme.format`` ``format``; granularity
            ``"block"`` (``block_size`` ``(128, 128)``), ``"group"`` or ``"channel"``; a per-channel
            ``scale`` of shape ``(N,)`` is held as ``(N, 1)``, a non-contiguous one as a contiguous copy.
            INT8: ``code_sum`` computed from ``data`` (int32 ``(N,)``, one launch); other formats None.
            FP4: granularity ``"group"``, ``group_size`` the block, ``scale`` uint8, NVFP4's
            ``scale_2`` float32 ``(1,)`` (MXFP4: None): given the bytes of a weight that
            :func:`quantize_weight` made, the same weight. INT4: the scheme
            :func:`quantize_weight` gives the same format and group size with scales of the dtype
            given (float64 as float32), so its bytes give the same weight.

        Raises
        ------
        TypeError
            ``data``, ``scale`` or ``zero_point`` is not a CuPy array; ``data`` not uint8 (int8 for
            ``"int8"``); ``scale`` not of a float dtype above (FP4: not uint8 or the format's scale
            type); ``zero_point`` not uint8;
            ``dtype`` not float32, float16 or bfloat16; ``format`` not a str; ``scale_2`` or
            ``global_scale`` neither a real nor a CuPy array, or an array not float32.
        ValueError
            An unsupported ``format`` or ``block_size`` (for ``"int8"`` anything but None; for
            ``"int4"`` and ``"uint4"`` anything but ``(1, G)`` or None); ``zero_point`` missing for
            ``"uint4"`` or given for another format, of the wrong shape or on another device;
            ``data`` not 2-D, not C-contiguous, with K = 0 (or, for FP8 groups and channels, an odd
            K; for INT8 a K above 2^24; for FP4 a K that is not a multiple of the block; for INT4
            groups a K they do not divide); ``scale`` of the wrong shape, on another device, or
            (float64) not exactly float32; ``"nvfp4"`` with
            neither or both of ``scale_2`` and ``global_scale``, either given with another format, a
            float one not positive and finite, an array one not of one element or on another device.
        """
        return cls(
            **checkpoint.parse(
                data, scale, format=format, block_size=block_size, zero_point=zero_point, scale_2=scale_2,
                global_scale=global_scale, dtype=dtype,
            )
        )  # fmt: skip

    @property
    def group_size(self):
        """K per scale, or None for one scale per output channel (128 for 128 x 128 blocks)."""
        return None if self.scheme.granularity == "channel" else self.scheme.block[-1]

    @property
    def block_size(self):
        """The 2-D block ``(rows, columns)`` per scale of a block weight, None for the others."""
        return self.scheme.block if self.scheme.granularity == "block" else None

    @property
    def _group(self) -> int:
        """K per scale, K for one per channel."""
        return self.shape[1] if self.scheme.granularity == "channel" else self.scheme.block[-1]

    @property
    def nbytes(self) -> int:
        """Bytes on the device: data, scales, zero points, code sums and NVFP4's scale_2."""
        extra = sum(0 if a is None else a.nbytes for a in (self.zero_point, self.code_sum, self.scale_2))
        return self.data.nbytes + self.scale.nbytes + extra

    def _with(self, data, scale, zero_point, data_layout: str, code_sum=None) -> "QuantizedWeight":
        """A weight of this one's scheme in ``data_layout``, with these arrays (an INT8 weight given
        no ``code_sum`` computes it from ``data``)."""
        return QuantizedWeight(
            data, scale, zero_point, self.scheme, self.shape, self.dtype, data_layout=data_layout, code_sum=code_sum,
            scale_2=self.scale_2,
        )  # fmt: skip

    def dequantize(self, out_dtype=None, *, out=None):
        """:func:`cupyquant.dequantize_weight` of this weight: ``(N, K)`` in ``out_dtype`` (default:
        the original weight's), bit-exact with :func:`cupyquant.reference.dequantize_weight`."""
        return dequantize(self, out_dtype, out)

    def copy(self) -> "QuantizedWeight":
        """A copy with its own device arrays (same layout), ``code_sum`` included."""
        z = None if self.zero_point is None else self.zero_point.copy()
        cs = None if self.code_sum is None else self.code_sum.copy()
        w = self._with(self.data.copy(), self.scale.copy(), z, self.data_layout, cs)
        if self.scale_2 is not None:
            w.scale_2 = self.scale_2.copy()
        return w

    def prepare(self) -> "QuantizedWeight":
        """:func:`cupyquant.prepare_weight` of this weight."""
        return prepare(self)

    def plain(self) -> "QuantizedWeight":
        """This weight in the plain layout (itself if it is plain; a new copy if prepared)."""
        if self.data_layout == "plain":
            return self
        check_weight(self)
        from .. import _validate

        with _validate.on_device_of(self.data):
            return layout.plain_of(self)

    def to_host(self) -> dict:
        """NumPy copies in the plain layout (a prepared weight is converted first): ``data``
        (packed), ``codes`` (INT4 unpacked, one per byte, FP8 as ``ml_dtypes.float8_e4m3fn``, INT8
        as they are, int8, FP4 unpacked as ``ml_dtypes.float4_e2m1fn``), ``scale`` (FP4: the bytes
        as ``ml_dtypes.float8_e4m3fn`` or ``float8_e8m0fnu``), ``zero_point`` (unpacked codes, or
        None), ``code_sum`` (int32 ``(N,)`` for INT8, else None), ``scale_2`` (float32 ``(1,)`` for
        NVFP4, else None)."""
        import cupy
        import ml_dtypes

        from .. import _layouts

        w = self.plain()
        data = cupy.asnumpy(w.data)
        N, K = w.shape
        ng = K // w._group
        scale = cupy.asnumpy(w.scale)
        if w.scheme.format == "float8_e4m3fn":
            codes = data.view(ml_dtypes.float8_e4m3fn)
        elif w.scheme.format == "int8":
            codes = data
        elif w.scheme.format in FP4_SCALE_DTYPES:
            codes = _layouts.unpack_fp4(data, K).view(ml_dtypes.float4_e2m1fn)
            scale = scale.view(getattr(ml_dtypes, FP4_SCALE_DTYPES[w.scheme.format]))
        else:
            codes = _layouts.unpack_fp4(data, K)
        zeros = None if w.zero_point is None else _layouts.unpack_fp4(cupy.asnumpy(w.zero_point), ng)
        code_sum = None if w.code_sum is None else cupy.asnumpy(w.code_sum)
        scale_2 = None if w.scale_2 is None else cupy.asnumpy(w.scale_2)
        return {
            "data": data,
            "codes": codes,
            "scale": scale,
            "zero_point": zeros,
            "code_sum": code_sum,
            "scale_2": scale_2,
        }

    def __repr__(self) -> str:
        g = "per-channel" if self.group_size is None else f"group_size={self.group_size}"
        if self.block_size is not None:
            g = f"block_size={self.block_size}"
        lay = "" if self.data_layout == "plain" else ", prepared"
        sums = "" if self.code_sum is None else ", code sums int32"
        s2 = "" if self.scale_2 is None else ", scale_2 float32"
        return (
            f"QuantizedWeight({self.scheme.format}, shape={self.shape}, {g}, scales {self.scheme.scale_dtype}{lay}{sums}"
            f"{s2}, {self.nbytes} bytes)"
        )


def check_weight(w) -> None:
    """Raise TypeError or ValueError unless ``w`` is a QuantizedWeight whose arrays are CuPy arrays
    of the shapes its scheme, shape and data layout say."""
    if not isinstance(w, QuantizedWeight):
        raise TypeError(f"w must be a QuantizedWeight (from cupyquant.quantize_weight), got {type(w).__name__}")
    checks.check_arrays(w)


def dequantize(w: QuantizedWeight, out_dtype=None, out=None):
    """:func:`cupyquant.dequantize_weight` (its docstring says what it computes and checks); the
    checks are made once per signature of the weight, ``out_dtype`` and ``out``."""
    import cupy

    from .. import _dtypes, _validate

    key = (w._signature() if type(w) is QuantizedWeight else [w], out_dtype, _validate.array_key(out))
    plan = _DEQUANTIZE_PLANS.lookup(key)
    if plan is None:
        check_weight(w)
        out_t = _dtypes.input_type(w.dtype if out_dtype is None else out_dtype, "out_dtype")
        inputs = (("w.data", w.data), ("w.scale", w.scale), ("w.scale_2", w.scale_2))
        if out is not None:
            _validate.out_array(out, "out", w.shape, out_t.dtype, w.data.data.device_id, inputs=inputs)
        plan = _DEQUANTIZE_PLANS.keep(key, (out_t, _validate.Disjoint(inputs + (("out", out),), 3)))
    out_t, disjoint = plan
    N, K = w.shape
    if out is not None:
        scale_2 = w.scale_2
        disjoint.check((w.data.data.ptr, w.scale.data.ptr, 0 if scale_2 is None else scale_2.data.ptr, out.data.ptr))
    with _validate.on_device_of(w.data):
        if w.data_layout == "prepared":
            w = layout.plain_of(w)
            _validate.keep_if_capturing(w.data, w.scale, w.zero_point)
        y = cupy.empty((N, K), dtype=out_t.dtype) if out is None else out
        if N and K:
            quant.dequantize(w, out_t, y)
    return y


_DEQUANTIZE_PLANS = _plans.Plans()


def prepare(w: QuantizedWeight) -> QuantizedWeight:
    """:func:`cupyquant.prepare_weight` (its docstring says what it makes and checks)."""
    from .. import _validate

    check_weight(w)
    if w.scheme.format == "int8":
        raise ValueError(
            "w is an int8 (W8A8) weight, which has no prepared layout and no weight-only matmul: pass it as it "
            "is to cupyquant.scaled_matmul with INT8 activations, or dequantize it (w.dequantize())"
        )
    if w.data_layout == "prepared":
        return w
    K = w.shape[1]
    chunk = CHUNK[w.scheme.format]
    if K % chunk:
        raise ValueError(
            f"w's K = {K} must be a multiple of {chunk} for {w.scheme.format} weights (the kernel's K step)"
        )
    with _validate.on_device_of(w.data):
        return layout.prepared_of(w)
