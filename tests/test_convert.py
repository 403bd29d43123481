"""checkpoints_convert (HF -> converted orbax checkpoint) and lingjax.checkpoint (loading it back).

Everything runs on the golden tiny checkpoints; conversions are cached per module, and all forward
passes share one compiled float64 function (models restored from converted checkpoints share a
graph and input shardings, so nnx.jit compiles once).
"""
import errno
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import checkpoints_convert.convert as convert_mod
from checkpoints_convert import main
from conftest import DSPARK_TINY, LING_TINY
from helpers import golden, rel
from lingjax.cache import init_cache
from lingjax.checkpoint import is_converted_checkpoint, load_converted, load_converted_draft, load_model
from lingjax.model.dspark import from_safetensors
from lingjax.safetensors_io import CheckpointReader, dequantize_block_fp8, write_safetensors
from lingjax.weights import load_hf_model, load_hf_params

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
BLOCK = 32
HIGH_PRECISION = ("layernorm", "norm.weight", "mlp.gate.weight", "conv1d", "word_embeddings", "lm_head")
TOKENIZER_FILES = {"tokenizer.json": "{}", "tokenizer_config.json": "{\"a\": 1}", "chat_template.jinja": "{{ x }}"}


# ---- building source checkpoints ------------------------------------------------------------------
def _tensors(src: Path) -> dict[str, np.ndarray]:
    r = CheckpointReader(src)
    return {k: np.array(r.get(k)) for k in r.keys()}


def _write_hf(d: Path, tensors: dict, config: dict, shards: int = 1, extra_files: dict | None = None) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config))
    for name, text in (extra_files or {}).items():
        (d / name).write_text(text)
    if shards == 1:
        write_safetensors(d / "model.safetensors", tensors)
        return d
    names = list(tensors)
    weight_map = {}
    for i, chunk in enumerate(np.array_split(np.arange(len(names)), shards)):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(d / fname, {names[j]: tensors[names[j]] for j in chunk})
        weight_map.update({names[j]: fname for j in chunk})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def _config(src: Path = LING_TINY) -> dict:
    return json.loads((src / "config.json").read_text())


def _quantize_reference(w: np.ndarray, b: int):
    """Published block fp8, written independently of the converter: one block at a time."""
    o, i = w.shape
    q = np.empty(w.shape, FP8)
    s = np.empty((math.ceil(o / b), math.ceil(i / b)), np.float32)
    for r in range(0, o, b):
        for c in range(0, i, b):
            blk = w[r:r + b, c:c + b].astype(np.float32)
            amax = np.float32(np.abs(blk).max())
            sc = amax / np.float32(448) if amax > 0 else np.float32(1)
            q[r:r + b, c:c + b] = (blk / sc).astype(FP8)
            s[r // b, c // b] = sc
    return q, s


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("convert")


@pytest.fixture(scope="module")
def fp8_dir(work):
    """The golden checkpoint in the published block-fp8 format (block 32, recorded in the config)."""
    out = {}
    for name, w in _tensors(LING_TINY).items():
        if name.endswith(".weight") and w.ndim == 2 and not any(h in name for h in HIGH_PRECISION):
            out[name], out[name + "_scale_inv"] = _quantize_reference(w, BLOCK)
        else:
            out[name] = w
    cfg = _config() | {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                               "weight_block_size": [BLOCK, BLOCK]}}
    return _write_hf(work / "ling3-tiny-fp8", out, cfg)


@pytest.fixture(scope="module")
def converted(work):
    """converted(name, src, *flags) -> OUT_DIR, converting once per name."""
    cache = {}

    def get(name, src=LING_TINY, *flags):
        if name not in cache:
            out = work / f"out-{name}"
            assert main([str(src), str(out), "-q", *flags]) == 0
            cache[name] = out
        return cache[name]
    return get


def _cli(capsys, *args) -> tuple[int, str]:
    rc = main([str(a) for a in args] + ["-q"])
    return rc, capsys.readouterr().err


def _params(model) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


def _assert_same_params(a, b):
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].dtype == pb[k].dtype, k
        assert pa[k].tobytes() == pb[k].tobytes(), k


def _tree_hashes(d: Path) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


@nnx.jit
def _forward(model, ids, cache):
    return model(ids, cache).logits[0]


def _logits(model):
    ids = jnp.asarray(golden()["long_ids"], jnp.int32)
    return np.asarray(_forward(model, ids, init_cache(model.cfg, 1, 128, model.dtype)))


