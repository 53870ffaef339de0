"""What a run will do, decided before anything is written: the source folder's tensors, which of
them are quantized (``targets`` and ``ignore``), the groups of weights that share an NVFP4 global
scale, and the output shards (each a list of whole units, at most ``max_shard_size`` bytes unless
one unit is larger), with the tensors each shard holds in order. Every check of the input happens
here, so a bad input raises :class:`CheckpointError` (a ``ValueError``) naming the tensor or
argument while the destination is untouched."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .files import CheckpointError, TensorEntry, read_header
from .schemes import FLOAT_WEIGHTS, CheckpointScheme, nbytes_of, shape_problem, tensor_layout

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
#: Every 2-D ``*.weight`` tensor, compressed-tensors' name for the targets of linear layers.
LINEAR = "Linear"
DEFAULT_TARGETS = (LINEAR,)
#: What llm-compressor's recipes leave unquantized: the output head, the embeddings, the norms and
#: MoE routers (matched against module names, the tensor name without ``.weight``).
DEFAULT_IGNORE = ("lm_head", r"re:.*embed.*", r"re:.*norm.*", r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$")
#: Projections that inference engines fuse into one matrix (vLLM's ``qkv_proj``, ``gate_up_proj``,
#: the experts' ``w13``); their NVFP4 weights share one global scale, as llm-compressor writes them.
FUSED = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"}, {"w1", "w3"})
DEFAULT_MAX_SHARD = 5 * 10**9
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size(value, arg: str = "max_shard_size") -> int:
    """Bytes from an int or a string such as ``"5GB"``, ``"500MB"``, ``"2GiB"``."""
    if isinstance(value, bool):
        raise TypeError(f"{arg} must be an int or a str such as '5GB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value)
        if not m or m.group(2).upper() not in _SIZE_UNITS:
            raise ValueError(f"{arg} must be a size such as '5GB', '500MB' or '2GiB', got {value!r}")
        n = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])
    else:
        raise TypeError(f"{arg} must be an int or a str such as '5GB', got {type(value).__name__}")
    if n <= 0:
        raise ValueError(f"{arg} must be positive, got {value!r}")
    return n


def _patterns(value, arg: str) -> tuple:
    if isinstance(value, str):
        value = (value,)
    try:
        items = tuple(value)
    except TypeError:
        raise TypeError(f"{arg} must be a str or a sequence of str, got {type(value).__name__}") from None
    for p in items:
        if not isinstance(p, str):
            raise TypeError(f"{arg} must hold str patterns, got {p!r}")
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as e:
                raise ValueError(f"{arg}: pattern {p!r} is not a regular expression ({e})") from None
    return items


def matches(module: str, pattern: str) -> bool:
    """compressed-tensors' rule: ``re:<regex>`` matches from the start of the module name
    (``re.match``), any other pattern the whole name."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern


@dataclass
class Unit:
    """Tensors kept together in one shard: one tensor, or the weights that share an NVFP4 global scale."""

    tensors: list
    quantized: bool
    out_bytes: int = 0


@dataclass
class Shard:
    name: str
    units: list
    layout: list = field(default_factory=list)  # [(name, dtype, shape)] in the order written

    @property
    def nbytes(self) -> int:
        return sum(u.out_bytes for u in self.units)


@dataclass
class Plan:
    src: Path
    dst: Path
    scheme: CheckpointScheme
    config: dict
    tensors: list
    quantized: list  # the TensorEntry of every weight to quantize
    ignored: list  # module names of the 2-D weights left unquantized
    shards: list
    targets: tuple
    ignore: tuple
    extra_files: list  # files and folders of the source copied as they are

    @property
    def in_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def source_tensors(src: Path) -> list:
    """Every tensor of a Hugging Face model folder, in file order (the index's files sorted, or
    ``model.safetensors``), each file in the order of its bytes."""
    index = src / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index (no weight_map: {e})") from None
        files = sorted(set(weight_map.values()))
        out = []
        for f in files:
            entries = read_header(src / f)
            listed = {n for n, v in weight_map.items() if v == f}
            have = {t.name for t in entries}
            if listed - have:
                raise CheckpointError(f"{src / f}: the index lists tensors the file lacks: {sorted(listed - have)[:5]}")
            out += entries
        missing = set(weight_map) - {t.name for t in out}
        if missing:
            raise CheckpointError(f"{index}: tensors not found in their files: {sorted(missing)[:5]}")
        return out
    if (src / SINGLE).is_file():
        return read_header(src / SINGLE)
    raise CheckpointError(f"src {src} has neither {INDEX} nor {SINGLE}")


def _fused_key(name: str):
    parent, _, leaf = name.removesuffix(".weight").rpartition(".")
    for i, group in enumerate(FUSED):
        if leaf in group:
            return (parent, i)
    return None


