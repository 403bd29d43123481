"""Save / load the embedded default model (target + DSpark draft + byte-level tokenizer).

Directory layout (written by `python -m lingjax.embedded.train --out DIR`):

    target.safetensors   LingModel parameters, flat: key = '.'-joined nnx state path
                         (e.g. 'layers.2.attn.kv_b'), in the model's own layout
    draft.safetensors    DSparkDraft parameters, same convention
    target_config.json   LingConfig.to_dict()
    draft_config.json    DSparkConfig.to_dict()
    tokenizer.json       the byte-level tokenizer (HF `tokenizers` format)
    train_log.json       how the weights were made (command, seed, steps, losses, versions)

Tensors are stored in the dtype each parameter has in a bfloat16 model: bfloat16, except the few
parameters the model keeps in float32 (KDA A_log / dt_bias, MoE expert_bias).
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lingjax.config import LingConfig
from lingjax.dspark_config import DSparkConfig
from lingjax.model.dspark import DSparkDraft
from lingjax.model.ling import LingModel
from lingjax.safetensors_io import SafetensorsFile, write_safetensors
from lingjax.tokenizer import Tokenizer, build_byte_level_tokenizer, load_tokenizer

DEFAULT_DIR = Path(__file__).resolve().parent / "weights"
TARGET_FILE, DRAFT_FILE = "target.safetensors", "draft.safetensors"
TARGET_CONFIG, DRAFT_CONFIG = "target_config.json", "draft_config.json"
TOKENIZER_FILE, TRAIN_LOG = "tokenizer.json", "train_log.json"
# v3: KDA projections (w_beta included), MLA's g_proj, MLP and expert weights in the published
# K-minor orientation (lingjax/param_layout.py); v2 files had w_beta and g_proj [D, H], v1 files
# every matrix [in, out], and both are refused (the shapes alone cannot tell when F == D or H == D).
# The committed v2 weights became v3 by transposing each w_beta and g_proj (the same trained values).
FORMAT = "lingjax-embedded-v3"


class EmbeddedModelMissing(FileNotFoundError):
    """The embedded weights have not been trained / committed (or the directory is incomplete)."""


def _build(kind: str, cfg, dtype, abstract: bool = True):
    make = (lambda: LingModel(cfg, dtype=dtype, rngs=nnx.Rngs(0))) if kind == "target" else \
           (lambda: DSparkDraft(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    return nnx.eval_shape(make) if abstract else make()


def _key(path) -> str:
    return ".".join(str(p) for p in path)


def model_tensors(model, kind: str) -> dict[str, np.ndarray]:
    """Flat {key: numpy array} of a model, each cast to its dtype in a bfloat16 build."""
    ref = dict((_key(p), v) for p, v in nnx.to_flat_state(nnx.state(_build(kind, model.cfg, jnp.bfloat16))))
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        k = _key(path)
        dt = ref[k].get_value().dtype
        out[k] = np.asarray(jnp.asarray(var.get_value()).astype(dt))
    return out


def fill_model(kind: str, cfg, tensors, dtype, what: str):
    """Build the model abstractly and fill every parameter from `tensors` (name -> array)."""
    model = _build(kind, cfg, dtype)
    graphdef, state = nnx.split(model)
    flat = nnx.to_flat_state(state)
    names = set(tensors.keys())
    for path, var in flat:
        k = _key(path)
        if k not in names:
            raise ValueError(f"{what}: missing tensor {k!r} (does the config match the weights?)")
        arr = np.asarray(tensors[k])
        want = var.get_value()
        if tuple(arr.shape) != tuple(want.shape):
            raise ValueError(f"{what}: tensor {k!r} has shape {arr.shape}, the config needs {want.shape}")
        var.set_value(jnp.asarray(arr, dtype=want.dtype))
        names.discard(k)
    if names:
        raise ValueError(f"{what}: unexpected tensors {sorted(names)[:8]}")
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def byte_tokenizer() -> Tokenizer:
    from lingjax.embedded.config import EOT_ID
    return Tokenizer(build_byte_level_tokenizer(), eos_token_ids=(EOT_ID,))


def save_embedded(directory: str | Path, target: LingModel, draft: DSparkDraft | None,
                  tokenizer: Tokenizer | None = None, train_log: dict | None = None) -> Path:
    """Write the layout above (draft files only when `draft` is given)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT}
    write_safetensors(d / TARGET_FILE, model_tensors(target, "target"), metadata=meta)
    (d / TARGET_CONFIG).write_text(json.dumps(target.cfg.to_dict(), indent=1) + "\n")
    if draft is not None:
        write_safetensors(d / DRAFT_FILE, model_tensors(draft, "draft"), metadata=meta)
        (d / DRAFT_CONFIG).write_text(json.dumps(draft.cfg.to_dict(), indent=1) + "\n")
    (tokenizer or byte_tokenizer()).hf.save(str(d / TOKENIZER_FILE))
    if train_log is not None:
        (d / TRAIN_LOG).write_text(json.dumps(train_log, indent=1) + "\n")
    return d


def _read(path: Path) -> dict[str, np.ndarray]:
    f = SafetensorsFile(path)
    if f.metadata.get("format") != FORMAT:
        raise ValueError(f"{path}: format {f.metadata.get('format')!r} is not {FORMAT!r} (weights written by "
                         "another lingjax version); retrain with `python -m lingjax.embedded.train --out DIR`")
    return {k: f.get(k) for k in f.keys()}


def load_target(directory: str | Path, dtype=jnp.bfloat16) -> LingModel:
    d = Path(directory)
    cfg = LingConfig.from_json(d / TARGET_CONFIG)
    return fill_model("target", cfg, _read(d / TARGET_FILE), dtype, f"{d / TARGET_FILE}")


def load_embedded(dtype=jnp.bfloat16, directory: str | Path | None = None
                  ) -> tuple[LingModel, DSparkDraft, Tokenizer]:
    """(target, draft, tokenizer) of the embedded model; default directory lingjax/embedded/weights/."""
    d = Path(directory) if directory is not None else DEFAULT_DIR
    needed = (TARGET_FILE, DRAFT_FILE, TARGET_CONFIG, DRAFT_CONFIG, TOKENIZER_FILE)
    missing = [n for n in needed if not (d / n).is_file()]
    if missing:
        raise EmbeddedModelMissing(
            f"the embedded model is not in {d} (missing: {', '.join(missing)}). Train it with "
            f"`python -m lingjax.embedded.train --out {d}` (about 8 minutes on one H200; "
            "see lingjax/embedded/train.py), or pass --checkpoint to use another model.")
    target = load_target(d, dtype)
    dcfg = DSparkConfig.from_json(d / DRAFT_CONFIG)
    dcfg.check_fits_target(target.cfg.hidden_size, target.cfg.num_hidden_layers, target.cfg.vocab_size)
    draft = fill_model("draft", dcfg, _read(d / DRAFT_FILE), dtype, f"{d / DRAFT_FILE}")
    return target, draft, load_tokenizer(d)


def param_count(model) -> int:
    return int(sum(x.size for x in jax.tree.leaves(nnx.state(model))))
