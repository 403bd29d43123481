"""DSpark block drafter (spec/dspark.md): a small Qwen3-style decoder that drafts a whole block of
tokens in one non-causal pass, conditioned on target-layer taps injected as extra keys/values.

Data flow of one speculative step (batch B, block Bk = cfg.block_size):

  taps [B, n, n_taps*hidden] --fc--> hidden_norm --> ctx --k_proj/k_norm/RoPE, v_proj--> cache
  [anchor, MASK x (Bk-1)] --target embed--> block_embeds [B, Bk, hidden]
  forward_block(cache, block_embeds, block_start) --> hidden [B, Bk, hidden] (after final norm)
  propose_greedy / propose_sample(hidden, anchor, lm_head) --> d_1..d_Bk, logits, confidences

The context K/V cache (`DSparkCache`) is append-only; the block's own K/V is never cached.
Everything here is jittable with static shapes; nothing reads back to the host.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lingjax.dspark_config import DSparkConfig, DSparkConfigError
from lingjax.model import dense, kernels
from lingjax.model.common import RMSNorm, acc_dtype, apply_rope, param, rope_cos_sin
from lingjax.param_layout import Matrix
from lingjax.quant import DEFAULT_BLOCK, Fp8Weight, quantize
from lingjax.sampling import filter_logits


class DSparkCache(NamedTuple):
    """Context K/V of the draft, one entry per draft layer.

    k[i], v[i]: [B, max_len, kv_heads, head_dim]; k is stored after k_norm and RoPE at the
    context token's absolute position. `length`: int32, scalar (or [B] when built with
    per_row=True): context positions 0..length-1 are valid; everything >= length is masked.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    length: jax.Array

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]


class DSparkProposal(NamedTuple):
    """Output of the Markov chain. `confidence_logits` is None without a confidence head;
    `draft_probs` (q_j, the distribution d_j was drawn from) is None for greedy proposals."""

    tokens: jax.Array             # [B, Bk] int32: d_1..d_Bk
    base_logits: jax.Array        # [B, Bk, V] acc dtype: hidden @ lm_head^T
    corrected_logits: jax.Array   # [B, Bk, V] acc dtype: base + Markov bias of the previous token
    confidence_logits: jax.Array | None  # [B, Bk] acc dtype, before the sigmoid
    draft_probs: jax.Array | None = None  # [B, Bk, V] acc dtype (sampling only)


class Linear(nnx.Module):
    """y = x @ W, W stored [in, *out] (no bias). `logical` names (in, *out) axes. With
    dense_kernel='pallas' (set by the Decoder from the target's switch: lingjax/model/dense.py)
    calls of at most 16 rows run on the skinny GEMM."""
    DENSE_WEIGHTS = (("weight", 1),)

    def __init__(self, in_features: int, out_shape, logical, *, dtype, rngs, std: float | None = None):
        out_shape = tuple(out_shape) if isinstance(out_shape, (tuple, list)) else (out_shape,)
        std = std if std is not None else 1.0 / math.sqrt(in_features)
        self.weight = param(rngs, (in_features, *out_shape), logical, dtype, std=std)

    def __call__(self, x, x_bound: float | None = None):
        """x [..., in] -> [..., *out] in the weight's dtype. x_bound: optional static bound on |x|
        (the RMSNorm before it), which spares an fp8 weight's kernel call a reduction over x."""
        if dense.uses_kernel(self, "weight", math.prod(x.shape[:-1])):
            return dense.dense_matmul(x.astype(self.weight.dtype), self.weight, x_bound=x_bound)
        w = self.weight[...]
        return jnp.tensordot(x.astype(w.dtype), w, axes=1)


# Linears of one input in one skinny-GEMM launch (`linears`; session 27: 20 launches and 20 output
# fusions fewer per DSpark step at the published draft's 5 layers). Read when a program is traced
# (set it before the first trace: a jitted function already traced keeps its choice); False gives
# one launch per Linear, the same products up to float32 summation order (kept for A/B timing).
FUSED_LINEARS = True


