"""Decode-state pytrees of the Ling target: per-layer KDA recurrent state + conv window, MLA latent
cache, the committed position. Static shapes: the MLA cache is a [max_len] ring-free buffer and
entries past `pos` are masked by causality (rejected speculative entries are simply overwritten).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from lingjax.approx import FP8_DTYPE, ApproxModes
from lingjax.config import LingConfig


class KDAState(NamedTuple):
    state: jax.Array   # [B, H, K, V] float32 (float64 under x64; bfloat16 with bf16_kda_state): the delta-rule state S
    conv: jax.Array    # [B, ks-1, 3, H, K] activation dtype: last ks-1 projected q/k/v inputs


class MLAState(NamedTuple):
    latent: jax.Array  # [B, S, kv_lora_rank]  kv_a_layernorm(latent) of every cached position
    k_rope: jax.Array  # [B, S, qk_rope_head_dim]  rotated rope key (shared by all heads)
    latent_scale: jax.Array | None = None  # [B, S] float32 per-token scale when latent is fp8 (fp8_mla_cache)


class LingCache(NamedTuple):
    layers: tuple      # one KDAState or MLAState per decoder layer
    mtp: MLAState | None  # the MTP layer's own attention cache (None when the model has no MTP)
    pos: jax.Array     # int32 scalar: tokens committed so far (next token's position)

    @property
    def max_len(self) -> int:
        for layer in self.layers:
            if isinstance(layer, MLAState):
                return layer.latent.shape[1]
        return 1 << 30  # an all-KDA model has no length limit from its cache


def init_cache(cfg: LingConfig, batch: int, max_len: int, dtype, *, with_mtp: bool | None = None,
               approx: ApproxModes = ApproxModes()) -> LingCache:
    """Zeroed caches for `batch` sequences of up to `max_len` positions. dtype = activation dtype.
    approx: the model's ApproxModes (`model.approx`); bf16_kda_state / fp8_mla_cache pick the
    storage dtypes, which the layers then follow."""
    acc = jnp.promote_types(dtype, jnp.float32)
    h, k = cfg.num_attention_heads, cfg.head_dim
    layers = []
    for kind in cfg.layer_kinds():
        if kind == "kda":
            layers.append(KDAState(jnp.zeros((batch, h, k, k), approx.kda_state_dtype(acc)),
                                   jnp.zeros((batch, cfg.short_conv_kernel_size - 1, 3, h, k), dtype)))
        else:
            layers.append(_mla_state(cfg, batch, max_len, dtype, approx.fp8_mla_cache))
    if with_mtp is None:
        with_mtp = cfg.num_nextn_predict_layers > 0
    mtp = _mla_state(cfg, batch, max_len, dtype, approx.fp8_mla_cache) if with_mtp else None
    return LingCache(tuple(layers), mtp, jnp.zeros((), jnp.int32))


def _mla_state(cfg: LingConfig, batch: int, max_len: int, dtype, fp8: bool = False) -> MLAState:
    if fp8:
        return MLAState(jnp.zeros((batch, max_len, cfg.kv_lora_rank), FP8_DTYPE),
                        jnp.zeros((batch, max_len, cfg.qk_rope_head_dim), dtype),
                        jnp.ones((batch, max_len), jnp.float32))
    return MLAState(jnp.zeros((batch, max_len, cfg.kv_lora_rank), dtype),
                    jnp.zeros((batch, max_len, cfg.qk_rope_head_dim), dtype))


def cache_bytes(cfg: LingConfig, batch: int, max_len: int, dtype, approx: ApproxModes = ApproxModes()) -> int:
    """Device bytes of `init_cache(...)` without allocating it."""
    shapes = jax.eval_shape(lambda: init_cache(cfg, batch, max_len, dtype, approx=approx))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
