"""The Hopper W8A8 kernel (kernels/scaled_mm_sm90.cu): its tile table, its cost model (tile and K
split) and the plan of its launch."""

from __future__ import annotations

from dataclasses import dataclass

from .. import _device, _dtypes, _jit, _launch, _workspace
from .._launch import ARG, Blob, Launch
from .._sizes import ceil_div
from . import args as A


@dataclass(frozen=True)
class Sm90Config:
    """A tile of the kernel: ``bm`` rows of a by ``bn`` rows of b, and the depth of the ring of
    128-k slots (``stages`` x (bm + bn) x 128 bytes of shared memory, each slot a multiple of 1024
    bytes: ``bn`` a multiple of 8). One consumer warpgroup takes 64 rows; two take 128, or 256 in two
    64-row waves each."""

    bm: int
    bn: int
    stages: int

    @property
    def threads(self) -> int:
        return (256 if self.bm > 64 else 128) + 128  # consumer warpgroups and the producer

    @property
    def waves(self) -> int:
        """64-row waves a consumer warpgroup multiplies in turn (2: no K split, no K_COL mode)."""
        return self.bm // (128 if self.bm > 64 else 64)

    @property
    def can_split(self) -> bool:
        """Whether the kernel takes a K split in this tile (its SPLIT): tiles of one 64-row wave a
        consumer warpgroup up to 128 columns wide, whose sums leave the registers for the split's
        epilogue, and INT8's 128 x 256 tile, which keeps no block sums; not WIDE (128 running sums and
        64 block sums a thread) nor the FP8 tiles 144 to 192 columns wide (72 to 96 of each; at 192
        the split's epilogue spills)."""
        return self.waves == 1 and (self.bn <= 128 or self == INT8_WIDE)

    def smem(self, mode: int = A.MODE_END) -> int:
        """The ring, its 1024-byte alignment, and in ``mode`` either the consumer warpgroups' staging
        buffers of y's TMA stores or (MODE_K_TILE) the ring of the blocks' scales."""
        return self.stages * (self.bm + self.bn) * 128 + 1024 + self.y_stage(mode) + self.scale_ring(mode)

    def y_stage(self, mode: int = A.MODE_END) -> int:
        """The staging buffers of y's TMA stores: 64 rows x bn 16-bit values a consumer warpgroup;
        none for bn > 128 (whose tiles store y directly) nor in MODE_K_TILE, whose scale ring takes
        their place."""
        if self.bn > 128 or mode == A.MODE_K_TILE:
            return 0
        return (2 if self.bm > 64 else 1) * 64 * self.bn * 2

    def scale_ring(self, mode: int = A.MODE_END) -> int:
        """MODE_K_TILE's ring of scales: a slot a stage, bm words of a's scales and b's, 16-byte padded."""
        return self.stages * (self.bm + 4) * 4 if mode == A.MODE_K_TILE else 0

    @property
    def targs(self) -> tuple:
        return (self.bm, self.bn, self.stages)


#: FP8: 128 x 128 tiles for large M; 64 x 64 tiles (one consumer warpgroup) for small M (config), where
#: 128 rows would multiply zeros and narrow tiles give more of them to stream the weights with
#: (4096 x 4096 M = 16 on an H100: 11.7 us against 15.7 for 64 x 128). Rings of 192 KB, the most
#: one block a SM holds with its epilogue.
LARGE = Sm90Config(128, 128, 6)
SMALL = Sm90Config(64, 64, 12)
#: FP8 256 x 128 tiles (two waves a consumer warpgroup): b's rows in shared memory serve four waves,
#: not two, so a block of K moves 1.5 bytes from L2 an output element, not 2. Per tensor and
#: 128 x 128 blocks (MODE_END, MODE_K_TILE) only, never split.
WIDE = Sm90Config(256, 128, 4)
#: FP8 128 x 192, 128 x 160 and 128 x 144 tiles, per tensor and per token x per channel only
#: (MODE_END: K_TILE's one b scale a tile needs bn | 128, K_COL's per-column scales need registers),
#: never split: where 128 divides N badly, fewer and fuller rounds of them take less time (config,
#: _time; 2112 = 11 x 192, 4608 = 32 x 144, 5120 = 32 x 160). Rings of 5 and 6 slots (200-216 KB),
#: the most that fit. y is stored directly: its TMA boxes are 64 columns wide, and at 192 columns
#: the staging buffers would take a slot of the ring.
LARGE_192 = Sm90Config(128, 192, 5)
LARGE_160 = Sm90Config(128, 160, 6)
LARGE_144 = Sm90Config(128, 144, 6)
LARGE_WIDTHS = (LARGE_192, LARGE_160, LARGE_144)  # widest first: the planner's order of preference
CONFIGS = (WIDE, LARGE, SMALL, *LARGE_WIDTHS)
#: INT8, which keeps one accumulator set (no promotion): 128 x 256 tiles for large M, and the FP8 ones
INT8_WIDE = Sm90Config(128, 256, 4)
INT8_CONFIGS = (INT8_WIDE, LARGE, SMALL)
#: K from which the 128 x 256 INT8 tile beats the 128 x 128 one. On an H100 (us, wide / narrow):
#: 8192 x 8192 x 8192 838 / 1014, 8192 x 4096 x 14336 654 / 847; at K = 4096 and below the narrow
#: tile is as fast or faster: 2048 x 4096 x 4096 84.4 / 73.1, 8192 x 24576 x 1536 955 / 892.
INT8_WIDE_MIN_K = 8192


