"""Model configuration: a frozen `LingConfig` read from a Hugging Face `config.json`, plus presets.

Only Ling-3.0 (BailingMoeV3: KDA + gated-MLA hybrid with a sigmoid group-routed MoE) is accepted.
`bailing_hybrid` is also the `model_type` of Ling 2.5/2.6, a different model, so we dispatch on
`architectures` plus the presence of `short_conv_kernel_size` (see spec/ling3.md).
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

LING3_ARCHITECTURE = "BailingMoeV3ForCausalLM"


class ConfigError(ValueError):
    """A config.json that is not a Ling-3.0 KDA hybrid, or that lacks a field we need."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """YaRN rope scaling (the only non-default kind Ling recipes use)."""

    type: str = "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclasses.dataclass(frozen=True)
class LingConfig:
    """Every field of spec/ling3.md; names follow the HF config.json."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_group_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int
    first_k_dense_replace: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    short_conv_kernel_size: int
    q_lora_rank: int | None = None
    num_shared_experts: int = 1
    moe_shared_expert_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-6
    kda_safe_gate: bool = True
    kda_lower_bound: float = -5.0
    num_nextn_predict_layers: int = 0
    pad_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    tie_word_embeddings: bool = False
    expert_swiglu_limit_list: tuple[float, ...] | None = None
    share_expert_swiglu_limit_list: tuple[float, ...] | None = None

    # ---- derived layout -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_dim(self) -> int:
        """Width of each KDA q/k/v/f/g projection: heads x head_dim (4096 for Flash)."""
        return self.num_attention_heads * self.head_dim

    @property
    def shared_intermediate_size(self) -> int:
        if self.moe_shared_expert_intermediate_size is not None:
            return self.moe_shared_expert_intermediate_size * self.num_shared_experts
        return self.moe_intermediate_size * self.num_shared_experts

    def is_mla_layer(self, i: int) -> bool:
        """Layer i is gated MLA iff it closes a group, or sits in a trailing partial group."""
        full_groups_end = (self.num_hidden_layers // self.layer_group_size) * self.layer_group_size
        return (i + 1) % self.layer_group_size == 0 or i >= full_groups_end

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    def layer_kinds(self) -> list[str]:
        """'kda' or 'mla' for each of the num_hidden_layers decoder layers."""
        return ["mla" if self.is_mla_layer(i) else "kda" for i in range(self.num_hidden_layers)]

    @property
    def mla_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_mla_layer(i)]

    @property
    def kda_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if not self.is_mla_layer(i)]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """eos_token_id as a tuple (the engine adds <|endoftext|> etc. from the tokenizer)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def swiglu_limit(self, layer: int, shared: bool) -> float | None:
        """Per-layer SwiGLU clamp L (None = off), from expert_/share_expert_swiglu_limit_list."""
        lst = self.share_expert_swiglu_limit_list if shared else self.expert_swiglu_limit_list
        if not lst or layer >= len(lst) or not lst[layer] or lst[layer] <= 0:
            return None
        return float(lst[layer])

    # ---- rope -------------------------------------------------------------------------------
    @property
    def attention_scale(self) -> float:
        """Softmax scale of MLA: qk_head_dim^-1/2, times mscale^2 under YaRN with mscale_all_dim."""
        scale = self.qk_head_dim ** -0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_get_mscale(rs.factor, rs.mscale_all_dim)
            scale = scale * m * m
        return scale

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LingConfig":
        check_is_ling3(d)
        if d.get("no_kda_lora", True) is False:
            raise ConfigError("no_kda_lora=false (low-rank KDA f/g projections, Kimi-Linear style) "
                              "is not supported: Ling-3.0 checkpoints use full-rank f_proj/g_proj.")
        if d.get("use_qkv_bias"):
            raise ConfigError("use_qkv_bias=true is not part of Ling-3.0 and is not supported.")
        gran = d.get("gated_attention_proj_granularity_type", "head_wise")
        if gran != "head_wise":
            raise ConfigError(f"gated_attention_proj_granularity_type={gran!r}: only 'head_wise' is supported.")
        names = {f.name for f in dataclasses.fields(cls)}
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [n for n in required if d.get(n) is None]
        if missing:
            raise ConfigError(f"config.json is missing required Ling-3.0 field(s): {', '.join(missing)}")
        kw = {k: v for k, v in d.items() if k in names and v is not None}
        if "rope_scaling" in kw:
            kw["rope_scaling"] = _parse_rope_scaling(kw["rope_scaling"])
        for k in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
            if k in kw:
                kw[k] = tuple(float(x) if x is not None else 0.0 for x in kw[k])
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = tuple(kw["eos_token_id"])
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> "LingConfig":
        return cls.from_dict(read_config_json(path, ConfigError, "config.json"))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["architectures"] = [LING3_ARCHITECTURE]
        d["model_type"] = "bailing_hybrid"
        d["no_kda_lora"] = True
        return d

    def replace(self, **kw) -> "LingConfig":
        cfg = dataclasses.replace(self, **kw)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def need(cond: bool, msg: str):
            if not cond:
                raise ConfigError(msg)
        need(self.num_experts % self.n_group == 0, f"num_experts {self.num_experts} not divisible by n_group {self.n_group}")
        need(0 < self.topk_group <= self.n_group, f"topk_group {self.topk_group} must be in 1..n_group ({self.n_group})")
        per_group = self.num_experts // self.n_group
        need(self.num_experts_per_tok <= self.topk_group * per_group,
             f"num_experts_per_tok {self.num_experts_per_tok} exceeds the experts in {self.topk_group} kept groups")
        need(per_group >= 2, "group routing needs at least 2 experts per group (group score = top-2 sum)")
        need(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim must be even")
        need(self.layer_group_size >= 1 and self.num_hidden_layers >= 1, "bad layer counts")
        need(self.num_attention_heads == self.num_key_value_heads,
             "Ling-3.0 KDA/MLA use num_key_value_heads == num_attention_heads")
        need(self.short_conv_kernel_size >= 1, "short_conv_kernel_size must be >= 1")
        need(self.kda_lower_bound < 0, "kda_lower_bound must be negative")


def read_config_json(path: str | Path, error=ValueError, what: str = "config.json") -> dict[str, Any]:
    """The dict of a config.json given the file or its directory; `error` names a missing file."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise error(f"no {what} at {path}")
    return json.loads(path.read_text())


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _parse_rope_scaling(rs: dict[str, Any] | None) -> RopeScaling | None:
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise ConfigError(f"rope_scaling type {kind!r} is not supported (only 'yarn' or none)")
    if "original_max_position_embeddings" not in rs:
        raise ConfigError("rope_scaling (yarn) needs original_max_position_embeddings")
    fields = {f.name for f in dataclasses.fields(RopeScaling)}
    return RopeScaling(**{k: v for k, v in rs.items() if k in fields and k != "type"})


