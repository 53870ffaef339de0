"""The kernel loader: the only module that touches ``cupy.RawModule``.

Each kernel *family* is one CUDA file ``kernels/<family>.cu``. At the first call of one of its
kernels on a device, the family's source (with its local ``#include "x.cuh"`` lines inlined) is
compiled by NVRTC through ``cupy.RawModule`` for that device's architecture, with the complete list
of the family's template instantiations as name expressions. CuPy keeps the binary in its disk cache
(``CUPY_CACHE_DIR``), keyed on the source, the options, the NVRTC version and the architecture;
this module memoizes the loaded module per device.

Adding a kernel family takes three steps:

1. Write ``kernels/<family>.cu``: ``#include "common.cuh"``, ``extern "C++"`` templates of
   ``__global__`` kernels, and a comment block saying what it computes, its rounding rule, its
   memory layout and the ``cupyquant.reference`` function it must match bit for bit.
2. Register it in ``_FAMILIES`` below: the family name and every instantiation a wrapper may ask
   for (use :func:`expr` and the tables in ``_dtypes``). A CPU test compiles all of them with NVRTC
   for sm_80, sm_89, sm_90, sm_100 and sm_120.
3. Write ``cupyquant/<family>.py``: validate arguments, then ``kernel(device, family, name,
   *targs)`` and launch it on the current stream. Asking for an unregistered expression raises, so the registry
   cannot fall behind the wrappers.

Local includes are inlined (rather than found through ``-I``) because CuPy's disk cache hashes only
the source string: a header edited behind an unchanged ``.cu`` would otherwise load a stale binary.
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import threading
from functools import lru_cache
from pathlib import Path

from . import _dtypes

KERNEL_DIR_ENV = "CUPYQUANT_KERNEL_DIR"
CUDA_INCLUDE_ENV = "CUPYQUANT_CUDA_INCLUDE"

#: Options for every family. No fast-math: it breaks round-half-to-even. CuPy adds ``-ftz=true``
#: itself; kernels use explicit IEEE PTX arithmetic wherever flushing could change an output byte.
BASE_OPTIONS = ("-std=c++17",)

#: What CuPy adds to the options when it compiles through NVRTC (cupy/cuda/compiler.py); the
#: GPU-free compile test adds the same so that it compiles what a device would.
CUPY_ADDED_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")

TEST_ARCHS = ("80", "89", "90", "100", "120")


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel family: carries the family, expression, options and NVRTC log."""

    def __init__(self, family: str, expression: str, options, log: str):
        self.family = family
        self.expression = expression
        self.options = tuple(options)
        self.log = log
        super().__init__(
            f"cupyquant could not compile kernel family {family!r} (asked for {expression!r}) "
            f"with options {' '.join(self.options)}\nNVRTC log:\n{log}"
        )


class CudaHeadersNotFound(RuntimeError):
    """The CUDA runtime headers (cuda_fp16.h, cuda_fp8.h, ...) NVRTC needs were not found."""


def expr(name: str, *targs) -> str:
    """The name expression ``name<a, b, ...>`` for template arguments (bools as true/false)."""
    parts = []
    for a in targs:
        if isinstance(a, bool):
            parts.append("true" if a else "false")
        else:
            parts.append(str(a))
    return f"{name}<{', '.join(parts)}>"


def _product(name: str, *axes) -> list[str]:
    return [expr(name, *combo) for combo in itertools.product(*axes)]


_BOOLS = (False, True)
# Configurations of the decode matmul (kernels/weight.cu MM_DEC3 ... MM_TWO_ONE): M <= 8 with 3
# or 4 blocks of 8 warps per SM, M tiles of 16 rows with blocks of 8 warps, M <= 8 with blocks of
# 16 warps, M <= 8 with blocks of 4, M tiles of 16 rows with blocks of 4 and of 16 warps (32 weight
# rows a block), with blocks of 4 and of 8 warps of 64 weight rows, and M tiles of 16 rows with
# blocks of 8 warps one per SM and two sets of partial sums (MM_TWO_ONE).
MATMUL_DEC3, MATMUL_DEC4, MATMUL_TWO, MATMUL_WIDE, MATMUL_NARROW, MATMUL_TWO_NARROW, MATMUL_TWO_WIDE, MATMUL_FOUR, MATMUL_FOUR_WIDE, MATMUL_TWO_ONE = range(10)
MATMUL_CONFIGS = (MATMUL_DEC3, MATMUL_DEC4, MATMUL_TWO, MATMUL_WIDE, MATMUL_NARROW, MATMUL_TWO_NARROW, MATMUL_TWO_WIDE, MATMUL_FOUR,
                  MATMUL_FOUR_WIDE, MATMUL_TWO_ONE)
