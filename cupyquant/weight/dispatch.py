"""The weight-only matmul ``a @ dequant(w).T`` (:func:`matmul`) and the choice of its kernel
(:func:`matmul_path`): the thresholds where the decode kernel hands over to a tensor-core gemm,
the planner that turns a call's shapes into the chosen kernel's launches (memoized per argument
signature), and the call itself.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import cupy
import numpy as np

from .. import _device, _plans, _validate, _workspace
from .._sizes import VECTOR_BYTES
from . import decode, layout, sm80_gemm, sm90_gemm
from .container import QuantizedWeight, check_weight
from .formats import CHUNK, FP4_BLOCK, kernel_scheme
from .problem import Problem

#: The path that tests force (_forced_path); None: matmul_path decides.
_FORCED = None


@contextlib.contextmanager
def _forced_path(path):
    """Private, for tests and benchmarks: within the block, matmuls take ``path`` (``"decode"``,
    ``"sm80_gemm"`` or ``"sm90_gemm"``) whatever their shape. ``"sm90_gemm"`` needs compute
    capability 9.0; the gemms take FP8 weights whose K is a multiple of GEMM_K (a ValueError
    otherwise). Not thread-safe: it sets a module global."""
    global _FORCED
    if path is not None and path not in PATH_NAMES:
        raise ValueError(f"path must be one of {PATH_NAMES}, got {path!r}")
    saved, _FORCED = _FORCED, path
    try:
        yield
    finally:
        _FORCED = saved


# ---------------------------------------------------------------- which kernel
@dataclass(frozen=True)
class PathThresholds:
    """Where the decode kernel hands over to a tensor-core gemm.

    The decode kernel reads each weight byte once per 16 rows of ``a``, so its time grows with M
    from the start; the gemms read it once per tile of 16-256 rows but pay a pipeline fill (and a K
    split's reduction), which a small weight does not amortize."""

    decode_max_m: int = 16  # decode for every M up to this, on every GPU
    # FP8 weights: decode for every M up to this (INT4's value), then INT4's rules below
    fp8_decode_max_m: int = 16
    # sm90 (wgmma): decode also for M <= sm90_decode_max_m while M x N < sm90_decode_mn_per_sm x SMs
    # (202,752 on 132 SMs: N = 4096 up to M = 32, 8192 up to 24). With two M tiles the decode kernel
    # is faster wherever this gives it the call (4096 x 14336 M = 32: 20.7 against 26.8); with three
    # it is slower on 9 of 10 shapes, by up to 60%.
    sm90_decode_max_m: int = 32
    sm90_decode_mn_per_sm: int = 1536
    # FP8 weights take that extension only below this many weights: a second 16-row tile costs the
    # decode kernel a second read of twice INT4's bytes. On an H200 (bf16, group 128) M = 17-32 of
    # 8192 x 8192 and 4096 x 14336 take 22.7-25.0 us on the sm90 gemm against 29.0-33.9 decoding,
    # while 4096 x 4096 keeps the decode kernel (9.7-9.9 against 10.2-10.5).
    fp8_sm90_decode_max_weights: int = 1 << 25
    # FP4 weights, whose dequantization costs the decode kernel more, take the sm90 gemm from M = 17:
    # at M = 32 it is faster on 4096 x 14336 (22.1 against 28.9) and slower on 4096^2 (10.3 against 9.6).
    # Other GPUs (mma.sync gemm): decode up to M = 64 below 2^26 weights and up to 256 below 2^25,
    # from scripts/bench.py --matmul-paths on an H200 (4096^2: M = 128 46 against 115, M = 1024 312
    # against 189; 14336 x 4096 M = 64 78 against 100, M = 128 149 against 132).
    small_weight: int = 1 << 25
    small_weight_decode_max_m: int = 256
    mid_weight: int = 1 << 26
    mid_weight_decode_max_m: int = 64


PATHS = PathThresholds()
#: The path names matmul_path returns.
PATH_NAMES = ("decode", "sm80_gemm", "sm90_gemm")
#: The tensor-core gemms stream K in stages of 128 (the 256-row sm90 tile: pairs of 64): FP8
#: weights (K a multiple of 64) take them where K is a multiple of this.
GEMM_K = 128


def choose_path(M: int, N: int, K: int, fp8: bool, wgmma: bool, sms, fp4: bool = False) -> str:
    """The kernel for ``M`` rows of ``a`` times an (N, K) weight on a GPU that runs the sm90 gemm
    (``wgmma``) or not (see PathThresholds); FP4 weights (``fp4``) take INT4's paths except the
    sm90 decode extension past M = 16; FP8 weights (``fp8``) take them past
    ``PATHS.fp8_decode_max_m`` where K is a multiple of GEMM_K (the sm90 decode extension only
    below ``PATHS.fp8_sm90_decode_max_weights``), the decode kernel otherwise."""
    if M <= (PATHS.fp8_decode_max_m if fp8 else PATHS.decode_max_m) or fp8 and K % GEMM_K:
        return "decode"
    if wgmma and K < 1 << 31:  # the sm90 kernel's group index is 32-bit
        if (
            not fp4
            and M <= PATHS.sm90_decode_max_m
            and M * N < PATHS.sm90_decode_mn_per_sm * sms
            and (not fp8 or N * K < PATHS.fp8_sm90_decode_max_weights)
        ):
            return "decode"
        return "sm90_gemm"
    w = N * K
    if (
        M <= PATHS.small_weight_decode_max_m
        and w < PATHS.small_weight
        or M <= PATHS.mid_weight_decode_max_m
        and w < PATHS.mid_weight
    ):
        return "decode"
    return "sm80_gemm"


def matmul_path(M: int, w: QuantizedWeight, *, arch=None, sms=None) -> str:
    """The kernel :func:`matmul` uses for ``M`` rows of activations: ``"decode"`` (the split-K
    kernel ``kernels/weight_decode.cu``, one 16-row tile of ``a`` per block), ``"sm90_gemm"``
    (``kernels/weight_sm90_gemm.cu``, Hopper's warpgroup tensor-core instructions, on GPUs of
    compute capability 9.0) or ``"sm80_gemm"`` (``kernels/weight_sm80_gemm.cu``, ``mma.sync``, on
    the other GPUs).

    ``arch`` is the compute capability as CuPy spells it (``"90"``) and ``sms`` the GPU's
    multiprocessor count; by default the current device's, or (no GPU) none, which gives
    ``"sm80_gemm"`` for the tensor-core path, and 132 (an H100 SXM). The thresholds are
    ``cupyquant.weight.dispatch.PATHS``. FP8 weights in 128 x 128 blocks take the paths of FP8
    weights in groups. Int8 weights have no path: a ValueError, as in :func:`matmul`."""
    _weight_only_format(w)
    if _FORCED is not None:
        return _FORCED
    N, K = w.shape
    fp8 = w.scheme.format == "float8_e4m3fn"
    if arch is None:
        device = _device.current_device()
        arch = None if device is None else _device.arch(device)
    wgmma = arch is not None and _device.caps_of_arch(arch).wgmma
    if sms is None and wgmma:
        device = _device.current_device()
        sms = 132 if device is None else _device.sm_count(device)
    return choose_path(M, N, K, fp8, wgmma, sms, fp4=w.scheme.format in FP4_BLOCK)


def _weight_only_format(w) -> None:
    """Refuse the INT8 (W8A8) weights, which the weight-only matmul does not take."""
    if not isinstance(w, QuantizedWeight):
        return
    if w.scheme.format == "int8":
        raise ValueError(
            "w is an int8 (W8A8) weight, which the weight-only matmul does not take: use cupyquant.scaled_matmul "
            "with INT8 activations, or w.dequantize() and a float matmul"
        )


# ---------------------------------------------------------------- the planner
#: The planners of each path: ``plan(problem)`` -> the Step launches.
_KERNELS = {"decode": decode.plan, "sm80_gemm": sm80_gemm.plan, "sm90_gemm": sm90_gemm.plan}


class _Plan:
    """A checked matmul call for one argument signature: the output's shape, whether ``a`` must be
    copied (rows not 16-byte aligned), the Step launches (none for an empty output), whether the
    weight must be prepared on each call, PDL, and the overlap check of ``out``."""

    __slots__ = ("y_shape", "M", "K", "copy_a", "row_bytes", "steps", "prepare", "pdl", "disjoint", "device")

    def __init__(self, a, w, out, pdl):
        check_weight(w)
        _weight_only_format(w)
        t = _validate.float_input(a, "a")
        if t.name not in ("float16", "bfloat16"):
            raise TypeError(f"a must be float16 or bfloat16 (the tensor-core input types), got {a.dtype}")
        N, K = w.shape
        if a.ndim == 0 or a.shape[-1] != K:
            raise ValueError(f"a.shape[-1] must equal w's K = {K}, got a.shape {a.shape}")
        fmt = w.scheme.format
        block = w.scheme.granularity == "block"  # float32 block scales: either activation dtype
        if fmt not in FP4_BLOCK and not block and w.scale.dtype != a.dtype:
            raise TypeError(
                f"w's scales are {w.scale.dtype} but a is {a.dtype}: the kernel dequantizes in a's dtype, "
                f"so quantize a weight of dtype {a.dtype} (or pass a as {w.scale.dtype})"
            )
        chunk = CHUNK[fmt]
        if K % chunk:
            raise ValueError(f"w's K = {K} must be a multiple of {chunk} for {fmt} weights (the kernel's K step)")
        if K // chunk >= 1 << 30:
            raise ValueError(f"w's K = {K} must be below {chunk << 30} (the kernels count K steps in 32 bits)")
        self.device = device = w.data.data.device_id
        _validate.same_device(a, "a", device, "w")
        if pdl is not None and not isinstance(pdl, (bool, np.bool_)):
            raise TypeError(f"pdl must be None, True or False, got {type(pdl).__name__}")
        caps = _device.caps(device)
        if pdl and not caps.pdl:
            raise ValueError(
                f"pdl=True needs a GPU of compute capability 9.0 or newer (programmatic dependent launch), "
                f"device {device} is {caps.name}"
            )
        self.pdl = pdl = caps.pdl if pdl is None else bool(pdl)
        lead = a.shape[:-1]
        self.M = M = math.prod(lead)
        self.K = K
        self.y_shape = lead + (N,)
        if out is not None:
            _validate.out_array(out, "out", self.y_shape, a.dtype, device, inputs=(("a", a), ("w.data", w.data)))
        self.disjoint = _validate.Disjoint((("a", a), ("w.data", w.data), ("out", out)), 2)
        # the rows of a are read where they are if they are one 16-byte aligned matrix, else copied
        try:
            row_stride = _validate.rows_view(a, "a")[2]
        except ValueError:
            row_stride = None
        self.copy_a = bool(M) and (
            row_stride is None or a.data.ptr % VECTOR_BYTES or (row_stride * a.itemsize) % VECTOR_BYTES
        )
        lda = K if self.copy_a else row_stride
        self.row_bytes = lda * a.itemsize
        self.prepare = w.data_layout != "prepared"  # the kernels read the prepared layout: a copy per call
        self.steps = ()
        if M and N:
            path = matmul_path(M, w, arch=caps.arch, sms=_device.sm_count(device))
            if path == "sm90_gemm" and not caps.wgmma:
                raise ValueError(
                    f"the sm90_gemm path needs a GPU of compute capability 9.0, device {device} is {caps.name}"
                )
            if path != "decode" and fmt == "float8_e4m3fn" and K % GEMM_K:
                raise ValueError(
                    f"w's K = {K} must be a multiple of {GEMM_K} for float8_e4m3fn weights on the {path} path "
                    "(its K stages)"
                )
            p = Problem(
                device, t, M, N, K, lda, fmt, kernel_scheme(w), w._group, layout.k_permuted(w),
                _device.sm_count(device), pdl, caps.wgmma, caps.pdl,
            )  # fmt: skip
            with _validate.on_device_of(w.data):
                self.steps = tuple(_KERNELS[path](p))


_PLANS = _plans.Plans()


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
        own time at decode, so prepare a weight once and reuse it. INT4 and FP8 in groups or per
        channel: its scales must have ``a``'s dtype (the kernel dequantizes in that dtype; quantize
        a weight of the activation dtype); FP8 in 128 x 128 blocks (float32 block scales), NVFP4
        and MXFP4 weights (scale bytes) take either activation dtype. K must be a multiple of 128
        (INT4, FP4) or 64 (FP8, blocks included; any N).
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
      per 16 rows. Every format takes it for M <= 16, and FP8 weights whose K is not a multiple of
      128 for every M; INT4 (and FP8 weights of fewer than 2^25 elements) on compute capability
      9.0 also for M <= 32 while M x N is under
      1536 per SM (202,752 on an H100 SXM: N = 4096 up to M = 32, N = 8192 up to 24); all on other
      GPUs also for M <= 64 when the weight has fewer than 2^26 elements, and for M <= 256 when it
      has fewer than 2^25.
    * ``"sm90_gemm"`` (``weight_sm90_gemm.cu``): every larger M on GPUs of compute capability 9.0
      (H100, H200). Hopper's warpgroup instructions with the dequantized weights as the register
      operand: blocks of 128 weight rows by 32 (M <= 32), 64, 128 or 256 rows of ``a``, K
      streamed through shared memory with ``cp.async`` in stages of 128 (4 deep; the 32-row tile
      6 deep; 256-row tiles: stages of 64, 6 deep; the 128-row tile 5 deep, loaded by a producer
      warpgroup of its own, the activations by TMA; FP8 weights, a byte each, 4 deep, the 64-row
      tile 3), and split across blocks when few tiles and a
      long K make that pay: 2 ways as a thread-block cluster whose two blocks add their partials
      through distributed shared memory,
      3 to 8 ways likewise where every tile's cluster fits on the GPU at once (one block per SM;
      the driver's cluster occupancy says), otherwise 4 or 8 ways as below. The tile height and
      the splits are chosen together by an estimate fitted to H100 timings (FP8 weights: H200
      timings).
    * ``"sm80_gemm"`` (``weight_sm80_gemm.cu``): every larger M on the other GPUs
      (``mma.sync``). Tiles of 16, 32, 64 or 128 rows by 128 columns, K streamed in stages of 128,
      3-4 stages deep; when its tiles cannot fill the GPU, K is split across blocks and the last
      block of a tile adds the float32 partials in split order (the result does not depend on
      timing).

    The thresholds are in ``cupyquant.weight.dispatch`` and the costs behind them in each kernel's module
    (``cupyquant.weight.decode``, ``sm80_gemm``, ``sm90_gemm``). INT4 with
    ``group_size`` 128 or per-channel (decode kernel, and sm80 tiles of up to 32 rows): the
    tensor cores multiply ``a`` by the exact integers ``q - z`` and each 128-wide chunk's float32
    partial sums are multiplied by the group's scale (``s * sum((q - z) * a)``, ``s`` and ``z`` the weight's
    ``scale`` and ``zero_point``, the weights never
    rounded to a's dtype). Otherwise (groups of 32 and 64, FP8, larger sm80 tiles, sm90) the weights
    are dequantized to a's dtype first, bit-identical to ``w.dequantize(a.dtype)``. Either way each
    product is exact and the sums are float32, in an order that differs from a sequential sum, and
    that depends on the path and tile (so a row's result can change in the last bits with M).

    FP8 in 128 x 128 blocks (every kernel, FP8's paths and thresholds): each E4M3 value times its
    block's float32 scale ``scale[n // 128, k // 128]`` in an IEEE float32 multiply, rounded once
    to a's dtype (the scale itself never rounded to 16 bits): the weights of ``w.dequantize(a.dtype)``,
    bit for bit (:func:`cupyquant.reference.dequantize_weight_blocks`), then summed as above; so
    each output is within ``(K 2^-23 + 2^-22) sum_k |a w|`` plus half an ulp of a's dtype of the
    float64 product with those weights (:func:`cupyquant.reference.weight_matmul_blocks` and
    ``weight_matmul_error_bound``). :func:`prepare_weight` holds the block scales once per row and
    128 k, float32.

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
        ``w``'s scales (INT4, FP8 groups and channels) are not in ``a``'s dtype; ``out`` has the wrong dtype.
    ValueError
        ``a``'s last axis is not ``w``'s K; K not a multiple of 128 (INT4, FP4) or 64 (FP8); ``w``
        int8 (use :func:`cupyquant.scaled_matmul`); ``a`` and ``w`` on different devices; ``out`` of the wrong shape or device, not C-contiguous, or
        overlapping ``a`` or ``w``; ``pdl=True`` on a GPU below compute capability 9.0.
    """
    key = (_validate.array_key(a), w._signature() if type(w) is QuantizedWeight else [w], _validate.array_key(out))
    key += (pdl, type(pdl), _FORCED)
    plan = _PLANS.lookup(key)
    if plan is None:
        plan = _PLANS.keep(key, _Plan(a, w, out, pdl))
    if out is not None:
        plan.disjoint.check((a.data.ptr, w.data.data.ptr, out.data.ptr))
    with _validate.on_device_of(w.data):
        y = cupy.empty(plan.y_shape, dtype=a.dtype) if out is None else out
        if plan.steps:
            _run(plan, a, w, y)
    return y


def _run(plan: _Plan, a, w, y) -> None:
    """The launches of a planned call (on w's device)."""
    if plan.copy_a:
        a = a.reshape(plan.M, plan.K).copy(order="C")  # not ascontiguousarray: that keeps a misaligned view
        _validate.keep_if_capturing(a)
    early = plan.pdl and not plan.prepare and w._read  # early_ok's rule
    wp = w
    if plan.prepare:
        wp = layout.prepared_of(w)
        _validate.keep_if_capturing(wp.data, wp.scale, wp.zero_point)
    a_ptr, y_ptr = a.data.ptr, y.data.ptr
    data, scale, zp, s2 = wp.data, wp.scale, wp.zero_point, wp.scale_2
    for st in plan.steps:
        launch = st.early if early and st.early is not None else st.plain
        if st.counters == 0 and st.tmaps is None:
            launch(a_ptr + st.a_off, data, scale, zp, s2, y_ptr + st.y_off)
            continue
        ws = counters = None
        if st.ws_shape is not None:  # float32 partial tiles (whole, tile-major), per-tile arrival counters
            ws, counters = _workspace.split_buffers(plan.device, math.prod(st.ws_shape), st.counters)
        if st.tmaps is None:
            launch(a_ptr + st.a_off, data, scale, zp, s2, y_ptr + st.y_off, ws, counters)
            continue
        rows, box_k, box_rows, tail = st.tmaps
        ptr = a_ptr + st.a_off
        tm = _workspace.tensor_map(ptr, rows, plan.K, plan.row_bytes, plan.device, box_k, box_rows)
        tm_tail = _workspace.NO_TENSOR_MAP
        if tail:
            tm_tail = _workspace.tensor_map(ptr, rows, plan.K, plan.row_bytes, plan.device, box_k, tail)
        launch(ptr, data, scale, zp, s2, y_ptr + st.y_off, ws, counters, tm, tm_tail)
    if not w._read and not cupy.cuda.get_current_stream().is_capturing():
        w._read = True  # a captured call may never run


def early_ok(w: QuantizedWeight, pdl: bool) -> bool:
    """Whether the decode kernel may load ``w``'s first chunk and its scales before its PDL wait
    (weight_decode.cu ``early``), and the sm90 gemm its first stages' weights and scales
    (weight_sm90_gemm.cu ``early``), so that they are on their way while the kernel before it on the
    stream finishes. Only the activations can be that kernel's output, provided that it does not
    write the weight: so not before a matmul made outside a graph capture has read the weight's
    present arrays (the kernel that made them may be the one just before; assigning a new array to
    the weight starts over), nor with a plain weight (its prepared copy is made in the same call),
    nor without PDL (nothing to overlap). After that, ``matmul``'s docstring asks that a kernel
    writing into a weight's arrays not be the one launched just before a PDL call with it."""
    return bool(pdl) and w.data_layout == "prepared" and w._read
