"""Configs of the embedded default model: a small Ling-3.0-architecture target (KDA + gated MLA +
group-routed sigmoid MoE + one MTP layer) and its DSpark draft, over the byte-level tokenizer.

Token ids: bytes 0..255, then `DEMO_SPECIAL_TOKENS` at 256.. (269 ids in all). The vocabulary is
exactly the tokenizer's; <|endoftext|> separates documents and is both eos and pad.
"""
from __future__ import annotations

from lingjax.config import LING3_ARCHITECTURE, LingConfig
from lingjax.dspark_config import DSparkConfig
from lingjax.tokenizer import DEMO_SPECIAL_TOKENS, ENDOFTEXT

VOCAB_SIZE = 256 + len(DEMO_SPECIAL_TOKENS)                 # 269
EOT_ID = 256 + DEMO_SPECIAL_TOKENS.index(ENDOFTEXT)         # 256
MASK_ID = 256 + DEMO_SPECIAL_TOKENS.index("<|mask|>")       # 268


def target_config(**overrides) -> LingConfig:
    """6 layers in groups of 3 (KDA, KDA, MLA): MLA at 2 and 5; layer 0 dense, 1..5 MoE."""
    d = dict(
        architectures=[LING3_ARCHITECTURE], model_type="bailing_hybrid",
        vocab_size=VOCAB_SIZE, hidden_size=256, num_hidden_layers=6, layer_group_size=3,
        num_attention_heads=4, num_key_value_heads=4, head_dim=64, q_lora_rank=None,
        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        rope_theta=10_000.0, rope_interleave=True, max_position_embeddings=4096,
        short_conv_kernel_size=4, kda_safe_gate=True, kda_lower_bound=-5.0,
        num_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        moe_intermediate_size=64, num_shared_experts=1, moe_shared_expert_intermediate_size=64,
        intermediate_size=512, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, rms_norm_eps=1e-6, num_nextn_predict_layers=1,
        pad_token_id=EOT_ID, eos_token_id=EOT_ID, tie_word_embeddings=False,
    )
    d.update(overrides)
    return LingConfig.from_dict(d)


def draft_config(target: LingConfig | None = None, **overrides) -> DSparkConfig:
    """2 Qwen3-style layers fed with the target's residual streams after layers 1..5."""
    target = target or target_config()
    n = target.num_hidden_layers
    kw = dict(
        hidden_size=target.hidden_size, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, intermediate_size=512, vocab_size=target.vocab_size,
        rms_norm_eps=1e-6, rope_theta=10_000.0, max_position_embeddings=target.max_position_embeddings,
        block_size=8, mask_token_id=MASK_ID, target_layer_ids=tuple(range(max(0, n - 5), n)),
        num_target_layers=n, markov_rank=32, markov_head_type="vanilla",
        enable_confidence_head=True, confidence_head_with_markov=True,
    )
    kw.update(overrides)
    cfg = DSparkConfig(**kw)
    cfg.validate()
    cfg.check_fits_target(target.hidden_size, n, target.vocab_size)
    return cfg


def smoke_configs() -> tuple[LingConfig, DSparkConfig]:
    """A much smaller model of the same architecture (every feature kept: KDA, MLA, dense + MoE
    layers with group routing, MTP) for CPU smoke tests."""
    t = target_config(hidden_size=64, num_hidden_layers=2, layer_group_size=2, num_attention_heads=2,
                      num_key_value_heads=2,
                      head_dim=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                      num_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                      moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, intermediate_size=128)
    dr = draft_config(t, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                      intermediate_size=128, markov_rank=8)
    return t, dr
