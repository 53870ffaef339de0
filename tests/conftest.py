"""Shared test machinery: the GPU gate, output poisoning and bit-exact comparison.

GPU gate: tests marked ``gpu`` skip when no CUDA device is usable, and fail instead when
``CUPYQUANT_REQUIRE_GPU=1`` (the device run sets it, so nothing can silently skip there).

Poisoning: every GPU test runs with a CuPy allocator that fills each new allocation with 0xFF bytes
before the op sees it, so an element a kernel forgets to write keeps a pattern it never produces:
0xff is a negative NaN in both FP8 formats (kernels emit only the canonical NaN 0x7f), and
0xffff / 0xffffffff are negative NaNs that the canonical-NaN outputs (0x7fff, 0x7fffffff) never
equal. Caller-given ``out=`` buffers are filled the same way by :func:`poisoned`.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import pytest

REQUIRE_GPU = os.environ.get("CUPYQUANT_REQUIRE_GPU", "") not in ("", "0")


def _gpu_status():
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
        if n < 1:
            return False, "no CUDA device"
        cupy.cuda.Device(0).compute_capability  # noqa: B018 - touches the driver
        return True, ""
    except Exception as e:  # noqa: BLE001 - any failure means no usable GPU
        return False, f"no usable CUDA device ({type(e).__name__}: {str(e).splitlines()[0][:120]})"


HAVE_GPU, NO_GPU_REASON = _gpu_status()

# ------------------------------------------------------------------ fuzz options (tests/test_fuzz.py)
FUZZ_DEFAULT_CASES = 256
FUZZ_DEFAULT_SEED = 0


def _fuzz_seed(text: str) -> int:
    try:
        v = int(text, 0)  # decimal, or 0x... as printed in failure messages
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= v < 1 << 63:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**63), got {v}")
    return v


def _fuzz_count(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def pytest_addoption(parser):
    group = parser.getgroup("cupyquant-fuzz", "cupyquant fuzz tests (tests/test_fuzz.py)")
    group.addoption(
        "--fuzz-cases",
        type=_fuzz_count,
        default=FUZZ_DEFAULT_CASES,
        metavar="N",
        help=f"number of random cases test_fuzz.py generates (default {FUZZ_DEFAULT_CASES})",
    )
    group.addoption(
        "--fuzz-seed",
        type=_fuzz_seed,
        default=FUZZ_DEFAULT_SEED,
        metavar="S",
        help="seed of the fuzz case list; case 0 has seed S itself, so '--fuzz-seed <a case's seed> "
        f"--fuzz-cases 1' reruns that one case (default {FUZZ_DEFAULT_SEED})",
    )


def fuzz_options(config) -> tuple[int, int]:
    """``(n_cases, seed)`` from ``--fuzz-cases`` and ``--fuzz-seed``."""
    return config.getoption("--fuzz-cases"), config.getoption("--fuzz-seed")


@pytest.fixture
def fuzz_config(request) -> tuple[int, int]:
    """``(n_cases, seed)`` of this run's fuzz options."""
    return fuzz_options(request.config)


def pytest_report_header(config):
    if HAVE_GPU:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
        return f"cupyquant GPU tests: on {props['name'].decode()} (CUPYQUANT_REQUIRE_GPU={int(REQUIRE_GPU)})"
    verdict = "FAIL" if REQUIRE_GPU else "are SKIPPED"
    return f"cupyquant GPU tests {verdict}: {NO_GPU_REASON}"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "requires_arch(fact): needs a GPU whose cupyquant._device.Caps has ``fact`` (wgmma, fp8_mma, int8_mma, "
        "pdl, fp4_cvt); skipped, naming it, on one without",
    )


