"""Kimi Delta Attention layer (spec/kda.md): fused q/k/v/f/g projection, depthwise causal conv +
SiLU on q/k/v, L2-normalised q/k, safe (or softplus) gate, beta, the delta-rule recurrence
(chunked for T > 1, one step for T = 1), gated per-head RMSNorm, o_proj. The recurrence runs in
the accumulation dtype whatever the cache stores (bf16 with ApproxModes.bf16_kda_state).

The recurrence runs on one of two kernels (``kda_kernel``, XLA by default):
  "xla"    lingjax.ops.kda everywhere: kda_step (decode), kda_chunked (prefill / verify),
           kda_state_after_prefix (commit).
  "pallas" the fused Mosaic GPU step (pallas_kernels/kda_step_fused.py: conv, SiLU, L2 norms,
           gate and the recurrence in one launch per layer) for decode (T = 1), for the outputs of a
           pending verify block (T <= 16) and for its commit (a replay of the block with g = 0,
           beta = 0 past the accepted prefix: exact identity updates in the kernel; a model
           without the short conv, kernel size 1, keeps the XLA path for these); and the
           chunked prefill kernel (pallas_kernels/kda_prefill.py) for every other T > 1 forward
           (prefill chunks) of a bfloat16 model with the safe gate (g >= -9 per token, which its
           in-chunk decay factors need) and head_dim 64 or 128. That kernel multiplies bf16 q / k / v (WGMMA operands), so
           it rounds the fp32 L2-normalised q, k to bf16: the KDA outputs move by ~3e-3 relative
           (its accuracy bar is 5e-3 vs float64); a float32 model keeps kda_chunked for prefill,
           as does a model with Kimi's unbounded softplus gate. Needs an NVIDIA Hopper GPU, float32
           accumulation (a bfloat16 / float32 model) and head_dim % 64 == 0. On a CPU backend it
           only runs in interpret mode, when traced inside ``kernels.pallas_interpret()`` (tests). On a
           device mesh (traced inside ``kernels.kernel_mesh(mesh)``, as the Decoder does for sharded
           params) each device runs the kernel on its own heads under ``jax.shard_map``: heads are
           split over 'tp' like the KDA parameters and state, every other mesh axis replicates.

The projections w_in and w_out follow the separate ``dense_kernel`` switch (lingjax/model/dense.py).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from lingjax.cache import KDAState
from lingjax.config import LingConfig
from lingjax.model import dense, kernels
from lingjax.model.common import acc_dtype, head_gate, param, rms_norm, rms_norm_bound
from lingjax.ops import kda as kda_ops
from pallas_kernels import kda_prefill, kda_step_fused

KDA_KERNELS = ("xla", "pallas")


class KDAPending(NamedTuple):
    """What committing an accepted prefix of a verified block needs (replay design, docs/ARCHITECTURE)."""
    start: KDAState      # state and conv window before the block
    k: jax.Array         # [B, T, H, K] normalised keys (acc dtype)
    v: jax.Array         # [B, T, H, V]
    g: jax.Array         # [B, T, H, K] log decay
    beta: jax.Array      # [B, T, H]
    conv_in: jax.Array   # [B, ks-1+T, 3, H, K] conv window followed by the block's projected inputs


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("start", "proj", "beta", "conv_w", "A_log", "dt_bias"),
                   meta_fields=("safe_gate", "lower_bound"))
@dataclasses.dataclass(frozen=True)
class KDAPendingFused:
    """What committing an accepted prefix through the fused Pallas step needs: the block's inputs and
    the layer's gate / conv parameters, so the commit replays the block (tokens past the prefix are
    identity updates) from the start state."""
    start: KDAState      # state and conv window before the block
    proj: jax.Array      # [B, T, 5, H, K] the block's input projection
    beta: jax.Array      # [B, T, H] logits: x w_beta before the sigmoid (the kernel applies it)
    conv_w: jax.Array    # [ks, 3, H, K]
    A_log: jax.Array     # [H]
    dt_bias: jax.Array   # [H, K]
    safe_gate: bool
    lower_bound: float


# heads dim of the fused step's array arguments: proj, window, conv_w, A_log, dt_bias, beta, state
_STEP_HEAD_AXES = (3, 3, 2, 0, 0, 2, 1)
# The fused decode step and the commit update the float32 state in place (a jax.new_ref operand the
# kernel overwrites: `kda_fused_step_pallas(state_in_place=True)`) instead of writing a new array;
# the same values either way. H200, full depth fp8 with every kernel (session 19, run 72): the
# commit's device-to-device copies 71 -> 36 per DSpark step (116 -> 35 us), plain decode 4.237 ->
# 4.172 ms/step, DSpark 8.823 -> 8.791. On by default; a trace-time setting for A/B runs. Not
# used under a device mesh (the kernels under shard_map keep a separate state output: the in-place
# form has not run on several GPUs).
STATE_IN_PLACE = True
# The fused decode step and the commit also write the conv window after the block (or after the
# accepted prefix) from the rows they hold in SMEM (`kda_fused_step_pallas(write_window=True)`)
# instead of an XLA slice kernel after them (~1.2 us each in the session-21 layer profile, run 81),
# the same values (a copy). On: its GPU tests pass on the H200 and, same host, full depth fp8
# DSpark 8.500 -> 8.422 ms/step, plain decode 3.886 -> 3.869 (session 22, runs 83-84 in
# docs/device_notes.md). A trace-time setting.
WINDOW_FROM_KERNEL = True

# (ndim, heads dim) of the fused step's outputs: o [B,T,H,V], state [B,H,K,V], window [B,W,3,H,K]
_O_HEADS, _STATE_HEADS, _WINDOW_HEADS = (4, 2), (4, 1), (5, 3)


def _state_in_place() -> bool:
    """STATE_IN_PLACE, off under a device mesh (see its comment)."""
    return bool(STATE_IN_PLACE) and kernels.current_mesh() is None


def _fused_decode(*args, **settings):
    """(o, state[, window]) of a decode step (pallas_kernels.kda_step_fused)."""
    return kda_step_fused.kda_fused_step_pallas(*args, **settings)


def _fused_verify(*args, **settings):
    """o of a pending verify block; its final state is never used, so it is not written."""
    return kda_step_fused.kda_fused_step_pallas(*args, write_state=False, **settings)[0]


def _fused_commit(*args, **settings):
    """The state (and with write_window the conv window) after the accepted prefix of a verified
    block; its outputs are not written."""
    out = kda_step_fused.kda_fused_step_pallas(*args, write_o=False, **settings)
    return out[1:] if settings.get("write_window") else out[1]


def check_kda_kernel(kernel: str, cfg: LingConfig | None = None, dtype=None) -> str:
    """Validate a kda_kernel value (and, given cfg / dtype, that the Pallas kernel supports them)."""
    if kernel not in KDA_KERNELS:
        raise ValueError(f"kda_kernel must be one of {', '.join(map(repr, KDA_KERNELS))}, got {kernel!r}")
    if kernel == "pallas":
        if cfg is not None and cfg.head_dim % 64:
            raise ValueError(f"kda_kernel='pallas' needs head_dim % 64 == 0 (WGMMA rows), got "
                             f"head_dim={cfg.head_dim}; use kda_kernel='xla'")
        if dtype is not None and acc_dtype(dtype) != jnp.float32:
            raise ValueError(f"kda_kernel='pallas' accumulates in float32; a {jnp.dtype(dtype).name} model "
                             "(float64 accumulation) needs kda_kernel='xla'")
    return kernel


def set_kda_kernel(model: nnx.Module, kernel: str) -> nnx.Module:
    """Switch every KDA layer of `model` (e.g. one built by a checkpoint loader) to `kernel`, in
    place; call it before the model is split / jitted (the choice is static). Returns `model`."""
    for _, m in nnx.iter_modules(model):
        if isinstance(m, KDA):
            m.kda_kernel = check_kda_kernel(kernel, m.cfg, m.A_log.get_value().dtype)   # acc dtype (w_in may be fp8)
    return model


def _pallas(fn, *args, head_axes, out_head_axes, **settings):
    """Call a KDA kernel: compiled on a GPU, interpreted inside `pallas_interpret`, and under
    `kernel_mesh(mesh)` split over the mesh's 'tp' axis by heads. `head_axes`: the heads dim of
    each arg (None: a replicated scalar); `out_head_axes`: (ndim, heads dim) of each output, or one
    such pair for a single output; `settings`: the kernel's static keyword settings."""
    call = functools.partial(kernels.shared_call, fn, interpret=kernels.interpret_arg("kda_kernel"), **settings)
    mesh = kernels.current_mesh()
    if mesh is None:
        return call(*args)
    heads = args[0].shape[head_axes[0]]
    tp = mesh.shape.get("tp", 1)
    if heads % tp:
        raise ValueError(f"kda_kernel='pallas' on a mesh splits heads over 'tp': {heads} heads are not "
                         f"divisible by tp={tp}; use a tp that divides {heads}")

    def spec(ndim, axis):
        return P(*[("tp" if tp > 1 and d == axis else None) for d in range(ndim)])
    in_specs = tuple(P() if a is None else spec(x.ndim, a) for x, a in zip(args, head_axes))
    out_specs = (spec(*out_head_axes) if isinstance(out_head_axes[0], int)
                 else tuple(spec(*o) for o in out_head_axes))
    return jax.shard_map(call, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)


