"""The JIT loader without a GPU: NVRTC compiles every registered instantiation for the targets that
run it (and a sample of each family for the others), local includes are inlined, and failures raise
the library's errors."""

from __future__ import annotations

import re
import shutil

import _nvrtc_pool
import pytest
from _scripts import load_script

import cupyquant
from cupyquant import _device, _jit
from cupyquant.w8a8 import args as w8a8_args

FAMILIES = sorted(cupyquant._all_families())

# ---------------------------------------------------------------- what the compile test compiles
# Every instantiation is compiled, in full, for every target that runs it (runs_on); every other
# target compiles a sample that holds every value of every template argument of the family's
# kernels (cover), so that each value's code still passes NVRTC and ptxas there. The targets are
# the five of _device.NVRTC_TEST_TARGETS and each family-specific one ("90a", "100a", "120a"). What runs where:
# - a family with no portable build (weight_sm90_gemm, scaled_mm_sm90: registered with
#   specific_required) runs on its family-specific target only; elsewhere it is a stub that traps;
# - scaled_mm_mma runs FP8 where the GPU has FP8 MMA (8.9 and newer; 9.0 where a test forces the
#   path) and INT8 where it has INT8 MMA (8.0 and newer): _device.Caps; FP8 on sm_80 is the one
#   sampled set it has;
# - every other family runs on all five targets (the family-specific ones of mx, nvfp4 and testing
#   too: an older NVRTC or a GPU without its own target takes the portable build).
# The compiles are one job per (family, target), run by worker processes, one a core
# (_nvrtc_pool), longest first, and the test below takes them in that order, so that results
# stream; a run starts only the jobs of its selected tests. On 2 cores: 15 min, where every
# instantiation on the five targets in one process took 25 min. The costs (seconds of one full
# compile on one core; the family-specific target for the specific_only families) only order the
# jobs.
COMPILE_SECONDS = {
    "scaled_mm_sm90": 121,
    "scaled_mm_mma": 115,
    "weight_sm90_gemm": 76,
    "weight_decode": 50,
    "groupwise": 45,
    "weight_sm80_gemm": 22,
    "rms_norm": 28,
    "mx": 13,
    "nvfp4": 5,
    "per_tensor": 4,
    "weight_quant": 4,
    "kv_cache": 3,
}
#: What the worker counts in each PTX for the tests below.
NEEDLES = (
    "griddepcontrol.wait;",
    "griddepcontrol.launch_dependents;",
    "e2m1x2",
    "ue8m0x2",
    "cvt.rn.satfinite.e2m1x2.f32",
    "cvt.rp.satfinite.ue8m0x2.f32",
    "cvt.rn.satfinite.e4m3x2.f32",
    "wgmma",
    "fence.proxy.async.shared::cta",
) + tuple(
    f"wgmma.mma_async.sync.aligned.m64n{bma}k16.f32.{t}.{t}"
    for bma, _, _ in cupyquant.weight.sm90_gemm.CONFIGS
    for t in ("f16", "bf16")
)


def targets(family: str) -> tuple:
    """NVRTC_TEST_TARGETS and the family's family-specific targets among them ("100a")."""
    specific = _jit.specific_targets(family)
    return _device.NVRTC_TEST_TARGETS + tuple(cc + "a" for cc in _device.NVRTC_TEST_TARGETS if cc in specific)


def runs_on(family: str, expression: str) -> frozenset:
    """The targets on which an instantiation runs (see above)."""
    own = frozenset(t for t in targets(family) if t.endswith("a"))
    if _jit.specific_only(family):
        return own
    if family == "scaled_mm_mma":
        int8 = expression.startswith(f"scaled_mm_mma<{w8a8_args.INT8_ID}, {w8a8_args.INT8_ID},")
        caps = {a: _device.caps_of_arch(a) for a in _device.NVRTC_TEST_TARGETS}
        return frozenset(a for a, c in caps.items() if (c.int8_mma if int8 else c.fp8_mma))
    return frozenset(_device.NVRTC_TEST_TARGETS) | own


def _template_values(expression: str) -> set:
    name, args = expression[:-1].split("<", 1)
    return {(name, i, a) for i, a in enumerate(args.split(", "))}


