"""Ling-3.0 (BailingMoeV3) causal LM: composition of KDA / gated-MLA attention, dense MLP / MoE,
the MTP (NEXTN) layer, final norm and the untied lm_head. One forward serves every mode:
prefill (empty cache, any T), decode (T = 1) and extend / verify (T tokens from a non-empty cache).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from lingjax.approx import ApproxModes
from lingjax.cache import LingCache, MLAState, init_cache
from lingjax.config import LingConfig
from lingjax.model.common import RMSNorm, acc_dtype, param
from lingjax.model.dense import check_dense_kernel, dense_matmul, set_dense_kernel, uses_kernel
from lingjax.model.kda import KDA, check_kda_kernel, commit_prefix
from lingjax.model.mla import GatedMLA, check_mla_kernel, set_mla_kernel
from lingjax.model.mlp import DenseMLP, MoE, check_moe_kernel


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: h += attn(norm(h)); h += mlp(norm(h))."""

    def __init__(self, cfg: LingConfig, layer: int, *, dtype, rngs, kind: str | None = None,
                 kda_kernel: str = "xla", moe_kernel: str = "xla"):
        self.kind = kind or ("mla" if cfg.is_mla_layer(layer) else "kda")
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        if self.kind == "mla":
            self.attn = GatedMLA(cfg, dtype=dtype, rngs=rngs)
        else:
            self.attn = KDA(cfg, dtype=dtype, rngs=rngs, kda_kernel=kda_kernel)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        if cfg.is_moe_layer(layer):
            self.mlp = MoE(cfg, layer, dtype=dtype, rngs=rngs, moe_kernel=moe_kernel)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)

    def __call__(self, h, cache, pos, *, pending: bool = False, valid_len=None):
        with jax.named_scope(self.kind):          # profile component: 'kda' | 'mla'
            x, bound = self.input_norm(h), self.input_norm.bound   # bound: static, for the fp8 kernels
            if self.kind == "mla":
                a, cache = self.attn(x, cache, pos, x_bound=bound)
            else:
                a, cache = self.attn(x, cache, pending=pending, valid_len=valid_len, x_bound=bound)
        h = h + a
        with jax.named_scope("moe" if isinstance(self.mlp, MoE) else "dense_mlp"):
            return h + self.mlp(self.post_norm(h), self.post_norm.bound), cache


class MTPLayer(nnx.Module):
    """NEXTN layer: x = eh_proj([enorm(embed(tok_{t+1})); hnorm(h_t)]) -> MLA+MoE block -> final norm."""
    DENSE_WEIGHTS = (("eh_proj", 1),)     # dense_kernel projection (lingjax/model/dense.py)

    def __init__(self, cfg: LingConfig, *, dtype, rngs, moe_kernel: str = "xla"):
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.eh_proj = param(rngs, (2 * d, d), (None, "embed"), dtype, std=(2 * d) ** -0.5)
        self.block = DecoderLayer(cfg, cfg.num_hidden_layers, dtype=dtype, rngs=rngs, kind="mla",
                                  moe_kernel=moe_kernel)
        self.final_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)

    def __call__(self, h_final, next_embeds, cache: MLAState, pos):
        """h_final [B, T, D] (main model after model.norm), next_embeds [B, T, D] -> (hidden, cache)."""
        x = jnp.concatenate([self.enorm(next_embeds), self.hnorm(h_final)], axis=-1)
        if uses_kernel(self, "eh_proj", math.prod(x.shape[:-1])):
            bounds = (self.enorm.bound, self.hnorm.bound)
            x = dense_matmul(x, self.eh_proj, x_bound=None if None in bounds else max(bounds))
        else:
            x = jnp.dot(x, self.eh_proj[...])
        x, cache = self.block(x, cache, pos)
        return self.final_norm(x), cache


class ForwardOut(NamedTuple):
    logits: jax.Array | None   # [B, T, V] or [B, 1, V] (last position) in acc dtype; None if not asked
    hidden: jax.Array          # [B, T, D] after model.norm
    taps: jax.Array | None     # [B, T, n_taps * D] residual streams after the tapped layers, concatenated
    cache: LingCache           # updated cache (pos advanced by T unless pending)
    pending: tuple | None      # per-layer KDAPending / None (verify mode), for `commit`