class KDA(nnx.Module):
    DENSE_WEIGHTS = (("w_in", -1), ("w_out", -2))  # dense_kernel projections, K-minor (lingjax/model/dense.py)
    BOUND_WEIGHTS = ("o_norm",)                     # what record_bounds reads (bench/xla_kernels.py)

    def __init__(self, cfg: LingConfig, *, dtype, rngs, kda_kernel: str = "xla"):
        d, h, k, ks = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.short_conv_kernel_size
        acc = acc_dtype(dtype)
        self.cfg = cfg
        self.kda_kernel = check_kda_kernel(kda_kernel, cfg, dtype)
        # q, k, v, f, g projections fused, K-minor as published: [5, H, K, D]
        self.w_in = param(rngs, (5, h, k, d), (None, "heads", "head_dim", "embed"), dtype, std=d ** -0.5)
        self.w_beta = param(rngs, (h, d), ("heads", "embed"), dtype, std=d ** -0.5)   # K-minor, as published
        self.conv = param(rngs, (ks, 3, h, k), (None, None, "heads", "head_dim"), dtype, std=ks ** -0.5)
        self.A_log = param(rngs, (h,), ("heads",), acc, std=0.5)
        self.dt_bias = param(rngs, (h, k), ("heads", "head_dim"), acc, std=0.5)
        self.o_norm = param(None, (k,), (None,), dtype, init="ones")
        self.w_out = param(rngs, (d, h, k), ("embed", "heads", "head_dim"), dtype, std=(h * k) ** -0.5)
        self.o_bound = None     # static bound on o_proj's input (the gated norm), recorded from o_norm

    def record_bounds(self):
        """Record ``o_bound``, the `rms_norm_bound` of o_norm as it is now (None for an abstract
        weight): the fp8 output projection's x_bound (lingjax.model.common.record_input_bounds)."""
        self.o_bound = rms_norm_bound(self.o_norm.get_value())

    def __call__(self, x, cache: KDAState, *, pending: bool = False, valid_len=None, x_bound=None):
        """x [B, T, D] -> (y [B, T, D], new KDAState) or, with pending=True (speculative verify),
        (y, KDAPending) leaving the state untouched until `commit_prefix` knows the accepted length.

        valid_len (traced int, optional): only the first valid_len tokens are real (a prompt padded
        to a compiled length); the rest become identity updates (gate 0, beta 0) and the conv
        window ends at valid_len. Outputs past valid_len are meaningless.
        x_bound: a static bound on |x| (the input norm's ``bound``) or None, for the fp8 kernels."""
        cfg = self.cfg
        acc = acc_dtype(x.dtype)
        b, t, _ = x.shape
        if dense.uses_kernel(self, "w_in", b * t):
            proj = dense.dense_matmul(x.astype(self.w_in.dtype), self.w_in, k_axes=-1,
                                      x_bound=x_bound)                      # [B, T, 5, H, K]
        else:
            w_in = self.w_in[...]
            proj = jnp.einsum("btd,chkd->btchk", x.astype(w_in.dtype), w_in)   # [B, T, 5, H, K]
        conv_in = jnp.concatenate([cache.conv, proj[:, :, :3]], axis=1)     # [B, ks-1+T, 3, H, K]
        step_kernel = self._step_kernel(t, pending)
        # [B, T, H]; the fused step takes the logits and applies the sigmoid itself (one XLA kernel fewer)
        beta = head_gate(x, self.w_beta[...], logits=step_kernel)
        s0 = widen_state(cache.state, acc)
        window = None               # the conv window after the block, when the fused step writes it
        if step_kernel:
            o, s, window = self._fused_step(proj, cache, beta, s0, pending, valid_len)
        else:
            q, k, v, g = kda_ops.kda_block_inputs(conv_in, proj[:, :, 3], self.conv[...], self.A_log[...],
                                                  self.dt_bias[...], safe_gate=cfg.kda_safe_gate,
                                                  lower_bound=cfg.kda_lower_bound)
            if valid_len is not None:
                real = jnp.arange(t) < valid_len
                g = jnp.where(real[None, :, None, None], g, 0.0)
                beta = jnp.where(real[None, :, None], beta, 0.0)
            if self._prefill_kernel(t, pending, x.dtype):
                o, s = _pallas(kda_prefill.kda_prefill_pallas, q, k, v, g, beta, s0,
                               head_axes=(2, 2, 2, 2, 2, 1), out_head_axes=((4, 2), (4, 1)))
            elif t == 1 and not pending:
                o, s = kda_ops.kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0)
                o = o[:, None]
            else:
                o, s = kda_ops.kda_chunked(q, k, v, g, beta, s0)
        y = self._output(o, proj[:, :, 4], x.dtype)
        if pending:
            if step_kernel:
                return y, KDAPendingFused(cache, proj, beta, *self._step_params(), cfg.kda_safe_gate,
                                          float(cfg.kda_lower_bound))
            return y, KDAPending(cache, k, v, g, beta, conv_in)
        s = store_state(s, cache.state.dtype)
        ks = cfg.short_conv_kernel_size
        if ks == 1:
            return y, KDAState(s, cache.conv)
        if window is not None:
            return y, KDAState(s, window.astype(cache.conv.dtype))
        if valid_len is not None:
            return y, KDAState(s, jax.lax.dynamic_slice_in_dim(conv_in, valid_len, ks - 1, axis=1))
        return y, KDAState(s, conv_in[:, t:t + ks - 1])

    def _step_kernel(self, t: int, pending: bool) -> bool:
        """Whether a forward of t tokens runs the fused Pallas step (decode, or a pending verify block)."""
        return (self.kda_kernel == "pallas" and (t == 1 or pending) and t <= kda_step_fused.MAX_T
                and self.cfg.short_conv_kernel_size > 1)

    def _step_params(self):
        return self.conv[...], self.A_log[...], self.dt_bias[...]

    def _fused_step(self, proj, cache: KDAState, beta, s0, pending: bool, valid_len):
        """The fused Pallas step: (o [B, T, H, V], state after the block, conv window after it), the
        last two None for a verify; the window also None unless WINDOW_FROM_KERNEL."""
        cfg = self.cfg
        args, head_axes = (proj, cache.conv, *self._step_params(), beta, s0), _STEP_HEAD_AXES
        settings = dict(safe_gate=cfg.kda_safe_gate, lower_bound=float(cfg.kda_lower_bound), beta_logits=True)
        if pending:
            return _pallas(_fused_verify, *args, head_axes=head_axes, out_head_axes=_O_HEADS, **settings), None, None
        if valid_len is not None:          # padded tokens become identity updates
            args, head_axes = args + (jnp.asarray(valid_len, jnp.int32),), head_axes + (None,)
        if WINDOW_FROM_KERNEL:
            return _pallas(_fused_decode, *args, head_axes=head_axes,
                           out_head_axes=(_O_HEADS, _STATE_HEADS, _WINDOW_HEADS),
                           state_in_place=_state_in_place(), write_window=True, **settings)
        o, s = _pallas(_fused_decode, *args, head_axes=head_axes, out_head_axes=(_O_HEADS, _STATE_HEADS),
                       state_in_place=_state_in_place(), **settings)
        return o, s, None

    def _prefill_kernel(self, t: int, pending: bool, dtype) -> bool:
        """Whether a forward of t tokens runs the chunked prefill kernel (module docstring)."""
        cfg = self.cfg
        return (self.kda_kernel == "pallas" and t > 1 and not pending and jnp.dtype(dtype) == jnp.bfloat16
                and cfg.kda_safe_gate and cfg.kda_lower_bound >= kda_prefill.MIN_LOG_DECAY
                and cfg.head_dim in kda_prefill.HEAD_DIMS)

    def _output(self, o, gate, dtype):
        """Gated per-head RMSNorm then o_proj: o [B, T, H, V] (acc), gate [B, T, H, K]."""
        o = rms_norm(o, self.o_norm[...].astype(o.dtype), self.cfg.rms_norm_eps)
        o = (o * jax.nn.sigmoid(gate.astype(o.dtype))).astype(dtype)        # |o| <= the norm's bound
        if dense.uses_kernel(self, "w_out", o.shape[0] * o.shape[1]):
            return dense.dense_matmul(o, self.w_out, k_axes=-2, x_bound=self.o_bound)
        return jnp.einsum("bthk,dhk->btd", o, self.w_out[...])