def linears(x, *modules: Linear, x_bound: float | None = None):
    """(m(x) for m in modules): Linears of one input. When every one of them runs on the skinny GEMM
    for this call and their weights are of one kind (type and dtype), all of them in ONE launch
    (dense.dense_matmul_multi: each Linear's own product up to float32 summation order); otherwise
    each as its own call. x_bound: as for Linear."""
    tokens = math.prod(x.shape[:-1])
    kinds = {(type(m.weight), dense.compute_dtype(m.weight)) for m in modules}   # Param / Fp8Weight
    if FUSED_LINEARS and len(modules) > 1 and len(kinds) == 1 and all(
            dense.uses_kernel(m, "weight", tokens) for m in modules):
        return dense.dense_matmul_multi(x.astype(modules[0].weight.dtype), [m.weight for m in modules],
                                        x_bound=x_bound)
    return tuple(m(x, x_bound) for m in modules)


class HeadsOut(nnx.Module):
    """o_proj: [B, T, heads, head_dim] -> [B, T, hidden]; weight stored [heads, head_dim, hidden]
    (the torch [hidden, heads*head_dim] weight transposed and split). Skinny GEMM as Linear."""
    DENSE_WEIGHTS = (("weight", 2),)

    def __init__(self, heads: int, head_dim: int, out: int, *, dtype, rngs):
        self.weight = param(rngs, (heads, head_dim, out), ("heads", "head_dim", "embed"), dtype,
                            std=1.0 / math.sqrt(heads * head_dim))

    def __call__(self, x):
        if dense.uses_kernel(self, "weight", math.prod(x.shape[:-2])):
            return dense.dense_matmul(x.astype(self.weight.dtype), self.weight, k_axes=2)
        w = self.weight[...]
        return jnp.einsum("bqhd,hde->bqe", x.astype(w.dtype), w)


# The draft's attention (its context cache and the block's own keys) on the flash-decoding kernel
# (pallas_kernels/draft_attention.py) when its projections run on the skinny GEMM
# (dense_kernel='pallas') and the shapes fit the kernel (`_context_kernel_fits`). On since session
# 31 (one H100, 12 layers, ms per DSpark step: run 111, the context on the kernel and the block's
# keys merged in XLA, 4.514 -> 4.463; run 113, the block's keys in the kernel too, 4.435 -> 4.426;
# GPU tests passed). False: the XLA attention (the reference). Read when a program is traced.
ATTENTION_KERNEL = True


def _context_kernel_fits(q, k_ctx, tokens_per_kv_head: int) -> bool:
    """Whether the context attention's kernel takes these operands (all bf16, head_dim 64 / 128, a
    cache of >= 64 positions in whole 8-row TMA tiles, <= 64 query rows per kv head)."""
    from pallas_kernels import draft_attention
    d, S = q.shape[-1], k_ctx.shape[1]
    return (all(jnp.dtype(x.dtype) == jnp.bfloat16 for x in (q, k_ctx)) and d in (64, 128)
            and S >= draft_attention.BLOCK_S and S % 8 == 0 and tokens_per_kv_head <= 64
            and q.shape[1] <= draft_attention.MAX_T)