# ---- the golden model through a conversion ---------------------------------------------------------
def test_float32_conversion_reproduces_golden_logits(converted):
    out = converted("f32", LING_TINY, "--dtype", "float32")
    assert is_converted_checkpoint(out)
    model = load_converted(out, jnp.float64)
    assert rel(_logits(model), golden()["long_logits"]) <= 1e-6
    _assert_same_params(model, load_hf_model(LING_TINY, dtype=jnp.float64))


@pytest.mark.parametrize("flag,dtype", [("float32", jnp.float32), ("bf16", jnp.bfloat16)])
def test_converted_equals_direct_load_bitwise(converted, flag, dtype):
    out = converted(flag, LING_TINY, "--dtype", flag)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["default_dtype"] == jnp.dtype(dtype).name
    if flag == "bf16":
        assert manifest["params"]["layers.0.attn.A_log"]["dtype"] == "float32"      # the model keeps it fp32
        assert manifest["params"]["layers.2.mlp.w_gate_up"]["dtype"] == "bfloat16"
    _assert_same_params(load_converted(out), load_hf_model(LING_TINY, dtype=dtype))
    _assert_same_params(load_model(out, dtype), load_model(LING_TINY, dtype))   # dispatch both ways


def test_sharded_restore(converted):
    """With a shardings mapping every array is restored directly with its sharding."""
    import jax
    out = converted("bf16", LING_TINY, "--dtype", "bf16")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    spec = jax.sharding.PartitionSpec
    shardings = {("embed",): jax.sharding.NamedSharding(mesh, spec("x", None)),
                 ("layers", 2, "mlp", "w_gate_up"): jax.sharding.NamedSharding(mesh, spec("x"))}
    model = load_converted(out, shardings=shardings)
    assert model.embed.get_value().sharding == shardings[("embed",)]
    assert model.layers[2].mlp.w_gate_up.get_value().sharding == shardings[("layers", 2, "mlp", "w_gate_up")]
    _assert_same_params(model, load_converted(out))


def test_sharded_restore_fp8(fp8_dir, converted):
    """fp8 parameters restored with a sharding are dequantised on their devices: same values."""
    import jax
    out = converted("fp8-keep", fp8_dir, "--dtype", "keep")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    path = ("layers", 2, "mlp", "w_gate_up")
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    model = load_converted(out, jnp.float32, shardings={path: sh})
    assert model.layers[2].mlp.w_gate_up.get_value().sharding == sh
    _assert_same_params(model, load_converted(out, jnp.float32))


def test_multi_shard_checkpoint_with_tokenizer(work, converted, capsys):
    src = _write_hf(work / "sharded", _tensors(LING_TINY), _config(), shards=3, extra_files=TOKENIZER_FILES)
    out = work / "out-sharded"
    rc, err = _cli(capsys, src, out, "--dtype", "float32")
    assert rc == 0, err
    for name, text in TOKENIZER_FILES.items():
        assert (out / name).read_text() == text
    assert json.loads((out / "config.json").read_text()) == _config()
    assert sorted(json.loads((out / "manifest.json").read_text())["source"]["files"]) == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    _assert_same_params(load_converted(out), load_converted(converted("f32", LING_TINY, "--dtype", "float32")))


