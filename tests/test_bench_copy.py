"""The same-size copy that the norm and KV-cache tables print as a small op's ceiling
(``cupyquant._bench.copy_seconds``): a kernel copy in a CUDA graph, every byte moved."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")


@pytest.mark.parametrize("nbytes", [16, 4096, 3 << 20])
def test_copy16_moves_every_byte(nbytes):
    from cupyquant import _bench

    src = cupy.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=cupy.uint8)
    dst = cupy.full(nbytes, 0xA5, dtype=cupy.uint8)
    _bench.copy16(src, dst)
    assert bool((dst == src).all())


def test_copy16_on_a_side_stream_in_a_graph():
    from cupyquant import _bench

    pairs = [(cupy.full(1 << 16, i + 1, dtype=cupy.uint8), cupy.zeros(1 << 16, dtype=cupy.uint8)) for i in range(3)]
    stream = cupy.cuda.Stream(non_blocking=True)
    graph = _bench.capture_graph(lambda s, d: _bench.copy16(s, d, stream), pairs, stream)
    for _, dst in pairs:
        dst.fill(0)
    graph.launch(stream)
    stream.synchronize()
    for src, dst in pairs:
        assert bool((dst == src).all())


@pytest.mark.parametrize("nbytes", [1000, 1 << 22])
def test_copy_seconds_times_a_copy(nbytes):
    from cupyquant import _bench

    assert 0 < _bench.copy_seconds(nbytes) < 1e-2