class DSparkAttention(nnx.Module):
    def __init__(self, cfg: DSparkConfig, *, dtype, rngs):
        h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, d
        self.q_proj = Linear(cfg.hidden_size, (h, d), ("embed", "heads", "head_dim"), dtype=dtype, rngs=rngs)
        self.k_proj = Linear(cfg.hidden_size, (kvh, d), ("embed", "kv_heads", "head_dim"), dtype=dtype, rngs=rngs)
        self.v_proj = Linear(cfg.hidden_size, (kvh, d), ("embed", "kv_heads", "head_dim"), dtype=dtype, rngs=rngs)
        # o_proj stored [heads, head_dim, hidden] (torch [hidden, heads*head_dim] transposed).
        self.o_proj = HeadsOut(h, d, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, logical=("head_dim",))
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, logical=("head_dim",))

    def context_kv(self, ctx, cos, sin, x_bound: float | None = None):
        """ctx [B, n, hidden] -> K (normed, roped), V: [B, n, kv_heads, head_dim]. x_bound: as for
        Linear (the draft's hidden_norm)."""
        k, v = linears(ctx, self.k_proj, self.v_proj, x_bound=x_bound)
        return apply_rope(self.k_norm(k), cos[:, :, None, :], sin[:, :, None, :], interleaved=False), v

    def __call__(self, x, k_ctx, v_ctx, ctx_valid, cos, sin, x_bound: float | None = None, ctx_length=None):
        """x [B, Bk, hidden] (after input_layernorm, whose bound is x_bound); k_ctx/v_ctx [B, M, kvh, d];
        ctx_valid [B, M] bool; cos/sin [B, Bk, d]; ctx_length [B] int32 (ctx_valid's count) or None:
        with it and ATTENTION_KERNEL the attention may run on the flash-decoding kernel."""
        b, bk, _ = x.shape
        kvh, g, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        acc = acc_dtype(x.dtype)
        cs, sn = cos[:, :, None, :], sin[:, :, None, :]
        q, k_blk, v_blk = linears(x, self.q_proj, self.k_proj, self.v_proj, x_bound=x_bound)
        q = apply_rope(self.q_norm(q), cs, sn, interleaved=False)                   # [B,Bk,H,d]
        k_blk = apply_rope(self.k_norm(k_blk), cs, sn, interleaved=False)           # [B,Bk,kvh,d]
        scale = d ** -0.5
        if ATTENTION_KERNEL and ctx_length is not None and dense.uses_kernel(self.q_proj, "weight", b * bk):
            qx = q.astype(x.dtype)
            if _context_kernel_fits(qx, k_ctx, bk * g):
                o = self._kernel_attention(qx, k_blk, v_blk, k_ctx, v_ctx, ctx_length, scale)
                return self.o_proj(o.reshape(b, bk, kvh * g, d).astype(x.dtype))
        q = q.reshape(b, bk, kvh, g, d)
        s_ctx = jnp.einsum("bqhgd,bkhd->bhgqk", q, k_ctx.astype(q.dtype), preferred_element_type=acc) * scale
        s_blk = jnp.einsum("bqhgd,bkhd->bhgqk", q, k_blk, preferred_element_type=acc) * scale
        neg = jnp.asarray(jnp.finfo(acc).min, acc)
        s_ctx = jnp.where(ctx_valid[:, None, None, None, :], s_ctx, neg)
        m = jnp.maximum(s_ctx.max(-1, keepdims=True), s_blk.max(-1, keepdims=True))
        p_ctx = jnp.exp(s_ctx - m)
        p_blk = jnp.exp(s_blk - m)
        denom = p_ctx.sum(-1, keepdims=True) + p_blk.sum(-1, keepdims=True)
        vt = v_blk.dtype
        o = (jnp.einsum("bhgqk,bkhd->bqhgd", p_ctx.astype(vt), v_ctx.astype(vt), preferred_element_type=acc)
             + jnp.einsum("bhgqk,bkhd->bqhgd", p_blk.astype(vt), v_blk, preferred_element_type=acc))
        o = o / jnp.moveaxis(denom, (1, 2, 3), (2, 3, 1))                           # [B,Bk,kvh,g,1]
        return self.o_proj(o.reshape(b, bk, kvh * g, d).astype(x.dtype))

    def _kernel_attention(self, q, k_blk, v_blk, k_ctx, v_ctx, ctx_length, scale):
        """The attention on the flash-decoding kernel: the context's valid positions and the block's
        own Bk keys (the kernel's extra keys) in one softmax. q [B,Bk,H,d] bf16 -> o [B,Bk,H,d] float32."""
        from pallas_kernels import draft_attention
        return kernels.shared_call(draft_attention.context_attention_pallas, q, k_ctx, v_ctx,
                                   ctx_length.astype(jnp.int32), k_blk.astype(q.dtype), v_blk.astype(q.dtype),
                                   scale=float(scale), interpret=kernels.interpret_arg("dense_kernel"))[0]