def modes(cfg: Sm90Config) -> tuple[int, ...]:
    """The scaling modes the kernel is built for in ``cfg``'s tile: a two-wave tile has no registers
    for K_COL's per-column scales; a tile wider than 128 columns takes MODE_END only (K_TILE's one b
    scale a tile needs bn | 128)."""
    if cfg.bn > 128:
        return (A.MODE_END,)
    return A.MODES if cfg.waves == 1 else (A.MODE_END, A.MODE_K_TILE)


#: FP8 formats of a and b the kernel is built for (the weights are e4m3; scaled_mm takes e5m2 b too)
A_FORMATS = B_FORMATS = tuple(A.FP8_IDS.values())

FAMILY = _jit.register(
    "scaled_mm_sm90",
    [
        e
        for cfg in CONFIGS
        for e in _jit.product(
            "scaled_mm_sm90", A_FORMATS, B_FORMATS, _dtypes.INPUT_CTYPES, modes(cfg), *[(v,) for v in cfg.targs]
        )
    ]
    + [
        _jit.expr("scaled_mm_sm90", A.INT8_ID, A.INT8_ID, ty, A.MODE_END, *cfg.targs)
        for cfg in INT8_CONFIGS
        for ty in _dtypes.INPUT_CTYPES
    ],
    specific_targets=_device.WGMMA_TARGETS,
    specific_required=True,
)

#: a split of K keeps at least this many 128-k blocks a part
MIN_KB_PER_SPLIT = 4


def config(M: int, N: int, K: int, sms: int, int8: bool = False, mode: int = A.MODE_END) -> Sm90Config:
    """The tile for an (M, N, K) matmul on ``sms`` SMs: 64 x 64 up to M = 64; up to M = 128 also
    where 128 x 128 tiles would leave half the SMs idle (and need a K split), unless the 64 x 64
    tiles take more than one wave over a long K; 128 x 128 otherwise. On an H100 at M = 128:
    7168 x 2048 13.6 against 18.4 us, 2112 x 7168 12.8 against 24.3; at M = 65, 8192 x 8192 46.1
    against 35.9 (the exception). INT8 above M = 128 takes the 128 x 256 tile over a long K (at least
    INT8_WIDE_MIN_K) unless its last round of tiles is emptier than the 128 x 128 tiles' (their
    waves, at half the work each, take less). FP8 above M = 128 takes 256 x 128 tiles where they pay
    (_wide_pays), else 128 x 128; per tensor and per token x per channel (MODE_END), a 128 x 192, 160
    or 144 tile instead where its modelled time (_time) is less than that choice's, the widest of
    equal times: 4096 x 2112 5 rounds of 128 x 128 tiles, 3 of 256 x 128 (4.8), 3 of 128 x 192 (4.5);
    1024 x 2112 2 rounds, 1 of 68 256 x 128 tiles (1.6), 1 of 120 128 x 144 tiles (1.125)."""
    if M <= 64:
        return SMALL
    if M > 128:
        if int8:
            if K >= INT8_WIDE_MIN_K and _waves(M, N, INT8_WIDE, sms) * 2 <= _waves(M, N, LARGE, sms):
                return INT8_WIDE
            return LARGE
        best = WIDE if mode != A.MODE_K_COL and _wide_pays(M, N, sms) else LARGE
        if mode == A.MODE_END:
            for cfg in LARGE_WIDTHS:
                if _time(M, N, cfg, sms) < _time(M, N, best, sms):
                    best = cfg
        return best
    tiles_large = ceil_div(M, LARGE.bm) * ceil_div(N, LARGE.bn)
    tiles_small = ceil_div(M, SMALL.bm) * ceil_div(N, SMALL.bn)
    if 2 * tiles_large <= sms and (tiles_small <= sms or K < 8192):
        return SMALL
    return LARGE


