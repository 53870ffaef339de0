"""Every scale layout of the library: its shape and strides, the buffers it allocates, and the kernel
arguments that address it. The quantizers, the fused norm and the W8A8 operand code all ask here.

Group and token scales (``scale_layout`` ``"row"`` or ``"col"``), for a tensor of leading shape
``(*B, M)`` with ``n_cols`` scale columns per row (``NG = K / group_size`` float32 scales, one per
token, or ``ceil(NG / 4)`` int32 words of packed UE8M0 bytes):

- ``"row"``: C-contiguous ``(*B, M, n_cols)``.
- ``"col"``: DeepGEMM's MN-major layout: each batch a row-major ``(n_cols, M_pad)`` block with
  ``M_pad = round_up(M, 4)`` (every column 16-byte aligned), batches one after another; the array
  is the ``(*B, M, n_cols)`` view of that buffer, padding rows written with zeros.

Block scales (``scale_layout`` ``"dense"`` or ``"swizzled"``) of MX (blocks of 32) and NVFP4 (16):
``"dense"`` uint8 ``(*lead, ceil(K / block))``; ``"swizzled"`` the 128x4 layout cuBLAS and Blackwell
block-scaled MMA read, uint8 ``(round_up(rows, 128), round_up(ceil(K / block), 4))``.

A per-tensor scale has the layout ``"scalar"``: float32 ``(1,)``.
"""

from __future__ import annotations

import math

import numpy as np

from ._sizes import ceil_div, round_up

GROUP_LAYOUTS = ("row", "col")
BLOCK_LAYOUTS = ("dense", "swizzled")
MX_BLOCK = 32
NV_BLOCK = 16
#: Rows of a tile of the swizzled layout, and scale columns of one.
SWIZZLE_ROWS, SWIZZLE_COLS = 128, 4
#: Group scales' dtypes: float32, or UE8M0 exponent bytes packed four per int32 word.
GROUP_SCALE_DTYPES = ("float32", "float8_e8m0fnu")

#: kernels/groupwise.cuh ScaleArgs, field for field (C alignment). "words" stays 0: the scale
#: buffer is a kernel argument of its own, so that one ScaleArgs serves every launch of a plan.
SCALE_ARGS = np.dtype(
    [
        ("words", np.uint64),
        ("M", np.int64),
        ("M_pad", np.int64),
        ("sb", np.int64),
        ("sm", np.int64),
        ("sg", np.int64),
        ("n_groups", np.int32),
        ("packed", np.int32),
        ("pow2", np.int32),
        ("col", np.int32),
        ("ub_ptr", np.uint64),
        ("ub_arg", np.float32),
        ("has_ub", np.int32),
        ("m_magic", np.uint64),
        ("m_shift", np.int32),
    ],
    align=True,
)


def magic(d: int) -> tuple:
    """(m, shift) with floor(n / d) == (n * m) >> shift for every 0 <= n < 2^31 (Granlund and
    Montgomery: l = ceil(log2 d), m = ceil(2^(31 + l) / d), shift = 31 + l)."""
    d = max(int(d), 1)
    sh = 31 + (d - 1).bit_length()
    return ceil_div(1 << sh, d), sh


# ---------------------------------------------------------------- group and token scales
def group_scale_layout(scale_layout) -> str:
    """Check a group scale layout (the ops' and the reference's ``scale_layout``)."""
    if scale_layout not in GROUP_LAYOUTS:
        raise ValueError(f"scale_layout={scale_layout!r} is not supported; expected one of {GROUP_LAYOUTS}")
    return scale_layout


def group_scale_packed(scale_layout, scale_dtype) -> bool:
    """Check a group scale layout and dtype; whether the scales are packed UE8M0 words."""
    from . import _dtypes

    group_scale_layout(scale_layout)
    return _dtypes.scale_dtype(scale_dtype, allowed=GROUP_SCALE_DTYPES) == "float8_e8m0fnu"