class DSparkMLP(nnx.Module):
    def __init__(self, cfg: DSparkConfig, *, dtype, rngs):
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, ("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, ("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, ("mlp", "embed"), dtype=dtype, rngs=rngs)

    def __call__(self, x, x_bound: float | None = None):
        gate, up = linears(x, self.gate_proj, self.up_proj, x_bound=x_bound)
        return self.down_proj(jax.nn.silu(gate) * up)


class DSparkLayer(nnx.Module):
    def __init__(self, cfg: DSparkConfig, *, dtype, rngs):
        self.self_attn = DSparkAttention(cfg, dtype=dtype, rngs=rngs)
        self.mlp = DSparkMLP(cfg, dtype=dtype, rngs=rngs)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def __call__(self, x, k_ctx, v_ctx, ctx_valid, cos, sin, ctx_length=None):
        x = x + self.self_attn(self.input_layernorm(x), k_ctx, v_ctx, ctx_valid, cos, sin,
                               x_bound=self.input_layernorm.bound, ctx_length=ctx_length)
        return x + self.mlp(self.post_attention_layernorm(x), x_bound=self.post_attention_layernorm.bound)


class DSparkDraft(nnx.Module):
    """The DSpark draft. It has no embedding / lm_head of its own: callers pass the target's."""
    BOUND_WEIGHTS = ("markov_w1",)  # what record_bounds reads (the norms record their own)

    def __init__(self, cfg: DSparkConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        cfg.validate()
        self.cfg = cfg
        self.dtype = dtype
        hid = cfg.hidden_size
        self.fc = Linear(cfg.tap_dim, hid, (None, "embed"), dtype=dtype, rngs=rngs)
        self.hidden_norm = RMSNorm(hid, cfg.rms_norm_eps, dtype=dtype)
        self.layers = nnx.List([DSparkLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(hid, cfg.rms_norm_eps, dtype=dtype)
        if cfg.has_markov:
            self.markov_w1 = param(rngs, (cfg.vocab_size, cfg.markov_rank), ("vocab", None), dtype)
            self.markov_w2 = Linear(cfg.markov_rank, cfg.vocab_size, (None, "vocab"), dtype=dtype, rngs=rngs)
        else:
            self.markov_w1 = None
            self.markov_w2 = None
        if cfg.enable_confidence_head:
            self.conf_proj = Linear(cfg.confidence_in_dim, 1, (None, None), dtype=dtype, rngs=rngs)
            self.conf_bias = param(None, (1,), (None,), dtype, init="zeros")
        else:
            self.conf_proj = None
            self.conf_bias = None
        self.markov_bound = None    # static bound on markov_w2's input rows (record_bounds)

    def record_bounds(self):
        """Record ``markov_bound`` = 2 max |markov_w1| (the chain's markov_w2 input rows are rows of
        markov_w1; 2x covers their rounding to bf16), the fp8 markov_w2 call's x_bound
        (lingjax.model.common.record_input_bounds); None for an abstract weight or no Markov head.
        The max is reduced where the weight lives: one scalar comes back, not the 80 MB table."""
        w1 = None if self.markov_w1 is None else self.markov_w1.get_value()
        if w1 is None or isinstance(w1, (jax.ShapeDtypeStruct, jax.core.Tracer)):
            self.markov_bound = None
        else:
            self.markov_bound = float(2.0 * jnp.max(jnp.abs(w1), initial=0).astype(jnp.float32))

    # ---- context cache ----------------------------------------------------------------------
    def init_cache(self, batch: int, max_len: int, *, per_row: bool = False) -> DSparkCache:
        """Empty context cache. per_row=True keeps one length per batch row ([B] int32)."""
        cfg = self.cfg
        shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        z = tuple(jnp.zeros(shape, self.dtype) for _ in range(cfg.num_hidden_layers))
        length = jnp.zeros((batch,) if per_row else (), jnp.int32)
        return DSparkCache(k=z, v=tuple(jnp.zeros(shape, self.dtype) for _ in range(cfg.num_hidden_layers)),
                           length=length)

    def _rope(self, positions):
        return rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, dtype=acc_dtype(self.dtype))

    def append_context(self, cache: DSparkCache, taps, start, count=None) -> DSparkCache:
        """Write the context K/V of taps [B, n, tap_dim] (positions start..start+n-1).

        `start` (scalar or [B], may be traced) is normally cache.length. `count` (optional, traced,
        scalar or [B]) marks only the first `count` rows as valid: length = start + count (default n).
        Rows past `count` are written but masked (positions >= length) and overwritten by the next
        append. Rows that would land at or past max_len are dropped, never wrapped or shifted.
        """
        b, n, _ = taps.shape
        ctx = self.hidden_norm(self.fc(taps.astype(self.dtype)))
        start = jnp.asarray(start, jnp.int32)
        pos = jnp.broadcast_to(start, (b,) if start.ndim else ())[..., None] + jnp.arange(n, dtype=jnp.int32)
        pos = jnp.broadcast_to(pos, (b, n))
        cos, sin = self._rope(pos)
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, n))
        ks, vs = [], []
        for layer, kc, vc in zip(self.layers, cache.k, cache.v):
            k, v = layer.self_attn.context_kv(ctx, cos, sin, x_bound=self.hidden_norm.bound)
            ks.append(kc.at[rows, pos].set(k.astype(kc.dtype), mode="drop"))
            vs.append(vc.at[rows, pos].set(v.astype(vc.dtype), mode="drop"))
        count = n if count is None else jnp.asarray(count, jnp.int32)
        length = jnp.broadcast_to(start + count, cache.length.shape).astype(jnp.int32)
        return DSparkCache(k=tuple(ks), v=tuple(vs), length=length)

    # ---- the draft pass ---------------------------------------------------------------------
    def forward_block(self, cache: DSparkCache, block_embeds, block_start):
        """block_embeds [B, Bk, hidden] at positions block_start.. (scalar or [B]) -> final-normed
        hidden [B, Bk, hidden]. Non-causal inside the block; sees context positions < cache.length."""
        b, bk, _ = block_embeds.shape
        start = jnp.asarray(block_start, jnp.int32)
        pos = jnp.broadcast_to((start[..., None] if start.ndim else start) + jnp.arange(bk, dtype=jnp.int32),
                               (b, bk))
        cos, sin = self._rope(pos)
        length = jnp.broadcast_to(cache.length, (b,))
        ctx_valid = jnp.arange(cache.max_len, dtype=jnp.int32)[None, :] < length[:, None]
        x = block_embeds.astype(self.dtype)
        for layer, kc, vc in zip(self.layers, cache.k, cache.v):
            x = layer(x, kc, vc, ctx_valid, cos, sin, ctx_length=length)
        return self.norm(x)

    # ---- Markov chain + confidence -----------------------------------------------------------
    def base_logits(self, hidden, lm_head):
        """hidden [B, Bk, hidden] @ lm_head[V, hidden]^T -> [B, Bk, V] in the acc dtype. lm_head may
        also be a function of hidden giving those logits (the Decoder passes the target's own
        ``logits``: the same product, on the skinny GEMM when the target's lm_head is)."""
        if callable(lm_head):
            return lm_head(hidden)
        acc = acc_dtype(hidden.dtype)
        return jnp.einsum("bqe,ve->bqv", hidden, lm_head.astype(hidden.dtype), preferred_element_type=acc)

    def _chain(self, hidden, anchor_tokens, lm_head, pick):
        """Run d_j = pick(corrected_j) left to right with lax.scan. pick(logits [B,V], j) -> (tok, q)."""
        acc = acc_dtype(hidden.dtype)
        base = self.base_logits(hidden, lm_head)                          # [B, Bk, V]
        w1 = self.markov_w1[...] if self.markov_w1 is not None else None
        w2 = self.markov_w2.weight[...] if self.markov_w2 is not None else None
        w2_kernel = w2 is not None and dense.uses_kernel(self.markov_w2, "weight", hidden.shape[0])
        cw = self.conf_proj.weight[...] if self.conf_proj is not None else None
        cb = self.conf_bias[...] if self.conf_bias is not None else None
        with_markov_conf = self.cfg.confidence_head_with_markov and w1 is not None

        def step(prev, xs):
            u, h, j = xs                                                  # [B,V], [B,hid], ()
            if w1 is not None:
                e = jnp.take(w1, prev, axis=0)                            # [B, r]
                if w2_kernel:           # the skinny GEMM (dense_kernel='pallas'), float32 products
                    corr = u + dense.dense_matmul(e, self.markov_w2.weight, out_dtype=acc, x_bound=self.markov_bound)
                else:
                    corr = u + jnp.dot(e, w2, preferred_element_type=acc).astype(acc)
            else:
                e, corr = None, u
            tok, q = pick(corr, j)
            if cw is not None:
                feat = jnp.concatenate([h, e.astype(h.dtype)], axis=-1) if with_markov_conf else h
                c = (jnp.dot(feat.astype(cw.dtype), cw, preferred_element_type=acc)[:, 0] + cb[0].astype(acc))
            else:
                c = jnp.zeros(prev.shape, acc)
            return tok, (tok, corr, c, q)

        xs = (jnp.moveaxis(base, 1, 0), jnp.moveaxis(hidden, 1, 0), jnp.arange(base.shape[1]))
        _, (toks, corr, conf, q) = jax.lax.scan(step, anchor_tokens.astype(jnp.int32), xs)
        toks, corr, conf = jnp.moveaxis(toks, 0, 1), jnp.moveaxis(corr, 0, 1), jnp.moveaxis(conf, 0, 1)
        q = None if q is None else jnp.moveaxis(q, 0, 1)
        return DSparkProposal(toks, base, corr, conf if cw is not None else None, q)

    def propose_greedy(self, hidden, anchor_tokens, lm_head) -> DSparkProposal:
        """Greedy Markov chain: d_0 = anchor, d_j = argmax(base[j-1] + w2(w1[d_{j-1}]));
        confidence logit c_j = proj([hidden[j-1]; w1[d_{j-1}]]) + bias (row j-1 of the outputs)."""
        def pick(logits, j):
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
        return self._chain(hidden, anchor_tokens, lm_head, pick)

    def propose_sample(self, hidden, anchor_tokens, lm_head, key, temperature,
                       top_k: int | None = None, top_p=None) -> DSparkProposal:
        """Sample d_j ~ q_j = softmax(filter(corrected_j / T)); returns q_j in `draft_probs` for
        lossless rejection sampling. temperature (> 0) and top_p may be traced; top_k is static.
        The verifier must apply the same temperature / top-k / top-p to the target distribution."""
        t = jnp.asarray(temperature, acc_dtype(hidden.dtype))
        keys = jax.random.split(key, hidden.shape[1])

        def pick(logits, j):
            z = filter_logits(logits / t, top_k, top_p)
            q = jax.nn.softmax(z, axis=-1)
            tok = jax.random.categorical(keys[j], z, axis=-1).astype(jnp.int32)
            return tok, q
        return self._chain(hidden, anchor_tokens, lm_head, pick)

    def draft(self, cache: DSparkCache, anchor_tokens, block_start, embed, lm_head) -> DSparkProposal:
        """Convenience: embed [anchor, MASK...] with the target table `embed` [V, hidden], run the
        block at block_start and the greedy chain."""
        ids = block_token_ids(anchor_tokens, self.cfg.block_size, self.cfg.mask_token_id)
        hidden = self.forward_block(cache, jnp.take(embed, ids, axis=0), block_start)
        return self.propose_greedy(hidden, anchor_tokens, lm_head)