def require_arch(fact: str) -> None:
    """Skip the running test unless the current GPU's capabilities (cupyquant._device.Caps) include
    ``fact``: the one place tests ask what a GPU can do."""
    import cupy

    from cupyquant import _device

    caps = _device.caps(cupy.cuda.Device().id)
    if not getattr(caps, fact):
        pytest.skip(f"needs {fact}, which a GPU of compute capability {caps.name} does not have")


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None and not HAVE_GPU:
        if REQUIRE_GPU:
            pytest.fail(f"CUPYQUANT_REQUIRE_GPU=1 but {NO_GPU_REASON}", pytrace=False)
        pytest.skip(f"GPU test skipped: {NO_GPU_REASON}")
    for mark in item.iter_markers("requires_arch"):
        if HAVE_GPU:
            require_arch(*mark.args)


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Every test starts with no memoized launch plan, so that one that changes a planner's tables
    or functions (monkeypatch) is planned with them."""
    from cupyquant import _plans

    _plans.clear()
    yield


POISON = 0xFF


@pytest.fixture(autouse=True)
def _poison_allocations(request):
    """For GPU tests: fill every CuPy allocation with 0xFF before use."""
    if request.node.get_closest_marker("gpu") is None or not HAVE_GPU:
        yield
        return
    import cupy

    pool = cupy.get_default_memory_pool()

    def alloc(size):
        mem = pool.malloc(size)
        if size:
            cupy.cuda.runtime.memsetAsync(mem.ptr, POISON, size, cupy.cuda.get_current_stream().ptr)
        return mem

    cupy.cuda.set_allocator(alloc)
    try:
        yield
    finally:
        cupy.cuda.set_allocator(pool.malloc)


def side_stream():
    """A non-blocking stream for a test's rounds, captures and replays, made once the device has
    finished everything queued so far: a test's arrays are allocated (and poisoned), filled and
    copied on the default stream, which a non-blocking stream does not wait for, so a late poisoning
    memset or copy could otherwise land among the calls under test."""
    import cupy

    cupy.cuda.Device().synchronize()
    return cupy.cuda.Stream(non_blocking=True)


def poisoned(shape, dtype):
    """A CuPy array of ``shape``/``dtype`` whose bytes are all 0xFF."""
    import cupy

    a = cupy.empty(shape, dtype=dtype)
    if a.size:
        cupy.cuda.runtime.memsetAsync(a.data.ptr, POISON, a.nbytes, cupy.cuda.get_current_stream().ptr)
    return a


def moved_copy(a, offset: int):
    """A C-contiguous CuPy copy of ``a`` that starts ``offset`` bytes past a 256-byte boundary (a
    misaligned view, as a slice of a larger buffer would be)."""
    import cupy

    raw = cupy.empty(a.nbytes + offset, np.uint8)[offset:]
    raw[...] = a.reshape(-1).view(np.uint8)
    return raw.view(a.dtype).reshape(a.shape)


def to_numpy(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_bits_equal(actual, expected, what: str = "output") -> None:
    """Compare as integers; on failure report the mismatch count, the first index, both values and
    both bit patterns."""
    a = to_numpy(actual)
    e = to_numpy(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != expected {e.shape}"
    assert a.dtype.itemsize == e.dtype.itemsize, f"{what}: itemsize {a.dtype} vs {e.dtype}"
    ab, eb = _bits(a), _bits(e)
    bad = ab != eb
    if bad.any():
        idx = np.argwhere(bad)[0]
        i = tuple(int(v) for v in idx)
        w = 2 * a.dtype.itemsize
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements differ; first at {i}: "
            f"got {a[i]!r} (0x{int(ab[i]):0{w}x}), expected {e[i]!r} (0x{int(eb[i]):0{w}x})"
        )


def raw_scale_words(q) -> np.ndarray:
    """The whole scale allocation of a per-token or per-group QuantizedTensor (padding included) as
    uint32 words."""
    import cupy

    from cupyquant import reference as ref

    shape = q.shape
    ng = 1 if q.scheme.granularity == "token" else shape[-1] // q.scheme.block[0]
    n_cols = -(-ng // 4) if q.scheme.scale_dtype == "float8_e8m0fnu" else ng
    _, total = ref.scale_word_offsets(shape, n_cols, q.scheme.scale_layout)
    return cupy.ndarray((total,), np.uint32, memptr=q.scale.data).get()


def heavy_tailed(shape, seed: int, dtype) -> np.ndarray:
    """Fresh random data spanning many binades: normal * exp(2 * normal)."""
    rng = np.random.default_rng(seed)
    v = rng.standard_normal(shape) * np.exp(2.0 * rng.standard_normal(shape))
    return v.astype(np.float32).astype(dtype)