_IN_CTYPES = tuple(t.ctype for t in _dtypes.INPUT_TYPES)
_FP8_TAGS = tuple(_dtypes.element_format(n).ctag for n in _dtypes.FP8_NAMES)
_Q8_TAGS = _FP8_TAGS + (_dtypes.element_format("int8").ctag,)

# Static-scale modes of fp8_quantize, mirrored in kernels/fp8_tensor.cu.
FP8_SCALE_FROM_AMAX, FP8_SCALE_FROM_DEVICE, FP8_SCALE_FROM_ARG = 0, 1, 2

# Weight schemes of kernels/weight.cu (W_INT4, W_UINT4, W_FP8); the matmul takes fp16/bf16 only.
WEIGHT_INT4, WEIGHT_UINT4, WEIGHT_FP8 = 0, 1, 2
_WEIGHT_SCHEMES = (WEIGHT_INT4, WEIGHT_UINT4, WEIGHT_FP8)
_HALF_CTYPES = ("__half", "__nv_bfloat16")
#: w4a16_gemm tile configurations (MT m16 tiles per warp, WM warps along M, STAGES) and the POST
#: values each is built with (kernels/weight_gemm.cu: MT = 4 has no registers for POST's partials).
GEMM_CONFIGS = {(1, 1, 4): _BOOLS, (2, 1, 4): _BOOLS, (4, 1, 4): (False,), (4, 2, 3): (False,)}

#: w4a16_wgmma tile configurations: (rows of a per tile, ring stages, 64-k halves per stage)
#: (kernels/weight_wgmma.cu), each built for both prepared INT4 orders (KP: weight.py _kperm).
WGMMA_CONFIGS = ((32, 6, 2), (64, 4, 2), (128, 5, 2), (256, 6, 1))

_MX_FP_TAGS = tuple(_dtypes.element_format(n).ctag for n in _dtypes.MX_NAMES)

#: family -> every instantiation its wrappers may request.
_FAMILIES: dict[str, tuple[str, ...]] = {
    "fp8_tensor": tuple(
        _product("fp8_amax", _IN_CTYPES, _BOOLS)
        + _product(
            "fp8_quantize",
            _IN_CTYPES,
            _FP8_TAGS,
            (FP8_SCALE_FROM_AMAX, FP8_SCALE_FROM_DEVICE, FP8_SCALE_FROM_ARG),
            _BOOLS,
        )
        + _product("fp8_dequantize", _IN_CTYPES, _FP8_TAGS, _BOOLS)
    ),
    "group_quant": tuple(
        _product("group_quantize", _IN_CTYPES, _Q8_TAGS, _BOOLS)
        + _product("token_quantize", _IN_CTYPES, _Q8_TAGS, _BOOLS)
        + _product("silu_mul_quantize", _IN_CTYPES, _Q8_TAGS, _BOOLS)
        + _product("silu_mul_intermediate", _IN_CTYPES)
        + _product("group_dequantize", _IN_CTYPES, _Q8_TAGS, _BOOLS)
    ),
    "mx": tuple(
        _product("mx_quantize", _IN_CTYPES, _MX_FP_TAGS, _BOOLS, _BOOLS)
        + _product("nvfp4_quantize", _IN_CTYPES, _BOOLS, _BOOLS)
        + _product("mx_dequantize", _IN_CTYPES, _MX_FP_TAGS, _BOOLS)
        + _product("nvfp4_dequantize", _IN_CTYPES, _BOOLS)
        + _product("cvt_check", _MX_FP_TAGS, _BOOLS)
        + _product("e8m0_check", _BOOLS)
    ),
    "weight": tuple(
        _product("weight_quantize", _IN_CTYPES, _WEIGHT_SCHEMES)
        + _product("weight_dequantize", _IN_CTYPES, _IN_CTYPES, _WEIGHT_SCHEMES)
        + _product("w4a16_matmul", _HALF_CTYPES, _WEIGHT_SCHEMES, MATMUL_CONFIGS, _BOOLS)
    ),
    "weight_gemm": tuple(
        e
        for cfg, posts in GEMM_CONFIGS.items()
        for e in _product("w4a16_gemm", _HALF_CTYPES, (WEIGHT_INT4, WEIGHT_UINT4), *[(v,) for v in cfg], posts)
    ),
    "weight_wgmma": tuple(
        e
        for cfg in WGMMA_CONFIGS
        for e in _product("w4a16_wgmma", _HALF_CTYPES, (WEIGHT_INT4, WEIGHT_UINT4), *[(v,) for v in cfg], _BOOLS)
    ),
}

