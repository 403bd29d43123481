"""Gated multi-head latent attention (spec/ling3.md, MLA layers and the MTP block).

The cache holds only kv_a_layernorm(latent) [S, 512] and the rotated rope key [S, 64]. For short
query blocks (decode, verify) `kv_b_proj` is absorbed into the query / output side so the cache is
never expanded; long blocks (prefill) expand k_nope / v per head, which is cheaper there.

With ApproxModes.fp8_mla_cache the cache's latent is float8_e4m3fn with a float32 scale per token
(`MLAState.latent_scale`): a token's quantised latent does not depend on which block wrote it, so
prefill, decode and verify see the same values. The absorbed form folds the scale into the scores
and the probabilities (the dots read fp8 converted, never a rescaled copy of the cache).

The absorbed attention of decode / verify calls (<= 16 tokens) runs on one of two kernels
(``mla_kernel``, XLA by default): the einsums below, or the Pallas flash-decoding kernel over the
latent cache (pallas_kernels/mla_decode.py; compiled on a GPU, interpreted inside
``kernels.pallas_interpret()`` on CPU). The kernel reads a bfloat16 cache only: 'pallas' needs a
bfloat16 model without ApproxModes.fp8_mla_cache (:func:`check_mla_kernel` refuses the others), a
cache length that is a multiple of 8 (lingjax.spec_decode sizes its caches in multiples of 64),
and no device mesh. Prefill (longer blocks) stays on XLA. H200, full depth fp8 with every kernel
(session 19): DSpark 9.036 -> 8.823 ms/step, plain decode 4.294 -> 4.237 (docs/PERFORMANCE.md).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lingjax.approx import quantize_fp8_per_token
from lingjax.cache import MLAState
from lingjax.config import LingConfig
from lingjax.model import dense as dense_proj
from lingjax.model import kernels
from lingjax.model.common import RMSNorm, acc_dtype, apply_rope, head_gate, param, rms_norm_bound, rope_cos_sin
from pallas_kernels import mla_decode

# Query blocks shorter than this use the absorbed form.
ABSORB_MAX_TOKENS = 32
MLA_KERNELS = ("xla", "pallas")


def check_mla_kernel(kernel: str, dtype=None, fp8_cache: bool = False) -> str:
    """Validate an mla_kernel value (and, given the model dtype / its fp8_mla_cache mode, that the
    Pallas kernel can read the cache)."""
    if kernel not in MLA_KERNELS:
        raise ValueError(f"mla_kernel must be one of {', '.join(map(repr, MLA_KERNELS))}, got {kernel!r}")
    if kernel == "pallas":
        if dtype is not None and jnp.dtype(dtype) != jnp.bfloat16:
            raise ValueError(f"mla_kernel='pallas' reads a bfloat16 latent cache; a {jnp.dtype(dtype).name} model "
                             "keeps a cache of that dtype: load the model in bfloat16 or use mla_kernel='xla'")
        if fp8_cache:
            raise ValueError("mla_kernel='pallas' reads a bfloat16 latent cache, not the fp8 one of "
                             "ApproxModes.fp8_mla_cache: drop that mode or use mla_kernel='xla'")
    return kernel


def set_mla_kernel(model: nnx.Module, kernel: str) -> nnx.Module:
    """Switch every gated-MLA layer of `model` (the MTP block's too) to `kernel`, in place; call it
    after set_approx and before the model is split / jitted (the choice is static). Returns `model`."""
    approx = getattr(model, "approx", None)
    fp8_cache = bool(approx is not None and approx.fp8_mla_cache)
    for _, m in nnx.iter_modules(model):
        if isinstance(m, GatedMLA):
            m.mla_kernel = check_mla_kernel(kernel, getattr(model, "dtype", None), fp8_cache)
    return model


class GatedMLA(nnx.Module):
    # dense_kernel projections (lingjax/model/dense.py); kv_b (absorbed einsums / prefill expansion) stays on XLA
    DENSE_WEIGHTS = (("q_a", 1), ("q_b", 1), ("q_proj", 1), ("kv_a", 1), ("dense", 2))
    BOUND_WEIGHTS = ("kv_b",)       # what record_bounds reads besides kv_a_norm's own (bench/xla_kernels.py)

    def __init__(self, cfg: LingConfig, *, dtype, rngs):
        d, h = cfg.hidden_size, cfg.num_attention_heads
        nope, rope, vd, lat = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.cfg = cfg
        self.mla_kernel = "xla"          # set_mla_kernel
        if cfg.q_lora_rank:
            self.q_a = param(rngs, (d, cfg.q_lora_rank), ("embed", None), dtype, std=d ** -0.5)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype=dtype, logical=(None,))
            self.q_b = param(rngs, (cfg.q_lora_rank, h, nope + rope), (None, "heads", None), dtype,
                             std=cfg.q_lora_rank ** -0.5)
        else:
            self.q_proj = param(rngs, (d, h, nope + rope), ("embed", "heads", None), dtype, std=d ** -0.5)
        self.kv_a = param(rngs, (d, lat + rope), ("embed", None), dtype, std=d ** -0.5)
        self.kv_a_norm = RMSNorm(lat, cfg.rms_norm_eps, dtype=dtype, logical=(None,))
        self.kv_b = param(rngs, (lat, h, nope + vd), (None, "heads", None), dtype, std=lat ** -0.5)
        self.g_proj = param(rngs, (h, d), ("heads", "embed"), dtype, std=d ** -0.5)   # K-minor, as published
        self.dense = param(rngs, (h, vd, d), ("heads", None, "embed"), dtype, std=(h * vd) ** -0.5)
        self.o_bound = None     # static bound on the output projection's input (record_bounds)

    def record_bounds(self):
        """Record ``o_bound`` (`mla_output_bound` of the latent norm and kv_b as they are now; None for
        abstract weights): the fp8 output projection's x_bound (lingjax.model.common.record_input_bounds)."""
        self.o_bound = mla_output_bound(self.kv_a_norm.weight.get_value(), self.kv_b, self.cfg.qk_nope_head_dim)

    def __call__(self, x, cache: MLAState, pos, *, x_bound=None):
        """x [B, T, D] at positions pos..pos+T-1 (pos traced int32) -> (y [B, T, D], new MLAState).

        The block's latent / rope key are written into the cache first; queries then attend to
        every cached position <= their own. x_bound: a static bound on |x| (the input norm's
        ``bound``) or None, for the fp8 kernels.
        """
        cfg = self.cfg
        nope, lat = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        b, t, _ = x.shape
        acc = acc_dtype(x.dtype)
        xw = x.astype(self.kv_a.dtype)
        if cfg.q_lora_rank:
            qa = (dense_proj.dense_matmul(xw, self.q_a, x_bound=x_bound) if self._kernel("q_a", b * t)
                  else jnp.dot(xw, self.q_a[...]))
            qa = self.q_a_norm(qa)
            q = (dense_proj.dense_matmul(qa, self.q_b, x_bound=self.q_a_norm.bound) if self._kernel("q_b", b * t)
                 else jnp.einsum("btr,rhe->bthe", qa, self.q_b[...]))
        elif self._kernel("q_proj", b * t):
            q = dense_proj.dense_matmul(xw, self.q_proj, x_bound=x_bound)
        else:
            q = jnp.einsum("btd,dhe->bthe", xw, self.q_proj[...])
        c = (dense_proj.dense_matmul(xw, self.kv_a, x_bound=x_bound) if self._kernel("kv_a", b * t)
             else jnp.dot(xw, self.kv_a[...]))
        latent = self.kv_a_norm(c[..., :lat])
        positions = pos + jnp.arange(t, dtype=jnp.int32)
        cos, sin = rope_cos_sin(positions, cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling, acc)
        q_nope = q[..., :nope]
        q_rope = apply_rope(q[..., nope:], cos[:, None], sin[:, None], interleaved=cfg.rope_interleave)
        k_rope = apply_rope(c[..., lat:], cos, sin, interleaved=cfg.rope_interleave)
        if cache.latent_scale is None:
            cache = MLAState(
                jax.lax.dynamic_update_slice_in_dim(cache.latent, latent.astype(cache.latent.dtype), pos, axis=1),
                jax.lax.dynamic_update_slice_in_dim(cache.k_rope, k_rope.astype(cache.k_rope.dtype), pos, axis=1))
        else:
            cache = _write_fp8(cache, latent, k_rope, pos)
        s_len = cache.latent.shape[1]
        mask = jnp.arange(s_len)[None, :] <= positions[:, None]               # [T, S]
        if self.mla_kernel == "pallas" and t <= mla_decode.MAX_T:
            o = self._attend_pallas(q_nope, q_rope, cache, pos)
        elif t < ABSORB_MAX_TOKENS:
            o = self._attend_absorbed(q_nope, q_rope, cache, mask)
        else:
            o = self._attend_expanded(q_nope, q_rope, cache, mask)
        gate = head_gate(x, self.g_proj[...])                                # [B, T, H]
        o = (o.astype(acc) * gate[..., None]).astype(x.dtype)
        if self._kernel("dense", b * t):
            return dense_proj.dense_matmul(o, self.dense, k_axes=2, x_bound=self.o_bound), cache
        return jnp.einsum("bthv,hvd->btd", o, self.dense[...]), cache

    def _kernel(self, name, tokens):
        return dense_proj.uses_kernel(self, name, tokens)

    def _softmax(self, scores, mask, t_axis: int = 2):
        """Softmax over the last axis (S) of scores [B, H, T, S] (t_axis 2) or [B, T, H, S] (t_axis
        1); mask [T, S]."""
        m = mask[None, None] if t_axis == 2 else mask[None, :, None]
        scores = jnp.where(m, scores * self.cfg.attention_scale, -jnp.inf)
        return jax.nn.softmax(scores, axis=-1)

    def _attend_expanded(self, q_nope, q_rope, cache: MLAState, mask):
        """Naive MLA: k_nope, v = kv_b(latent) per head over the whole cache. Returns [B, T, H, V]."""
        nope = self.cfg.qk_nope_head_dim
        acc = acc_dtype(q_nope.dtype)
        latent = cache.latent
        if cache.latent_scale is not None:   # fp8 cache: dequantise (prefill is not bound by cache reads)
            latent = (latent.astype(acc) * cache.latent_scale[..., None]).astype(q_nope.dtype)
        kv = jnp.einsum("bsl,lhe->bshe", latent, self.kv_b[...])
        k_nope, v = kv[..., :nope], kv[..., nope:]
        scores = (jnp.einsum("bthn,bshn->bhts", q_nope, k_nope, preferred_element_type=acc)
                  + jnp.einsum("bthr,bsr->bhts", q_rope, cache.k_rope, preferred_element_type=acc))
        p = self._softmax(scores, mask)
        return jnp.einsum("bhts,bshv->bthv", p.astype(v.dtype), v, preferred_element_type=acc)

    def _attend_absorbed(self, q_nope, q_rope, cache: MLAState, mask):
        """Absorbed MLA: q_lat = q_nope . W_uk, attend over latents, o = o_lat . W_uv. [B, T, H, V].
        Scores and probabilities stay [B, T, H, S], the order the query rows have: no transposes
        of the [T H, S] score matrices between the dots and the softmax."""
        nope = self.cfg.qk_nope_head_dim
        acc = acc_dtype(q_nope.dtype)
        kv_b = self.kv_b[...]
        q_lat = jnp.einsum("bthn,lhn->bthl", q_nope.astype(acc), kv_b[..., :nope].astype(acc))
        lat = cache.latent
        if cache.latent_scale is not None:   # fp8 cache: per-token scale folded into scores / probabilities
            scale = cache.latent_scale[:, None, None, :].astype(acc)            # [B, 1, 1, S]
            lat = lat.astype(q_nope.dtype)
            scores = (jnp.einsum("bthl,bsl->bths", q_lat.astype(lat.dtype), lat, preferred_element_type=acc) * scale
                      + jnp.einsum("bthr,bsr->bths", q_rope, cache.k_rope, preferred_element_type=acc))
            p = self._softmax(scores, mask, t_axis=1)
            o_lat = jnp.einsum("bths,bsl->bthl", (p * scale).astype(lat.dtype), lat, preferred_element_type=acc)
            return jnp.einsum("bthl,lhv->bthv", o_lat, kv_b[..., nope:].astype(acc))
        scores = (jnp.einsum("bthl,bsl->bths", q_lat.astype(lat.dtype), lat, preferred_element_type=acc)
                  + jnp.einsum("bthr,bsr->bths", q_rope, cache.k_rope, preferred_element_type=acc))
        p = self._softmax(scores, mask, t_axis=1)
        o_lat = jnp.einsum("bths,bsl->bthl", p.astype(lat.dtype), lat, preferred_element_type=acc)
        return jnp.einsum("bthl,lhv->bthv", o_lat, kv_b[..., nope:].astype(acc))


    def _attend_pallas(self, q_nope, q_rope, cache: MLAState, pos):
        """The absorbed attention on the Pallas kernel (same q_lat and W_uv as `_attend_absorbed`).
        Returns [B, T, H, V] float32."""
        nope = self.cfg.qk_nope_head_dim
        b, t, h, _ = q_nope.shape
        if cache.latent_scale is not None or cache.latent.dtype != jnp.bfloat16:
            raise ValueError(f"mla_kernel='pallas' reads a bfloat16 latent cache; this cache is "
                             f"{jnp.dtype(cache.latent.dtype).name}: use mla_kernel='xla'")
        if kernels.current_mesh() is not None:
            raise ValueError("mla_kernel='pallas' is not split over a device mesh yet; use mla_kernel='xla'")
        acc = acc_dtype(q_nope.dtype)
        # both products over the whole of kv_b [L, H, nope + V] (q_nope padded with zero columns, the
        # output's first nope columns dropped: the same sums): sliced into W_uk / W_uv, XLA spent a
        # kernel per call on the halves (a float32 copy of both, 16.8 MB written and read back at the
        # Ling shape; with bf16 kv_b a copy of each). Held in bf16 (param_layout.LING_DEQUANTISED_AT_LOAD),
        # the two dots read kv_b as it is (deviceless H200 compile, bench/xla_kernels.py, session 25).
        kv_b = self.kv_b[...]
        q_full = jnp.pad(q_nope.astype(kv_b.dtype), ((0, 0),) * 3 + ((0, kv_b.shape[-1] - nope),))
        q_lat = jnp.einsum("bthe,lhe->bthl", q_full, kv_b, preferred_element_type=acc)
        rows = lambda a: a.astype(jnp.bfloat16).reshape(b, t * h, -1)      # noqa: E731  [B, T*H, .], t-major
        _, s_len, lat = cache.latent.shape
        wgs = mla_decode.warpgroups_for(lat, cache.k_rope.shape[-1], s_len)   # explicit: part of the trace key
        o_lat = kernels.shared_call(mla_decode.mla_decode_attention_pallas, rows(q_lat), rows(q_rope), cache.latent,
                                    cache.k_rope, pos, heads=h, scale=float(self.cfg.attention_scale),
                                    warpgroups=wgs, interpret=kernels.interpret_arg("mla_kernel"))
        return jnp.einsum("bthl,lhe->bthe", o_lat.reshape(b, t, h, -1), kv_b.astype(acc))[..., nope:]


def mla_output_bound(latent_norm_weight, kv_b, nope: int) -> float | None:
    """A number no |o| of the gated MLA's output projection input exceeds, for any input: o = gate *
    sum_l o_lat[l] W_uv[l, h, v] with W_uv = kv_b[..., nope:], the gate in (0, 1) and o_lat a
    softmax-weighted mean of cached latents (absorbed, Pallas or expanded alike), each at most
    `rms_norm_bound`(latent norm weight) in size, so |o| <= that bound * max over (h, v) of
    sum_l |W_uv[l, h, v]|. The latent bound's factor 2 covers the roundings (bf16 / fp8 cache,
    bf16 probabilities summing to just over 1, the float32 products). None for abstract weights.
    kv_b: a parameter or an array (models hold it dequantised: param_layout.LING_DEQUANTISED_AT_LOAD)."""
    lat = rms_norm_bound(latent_norm_weight)
    w = kv_b.get_value() if isinstance(kv_b, nnx.Variable) else kv_b
    if lat is None or isinstance(w, (jax.ShapeDtypeStruct, jax.core.Tracer)):
        return None
    w_uv = np.abs(np.asarray(w, np.float32)[..., nope:])
    return float(lat * w_uv.sum(axis=0).max()) if w_uv.size else 0.0


def _write_fp8(cache: MLAState, latent, k_rope, pos) -> MLAState:
    """Write a block's latent [B, T, L] (quantised per token) and rope key [B, T, R] at pos."""
    q, scale = quantize_fp8_per_token(latent)
    return MLAState(jax.lax.dynamic_update_slice_in_dim(cache.latent, q, pos, axis=1),
                    jax.lax.dynamic_update_slice_in_dim(cache.k_rope, k_rope.astype(cache.k_rope.dtype), pos, axis=1),
                    jax.lax.dynamic_update_slice_in_dim(cache.latent_scale, scale, pos, axis=1))