#: A 256 x 128 tile's time over a 128 x 128 one's: it does twice the work at about 1.25x the rate.
#: On an H200 (TFLOP/s, wide / narrow, per tensor): 4096 x 4096 x 4096 1019 / 776-912, 4096 x 24576 x
#: 1536 806 / 601, 4096 x 2112 x 7168 819 / 700 (3 rounds of wide tiles against 5 of narrow ones).
WIDE_COST = 1.6


def _wide_pays(M: int, N: int, sms: int) -> bool:
    """Whether FP8's 256 x 128 tiles (never split) beat the 128 x 128 ones on an (M, N) output: they
    fill at least half the SMs, and their rounds, at WIDE_COST each, take less time (at 512 x 4096
    the wide tiles would fill 64 SMs: 555 against 684 TFLOP/s)."""
    tiles = ceil_div(M, WIDE.bm) * ceil_div(N, WIDE.bn)
    return 2 * tiles > sms and _time(M, N, WIDE, sms) <= _time(M, N, LARGE, sms)


def _time(M: int, N: int, cfg: Sm90Config, sms: int) -> float:
    """The modelled time of an (M, N) output in ``cfg``'s tiles (FP8 above M = 128, unsplit), in
    rounds of 128 x 128 tiles: the rounds of one tile a SM that it takes (_waves), each as long as
    the tile's work makes it, bn / 128 of a 128 x 128 tile's round for a 128-row tile and WIDE_COST
    for a 256 x 128 tile. It counts only how full the last round is; what a wider tile saves in
    loads from L2 for the same work is left out, so that a width pays only by rounds it saves."""
    cost = WIDE_COST if cfg == WIDE else cfg.bn / 128
    return _waves(M, N, cfg, sms) * cost


def _waves(M: int, N: int, cfg: Sm90Config, sms: int) -> int:
    """Rounds of one tile per SM that an (M, N) output takes in ``cfg``'s tiles."""
    return ceil_div(ceil_div(M, cfg.bm) * ceil_div(N, cfg.bn), sms)


