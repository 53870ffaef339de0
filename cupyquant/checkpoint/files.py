"""safetensors files by their documented layout: an 8-byte little-endian header length, a JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, offsets from
the end of the header), then the tensors' bytes. Read memory-mapped (a tensor's pages are read when
it is used, once; a shard is never held whole), written as a stream (the header first, from the
planned sizes, then each tensor as it is made), under a temporary name renamed at the end, so that
a failed or retried writer never leaves a partial shard under the final name.

The files load with the ``safetensors`` package (tests/test_checkpoint.py reads every written
shard with it); reading through NumPy memory maps keeps bfloat16 and FP8 tensors, which the
package's NumPy API would convert or refuse, as their bytes."""

from __future__ import annotations

import json
import os
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .schemes import NP_DTYPE

#: A header longer than this is not a safetensors header (the package's own limit is 100 MB).
MAX_HEADER = 100_000_000
#: What the header's ``__metadata__`` says; transformers reads files whose format is "pt".
METADATA = {"format": "pt"}


class CheckpointError(ValueError):
    """A checkpoint folder or argument that cannot be used, found before anything is written."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a source file: its name, safetensors dtype, shape, file and absolute byte range."""

    name: str
    dtype: str
    shape: tuple
    path: Path
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(path: Path) -> list:
    """The :class:`TensorEntry` list of a safetensors file, in the order of their bytes."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, MAX_HEADER):
                raise CheckpointError(
                    f"{path}: not a safetensors file (header length {n} past the file's {size} bytes)"
                )
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a safetensors file (its header is not JSON: {e})") from None
    base = 8 + n
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = info["dtype"], tuple(int(v) for v in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {info!r}") from None
        if dtype not in NP_DTYPE:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype!r}, which cupyquant does not read")
        want = NP_DTYPE[dtype].itemsize * int(np.prod(shape, dtype=np.int64))
        if not 0 <= b <= e <= size - base or e - b != want:
            raise CheckpointError(f"{path}: tensor {name!r} has offsets {[b, e]} that do not fit its shape or the file")
        out.append(TensorEntry(name, dtype, shape, path, base + b, base + e))
    out.sort(key=lambda t: t.begin)
    return out


def read_tensor(t: TensorEntry) -> np.ndarray:
    """The tensor as a read-only NumPy array over a memory map of its bytes (not read yet)."""
    dtype = NP_DTYPE[t.dtype]
    if t.nbytes == 0:
        return np.zeros(t.shape, dtype)
    m = np.memmap(t.path, dtype=np.uint8, mode="r", offset=t.begin, shape=(t.nbytes,))
    return m.view(dtype).reshape(t.shape)


def header_bytes(layout: list) -> bytes:
    """The 8-byte length and JSON header of a file holding ``layout`` ``[(name, dtype, shape)]`` in
    that order, padded with spaces to a multiple of 8 bytes (the tensors then start 8-byte aligned)."""
    header, off = {"__metadata__": METADATA}, 0
    for name, dtype, shape in layout:
        n = NP_DTYPE[dtype].itemsize * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": dtype, "shape": [int(v) for v in shape], "data_offsets": [off, off + n]}
        off += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class ShardWriter:
    """Writes one safetensors file of a planned ``layout`` ``[(name, dtype, shape)]``: the header at
    once, then :meth:`write` each tensor in the layout's order; :meth:`close` renames the temporary
    file to ``path``, :meth:`abort` removes it. A context manager aborts on an exception."""

    def __init__(self, path: Path, layout: list):
        self.path = Path(path)
        self.layout = list(layout)
        self._next = 0
        self.tmp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex}.tmp")
        self._f = open(self.tmp, "wb")
        self._f.write(header_bytes(self.layout))

    def write(self, name: str, array: np.ndarray) -> None:
        want_name, dtype, shape = self.layout[self._next]
        a = np.ascontiguousarray(array)
        if name != want_name or a.dtype != NP_DTYPE[dtype] or tuple(a.shape) != tuple(shape):
            raise AssertionError(
                f"{self.path.name}: wrote {name} {a.dtype} {a.shape}, planned {want_name} {dtype} {shape}"
            )
        self._f.write(memoryview(a.reshape(-1).view(np.uint8)))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self.layout):
            raise AssertionError(f"{self.path.name}: {self._next} of {len(self.layout)} tensors written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self._f.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False
