"""First-call compile time of each kernel family, cold (empty CuPy cache) and warm (cache hit).

Two modes:

``python scripts/compile_time.py [--arch 90 --arch 100a] [--repeat 3]`` (default without a GPU)
    Measures on the host, with NVRTC and no GPU, for the given architectures:

    - *cold*: :func:`cupyquant._jit.compile_for_arch` of the whole family (every registered
      template instantiation in one NVRTC program, with the source string and options CuPy
      compiles; a first call compiles only the instantiations it launches, each on its own);
      median and minimum of ``--repeat`` runs.
    - *warm*: the host work a CuPy disk-cache hit does before the module is loaded onto the GPU:
      reading the family's source (``cupyquant._jit.source``), hashing the cache key, reading the
      ``.cubin`` file from a ``cupy.cuda._compiler_cache.DiskKernelCacheBackend`` and checking its
      SHA-1, and splitting off the stored mangled names. ``cuModuleLoadData`` itself needs a GPU and
      is not in this figure. Median of 20 runs.
    - *probe*: the empty NVRTC compile CuPy runs once per process and option set to read NVRTC's
      version banner (``cupy.cuda.compiler._preprocess``); a warm first call pays it too.

``python scripts/compile_time.py --gpu`` (on a GPU machine)
    For each public op (:data:`GPU_OPS`), a fresh Python process with an empty ``CUPY_CACHE_DIR``
    times its first call (synchronized), which compiles the instantiations it launches, then the
    second call; a second fresh process with the now filled cache does the same. ``first - second`` is the compile (cold) or cache-load (warm)
    overhead that a user's first call sees; the device, CuPy and NVRTC versions are printed.

``--markdown`` prints the table as Markdown (as docs/cache_and_troubleshooting.md shows it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import cupyquant  # noqa: E402

# GPU mode: per public op, (its family, untimed setup, timed op). A first call compiles the
# instantiations it launches; the setup's own compiles are not timed. x is a (1024, 1024) bfloat16
# array of ones. A family without an op here is reported as skipped.
GPU_OPS = {
    "quantize_fp8": ("per_tensor", "", "cq.quantize_fp8(x)"),
    "quantize_fp8, static": ("per_tensor", "", "cq.quantize_fp8(x, scale=0.5)"),
    "dequantize (per tensor)": ("per_tensor", "q = cq.quantize_fp8(x)", "q.dequantize()"),
    "quantize_groupwise, per token": ("groupwise", "", "cq.quantize_groupwise(x, group_size=None)"),
    "quantize_groupwise, group 128": ("groupwise", "", "cq.quantize_groupwise(x, group_size=128)"),
    "silu_mul_quantize": ("groupwise", "", "cq.silu_mul_quantize(x)"),
    "dequantize (group)": ("groupwise", "q = cq.quantize_groupwise(x)", "q.dequantize()"),
    "quantize_mx": ("mx", "", "cq.quantize_mx(x, 'float8_e4m3fn')"),
    "dequantize (MX)": ("mx", "q = cq.quantize_mx(x, 'float8_e4m3fn')", "q.dequantize()"),
    "quantize_nvfp4": ("nvfp4", "", "cq.quantize_nvfp4(x)"),
    "dequantize (NVFP4)": ("nvfp4", "q = cq.quantize_nvfp4(x, global_scale=1.0)", "q.dequantize()"),
    "rms_norm_quantize, per token": ("rms_norm", "", "cq.rms_norm_quantize(x, x[0])"),
    "rms_norm_quantize, group 128": ("rms_norm", "", "cq.rms_norm_quantize(x, x[0], scheme='group')"),
    "quantize_kv_cache": (
        "kv_cache",
        "kv = x[:64].reshape(64, 16, 64); c = cupy.zeros((8, 16, 16, 64), cupy.uint8); s = cupy.arange(64)",
        "cq.quantize_kv_cache(kv, kv, c, c.copy(), s, scale_k=1.0, scale_v=1.0)",
    ),
    "quantize_weight": ("weight_quant", "", "cq.quantize_weight(x, 'int4', group_size=128)"),
    "matmul, decode": ("weight_decode", "w = cq.quantize_weight(x, 'int4', group_size=128)", "cq.matmul(x[:1], w)"),
    # M = 1024 takes a tensor-core kernel; each is forced so that its own family compiles
    "matmul, sm80_gemm": (
        "weight_sm80_gemm",
        "w = cq.quantize_weight(x, 'int4', group_size=128); cq.weight._forced_path('sm80_gemm').__enter__()",
        "cq.matmul(x, w)",
    ),
    "matmul, sm90_gemm": (
        "weight_sm90_gemm",
        "w = cq.quantize_weight(x, 'int4', group_size=128); cq.weight._forced_path('sm90_gemm').__enter__()",
        "cq.matmul(x, w)",
    ),
    "scaled_matmul": (
        "scaled_mm_sm90",
        "a = cq.quantize_groupwise(x, group_size=None); w = cq.quantize_weight(x, 'float8_e4m3fn', group_size=None)",
        "cq.scaled_matmul(a, w)",
    ),
}

_CHILD = r"""
import json, os, sys, time
import cupy, ml_dtypes, numpy as np
sys.path.insert(0, {root!r})
import cupyquant as cq
x = cupy.asarray(np.ones((1024, 1024), np.float32).astype(ml_dtypes.bfloat16))
{setup}
dev = cupy.cuda.Device()
dev.synchronize()
t0 = time.perf_counter()
{op}
dev.synchronize()
t1 = time.perf_counter()
{op}
dev.synchronize()
t2 = time.perf_counter()
files = sorted(f for f in os.listdir(os.environ["CUPY_CACHE_DIR"]) if f.endswith(".cubin"))
print(json.dumps({{"first": t1 - t0, "second": t2 - t1, "cubins": files}}))  # cubins: setup's too
"""


def _versions() -> dict:
    import cupy
    from cupy_backends.cuda.libs import nvrtc

    return {"cupy": cupy.__version__, "nvrtc": "%d.%d" % nvrtc.getVersion(), "python": platform.python_version()}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _cubin(family: str, arch: str) -> bytes:
    """The cubin of a family (for the warm measurement's cache file), compiled like compile_for_arch."""
    from cupy_backends.cuda.libs import nvrtc

    from cupyquant import _jit

    prog = nvrtc.createProgram(_jit.source(family), f"{family}.cu", [], [])
    try:
        for e in cupyquant._all_families()[family]:
            nvrtc.addNameExpression(prog, e)
        nvrtc.compileProgram(prog, list(_jit.options() + _jit.CUPY_ADDED_OPTIONS + (f"-arch=sm_{arch}",)))
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


def _probe_seconds(arch: str) -> float:
    """CuPy's once-per-process NVRTC version probe: an empty program compiled to PTX."""
    from cupy.cuda import compiler

    from cupyquant import _jit

    digits = arch.rstrip("a")
    t = time.perf_counter()
    compiler._preprocess("", _jit.options() + ("-ftz=true",), digits, "nvrtc")
    return time.perf_counter() - t


def _warm_seconds(family: str, arch: str, cache_dir: str, runs: int = 20) -> float:
    """Median host time of a CuPy disk-cache hit for the family, up to (not including) the module load."""
    from cupy.cuda import compiler
    from cupy.cuda._compiler_cache import DiskKernelCacheBackend

    from cupyquant import _jit

    exprs = sorted(cupyquant._all_families()[family])
    backend = DiskKernelCacheBackend(cache_dir)

    def key(src: str) -> str:
        opts = _jit.options() + ("-ftz=true",)
        text = f"{(arch, opts, 'nvrtc')} {src} ne1 " + "\0".join(exprs)
        return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest() + ".cubin"

    names = [f"_Z{i}" for i in range(len(exprs))]  # placeholder mangled names of realistic count
    saved = key(_jit.source(family))
    backend.save(saved, compiler._encode_cache_payload(names, _cubin(family, arch)), "")
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        key(_jit.source(family))  # the work of a lookup; load the saved name in case a kernel file changed
        payload = backend.load(saved)
        decoded = compiler._decode_cache_payload(payload, len(exprs))
        times.append(time.perf_counter() - t)
        assert decoded is not None and decoded[1]
    return statistics.median(times)


def measure_cpu(archs, repeat: int) -> dict:
    from cupyquant import _jit

    rows = []
    load_before = os.getloadavg()  # other work on the machine slows NVRTC down: report the load
    with tempfile.TemporaryDirectory() as cache_dir:
        for arch in archs:
            probe = _probe_seconds(arch)  # also loads NVRTC, so the first cold run does not pay that
            for family in sorted(cupyquant._all_families()):
                if arch.endswith("a") and family not in _jit.arch_specific_families():
                    continue
                cold = []
                try:
                    for _ in range(repeat):
                        t = time.perf_counter()
                        _jit.compile_for_arch(family, arch)
                        cold.append(time.perf_counter() - t)
                except _jit.KernelCompileError as e:
                    print(
                        f"compile_time.py: {family} does not compile for sm_{arch}: {str(e).splitlines()[0]}",
                        file=sys.stderr,
                    )
                    continue
                rows.append(
                    {
                        "family": family,
                        "arch": f"sm_{arch}",
                        "instantiations": len(cupyquant._all_families()[family]),
                        "cold_median_s": statistics.median(cold),
                        "cold_min_s": min(cold),
                        "warm_s": _warm_seconds(family, arch, cache_dir),
                        "probe_s": probe,
                    }
                )
    return {
        "mode": "cpu",
        "machine": f"{_cpu_name()}, {os.cpu_count()} CPUs",
        **_versions(),
        "rows": rows,
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }


def measure_gpu() -> dict:
    import cupy

    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    rows = []
    families = cupyquant._all_families()
    for family in sorted(set(families) - {f for f, _, _ in GPU_OPS.values()}):
        print(f"compile_time.py: no op listed for family {family!r} in GPU_OPS; skipped", file=sys.stderr)
    for label, (family, setup, op) in GPU_OPS.items():
        with tempfile.TemporaryDirectory() as cache_dir:
            env = dict(os.environ, CUPY_CACHE_DIR=cache_dir)
            code = _CHILD.format(root=str(ROOT), setup=setup, op=op)
            res = {}
            try:
                for phase in ("cold", "warm"):
                    out = subprocess.run(
                        [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True
                    )
                    res[phase] = json.loads(out.stdout.strip().splitlines()[-1])
            except subprocess.CalledProcessError as e:  # an op this GPU does not run (sm90 kernels elsewhere)
                print(f"compile_time.py: {label} failed:\n{e.stderr[-600:]}", file=sys.stderr)
                continue
        rows.append(
            {
                "op_name": label,
                "family": family,
                "arch": f"sm_{dev.compute_capability}",
                "op": op,
                "cold_first_s": res["cold"]["first"],
                "cold_second_s": res["cold"]["second"],
                "warm_first_s": res["warm"]["first"],
                "warm_second_s": res["warm"]["second"],
                "cubins": res["cold"]["cubins"],
            }
        )
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return {"mode": "gpu", "machine": name, **_versions(), "rows": rows}


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}" if s < 10 else f"{s * 1e3:.0f}"


def markdown(res: dict) -> str:
    head = f"{res['machine']}; CuPy {res['cupy']}, NVRTC {res['nvrtc']}, Python {res['python']}"
    if "load_before" in res:
        head += "; 1-minute load average %.2f before, %.2f after" % (res["load_before"][0], res["load_after"][0])
    lines = [head, ""]
    if res["mode"] == "cpu":
        lines += [
            "| family | target | instantiations | cold: NVRTC compile, median (min) | warm: cache hit before module load | NVRTC version probe (once per process) |",
            "|---|---|---|---|---|---|",
        ]
        for r in res["rows"]:
            lines.append(
                f"| {r['family']} | {r['arch']} | {r['instantiations']} | {r['cold_median_s']:.2f} s ({r['cold_min_s']:.2f} s) "
                f"| {_ms(r['warm_s'])} ms | {_ms(r['probe_s'])} ms |"
            )
    else:
        lines += [
            "| op | family | target | first call, empty cache | first call, cache hit | second call | call |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in res["rows"]:
            lines.append(
                f"| {r['op_name']} | {r['family']} | {r['arch']} | {r['cold_first_s']:.2f} s | {_ms(r['warm_first_s'])} ms "
                f"| {_ms(r['warm_second_s'])} ms | `{r['op']}` |"
            )
    return "\n".join(lines)


def _has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no driver, no device, no CuPy: all mean "no GPU"
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", action="store_true", help="time real first calls on the current GPU")
    p.add_argument("--arch", action="append", help="CPU mode: target such as 90 or 100a (repeatable; default 90)")
    p.add_argument("--repeat", type=int, default=3, help="CPU mode: cold compiles per family (default 3)")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    if args.gpu and not _has_gpu():
        print("compile_time.py --gpu: no usable CUDA device", file=sys.stderr)
        return 1
    res = measure_gpu() if args.gpu else measure_cpu(args.arch or ["90"], args.repeat)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    print(markdown(res) if args.markdown else json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
