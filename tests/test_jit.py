"""The JIT loader without a GPU: NVRTC compiles every registered instantiation for every target
architecture, local includes are inlined, and failures raise the library's errors."""

from __future__ import annotations

import re
import shutil

import pytest
from _scripts import load_script

import cupyquant
from cupyquant import _device, _jit

FAMILIES = sorted(cupyquant._all_families())


@pytest.mark.slow
@pytest.mark.parametrize("arch", _device.NVRTC_TEST_TARGETS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_instantiation_compiles(family, arch):
    ptx = []
    lowered = _jit.compile_for_arch(family, arch, ptx_out=ptx)
    exprs = _jit.families()[family]
    assert set(lowered) == set(exprs)
    assert len(set(lowered.values())) == len(exprs), "two expressions lowered to one symbol"
    assert all(name.startswith("_Z") for name in lowered.values())
    # programmatic dependent launch: each matmul kernel waits for the kernel before (and releases
    # the one after) once, on the targets that have it (9.0 and newer); nothing else does. The
    # decode kernel (w16_decode) has two call sites, one on each side of its first weight loads,
    # of which a launch takes one (weight_decode.cu, MatmulArgs.early)
    sites = {"w16_decode": 2, "sm80_w16_gemm": 1}
    pdl_sites = (
        sum(n for e in exprs for k, n in sites.items() if e.startswith(k)) if _device.caps_of_arch(arch).pdl else 0
    )
    assert ptx[0].count("griddepcontrol.wait;") == pdl_sites
    assert ptx[0].count("griddepcontrol.launch_dependents;") == pdl_sites


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
@pytest.mark.parametrize("arch", ["100a", "120a"])
@pytest.mark.parametrize("family", sorted(BLACKWELL_CVTS))
def test_blackwell_targets_use_the_conversion_instructions(family, arch):
    """On the family-specific Blackwell targets the block-scaled families (and the test kernels that
    check their conversions) use the e2m1x2 and ue8m0x2 conversions (and the fp8x2 one); on sm_90
    only the fp8x2 one exists."""
    ptx = []
    lowered = _jit.compile_for_arch(family, arch, ptx_out=ptx)
    assert set(lowered) == set(_jit.families()[family])
    for cvt in BLACKWELL_CVTS[family]:
        assert cvt in ptx[0], cvt


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(BLACKWELL_CVTS))
def test_hopper_uses_the_software_fp4_path(family):
    ptx = []
    _jit.compile_for_arch(family, "90", ptx_out=ptx)
    assert "e2m1x2" not in ptx[0] and "ue8m0x2" not in ptx[0]
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx[0]


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
def test_hopper_matmul_uses_wgmma_only_on_sm90a():
    """weight_sm90_gemm is built for sm_90a, the only target with wgmma: there its kernels issue
    wgmma.mma_async with the A operand in registers (64 x BMA x 16 per instruction); on every other
    target they compile to stubs that the host never launches.

    ptxas keeps every wgmma pipelined and spills nothing: where non-wgmma instructions define a
    wgmma's input registers inside its pipeline, ptxas serializes the wgmmas and says so in the log
    ("Potential Performance Loss", C7513). Serialized wgmmas make the 256-row tile 29-40% slower
    (BENCHMARKS.md) with output bits unchanged, so only this catches it."""
    ptx, log = [], []
    lowered = _jit.compile_for_arch("weight_sm90_gemm", "90a", ptx_out=ptx, log_out=log)
    assert set(lowered) == set(_jit.families()["weight_sm90_gemm"])
    assert "Potential Performance Loss" not in log[0], log[0]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log[0])
    assert len(spills) >= len(lowered), log[0]  # one report per kernel
    assert all(st == ld == "0" for st, ld in spills), log[0]
    for bma, _, _ in cupyquant.weight.configs.SM90_GEMM_CONFIGS:
        for t in ("f16", "bf16"):
            assert f"wgmma.mma_async.sync.aligned.m64n{bma}k16.f32.{t}.{t}" in ptx[0]
    assert "fence.proxy.async.shared::cta" in ptx[0]
    # PDL, as the other matmul kernels: one wait a kernel, two in the 128-row tile's (its producer
    # warpgroup waits after its early weight copies, its compute warps on their own)
    # (the 128-row tile: fp16 and bf16, INT4 in both prepared orders, FP4 in the k-permuted one)
    producers = sum(", 128, " in name for name in lowered)
    from cupyquant.weight import formats

    assert producers == 2 * (2 * len(formats.INT4_IDS) + len(formats.FP4_IDS)), sorted(lowered)
    assert ptx[0].count("griddepcontrol.wait;") == len(lowered) + producers
    ptx90 = []
    _jit.compile_for_arch("weight_sm90_gemm", "90", ptx_out=ptx90)
    assert "wgmma" not in ptx90[0].replace("sm90_w16_gemm", "")
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