class LingModel(nnx.Module):
    DENSE_WEIGHTS = (("lm_head", 1),)     # dense_kernel projection (lingjax/model/dense.py)

    def __init__(self, cfg: LingConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None, with_mtp: bool | None = None,
                 kda_kernel: str = "xla", moe_kernel: str = "xla", dense_kernel: str = "xla",
                 mla_kernel: str = "xla", approx: ApproxModes = ApproxModes()):
        """kda_kernel: 'xla' (default) | 'pallas': the KDA recurrence kernel (lingjax/model/kda.py).
        moe_kernel: 'xla' (default) | 'pallas': the routed-expert kernel of calls of <= 16 tokens
        (lingjax/model/mlp.py); after lingjax.quant.quantize_model, or to switch a loaded model,
        use lingjax.model.mlp.set_moe_kernel (it also checks the expert weights' dtype).
        dense_kernel: 'xla' (default) | 'pallas': the skinny GEMM for the dense projections and
        lm_head of calls of <= 16 tokens (lingjax/model/dense.py). Here 'pallas' needs a bfloat16
        model (a float32 model's weights are float32: nothing to stream, ValueError); after
        lingjax.quant.quantize_model, or to switch a loaded model, use
        lingjax.model.dense.set_dense_kernel (it records which weights the kernel streams).
        mla_kernel: 'xla' (default) | 'pallas': the absorbed attention of calls of <= 16 tokens over
        the latent cache (lingjax/model/mla.py); 'pallas' needs a bfloat16 model without
        approx.fp8_mla_cache; to switch a loaded model use lingjax.model.mla.set_mla_kernel.
        approx: optional approximate speed modes (lingjax/approx.py), all off by default; caches
        for this model come from `self.init_cache` (storage dtypes follow the modes)."""
        check_kda_kernel(kda_kernel)
        check_moe_kernel(moe_kernel)
        check_dense_kernel(dense_kernel, dtype)
        check_mla_kernel(mla_kernel, dtype, approx.fp8_mla_cache)
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.cfg = cfg
        self.dtype = dtype
        d, v = cfg.hidden_size, cfg.vocab_size
        self.embed = param(rngs, (v, d), ("vocab", "embed"), dtype, std=1.0)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype=dtype, rngs=rngs, kda_kernel=kda_kernel,
                                             moe_kernel=moe_kernel) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = param(rngs, (d, v), ("embed", "vocab"), dtype, std=d ** -0.5)
        if with_mtp is None:
            with_mtp = cfg.num_nextn_predict_layers > 0
        self.mtp = MTPLayer(cfg, dtype=dtype, rngs=rngs, moe_kernel=moe_kernel) if with_mtp else None
        set_approx(self, approx)
        set_dense_kernel(self, dense_kernel)
        set_mla_kernel(self, mla_kernel)

    def init_cache(self, batch: int, max_len: int, *, with_mtp: bool | None = None) -> LingCache:
        """Zeroed cache for this model: activation dtype, storage dtypes of `self.approx`."""
        return init_cache(self.cfg, batch, max_len, self.dtype, with_mtp=with_mtp, approx=self.approx)

    def embed_tokens(self, tokens):
        with jax.named_scope("embed"):
            return jnp.take(self.embed[...], tokens, axis=0)

    def logits(self, hidden, x_bound: float | None = None):
        """hidden [..., D] (final-normed) -> fp32 (acc) logits [..., V]. x_bound: a static bound on
        |hidden| (the norm's recorded ``bound``) or None, for an fp8 lm_head on the kernel."""
        acc = acc_dtype(hidden.dtype)
        kernel = uses_kernel(self, "lm_head", math.prod(hidden.shape[:-1]))
        with jax.named_scope("lm_head"):
            if self.approx.bf16_router_head:   # bf16 logits, widened so consumers see one dtype
                bf = jnp.bfloat16
                if kernel:
                    return dense_matmul(hidden.astype(bf), self.lm_head, out_dtype=bf,
                                        x_bound=x_bound).astype(acc)
                return jnp.dot(hidden.astype(bf), self.lm_head[...].astype(bf), preferred_element_type=bf).astype(acc)
            if kernel:
                return dense_matmul(hidden, self.lm_head, out_dtype=acc, x_bound=x_bound)
            return jnp.dot(hidden, self.lm_head[...], preferred_element_type=acc)

    def __call__(self, tokens, cache: LingCache, *, logits: str = "all", tap_layers: tuple[int, ...] = (),
                 pending: bool = False, return_all_hidden: bool = False, valid_len=None) -> ForwardOut:
        """tokens [B, T] int32 at positions cache.pos .. cache.pos+T-1.

        logits: 'all' | 'last' | 'none'. tap_layers: static layer ids whose output residual stream
        is returned concatenated (DSpark context features). pending=True (verify): KDA states are
        not advanced; `commit(cache, pending, n)` advances them by the accepted n tokens later.
        return_all_hidden: taps become every layer's output stacked [L, B, T, D] (tests).
        valid_len (traced int): tokens past it are padding (prompt buckets): KDA states skip them,
        MLA entries past it are junk that later writes overwrite, pos advances by valid_len.
        """
        if tokens.shape[1] > cache.max_len:
            raise ValueError(f"{tokens.shape[1]} tokens do not fit a cache of {cache.max_len} positions")
        pos = cache.pos  # callers keep pos + T <= cache.max_len (the engine sizes caches per request)
        h = self.embed_tokens(tokens)
        new_layers, pend, taps = [], [], {}
        if -1 in tap_layers:  # DSpark convention: layer id -1 = the embedding output
            taps[-1] = h
        for i, layer in enumerate(self.layers):
            h, c = layer(h, cache.layers[i], pos, pending=pending, valid_len=valid_len)
            if pending and layer.kind == "kda":
                new_layers.append(cache.layers[i])
                pend.append(c)
            else:
                new_layers.append(c)
                pend.append(None)
            if return_all_hidden or i in tap_layers:
                taps[i] = h
        with jax.named_scope("lm_head"):          # the final norm counts with the head
            hidden = self.norm(h)
        out_logits = None
        if logits == "all":
            out_logits = self.logits(hidden, self.norm.bound)
        elif logits == "last":
            out_logits = self.logits(hidden[:, -1:], self.norm.bound)
        if return_all_hidden:
            tap_out = jnp.stack([taps[i] for i in range(len(self.layers))])
        elif tap_layers:
            tap_out = jnp.concatenate([taps[i] for i in tap_layers], axis=-1)
        else:
            tap_out = None
        t = tokens.shape[1]
        advance = t if valid_len is None else valid_len
        new_cache = LingCache(tuple(new_layers), cache.mtp, pos if pending else (pos + advance).astype(jnp.int32))
        return ForwardOut(out_logits, hidden, tap_out, new_cache, tuple(pend) if pending else None)

    def mtp_forward(self, hidden, next_tokens, cache: LingCache, pos=None):
        """MTP hidden for positions pos..pos+T-1 given main final hidden [B, T, D] and the next
        tokens [B, T]; writes the MTP attention cache. Returns (mtp_hidden [B, T, D], cache)."""
        if self.mtp is None:
            raise ValueError("this model was built without its MTP layer (num_nextn_predict_layers=0)")
        pos = cache.pos if pos is None else pos
        out, mtp_cache = self.mtp(hidden, self.embed_tokens(next_tokens), cache.mtp, pos)
        return out, cache._replace(mtp=mtp_cache)


def set_approx(model: nnx.Module, approx: ApproxModes) -> nnx.Module:
    """Set the approximate modes of `model` (a LingModel, e.g. one built by a checkpoint loader) and
    of its MoE layers, in place; call it before the model is split / jitted. Returns `model`."""
    if not isinstance(approx, ApproxModes):
        raise TypeError(f"approx must be a lingjax.approx.ApproxModes, got {type(approx).__name__}")
    for _, m in nnx.iter_modules(model):
        if isinstance(m, (LingModel, MoE)):
            m.approx = approx
    return model


def commit(verified: LingCache, pending: tuple, n, start_pos) -> LingCache:
    """Advance a verified block's cache by its accepted prefix of n tokens (n traced, >= 1).

    verified: the cache returned by a pending forward (MLA entries already written; KDA layers
    still at the block start); pending: its per-layer KDAPending (None for MLA layers).
    """
    with jax.named_scope("commit"):
        layers = tuple(c if p is None else commit_prefix(p, n) for c, p in zip(verified.layers, pending))
    return LingCache(layers, verified.mtp, (start_pos + n).astype(jnp.int32))
