"""The launcher's host side without a GPU: the ctypes structures match cuda.h, a Launch's parameter
array points at the values the kernel must receive (fixed ones written once, pointers patched at
each call), and the argument structs match the kernels'."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np
import pytest

from cupyquant import _launch

pytest.importorskip("cupy")  # the header comes with the CUDA runtime wheels of the cu12/cu13 extras


def _cuda_h() -> str:
    from cupyquant import _jit

    try:
        path = Path(_jit.cuda_include_dir()) / "cuda.h"
    except Exception as e:  # noqa: BLE001 - no headers: say so
        pytest.skip(f"no CUDA headers: {e}")
    if not path.exists():
        pytest.skip(f"no cuda.h in {path.parent}")
    return path.read_text(errors="replace")


def _fields(header: str, struct: str) -> list[str]:
    body = re.search(r"typedef struct " + struct + r"\s*\{(.*?)\}", header, re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    return [re.findall(r"(\w+)\s*(?:\[[^\]]*\])?\s*;", line)[0] for line in body.split("\n") if ";" in line]


def test_structures_match_cuda_h():
    h = _cuda_h()
    assert re.search(r"CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION\s*=\s*6\b", h)
    assert _launch.ATTR_PROGRAMMATIC_STREAM_SERIALIZATION == 6
    assert re.search(r"CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION\s*=\s*4\b", h)
    assert _launch.ATTR_CLUSTER_DIMENSION == 4
    # the cluster dimension's member of the value union: three unsigned ints x, y, z
    assert re.search(r"struct\s*\{\s*unsigned int x;\s*unsigned int y;\s*unsigned int z;\s*\}\s*clusterDim;", h)
    assert _fields(h, "CUlaunchConfig_st") == [f for f, _ in _launch.LaunchConfig._fields_]
    assert _fields(h, "CUlaunchAttribute_st") == [f for f, _ in _launch.LaunchAttribute._fields_]
    assert re.search(r"union CUlaunchAttributeValue_union\s*\{\s*char pad\[64\];", h)


def test_structure_layout_by_hand():
    # CUlaunchConfig: seven unsigned ints (28 bytes), the stream at 32 after 4 bytes of padding, the
    # attribute pointer at 40, the count at 48, 56 bytes in all; CUlaunchAttribute: a 4-byte id
    # padded to 8, then the 64-byte value union
    assert ctypes.sizeof(_launch.LaunchConfig) == 56
    assert (
        _launch.LaunchConfig.sharedMemBytes.offset,
        _launch.LaunchConfig.hStream.offset,
        _launch.LaunchConfig.attrs.offset,
        _launch.LaunchConfig.numAttrs.offset,
    ) == (24, 32, 40, 48)
    assert ctypes.sizeof(_launch.LaunchAttribute) == 72 and _launch.LaunchAttribute.value.offset == 8
    a = _launch._PDL_ATTR
    assert a.id == 6 and bytes(a.value)[:4] == (1).to_bytes(4, "little") and not any(bytes(a.value)[4:])


def test_launch_attributes():
    attrs, n = _launch.launch_attributes(True)
    assert n == 1 and attrs.contents.id == 6
    assert _launch.launch_attributes(False) == (None, 0)
    for pdl in (True, False):
        attrs, n = _launch.launch_attributes(pdl, (1, 1, 2))
        assert n == (2 if pdl else 1)
        assert attrs[0].id == 4 and bytes(attrs[0].value)[:12] == b"".join(v.to_bytes(4, "little") for v in (1, 1, 2))
        assert not any(bytes(attrs[0].value)[12:])
        assert attrs[1].id == 6 and bytes(attrs[1].value)[:4] == (1).to_bytes(4, "little")


class _Ptr:
    def __init__(self, p):
        self.ptr = p


class _Arr:  # what the launcher reads of a CuPy array
    def __init__(self, p):
        self.data = _Ptr(p)


class _Kernel:  # what the launcher reads of a cupy.RawKernel
    def __init__(self):
        self.kernel = _Ptr(0x1234)


def _patch(launch, values):
    """Write a call's values into the parameter buffer as a call does, without launching."""
    launch._copy_blobs(values) if launch._blobs else [
        launch._words.__setitem__(slot, v if type(v) is int else (0 if v is None else v.data.ptr))
        for slot, v in zip(launch._slots, values)
    ]


