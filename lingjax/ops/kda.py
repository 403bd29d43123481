"""Pure-JAX reference implementations of Kimi Delta Attention (KDA).

Shapes: B batch, T tokens, H heads, K key dim, V value dim. The recurrent state
per head is S in R^{K x V}. Per token (see shared spec kda.md):

    S <- diag(exp g_t) S;  u = beta_t (v_t - S^T k_t);  S <- S + k_t u^T;  o_t = S^T (scale q_t)

Everything is accumulated in ``promote(input dtype, float32)`` (float64 stays float64).
These are references / fallbacks: no Pallas, no Python loop over tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_HI = lax.Precision.HIGHEST


def _acc_dtype(*xs):
    """Accumulation dtype: the promoted input dtype, at least float32."""
    return jnp.promote_types(jnp.result_type(*[x for x in xs if x is not None]), jnp.float32)


def _scale(scale, k_dim):
    return k_dim ** -0.5 if scale is None else scale


# ----------------------------------------------------------------------------- gate / norm


def kda_gate(f, A_log, dt_bias, *, safe_gate=True, lower_bound=-5.0):
    """Per-channel log decay g (<= 0) from the raw gate projection.

    f: [..., H, K] (``W_f x`` per head); A_log: [H]; dt_bias: [H*K].
    safe gate: ``lower_bound * sigmoid(exp(A_log) * (f + dt_bias))`` in (lower_bound, 0);
    otherwise Kimi's ``-exp(A_log) * softplus(f + dt_bias)``. Returns [..., H, K] in fp32/fp64.
    """
    dt = _acc_dtype(f, A_log, dt_bias)
    H, K = f.shape[-2:]
    x = f.astype(dt) + dt_bias.astype(dt).reshape(H, K)
    a = jnp.exp(A_log.astype(dt))[:, None]
    if safe_gate:
        return lower_bound * jax.nn.sigmoid(a * x)
    return -a * jax.nn.softplus(x)


def l2_normalize(x, eps=1e-6):
    """x / sqrt(sum(x^2, -1) + eps), computed and returned in fp32 (fp64 for fp64 input)."""
    x = x.astype(_acc_dtype(x))
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_conv(window, w, t: int):
    """Depthwise causal conv. window [B, ks-1+T, C...] (history then inputs), w [ks, C...] -> [B, T, C...].

    y_t = sum_j w[j] * x_{t-ks+1+j}: output t reads window rows t .. t+ks-1; accumulated in fp32
    (fp64 for fp64 input), returned in the window's dtype.
    """
    ks = w.shape[0]
    acc = _acc_dtype(window)
    out = sum(window[:, j:j + t].astype(acc) * w[j].astype(acc) for j in range(ks))
    return out.astype(window.dtype)


# ----------------------------------------------------------------------------- recurrent


def _step(S, q, k, v, g, beta):
    """One token for all (b, h): S [B,H,K,V], q,k,g [B,H,K] (q pre-scaled), v [B,H,V], beta [B,H]."""
    S = jnp.exp(g)[..., :, None] * S
    kS = jnp.einsum("bhk,bhkv->bhv", k, S, precision=_HI)
    u = beta[..., None] * (v - kS)
    S = S + k[..., :, None] * u[..., None, :]
    o = jnp.einsum("bhk,bhkv->bhv", q, S, precision=_HI)
    return o, S


def kda_step(q, k, v, g, beta, state, scale=None):
    """Single-token decode step. q,k,g [B,H,K]; v [B,H,V]; beta [B,H]; state [B,H,K,V].

    Returns (o [B,H,V], new_state [B,H,K,V]) in the accumulation dtype.
    """
    dt = _acc_dtype(q, k, v, g, beta, state)
    q = q.astype(dt) * _scale(scale, q.shape[-1])
    o, S = _step(state.astype(dt), q, k.astype(dt), v.astype(dt), g.astype(dt), beta.astype(dt))
    return o, S


def kda_recurrent(q, k, v, g, beta, initial_state=None, scale=None):
    """Token-by-token KDA via lax.scan.

    q,k [B,T,H,K] (L2-normalised); v [B,T,H,V]; g [B,T,H,K] log decay; beta [B,T,H];
    initial_state [B,H,K,V] or None (zeros). Returns (o [B,T,H,V], final_state [B,H,K,V]).
    """
    dt = _acc_dtype(q, k, v, g, beta, initial_state)
    B, T, H, K = k.shape
    V = v.shape[-1]
    S0 = jnp.zeros((B, H, K, V), dt) if initial_state is None else initial_state.astype(dt)
    q = q.astype(dt) * _scale(scale, K)
    tm = lambda x: jnp.moveaxis(x.astype(dt), 1, 0)  # time-major

    def body(S, xs):
        o, S = _step(S, *xs)
        return S, o

    S, o = lax.scan(body, S0, (tm(q), tm(k), tm(v), tm(g), tm(beta)))
    return jnp.moveaxis(o, 0, 1), S


# ----------------------------------------------------------------------------- chunked


def _to_chunks(x, C):
    """[B,Tp,H,...] -> [N,B,H,C,...] (chunk-major, for the chunk-to-chunk scan)."""
    B, Tp, H = x.shape[:3]
    x = x.reshape(B, Tp // C, C, H, *x.shape[3:])
    return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)


def _kda_chunked_impl(q, k, v, g, beta, S0, scale, C):
    """Chunked KDA. q may be None (state only). Returns (o [B,T,H,V] or None, S [B,H,K,V])."""
    dt = _acc_dtype(q, k, v, g, beta, S0)
    B, T, H, K = k.shape
    V = v.shape[-1]
    S0 = jnp.zeros((B, H, K, V), dt) if S0 is None else S0.astype(dt)
    pad = (-T) % C
    # Padding tokens have k=v=q=g=beta=0: identity state updates, sliced away below.
    prep = lambda x: _to_chunks(
        jnp.pad(x.astype(dt), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)), C)
    k, v, g, beta = prep(k), prep(v), prep(g), prep(beta)   # [N,B,H,C,(K|V)], beta [N,B,H,C]

    G = jnp.cumsum(g, axis=-2)                              # in-chunk cumulative log decay
    # Pairwise decay exp(G_i - G_j): the difference is formed explicitly and masked to j <= i
    # *before* the exp, so every exponent is <= 0 (g <= 0) and nothing can overflow, however
    # strong the decay. Size [N,B,H,C,C,K] = C x the size of k; never T x T.
    idx = jnp.arange(C)
    incl = idx[:, None] >= idx[None, :]                     # j <= i
    strict = idx[:, None] > idx[None, :]                    # j <  i
    diff = G[..., :, None, :] - G[..., None, :, :]
    D = jnp.exp(jnp.where(incl[:, :, None], diff, -jnp.inf))

    Akk = jnp.einsum("...id,...jd,...ijd->...ij", k, k, D, precision=_HI)
    Akk = jnp.where(strict, beta[..., :, None] * Akk, 0.0)
    L = jnp.eye(C, dtype=dt) + Akk                          # unit lower triangular
    solve = lambda b: lax.linalg.triangular_solve(
        L, b, left_side=True, lower=True, unit_diagonal=True)
    Gam = jnp.exp(G)                                        # Gamma_r = exp(G_r) <= 1
    W = solve(beta[..., None] * Gam * k)                    # T (Gamma * K), T = (I+Akk)^-1 diag(beta)
    U = solve(beta[..., None] * v)                          # T V
    Kd = k * jnp.exp(G[..., -1:, :] - G)                    # K * exp(G_C - G), exponent <= 0
    GamC = Gam[..., -1, :]                                  # [N,B,H,K]

    if q is not None:
        q = prep(q) * _scale(scale, K)
        Aqk = jnp.einsum("...id,...jd,...ijd->...ij", q, k, D, precision=_HI)  # D is 0 for j > i
        Qg = q * Gam
    else:
        Aqk = Qg = jnp.zeros((k.shape[0], 0), dt)          # dummies, unused

    def body(S, xs):
        W, U, Kd, GamC, Qg, Aqk = xs
        Vp = U - jnp.einsum("bhck,bhkv->bhcv", W, S, precision=_HI)
        o = None
        if q is not None:
            o = (jnp.einsum("bhck,bhkv->bhcv", Qg, S, precision=_HI)
                 + jnp.einsum("bhij,bhjv->bhiv", Aqk, Vp, precision=_HI))
        S = GamC[..., None] * S + jnp.einsum("bhck,bhcv->bhkv", Kd, Vp, precision=_HI)
        return S, o

    S, o = lax.scan(body, S0, (W, U, Kd, GamC, Qg, Aqk))
    if q is None:
        return None, S
    o = jnp.moveaxis(jnp.moveaxis(o, 3, 2), 0, 1)           # [B,N,C,H,V]
    return o.reshape(B, -1, H, V)[:, :T], S


def kda_chunked(q, k, v, g, beta, initial_state=None, scale=None, chunk_size=16):
    """Chunked (WY / UT-transform) KDA; same contract as :func:`kda_recurrent`.

    Intra-chunk work is vectorised over all chunks; only the state pass is a lax.scan.
    T need not be a multiple of ``chunk_size`` (static).
    """
    return _kda_chunked_impl(q, k, v, g, beta, initial_state, scale, chunk_size)


def kda_state_after_prefix(state, k, v, g, beta, n, scale=None, chunk_size=16):
    """State after only the first n tokens of a block (speculative-decoding rollback).

    state [B,H,K,V]; k,g [B,T,H,K]; v [B,T,H,V]; beta [B,T,H]; n traced int32, 0 <= n <= T.
    Tokens t >= n get g=0, beta=0 (identity updates), so shapes stay static.
    ``scale`` is accepted for API symmetry (the state does not depend on it).
    """
    del scale
    keep = jnp.arange(k.shape[1]) < n                       # [T]
    g = jnp.where(keep[None, :, None, None], g, 0)
    beta = jnp.where(keep[None, :, None], beta, 0)
    C = min(chunk_size, k.shape[1])
    return _kda_chunked_impl(None, k, v, g, beta, state, None, C)[1]


# ----------------------------------------------------------------------------- numpy oracle


def kda_recurrent_numpy(q, k, v, g, beta, initial_state=None, scale=None):
    """Float64 numpy token loop (test oracle). Same contract as :func:`kda_recurrent`."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    B, T, H, K = k.shape
    V = v.shape[-1]
    S = (np.zeros((B, H, K, V)) if initial_state is None
         else np.array(initial_state, np.float64))
    q = q * _scale(scale, K)
    o = np.zeros((B, T, H, V))
    for t in range(T):
        S = np.exp(g[:, t])[..., None] * S
        u = beta[:, t, :, None] * (v[:, t] - np.einsum("bhk,bhkv->bhv", k[:, t], S))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        o[:, t] = np.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o, S