def splits(tiles: int, nkb: int, sms: int) -> tuple[int, int]:
    """(parts, 128-k blocks a part) of K for ``tiles`` tiles on ``sms`` SMs: where the tiles leave
    half the SMs idle or more, as many parts as fill them, none shorter than MIN_KB_PER_SPLIT blocks
    (each part adds a round trip through L2 to the tile's end: on an H100, 2112 x 7168 M = 16 with 34
    tiles takes 16.2 us unsplit, 13.0 in 4 parts; 4096 x 4096 with 64 tiles 11.7 unsplit, 12.2 in 2)."""
    if 2 * tiles > sms:
        return 1, nkb
    s = max(1, min(sms // max(tiles, 1), nkb // MIN_KB_PER_SPLIT))
    per = ceil_div(nkb, s)
    return ceil_div(nkb, per), per


#: y's TMA store box: 64 rows x 64 16-bit columns (128-byte rows, the 128-byte swizzle)
Y_BOX = 64


class OperandMaps:
    """The TMA tensor maps of a call's a and b (8-bit rows, boxes of 128 k by ``box_a`` and
    ``box_b`` rows), encoded again only when a call's address or row stride differs from the last
    call's (a plan's calls usually pass the same buffers; _workspace.tensor_map caches the rest)."""

    __slots__ = ("M", "N", "K", "device", "box_a", "box_b", "_last")

    def __init__(self, L, box_a: int, box_b: int):
        self.M, self.N, self.K, self.device = L.M, L.N, L.K, L.device
        self.box_a, self.box_b = box_a, box_b
        self._last = (None, None, None, None)  # a's and b's (address, row stride), map

    def __call__(self, ops) -> tuple:
        """(a's map, b's map) for a call's Operands."""
        ka, ta, kb, tb = self._last
        pa, pb = (ops.a.data.ptr, ops.lda), (ops.b.data.ptr, ops.ldb)
        if pa != ka:
            ta = _workspace.tensor_map(pa[0], self.M, self.K, pa[1], self.device, A.BLOCK_K, self.box_a, 1)
        if pb != kb:
            tb = _workspace.tensor_map(pb[0], self.N, self.K, pb[1], self.device, A.BLOCK_K, self.box_b, 1)
        self._last = (pa, ta, pb, tb)
        return ta, tb


class MmLaunch:
    """The planned launch of one call layout: the kernel's Launch (arguments: the tensor maps of a
    and b, given at each call, then a's and b's scales, zero points, column term, bias, the output,
    the workspace and arrival counters of a K split), a's and b's tensor maps (OperandMaps), and the K
    split's workspace (its float32 elements, 0 for none) and counters. It is launched with PDL: the
    kernel waits for the kernel before it ahead of any global access, so that only its launch and
    set-up overlap that kernel's end.

    ``cfg`` and ``parts`` default to the planner's choice. ``cluster=2`` launches clusters of two
    blocks that take neighbouring tiles in N and share a's rows, each loading half of them for both
    by TMA multicast (no K split). It halves a's reads from L2 but is not faster on an H200, where
    the kernel is not bound by L2 (4096 x 4096 x 4096 per tensor: 1029 against 1019 TFLOP/s; 8192^3:
    1060 against 1203), so the planner does not take it; tests and benchmarks force it."""

    __slots__ = ("launch", "maps", "ws", "counters", "M", "N", "K", "device", "ldy", "y_tma", "_ymap")

    def __init__(self, L, cfg: Sm90Config | None = None, parts: int | None = None, cluster: int = 1):
        self.M, self.N, self.K, self.device = M, N, K, device = L.M, L.N, L.K, L.device
        sms = _device.sm_count(device)
        cfg = config(M, N, K, sms, L.a_format == "int8", L.mode) if cfg is None else cfg
        tiles_n, tiles_m = ceil_div(N, cfg.bn), ceil_div(M, cfg.bm)
        nkb = ceil_div(K, A.BLOCK_K)
        if not cfg.can_split:
            parts, per = 1, nkb
        elif parts is None:
            parts, per = splits(tiles_n * tiles_m, nkb, sms)
        else:
            per = ceil_div(nkb, parts)
            parts = ceil_div(nkb, per)
        ty = _dtypes.input_type(L.out_dtype, "out_dtype").ctype
        fa, fb = A.FORMAT_IDS[L.a_format], A.FORMAT_IDS[L.b_format]
        k = _jit.kernel(device, FAMILY, "scaled_mm_sm90", fa, fb, ty, L.mode, *cfg.targs)
        smem = cfg.smem(L.mode)
        _workspace.raise_smem_limit(device, k, smem)
        self.ws = parts * tiles_n * tiles_m * cfg.bm * cfg.bn if parts > 1 else 0
        self.counters = tiles_n * tiles_m if parts > 1 else 0
        if cluster not in (1, 2) or (cluster == 2 and parts > 1):
            raise ValueError(f"cluster must be 1, or 2 without a K split, got {cluster} with {parts} parts")
        self.maps = OperandMaps(L, cfg.bm // cluster, cfg.bn)
        tm = Blob(_launch.TENSOR_MAP)
        args = (tm, tm, tm) + (ARG,) * 8 + (A.mm_args(L, parts, per, cluster),)
        # y by TMA from shared memory where the kernel can (16-bit out, unsplit, rows a multiple of 16
        # bytes apart); a call whose out is not 16-byte aligned stores directly (y_tma = 0)
        self.ldy = L.ldy or N
        ty_bytes = _dtypes.input_type(L.out_dtype, "out_dtype").dtype.itemsize
        self.y_tma = cfg.y_stage(L.mode) > 0 and ty_bytes == 2 and parts == 1 and (self.ldy * 2) % 16 == 0
        self._ymap = (None, None)
        work = tiles_m * ceil_div(tiles_n, cluster) * parts  # a cluster's items
        fields = ((len(args) - 1, "y_tma"),)
        if cluster == 1:
            self.launch = Launch(k, (min(work, sms),), (cfg.threads,), args, smem=smem, pdl=True, fields=fields)
        else:
            fit = _launch.max_active_clusters(k, cfg.threads, smem, (cluster, 1, 1))
            grid = cluster * min(work, fit)
            self.launch = Launch(
                k, (grid,), (cfg.threads,), args, smem=smem, pdl=True, cluster=(cluster, 1, 1), fields=fields
            )

    def __call__(self, ops) -> None:
        """Launch on the current stream for a call's Operands."""
        dev = self.device
        tma, tmb = self.maps(ops)
        ws = counters = None
        if self.ws:
            ws, counters = _workspace.split_buffers(dev, self.ws, self.counters)
        py = ops.out2  # the output's address (build.Operands)
        use = self.y_tma and py % 16 == 0
        tmy = _workspace.NO_TENSOR_MAP  # never read where the call stores y directly
        if use:
            ky, tmy = self._ymap
            if ky != py:
                tmy = _workspace.tensor_map(py, self.M, self.N, self.ldy * 2, dev, Y_BOX, Y_BOX, 2)
                self._ymap = (py, tmy)
        self.launch(tma, tmb, tmy, ops.sa, ops.sb, ops.azp, ops.adj, ops.bias, ops.out2, ws, counters, int(use))