def _units(tensors: list, quantize: set, scheme: CheckpointScheme) -> list:
    """One unit per tensor, except that the quantized weights of one fused group (same parent
    module) form one unit under NVFP4; units in the order of their first tensor."""
    units, fused = [], {}
    for t in tensors:
        q = t.name in quantize
        key = _fused_key(t.name) if q and scheme.fmt == "nvfp4" else None
        if key is not None and key in fused:
            fused[key].tensors.append(t)
            continue
        u = Unit([t], q)
        units.append(u)
        if key is not None:
            fused[key] = u
    for u in units:
        u.out_bytes = sum(_out_bytes(t, u.quantized, scheme) for t in u.tensors)
    return units


def out_layout(t: TensorEntry, quantized: bool, scheme: CheckpointScheme) -> list:
    """``[(name, dtype, shape)]`` written for a source tensor."""
    if not quantized:
        return [(t.name, t.dtype, t.shape)]
    module = t.name.removesuffix(".weight")
    return [(f"{module}.{suffix}", dt, shp) for suffix, dt, shp in tensor_layout(scheme, t.shape, t.dtype)]


def _out_bytes(t, quantized, scheme) -> int:
    return nbytes_of(out_layout(t, quantized, scheme)) if quantized else t.nbytes


def _shards(units: list, max_bytes: int, scheme) -> list:
    groups, cur, size = [], [], 0
    for u in units:
        if cur and size + u.out_bytes > max_bytes:
            groups.append(cur)
            cur, size = [], 0
        cur.append(u)
        size += u.out_bytes
    if cur or not groups:
        groups.append(cur)
    n = len(groups)
    shards = []
    for i, g in enumerate(groups):
        name = SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        s = Shard(name, g)
        for u in g:
            for t in u.tensors:
                s.layout += out_layout(t, u.quantized, scheme)
        shards.append(s)
    return shards


def _check_dst(src: Path, dst, overwrite: bool) -> Path:
    if not isinstance(dst, (str, Path)):
        raise TypeError(f"dst must be a str or a Path, got {type(dst).__name__}")
    dst = Path(dst)
    if dst.resolve() == src.resolve():
        raise CheckpointError(f"dst must differ from src ({src})")
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(f"dst {dst} exists and is not a folder")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise CheckpointError(f"dst {dst} is not empty: pass overwrite=True (--overwrite) to write into it")
    return dst


def make_plan(src, dst, scheme: CheckpointScheme, *, targets, ignore, max_shard_size, overwrite) -> Plan:
    """Check everything and plan the run (nothing is written)."""
    if not isinstance(src, (str, Path)):
        raise TypeError(f"src must be a str or a Path, got {type(src).__name__}")
    src = Path(src)
    if not src.is_dir():
        raise CheckpointError(f"src {src} is not a folder")
    max_bytes = parse_size(max_shard_size)
    targets = _patterns(DEFAULT_TARGETS if targets is None else targets, "targets")
    ignore = _patterns(DEFAULT_IGNORE if ignore is None else ignore, "ignore")
    if not targets:
        raise ValueError("targets must name at least one pattern")
    dst = _check_dst(src, dst, overwrite)
    try:
        config = json.loads((src / "config.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"src {src} has no config.json") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{src / 'config.json'}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{src / 'config.json'}: not a JSON object")
    if "quantization_config" in config:
        raise CheckpointError(f"src {src} is already quantized (its config.json has a quantization_config)")
    tensors = source_tensors(src)
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise CheckpointError(f"src {src}: tensors in more than one file: {dup[:5]}")
    quantize, ignored = [], []
    for t in tensors:
        module = t.name.removesuffix(".weight")
        explicit = any(p != LINEAR and matches(module, p) for p in targets)
        linear = LINEAR in targets and t.name.endswith(".weight") and len(t.shape) == 2
        if not (explicit or linear):
            continue
        if any(matches(module, p) for p in ignore):
            if len(t.shape) == 2 and t.name.endswith(".weight"):
                ignored.append(module)
            continue
        if not t.name.endswith(".weight") or len(t.shape) != 2:
            raise CheckpointError(
                f"tensor {t.name!r} matches targets {targets} but is not the 2-D weight of a linear layer "
                f"(shape {t.shape}); narrow targets or add it to ignore"
            )
        if t.dtype not in FLOAT_WEIGHTS:
            raise CheckpointError(f"tensor {t.name!r} has dtype {t.dtype}; quantizing takes {FLOAT_WEIGHTS}")
        why = shape_problem(scheme, t.shape)
        if why:
            raise CheckpointError(f"tensor {t.name!r} {why}; add it to ignore to keep it unquantized")
        quantize.append(t)
    chosen = {t.name for t in quantize}
    for t in tensors:  # 2-D weights neither targeted nor ignored stay as they are too
        if t.name.endswith(".weight") and len(t.shape) == 2 and t.name not in chosen:
            ignored.append(t.name.removesuffix(".weight"))
    units = _units(tensors, chosen, scheme)
    shards = _shards(units, max_bytes, scheme)
    skip = {INDEX, "config.json"} | {t.path.name for t in tensors}
    extra = sorted(
        p for p in src.iterdir() if p.name not in skip and not p.name.startswith(".") and p.suffix != ".safetensors"
    )
    return Plan(src, dst, scheme, config, tensors, quantize, sorted(set(ignored)), shards, targets, ignore, extra)
