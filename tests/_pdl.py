"""What the PDL tests of the op families share (one test in each family's file): rounds of an op on
fixed input buffers, each round's inputs written by a kernel that lets the op's kernel start at once.

The ops launch their kernels with programmatic dependent launch (PDL) on compute capability 9.0 and
newer: a kernel may start while the kernel before it on the stream runs, and must wait
(``griddepcontrol.wait``) before its first access to global memory. Before each round, the
*overwrite* kernel below, itself launched with PDL, waits for the kernel before it, releases the
next one at once (``griddepcontrol.launch_dependents``), spins for a head start (about 30 us), and
only then copies the round's values into the op's input buffers, one block byte by byte (so that
it keeps running a while longer), and copies the previous round's outputs out. An op kernel that
read an input before its wait would see the previous round's values, and one that wrote an output
before it would change what the previous round's copy saves: either way some round differs from
the reference. The rounds run in a stream and then replayed from a CUDA graph that captured them all
(PDL launches become programmatic edges of the graph).

CuPy's allocator is left unpoisoned during the rounds: the test allocator's memset of a new array
would stand between the overwrite kernel and the op's kernel, serializing them.
"""

from __future__ import annotations

import contextlib

import numpy as np

try:
    import cupy
except ImportError:  # the GPU tests skip; the module still imports
    cupy = None

#: clock64() cycles of the overwrite kernel's head start: about 30 us at H100/H200 clocks
SPIN_CYCLES = 1 << 16
#: (source, destination) pairs one overwrite launch copies at most
MAX_PAIRS = 16

_SOURCE = r"""
struct Pairs {
    long long src[16], dst[16], n[16];
    int count;
};
extern "C" __global__ void pdl_overwrite(Pairs p, long long cycles) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const long long start = clock64();
    while (clock64() - start < cycles) { }
    for (int j = 0; j < p.count; ++j) {
        const unsigned char* s = (const unsigned char*)p.src[j];
        unsigned char* d = (unsigned char*)p.dst[j];
        for (long long i = threadIdx.x; i < p.n[j]; i += blockDim.x) d[i] = s[i];
        __syncthreads();  // a save of an output before the write of an input into the same buffer
    }
}
"""
_PAIRS = np.dtype(
    [
        ("src", np.int64, (MAX_PAIRS,)),
        ("dst", np.int64, (MAX_PAIRS,)),
        ("n", np.int64, (MAX_PAIRS,)),
        ("count", np.int32),
    ],
    align=True,
)
_kernel = None


def _overwrite(pairs) -> None:
    """Launch the overwrite kernel (with PDL) copying each (destination, source) array pair."""
    global _kernel
    from cupyquant._launch import Launch

    if _kernel is None:
        _kernel = cupy.RawKernel(_SOURCE, "pdl_overwrite")
    assert len(pairs) <= MAX_PAIRS
    p = np.zeros((), _PAIRS)
    for j, (dst, src) in enumerate(pairs):
        assert dst.nbytes == src.nbytes and dst.flags.c_contiguous and src.flags.c_contiguous
        p["src"][j], p["dst"][j], p["n"][j] = src.data.ptr, dst.data.ptr, src.nbytes
    p["count"] = len(pairs)
    Launch(_kernel, (1,), (256,), (p[()], np.int64(SPIN_CYCLES)), pdl=True)()


@contextlib.contextmanager
def _unpoisoned():
    saved = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
    try:
        yield
    finally:
        cupy.cuda.set_allocator(saved)


def _rounds(step, inputs, sources) -> list:
    """Each round: the overwrite kernel (this round's sources into ``inputs``, the previous round's
    outputs into new arrays), then ``step()``; then one more overwrite for the last round's outputs.
    Returns the saved outputs of each round (device arrays) and every array the rounds used."""
    saved, keep, last = [], [], []
    for r in range(len(sources) + 1):
        copies = [cupy.empty(o.shape, o.dtype) for o in last]
        saved.append(copies)
        pairs = list(zip(copies, last))
        if r < len(sources):
            pairs += list(zip(inputs, sources[r]))
        _overwrite(pairs)
        keep += last
        if r < len(sources):
            last = [o for o in step() if o is not None]
    return saved[1:], keep


def check_rounds(step, inputs, sources, check) -> None:
    """Run ``step()`` (the op on the arrays ``inputs``; returns the device arrays it produced, which
    may be the same ``out=`` buffers every round) for each round ``r`` of ``sources`` (a list, per
    round, of device arrays shaped as ``inputs``), each after the overwrite kernel that writes the
    round's sources into ``inputs``; then ``check(r, outputs, where)`` with round r's outputs as
    NumPy arrays and ``where`` "stream" or "graph": in a stream, then replayed from a CUDA graph of
    all the rounds (inputs and outputs poisoned before the replay)."""
    from conftest import side_stream

    stream = side_stream()  # the inputs, sources and out= buffers were made on the default stream
    with _unpoisoned(), stream:
        step()  # compiles and plans (loading may synchronize; capture must not)
        stream.synchronize()
        saved, _ = _rounds(step, inputs, sources)
        stream.synchronize()
        for r, outs in enumerate(saved):
            check(r, [o.get() for o in outs], "stream")
        stream.begin_capture()
        try:
            saved, keep = _rounds(step, inputs, sources)
        finally:
            graph = stream.end_capture()
        for a in [o for outs in saved for o in outs] + keep + list(inputs):
            cupy.cuda.runtime.memsetAsync(a.data.ptr, 0xFF, a.nbytes, stream.ptr)
        graph.launch(stream)
        stream.synchronize()
        for r, outs in enumerate(saved):
            check(r, [o.get() for o in outs], "graph")


def assert_rounds_equal(got, want, names, what: str) -> None:
    """Each output of a round against the reference's, bit for bit, named."""
    from conftest import assert_bits_equal

    assert len(got) == len(want) == len(names), (len(got), len(want), names)
    for g, w, n in zip(got, want, names, strict=True):
        assert_bits_equal(g, w, f"{what}: {n}")