# ---- fp8 ---------------------------------------------------------------------------------------------
def test_fp8_keep_and_bf16_within_quantisation_error(fp8_dir, converted):
    g = golden()["long_logits"]
    reader = CheckpointReader(fp8_dir)
    ref_model = load_model(fp8_dir, jnp.float64)              # published dequantisation, float64 model
    err_fp8 = rel(_logits(ref_model), g)
    err_bf16 = rel(_logits(load_converted(converted("bf16", LING_TINY, "--dtype", "bf16"), jnp.float64)), g)

    keep = converted("fp8-keep", fp8_dir, "--dtype", "keep")                 # block size from the config
    m = json.loads((keep / "manifest.json").read_text())["params"]
    assert m["layers.2.mlp.w_gate_up"]["dtype"] == "float8_e4m3fn"
    assert m["layers.2.mlp.w_gate_up"]["fp8"]["scale_shape"] == [16, 2, 128 // BLOCK, 1]
    assert m["layers.2.mlp.router"]["dtype"] == "float32" and "fp8" not in m["layers.2.mlp.router"]
    # keep: the same float64 parameters bit for bit as the published dequantisation, hence the same
    # logits through the same compiled forward (error exactly err_fp8)
    _assert_same_params(load_converted(keep, jnp.float64), ref_model)

    as_bf16 = converted("fp8-bf16", fp8_dir, "--dtype", "bf16", "--fp8-block", str(BLOCK))
    err = rel(_logits(load_converted(as_bf16, jnp.float64)), g)
    # fp8 error plus at most the bf16 rounding's own effect (measured ~0.512 vs 0.508 + 0.157)
    assert err <= err_fp8 + err_bf16, (err, err_fp8, err_bf16)

    # dequantisation bit-exact against numpy: keep (dequantised at load) and bf16 (at conversion)
    ref32 = load_hf_params(nnx.eval_shape(lambda: type(ref_model)(ref_model.cfg, dtype=jnp.float32)), reader,
                           fp8_block=(BLOCK, BLOCK))
    _assert_same_params(load_converted(keep, jnp.float32), ref32)
    _assert_same_params(load_converted(as_bf16, jnp.bfloat16), load_model(fp8_dir, jnp.bfloat16))
    gate = [dequantize_block_fp8(reader.get(f"model.layers.2.mlp.experts.{e}.{n}_proj.weight"),
                                 reader.get(f"model.layers.2.mlp.experts.{e}.{n}_proj.weight_scale_inv"),
                                 (BLOCK, BLOCK)) for e in range(16) for n in ("gate", "up")]
    want = np.stack(gate).reshape(16, 2, 32, 128)                     # [E, 2, F, D]: as published
    got = np.asarray(load_converted(keep, jnp.float32).layers[2].mlp.w_gate_up.get_value())
    assert got.tobytes() == want.astype(np.float32).tobytes()


def test_fp8_weights_load_as_block_fp8(fp8_dir, converted):
    """fp8_weights=True keeps the stored values and scales (lingjax.quant.Fp8Weight): dequantising
    them gives exactly the parameters a dequantising load gives; not-fp8-ready sources are errors."""
    from lingjax.checkpoint import ConvertedCheckpointError
    from lingjax.quant import Fp8Weight, fp8_weights
    keep = converted("fp8-keep", fp8_dir, "--dtype", "keep")
    q = load_converted(keep, jnp.float32, fp8_weights=True)
    w = q.layers[2].mlp.w_gate_up
    assert isinstance(w, Fp8Weight) and w.values.get_value().dtype == jnp.float8_e4m3fn and w.block == (BLOCK, BLOCK)
    deq = load_converted(keep, jnp.float32)
    for path, fw in fp8_weights(q):
        owner = deq
        for p in path:
            owner = owner[p] if isinstance(p, int) else getattr(owner, p)
        assert np.asarray(fw[...]).tobytes() == np.asarray(owner.get_value()).tobytes(), path
    stored = json.loads((keep / "manifest.json").read_text())["params"]
    held = [(i, n) for i, layer in enumerate(q.layers) for n in ("w_beta", "g_proj", "kv_b") if hasattr(layer.attn, n)]
    assert {n for _, n in held} == {"w_beta", "g_proj", "kv_b"}
    for i, n in held:      # stored fp8, held dequantised (param_layout.LING_DEQUANTISED_AT_LOAD)
        w = getattr(q.layers[i].attn, n)
        assert isinstance(w, nnx.Param) and w.get_value().dtype == jnp.float32
        assert np.asarray(w.get_value()).tobytes() == np.asarray(getattr(deq.layers[i].attn, n).get_value()).tobytes()
        assert stored[f"layers.{i}.attn.{n}"]["dtype"] == "float8_e4m3fn"
    assert np.array_equal(_logits(q), _logits(deq))
    with pytest.raises(ConvertedCheckpointError, match="not fp8-ready"):
        load_converted(converted("bf16", LING_TINY, "--dtype", "bf16"), fp8_weights=True)
    with pytest.raises(ConvertedCheckpointError, match="converted checkpoints only"):
        load_model(fp8_dir, fp8_weights=True)


def test_quantise_to_fp8(converted):
    """A float32 source with --dtype fp8 gets the published block format (amax/448 per block)."""
    out = converted("to-fp8", LING_TINY, "--dtype", "fp8", "--fp8-block", "16")
    m = json.loads((out / "manifest.json").read_text())
    assert m["params"]["layers.0.attn.w_in"]["fp8"]["block"] == [16, 16]
    assert m["params"]["embed"]["dtype"] == "bfloat16" and m["params"]["lm_head"]["dtype"] == "bfloat16"
    w = _tensors(LING_TINY)["model.layers.0.attention.o_proj.weight"]
    q, s = _quantize_reference(w, 16)
    want = dequantize_block_fp8(q, s, (16, 16)).reshape(128, 2, 64)       # w_out [D, H, K]: as published
    got = np.asarray(load_converted(out, jnp.float32).layers[0].attn.w_out.get_value())
    assert got.tobytes() == want.tobytes()


# ---- older format versions --------------------------------------------------------------------------
def _as_version_2(out: Path, dst: Path) -> Path:
    """A copy of a version-3 conversion written as version 2 did: every KDA w_beta and MLA g_proj
    stored [D, H] ([in, out], its fp8 matrix view with in and out swapped, the same scales)."""
    import orbax.checkpoint as ocp
    from checkpoints_convert.parts import save_part
    from lingjax.checkpoint import orbax_handler
    shutil.copytree(out, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["format_version"] = 2
    keys = [k for k in m["params"] if k.endswith((".w_beta", ".g_proj"))]
    assert {k.rsplit(".", 1)[1] for k in keys} == {"w_beta", "g_proj"}
    for key in keys:
        meta = m["params"][key]
        part = dst / "params" / meta["part"]
        names = [k for k, v in m["params"].items() if v["part"] == meta["part"]]
        names += [k + "_scale_inv" for k in names if "fp8" in m["params"][k]]
        arrays = orbax_handler().restore(part, args=ocp.args.PyTreeRestore(
            item={n: np.empty(0) for n in names},
            restore_args={n: ocp.RestoreArgs(restore_type=np.ndarray) for n in names}))
        arrays[key] = np.ascontiguousarray(arrays[key].T)
        meta["shape"] = list(arrays[key].shape)
        if "fp8" in meta:
            meta["fp8"] = {**meta["fp8"], "in": meta["fp8"]["out"], "out": meta["fp8"]["in"]}
        shutil.rmtree(part)
        m["parts"][meta["part"]] = save_part(part, arrays, {n: a.shape for n, a in arrays.items()})
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


@pytest.mark.parametrize("name,flags,fp8_weights", [("bf16", ("--dtype", "bf16"), False),
                                                    ("fp8-keep", ("--dtype", "keep"), False),
                                                    ("fp8-keep", ("--dtype", "keep"), True)])
def test_version_2_checkpoint_reads_gates_transposed(work, fp8_dir, converted, name, flags, fp8_weights):
    """Version 2 stored w_beta and g_proj [D, H]; it is still read (no reconversion), transposed on restore, so
    the model gets exactly the version-3 parameters, with and without a sharding for it. Version 1
    and unknown versions are refused."""
    import jax
    from lingjax.checkpoint import ConvertedCheckpointError
    out = converted(name, fp8_dir if "fp8" in name else LING_TINY, *flags)
    old = work / f"v2-{name}-{fp8_weights}"
    if not old.exists():
        _as_version_2(out, old)
    dtype = jnp.float32 if "fp8" in name else None
    new_model = load_converted(out, dtype, fp8_weights=fp8_weights)
    _assert_same_params(load_converted(old, dtype, fp8_weights=fp8_weights), new_model)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None))
    gates = [(int(k.split(".")[1]), k.rsplit(".", 1)[1]) for k in json.loads((old / "manifest.json").read_text())["params"]
             if k.startswith("layers.") and k.endswith((".w_beta", ".g_proj"))]
    paths = [("layers", i, "attn", name) for i, name in gates]     # held dequantised even with fp8 weights
    sharded = load_converted(old, dtype, fp8_weights=fp8_weights, shardings={p: sh for p in paths})
    for i, name in gates:
        assert getattr(sharded.layers[i].attn, name).get_value().sharding == sh
    _assert_same_params(sharded, new_model)
    for version in (1, 4):
        bad = work / f"v{version}-{name}-{fp8_weights}"
        if not bad.exists():
            shutil.copytree(old, bad)
            m = json.loads((bad / "manifest.json").read_text())
            (bad / "manifest.json").write_text(json.dumps(m | {"format_version": version}))
        with pytest.raises(ConvertedCheckpointError, match=f"format version {version} is not supported"):
            load_converted(bad, dtype)


