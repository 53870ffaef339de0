"""The Hopper W8A8 kernel for few rows of a (kernels/scaled_mm_sm90_small.cu: FP8 and INT8, a and b
swapped on the wgmma operands): which calls it takes, its K split and the plan of its launch."""

from __future__ import annotations

from .. import _device, _dtypes, _jit, _launch, _workspace
from .._launch import ARG, Blob, Launch
from .._sizes import ceil_div
from . import args as A
from .sm90 import A_FORMATS, B_FORMATS

#: a's rows the kernel takes: wgmma's N (a's rows past M read as zeros). The kernel builds for 32 as
#: well, but at M = 32 the 64 x 64 tile of kernels/scaled_mm_sm90.cu is as fast or faster (H200,
#: 4096 x 4096: 11.7 against 12.1 us per tensor, 13.4 against 15.5 us in 128 x 128 blocks).
TOKS = (16,)
#: b's rows a block (wgmma's M)
ROWS = 64
#: the ring's depth: (64 + TOK) x 128 bytes a slot, two blocks a SM (8 x 10 KB = 80 KB at TOK = 16)
STAGES = 8
THREADS = 256
#: a split of K keeps at least this many 128-k blocks a part
MIN_KB_PER_SPLIT = 4

FAMILY = _jit.register(
    "scaled_mm_sm90_small",
    _jit.product("scaled_mm_sm90_small", A_FORMATS, B_FORMATS, _dtypes.INPUT_CTYPES, A.MODES, TOKS, (STAGES,))
    + _jit.product(
        "scaled_mm_sm90_small", (A.INT8_ID,), (A.INT8_ID,), _dtypes.INPUT_CTYPES, (A.MODE_END,), TOKS, (STAGES,)
    ),
    specific_targets=_device.WGMMA_TARGETS,
    specific_required=True,
)


def takes(L) -> bool:
    """Whether the call layout ``L`` goes to this kernel: at most max(TOKS) rows of a."""
    return L.M <= TOKS[-1]


def smem(tok: int) -> int:
    return STAGES * (ROWS + tok) * A.BLOCK_K + 1024  # + the 1024-byte alignment of the ring


def splits(tiles: int, nkb: int, sms: int) -> tuple[int, int]:
    """(parts, 128-k blocks a part) of K for ``tiles`` tiles of 64 rows of b: as many parts as keep
    two blocks on every SM (the weights' bytes in flight), none shorter than MIN_KB_PER_SPLIT blocks."""
    s = max(1, min((2 * sms) // max(tiles, 1), nkb // MIN_KB_PER_SPLIT))
    per = ceil_div(nkb, s)
    return ceil_div(nkb, per), per


class MmSmallLaunch:
    """The planned launch of one call layout: the kernel's Launch (arguments: the tensor maps of a
    and b, given at each call, then a's and b's scales, INT8's zero points and column term, bias, the
    output, the workspace and arrival counters of a K split) over a grid of (tiles of 64 rows of b,
    parts of K)."""

    __slots__ = ("launch", "tok", "ws", "counters", "M", "N", "K", "device", "_maps")

    def __init__(self, L, parts: int | None = None):
        self.M, self.N, self.K, self.device = M, N, K, device = L.M, L.N, L.K, L.device
        sms = _device.sm_count(device)
        self.tok = tok = next(t for t in TOKS if M <= t)
        tiles, nkb = ceil_div(N, ROWS), ceil_div(K, A.BLOCK_K)
        if parts is None:
            parts, per = splits(tiles, nkb, sms)
        else:
            per = ceil_div(nkb, parts)
            parts = ceil_div(nkb, per)
        ty = _dtypes.input_type(L.out_dtype, "out_dtype").ctype
        fa, fb = A.FORMAT_IDS[L.a_format], A.FORMAT_IDS[L.b_format]
        k = _jit.kernel(device, FAMILY, "scaled_mm_sm90_small", fa, fb, ty, L.mode, tok, STAGES)
        _workspace.raise_smem_limit(device, k, smem(tok))
        self.ws = parts * tiles * 128 * (tok // 2) if parts > 1 else 0
        self.counters = tiles if parts > 1 else 0
        tm = Blob(_launch.TENSOR_MAP)
        args = (tm, tm) + (ARG,) * 8 + (A.mm_args(L, parts, per),)
        self.launch = Launch(k, (tiles, parts), (THREADS,), args, smem=smem(tok))
        self._maps = (None, None, None, None)

    def __call__(self, ops) -> None:
        """Launch on the current stream for a call's Operands."""
        dev = self.device
        ka, ta, kb, tb = self._maps
        pa, pb = (ops.a.data.ptr, ops.lda), (ops.b.data.ptr, ops.ldb)
        if pa != ka:
            ta = _workspace.tensor_map(pa[0], self.M, self.K, pa[1], dev, A.BLOCK_K, self.tok, 1)
        if pb != kb:
            tb = _workspace.tensor_map(pb[0], self.N, self.K, pb[1], dev, A.BLOCK_K, ROWS, 1)
        self._maps = (pa, ta, pb, tb)
        ws = counters = None
        if self.ws:
            ws, counters = _workspace.split_buffers(dev, self.ws, self.counters)
        self.launch(ta, tb, ops.sa, ops.sb, ops.azp, ops.adj, ops.bias, ops.out2, ws, counters)