def block_token_ids(anchor_tokens, block_size: int, mask_token_id: int):
    """[B] anchors -> [B, block_size] ids: [anchor, MASK x (block_size-1)]."""
    a = jnp.asarray(anchor_tokens, jnp.int32)
    masks = jnp.full((a.shape[0], block_size - 1), mask_token_id, jnp.int32)
    return jnp.concatenate([a[:, None], masks], axis=1)


# ---- weights ------------------------------------------------------------------------------------
def draft_weight_map(model: DSparkDraft) -> dict[str, tuple[nnx.Param, str]]:
    """Published name -> (param, how): 'T' transpose [out,in]->[in,out]; 'o' o_proj to [h,d,e];
    'qkv' [h*d, e] -> [e, h, d]; '' as is."""
    m: dict[str, tuple[nnx.Param, str]] = {
        "fc.weight": (model.fc.weight, "T"),
        "hidden_norm.weight": (model.hidden_norm.weight, ""),
        "norm.weight": (model.norm.weight, ""),
    }
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        a = layer.self_attn
        m[p + "self_attn.q_proj.weight"] = (a.q_proj.weight, "qkv")
        m[p + "self_attn.k_proj.weight"] = (a.k_proj.weight, "qkv")
        m[p + "self_attn.v_proj.weight"] = (a.v_proj.weight, "qkv")
        m[p + "self_attn.o_proj.weight"] = (a.o_proj.weight, "o")
        m[p + "self_attn.q_norm.weight"] = (a.q_norm.weight, "")
        m[p + "self_attn.k_norm.weight"] = (a.k_norm.weight, "")
        m[p + "mlp.gate_proj.weight"] = (layer.mlp.gate_proj.weight, "T")
        m[p + "mlp.up_proj.weight"] = (layer.mlp.up_proj.weight, "T")
        m[p + "mlp.down_proj.weight"] = (layer.mlp.down_proj.weight, "T")
        m[p + "input_layernorm.weight"] = (layer.input_layernorm.weight, "")
        m[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, "")
    if model.markov_w1 is not None:
        m["markov_head.markov_w1.weight"] = (model.markov_w1, "")
        m["markov_head.markov_w2.weight"] = (model.markov_w2.weight, "T")
    if model.conf_proj is not None:
        m["confidence_head.proj.weight"] = (model.conf_proj.weight, "T")
        m["confidence_head.proj.bias"] = (model.conf_bias, "")
    return m


