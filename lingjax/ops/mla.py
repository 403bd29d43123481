"""Pure-XLA reference of the absorbed MLA attention over the latent cache (the contract of
pallas_kernels/mla_decode.py; lingjax/model/mla.py's `_attend_absorbed` computes the same with
[B, T, H] query axes).

    q_lat   [B, R, L]       rows r = t * heads + h: the latent query q_nope . W_uk
    q_rope  [B, R, Dr]      the rotated rope query (same rows)
    latent  [B, S, L], k_rope [B, S, Dr]  the cache
    pos     int32 scalar    row r sees positions s <= pos + r // heads
    -> o    [B, R, L] in the accumulation dtype (float32 for bf16 / f32 inputs, float64 for float64)

Scores accumulate in the accumulation dtype; the normalised probabilities are rounded to the cache
dtype before P . latent, as the model's XLA path does (for float64 inputs nothing is rounded: the
oracle the tests use).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from lingjax.model.common import acc_dtype


def absorbed_attention(q_lat, q_rope, latent, k_rope, pos, *, heads: int, scale: float):
    """softmax_s(scale * (q_lat . latent_s + q_rope . k_rope_s)) . latent over s <= each row's position."""
    acc = acc_dtype(latent.dtype)
    R = q_lat.shape[1]
    limits = jnp.asarray(pos, jnp.int32) + jnp.arange(R, dtype=jnp.int32) // heads          # [R]
    visible = jnp.arange(latent.shape[1])[None, :] <= limits[:, None]                      # [R, S]
    scores = (jnp.einsum("brl,bsl->brs", q_lat.astype(latent.dtype), latent, preferred_element_type=acc)
              + jnp.einsum("brd,bsd->brs", q_rope.astype(k_rope.dtype), k_rope, preferred_element_type=acc))
    p = jax.nn.softmax(jnp.where(visible[None], scores * scale, -jnp.inf), axis=-1)
    return jnp.einsum("brs,bsl->brl", p.astype(latent.dtype), latent, preferred_element_type=acc)
