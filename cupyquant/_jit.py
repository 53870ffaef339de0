"""The kernel loader: the only module that touches ``cupy.RawModule``.

Each kernel *family* is one CUDA file ``kernels/<family>.cu``. At the first request of one of its
template instantiations on a device, the family's source (with its local ``#include "x.cuh"``
lines inlined) is compiled by NVRTC through ``cupy.RawModule`` for that device's architecture with
that one instantiation as its name expression: a call compiles only what it launches (0.1 to 0.4 s
for a quantizer's instantiation, up to 2 s for a matmul's, where a whole family takes 2 s to
2 minutes on one core). CuPy keeps each binary in its disk cache (``CUPY_CACHE_DIR``), keyed on the
source, the options, the name expressions, the NVRTC version and the architecture; this module
memoizes the loaded kernels per device.

Adding a kernel family takes three steps:

1. Write ``kernels/<family>.cu``: ``#include "common.cuh"``, ``extern "C++"`` templates of
   ``__global__`` kernels, and a comment block saying what it computes, its rounding rule, its
   memory layout and the ``cupyquant.reference`` function it must match bit for bit.
2. Write the op module and declare the family there with :func:`register`: its name and every
   instantiation its wrapper may ask for (build them with :func:`product` from the module's own
   configuration tables and those in ``_dtypes``). A CPU test (``tests/test_jit.py``) compiles
   each of them with NVRTC for the targets of sm_80, sm_89, sm_90, sm_100, sm_120 and the
   family-specific ones that run it.
3. In the wrapper: validate arguments, then ``kernel(device, family, name, *targs)`` and launch it
   on the current stream. Asking for an unregistered expression raises, so the registry cannot fall
   behind the wrappers.

This module knows no op: the op modules declare their families and configurations to it.

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

KERNEL_DIR_ENV = "CUPYQUANT_KERNEL_DIR"
CUDA_INCLUDE_ENV = "CUPYQUANT_CUDA_INCLUDE"

#: Options for every family. No fast-math: it breaks round-half-to-even. CuPy adds ``-ftz=true``
#: itself; kernels use explicit IEEE PTX arithmetic wherever flushing could change an output byte.
BASE_OPTIONS = ("-std=c++17",)

#: What CuPy adds to the options when it compiles through NVRTC (cupy/cuda/compiler.py); the
#: GPU-free compile test adds the same so that it compiles what a device would.
CUPY_ADDED_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")


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

    def __reduce__(self):  # pickled with its fields (a process pool's worker raises it to its parent)
        return type(self), (self.family, self.expression, self.options, self.log)


class CudaHeadersNotFoundError(RuntimeError):
    """The CUDA runtime headers (cuda_fp16.h, cuda_fp8.h, ...) NVRTC needs were not found."""


class KernelLaunchError(RuntimeError):
    """The CUDA driver refused a kernel launch: carries the driver's error code and message."""

    def __init__(self, call: str, code: int, message: str):
        self.call = call
        self.code = code
        self.message = message
        super().__init__(f"{call} failed: error {code} ({message})")

    def __reduce__(self):
        return type(self), (self.call, self.code, self.message)


def expr(name: str, *targs) -> str:
    """The name expression ``name<a, b, ...>`` for template arguments (bools as true/false, ints,
    IntEnum members included, as their numbers)."""
    parts = []
    for a in targs:
        if isinstance(a, bool):
            parts.append("true" if a else "false")
        elif isinstance(a, int):
            parts.append(str(int(a)))
        else:
            parts.append(str(a))
    return f"{name}<{', '.join(parts)}>"


def product(name: str, *axes) -> list[str]:
    """Every name expression ``name<a, b, ...>`` over the product of the template-argument axes."""
    return [expr(name, *combo) for combo in itertools.product(*axes)]


#: family -> every instantiation its wrappers may request, filled by the op modules through
#: :func:`register` when they are imported.
_FAMILIES: dict[str, tuple[str, ...]] = {}
#: family -> compute capabilities (``"100"``) for which it is compiled for the family-specific
#: target (``-arch=sm_100a``): where an instruction it needs exists only there.
_SPECIFIC_TARGETS: dict[str, tuple[str, ...]] = {}
#: Families with no portable build to fall back to: without the specific target their kernels are
#: stubs, so a failed specific build is an error, not a fallback.
_SPECIFIC_REQUIRED: set[str] = set()


def register(family: str, expressions, *, specific_targets=(), specific_required: bool = False) -> str:
    """Declare a kernel family (``kernels/<family>.cu``) and every name expression its wrapper may
    ask for; returns ``family``. Called once by the op module that owns the family, at import.

    ``specific_targets``: compute capabilities on which NVRTC is asked for the family-specific target
    (``-arch=sm_XXa``), falling back to the portable build when that fails, unless
    ``specific_required``."""
    exprs = tuple(expressions)
    if family in _FAMILIES and _FAMILIES[family] != exprs:
        raise ValueError(f"kernel family {family!r} is already registered with other instantiations")
    _FAMILIES[family] = exprs
    if specific_targets:
        _SPECIFIC_TARGETS[family] = tuple(specific_targets)
    if specific_required:
        _SPECIFIC_REQUIRED.add(family)
    return family