def test_launch_params_point_at_each_value():
    st = np.zeros((), dtype=np.dtype([("M", np.int64), ("ptr", np.uint64), ("g", np.int32)], align=True))
    st["M"], st["g"] = 3, -7
    tm = np.zeros((), _launch.TENSOR_MAP)
    tm["w"] = np.arange(16)
    L = _launch.Launch(
        _Kernel(),
        (5,),
        (256,),
        (_launch.ARG, 0x40, np.float32(1.5), st, _launch.ARG, _launch.Blob(_launch.TENSOR_MAP)),
        fields=((3, "ptr"),),
    )
    assert L.grid == (5, 1, 1) and L.block == (256, 1, 1) and L._cfg is None
    _patch(L, (_Arr(0x7F0000001000), None, tm, 0x9000))
    params = L._params
    assert len(params) == 6 and all(p % 64 == 0 for p in params)  # each argument in a slot of its own
    assert ctypes.c_uint64.from_address(params[0]).value == 0x7F0000001000
    assert ctypes.c_uint64.from_address(params[1]).value == 0x40  # a fixed pointer
    assert ctypes.c_float.from_address(params[2]).value == 1.5
    got = np.frombuffer(ctypes.string_at(params[3], st.dtype.itemsize), st.dtype)[0]
    assert (got["M"], got["ptr"], got["g"]) == (3, 0x9000, -7)  # a pointer field given at the call
    assert ctypes.c_uint64.from_address(params[4]).value == 0  # None: a null pointer
    assert ctypes.string_at(params[5], 128) == tm.tobytes()  # a blob copied by value
    assert L.param_bytes(3) == ctypes.string_at(params[3], st.dtype.itemsize)
    with pytest.raises(TypeError, match="0-d struct"):
        _launch.Launch(_Kernel(), (1,), (32,), (np.zeros(3, np.int64),))


def test_recorded_call_shows_left_out_arguments_as_their_zero_bytes():
    """A plan may leave out a call's last arguments (no split-K workspace, no tensor map): the
    recording shows them as a launch passes them, a null pointer and an all-zero map."""
    L = _launch.Launch(
        _Kernel(), (1,), (32,), (_launch.ARG, _launch.ARG, _launch.ARG, _launch.Blob(_launch.TENSOR_MAP))
    )
    _patch(L, (0x7000,))
    kernel, grid, block, args, smem, launch = L._record((0x7000,))
    assert args[:3] == (0x7000, None, None) and launch is L
    assert args[3].dtype == _launch.TENSOR_MAP and not args[3]["w"].any()


def test_launch_attributes_of_pdl_and_cluster_launches():
    L = _launch.Launch(_Kernel(), (2, 3), (128,), (_launch.ARG,), smem=1024, pdl=True, cluster=(1, 1, 2))
    cfg = L._cfg
    assert (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX, cfg.sharedMemBytes) == (2, 3, 1, 128, 1024)
    assert cfg.numAttrs == 2 and cfg.attrs[0].id == 4 and cfg.attrs[1].id == 6


def test_recording_gives_raw_kernel_arguments(monkeypatch):
    """_launch.recording: each call as cupy.RawKernel takes it, structs with their pointers filled in."""
    st = np.zeros((), dtype=np.dtype([("n", np.int64), ("p", np.uint64)], align=True))
    L = _launch.Launch(_Kernel(), (1,), (32,), (_launch.ARG, np.int64(7), st), fields=((2, "p"),))
    monkeypatch.setattr(_launch, "_stream_ptr", lambda: 0)
    monkeypatch.setattr(_launch.Launch, "_go", lambda self, stream: None)
    a = _Arr(0x1000)
    with _launch.recording() as rec:
        L(a, 0x2000)
        _launch._recording.append(("x",))  # recording restores the outer state on exit
    kernel, grid, block, args, smem, launch = rec[0]
    assert launch is L and grid == (1, 1, 1) and args[0] is a and args[1] == 7 and args[2]["p"] == 0x2000
    assert _launch._recording is None


