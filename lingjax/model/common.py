"""Building blocks shared by Ling and the DSpark draft: parameters with logical axes, Linear,
RMSNorm, and rotary embeddings (interleaved for MLA, rotate-half for the draft).

Every parameter is an `nnx.Param` carrying `logical=(axis names...)`; `lingjax.sharding` maps those
names onto a device mesh. Logical names used: 'vocab', 'embed', 'heads', 'kv_heads', 'head_dim',
'experts', 'mlp', 'latent', None (replicated).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lingjax.config import RopeScaling, yarn_get_mscale


def acc_dtype(dtype) -> jnp.dtype:
    """Dtype for 'fp32 in the published code' math: float32, or float64 when running in x64."""
    return jnp.promote_types(dtype, jnp.float32)


def param(rngs: nnx.Rngs | None, shape, logical, dtype, init: str = "normal", std: float = 0.02) -> nnx.Param:
    """A parameter with logical axis names. init: 'normal' (std), 'ones', 'zeros'."""
    assert len(shape) == len(logical), (shape, logical)
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical=tuple(logical))


class RMSNorm(nnx.Module):
    """Normalise in fp32 over the last dim, cast back to the input dtype, multiply by the weight.
    ``bound``: a static bound on every output's size (`rms_norm_bound` of the weight), recorded by
    `record_bounds` (`record_input_bounds`); None until then. Layers pass it to the fp8 kernels as
    ``x_bound``."""
    BOUND_WEIGHTS = ("weight",)     # what record_bounds reads (bench/xla_kernels.py makes them concrete)

    def __init__(self, dim: int, eps: float, *, dtype, logical=("embed",)):
        self.eps = eps
        self.weight = param(None, (dim,), logical, dtype, init="ones")
        self.bound = None

    def record_bounds(self):
        """Record ``bound`` from the weight as it is now (None for an abstract weight)."""
        self.bound = rms_norm_bound(self.weight.get_value())

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)


def rms_norm(x, weight, eps: float):
    xf = x.astype(acc_dtype(x.dtype))
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


def rms_norm_bound(weight) -> float | None:
    """A number no |rms_norm(x, weight, eps)| exceeds, for any x and eps >= 0 (nor |rms_norm(...) *
    g| for |g| <= 1): each normalised element is at most sqrt(n) in size (its square is at most the
    n-element sum of squares, n = weight.size), times max |weight|; the factor 2 covers the bf16
    roundings of the normalised value and of the product. From a concrete weight (a Python float:
    a constant in the traced step, so no kernel computes it); None for an abstract one (shapes only)."""
    if isinstance(weight, jax.ShapeDtypeStruct) or isinstance(weight, jax.core.Tracer):
        return None
    w = np.abs(np.asarray(weight, np.float32))
    return float(2.0 * math.sqrt(w.size) * w.max()) if w.size else 0.0


def record_input_bounds(model: nnx.Module) -> nnx.Module:
    """Run every module's ``record_bounds()``, in place: each records the static bounds it derives
    from its weights as they are now (RMSNorm: ``bound``; KDA: ``o_bound`` of its output norm;
    GatedMLA: ``o_bound`` of its output projection's input) and lists the weights it reads in its
    class's ``BOUND_WEIGHTS``. The layers pass these static bounds to the fp8 skinny GEMM and MoE
    kernels as ``x_bound``, which spares each call a reduction over its input
    (pallas_kernels.common.f16_rows). Called by set_dense_kernel and
    set_moe_kernel (after loading or quantising); call it again after changing a norm weight: a
    stale bound more than 2x too small makes the kernels' f16 inputs overflow to inf (loudly).
    Returns `model`."""
    for _, m in nnx.iter_modules(model):
        if hasattr(m, "record_bounds"):
            m.record_bounds()
    return model


def bound_arg(bound):
    """A recorded bound (float or None) as the kernels' x_bound argument: a float32 constant or None."""
    return None if bound is None else jnp.float32(bound)


# A per-head sigmoid gate of a call of at most this many tokens (KDA's beta, gated MLA's output
# gate) is computed as a product summed over D, not a dot: with the weight stored K-minor [H, D]
# (as published) XLA emits one row reduction with the sigmoid fused into it. As dots over the
# [D, H] weights they were stored as before session 22, XLA made them a column reduction at M = 1
# (3.9 / 3.8 us per KDA / MLA layer) and a GEMM, a split-K sum and a sigmoid kernel at M = 9 (4.0
# us in three kernels per KDA layer): session-21 / -17 layer profiles (runs 81, 67). As reductions
# (session 22, run 84, with the conv window from the kernel): one KDA layer 71.3 -> 65.8 us at M = 9
# (verify + commit), 46.1 -> 38.1 at M = 1; one MLA layer at M = 1 60.6 -> 56.5 us. Longer calls
# (prefill) take the dot (the product would be [T, H, D]).
GATE_REDUCE_MAX_TOKENS = 16


def head_gate(x, w, *, logits: bool = False):
    """sigmoid(x w^T): x [B, T, D], w [H, D] (K-minor) -> [B, T, H] in the accumulation dtype
    (see GATE_REDUCE_MAX_TOKENS for how it is computed); logits=True: x w^T, the sigmoid left to
    the consumer (the fused KDA step applies it in its kernel)."""
    acc = acc_dtype(x.dtype)
    w = w.astype(acc)
    if x.shape[0] * x.shape[1] <= GATE_REDUCE_MAX_TOKENS:
        z = jnp.sum(x.astype(acc)[:, :, None, :] * w, axis=-1)
    else:
        z = jnp.einsum("btd,hd->bth", x.astype(acc), w)
    return z if logits else jax.nn.sigmoid(z)


# ---- rotary embeddings -----------------------------------------------------------------------
def rope_inv_freq(dim: int, theta: float, scaling: RopeScaling | None = None, dtype=jnp.float32):
    """inv_freq [dim/2] = theta^(-arange(0, dim, 2)/dim), YaRN-blended when `scaling` is given."""
    exps = jnp.arange(0, dim, 2, dtype=dtype) / dim
    inv_freq = 1.0 / (theta ** exps)
    if scaling is None:
        return inv_freq
    # YaRN (DeepSeek-V2 style): interpolate low frequencies, keep high ones.
    extra = inv_freq
    inter = inv_freq / scaling.factor
    low, high = _yarn_correction_range(scaling.beta_fast, scaling.beta_slow, dim, theta,
                                       scaling.original_max_position_embeddings)
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=dtype) - low) / max(high - low, 1e-3), 0.0, 1.0)
    mask = 1.0 - ramp
    return inter * (1.0 - mask) + extra * mask