def specific_only(family: str) -> bool:
    """Whether the family has no portable build: it runs only on its family-specific targets
    (registered with ``specific_required``) and is a stub that traps everywhere else."""
    return family in _SPECIFIC_REQUIRED


def arch_specific_families() -> frozenset:
    """The registered families that have a family-specific target on some GPU."""
    return frozenset(_SPECIFIC_TARGETS)


def families() -> dict[str, tuple[str, ...]]:
    """A copy of the registry: family name -> registered name expressions, for the families whose
    op modules are imported (``cupyquant._all_families()`` imports them all)."""
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
    path = kernel_dir() / f"{family}.cu"
    if not path.is_file():
        raise KeyError(f"unknown kernel family {family!r}: no {path}")
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
    raise CudaHeadersNotFoundError(
        "cupyquant needs the CUDA runtime headers (cuda_fp16.h, cuda_fp8.h) for NVRTC and found none in "
        + ", ".join(str(c) for c in candidates)
        + ". Install them with `pip install cupyquant[cu13]` (or [cu12]; from a clone of the repository, "
        '`pip install ".[cu13]"`), i.e. the nvidia-cuda-runtime '
        f"wheel, or point {CUDA_INCLUDE_ENV} at a CUDA toolkit's include directory."
    )


def options() -> tuple[str, ...]:
    """The NVRTC options for every family (CuPy adds -arch and -ftz=true)."""
    return BASE_OPTIONS + (f"-I{cuda_include_dir()}",)


_lock = threading.Lock()
_kernels: dict = {}
_kernel_device: dict = {}  # id of a kernel in _kernels -> its device (kept as long as the kernel)


def specific_targets(family: str) -> tuple:
    """The compute capabilities for which ``family`` is compiled for its family-specific target."""
    return _SPECIFIC_TARGETS.get(family, ())


def _build_module(family: str, expression: str, device: int):
    import cupy
    from cupy.cuda import compiler

    from . import _device

    base = options()
    attempts = [base]
    extra = _device.specific_arch_option(specific_targets(family), device)
    if extra:  # an NVRTC too old for the target falls back to the portable (software) build
        attempts.insert(0, base + (extra,))
        if family in _SPECIFIC_REQUIRED:
            attempts = attempts[:1]
    for i, opts in enumerate(attempts):
        mod = cupy.RawModule(code=source(family), options=opts, name_expressions=[expression])
        try:
            mod.compile()
            return mod
        except compiler.CompileException as e:
            if i == len(attempts) - 1:
                raise KernelCompileError(family, expression, opts, e.get_message()) from None


def kernel(device: int, family: str, name: str, *targs):
    """The compiled ``cupy.RawKernel`` for ``name<targs...>`` of a family on ``device`` (compiled for
    that device's architecture whichever device is current); :func:`function_ptr` gives its
    ``CUfunction`` on that device.

    Each instantiation is compiled (or loaded from CuPy's disk cache) at its first request on a
    device and kept; later calls are one dictionary lookup keyed on the template arguments, so no string is built on
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
    import cupy

    with _lock, cupy.cuda.Device(device):  # first calls from many threads compile an instantiation once
        k = _kernels.get(key)
        if k is None:
            k = _build_module(family, expression, device).get_function(expression)
            _kernel_device[id(k)] = device
            _kernels[key] = k
    return k


def function_ptr(k) -> int:
    """The ``CUfunction`` of a kernel from :func:`kernel` on the device it was asked for (a
    ``cupy.RawKernel`` loads its module per current device); another kernel's on the current device."""
    device = _kernel_device.get(id(k))
    if device is None:
        return k.kernel.ptr
    import cupy

    with cupy.cuda.Device(device):
        return k.kernel.ptr


def compile_for_arch(family: str, arch: str, expressions=None, ptx_out=None, log_out=None) -> dict[str, str]:
    """Compile a family with NVRTC for ``sm_<arch>`` (``arch`` may carry the ``a`` suffix of a
    family-specific target) without a GPU; returns expression -> lowered name, and appends the PTX
    to the list ``ptx_out`` if given. With a list ``log_out``, ptxas also reports each kernel's
    registers and spills (``--ptxas-options=-v``, which changes no code) and the NVRTC log is
    appended to it. Raises :class:`KernelCompileError`. Used by the CPU tests."""
    from cupy_backends.cuda.libs import nvrtc

    exprs = list(_FAMILIES[family] if expressions is None else expressions)
    opts = (
        options()
        + CUPY_ADDED_OPTIONS
        + (f"-arch=sm_{arch}",)
        + (("--ptxas-options=-v",) if log_out is not None else ())
    )
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