# ----------------------------------------------------------------------------- fused decode step


def kda_block_inputs(conv_in, f, conv_w, A_log, dt_bias, *, safe_gate=True, lower_bound=-5.0):
    """A KDA layer's recurrence inputs for a block of T tokens: conv + SiLU on q, k, v, L2-normalised
    q, k and the gate (what the model's XLA path, kda_fused_step and bench.kernels share).

    conv_in [B, ks-1+T, 3, H, K]: the conv window, then the block's q, k, v projections; f [B, T, H, K]
    the gate projection; conv_w [ks, 3, H, K]; A_log [H]; dt_bias [H, K] or [H*K].
    Returns q, k, v, g [B, T, H, K] in the accumulation dtype (fp32, fp64 for fp64 inputs).
    """
    qkv = jax.nn.silu(causal_conv(conv_in, conv_w, f.shape[1]))
    q = l2_normalize(qkv[:, :, 0])
    k = l2_normalize(qkv[:, :, 1])
    v = qkv[:, :, 2].astype(q.dtype)
    g = kda_gate(f, A_log, dt_bias.reshape(-1), safe_gate=safe_gate, lower_bound=lower_bound)
    return q, k, v, g


def kda_fused_step(proj, window, conv_w, A_log, dt_bias, beta, state, n=None, *, safe_gate=True,
                   lower_bound=-5.0, scale=None, beta_logits=False):
    """What a KDA layer computes between its input projection and its output norm for a short block
    (the XLA reference of pallas_kernels.kda_step_fused): :func:`kda_block_inputs`, then the
    recurrence from `state`.

    proj [B,T,P,H,K] (channels q, k, v, f, ...); window [B,ks-1,3,H,K] conv history; conv_w
    [ks,3,H,K]; A_log [H]; dt_bias [H,K]; beta [B,T,H] (sigmoid applied; beta_logits=True: before
    it); state [B,H,K,V]; n (traced int, optional): tokens t >= n are identity updates (g = 0,
    beta = 0). Returns (o [B,T,H,V], state after the block) in the accumulation dtype.
    """
    T = proj.shape[1]
    if beta_logits:
        beta = jax.nn.sigmoid(beta)
    conv_in = jnp.concatenate([window.astype(proj.dtype), proj[:, :, :3]], axis=1)
    q, k, v, g = kda_block_inputs(conv_in, proj[:, :, 3], conv_w, A_log, dt_bias,
                                  safe_gate=safe_gate, lower_bound=lower_bound)
    if n is not None:
        keep = jnp.arange(T) < n
        g = jnp.where(keep[None, :, None, None], g, 0)
        beta = jnp.where(keep[None, :, None], beta, 0)
    return kda_recurrent(q, k, v, g, beta, state, scale)


def conv_window_after(window, proj, n=None):
    """The short-conv window after the first n tokens of a block (n None: all T): rows n .. n+W-1
    of window ++ the block's q, k, v projections, the reference of the fused step's write_window.
    window [B, W, 3, H, K], proj [B, T, P >= 3, H, K], n traced int in [0, T] -> [B, W, 3, H, K]
    in window's dtype."""
    rows = jnp.concatenate([window, proj[:, :, :3].astype(window.dtype)], axis=1)
    return jax.lax.dynamic_slice_in_dim(rows, proj.shape[1] if n is None else n, window.shape[1], axis=1)