#: Families compiled for the family-specific target (``-arch=sm_100a``, ``sm_120a``, ...) on GPUs
#: that have one: mx because its FP4 and UE8M0 conversions exist as instructions only there, and
#: weight_wgmma because Hopper's wgmma exists only on sm_90a. NVRTC given both CuPy's
#: ``-arch=sm_XX`` and ``-arch=sm_XXa`` compiles for the latter.
_SPECIFIC_TARGETS = {
    "mx": ("100", "101", "103", "110", "120", "121"),
    "weight_wgmma": ("90",),
}
ARCH_SPECIFIC_FAMILIES = frozenset(_SPECIFIC_TARGETS)
#: Families with no portable build to fall back to: without the specific target their kernels are
#: stubs (weight_wgmma traps), so a failed specific build is an error, not a fallback.
_SPECIFIC_REQUIRED = frozenset({"weight_wgmma"})


def families() -> dict[str, tuple[str, ...]]:
    """A copy of the registry: family name -> registered name expressions."""
    return dict(_FAMILIES)


def kernel_dir() -> Path:
    """Where the ``.cu`` files are: ``$CUPYQUANT_KERNEL_DIR``, the installed package data, or the
    source tree, in that order."""
    env = os.environ.get(KERNEL_DIR_ENV)
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve().parent
    candidates += [here / "kernels", here.parent / "kernels"]
    for c in candidates:
        if (c / "common.cuh").is_file():
            return c
    raise FileNotFoundError(
        "cupyquant could not find its CUDA sources; looked in "
        + ", ".join(str(c) for c in candidates)
        + f". Reinstall cupyquant or set {KERNEL_DIR_ENV}."
    )


_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.M)


def _inline(path: Path, seen: set) -> str:
    text = path.read_text()

    def repl(m):
        inc = (path.parent / m.group(1)).resolve()
        if not inc.is_file():
            raise FileNotFoundError(f"{path.name} includes {m.group(1)!r}, which is not in {path.parent}")
        if inc in seen:  # every local header is #pragma once in spirit: inline it once
            return f"// (already inlined: {m.group(1)})"
        seen.add(inc)
        return f"// ---- begin {m.group(1)} ----\n{_inline(inc, seen)}\n// ---- end {m.group(1)} ----"

    return _INCLUDE_RE.sub(repl, text)


def source(family: str) -> str:
    """The family's source with local includes inlined: exactly the string NVRTC compiles."""
    if family not in _FAMILIES:
        raise KeyError(f"unknown kernel family {family!r}; registered: {sorted(_FAMILIES)}")
    path = kernel_dir() / f"{family}.cu"
    return _inline(path, {path.resolve()})


def _site_dirs():
    for p in sys.path:
        if p and os.path.isdir(p):
            yield Path(p)


@lru_cache(maxsize=None)
def cuda_include_dir() -> str:
    """The directory holding ``cuda_fp16.h``/``cuda_fp8.h`` for NVRTC's ``-I``."""
    candidates = []
    env = os.environ.get(CUDA_INCLUDE_ENV)
    if env:
        candidates.append(Path(env))
    try:  # CuPy finds the CUDA root next to the NVRTC it loads; prefer headers of that version.
        from cupy import _environment

        root = _environment.get_cuda_path()
        if root:
            candidates.append(Path(root) / "include")
    except Exception:  # noqa: BLE001 - any failure here only removes one candidate
        pass
    for site in _site_dirs():
        candidates += [site / "nvidia" / "cu13" / "include", site / "nvidia" / "cuda_runtime" / "include"]
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    for c in candidates:
        if (c / "cuda_fp8.h").is_file() and (c / "cuda_fp16.h").is_file():
            return str(c)
    raise CudaHeadersNotFound(
        "cupyquant needs the CUDA runtime headers (cuda_fp16.h, cuda_fp8.h) for NVRTC and found none in "
        + ", ".join(str(c) for c in candidates)
        + ". Install them with `pip install cupyquant[cu13]` (or [cu12]), i.e. the nvidia-cuda-runtime "
        f"wheel, or point {CUDA_INCLUDE_ENV} at a CUDA toolkit's include directory."
    )