# ---- DSpark draft ------------------------------------------------------------------------------------
def test_draft_with_model_prefix(work, capsys):
    tensors = {"model." + k: v for k, v in _tensors(DSPARK_TINY).items()}
    src = _write_hf(work / "draft-prefixed", tensors, _config(DSPARK_TINY))
    out = work / "out-draft"
    rc, err = _cli(capsys, src, out, "--draft", "--dtype", "keep")
    assert rc == 0, err
    assert "unexpected" not in err                                  # lm_head copy ignored silently
    draft = load_converted_draft(out, jnp.float32)
    _assert_same_params(draft, from_safetensors(DSPARK_TINY, dtype=jnp.float32))
    rc, err = _cli(capsys, src, work / "out-draft-2")                 # without --draft: a clear refusal
    assert rc == 1 and "--draft" in err


# ---- chunk shapes -----------------------------------------------------------------------------------
MIB = 1 << 20
FLASH_ARRAYS = [  # Ling-3.0-flash parameters: shape, logical axes
    ((5, 32, 128, 2560), (None, "heads", "head_dim", "embed")),      # KDA w_in
    ((2560, 32, 128), ("embed", "heads", "head_dim")),               # KDA w_out
    ((32, 2560), ("heads", "embed")),                                # w_beta (160 KiB in bf16)
    ((32,), ("heads",)),                                             # A_log
    ((512, 32, 256), (None, "heads", None)),                         # MLA kv_b
    ((512, 2, 768, 2560), ("experts", None, "mlp", "embed")),        # routed experts w_gate_up
    ((512, 2560, 768), ("experts", "embed", "mlp")),                 # routed experts w_down
    ((157184, 2560), ("vocab", "embed")),                            # embed
    ((2560, 157184), ("embed", "vocab")),                            # lm_head
    ((2560, 6144), ("embed", "mlp")),                                # dense w_down
]