def _yarn_correction_range(beta_fast, beta_slow, dim, base, max_pos):
    def dim_for(rot):
        return (dim * math.log(max_pos / (rot * 2 * math.pi))) / (2 * math.log(base))
    low = math.floor(dim_for(beta_fast))
    high = math.ceil(dim_for(beta_slow))
    return max(low, 0), min(high, dim - 1)


def rope_cos_sin(positions, dim: int, theta: float, scaling: RopeScaling | None = None, dtype=jnp.float32):
    """cos, sin [..., dim] for integer positions [...]: cat(freqs, freqs) layout (rotate-half)."""
    inv_freq = rope_inv_freq(dim, theta, scaling, dtype)
    freqs = positions.astype(dtype)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    mscale = 1.0
    if scaling is not None:
        mscale = yarn_get_mscale(scaling.factor, scaling.mscale) / yarn_get_mscale(scaling.factor, scaling.mscale_all_dim)
    return jnp.cos(emb) * mscale, jnp.sin(emb) * mscale


def rotate_half(x):
    h = x.shape[-1] // 2
    return jnp.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def apply_rope(x, cos, sin, interleaved: bool):
    """x [..., T, heads, dim] or [..., T, dim] with cos/sin [..., T, dim] broadcast over heads.

    interleaved=True (Ling MLA): pairs (x[2i], x[2i+1]) are de-interleaved to
    [x0, x2, ..., x1, x3, ...] first; the result stays in that order (q and k alike).
    """
    if interleaved:
        d = x.shape[-1]
        x = x.reshape(*x.shape[:-1], d // 2, 2).swapaxes(-1, -2).reshape(x.shape)
    dtype = x.dtype
    xf = x.astype(cos.dtype)
    return (xf * cos + rotate_half(xf) * sin).astype(dtype)