def cover(expressions) -> list:
    """A small deterministic sample of ``expressions`` that holds every value of every template
    argument of each kernel name: greedily, the expression that adds the most (name, position,
    value) triples not yet held (the first in registry order on a tie); returned in registry order."""
    expressions = list(expressions)
    values = [_template_values(e) for e in expressions]
    want, seen, chosen = set().union(*values) if values else set(), set(), set()
    while seen != want:
        i = max(range(len(expressions)), key=lambda i: (len(values[i] - seen), -i))
        chosen.add(i)
        seen |= values[i]
    return [e for i, e in enumerate(expressions) if i in chosen]


def _job(family: str, target: str) -> _nvrtc_pool.Job:
    exprs = _jit.families()[family]
    sample = set(cover([e for e in exprs if target not in runs_on(family, e)]))
    chosen = tuple(e for e in exprs if target in runs_on(family, e) or e in sample)
    return _nvrtc_pool.Job(
        family,
        target,
        chosen,
        NEEDLES,
        log=(family, target) == ("weight_sm90_gemm", "90a"),  # its ptxas report (test_hopper_matmul_...)
        cost=COMPILE_SECONDS.get(family, 1) * len(chosen) / len(exprs),
    )


JOBS = {(f, t): _job(f, t) for f in FAMILIES for t in targets(f)}
#: The jobs longest first, as the pool starts them (ties in name order).
BY_COST = sorted(JOBS, key=lambda k: (-JOBS[k].cost, k))
#: The jobs of the tests that name no (family, target) in their parameters.
JOBS_OF_TEST = {
    "test_hopper_matmul_uses_wgmma_only_on_sm90a": [("weight_sm90_gemm", "90a"), ("weight_sm90_gemm", "90")]
}


@pytest.fixture(scope="module")
def nvrtc(request):
    """The compile results of the selected tests of this module, compiled by worker processes."""
    keys = set()
    for item in request.session.items:
        if getattr(item, "module", None) is request.module and "nvrtc" in item.fixturenames:
            params = getattr(item, "callspec", None)
            if params is not None and "target" in params.params:
                keys.add((params.params["family"], params.params["target"]))
            keys.update(JOBS_OF_TEST.get(item.originalname, ()))
    pool = _nvrtc_pool.Pool(JOBS[k] for k in keys)
    yield pool
    pool.close()


#: The families each of whose kernels waits once in every instantiation (pdl_wait_then_release at
#: its top: the quantizers, dequantizers, fused RMSNorm and KV cache), as pdl_sites counts them.
PDL_ONCE_FAMILIES = ("per_tensor", "groupwise", "mx", "nvfp4", "rms_norm", "kv_cache")
_PDL_ONCE = frozenset(e.split("<", 1)[0] for f in PDL_ONCE_FAMILIES for e in _jit.families()[f])


def pdl_sites(expression: str, target: str) -> int:
    """The griddepcontrol.wait (and .launch_dependents) sites of one instantiation on a target:
    programmatic dependent launch exists from 9.0, and every kernel of the quantizers, the norm,
    the KV-cache write and the matmuls uses it, once each (each waits for the kernel before and
    releases the one after; PDL_ONCE_FAMILIES and the W8A8 Hopper kernels, built on sm_90a only).
    The decode kernel (w16_decode)
    has two call sites, one on each side of its first weight loads, of which a launch takes one
    (weight_decode.cu, MatmulArgs.early); the Hopper kernel (built on sm_90a only) has a second in
    its 128-row tile, whose producer warpgroup waits after its early weight copies and its compute
    warps on their own."""
    if not _device.caps_of_arch(target.rstrip("a")).pdl:
        return 0
    if expression.split("<", 1)[0] in _PDL_ONCE:
        return 1
    if expression.startswith("w16_decode<"):
        return 2
    if expression.startswith("sm80_w16_gemm<"):
        return 1
    if expression.startswith("sm90_w16_gemm<") and target == "90a":
        return 2 if ", 128, " in expression else 1
    if expression.startswith(("scaled_mm_sm90<", "scaled_mm_sm90_small<")) and target == "90a":
        return 1
    return 0


@pytest.mark.slow
@pytest.mark.parametrize("family, target", BY_COST, ids=[f"{f}-{t}" for f, t in BY_COST])
def test_every_instantiation_compiles(family, target, nvrtc):
    job = JOBS[family, target]
    r = nvrtc.result(family, target)
    lowered = r["lowered"]
    assert set(lowered) == set(job.expressions)
    assert len(set(lowered.values())) == len(lowered), "two expressions lowered to one symbol"
    assert all(name.startswith("_Z") for name in lowered.values())
    sites = sum(pdl_sites(e, target) for e in job.expressions)
    assert r["counts"]["griddepcontrol.wait;"] == sites
    assert r["counts"]["griddepcontrol.launch_dependents;"] == sites


