"""Feed-forward blocks: the dense SwiGLU MLP (first layers, shared expert) and the routed MoE.

The routed experts run on one of two kernels (``moe_kernel``, XLA by default):
  "xla"    lingjax.ops.moe everywhere: experts_gather below MOE_GATHER_MAX_TOKENS tokens,
           experts_capacity above.
  "pallas" the Mosaic GPU expert kernel (pallas_kernels/moe_experts.py) for calls of at most
           16 tokens (decode, a speculative verify block); prefill stays on XLA, and so does the
           router (a shared expert that cannot join the kernel, a DenseMLP, follows
           ``dense_kernel``: lingjax/model/dense.py).
           Streams block-fp8 (Fp8Weight, 128 x 128 blocks) or bfloat16 expert weights, each chosen
           expert once per call, and skips slots whose combine weight is 0
           (ApproxModes.expert_keep). The shared expert joins the same kernels as one more
           slot with weight 1 when it has the routed experts' intermediate size and weight kind
           (`shared_kernel_weights`; Ling-3.0-flash: yes), so routed + shared are summed in float32
           and rounded once. Computes in bf16 with float32
           accumulation whatever the model dtype (a float32 model's fp8 weights dequantise to
           bf16, not f32). Needs an NVIDIA Hopper GPU, hidden and expert intermediate sizes that
           are multiples of 128, and a bfloat16 / float32 model; float32 (unquantised) expert
           weights are refused. On a CPU backend it only runs in interpret mode, traced inside
           ``lingjax.model.kernels.pallas_interpret()`` (the one interpret switch of the model's
           Pallas kernels). Not split over devices: lingjax.loader refuses it with a mesh.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from lingjax.approx import ApproxModes
from lingjax.config import LingConfig
from lingjax.model import dense, kernels
from lingjax.model.common import acc_dtype, bound_arg, param, record_input_bounds
from lingjax.ops import moe as moe_ops
from lingjax.param_layout import Matrix
from lingjax.quant import Fp8Weight
from pallas_kernels import moe_experts

# Token counts at or above this use the capacity expert path (prefill); below it, gather.
MOE_GATHER_MAX_TOKENS = 64
MOE_KERNELS = ("xla", "pallas")
# The kernels' fp8 layouts (K-minor, as published: lingjax/param_layout.py)
_GU_VIEW, _DOWN_VIEW = Matrix((0, 1), (3,), (2,)), Matrix((0,), (2,), (1,))     # [E, 2, F, D], [E, D, F]


def check_moe_kernel(kernel: str, cfg: LingConfig | None = None, dtype=None) -> str:
    """Validate a moe_kernel value (and, given cfg / dtype, that the Pallas kernel supports them)."""
    if kernel not in MOE_KERNELS:
        raise ValueError(f"moe_kernel must be one of {', '.join(map(repr, MOE_KERNELS))}, got {kernel!r}")
    if kernel == "pallas":
        b = moe_experts.BLOCK
        if cfg is not None and (cfg.hidden_size % b or cfg.moe_intermediate_size % b):
            raise ValueError(f"moe_kernel='pallas' needs hidden_size and moe_intermediate_size that are "
                             f"multiples of {b}, got {cfg.hidden_size} and {cfg.moe_intermediate_size}; "
                             "use moe_kernel='xla'")
        if dtype is not None and acc_dtype(dtype) != jnp.float32:
            raise ValueError(f"moe_kernel='pallas' accumulates in float32; a {jnp.dtype(dtype).name} model "
                             "(float64 accumulation) needs moe_kernel='xla'")
    return kernel


def expert_kernel_weights(w_gate_up, w_down):
    """(w_gate_up, gu_scale, w_down, down_scale) arrays for moe_experts_pallas from a MoE's expert
    Params (bfloat16; scales None) or Fp8Weights (values + scale_inv in the kernel's layout).
    Raises ValueError, saying what to do, for anything else."""
    if isinstance(w_gate_up, Fp8Weight) and isinstance(w_down, Fp8Weight):
        for w, view in ((w_gate_up, _GU_VIEW), (w_down, _DOWN_VIEW)):
            if w.block != (moe_experts.BLOCK,) * 2 or w.view != view:
                raise ValueError(f"moe_kernel='pallas' needs 128 x 128 fp8 blocks in the published layout, "
                                 f"got block {w.block}, view {w.view}; use moe_kernel='xla'")
        return (w_gate_up.values.get_value(), w_gate_up.scale_inv.get_value(),
                w_down.values.get_value(), w_down.scale_inv.get_value())
    if isinstance(w_gate_up, Fp8Weight) or isinstance(w_down, Fp8Weight):
        raise ValueError("moe_kernel='pallas' needs both expert weights fp8 or both bfloat16, got one of each")
    gu, d = (w.get_value() if isinstance(w, nnx.Variable) else w[...] for w in (w_gate_up, w_down))
    if gu.dtype != jnp.bfloat16 or d.dtype != jnp.bfloat16:
        raise ValueError(f"moe_kernel='pallas' streams block-fp8 or bfloat16 expert weights, got "
                         f"{jnp.dtype(gu.dtype).name}: quantise the model (lingjax.quant.quantize_model), "
                         "load it in bfloat16, or use moe_kernel='xla'")
    return gu, None, d, None


def set_moe_kernel(model: nnx.Module, kernel: str) -> nnx.Module:
    """Switch every MoE layer of `model` (e.g. one built by a checkpoint loader, after any fp8
    quantisation) to `kernel`, in place; call it before the model is split / jitted (the choice is
    static). For 'pallas' the expert weights are checked too, and the norms' output bounds the
    kernels take as x_bound are recorded (lingjax.model.common.record_input_bounds). Returns `model`."""
    for _, m in nnx.iter_modules(model):
        if isinstance(m, MoE):
            m.moe_kernel = check_moe_kernel(kernel, m.cfg, m.expert_bias.get_value().dtype)   # acc dtype
            if kernel == "pallas":
                expert_kernel_weights(m.w_gate_up, m.w_down)
    return record_input_bounds(model)


_SHARED_GU_VIEW, _SHARED_DOWN_VIEW = Matrix((0,), (2,), (1,)), Matrix((), (1,), (0,))   # [2, F, D], [D, F]


def shared_kernel_weights(shared: "DenseMLP", w_gate_up, intermediate: int):
    """(w_gate_up [2, F, D], gu_scale | None, w_down [D, F], down_scale | None) of the shared
    expert for the expert kernel's extra slot, or None when it cannot join it: its intermediate
    size differs from the routed experts' F, or its weights are not of the routed experts' kind
    (both 128 x 128 block-fp8 in the published layout, or both bfloat16). A static rule: such a
    shared expert runs on its own (DenseMLP), the same math in separate calls."""
    gu, d = shared.w_gate_up, shared.w_down
    if isinstance(w_gate_up, Fp8Weight):
        ok = all(isinstance(a, Fp8Weight) and a.block == (moe_experts.BLOCK,) * 2 and a.view == v
                 for a, v in ((gu, _SHARED_GU_VIEW), (d, _SHARED_DOWN_VIEW)))
        if not ok or gu.values.get_value().shape[-2] != intermediate:
            return None
        return (gu.values.get_value(), gu.scale_inv.get_value(), d.values.get_value(), d.scale_inv.get_value())
    if isinstance(gu, Fp8Weight) or isinstance(d, Fp8Weight):
        return None
    gu, d = gu.get_value(), d.get_value()
    if gu.dtype != jnp.bfloat16 or d.dtype != jnp.bfloat16 or gu.shape[-2] != intermediate:
        return None
    return gu, None, d, None


def _pallas_experts(xf, idx, w, w_gate_up, w_down, limit, shared=None, x_bound=None):
    """moe_experts_pallas on the MoE's weights (and the shared expert's: ``shared``, the tuple of
    `shared_kernel_weights` + its clamp), x_bound the static bound on |xf| or None: compiled on a
    GPU, interpreted inside lingjax.model.kernels.pallas_interpret() (CPU tests)."""
    interpret = kernels.interpret_arg("moe_kernel")
    if kernels.current_mesh() is not None:
        raise ValueError("moe_kernel='pallas' is not split over devices (no shard_map over the experts); "
                         "use moe_kernel='xla' on a device mesh")
    gu, gu_scale, d, d_scale = expert_kernel_weights(w_gate_up, w_down)
    if shared is None:
        return kernels.shared_call(_routed_experts, xf, idx, w, gu, gu_scale, d, d_scale, bound_arg(x_bound),
                                   limit=limit, interpret=interpret)
    *sh, sh_limit = shared
    return kernels.shared_call(_experts_and_shared, xf, idx, w, gu, gu_scale, d, d_scale, *sh, bound_arg(x_bound),
                               limit=limit, shared_limit=sh_limit, interpret=interpret)


def _routed_experts(x, idx, w, gu, gu_scale, d, d_scale, x_bound, *, limit, interpret):
    """moe_experts_pallas with x_bound as a positional argument (shared_call's keyword settings are
    static)."""
    return moe_experts.moe_experts_pallas(x, idx, w, gu, gu_scale, d, d_scale, limit, x_bound=x_bound,
                                          k_minor=True, interpret=interpret)


def _experts_and_shared(x, idx, w, gu, gu_scale, d, d_scale, sh_gu, sh_gu_scale, sh_d, sh_d_scale, x_bound, *,
                        limit, shared_limit, interpret):
    """moe_experts_pallas with the shared expert's arrays and x_bound as positional arguments
    (shared_call's keyword settings are static)."""
    return moe_experts.moe_experts_pallas(x, idx, w, gu, gu_scale, d, d_scale, limit,
                                          shared=(sh_gu, sh_gu_scale, sh_d, sh_d_scale, shared_limit),
                                          x_bound=x_bound, k_minor=True, interpret=interpret)


class DenseMLP(nnx.Module):
    """down(silu(gate(x)) * up(x)); gate and up fused into w_gate_up [2, F, D], w_down [D, F] (the
    published K-minor orientation). Both projections follow `dense_kernel`
    (lingjax/model/dense.py) for calls of <= 16 tokens."""
    DENSE_WEIGHTS = (("w_gate_up", -1), ("w_down", -1))       # the last axis is contracted

    def __init__(self, hidden: int, inter: int, *, dtype, rngs, swiglu_limit: float | None = None):
        self.swiglu_limit = swiglu_limit
        self.w_gate_up = param(rngs, (2, inter, hidden), (None, "mlp", "embed"), dtype, std=hidden ** -0.5)
        self.w_down = param(rngs, (hidden, inter), ("embed", "mlp"), dtype, std=inter ** -0.5)

    def __call__(self, x, x_bound: float | None = None):
        """x [..., D] -> [..., D]; x_bound: a static bound on |x| (its RMSNorm's ``bound``) or None."""
        tokens = math.prod(x.shape[:-1])
        if dense.uses_kernel(self, "w_gate_up", tokens):
            h = dense.dense_matmul(x.astype(self.w_gate_up.dtype), self.w_gate_up, k_axes=-1, x_bound=x_bound)
        else:
            w = self.w_gate_up[...]
            h = jnp.einsum("...d,cfd->...cf", x.astype(w.dtype), w)
        a = moe_ops.swiglu(h[..., 0, :], h[..., 1, :], self.swiglu_limit)
        if dense.uses_kernel(self, "w_down", tokens):
            return dense.dense_matmul(a, self.w_down, k_axes=-1)
        return jnp.einsum("...f,df->...d", a, self.w_down[...])


class MoE(nnx.Module):
    """Sigmoid group-limited router + routed experts (w_gate_up [E, 2, F, D], w_down [E, D, F], the
    published K-minor orientation) + one unscaled shared expert.
    `approx` (lingjax/approx.py): expert_keep and bf16_router_head change the routing; off by default.
    `moe_kernel`: 'xla' | 'pallas' for the routed experts of calls of <= 16 tokens (module docstring)."""

    def __init__(self, cfg: LingConfig, layer: int, *, dtype, rngs, approx: ApproxModes = ApproxModes(),
                 moe_kernel: str = "xla"):
        d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        self.cfg = cfg
        self.approx = approx
        self.moe_kernel = check_moe_kernel(moe_kernel, cfg, dtype)
        self.limit = cfg.swiglu_limit(layer, shared=False)
        self.router = param(rngs, (d, e), ("embed", None), dtype, std=d ** -0.5)
        self.expert_bias = param(None, (e,), (None,), jnp.promote_types(dtype, jnp.float32), init="zeros")
        self.w_gate_up = param(rngs, (e, 2, f, d), ("experts", None, "mlp", "embed"), dtype, std=d ** -0.5)
        self.w_down = param(rngs, (e, d, f), ("experts", "embed", "mlp"), dtype, std=f ** -0.5)
        self.shared = DenseMLP(d, cfg.shared_intermediate_size, dtype=dtype, rngs=rngs,
                               swiglu_limit=cfg.swiglu_limit(layer, shared=True))

    def __call__(self, x, x_bound: float | None = None):
        """x [B, T, D] -> [B, T, D]; x_bound: a static bound on |x| (its RMSNorm's ``bound``) or None."""
        cfg = self.cfg
        b, t, d = x.shape
        xf = x.reshape(b * t, d)
        idx, w = moe_ops.route(xf, self.router[...], self.expert_bias[...], n_group=cfg.n_group,
                               topk_group=cfg.topk_group, top_k=cfg.num_experts_per_tok,
                               norm_topk_prob=cfg.norm_topk_prob,
                               routed_scaling_factor=cfg.routed_scaling_factor,
                               expert_keep=self.approx.expert_keep, bf16_logits=self.approx.bf16_router_head)
        if self.moe_kernel == "pallas" and b * t <= moe_experts.MAX_M:
            sh = shared_kernel_weights(self.shared, self.w_gate_up, cfg.moe_intermediate_size)
            if sh is not None:      # routed + shared experts in one pair of kernels
                y = _pallas_experts(xf, idx, w, self.w_gate_up, self.w_down, self.limit,
                                    shared=(*sh, self.shared.swiglu_limit), x_bound=x_bound)
                return y.reshape(b, t, d)
            routed = _pallas_experts(xf, idx, w, self.w_gate_up, self.w_down, self.limit, x_bound=x_bound)
        else:
            experts = moe_ops.experts_gather if b * t < MOE_GATHER_MAX_TOKENS else moe_ops.experts_capacity
            routed = experts(xf, idx, w, self.w_gate_up, self.w_down, self.limit)   # Param or Fp8Weight
        return (routed + self.shared(xf, x_bound)).reshape(b, t, d)