def check_is_ling3(d: dict[str, Any]) -> None:
    """Refuse configs that are not Ling-3.0 KDA hybrids, naming what is wrong."""
    arch = d.get("architectures") or []
    if LING3_ARCHITECTURE not in arch:
        raise ConfigError(
            f"architectures={arch!r} (model_type={d.get('model_type')!r}) is not {LING3_ARCHITECTURE}: "
            "lingjax runs only Ling-3.0 (KDA + gated-MLA hybrid) checkpoints.")
    if "short_conv_kernel_size" not in d:
        raise ConfigError(
            "config has no short_conv_kernel_size: this looks like Ling 2.5/2.6 'bailing_hybrid' "
            "(lightning attention), not a Ling-3.0 KDA hybrid; it is not supported.")


# ---- presets ----------------------------------------------------------------------------------
_FLASH = dict(
    architectures=[LING3_ARCHITECTURE], model_type="bailing_hybrid",
    vocab_size=157184, hidden_size=2560, num_hidden_layers=42, layer_group_size=6,
    num_attention_heads=32, num_key_value_heads=32, head_dim=128, q_lora_rank=None,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    gated_attention_proj_granularity_type="head_wise", rope_theta=6_000_000.0, rope_interleave=True,
    rope_scaling=None, max_position_embeddings=131072, short_conv_kernel_size=4, no_kda_lora=True,
    kda_safe_gate=True, kda_lower_bound=-5.0, num_experts=512, num_experts_per_tok=8,
    num_shared_experts=1, moe_intermediate_size=768, moe_shared_expert_intermediate_size=768,
    intermediate_size=6144, first_k_dense_replace=2, n_group=8, topk_group=4,
    routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6, pad_token_id=156892,
    eos_token_id=156895, num_nextn_predict_layers=1, tie_word_embeddings=False,
)
# Ling-3.0-tiny (7.9B total / 1.3B active): 24 layers in a 3:1 KDA:MLA pattern, q LoRA 256.
# n_group/topk_group are not in our sources for this model; 8/4 as in Flash (check the real config).
_TINY = dict(
    _FLASH, hidden_size=1536, num_hidden_layers=24, layer_group_size=4, num_attention_heads=16,
    num_key_value_heads=16, q_lora_rank=256, num_experts=128, moe_intermediate_size=512,
    moe_shared_expert_intermediate_size=512, intermediate_size=4608, first_k_dense_replace=1,
)
PRESETS: dict[str, dict[str, Any]] = {"ling3-flash": _FLASH, "ling3-tiny": _TINY}


def preset(name: str) -> LingConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return LingConfig.from_dict(PRESETS[name])