def test_each_instantiation_is_compiled_in_full_where_it_runs():
    for family, exprs in _jit.families().items():
        for e in exprs:
            where = runs_on(family, e)
            assert where, (family, e)  # it runs somewhere, so some target compiles it
            for target in where:
                assert e in JOBS[family, target].expressions, (family, target, e)
    # the rules above, spelled out
    fp8, int8 = (_jit.families()["scaled_mm_mma"][0], _jit.families()["scaled_mm_mma"][-1])
    assert runs_on("scaled_mm_mma", fp8) == {"89", "90", "100", "120"}
    assert runs_on("scaled_mm_mma", int8) == {"80", "89", "90", "100", "120"}
    assert runs_on("scaled_mm_sm90", _jit.families()["scaled_mm_sm90"][0]) == {"90a"}
    assert runs_on("weight_sm90_gemm", _jit.families()["weight_sm90_gemm"][0]) == {"90a"}
    assert runs_on("mx", _jit.families()["mx"][0]) == {"80", "89", "90", "100", "120", "100a", "120a"}
    assert runs_on("groupwise", _jit.families()["groupwise"][0]) == set(_device.NVRTC_TEST_TARGETS)
    assert set(targets("groupwise")) == set(_device.NVRTC_TEST_TARGETS)


def test_every_target_compiles_every_template_argument_value():
    """A sampled target still compiles each value of each template argument of each kernel."""
    sampled = 0
    for (family, target), job in JOBS.items():
        want = set().union(*map(_template_values, _jit.families()[family]))
        assert set().union(*map(_template_values, job.expressions)) == want, (family, target)
        sampled += len(job.expressions) < len(_jit.families()[family])
    assert sampled >= 11  # scaled_mm_mma on sm_80, the two sm_90a-only families on five targets each


def test_cover_takes_the_expressions_that_add_most():
    exprs = _jit.product("k", ("a", "b"), (1, 2, 3), (True, False))
    assert cover(exprs) == ["k<a, 1, true>", "k<a, 3, true>", "k<b, 2, false>"]
    assert cover(exprs + _jit.product("j", (0,))) == ["k<a, 1, true>", "k<a, 3, true>", "k<b, 2, false>", "j<0>"]
    assert cover([]) == []


def test_compile_errors_cross_process_boundaries():
    """A worker's KernelCompileError reaches the test with its fields (the pool pickles it)."""
    import pickle

    e = _jit.KernelCompileError("fam", "k<1>", ("-arch=sm_90",), "log text")
    back = pickle.loads(pickle.dumps(e))
    assert (back.family, back.expression, back.options, back.log) == ("fam", "k<1>", ("-arch=sm_90",), "log text")
    assert str(back) == str(e)
    le = pickle.loads(pickle.dumps(_jit.KernelLaunchError("cuLaunchKernel", 1, "invalid value")))
    assert (le.call, le.code, le.message) == ("cuLaunchKernel", 1, "invalid value")


def test_registry_is_not_empty_and_has_no_duplicates():
    for family, exprs in _jit.families().items():
        assert exprs, family
        assert len(exprs) == len(set(exprs)), family


@pytest.mark.parametrize("family", FAMILIES)
def test_local_includes_are_inlined(family):
    src = _jit.source(family)
    assert not re.search(r'^\s*#\s*include\s*"', src, re.M), "a local include reached NVRTC"
    assert "namespace cq" in src  # common.cuh's content is in the string CuPy hashes


def test_kernel_dir_override_and_compile_error(tmp_path, monkeypatch):
    shutil.copy(_jit.kernel_dir() / "common.cuh", tmp_path / "common.cuh")
    (tmp_path / "per_tensor.cu").write_text('#include "common.cuh"\n__global__ void broken() { undefined_symbol(); }\n')
    monkeypatch.setenv(_jit.KERNEL_DIR_ENV, str(tmp_path))
    assert _jit.kernel_dir() == tmp_path
    with pytest.raises(_jit.KernelCompileError) as info:
        _jit.compile_for_arch("per_tensor", "90", ["broken"])
    err = info.value
    assert err.family == "per_tensor"
    assert "-arch=sm_90" in err.options
    assert "undefined_symbol" in err.log
    assert "per_tensor" in str(err) and "undefined_symbol" in str(err)


