"""Feed-forward blocks: the dense SwiGLU MLP (first layers, shared expert) and the routed MoE."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from lingjax.approx import ApproxModes
from lingjax.config import LingConfig
from lingjax.model.common import param
from lingjax.ops import moe as moe_ops

# Token counts at or above this use the sorted-block expert path (prefill); below it, gather.
MOE_GATHER_MAX_TOKENS = 64


class DenseMLP(nnx.Module):
    """down(silu(gate(x)) * up(x)); gate and up fused into w_gate_up [D, 2, F]."""

    def __init__(self, hidden: int, inter: int, *, dtype, rngs, swiglu_limit: float | None = None):
        self.swiglu_limit = swiglu_limit
        self.w_gate_up = param(rngs, (hidden, 2, inter), ("embed", None, "mlp"), dtype, std=hidden ** -0.5)
        self.w_down = param(rngs, (inter, hidden), ("mlp", "embed"), dtype, std=inter ** -0.5)

    def __call__(self, x):
        w = self.w_gate_up[...]
        h = jnp.tensordot(x.astype(w.dtype), w, axes=1)
        return jnp.tensordot(moe_ops.swiglu(h[..., 0, :], h[..., 1, :], self.swiglu_limit), self.w_down[...], axes=1)


class MoE(nnx.Module):
    """Sigmoid group-limited router + routed experts (stacked [E, ...]) + one unscaled shared expert.
    `approx` (lingjax/approx.py): expert_keep and bf16_router_head change the routing; off by default."""

    def __init__(self, cfg: LingConfig, layer: int, *, dtype, rngs, approx: ApproxModes = ApproxModes()):
        d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        self.cfg = cfg
        self.approx = approx
        self.limit = cfg.swiglu_limit(layer, shared=False)
        self.router = param(rngs, (d, e), ("embed", None), dtype, std=d ** -0.5)
        self.expert_bias = param(None, (e,), (None,), jnp.promote_types(dtype, jnp.float32), init="zeros")
        self.w_gate_up = param(rngs, (e, d, 2, f), ("experts", "embed", None, "mlp"), dtype, std=d ** -0.5)
        self.w_down = param(rngs, (e, f, d), ("experts", "mlp", "embed"), dtype, std=f ** -0.5)
        self.shared = DenseMLP(d, cfg.shared_intermediate_size, dtype=dtype, rngs=rngs,
                               swiglu_limit=cfg.swiglu_limit(layer, shared=True))

    def __call__(self, x):
        """x [B, T, D] -> [B, T, D]."""
        cfg = self.cfg
        b, t, d = x.shape
        xf = x.reshape(b * t, d)
        idx, w = moe_ops.route(xf, self.router[...], self.expert_bias[...], n_group=cfg.n_group,
                               topk_group=cfg.topk_group, top_k=cfg.num_experts_per_tok,
                               norm_topk_prob=cfg.norm_topk_prob,
                               routed_scaling_factor=cfg.routed_scaling_factor,
                               expert_keep=self.approx.expert_keep, bf16_logits=self.approx.bf16_router_head)
        experts = moe_ops.experts_gather if b * t < MOE_GATHER_MAX_TOKENS else moe_ops.experts_sorted_blocks
        routed = experts(xf, idx, w, self.w_gate_up, self.w_down, self.limit)   # Param or Fp8Weight
        return (routed + self.shared(xf)).reshape(b, t, d)
