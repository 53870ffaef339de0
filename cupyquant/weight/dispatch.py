"""The matmul ``a @ dequant(w).T`` and the choice of its kernel (:func:`matmul_path`)."""

from __future__ import annotations

import contextlib
import math

import cupy
import numpy as np

from .. import _device, _validate
from . import configs as C
from . import launch, plan
from .container import QuantizedWeight
from .quantize import check_weight, prepared_of

#: The path that tests force (_forced_path); None: matmul_path decides.
_FORCED = None


@contextlib.contextmanager
def _forced_path(path):
    """Private, for tests and benchmarks: within the block, INT4 and FP4 matmuls take ``path`` (``"decode"``,
    ``"sm80_gemm"`` or ``"sm90_gemm"``; ``"pipelined"`` and ``"wgmma"`` are the same as the last two)
    whatever their shape; FP8 weights always take ``"decode"``. ``"sm90_gemm"`` needs compute
    capability 9.0. Not thread-safe: it sets a module global."""
    global _FORCED
    path = plan.PATH_ALIASES.get(path, path)
    if path is not None and path not in plan.PATH_NAMES:
        raise ValueError(f"path must be one of {plan.PATH_NAMES} (or {tuple(plan.PATH_ALIASES)}), got {path!r}")
    saved, _FORCED = _FORCED, path
    try:
        yield
    finally:
        _FORCED = saved


def matmul_path(M: int, w: QuantizedWeight, *, arch=None, sms=None) -> str:
    """The kernel :func:`matmul` uses for ``M`` rows of activations: ``"decode"`` (the split-K
    kernel ``kernels/weight_decode.cu``, one 16-row tile of ``a`` per block), ``"sm90_gemm"``
    (``kernels/weight_sm90_gemm.cu``, Hopper's warpgroup tensor-core instructions, on GPUs of
    compute capability 9.0) or ``"sm80_gemm"`` (``kernels/weight_sm80_gemm.cu``, ``mma.sync``, on
    the other GPUs). These were ``"wgmma"`` and ``"pipelined"`` before; the old names are accepted
    where a path is an input.

    ``arch`` is the compute capability as CuPy spells it (``"90"``) and ``sms`` the GPU's
    multiprocessor count; by default the current device's, or (no GPU) none, which gives
    ``"sm80_gemm"`` for the tensor-core path, and 132 (an H100 SXM). The thresholds are
    ``cupyquant.weight.plan.PATHS``. Block weights (``w.block_size``) and int8 weights have no
    path: a ValueError, as in :func:`matmul`."""
    _weight_only_format(w)
    fp8 = w.scheme.format == "float8_e4m3fn"
    if _FORCED is not None and (not fp8 or _FORCED == "decode"):
        return _FORCED
    N, K = w.shape
    if arch is None:
        arch = _device.current_arch()
    if sms is None and arch in plan.SM90_ARCHS:
        sms = _device.current_sm_count()
    return plan.choose_path(M, N, K, fp8, arch, sms, fp4=w.scheme.format in C.FP4_BLOCK)


def _weight_only_format(w) -> None:
    """Refuse the W8A8 weights (FP8 in 128 x 128 blocks, INT8), which the weight-only matmul does not take."""
    if not isinstance(w, QuantizedWeight):
        return
    if w.scheme.format == "int8":
        raise ValueError(
            "w is an int8 (W8A8) weight, which the weight-only matmul does not take: use cupyquant.scaled_matmul "
            "with INT8 activations, or w.dequantize() and a float matmul"
        )
    if w.block_size is not None:
        raise ValueError(
            f"w is an FP8 weight in {w.block_size} blocks, which the weight-only matmul does not take: "
            "use cupyquant.scaled_matmul (FP8 activations), or w.dequantize() and a float matmul"
        )