def test_missing_local_include_is_named(tmp_path, monkeypatch):
    (tmp_path / "common.cuh").write_text("// empty\n")
    (tmp_path / "per_tensor.cu").write_text('#include "nothere.cuh"\n')
    monkeypatch.setenv(_jit.KERNEL_DIR_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="nothere.cuh"):
        _jit.source("per_tensor")


def test_unknown_family():
    with pytest.raises(KeyError, match="unknown kernel family"):
        _jit.source("nope")


def test_missing_headers_error_says_what_to_install(monkeypatch, tmp_path):
    _jit.cuda_include_dir.cache_clear()
    monkeypatch.setattr(_jit, "_site_dirs", lambda: iter(()))
    monkeypatch.setenv(_jit.CUDA_INCLUDE_ENV, str(tmp_path))
    for var in ("CUDA_PATH", "CUDA_HOME"):
        monkeypatch.delenv(var, raising=False)
    import cupy._environment

    monkeypatch.setattr(cupy._environment, "get_cuda_path", lambda: None)
    monkeypatch.setattr(_jit, "Path", _NoUsrLocal)
    try:
        with pytest.raises(_jit.CudaHeadersNotFoundError, match=r"pip install cupyquant\[cu13\]"):
            _jit.cuda_include_dir()
    finally:
        monkeypatch.undo()
        _jit.cuda_include_dir.cache_clear()


class _NoUsrLocal(type(_jit.Path())):
    """A Path in which /usr/local/cuda does not exist, so the test does not depend on the machine."""

    def is_file(self):
        return False if str(self).startswith("/usr/local/cuda") else super().is_file()


def test_expr_formats_template_arguments():
    assert _jit.expr("k", "float", "cq::E4M3", 2, True) == "k<float, cq::E4M3, 2, true>"
    from cupyquant._validate import ScaleSource

    assert _jit.expr("k", ScaleSource.ARG, False) == "k<2, false>"


def test_error_classes_are_exported():
    assert cupyquant.CudaHeadersNotFoundError is _jit.CudaHeadersNotFoundError
    assert issubclass(cupyquant.KernelLaunchError, RuntimeError)
    assert cupyquant.UnsupportedGPUError is _device.UnsupportedGPUError
    assert issubclass(cupyquant.UnsupportedGPUError, RuntimeError)


def test_unregistered_expression_is_refused_before_compiling():
    with pytest.raises(KeyError, match="not registered"):
        _jit.kernel(0, "per_tensor", "fp8_quantize", "double", "cq::E4M3", 0, True)


# The conversion instructions each block-scaled family uses where the target has them: the FP8
# one (MXFP8 elements, NVFP4 scales), E2M1 (MXFP4, NVFP4 elements) and the E8M0 round-up (MX scales).
BLACKWELL_CVTS = {
    "mx": ("cvt.rn.satfinite.e2m1x2.f32", "cvt.rp.satfinite.ue8m0x2.f32", "cvt.rn.satfinite.e4m3x2.f32"),
    "nvfp4": ("cvt.rn.satfinite.e2m1x2.f32", "cvt.rn.satfinite.e4m3x2.f32"),
    "testing": ("cvt.rn.satfinite.e2m1x2.f32", "cvt.rp.satfinite.ue8m0x2.f32", "cvt.rn.satfinite.e4m3x2.f32"),
}


@pytest.mark.slow
@pytest.mark.parametrize("target", ["100a", "120a"])
@pytest.mark.parametrize("family", sorted(BLACKWELL_CVTS))
def test_blackwell_targets_use_the_conversion_instructions(family, target, nvrtc):
    """On the family-specific Blackwell targets the block-scaled families (and the test kernels that
    check their conversions) use the e2m1x2 and ue8m0x2 conversions (and the fp8x2 one); on sm_90
    only the fp8x2 one exists."""
    r = nvrtc.result(family, target)
    assert set(r["lowered"]) == set(_jit.families()[family])
    for cvt in BLACKWELL_CVTS[family]:
        assert r["counts"][cvt], cvt


@pytest.mark.slow
@pytest.mark.parametrize("target", ["90"])
@pytest.mark.parametrize("family", sorted(BLACKWELL_CVTS))
def test_hopper_uses_the_software_fp4_path(family, target, nvrtc):
    counts = nvrtc.result(family, target)["counts"]
    assert counts["e2m1x2"] == 0 and counts["ue8m0x2"] == 0
    assert counts["cvt.rn.satfinite.e4m3x2.f32"]