def options() -> tuple[str, ...]:
    """The NVRTC options for every family (CuPy adds -arch and -ftz=true)."""
    return BASE_OPTIONS + (f"-I{cuda_include_dir()}",)


_lock = threading.Lock()
_kernels: dict = {}


def specific_target(family: str, arch: str):
    """The family-specific ``-arch`` option for a family on a GPU of compute capability ``arch``
    (``"100"``), or None where there is none to ask for."""
    if arch in _SPECIFIC_TARGETS.get(family, ()):
        return f"-arch=sm_{arch}a"
    return None


def _build_module(family: str, requested: str, device: int):
    import cupy
    from cupy.cuda import compiler

    base = options()
    attempts = [base]
    extra = specific_target(family, cupy.cuda.Device(device).compute_capability)
    if extra:  # an NVRTC too old for the target falls back to the portable (software) build
        attempts.insert(0, base + (extra,))
        if family in _SPECIFIC_REQUIRED:
            attempts = attempts[:1]
    for i, opts in enumerate(attempts):
        mod = cupy.RawModule(code=source(family), options=opts, name_expressions=list(_FAMILIES[family]))
        try:
            mod.compile()
            return mod
        except compiler.CompileException as e:
            if i == len(attempts) - 1:
                raise KernelCompileError(family, requested, opts, e.get_message()) from None


def kernel(device: int, family: str, name: str, *targs):
    """The compiled ``cupy.RawKernel`` for ``name<targs...>`` of a family on ``device``, which must
    be the current device (wrappers run inside ``_validate.on_device_of``).

    The family is compiled once per device (at the first request of any of its kernels) and kept;
    later calls are one dictionary lookup keyed on the template arguments, so no string is built on
    the hot path. Asking for an expression the registry lacks raises ``KeyError``.
    """
    key = (device, family, name, targs)
    k = _kernels.get(key)
    if k is None:
        k = _load(key)
    return k


def _load(key):
    device, family, name, targs = key
    expression = expr(name, *targs)
    if expression not in _FAMILIES.get(family, ()):
        raise KeyError(f"{expression!r} is not registered for kernel family {family!r} in cupyquant._jit")
    with _lock:  # first calls from many threads compile the family once
        k = _kernels.get(key)
        if k is None:
            mod = _kernels.get((device, family))
            if mod is None:
                mod = _kernels[(device, family)] = _build_module(family, expression, device)
            k = _kernels[key] = mod.get_function(expression)
    return k


def compile_for_arch(family: str, arch: str, expressions=None, ptx_out=None, log_out=None) -> dict[str, str]:
    """Compile a family with NVRTC for ``sm_<arch>`` (``arch`` may carry the ``a`` suffix of a
    family-specific target) without a GPU; returns expression -> lowered name, and appends the PTX
    to the list ``ptx_out`` if given. With a list ``log_out``, ptxas also reports each kernel's
    registers and spills (``--ptxas-options=-v``, which changes no code) and the NVRTC log is
    appended to it. Raises :class:`KernelCompileError`. Used by the CPU tests."""
    from cupy_backends.cuda.libs import nvrtc

    exprs = list(_FAMILIES[family] if expressions is None else expressions)
    opts = options() + CUPY_ADDED_OPTIONS + (f"-arch=sm_{arch}",) + (("--ptxas-options=-v",) if log_out is not None else ())
    prog = nvrtc.createProgram(source(family), f"{family}.cu", [], [])
    try:
        for e in exprs:
            nvrtc.addNameExpression(prog, e)
        try:
            nvrtc.compileProgram(prog, list(opts))
        except nvrtc.NVRTCError:
            raise KernelCompileError(family, ", ".join(exprs), opts, nvrtc.getProgramLog(prog)) from None
        if not nvrtc.getCUBIN(prog):
            raise KernelCompileError(family, ", ".join(exprs), opts, "NVRTC produced an empty cubin")
        if ptx_out is not None:
            ptx_out.append(nvrtc.getPTX(prog).decode(errors="replace"))
        if log_out is not None:
            log_out.append(nvrtc.getProgramLog(prog))
        return {e: nvrtc.getLoweredName(prog, e) for e in exprs}
    finally:
        nvrtc.destroyProgram(prog)