def group_scale_columns(n_groups: int, packed: bool) -> int:
    """Scale columns per row: the groups, or their packed words (four UE8M0 bytes each)."""
    return ceil_div(n_groups, 4) if packed else n_groups


class GroupLayout:
    """Where each scale word of a tensor with leading shape ``lead`` goes, ``n_cols`` words a row, in
    the ``"col"`` layout if ``col`` else ``"row"``: the word of row m of batch b and column g is
    ``b * sb + m * sm + g * sg``; ``words`` in all (padding included); ``shape`` and byte
    ``strides`` of the array view."""

    __slots__ = ("lead", "n_cols", "col", "M", "M_pad", "B", "sb", "sm", "sg", "words", "shape", "strides")

    def __init__(self, lead: tuple, n_cols: int, col: bool):
        self.lead, self.n_cols, self.col = lead, n_cols, col
        rows = math.prod(lead)
        self.M = lead[-1] if lead else 1
        self.B = rows // self.M if self.M else 0
        if col:
            self.M_pad = round_up(self.M, 4)
            self.sb, self.sm, self.sg = n_cols * self.M_pad, 1, self.M_pad
        else:
            self.M_pad = self.M
            self.sb, self.sm, self.sg = self.M * n_cols, n_cols, 1
        self.words = self.B * self.sb
        self.shape = lead + (n_cols,)
        if lead:
            batch = []
            acc = self.sb * 4
            for d in reversed(lead[:-1]):
                batch.append(acc)
                acc *= d
            self.strides = tuple(reversed(batch)) + (self.sm * 4, self.sg * 4)
        else:
            self.strides = (self.sg * 4,)

    @property
    def nbytes(self) -> int:
        """Bytes of the allocation (at least 4)."""
        return max(self.words, 1) * 4

    def view(self, mem, dtype):
        """The array of this layout over the allocation ``mem`` (a ``cupy.cuda.MemoryPointer``)."""
        import cupy

        return cupy.ndarray(self.shape, dtype=dtype, memptr=mem, strides=self.strides)

    def empty(self, dtype):
        """A new allocation of this layout on the current device, viewed as ``dtype`` (float32 or
        int32)."""
        import cupy

        return self.view(cupy.cuda.alloc(self.nbytes), dtype)


def group_layout(shape: tuple, n_groups: int, scale_layout: str, packed: bool) -> GroupLayout:
    """The layout of the scales of a tensor of ``shape`` (its leading axes are the scales' rows)."""
    return GroupLayout(tuple(shape[:-1]), group_scale_columns(n_groups, packed), scale_layout == "col")


def group_scale_args(lay: GroupLayout, n_groups: int, packed: bool, pow2: bool, bound: tuple = (0, 0.0, 0)) -> np.void:
    """The kernels' ScaleArgs for scales in ``lay``; ``bound`` the ``(pointer, value, has_ub)`` of a
    scale bound (:func:`scale_bound`)."""
    return np.array(
        (0, lay.M, lay.M_pad, lay.sb, lay.sm, lay.sg, n_groups, packed, pow2, lay.col, *bound, *magic(lay.M)),
        dtype=SCALE_ARGS,
    )[()]


def scale_bound(scale_ub, device: int) -> tuple:
    """(pointer, value, has_ub) of the kernels' ScaleArgs for a ``scale_ub`` argument (None, a
    positive finite real, or a one-element float32 device array)."""
    from . import _validate

    mode, array, value = _validate.scale_arg(scale_ub, "scale_ub", device)
    return (0 if array is None else array.data.ptr), value, int(mode != _validate.ScaleSource.AMAX)


def check_group_scale_out(a, lay: GroupLayout, dtype, device: int, inputs=(), arg: str = "scale_out", alloc: str = ""):
    """A caller's buffer for scales in ``lay``: the layout's shape, dtype and strides, 16-byte
    aligned in an allocation that covers the padding, on ``device``, not overlapping ``inputs``."""
    from . import _validate

    _validate.scale_out(
        a,
        lay.shape,
        dtype,
        device,
        inputs=inputs,
        strides=lay.strides,
        nbytes=lay.words * 4,
        alloc=alloc or "cupyquant.empty_scales()",
        arg=arg,
    )