@pytest.mark.parametrize("family", sorted(BLACKWELL_CVTS))
def test_specific_target_is_asked_only_where_it_exists(family, monkeypatch):
    monkeypatch.setattr(_device, "_caps", {0: _device.caps_of_arch("100"), 1: _device.caps_of_arch("120")})
    monkeypatch.setitem(_device._caps, 2, _device.caps_of_arch("90"))
    targets = _jit.specific_targets(family)
    assert _device.specific_arch_option(targets, 0) == "-arch=sm_100a"
    assert _device.specific_arch_option(targets, 1) == "-arch=sm_120a"
    assert _device.specific_arch_option(targets, 2) is None
    assert _device.specific_arch_option(_jit.specific_targets("per_tensor"), 0) is None
    assert _device.specific_arch_option(_jit.specific_targets("groupwise"), 0) is None


def test_family_names_are_file_stems():
    """Each registered family is kernels/<family>.cu; the activation-side families are these."""
    for family in FAMILIES:
        assert (_jit.kernel_dir() / f"{family}.cu").is_file(), family
    assert {"per_tensor", "groupwise", "mx", "nvfp4", "testing"} <= set(FAMILIES)


def test_test_kernels_are_in_no_production_family():
    for family, exprs in _jit.families().items():
        if family != "testing":
            assert not any(e.startswith(("cvt_check", "e8m0_check")) for e in exprs), family


@pytest.mark.slow
def test_hopper_matmul_uses_wgmma_only_on_sm90a(nvrtc):
    """weight_sm90_gemm is built for sm_90a, the only target with wgmma: there its kernels issue
    wgmma.mma_async with the A operand in registers (64 x BMA x 16 per instruction); on every other
    target they compile to stubs that the host never launches.

    ptxas keeps every wgmma pipelined and spills nothing: where non-wgmma instructions define a
    wgmma's input registers inside its pipeline, ptxas serializes the wgmmas and says so in the log
    ("Potential Performance Loss", C7513). Serialized wgmmas make the 256-row tile 29-40% slower
    (BENCHMARKS.md) with output bits unchanged, so only this catches it."""
    r = nvrtc.result("weight_sm90_gemm", "90a")
    lowered, log, counts = r["lowered"], r["log"], r["counts"]
    assert set(lowered) == set(_jit.families()["weight_sm90_gemm"])
    assert "Potential Performance Loss" not in log, log
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(spills) >= len(lowered), log  # one report per kernel
    assert all(st == ld == "0" for st, ld in spills), log
    for bma, _, _ in cupyquant.weight.sm90_gemm.CONFIGS:
        for t in ("f16", "bf16"):
            assert counts[f"wgmma.mma_async.sync.aligned.m64n{bma}k16.f32.{t}.{t}"]
    assert counts["fence.proxy.async.shared::cta"]
    # PDL, as the other matmul kernels (pdl_sites): one wait a kernel, two in the 128-row tile's
    # (the 128-row tile: fp16 and bf16, INT4 in both prepared orders, FP4 in the k-permuted one,
    # FP8 and block FP8 in the plain one)
    producers = sum(", 128, " in name for name in lowered)
    from cupyquant.weight import formats

    assert producers == 2 * (2 * len(formats.INT4_IDS) + len(formats.FP4_IDS) + len(formats.FP8_IDS)), sorted(lowered)
    assert counts["griddepcontrol.wait;"] == len(lowered) + producers
    assert nvrtc.result("weight_sm90_gemm", "90")["counts"]["wgmma"] == 0  # the stubs
    assert _jit.specific_targets("weight_sm90_gemm") == _device.WGMMA_TARGETS == ("90",)


def test_generated_wgmma_wrappers_are_current():
    gen = load_script("gen_wgmma")
    assert gen.current() == gen.generated(), "run python scripts/gen_wgmma.py"


def test_reference_is_a_lazy_attribute_that_needs_no_cupy():
    """``cupyquant.reference`` is reachable after ``import cupyquant`` alone, without CuPy."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "import cupyquant\n"
        "assert 'cupyquant.reference' not in sys.modules\n"
        "print(cupyquant.reference.quantize_fp8.__name__)\n"
    )
    root = str(Path(__file__).resolve().parent.parent)
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, env={"PYTHONPATH": root, "PATH": ""}
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "quantize_fp8"
