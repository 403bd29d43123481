"""LingConfig: reading config.json, the presets, refusals, rope scaling, SwiGLU limits, and the
parameter totals of the real Ling-3.0-flash (spec/ling3.md, "Parameter-count check")."""
from __future__ import annotations

import copy
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import LING_TINY
from lingjax.config import PRESETS, ConfigError, LingConfig, RopeScaling, preset
from lingjax.model.common import rope_inv_freq
from lingjax.model.ling import LingModel


def _golden_dict():
    return json.loads((LING_TINY / "config.json").read_text())


def _flash_dict():
    return copy.deepcopy(PRESETS["ling3-flash"])


# ---- reading config.json ------------------------------------------------------------------------
def test_from_json_golden_config():
    cfg = LingConfig.from_json(LING_TINY / "config.json")
    assert cfg == LingConfig.from_json(LING_TINY)               # a directory works too
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.layer_group_size) == (128, 8, 4)
    assert cfg.mla_layers == [3, 7]
    assert cfg.kda_layers == [0, 1, 2, 4, 5, 6]
    assert cfg.layer_kinds() == ["kda"] * 3 + ["mla"] + ["kda"] * 3 + ["mla"]
    assert [cfg.is_moe_layer(i) for i in range(8)] == [False, False] + [True] * 6
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group) == (16, 4, 4, 2)
    assert cfg.q_lora_rank is None and cfg.rope_scaling is None
    assert (cfg.qk_head_dim, cfg.kda_dim, cfg.shared_intermediate_size) == (48, 128, 32)
    assert cfg.attention_scale == 48 ** -0.5
    assert cfg.kda_safe_gate and cfg.kda_lower_bound == -5.0
    assert cfg.num_nextn_predict_layers == 1
    assert cfg.eos_token_ids == (1,)
    assert cfg.routed_scaling_factor == 2.5 and cfg.norm_topk_prob
    assert cfg.swiglu_limit(3, shared=False) is None and cfg.swiglu_limit(3, shared=True) is None
    # to_dict round-trips through the same reader
    assert LingConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_from_json_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        LingConfig.from_json(tmp_path)


# ---- ling3-flash preset: layout and parameter totals --------------------------------------------
def test_flash_layout():
    cfg = preset("ling3-flash")
    assert cfg.mla_layers == [5, 11, 17, 23, 29, 35, 41]
    assert len(cfg.kda_layers) == 35
    assert cfg.kda_dim == 4096 and cfg.qk_head_dim == 192
    assert cfg.attention_scale == 192 ** -0.5
    assert cfg.eos_token_ids == (156895,) and cfg.pad_token_id == 156892