def _words(strides, itemsize: int, arg: str) -> tuple:
    if any(st < 0 or st % itemsize for st in strides):
        raise ValueError(f"{arg} must have non-negative strides that are multiples of {itemsize} bytes, got {strides}")
    return tuple(st // itemsize for st in strides)


def group_scale_addressing(lead: tuple, scale_shape: tuple, scale_strides: tuple, per_token: bool, arg: str) -> tuple:
    """``(rows, batch, sm, sk)`` in 4-byte words of a token or group scale array of ``scale_shape``
    (``lead + (n_cols,)``) and byte ``scale_strides`` (any layout whose batch axes collapse into one
    stride, as "row" and "col" do), for a tensor whose leading shape is ``lead`` (``(*B, M)``;
    ``()`` for one row): the word of row m and column k is ``(m / rows) * batch + (m % rows) * sm
    + k * sk``. ``arg`` names the array in messages."""
    words = _words(scale_strides, 4, arg)
    if not lead:
        return 1, 0, 0, 0 if per_token else words[-1]
    M = lead[-1]
    sm = words[-2]
    sk = 0 if per_token else words[-1]
    batch = [(n, st) for n, st in zip(lead[:-1], words[:-2]) if n != 1]
    sb = batch[-1][1] if batch else 0
    for (_, outer), (n_inner, inner) in zip(batch[:-1], batch[1:]):
        if outer != inner * n_inner:
            raise ValueError(
                f"{arg}'s batch axes must collapse into one stride (shape {scale_shape}, strides {scale_strides})"
            )
    return max(M, 1), sb, sm, sk


def word_strides(strides, itemsize: int, arg: str) -> tuple:
    """Byte strides as element strides; ValueError naming ``arg`` unless they are non-negative
    multiples of ``itemsize``."""
    return _words(strides, itemsize, arg)


# ---------------------------------------------------------------- block scales (MX, NVFP4)
def block_scale_shape(
    shape: tuple[int, ...], block_size: int = MX_BLOCK, scale_layout: str = "dense"
) -> tuple[int, ...]:
    """The shape of the uint8 scale array that :func:`quantize_mx` (``block_size=32``) or
    :func:`quantize_nvfp4` (``block_size=16``) writes for a tensor of ``shape``: ``shape[:-1] +
    (ceil(K / block_size),)`` dense, ``(round_up(rows, 128), round_up(ceil(K / block_size), 4))``
    swizzled, with ``rows`` the product of ``shape[:-1]``.

    Raises
    ------
    TypeError
        ``shape`` is not a tuple of integers.
    ValueError
        An empty ``shape`` or a negative dimension; ``block_size`` not 32 or 16; an unsupported
        ``scale_layout``.
    """
    from . import _checks

    shape = _checks.shape_tuple(shape)
    if not shape:
        raise ValueError("shape must have at least one dimension")
    if block_size not in (MX_BLOCK, NV_BLOCK):
        raise ValueError(f"block_size={block_size!r} is not supported; expected 32 (MX) or 16 (NVFP4)")
    check_block_layout(scale_layout)
    kb = ceil_div(shape[-1], block_size)
    if scale_layout == "dense":
        return shape[:-1] + (kb,)
    return (round_up(math.prod(shape[:-1]), SWIZZLE_ROWS), round_up(kb, SWIZZLE_COLS))


def check_block_layout(scale_layout) -> None:
    if scale_layout not in BLOCK_LAYOUTS:
        raise ValueError(f"scale_layout={scale_layout!r} is not supported; expected one of {BLOCK_LAYOUTS}")


def packed_shape(shape, bits: int) -> tuple:
    """The byte shape of elements of ``bits`` bits in ``shape``: FP4 packs two a byte along the last axis."""
    return tuple(shape) if bits == 8 else tuple(shape[:-1]) + (ceil_div(shape[-1], 2),)
