"""The Hopper W8A8 kernel for few rows of a (kernels/scaled_mm_sm90_small.cu: FP8 and INT8, a and b
swapped on the wgmma operands): which calls it takes, its K split and the plan of its launch."""

from __future__ import annotations

import cupy

from .. import _device, _dtypes, _jit, _launch, _workspace
from .._launch import ARG, Blob, Launch
from .._sizes import ceil_div, round_up
from . import args as A
from .sm90 import A_FORMATS, B_FORMATS, OperandMaps

#: a's rows the kernel takes: wgmma's N (a's rows past M read as zeros). The kernel builds for 32 as
#: well, but at M = 32 the 64 x 64 tile of kernels/scaled_mm_sm90.cu is as fast or faster (H200,
#: 4096 x 4096: 11.7 against 12.1 us per tensor, 13.4 against 15.5 us in 128 x 128 blocks).
TOKS = (16,)
#: b's rows a block (wgmma's M)
ROWS = 64
#: (128-k blocks a slot, slots of the ring) by kind of call: FP8 whose scales do not vary along K,
#: FP8 whose scales do, INT8. A slot holds KPS x (64 + TOK) x 128 bytes (80 KB of ring a block at
#: TOK = 16, two blocks a SM). Four blocks a slot where the scales vary along K wait once a slot, not
#: once a block, before their promotions (H200, 8192 x 8192 in 128 x 128 blocks, M = 16: 21.0
#: against 26.3 us); FP8 sums that only add are fastest a block a slot (4096 x 4096 per tensor, M = 1:
#: 8.5 against 9.0 us), INT8 two (8192 x 8192, M = 1: 18.8 against 19.1 us).
SLOTS = {"end": (1, 8), "k": (4, 2), "int8": (2, 4)}
THREADS = 256
#: a split of K keeps at least this many 128-k blocks a part
MIN_KB_PER_SPLIT = 4

_KINDS = (  # (a's formats, b's formats, modes, SLOTS entry)
    (A_FORMATS, B_FORMATS, (A.MODE_END,), "end"),
    (A_FORMATS, B_FORMATS, A.MODES[1:], "k"),
    ((A.INT8_ID,), (A.INT8_ID,), (A.MODE_END,), "int8"),
)
FAMILY = _jit.register(
    "scaled_mm_sm90_small",
    [
        e
        for fa, fb, modes, kind in _KINDS
        for e in _jit.product("scaled_mm_sm90_small", fa, fb, _dtypes.INPUT_CTYPES, modes, TOKS, *zip(SLOTS[kind]))
    ],
    specific_targets=_device.WGMMA_TARGETS,
    specific_required=True,
)


def takes(L) -> bool:
    """Whether the call layout ``L`` goes to this kernel: at most max(TOKS) rows of a."""
    return L.M <= TOKS[-1]


def slots(L) -> tuple[int, int]:
    """(128-k blocks a slot, slots) of the kernel for the call layout ``L`` (SLOTS)."""
    if L.a_format == "int8":
        return SLOTS["int8"]
    return SLOTS["end" if L.mode == A.MODE_END else "k"]


def smem(tok: int, kps: int, stages: int) -> int:
    return stages * kps * (ROWS + tok) * A.BLOCK_K + 1024  # + the 1024-byte alignment of the ring


def splits(tiles: int, nkb: int, sms: int, kps: int) -> tuple[int, int]:
    """(parts, 128-k blocks a part) of K for ``tiles`` tiles of 64 rows of b: as many parts as keep
    two blocks on every SM (the weights' bytes in flight), none shorter than MIN_KB_PER_SPLIT blocks,
    each a whole number of slots of ``kps`` blocks (the last part may be shorter)."""
    s = max(1, min((2 * sms) // max(tiles, 1), nkb // MIN_KB_PER_SPLIT))
    per = round_up(ceil_div(nkb, s), kps)
    return ceil_div(nkb, per), per


def early_ok(weight) -> bool:
    """Whether the kernel may issue the first slots of b before its PDL wait: b is the codes of a
    QuantizedWeight that a call outside a graph capture has read already (as the weight-only
    matmul's rule, cupyquant/weight/dispatch.py early_ok: the kernel just before is then not the one
    that made them; assigning a new array to the weight starts over)."""
    return weight is not None and weight._read


class MmSmallLaunch:
    """The planned launch of one call layout: the kernel's Launch (arguments: the tensor maps of a
    and b, given at each call, then a's and b's scales, INT8's zero points and column term, bias, the
    output, the workspace and arrival counters of a K split) over a grid of (tiles of 64 rows of b,
    parts of K), with PDL (``pdl=False``: without); and a second Launch that issues b's first slots
    before the PDL wait, taken when ``early_ok``."""

    __slots__ = ("plain", "early", "maps", "ws", "counters", "device")

    def __init__(self, L, parts: int | None = None, *, pdl: bool = True):
        M, N, K, device = L.M, L.N, L.K, L.device
        self.device = device
        sms = _device.sm_count(device)
        tok = next(t for t in TOKS if M <= t)
        self.maps = OperandMaps(L, tok, ROWS)
        kps, stages = slots(L)
        tiles, nkb = ceil_div(N, ROWS), ceil_div(K, A.BLOCK_K)
        if parts is None:
            parts, per = splits(tiles, nkb, sms, kps)
        else:
            per = round_up(ceil_div(nkb, parts), kps)
            parts = ceil_div(nkb, per)
        ty = _dtypes.input_type(L.out_dtype, "out_dtype").ctype
        fa, fb = A.FORMAT_IDS[L.a_format], A.FORMAT_IDS[L.b_format]
        k = _jit.kernel(device, FAMILY, "scaled_mm_sm90_small", fa, fb, ty, L.mode, tok, kps, stages)
        size = smem(tok, kps, stages)
        _workspace.raise_smem_limit(device, k, size)
        self.ws = parts * tiles * 128 * (tok // 2) if parts > 1 else 0
        self.counters = tiles if parts > 1 else 0
        tm = Blob(_launch.TENSOR_MAP)
        launches = []
        for early in (False, True) if pdl else (False,):
            p = A.mm_args(L, parts, per)
            p["early"] = int(early)
            launches.append(Launch(k, (tiles, parts), (THREADS,), (tm, tm) + (ARG,) * 8 + (p,), smem=size, pdl=pdl))
        self.plain, self.early = launches[0], launches[1] if pdl else None

    def __call__(self, ops) -> None:
        """Launch on the current stream for a call's Operands."""
        ta, tb = self.maps(ops)
        ws = counters = None
        if self.ws:
            ws, counters = _workspace.split_buffers(self.device, self.ws, self.counters)
        w = ops.weight
        launch = self.early if self.early is not None and early_ok(w) else self.plain
        launch(ta, tb, ops.sa, ops.sb, ops.azp, ops.adj, ops.bias, ops.out2, ws, counters)
        if w is not None and not w._read and not cupy.cuda.get_current_stream().is_capturing():
            w._read = True  # a captured call may never run