# The argument structures passed by value to the kernels: the NumPy dtype the wrapper fills, and the
# kernel file and struct it must match field for field (name, type, order).
_C_TYPES = {"i64": np.int64, "int": np.int32, "float": np.float32, "unsigned long long": np.uint64}
ARG_STRUCTS = [
    ("_scales", "SCALE_ARGS", "groupwise.cuh", "ScaleArgs"),
    ("norm", "_NORM_ARGS", "rms_norm.cu", "NormArgs"),
    ("kv_cache", "_WRITE_ARGS", "kv_cache.cu", "KVWriteArgs"),
    ("kv_cache", "_READ_ARGS", "kv_cache.cu", "KVReadArgs"),
    ("_block_scale", "QUANT_ARGS", "block_scale.cuh", "QuantArgs"),
    ("_block_scale", "DEQUANT_ARGS", "block_scale.cuh", "DequantArgs"),
    ("weight.quant", "QUANT_ARGS", "weight_quant.cu", "WQuantArgs"),
    ("weight.quant", "QUANT_ARGS", "weight_quant.cu", "WDequantArgs"),
    ("weight.quant", "BLOCK_ARGS", "weight_quant.cu", "WBlockArgs"),
    ("weight.decode", "ARGS", "weight_decode.cu", "MatmulArgs"),
    ("weight.sm80_gemm", "ARGS", "weight_sm80_gemm.cu", "GemmArgs"),
    ("weight.sm90_gemm", "ARGS", "weight_sm90_gemm.cu", "WgArgs"),
]


def _c_fields(source: str, struct: str) -> list[tuple[str, type]]:
    body = re.search(r"^struct " + struct + r" \{(.*?)^\};", source, re.S | re.M).group(1)
    out = []
    for decl in re.sub(r"//[^\n]*", "", body).split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        m = re.fullmatch(r"((?:const )?[\w ]+?)\s*(\*?)\s*(\w+(?:\s*,\s*\w+)*)", decl)
        assert m, decl
        ctype = np.uint64 if m.group(2) else _C_TYPES[m.group(1)]  # pointers travel as 64-bit integers
        out += [(name.strip(), ctype) for name in m.group(3).split(",")]
    return out


@pytest.mark.parametrize("module,dtype_name,cu,struct", ARG_STRUCTS, ids=[f"{c}:{s}" for _, _, c, s in ARG_STRUCTS])
def test_kernel_argument_structs_match_their_dtypes(module, dtype_name, cu, struct):
    import importlib

    from cupyquant import _jit

    dt = getattr(importlib.import_module(f"cupyquant.{module}"), dtype_name)
    fields = _c_fields((Path(_jit.kernel_dir()) / cu).read_text(), struct)
    assert [(n, np.dtype(t)) for n, t in fields] == [(n, dt.fields[n][0]) for n in dt.names], (cu, struct)
    assert dt.isalignedstruct


def test_tensor_map_matches_the_kernels_parameter():
    """The 128-byte CUtensorMap that the Hopper kernels take by value is sm90_async.cuh's TmaMap:
    sixteen 64-bit words, 64-byte aligned (cuda.h's CUtensorMap is 16 x 64 bits, alignas(64)); the
    sm90 gemm kernel's last two parameters are two of them (the whole tiles' boxes and the last
    tile's)."""
    from cupyquant import _jit

    assert _launch.TENSOR_MAP.itemsize == 128 and _launch.TENSOR_MAP.names == ("w",)
    kernels = Path(_jit.kernel_dir())
    header = (kernels / "sm90_async.cuh").read_text()
    body = re.search(r"^struct alignas\(64\) TmaMap \{(.*?)^\};", header, re.S | re.M)
    assert body and " ".join(re.sub(r"//[^\n]*", "", body.group(1)).split()) == "unsigned long long w[16];"
    for name in ("weight_sm90_gemm.cu", "scaled_mm_sm90.cu", "scaled_mm_sm90_small.cu"):
        src = (kernels / name).read_text()
        assert '#include "sm90_async.cuh"' in src and "struct alignas(64) TmaMap" not in src, name
    src = (kernels / "weight_sm90_gemm.cu").read_text()
    assert "const __grid_constant__ TmaMap tm, const __grid_constant__ TmaMap tm_tail)" in src, "two maps, last"


@pytest.mark.gpu
def test_tensor_map_2d_encodes_and_refuses():
    """cuTensorMapEncodeTiled through ctypes: a map of a 16-byte-aligned matrix is 128 bytes, not
    all zero, and the driver's refusal of a misaligned address comes back as a RuntimeError with its
    message (matmul never asks for one: it copies such activations first)."""
    import cupy

    buf = cupy.zeros((300, 512), dtype=cupy.float16)
    m = _launch.tensor_map_2d(buf.data.ptr, 300, 512, buf.strides[0], 64, 128)
    assert m.shape == () and m.dtype == _launch.TENSOR_MAP and m["w"].any()
    with pytest.raises(RuntimeError, match="cuTensorMapEncodeTiled"):
        _launch.tensor_map_2d(buf.data.ptr + 2, 300, 512, buf.strides[0], 64, 128)


