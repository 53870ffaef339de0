"""The CPU parts of scripts/bench_host.py: it times every public op (and with out= where an op
takes it), and its bare replay allocates what an op returns. The timings need a GPU."""

from __future__ import annotations

import inspect
import re

import pytest
from _scripts import SCRIPTS, load_script

import cupyquant as cq

pytest.importorskip("cupy")

#: Public names that are not ops (containers, errors, helpers that allocate or compute shapes)
NOT_OPS = {"QuantizedTensor", "QuantizedWeight", "Scheme", "KernelCompileError", "KernelLaunchError"}
NOT_OPS |= {"CudaHeadersNotFoundError", "UnsupportedGPUError", "block_scale_shape", "empty_kv_scale_cache"}


def test_every_public_op_has_a_case():
    src = (SCRIPTS / "bench_host.py").read_text()
    called = set(re.findall(r"\bcq\.(\w+)\(", src))
    ops = {n for n in cq.__all__ if not n.startswith("__") and n not in NOT_OPS}
    assert ops <= called, f"ops bench_host.py does not time: {sorted(ops - called)}"
    for name in ("matmul", "scaled_matmul", "rms_norm_quantize", "quantize_groupwise", "dequantize"):
        assert re.search(rf"cq\.{name}\([^\n]*out=", src), f"{name} with out="


@pytest.mark.gpu
def test_every_case_runs_and_replays():
    """Each case once (one round of two calls): the op and its bare replay run, and the replay holds
    the op's launches and allocations (matmul: one launch, one output; quantize_fp8 dynamic: two
    launches and a memset, three outputs)."""
    host = load_script("bench_host")
    rows = {name: host.measure(fn, given, rounds=1, calls=2) for name, (fn, given) in host.cases().items()}
    for name, r in rows.items():
        assert r["ours_us"] > 0 and r["bare_us"] > 0, name
    assert (rows["matmul int4 g128"]["launches"], rows["matmul int4 g128"]["outputs"]) == (1, 1)
    r = rows["quantize_fp8 dynamic"]
    assert (r["launches"], r["memsets"], r["outputs"]) == (2, 1, 3)
    assert rows["matmul int4 g128 out="]["outputs"] == 0
    assert rows["quantize_fp8 dynamic out="]["outputs"] == 2  # its scale and amax: q is given
    assert inspect.getdoc(host).startswith("Host time per call")