def matmul(a, w: QuantizedWeight, *, out=None, pdl=None) -> cupy.ndarray:
    """``a @ dequant(w).T`` in ``a``'s dtype, accumulated in float32, the weights dequantized in
    registers on their way to the tensor cores (``mma.sync``); the 4-bit form is never expanded in
    memory.

    Parameters
    ----------
    a : cupy.ndarray
        float16 or bfloat16, shape ``(..., K)``; leading dimensions are flattened into M rows.
        Rows that are not 16-byte aligned with a unit stride along K are copied first.
    w : QuantizedWeight
        Prepared by :func:`prepare_weight` (the layout the kernels read), or plain, which is then
        converted on every call: a copy of the weight through memory, several times the matmul's
        own time at decode, so prepare a weight once and reuse it. INT4 and FP8: its scales must
        have ``a``'s dtype (the kernel dequantizes in that dtype; quantize a weight of the
        activation dtype); NVFP4 and MXFP4 weights (scale bytes) take either activation dtype.
        K must be a multiple of 128 (INT4, FP4) or 64 (FP8).
    out : cupy.ndarray, optional
        ``(..., N)`` of ``a``'s dtype, C-contiguous.
    pdl : bool, optional
        Programmatic dependent launch (FlashInfer's ``enable_pdl``): the matmul kernel is launched
        so that it may start while the kernel before it on the stream is still running, its
        blocks set up on the SMs and waiting there, before any load of ``a``, for that kernel to
        complete; and it lets the kernel after it (another PDL launch) do the same. The result is
        the same either way. None (the default) turns it on on GPUs of compute capability 9.0 and
        newer, the ones that have it; True elsewhere is a ``ValueError``. It works in CUDA graphs
        (the launch becomes a programmatic edge). From the second call with the same prepared
        weight object and arrays on (captured calls do not count), the decode kernel also reads
        the first part of ``w`` before that wait, while the kernel before finishes (weights are
        constants): so if you write into a weight's arrays after its first matmul, pass
        ``pdl=False`` to the matmul launched right after that write on the same stream (or launch
        any other kernel in between).

    Notes
    -----
    Three kernels; :func:`matmul_path` says which one a call takes:

    * ``"decode"`` (``weight_decode.cu``): one 16-row tile of ``a`` per block, the block's 4, 8 or 16
      warps splitting K over 16 to 64 weight rows (chosen by shape); each weight byte is read once
      per 16 rows. FP8 weights take it for every M. INT4 and FP4 take it for M <= 16; INT4 on compute
      capability 9.0 also for M <= 32 while M x N is under
      1536 per SM (202,752 on an H100 SXM: N = 4096 up to M = 32, N = 8192 up to 24); both on other GPUs also for
      M <= 64 when the weight has fewer than 2^26 elements, and for M <= 256 when it has
      fewer than 2^25.
    * ``"sm90_gemm"`` (``weight_sm90_gemm.cu``): INT4 and FP4 for every larger M on GPUs of compute capability 9.0
      (H100, H200). Hopper's warpgroup instructions with the dequantized weights as the register
      operand: blocks of 128 weight rows by 32 (M <= 32), 64, 128 or 256 rows of ``a``, K
      streamed through shared memory with ``cp.async`` in stages of 128 (4 deep; the 32-row tile
      6 deep; 256-row tiles: stages of 64, 6 deep; the 128-row tile 5 deep, loaded by a producer
      warpgroup of its own, the activations by TMA), and split across blocks when few tiles and a
      long K make that pay: 2 ways as a thread-block cluster whose two blocks add their partials
      through distributed shared memory,
      3 to 8 ways likewise where every tile's cluster fits on the GPU at once (one block per SM;
      the driver's cluster occupancy says), otherwise 4 or 8 ways as below. The tile height and
      the splits are chosen together by an estimate fitted to H100 timings.
    * ``"sm80_gemm"`` (``weight_sm80_gemm.cu``): INT4 and FP4 for every larger M on the other GPUs
      (``mma.sync``). Tiles of 16, 32, 64 or 128 rows by 128 columns, K streamed in stages of 128,
      3-4 stages deep; when its tiles cannot fill the GPU, K is split across blocks and the last
      block of a tile adds the float32 partials in split order (the result does not depend on
      timing).

    The thresholds and the costs behind them are in ``cupyquant.weight.plan``. INT4 with
    ``group_size`` 128 or per-channel (decode kernel, and sm80 tiles of up to 32 rows): the
    tensor cores multiply ``a`` by the exact integers ``q - z`` and each 128-wide chunk's float32
    partial sums are multiplied by the group's scale (``s * sum((q - z) * a)``, ``s`` and ``z`` the weight's
    ``scale`` and ``zero_point``, the weights never
    rounded to a's dtype). Otherwise (groups of 32 and 64, FP8, larger sm80 tiles, sm90) the weights
    are dequantized to a's dtype first, bit-identical to ``w.dequantize(a.dtype)``. Either way each
    product is exact and the sums are float32, in an order that differs from a sequential sum, and
    that depends on the path and tile (so a row's result can change in the last bits with M).

    NVFP4 and MXFP4 (every kernel): the tensor cores multiply ``a`` by ``e2m1(q) * s * 2^-C`` (``s``
    the block's E4M3 or E8M0 scale; ``C`` 24 for MXFP4 with bf16, 7 otherwise), built in registers
    and exact in fp16 and bf16, and the float32 sums are multiplied once by ``2^C`` (times NVFP4's
    ``scale_2``) before the rounding to a's dtype: the weights are never rounded, so each output is
    within ``(K 2^-23 + 2^-22) sum_k |a w|`` plus half an ulp of the float64 product with the
    exactly dequantized weight. Exact for every finite E4M3 scale, and for E8M0 scales ``2^e`` with
    ``-16 <= e <= 8`` (fp16) or ``-108 <= e <= 25`` (bf16); past that range the products round,
    an fp16 scale below ``2^-21`` acts as 0 and one above ``2^8`` (bf16: ``2^25``) as infinity, as
    does an E8M0 NaN.

    Raises
    ------
    TypeError
        ``a`` is not a CuPy array of float16 or bfloat16; ``w`` is not a :class:`QuantizedWeight`;
        ``w``'s scales (INT4, FP8) are not in ``a``'s dtype; ``out`` has the wrong dtype.
    ValueError
        ``a``'s last axis is not ``w``'s K; K not a multiple of 128 (INT4, FP4) or 64 (FP8); ``w`` in
        128 x 128 blocks or int8 (use :func:`cupyquant.scaled_matmul`); ``a`` and ``w`` on different devices; ``out`` of the wrong shape or device, not C-contiguous, or
        overlapping ``a`` or ``w``; ``pdl=True`` on a GPU below compute capability 9.0.
    """
    check_weight(w)
    _weight_only_format(w)
    t = _validate.float_input(a, "a")
    if t.name not in ("float16", "bfloat16"):
        raise TypeError(f"a must be float16 or bfloat16 (the tensor-core input types), got {a.dtype}")
    N, K = w.shape
    if a.ndim == 0 or a.shape[-1] != K:
        raise ValueError(f"a.shape[-1] must equal w's K = {K}, got a.shape {a.shape}")
    if w.scheme.format not in C.FP4_BLOCK and w.scale.dtype != a.dtype:
        raise TypeError(
            f"w's scales are {w.scale.dtype} but a is {a.dtype}: the kernel dequantizes in a's dtype, "
            f"so quantize a weight of dtype {a.dtype} (or pass a as {w.scale.dtype})"
        )
    fmt = w.scheme.format
    chunk = C.CHUNK[fmt]
    if K % chunk:
        raise ValueError(f"w's K = {K} must be a multiple of {chunk} for {fmt} weights (the kernel's K step)")
    if K // chunk >= 1 << 30:
        raise ValueError(f"w's K = {K} must be below {chunk << 30} (the kernels count K steps in 32 bits)")
    device = w.data.data.device_id
    _validate.same_device(a, "a", device, "w")
    if pdl is not None and not isinstance(pdl, (bool, np.bool_)):
        raise TypeError(f"pdl must be None, True or False, got {type(pdl).__name__}")
    pdl_ok = int(_device.arch(device)) >= 90
    if pdl and not pdl_ok:
        raise ValueError(
            f"pdl=True needs a GPU of compute capability 9.0 or newer (programmatic dependent launch), "
            f"device {device} is {_device.arch(device)}"
        )
    pdl = pdl_ok if pdl is None else bool(pdl)
    lead = a.shape[:-1]
    M = math.prod(lead)
    if out is not None:
        _validate.out_array(out, "out", lead + (N,), a.dtype, device, inputs=(("a", a), ("w.data", w.data)))
    with _validate.on_device_of(w.data):
        a2 = a.reshape(M, K) if M else a.reshape(0, K)
        if M and (a2.strides[1] != a2.itemsize or a2.strides[0] % 16 or a2.data.ptr % 16 or a2.strides[0] < 0):
            a2 = a2.copy(order="C")  # not ascontiguousarray: that returns a misaligned contiguous view as is
            _validate.keep_if_capturing(a2)
        y = cupy.empty(lead + (N,), dtype=a.dtype) if out is None else out
        if M and N:
            early = early_ok(w, pdl)
            user_w = w
            if not w._prepared:  # the kernels read the prepared layout: a copy per call
                w = prepared_of(w)
                _validate.keep_if_capturing(w.data, w.scale, w.zero_point)
            path = matmul_path(M, w, arch=_device.arch(device), sms=_device.sm_count(device))
            problem = launch.Problem(device, t, a2, w, y.reshape(M, N), M, N, K, pdl, early)
            if path == "decode":
                launch.decode(problem)
            elif path == "sm90_gemm":
                if _device.arch(device) not in plan.SM90_ARCHS:
                    raise ValueError(
                        f"the sm90_gemm path needs a GPU of compute capability 9.0, device {device} is "
                        f"{_device.arch(device)}"
                    )
                launch.sm90_gemm(problem)
            else:
                launch.sm80_gemm(problem)
            if not cupy.cuda.get_current_stream().is_capturing():  # a captured call may never run
                user_w._read_key = arrays_key(user_w)
    return y


def early_ok(w: QuantizedWeight, pdl: bool) -> bool:
    """Whether the decode kernel may load ``w``'s first chunk and its scales before its PDL wait
    (weight_decode.cu ``early``), and the sm90 gemm its first stages' weights and scales
    (weight_sm90_gemm.cu ``early``), so that they are on their way while the kernel before it on the
    stream finishes. Only the activations can be that kernel's output, provided that it does not
    write the weight: so not before a matmul made outside a graph capture has read the weight's
    present arrays (the kernel that made them may be the one just before), nor with a plain weight
    (its prepared copy is made in the same call), nor without PDL (nothing to overlap). After that,
    ``matmul``'s docstring asks that a kernel writing into a weight's arrays not be the one
    launched just before a PDL call with it."""
    return bool(pdl) and w._prepared and w._read_key == arrays_key(w)


def arrays_key(w: QuantizedWeight) -> tuple:
    """The device buffers of ``w`` (address and size of data, scales and zero points): a weight whose
    arrays were replaced, or a ``copy.deepcopy`` of one (new buffers), counts as not yet read."""
    arrays = (w.data, w.scale, w.zero_point, getattr(w, "scale_2", None))
    return tuple(None if x is None else (x.data.ptr, x.nbytes) for x in arrays)