def widen_state(state, acc):
    """A state stored below the accumulation dtype (ApproxModes.bf16_kda_state) is updated in acc."""
    return state if state.dtype == acc else state.astype(acc)


def store_state(state, dtype):
    """Round an updated state to its cache's storage dtype (identity when they match)."""
    return state if state.dtype == dtype else state.astype(dtype)


def commit_prefix(p: KDAPending | KDAPendingFused, n) -> KDAState:
    """State and conv window after the first n tokens of a pending block (n traced, 0 <= n <= T)."""
    ks1 = p.start.conv.shape[1]
    if isinstance(p, KDAPendingFused):
        s0 = widen_state(p.start.state, p.A_log.dtype)     # A_log is in the accumulation dtype
        args = (p.proj, p.start.conv, p.conv_w, p.A_log, p.dt_bias, p.beta, s0, jnp.asarray(n, jnp.int32))
        settings = dict(head_axes=_STEP_HEAD_AXES + (None,), safe_gate=p.safe_gate, lower_bound=p.lower_bound,
                        state_in_place=_state_in_place(), beta_logits=True)
        if WINDOW_FROM_KERNEL:
            s, conv = _pallas(_fused_commit, *args, out_head_axes=(_STATE_HEADS, _WINDOW_HEADS),
                              write_window=True, **settings)
            return KDAState(store_state(s, p.start.state.dtype), conv.astype(p.start.conv.dtype))
        s = _pallas(_fused_commit, *args, out_head_axes=_STATE_HEADS, **settings)
        conv = kda_ops.conv_window_after(p.start.conv, p.proj, n)
    else:
        s0 = widen_state(p.start.state, p.k.dtype)     # k is in the accumulation dtype
        s = kda_ops.kda_state_after_prefix(s0, p.k, p.v, p.g, p.beta, n)
        conv = jax.lax.dynamic_slice_in_dim(p.conv_in, n, ks1, axis=1) if ks1 else p.start.conv
    return KDAState(store_state(s, p.start.state.dtype), conv)
