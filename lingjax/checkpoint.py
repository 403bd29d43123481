"""Load checkpoints written by `python -m checkpoints_convert` (and dispatch HF vs converted dirs).

Layout of a converted checkpoint directory (format `lingjax-converted`, version 3):

    manifest.json     format, kind ('ling' | 'dspark'), dtype policy, source, every parameter
                      (path, shape, stored dtype, part, fp8 layout) and every part's checksum
    config.json       the source config.json, verbatim
    tokenizer files   tokenizer.json, tokenizer_config.json, chat_template.jinja, ... (if present)
    params/<part>/    one orbax PyTree checkpoint per part (zarr v2, uncompressed, no OCDBT):
                      a part holds consecutive parameters of one layer (or of the top level),
                      keyed by the dotted parameter path, e.g. `layers.3.attn.kv_b`

Arrays are stored in the model's own layout (`lingjax.weights.plan_for`: fused, stacked; [in, out]
for the MLA projections, lm_head, router and eh_proj, the published [out, in] for KDA, MLP and
expert weights and MLA's per-head gate g_proj; version 1 had every matrix [in, out] and is
refused: reconvert; version 2 stored KDA's w_beta and MLA's g_proj [in, out] and is read, those
two small matrices transposed on restore: `LEGACY_TRANSPOSED`) and chunked along
the axes the partition rules shard (`checkpoints_convert/chunks.py`: a 1-, 2-, 4- or 8-way shard of
any array over 1 MiB per shard starts and ends on chunk boundaries), so a restore with target
shardings reads only each device's shard. The reader takes any chunking (it is in each array's zarr
metadata): checkpoints written with other chunk shapes restore the same values, each device reading
the whole chunks its shard touches.

FP8 parameters store `key` (float8_e4m3fn values, same shape as the parameter) and
`key_scale_inv` (float32). The scales follow the parameter's *matrix view*, recorded in the
manifest as `fp8 = {stack, in, out, block}` (axis lists of the stored array): permute the values to
(stack axes, in axes, out axes) and flatten to [*stack_dims, IN, OUT]; `scale_inv` is
[*stack_dims, ceil(IN/block[0]), ceil(OUT/block[1])] and multiplies each block of that view. Each
[IN, OUT] matrix is one published [out, in] weight transposed, so its scales are the published
`weight_scale_inv` transposed (also for the K-minor weights, whose values are not). Loading
dequantises (float32 product, then a cast) to the requested dtype, or, with `fp8_weights=True`,
keeps values and scales as the model's block-fp8 weights (`lingjax.quant.Fp8Weight`, which uses
the same matrix view).
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

FORMAT = "lingjax-converted"
FORMAT_VERSION = 3
READABLE_VERSIONS = (2, 3)
# Parameters (by leaf name) that an older format version stored transposed: {version: names}.
# Version 2 stored KDA's w_beta and MLA's g_proj [D, H] ([in, out]); version 3 keeps the published
# [H, D] (K-minor), which makes a decode step's per-head gate one row reduction
# (lingjax.model.common.head_gate).
LEGACY_TRANSPOSED = {2: frozenset({"w_beta", "g_proj"})}
MANIFEST = "manifest.json"
PARAMS_DIR = "params"
SCALE_SUFFIX = "_scale_inv"


class ConvertedCheckpointError(ValueError):
    """A converted checkpoint that is missing, incomplete, of another version or another model."""


# ---- format helpers (shared with the converter) -------------------------------------------------
def param_key(path: tuple) -> str:
    """('layers', 3, 'attn', 'kv_b') -> 'layers.3.attn.kv_b' (the orbax tree key)."""
    return ".".join(str(p) for p in path)


def orbax_handler(type_handler_registry=None):
    """The orbax handler both the writer and the reader use (zarr v2 without OCDBT or compression:
    deterministic file names and bytes, chunks a sharded restore can read independently)."""
    import orbax.checkpoint as ocp
    kw = {"type_handler_registry": type_handler_registry} if type_handler_registry is not None else {}
    return ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=False, use_compression=False, **kw)


def hash_dir(directory: str | Path) -> dict[str, Any]:
    """Deterministic checksum of every file under `directory`: sha256 over sorted
    `relative/path <NUL> sha256(file)` lines (files hashed in parallel threads; hashlib releases
    the GIL). Returns {'sha256', 'bytes', 'files'}."""
    from concurrent.futures import ThreadPoolExecutor
    directory = Path(directory)
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(hash_file, files))
    outer = hashlib.sha256()
    for f, (digest, _) in zip(files, digests):
        outer.update(f"{f.relative_to(directory).as_posix()}\0{digest}\n".encode())
    return {"sha256": outer.hexdigest(), "bytes": sum(n for _, n in digests), "files": len(files)}


def hash_file(path: Path) -> tuple[str, int]:
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


def read_manifest(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise ConvertedCheckpointError(f"{directory} is not a converted checkpoint (no {MANIFEST})")
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConvertedCheckpointError(f"{path} is corrupt ({e})") from e
    if m.get("format") != FORMAT:
        raise ConvertedCheckpointError(f"{path}: format {m.get('format')!r} is not {FORMAT!r}")
    if m.get("format_version") not in READABLE_VERSIONS:
        raise ConvertedCheckpointError(f"{path}: format version {m.get('format_version')} is not supported "
                                       f"(this lingjax reads versions {', '.join(map(str, READABLE_VERSIONS))}); "
                                       "reconvert the checkpoint")
    return m


def is_converted_checkpoint(directory: str | Path) -> bool:
    """True for a complete converted checkpoint (its manifest is written last, just before the
    atomic rename, so a partial conversion never qualifies)."""
    try:
        read_manifest(directory)
        return True
    except ConvertedCheckpointError:
        return False


def dequantize_fp8(values, scale_inv, fp8: Mapping[str, Any], dtype, xp=jnp):
    """Stored fp8 `values` + `scale_inv` (matrix view `fp8`, see the module docstring) -> `dtype`.
    The product is taken in float32, as the published `w = w_fp8 * scale_inv` reference does.
    xp: jax.numpy (traceable, keeps shardings under jit) or numpy (host, no compilation)."""
    stack, in_, out = tuple(fp8["stack"]), tuple(fp8["in"]), tuple(fp8["out"])
    b_in, b_out = fp8["block"]
    shape = values.shape
    perm = stack + in_ + out
    s_dims = [shape[a] for a in stack]
    n_in = math.prod(shape[a] for a in in_)
    n_out = math.prod(shape[a] for a in out)
    v = xp.transpose(values, perm).astype(np.float32).reshape(*s_dims, n_in, n_out)
    s = xp.repeat(xp.repeat(scale_inv.astype(np.float32), b_in, axis=-2), b_out, axis=-1)
    w = v * s[..., :n_in, :n_out]
    w = w.reshape([shape[a] for a in perm])
    return xp.transpose(w, tuple(int(i) for i in np.argsort(perm))).astype(dtype)


# ---- restore --------------------------------------------------------------------------------------
def _replicated_like(sharding):
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return sharding


@functools.lru_cache(maxsize=None)
def _dequant_fn(view: tuple, dtype, sharding):
    stack, in_, out, block = view
    fp8 = {"stack": stack, "in": in_, "out": out, "block": block}
    return jax.jit(lambda v, s: dequantize_fp8(v, s, fp8, dtype), out_shardings=sharding)


def _restore_part(part_dir: Path, entries: dict[str, tuple[tuple, Any, Any]]) -> dict[str, Any]:
    """entries: key -> (shape, dtype, sharding or None). With a sharding the array is read as a
    jax.Array with that sharding (each device reads its shard; orbax casts to `dtype`); with None
    as a host numpy array in the stored dtype."""
    import orbax.checkpoint as ocp
    item, args = {}, {}
    for k, (shape, dtype, sh) in entries.items():
        if sh is None:
            item[k], args[k] = np.empty(0), ocp.RestoreArgs(restore_type=np.ndarray)
        else:
            item[k] = jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sh)
            args[k] = ocp.ArrayRestoreArgs(sharding=sh, global_shape=tuple(shape), dtype=jnp.dtype(dtype))
    return orbax_handler().restore(part_dir, args=ocp.args.PyTreeRestore(item=item, restore_args=args,
                                                                        partial_restore=True))


def _fill(abstract: nnx.Module, directory: Path, manifest: dict, shardings) -> nnx.Module:
    """Restore every manifest parameter into the abstract module's variables, part by part.

    A parameter with a sharding in `shardings` is read shard-wise onto its devices (fp8:
    dequantised there under jit). Any other one is read on the host and converted with numpy,
    then placed like the direct HF loader does (`jnp.asarray`), so both give identical arrays.
    An older version's transposed matrix (`LEGACY_TRANSPOSED`) is read on the host, transposed and
    then placed (with its sharding, if it has one). A model with block-fp8 weights
    (`lingjax.quant.Fp8Weight`: variables `<key>.values` and `<key>.scale_inv`) gets the stored fp8
    values and scales as they are.
    """
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    by_key = {param_key(p): p for p in flat}
    fp8_keys = {k[: -len(".values")] for k in by_key if k.endswith(".values")}
    model_keys = (set(by_key) - {f"{k}.values" for k in fp8_keys} - {f"{k}.scale_inv" for k in fp8_keys}) | fp8_keys
    params = manifest["params"]
    missing = sorted(model_keys - set(params))
    extra = sorted(set(params) - model_keys)
    if missing or extra:
        raise ConvertedCheckpointError(
            f"{directory}: checkpoint does not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
    not_fp8 = sorted(k for k in fp8_keys if "fp8" not in params[k])
    if not_fp8:
        raise ConvertedCheckpointError(
            f"{directory}: not fp8-ready: {len(not_fp8)} matrices (e.g. {not_fp8[0]}) are stored as "
            f"{params[not_fp8[0]]['dtype']}; convert with `python -m checkpoints_convert ... --dtype fp8` (or "
            f"`--dtype keep` from the published FP8 checkpoint) to run fp8 weights")
    parts: dict[str, list[str]] = {}
    for key, meta in params.items():
        parts.setdefault(meta["part"], []).append(key)
    transposed = LEGACY_TRANSPOSED.get(manifest["format_version"], frozenset())
    for part, keys in parts.items():
        entries, targets, legacy = {}, {}, set()
        for key in keys:
            meta = params[key]
            keep_fp8 = key in fp8_keys
            path = by_key[f"{key}.values" if keep_fp8 else key]
            want = flat[path].get_value()
            stored_shape = tuple(want.shape)
            if key.rsplit(".", 1)[-1] in transposed:     # read on the host, transposed below
                stored_shape = stored_shape[::-1]
                legacy.add(key)
            if tuple(meta["shape"]) != stored_shape:
                raise ConvertedCheckpointError(f"{directory}: {key} has shape {tuple(meta['shape'])}, the model "
                                               f"expects {stored_shape} (converted for another config?)")
            sh = None if key in legacy else (shardings or {}).get(path)
            targets[key] = (sh, want.dtype)
            fp8 = meta.get("fp8")
            entries[key] = (meta["shape"], meta["dtype"] if fp8 else want.dtype, sh)
            if fp8:
                scale_sh = (shardings or {}).get(by_key[f"{key}.scale_inv"]) if keep_fp8 and sh is not None else None
                if scale_sh is None and sh is not None:
                    scale_sh = _replicated_like(sh)
                entries[key + SCALE_SUFFIX] = (fp8["scale_shape"], "float32", scale_sh)
        arrays = _restore_part(directory / PARAMS_DIR / part, entries)
        for key in keys:
            sh, dtype = targets[key]
            arr, fp8 = arrays.pop(key), params[key].get("fp8")
            if key in legacy:       # an older version's [in, out] matrix: the same matrix, transposed
                arr = np.ascontiguousarray(np.asarray(arr).T)
                if fp8:             # (its scales follow the matrix view, which swaps in and out)
                    fp8 = {**fp8, "in": fp8["out"], "out": fp8["in"]}
            if key in fp8_keys:
                _check_fp8_view(directory, key, fp8, abstract)
                scale = arrays.pop(key + SCALE_SUFFIX)
                for leaf, a in (("values", arr), ("scale_inv", scale)):
                    v = flat[by_key[f"{key}.{leaf}"]]
                    v.set_value(a if isinstance(a, jax.Array)
                                else _place(np.asarray(a).astype(v.get_value().dtype), shardings, by_key[f"{key}.{leaf}"]))
                continue
            if fp8:
                scale = arrays.pop(key + SCALE_SUFFIX)
                if sh is None:
                    arr = dequantize_fp8(arr, scale, fp8, dtype, xp=np)
                else:
                    view = (tuple(fp8["stack"]), tuple(fp8["in"]), tuple(fp8["out"]), tuple(fp8["block"]))
                    arr = _dequant_fn(view, jnp.dtype(dtype), sh)(arr, scale)
            if sh is None:
                arr = _place(np.asarray(arr).astype(dtype, copy=False), shardings, by_key[key])
            flat[by_key[key]].set_value(arr)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _place(host: np.ndarray, shardings, path) -> jax.Array:
    """A host array on the device(s): with its sharding when `shardings` has one for `path` (a
    parameter read on the host although sharded: an older version's transposed matrix), else as
    `jnp.asarray` places it (the direct HF loader's placement)."""
    sh = (shardings or {}).get(path)
    return jnp.asarray(host) if sh is None else jax.device_put(host, sh)


def _check_fp8_view(directory, key: str, fp8: Mapping[str, Any], abstract) -> None:
    """The stored matrix view and block must be the ones the model's Fp8Weight dequantises with."""
    owner = abstract
    for p in key.split("."):
        owner = owner[int(p)] if p.isdigit() else getattr(owner, p)
    stored = (tuple(fp8["stack"]), tuple(fp8["in"]), tuple(fp8["out"]), tuple(fp8["block"]))
    model = (owner.view.stack, owner.view.in_, owner.view.out, owner.block)
    if stored != model:
        raise ConvertedCheckpointError(f"{directory}: {key} is stored with fp8 view/block {stored}, the model "
                                       f"uses {model}")


def _open(directory, kind: str) -> tuple[Path, dict]:
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest.get("kind") != kind:
        raise ConvertedCheckpointError(f"{directory} holds a converted {manifest.get('kind')!r} checkpoint, "
                                       f"not {kind!r}")
    return directory, manifest


def load_converted(directory, dtype=None, *, shardings: Mapping[tuple, Any] | None = None,
                   fp8_weights: bool = False):
    """LingModel from a converted checkpoint, restored into an `nnx.eval_shape` abstract model.

    dtype: model (compute) dtype (default: the manifest's `default_dtype`). shardings: optional
    {param path tuple: jax.sharding.Sharding}; each array is restored directly with that sharding
    (each device reads only its shard). fp8 parameters are dequantised to `dtype` on load, unless
    fp8_weights: then the model keeps them as block fp8 (`lingjax.quant`), and a checkpoint that
    is not fp8-ready is an error. Shardings for an fp8 model come from `abstract_model(...)`.
    """
    directory, manifest = _open(directory, "ling")
    abstract = abstract_model(directory, dtype, fp8_weights=fp8_weights, manifest=manifest)
    return _fill(abstract, directory, manifest, shardings)


def abstract_model(directory, dtype=None, *, fp8_weights: bool = False, manifest: dict | None = None):
    """The `nnx.eval_shape` LingModel a converted checkpoint restores into (for computing shardings)."""
    from lingjax.config import LingConfig
    from lingjax.model.ling import LingModel
    from lingjax.quant import quantize_model
    directory = Path(directory)
    manifest = manifest or read_manifest(directory)
    cfg = LingConfig.from_json(directory / "config.json")
    dtype = jnp.dtype(manifest["default_dtype"] if dtype is None else dtype)
    if dtype.itemsize == 1:       # a 1-byte dtype names the weights; the compute dtype is then bf16
        dtype = jnp.dtype(jnp.bfloat16)
    block = tuple(manifest.get("fp8_block") or (128, 128))

    def build():
        m = LingModel(cfg, dtype=dtype, with_mtp=manifest["with_mtp"])
        return quantize_model(m, block) if fp8_weights else m
    return nnx.eval_shape(build)


def load_converted_draft(directory, dtype=None, *, shardings: Mapping[tuple, Any] | None = None):
    """DSparkDraft from a converted draft checkpoint (`--draft`); same arguments as load_converted."""
    from lingjax.dspark_config import DSparkConfig
    from lingjax.model.dspark import DSparkDraft
    directory, manifest = _open(directory, "dspark")
    cfg = DSparkConfig.from_json(directory / "config.json")
    dtype = jnp.dtype(manifest["default_dtype"] if dtype is None else dtype)
    abstract = nnx.eval_shape(lambda: DSparkDraft(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    return _fill(abstract, directory, manifest, shardings)


def load_model(directory, dtype=None, *, shardings: Mapping[tuple, Any] | None = None, with_mtp: bool | None = None,
               fp8_weights: bool = False):
    """LingModel from either a converted checkpoint or a Hugging Face checkpoint directory.

    HF directories default to bfloat16 and read the fp8 block size from the config's
    `quantization_config.weight_block_size` (default 128x128); `with_mtp` applies to HF directories
    only (a converted checkpoint has the MTP layer iff it was converted with one). fp8_weights
    (block-fp8 weight-only inference) needs a converted fp8 checkpoint.
    """
    if is_converted_checkpoint(directory):
        return load_converted(directory, dtype, shardings=shardings, fp8_weights=fp8_weights)
    if fp8_weights:
        raise ConvertedCheckpointError(
            f"{directory}: fp8 weights are loaded from converted checkpoints only: run "
            f"`python -m checkpoints_convert {directory} OUT --dtype keep` (published FP8 checkpoint) or "
            f"`--dtype fp8`, then use OUT")
    from lingjax.config import LingConfig
    from lingjax.model.ling import LingModel
    from lingjax.safetensors_io import CheckpointReader
    from lingjax.weights import load_hf_params
    directory = Path(directory)
    raw = json.loads((directory / "config.json").read_text())
    cfg = LingConfig.from_dict(raw)
    block = (raw.get("quantization_config") or {}).get("weight_block_size") or (128, 128)
    reader = CheckpointReader(directory)
    if with_mtp is None:
        with_mtp = (cfg.num_nextn_predict_layers > 0
                    and f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight" in reader)
    dtype = jnp.dtype(jnp.bfloat16 if dtype is None else dtype)
    abstract = nnx.eval_shape(lambda: LingModel(cfg, dtype=dtype, with_mtp=with_mtp))
    return load_hf_params(abstract, reader, shardings=shardings, fp8_block=tuple(block))
