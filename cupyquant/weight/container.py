"""QuantizedWeight: a quantized weight, its scales and zero points, and the scheme that made them."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..quantized import Scheme

_LAYOUTS = ("plain", "prepared")
#: The kernel family that quantizes and dequantizes weights (kernels/weight_quant.cu).
FAMILY = "weight_quant"


class _WeightScheme(Scheme):
    """A weight's :class:`~cupyquant.Scheme`. It also compares equal to its format's name
    (``w.scheme == "int4"``): a deprecated alias of ``w.scheme.format == "int4"``."""

    def __eq__(self, other):
        if isinstance(other, str):
            return self.format == other
        if isinstance(other, Scheme):
            return tuple(self.__dict__.values()) == tuple(other.__dict__.values())
        return NotImplemented

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = Scheme.__hash__


#: The scale bytes' dtype of the FP4 formats.
FP4_SCALE_DTYPES = {"nvfp4": "float8_e4m3fn", "mxfp4": "float8_e8m0fnu"}


class _DefaultBlockSize(tuple):
    """from_checkpoint's default ``block_size``, ``(128, 128)``, told apart from an explicit
    ``(128, 128)`` so that the FP4 formats (whose blocks are 1 x 16 or 1 x 32) can take the default."""

    def __repr__(self) -> str:
        return "(128, 128)"


DEFAULT_BLOCK_SIZE = _DefaultBlockSize((128, 128))


def weight_scheme(fmt: str, group_size, K: int, dtype, layout: str = "plain", *, block=None) -> Scheme:
    """The Scheme of a weight: ``fmt`` ``"int4"``, ``"uint4"``, ``"float8_e4m3fn"``, ``"int8"``,
    ``"nvfp4"`` or ``"mxfp4"``, groups of ``group_size`` along K (None: one scale per output
    channel), scales in ``dtype`` (FP4: the scale bytes' E4M3 or E8M0); or, with
    ``block`` ``(rows, columns)``, FP8 in 2-D blocks (granularity ``"block"``, ``group_size``
    ignored)."""
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")
    if block is not None:
        return _WeightScheme(
            format=fmt,
            granularity="block",
            block=tuple(int(v) for v in block),
            scale_dtype=np.dtype(dtype).name,
            scale_layout=layout,
            family=FAMILY,
        )
    channel = group_size is None
    return _WeightScheme(
        format=fmt,
        granularity="channel" if channel else "group",
        block=(int(K) if channel else int(group_size),),
        scale_dtype=FP4_SCALE_DTYPES.get(fmt) or np.dtype(dtype).name,
        scale_layout=layout,
        family=FAMILY,
    )


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
        ``"float8_e4m3fn"`` NVFP4, ``"float8_e8m0fnu"`` MXFP4); ``scale_layout`` ``"plain"`` (from
        :func:`quantize_weight`) or
        ``"prepared"`` (from :func:`prepare_weight`); ``family`` ``"weight_quant"``. It also
        compares equal to the format's name (deprecated).
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
    ``QuantizedWeight(data, scale, zero_point, scheme, shape, dtype, code_sum=None, scale_2=None)`` takes a
    :class:`Scheme`; the older ``QuantizedWeight(data, scales, zeros, "int4", group_size, shape,
    dtype, layout)`` is accepted too (deprecated). An INT8 weight made without ``code_sum`` gets
    it computed from ``data`` (a CuPy int8 ``(N, K)`` C-contiguous array; otherwise it stays None
    and the ops name what is wrong).
    """

    def __init__(
        self, data, scale, zero_point, scheme, shape, dtype, *deprecated, layout=None, code_sum=None, scale_2=None
    ):
        if isinstance(scheme, str):  # the older form: (..., format, group_size, shape, dtype[, layout])
            if len(deprecated) not in (1, 2) or len(deprecated) == 2 and layout is not None:
                raise TypeError(
                    "QuantizedWeight(data, scales, zeros, format, group_size, shape, dtype[, layout]) "
                    f"takes 7 or 8 arguments, got {6 + len(deprecated)}"
                )
            group_size, shape, dtype = shape, dtype, deprecated[0]
            layout = deprecated[1] if len(deprecated) == 2 else "plain" if layout is None else layout
            scheme = weight_scheme(scheme, group_size, tuple(shape)[1], dtype, layout)
        elif deprecated or layout is not None:
            raise TypeError("QuantizedWeight takes 6 arguments with a Scheme (its scale_layout is the layout)")
        elif not isinstance(scheme, Scheme):
            raise TypeError(f"scheme must be a cupyquant.Scheme, got {type(scheme).__name__}")
        elif scheme.scale_layout not in _LAYOUTS:
            raise ValueError(f"scheme.scale_layout must be one of {_LAYOUTS}, got {scheme.scale_layout!r}")
        elif type(scheme) is Scheme:
            scheme = _WeightScheme(**scheme.__dict__)
        self.data, self.scale, self.zero_point = data, scale, zero_point
        self.scheme = scheme
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        if code_sum is None and scheme.format == "int8":
            from .quantize import code_sums

            code_sum = code_sums(data)
        self.code_sum = code_sum
        self.scale_2 = scale_2
        # the arrays a matmul has read (dispatch.arrays_key): later calls with the same arrays may
        # read them before the kernel before them completes (dispatch.early_ok)
        self._read_key = None

    @classmethod
    def from_checkpoint(
        cls,
        data,
        scale,
        *,
        format: str = "float8_e4m3fn",
        block_size=DEFAULT_BLOCK_SIZE,
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
            K up to 2^24), or for ``"nvfp4"`` and ``"mxfp4"`` uint8 ``(N, K / 2)``, the packed E2M1
            codes (element ``2 i`` of a row in the low nibble of byte ``i``: ModelOpt's ``weight``,
            compressed-tensors' ``weight_packed``), ``K = 2 * data.shape[1]`` a nonzero multiple of
            the block (16 NVFP4, 32 MXFP4); C-contiguous. Used as it is (not copied).
        scale : cupy.ndarray
            The decode scales, ``w ~ fp8(q) * scale`` (DeepSeek-V3's ``weight_scale_inv``) or
            ``w ~ q * scale`` (INT8: compressed-tensors' per-channel ``weight_scale``), on
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
            (``w ~ e2m1(q) * (e4m3(scale) * scale_2)``) or ``"mxfp4"``
            (``w ~ e2m1(q) * 2^(scale - 127)``).
        block_size : (128, 128), (1, G) or None
            ``(128, 128)``: 2-D blocks (any N and K; the weight of :func:`quantize_weight` with
            ``block_size=(128, 128)``); ``(1, G)``, G in 32, 64, 128 dividing K: groups of G along K
            (``group_size=G``); None: one scale per output channel (``group_size=None``), the only
            choice for ``"int8"`` (pass it: the default ``(128, 128)`` is a ValueError there).
            ``"nvfp4"`` and ``"mxfp4"`` have their own blocks (1 x 16, 1 x 32): leave ``block_size``
            at its default, or pass None or ``(1, 16)`` / ``(1, 32)``; anything else (an explicit
            ``(128, 128)`` included) is a ValueError.
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
            Plain layout, ``zero_point`` None, ``scheme.format`` ``format``; granularity
            ``"block"`` (``block_size`` ``(128, 128)``), ``"group"`` or ``"channel"``; a per-channel
            ``scale`` of shape ``(N,)`` is held as ``(N, 1)``, a non-contiguous one as a contiguous copy.
            INT8: ``code_sum`` computed from ``data`` (int32 ``(N,)``, one launch); other formats None.
            FP4: granularity ``"group"``, ``group_size`` the block, ``scale`` uint8, NVFP4's
            ``scale_2`` float32 ``(1,)`` (MXFP4: None): given the bytes of a weight that
            :func:`quantize_weight` made, the same weight.

        Raises
        ------
        TypeError
            ``data`` or ``scale`` is not a CuPy array; ``data`` not uint8 (int8 for ``"int8"``);
            ``scale`` not of a float dtype above (FP4: not uint8 or the format's scale type);
            ``dtype`` not float32, float16 or bfloat16; ``format`` not a str; ``scale_2`` or
            ``global_scale`` neither a real nor a CuPy array, or an array not float32.
        ValueError
            An unsupported ``format`` or ``block_size`` (for ``"int8"`` anything but None); ``data``
            not 2-D, not C-contiguous, with K = 0 (or, for FP8 groups and channels, an odd K; for
            INT8 a K above 2^24; for FP4 a K that is not a multiple of the block); ``scale`` of the
            wrong shape, on another device, or (float64) not exactly float32; ``"nvfp4"`` with
            neither or both of ``scale_2`` and ``global_scale``, either given with another format, a
            float one not positive and finite, an array one not of one element or on another device.
        """
        from .checkpoint import from_checkpoint

        return from_checkpoint(
            data, scale, format=format, block_size=block_size, scale_2=scale_2, global_scale=global_scale, dtype=dtype
        )

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
    def _format(self) -> str:
        return self.scheme.format

    @property
    def _prepared(self) -> bool:
        return self.scheme.scale_layout == "prepared"

    # deprecated aliases
    @property
    def scales(self):
        """Deprecated alias of :attr:`scale`."""
        return self.scale

    @scales.setter
    def scales(self, value):
        self.scale = value

    @property
    def zeros(self):
        """Deprecated alias of :attr:`zero_point`."""
        return self.zero_point

    @zeros.setter
    def zeros(self, value):
        self.zero_point = value

    @property
    def G(self) -> int:
        """Deprecated: K per scale (K for one scale per output channel)."""
        return self._group

    @property
    def layout(self) -> str:
        """Deprecated alias of ``scheme.scale_layout``: ``"plain"`` or ``"prepared"``."""
        return self.scheme.scale_layout

    @property
    def nbytes(self) -> int:
        """Bytes on the device: data, scales, zero points, code sums and NVFP4's scale_2."""
        extra = sum(0 if a is None else a.nbytes for a in (self.zero_point, self.code_sum, self.scale_2))
        return self.data.nbytes + self.scale.nbytes + extra

    def _with(self, data, scale, zero_point, layout: str, code_sum=None) -> "QuantizedWeight":
        """A weight of this one's scheme in ``layout``, with these arrays (an INT8 weight given no
        ``code_sum`` computes it from ``data``)."""
        if layout not in _LAYOUTS:
            raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")
        scheme = dataclasses.replace(self.scheme, scale_layout=layout)
        return QuantizedWeight(
            data, scale, zero_point, scheme, self.shape, self.dtype, code_sum=code_sum, scale_2=self.scale_2
        )

    def dequantize(self, out_dtype=None, *, out=None):
        """``(N, K)`` in ``out_dtype`` (default: the original weight's), ``(q - zero_point) * scale``,
        bit-exact with :func:`cupyquant.reference.dequantize_weight`."""
        from .quantize import dequantize_weight

        return dequantize_weight(self, out_dtype, out=out)

    def copy(self) -> "QuantizedWeight":
        """A copy with its own device arrays (same layout), ``code_sum`` included."""
        z = None if self.zero_point is None else self.zero_point.copy()
        cs = None if self.code_sum is None else self.code_sum.copy()
        w = self._with(self.data.copy(), self.scale.copy(), z, self.scheme.scale_layout, cs)
        if self.scale_2 is not None:
            w.scale_2 = self.scale_2.copy()
        return w

    def prepare(self) -> "QuantizedWeight":
        """:func:`prepare_weight` of this weight."""
        from .quantize import prepare_weight

        return prepare_weight(self)

    def plain(self) -> "QuantizedWeight":
        """This weight in the plain layout (itself if it is plain; a new copy if prepared)."""
        from .quantize import plain_weight

        return plain_weight(self)

    def to_host(self) -> dict:
        """NumPy copies in the plain layout (a prepared weight is converted first): ``data``
        (packed), ``codes`` (INT4 unpacked, one per byte, FP8 as ``ml_dtypes.float8_e4m3fn``, INT8
        as they are, int8, FP4 unpacked as ``ml_dtypes.float4_e2m1fn``), ``scale`` (FP4: the bytes
        as ``ml_dtypes.float8_e4m3fn`` or ``float8_e8m0fnu``), ``zero_point`` (unpacked codes, or
        None), ``code_sum`` (int32 ``(N,)`` for INT8, else None), ``scale_2`` (float32 ``(1,)`` for
        NVFP4, else None); ``scales`` and ``zeros`` are the same arrays under their deprecated names."""
        import cupy
        import ml_dtypes

        from .. import _layouts

        w = self.plain()
        data = cupy.asnumpy(w.data)
        N, K = w.shape
        ng = K // w._group
        scale = cupy.asnumpy(w.scale)
        if w._format == "float8_e4m3fn":
            codes = data.view(ml_dtypes.float8_e4m3fn)
        elif w._format == "int8":
            codes = data
        elif w._format in FP4_SCALE_DTYPES:
            codes = _layouts.unpack_fp4(data, K).view(ml_dtypes.float4_e2m1fn)
            scale = scale.view(getattr(ml_dtypes, FP4_SCALE_DTYPES[w._format]))
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
            "scales": scale,
            "zeros": zeros,
        }

    def __repr__(self) -> str:
        g = "per-channel" if self.group_size is None else f"group_size={self.group_size}"
        if self.block_size is not None:
            g = f"block_size={self.block_size}"
        lay = "" if not self._prepared else ", prepared"
        sums = "" if self.code_sum is None else ", code sums int32"
        s2 = "" if self.scale_2 is None else ", scale_2 float32"
        return (
            f"QuantizedWeight({self._format}, shape={self.shape}, {g}, scales {self.scheme.scale_dtype}{lay}{sums}"
            f"{s2}, {self.nbytes} bytes)"
        )