def _abstract_params(cfg, with_mtp):
    model = nnx.eval_shape(lambda: LingModel(cfg, dtype=jnp.bfloat16, with_mtp=with_mtp))
    assert (model.mtp is not None) == with_mtp
    return {path: int(np.prod(v.shape)) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _active(cfg, sizes):
    """Per-token active parameters: everything of the main model except the embedding table and the
    non-selected routed experts (attention, dense MLPs, routers, shared experts, top-k routed experts,
    norms, lm_head)."""
    total = 0
    for path, n in sizes.items():
        if path[0] in ("embed", "mtp"):
            continue
        if path[0] == "layers" and cfg.is_moe_layer(path[1]) and path[2:] in (("mlp", "w_gate_up"), ("mlp", "w_down")):
            assert n % cfg.num_experts == 0
            n = n // cfg.num_experts * cfg.num_experts_per_tok
        total += n
    return total


def test_flash_parameter_counts():
    cfg = preset("ling3-flash")
    main = _abstract_params(cfg, with_mtp=False)
    full = _abstract_params(cfg, with_mtp=True)
    total, total_mtp = sum(main.values()), sum(full.values())
    assert abs(total - 124.41e9) <= 0.01e9, total               # measured 124,414,211,552
    assert abs(total_mtp - 127.49e9) <= 0.01e9, total_mtp       # measured 127,486,405,600
    assert abs(_active(cfg, full) - 5.10e9) <= 0.01e9           # measured 5,103,302,112
    # the spec's per-layer figures: KDA 63.0 M, MLA 32.0 M, MoE 3,027 M
    per = {}
    for path, n in main.items():
        if path[0] == "layers":
            per[(path[1], path[2])] = per.get((path[1], path[2]), 0) + n
    assert all(abs(per[(i, "attn")] - 63.0e6) < 0.1e6 for i in cfg.kda_layers)
    assert all(abs(per[(i, "attn")] - 32.0e6) < 0.1e6 for i in cfg.mla_layers)
    assert all(abs(per[(i, "mlp")] - 3027e6) < 1e6 for i in range(cfg.first_k_dense_replace, 42))
    # the embedding and the untied lm_head are both vocab x hidden
    assert main[("embed",)] == main[("lm_head",)] == 157184 * 2560


def test_tiny_preset_parameter_count():
    cfg = preset("ling3-tiny")
    assert cfg.q_lora_rank == 256
    assert cfg.mla_layers == [3, 7, 11, 15, 19, 23]
    sizes = _abstract_params(cfg, with_mtp=False)
    total = sum(sizes.values())
    assert abs(total - 7.9e9) <= 0.05e9, total                  # measured 7,893,392,800
    assert ("layers", 3, "attn", "q_a") in sizes and ("layers", 3, "attn", "q_b") in sizes
    assert abs(_active(cfg, sizes) - 1.14e9) <= 0.01e9          # measured 1,140,301,216 (no embedding)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset 'nope'.*ling3-flash"):
        preset("nope")


# ---- layer layout ---------------------------------------------------------------------------------
@pytest.mark.parametrize("layers,group,mla", [
    (42, 6, [5, 11, 17, 23, 29, 35, 41]),
    (44, 6, [5, 11, 17, 23, 29, 35, 41, 42, 43]),     # trailing partial group of 2 -> MLA
    (45, 6, [5, 11, 17, 23, 29, 35, 41, 42, 43, 44]),
    (5, 3, [2, 3, 4]),
    (3, 4, [0, 1, 2]),                                # no full group at all: every layer MLA
    (4, 1, [0, 1, 2, 3]),
])
def test_trailing_partial_group_is_mla(layers, group, mla):
    cfg = preset("ling3-flash").replace(num_hidden_layers=layers, layer_group_size=group)
    assert cfg.mla_layers == mla
    assert cfg.kda_layers == [i for i in range(layers) if i not in mla]


# ---- refusals -------------------------------------------------------------------------------------
def test_refuses_ling25_bailing_hybrid_without_short_conv():
    d = _flash_dict()
    del d["short_conv_kernel_size"]
    with pytest.raises(ConfigError, match="short_conv_kernel_size.*Ling 2.5"):
        LingConfig.from_dict(d)
    # Ling 2.5's own architecture name is refused on the architecture, model_type notwithstanding
    d["architectures"] = ["BailingMoeV2_5ForCausalLM"]
    with pytest.raises(ConfigError, match="BailingMoeV2_5ForCausalLM.*bailing_hybrid.*BailingMoeV3ForCausalLM"):
        LingConfig.from_dict(d)


@pytest.mark.parametrize("arch", [["Qwen3ForCausalLM"], [], None])
def test_refuses_other_architectures(arch):
    d = _flash_dict()
    d["architectures"] = arch
    d["model_type"] = "qwen3"
    with pytest.raises(ConfigError, match="is not BailingMoeV3ForCausalLM"):
        LingConfig.from_dict(d)


@pytest.mark.parametrize("field", ["kv_lora_rank", "num_experts", "n_group", "first_k_dense_replace"])
def test_refuses_missing_required_field(field):
    d = _flash_dict()
    del d[field]
    with pytest.raises(ConfigError, match=f"missing required Ling-3.0 field\\(s\\): {field}$"):
        LingConfig.from_dict(d)
    d[field] = None                                    # an explicit null is missing too
    with pytest.raises(ConfigError, match=field):
        LingConfig.from_dict(d)


def test_missing_fields_are_all_named():
    d = _flash_dict()
    del d["kv_lora_rank"], d["head_dim"]
    with pytest.raises(ConfigError) as e:
        LingConfig.from_dict(d)
    assert "kv_lora_rank" in str(e.value) and "head_dim" in str(e.value)


def test_refuses_kda_lora():
    d = _flash_dict()
    d["no_kda_lora"] = False
    with pytest.raises(ConfigError, match="no_kda_lora=false"):
        LingConfig.from_dict(d)
    del d["no_kda_lora"]                               # absent = Ling's full-rank default
    assert LingConfig.from_dict(d) == preset("ling3-flash")


@pytest.mark.parametrize("key,value,msg", [
    ("use_qkv_bias", True, "use_qkv_bias"),
    ("gated_attention_proj_granularity_type", "element_wise", "head_wise"),
    ("num_experts_per_tok", 300, "exceeds the experts in 4 kept groups"),
    ("topk_group", 9, "topk_group 9"),
    ("num_experts", 500, "not divisible by n_group"),
    ("kda_lower_bound", 1.0, "kda_lower_bound"),
])
def test_refuses_inconsistent_values(key, value, msg):
    d = _flash_dict()
    d[key] = value
    with pytest.raises(ConfigError, match=msg):
        LingConfig.from_dict(d)


# ---- rope scaling -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind_key", ["type", "rope_type"])
def test_yarn_rope_scaling(kind_key):
    d = _flash_dict()
    d["rope_scaling"] = {kind_key: "yarn", "factor": 2.0, "original_max_position_embeddings": 131072,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    cfg = LingConfig.from_dict(d)
    assert cfg.rope_scaling == RopeScaling(factor=2.0, original_max_position_embeddings=131072,
                                           beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
    m = 0.1 * math.log(2.0) + 1.0
    assert cfg.attention_scale == pytest.approx(192 ** -0.5 * m * m, rel=1e-15)
    assert cfg.attention_scale > preset("ling3-flash").attention_scale
    # YaRN also changes the rope frequencies: interpolated low frequencies, untouched high ones
    base = np.asarray(rope_inv_freq(64, cfg.rope_theta, None, jnp.float64))
    yarn = np.asarray(rope_inv_freq(64, cfg.rope_theta, cfg.rope_scaling, jnp.float64))
    assert yarn[0] == base[0]
    np.testing.assert_allclose(yarn[-1], base[-1] / 2.0, rtol=1e-12)
    # without mscale_all_dim the softmax scale is the plain one
    d["rope_scaling"].pop("mscale_all_dim")
    assert LingConfig.from_dict(d).attention_scale == 192 ** -0.5


@pytest.mark.parametrize("rs", [None, {}, {"type": "default"}, {"rope_type": "default", "factor": 1.0}])
def test_default_rope_scaling_is_none(rs):
    d = _flash_dict()
    d["rope_scaling"] = rs
    assert LingConfig.from_dict(d).rope_scaling is None


def test_refuses_other_rope_scaling():
    d = _flash_dict()
    d["rope_scaling"] = {"type": "linear", "factor": 2.0}
    with pytest.raises(ConfigError, match="'linear'"):
        LingConfig.from_dict(d)


# ---- SwiGLU limit lists -------------------------------------------------------------------------
def test_swiglu_limit_lists():
    d = _flash_dict()
    d["expert_swiglu_limit_list"] = [0, 7.0, None, -1.0, 3.5]
    d["share_expert_swiglu_limit_list"] = [10.0, 0.0]
    cfg = LingConfig.from_dict(d)
    assert [cfg.swiglu_limit(i, shared=False) for i in range(7)] == [None, 7.0, None, None, 3.5, None, None]
    assert [cfg.swiglu_limit(i, shared=True) for i in range(3)] == [10.0, None, None]
    json.dumps(cfg.to_dict())                           # tuples of floats stay serialisable
    base = preset("ling3-flash")
    assert base.expert_swiglu_limit_list is None
    assert all(base.swiglu_limit(i, s) is None for i in range(42) for s in (False, True))
    d["expert_swiglu_limit_list"] = [0.0] * 42
    assert all(LingConfig.from_dict(d).swiglu_limit(i, False) is None for i in range(42))
