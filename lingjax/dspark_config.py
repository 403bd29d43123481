"""Configuration of the DSpark draft model (a Qwen3-style block drafter fed with target taps).

The draft's `config.json` carries the usual Qwen3 fields plus the DSpark ones (`block_size`,
`mask_token_id`, `target_layer_ids`, `num_target_layers`, `markov_rank`, `markov_head_type`,
`enable_confidence_head`, `confidence_head_with_markov`). Published checkpoints may put the DSpark
keys at the top level or nest them under `dspark_config` (or the older `dflash_config`); both are
accepted, nested values win over top-level ones. See spec/dspark.md.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

from lingjax.config import read_config_json

# How the draft's projections are held (load_engine(draft_dtype=), the CLIs' --draft-dtype):
# bf16 as loaded, or fp8 = block fp8 (lingjax.model.dspark.quantize_draft).
DRAFT_DTYPES = ("bf16", "fp8")

# Keys that may sit in a nested `dspark_config` / `dflash_config` dict.
_NESTED_KEYS = ("dspark_config", "dflash_config")
_MARKOV_TYPES = ("vanilla",)


class DSparkConfigError(ValueError):
    """A draft config.json we cannot run, or a draft that does not fit the target."""


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    # ---- Qwen3 backbone ---------------------------------------------------------------------
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 131072
    attention_bias: bool = False
    # ---- DSpark -----------------------------------------------------------------------------
    block_size: int = 8
    mask_token_id: int = 0
    target_layer_ids: tuple[int, ...] = (1, 11, 23, 29, 35)
    num_target_layers: int | None = None
    markov_rank: int = 0
    markov_head_type: str | None = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False

    # ---- derived ----------------------------------------------------------------------------
    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def tap_dim(self) -> int:
        """Width of the concatenated target taps fed to `fc` (num_taps x hidden_size)."""
        return self.num_taps * self.hidden_size

    @property
    def has_markov(self) -> bool:
        return self.markov_rank > 0

    @property
    def confidence_in_dim(self) -> int:
        extra = self.markov_rank if (self.confidence_head_with_markov and self.has_markov) else 0
        return self.hidden_size + extra

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DSparkConfig":
        flat: dict[str, Any] = dict(d)
        for key in _NESTED_KEYS:
            nested = d.get(key)
            if nested is None:
                continue
            if not isinstance(nested, Mapping):
                raise DSparkConfigError(f"{key} must be a dict, got {type(nested).__name__}")
            flat.update(nested)
        if "head_dim" not in flat and flat.get("hidden_size") and flat.get("num_attention_heads"):
            flat["head_dim"] = int(flat["hidden_size"]) // int(flat["num_attention_heads"])
        if flat.get("num_key_value_heads") is None and flat.get("num_attention_heads") is not None:
            flat["num_key_value_heads"] = flat["num_attention_heads"]
        names = {f.name for f in dataclasses.fields(cls)}
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        missing = [n for n in required if flat.get(n) is None]
        if missing:
            raise DSparkConfigError(f"draft config is missing required field(s): {', '.join(missing)}")
        kw = {k: v for k, v in flat.items() if k in names and v is not None}
        if "target_layer_ids" in kw:
            kw["target_layer_ids"] = tuple(int(x) for x in kw["target_layer_ids"])
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings",
                  "block_size", "mask_token_id", "markov_rank", "num_target_layers"):
            if k in kw:
                kw[k] = int(kw[k])
        for k in ("rms_norm_eps", "rope_theta"):
            if k in kw:
                kw[k] = float(kw[k])
        for k in ("attention_bias", "enable_confidence_head", "confidence_head_with_markov"):
            if k in kw:
                kw[k] = bool(kw[k])
        if kw.get("markov_rank", 0) == 0 and "markov_head_type" not in kw:
            kw["markov_head_type"] = None
        rs = flat.get("rope_scaling")
        if rs and rs.get("rope_type", rs.get("type")) not in (None, "default"):
            raise DSparkConfigError(f"draft rope_scaling {rs!r} is not supported (plain RoPE only)")
        act = flat.get("hidden_act", "silu")
        if act != "silu":
            raise DSparkConfigError(f"draft hidden_act={act!r}: only 'silu' (SwiGLU) is supported")
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> "DSparkConfig":
        return cls.from_dict(read_config_json(path, DSparkConfigError, "draft config.json"))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        d["architectures"] = ["LingDSparkModel"]
        d["model_type"] = "qwen3"
        d["hidden_act"] = "silu"
        return d

    def replace(self, **kw) -> "DSparkConfig":
        cfg = dataclasses.replace(self, **kw)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def need(cond: bool, msg: str):
            if not cond:
                raise DSparkConfigError(msg)

        need(self.hidden_size > 0 and self.num_hidden_layers > 0 and self.intermediate_size > 0,
             "hidden_size, num_hidden_layers and intermediate_size must be positive")
        need(self.num_attention_heads > 0 and self.num_key_value_heads > 0,
             "num_attention_heads and num_key_value_heads must be positive")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_attention_heads {self.num_attention_heads} is not a multiple of "
             f"num_key_value_heads {self.num_key_value_heads}")
        need(self.head_dim > 0 and self.head_dim % 2 == 0, f"head_dim {self.head_dim} must be even")
        need(not self.attention_bias, "attention_bias=true is not supported (DSpark drafts have no q/k/v/o bias)")
        need(self.block_size >= 1, f"block_size {self.block_size} must be >= 1")
        need(0 <= self.mask_token_id < self.vocab_size,
             f"mask_token_id {self.mask_token_id} outside the vocabulary (0..{self.vocab_size - 1})")
        need(len(self.target_layer_ids) > 0, "target_layer_ids must not be empty")
        ids = list(self.target_layer_ids)
        need(all(i >= -1 for i in ids),
             f"target_layer_ids {ids}: ids must be >= -1 (-1 = the target's embedding output)")
        need(all(a < b for a, b in zip(ids, ids[1:])), f"target_layer_ids {ids} must be strictly increasing")
        if self.num_target_layers is not None:
            need(max(ids) < self.num_target_layers,
                 f"target_layer_ids {ids} out of range for num_target_layers={self.num_target_layers}")
        need(self.markov_rank >= 0, f"markov_rank {self.markov_rank} must be >= 0")
        if self.markov_rank > 0:
            need(self.markov_head_type in _MARKOV_TYPES,
                 f"markov_head_type={self.markov_head_type!r} is not supported; "
                 f"only {', '.join(map(repr, _MARKOV_TYPES))} is implemented")
        if self.enable_confidence_head and self.confidence_head_with_markov:
            need(self.markov_rank > 0, "confidence_head_with_markov=true needs a Markov head (markov_rank > 0)")

    def check_fits_target(self, target_hidden_size: int, target_num_layers: int, vocab_size: int) -> None:
        """Raise DSparkConfigError (a ValueError) unless this draft can run on the given target."""
        problems = []
        if self.hidden_size != target_hidden_size:
            problems.append(f"draft hidden_size {self.hidden_size} != target hidden_size {target_hidden_size} "
                            "(the draft embeds with the target's word_embeddings and its taps are "
                            "target residual streams)")
        bad = [i for i in self.target_layer_ids if not (-1 <= i < target_num_layers)]
        if bad:
            problems.append(f"target_layer_ids {list(self.target_layer_ids)} contain {bad}, out of range "
                            f"for a target with {target_num_layers} decoder layers (valid: -1..{target_num_layers - 1})")
        if self.num_target_layers is not None and self.num_target_layers != target_num_layers:
            problems.append(f"draft was trained for num_target_layers={self.num_target_layers}, "
                            f"target has {target_num_layers} layers")
        if self.vocab_size != vocab_size:
            problems.append(f"draft vocab_size {self.vocab_size} != target vocab_size {vocab_size} "
                            "(the Markov head and lm_head are indexed by target token ids)")
        if problems:
            raise DSparkConfigError("DSpark draft does not fit the target: " + "; ".join(problems))


def dspark_for_ling3_flash() -> DSparkConfig:
    """The published Ling-3.0-flash DSpark draft shape (spec/dspark.md).

    intermediate_size 6144 is the Ling-3.0-flash target's dense intermediate size; DeepSpec builds
    the draft config as a copy of the target config, so the draft inherits it (not confirmed
    against the published draft config.json). mask_token_id 156894 is a guess (a special id next
    to Ling's pad 156892 / eos 156895); the spec does not state it -- read it from the checkpoint.
    """
    return DSparkConfig(
        hidden_size=2560, num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=32,
        head_dim=128, intermediate_size=6144, vocab_size=157184, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, max_position_embeddings=131072, attention_bias=False,
        block_size=8, mask_token_id=156894, target_layer_ids=(1, 11, 23, 29, 35),
        num_target_layers=42, markov_rank=256, markov_head_type="vanilla",
        enable_confidence_head=True, confidence_head_with_markov=True,
    )