def draft_projections(model: DSparkDraft) -> list[tuple[nnx.Module, Matrix]]:
    """(module, matrix view of its ``weight``) of every draft projection `quantize_draft` holds in
    fp8: fc, each layer's q / k / v / o and gate / up / down, and markov_w2 -- what the skinny GEMM
    streams. Not the confidence head (one output column) nor markov_w1 (a table the chain gathers
    rows of)."""
    mods: list[nnx.Module] = [model.fc]
    for layer in model.layers:
        a, mlp = layer.self_attn, layer.mlp
        mods += [a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    if model.markov_w2 is not None:
        mods.append(model.markov_w2)
    views = []
    for m in mods:
        nd, k = len(m.weight.shape), dict(type(m).DENSE_WEIGHTS)["weight"]   # [in..., out...]: k in axes
        views.append((m, Matrix((), tuple(range(k)), tuple(range(k, nd)))))
    return views


def quantize_draft(model: DSparkDraft, block=DEFAULT_BLOCK) -> DSparkDraft:
    """Hold the draft's projections (`draft_projections`) as block fp8 (lingjax.quant: e4m3 values,
    one float32 scale per 128 x 128 block, the published recipe), in place; returns `model`.

    The draft only proposes tokens: the target verifies every one of them, so the output is the
    target's whatever the draft's weights (greedy: the same tokens; sampling: the same distribution,
    lossless rejection sampling). What changes is how many proposals are accepted, and the step's
    weight bytes: at the published draft's shape (5 layers, hidden 2560) the projections are ~1.17 GB
    of bf16 per verify step, plus eight markov_w2 reads of 80 MB, halved in fp8. Call it before
    the draft meets a Decoder (which records the dense kernel's weights and input bounds). Works on
    concrete models and inside nnx.eval_shape."""
    from lingjax.sharding import variable_logical
    for m, view in draft_projections(model):
        w = m.weight
        if isinstance(w, Fp8Weight):
            continue
        values, scale = quantize(w.get_value(), view, block)
        m.weight = Fp8Weight(values, scale, view=view, block=block, dtype=w.get_value().dtype,
                             logical=variable_logical(w))
    return model


_IGNORED = ("embed_tokens.weight", "lm_head.weight", "word_embeddings.weight")


def load_dspark_weights(model: DSparkDraft, tensors: Mapping[str, np.ndarray], *, strict: bool = True,
                        put=None) -> DSparkDraft:
    """Fill `model` (concrete or built with nnx.eval_shape) from published-name tensors.

    Accepts an optional `model.` prefix; ignores the embed_tokens / lm_head copies. Raises
    DSparkConfigError on missing or wrong-shaped tensors, and (strict) on unexpected names.
    `put(array_np, param) -> jax.Array` may place each weight (e.g. with a sharding); default
    jnp.asarray in the model dtype. Returns the model.
    """
    names = {}
    for k in tensors:
        short = k[len("model."):] if k.startswith("model.") else k
        if short in names:
            raise DSparkConfigError(f"tensor {short!r} given twice (with and without the 'model.' prefix)")
        names[short] = k
    wmap = draft_weight_map(model)
    missing = [n for n in wmap if n not in names]
    if missing:
        raise DSparkConfigError(f"DSpark checkpoint lacks {len(missing)} tensor(s): {', '.join(missing[:8])}"
                                + (" ..." if len(missing) > 8 else ""))
    unexpected = [n for n in names if n not in wmap and not n.endswith(_IGNORED)]
    if strict and unexpected:
        raise DSparkConfigError(f"unexpected tensor(s) in DSpark checkpoint: {', '.join(sorted(unexpected)[:8])}"
                                " (does the config match the checkpoint?)")
    cfg = model.cfg
    for name, (p, how) in wmap.items():
        arr = np.asarray(tensors[names[name]])
        cur = p.get_value()
        target = tuple(cur.shape)
        if how == "T":
            want = target[::-1]
        elif how == "qkv":                       # torch [heads*d, hidden] -> [hidden, heads, d]
            want = (target[1] * target[2], target[0])
        elif how == "o":                         # torch [hidden, heads*d] -> [heads, d, hidden]
            want = (target[2], target[0] * target[1])
        else:
            want = target
        if tuple(arr.shape) != want:
            raise DSparkConfigError(f"tensor {name!r} has shape {tuple(arr.shape)}, expected {want} "
                                    f"for the draft config (hidden {cfg.hidden_size}, heads "
                                    f"{cfg.num_attention_heads}/{cfg.num_key_value_heads}x{cfg.head_dim}, "
                                    f"vocab {cfg.vocab_size}, markov_rank {cfg.markov_rank})")
        if how == "T":
            arr = arr.T
        elif how == "qkv":
            arr = arr.T.reshape(target)
        elif how == "o":
            arr = arr.T.reshape(target)
        p.set_value(put(arr, p) if put is not None else jnp.asarray(arr, dtype=cur.dtype))
    return model


def from_safetensors(path: str | Path, *, dtype=jnp.bfloat16, cfg: DSparkConfig | None = None,
                     put=None) -> DSparkDraft:
    """Build a DSparkDraft from a checkpoint dir (config.json + *.safetensors) without allocating
    random weights first (the module is built abstractly with nnx.eval_shape, then filled)."""
    from safetensors import safe_open

    path = Path(path)
    cfg = cfg or DSparkConfig.from_json(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise DSparkConfigError(f"no *.safetensors under {path}")
    model = nnx.eval_shape(lambda: DSparkDraft(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        with safe_open(str(f), "np") as fh:
            for k in fh.keys():
                if not k.endswith(_IGNORED):
                    tensors[k] = fh.get_tensor(k)
    return load_dspark_weights(model, tensors, put=put)