def test_tensor_map_cache_reuses_and_stays_bounded(monkeypatch):
    """_workspace.tensor_map encodes a map once per (address, rows, K, row stride, device, box) and
    keeps at most TMAP_CACHE of them, the oldest going first; the encoder is stubbed (no GPU needed)."""
    from cupyquant import _workspace as W

    calls = []

    def fake(ptr, rows, cols, row_bytes, box_cols, box_rows, elem_bytes=2):
        calls.append((ptr, rows, cols, row_bytes, box_cols, box_rows))
        return np.zeros((), _launch.TENSOR_MAP)

    monkeypatch.setattr(_launch, "tensor_map_2d", fake)
    monkeypatch.setattr(W, "tmap_cache", {})
    monkeypatch.setattr(W, "TMAP_CACHE", 4)
    m = W.tensor_map(1 << 20, 200, 4096, 8192, 0, 64, 128)
    assert W.tensor_map(1 << 20, 200, 4096, 8192, 0, 64, 128) is m and len(calls) == 1
    assert calls[0] == (1 << 20, 200, 4096, 8192, 64, 128)
    # a different row count, row stride, device or box is a different map
    W.tensor_map(1 << 20, 201, 4096, 8192, 0, 64, 128)
    W.tensor_map(1 << 20, 200, 4096, 16384, 0, 64, 128)
    W.tensor_map(1 << 20, 200, 4096, 8192, 1, 64, 128)
    assert len(calls) == 4 and len(W.tmap_cache) == 4
    W.tensor_map(1 << 20, 200, 4096, 8192, 0, 64, 72)  # the fifth evicts the first
    assert len(W.tmap_cache) == 4 and len(calls) == 5 and calls[-1][-1] == 72
    W.tensor_map(1 << 20, 200, 4096, 8192, 0, 64, 128)
    assert len(calls) == 6, "the oldest map was evicted and is encoded again"


def test_a_refused_launch_raises_kernel_launch_error(monkeypatch):
    """A launch that the driver refuses raises cupyquant.KernelLaunchError (a RuntimeError) with the
    driver's code and message. The driver is replaced by one that refuses every launch, so no GPU
    is needed."""
    import cupyquant

    def refuse(cfg, fn, params, extra):
        return 1  # CUDA_ERROR_INVALID_VALUE

    def message(code, out):  # out: a ctypes byref of the char* the driver fills
        out._obj.value = b"invalid argument"
        return 0

    monkeypatch.setattr(_launch, "_driver", lambda: (refuse, message))
    monkeypatch.setattr(_launch, "_stream_ptr", lambda: 0)
    launch = _launch.Launch(_Kernel(), (1,), (32,), (_launch.ARG,), pdl=True)
    with pytest.raises(cupyquant.KernelLaunchError) as info:
        launch(0)
    assert isinstance(info.value, RuntimeError)
    assert info.value.code == 1 and info.value.message == "invalid argument"
    assert "cuLaunchKernelEx failed: error 1 (invalid argument)" in str(info.value)


# The modules whose every launch carries programmatic dependent launch where the GPU has it.
PDL_MODULES = ("per_tensor", "groupwise", "mx", "nvfp4", "norm", "kv_cache", "_block_scale")


@pytest.mark.parametrize("module", PDL_MODULES)
def test_every_launch_of_the_activation_ops_asks_for_pdl_by_capability(module):
    """Every ``Launch(...)`` of these modules passes ``pdl=`` the device's ``Caps.pdl`` (compute
    capability 9.0 and newer: their kernels wait before their first global access), directly or
    through a local ``pdl = _device.caps(device).pdl``; never a constant. (The GPU test
    tests/test_runtime.py::test_launches_carry_pdl_by_capability checks the launches themselves.)"""
    import ast

    from cupyquant import _jit

    path = Path(_jit.kernel_dir()).parent / "cupyquant" / f"{module}.py"
    tree = ast.parse(path.read_text())
    caps_pdl = re.compile(r"_device\.caps\(\w+(\.\w+)*\)\.pdl")
    local = {
        t.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign) and caps_pdl.fullmatch(ast.unparse(n.value))
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and (n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", "")) == "Launch"
    ]
    assert calls or module in ("mx", "nvfp4"), module  # they launch through _block_scale (and per_tensor)
    for c in calls:
        pdl = [k.value for k in c.keywords if k.arg == "pdl"]
        assert pdl, f"{module}.py:{c.lineno}: Launch without pdl="
        v = ast.unparse(pdl[0])
        assert caps_pdl.fullmatch(v) or v in local, f"{module}.py:{c.lineno}: pdl={v}"