def test_chunk_shapes_documented_examples():
    from checkpoints_convert.chunks import chunk_shape
    assert chunk_shape((5, 32, 128, 2560), 2, FLASH_ARRAYS[0][1], 64 * MIB) == (5, 4, 128, 2560)
    assert chunk_shape((512, 2, 768, 2560), 2, FLASH_ARRAYS[5][1], 64 * MIB) == (64, 2, 96, 2560)
    assert chunk_shape((157184, 2560), 2, ("vocab", "embed"), 64 * MIB) == (9824, 2560)
    assert chunk_shape((2560, 32), 2, ("embed", "heads"), 64 * MIB) == (2560, 32)    # small: read whole
    assert chunk_shape((32,), 4, ("heads",), 64 * MIB) == (32,)
    assert chunk_shape((512, 32, 256), 2, (None, "heads", None), 64 * MIB) == (512, 4, 256)  # 1 MiB slabs
    assert chunk_shape((5, 32, 128, 2560), 2, None, 64 * MIB) == (5, 32, 128, 1280)  # size only


@pytest.mark.parametrize("itemsize", [1, 2, 4])
@pytest.mark.parametrize("budget", [4 << 10, 1 * MIB, 64 * MIB])
def test_chunk_shapes_align_with_every_supported_shard(itemsize, budget):
    """Extents divide the array; a chunk fits the budget; every 2-, 4-, 8-way shard of the (first)
    sharded axis is whole chunks unless its slab of the array is under min(budget, 1 MiB)."""
    from checkpoints_convert.chunks import MIN_SPLIT_BYTES, SHARDED_AXES, chunk_shape
    for shape, logical in FLASH_ARRAYS + [((128, 5, 2, 64), ("embed", None, "heads", "head_dim")),
                                          ((16, 128, 2, 32), ("experts", "embed", None, "mlp"))]:
        chunk = chunk_shape(shape, itemsize, logical, budget)
        assert all(n % c == 0 for n, c in zip(shape, chunk)), (shape, chunk)
        assert math.prod(chunk) * itemsize <= budget, (shape, chunk)
        axis = next(a for name in SHARDED_AXES for a, n in enumerate(logical) if n == name)
        for m in (2, 4, 8):
            if shape[axis] % m == 0:
                aligned = (shape[axis] // m) % chunk[axis] == 0
                assert aligned or math.prod(shape) * itemsize // m < min(budget, MIN_SPLIT_BYTES), (shape, chunk, m)


def test_converted_arrays_have_the_planned_chunks(work):
    """Every stored array's zarr chunks are those chunks.py plans for it (heads cut per head at 4 KiB)."""
    from checkpoints_convert.build import plan_param, stored_chunks
    from checkpoints_convert.specs import ling_specs
    from lingjax.config import LingConfig
    out = work / "out-chunks"
    assert main([str(LING_TINY), str(out), "-q", "--dtype", "float32", "--chunk-size", "0.00390625"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["converter"]["chunk_rule"].startswith("sharded-axes")
    n = 0
    for spec in ling_specs(LingConfig.from_json(LING_TINY / "config.json"), with_mtp=True):
        meta = plan_param(spec, ["F32"], "float32", (128, 128))
        for key, chunk in stored_chunks(spec, meta, 4096).items():
            zarray = json.loads((out / "params" / manifest["params"][spec.key]["part"] / key / ".zarray").read_text())
            assert tuple(zarray["chunks"]) == chunk, key
            n += 1
    assert n == len(manifest["params"])
    w_in = json.loads(next(out.glob("params/*/layers.0.attn.w_in/.zarray")).read_text())
    assert w_in["shape"] == [5, 2, 64, 128] and w_in["chunks"][1] == 1


# ---- resume, atomicity, existing output ---------------------------------------------------------------
def _interrupt_after(monkeypatch, n: int, exc: BaseException):
    """Parts after the n-th fail mid-write: a half-written `<part>.tmp` is left behind, as a kill would."""
    real, calls = convert_mod.save_part, []

    def flaky(part_dir, *a, **kw):
        calls.append(1)
        if len(calls) > n:
            tmp = part_dir.with_name(part_dir.name + ".tmp")
            tmp.mkdir(parents=True, exist_ok=True)
            (tmp / "_METADATA").write_text("{half")
            raise exc
        return real(part_dir, *a, **kw)
    monkeypatch.setattr(convert_mod, "save_part", flaky)


def test_interrupted_conversion_resumes_byte_identical(work, converted, monkeypatch, capsys):
    out = work / "out-resumed"
    _interrupt_after(monkeypatch, 4, KeyboardInterrupt())
    rc, err = _cli(capsys, LING_TINY, out, "--dtype", "float32")
    assert rc == 130 and "resume" in err
    assert not out.exists() and out.with_name(out.name + ".partial").is_dir()
    monkeypatch.undo()
    # damage one finished part: the rerun must notice (checksum) and rewrite it
    victim = next(p for p in sorted((out.with_name(out.name + ".partial") / "params").rglob("*"))
                  if p.is_file() and p.parent.name.startswith("layers"))
    victim.write_bytes(b"garbage")
    rc, err = _cli(capsys, LING_TINY, out, "--dtype", "float32")
    assert rc == 0, err
    assert "resuming" in err and "fails its checksum" in err
    assert _tree_hashes(out) == _tree_hashes(converted("f32", LING_TINY, "--dtype", "float32"))
    assert not out.with_name(out.name + ".partial").exists()


def test_disk_full(work, converted, monkeypatch, capsys):
    out = work / "out-diskfull"
    _interrupt_after(monkeypatch, 2, OSError(errno.ENOSPC, "No space left on device", "x"))
    rc, err = _cli(capsys, LING_TINY, out, "--dtype", "float32")
    assert rc == 1 and err.startswith("error: no space left on device") and len(err.splitlines()) == 1
    assert not out.exists()
    monkeypatch.undo()
    assert _cli(capsys, LING_TINY, out, "--dtype", "float32")[0] == 0
    assert _tree_hashes(out) == _tree_hashes(converted("f32", LING_TINY, "--dtype", "float32"))


def test_existing_output(work, converted, capsys):
    out = work / "out-existing"
    shutil.copytree(converted("f32", LING_TINY, "--dtype", "float32"), out)
    rc, err = _cli(capsys, LING_TINY, out, "--dtype", "float32", "--verify")
    assert rc == 0 and "already holds this conversion" in err
    rc, err = _cli(capsys, LING_TINY, out, "--dtype", "bf16")
    assert rc == 1 and "different converted checkpoint" in err and "--force" in err
    assert json.loads((out / "manifest.json").read_text())["dtype"] == "float32"       # untouched
    rc, err = _cli(capsys, LING_TINY, out, "--dtype", "bf16", "--force")
    assert rc == 0 and json.loads((out / "manifest.json").read_text())["dtype"] == "bfloat16"
    other = work / "not-a-checkpoint"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    rc, err = _cli(capsys, LING_TINY, other, "--force")
    assert rc == 1 and "not a lingjax converted checkpoint" in err and (other / "notes.txt").exists()


# ---- bad input: one clear line, exit 1, no OUT_DIR ------------------------------------------------
def _broken(work: Path, name: str, mutate) -> Path:
    tensors, cfg = _tensors(LING_TINY), _config()
    mutate(tensors, cfg)
    return _write_hf(work / f"bad-{name}", tensors, cfg)


def _assert_refused(capsys, work, src, *expect, extra=()):
    out = work / f"out-{src.name}"
    rc, err = _cli(capsys, src, out, *extra)
    assert rc == 1, err
    assert err.startswith("error: ") and "Traceback" not in err
    for e in expect:
        assert e in err, err
    assert not out.exists() and not is_converted_checkpoint(out)
    return err


def test_missing_shard(work, capsys):
    src = _write_hf(work / "bad-missing-shard", _tensors(LING_TINY), _config(), shards=3)
    (src / "model-00002-of-00003.safetensors").unlink()
    _assert_refused(capsys, work, src, "missing shard", "model-00002-of-00003.safetensors")


def test_truncated_shard(work, capsys):
    src = _write_hf(work / "bad-truncated", _tensors(LING_TINY), _config())
    with open(src / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(src / "model.safetensors") - 1000)
    _assert_refused(capsys, work, src, "truncated")


def test_missing_tensor(work, capsys):
    src = _broken(work, "missing-tensor", lambda t, c: t.pop("model.layers.3.attention.kv_b_proj.weight"))
    _assert_refused(capsys, work, src, "missing tensor model.layers.3.attention.kv_b_proj.weight")


def test_wrong_shape_lists_every_problem(work, capsys):
    def mutate(t, c):
        t["model.layers.0.attention.q_proj.weight"] = t["model.layers.0.attention.q_proj.weight"][:64]
        t["model.norm.weight"] = np.ones(7, np.float32)
    src = _broken(work, "wrong-shape", mutate)
    err = _assert_refused(capsys, work, src, "2 problem(s)", "model.layers.0.attention.q_proj.weight has shape [64, 128], "
                          "expected [128, 128]", "model.norm.weight has shape [7]")
    assert len(err.splitlines()) == 3                                 # summary + one line per problem


def test_wrong_dtype(work, capsys):
    def mutate(t, c):
        t["model.layers.1.mlp.down_proj.weight"] = t["model.layers.1.mlp.down_proj.weight"].astype(np.int32)
    _assert_refused(capsys, work, _broken(work, "wrong-dtype", mutate), "model.layers.1.mlp.down_proj.weight has dtype I32")


def test_unknown_architecture(work, capsys):
    src = _broken(work, "arch", lambda t, c: c.update(architectures=["LlamaForCausalLM"], model_type="llama"))
    _assert_refused(capsys, work, src, "LlamaForCausalLM", "BailingMoeV3ForCausalLM")
    src = _broken(work, "ling2", lambda t, c: c.pop("short_conv_kernel_size"))
    _assert_refused(capsys, work, src, "Ling 2.5/2.6")


def test_unexpected_tensor_is_a_warning(work, capsys):
    src = _broken(work, "unexpected", lambda t, c: t.update({"model.extra.weight": np.ones(3, np.float32)}))
    out = work / "out-unexpected"
    rc, err = _cli(capsys, src, out, "--dtype", "float32")
    assert rc == 0 and "warning: 1 unexpected tensor(s) not converted: model.extra.weight" in err


def test_usage_errors(work, capsys):
    assert main([str(LING_TINY), str(work / "x"), "--dtype", "int4"]) == 2
    assert main([str(LING_TINY)]) == 2
    assert main([str(LING_TINY), str(work / "x"), "--fp8-block", "abc"]) == 2
    assert not (work / "x").exists()


def test_cli_subprocess(work):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    r = subprocess.run([sys.executable, "-m", "checkpoints_convert", str(work / "nope"), str(work / "o")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"error: {work / 'nope'} is not a directory"]
    r = subprocess.run([sys.executable, "-m", "checkpoints_convert", "--help"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0 and "--dtype" in r.stdout and "--fp8-block" in r.stdout
