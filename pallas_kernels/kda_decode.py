"""Fused KDA recurrent decode / verify kernel (Pallas Mosaic GPU, `plgpu.kernel`).

Same contract as :func:`lingjax.ops.kda.kda_recurrent` for a short block of T = 1..16 tokens:

    q, k, g [B,T,H,K]  (q, k already L2-normalised; g = per-channel log decay <= 0)
    v       [B,T,H,V]
    beta    [B,T,H]
    state   [B,H,K,V]  float32
    -> (o [B,T,H,V] float32, final state [B,H,K,V] float32)

Per token (shared spec kda.md):  S <- diag(exp g) S;  u = beta (v - S^T k);  S <- S + k u^T;
o = S^T (scale q).

Design
------
* Grid ``(B, H, V // block_v)``, one warpgroup (128 threads) per program. Column block j of the
  state, ``S[:, j*block_v:(j+1)*block_v]``, evolves independently of the other columns (every
  update only mixes rows through the full-length k, q, g, which each program loads whole), so the
  V axis is split to get enough programs: B=1, H=32, V=128, block_v=32 -> 128 programs.
* Per program, TMA brings into SMEM once: the state tile [K, block_v] (fp32), the T rows of
  q, k, beta*k, g ([T, K] each) and beta*v ([T, block_v]). All on separate single-arrival
  barriers.
* The state tile lives in registers in the WGMMA fragment layout for the whole block of tokens
  (K rows over the 4 warps, block_v columns within a warp). The recurrence is written with
  elementwise ops + one-axis reductions only (no dot / einsum / transposes inside the kernel):
    - K-vectors (q, k, beta*k, exp g) are loaded in ``WGMMA.reduce(1)`` ("row") layout and
      broadcast along columns: ``S * x[:, None]``;
    - ``S^T x = sum(S * x[:, None], axis=0)`` is a reduction over K (axis 0: cross-warp, Mosaic
      uses a small SMEM scratch) giving a ``WGMMA.reduce(0)`` ("column") vector of length block_v;
    - the rank-1 update ``k u^T = k[:, None] * u[None, :]`` broadcasts a row vector and a
      column vector.
* beta is folded in the XLA wrapper (``beta*k``, ``beta*v``: u = beta v - S^T (beta k)), so the
  kernel needs no scalar loads; exp(g) and the q scale are applied in-kernel.
* Outputs: o rows are stored to an SMEM [T, block_v] tile, the final state tile to SMEM, then one
  TMA store each (``commit_smem`` before the TMA, ``wait_smem_to_gmem(0)`` at the end). The state
  is read once and written once per block of T tokens.

Replay commit: :func:`kda_state_after_prefix_pallas` runs the same kernel with g = 0, beta = 0 on
the tokens past the accepted prefix. In this kernel such a token is exactly the identity
(exp(0) = 1; beta*k = beta*v = 0 so u = 0 and S + k*0 = S, for any finite S), so the state equals
the kernel's own state after only the prefix, bit for bit.

Status: runs on the H200 (jax 0.11.2): its GPU tests pass (tests/test_pallas_kda_decode.py, the
compiled kernel against the float64 oracle; ptxas 64-245 registers, no spills). In-loop time
(bench/kernels.py, docs/PERFORMANCE.md): T=1 16.6 us (XLA's kda_step 7.6 us: this kernel is the
slower one at T=1, latency-bound), verify T=9 18.8 us (XLA 62.4), commit 16.4 us (XLA 60.2).
On CPU (CI): interpret mode with race detection vs the XLA reference and the float64 oracle
(T in {1,3,9,16}, K=V in {64,128}, block_v in {16,32,64,128}) and cross-lowering for CUDA.
Used by the model only with ``kda_kernel="pallas"`` (lingjax/model/kda.py; the default is XLA):
decode, verify outputs, commit. A verify discards the final state, which the kernel still writes
(2 MiB per layer; a custom call's unused output is not eliminated) — a state-less variant would
save that.

API notes / pitfalls (the API used here is the same in jax 0.11.2 and 0.12.0.1):
* ``plgpu.kernel`` (not ``pl.pallas_call`` + ``CompilerParams``).
* ``plgpu.load(ref.at[...], layout=...)``: 0.12 takes no index argument; 0.11.2 still accepts a
  positional ``idx`` but deprecates it in favour of ``ref.at[idx]`` (checked in its source), so
  the ``.at`` form works on both and no version switch is needed.
* ``copy_gmem_to_smem(src, dst, barrier)``, ``barrier_wait``, ``commit_smem``,
  ``copy_smem_to_gmem``, ``wait_smem_to_gmem(n)``, ``Layout.WGMMA.reduce(axis)``, ``SMEM``,
  ``Barrier(num_barriers=)`` have the same signatures in both versions.
* ``InterpretGPUParams(detect_races=True)``: 0.12 raises on a race by default (``on_race="raise"``;
  checked by deleting the TMA ``barrier_wait``); 0.11.2 has no ``on_race``: it prints and sets a
  flag, which the tests read. After an exception the interpreter's global state needs
  ``reset_gpu_interpret_mode_state``, which is not exported from ``plgpu`` (private module only).
* On a CPU backend the kernel runs only in interpret mode (``interpret=`` here, or tracing under
  ``plgpu.force_gpu_interpret_mode``); otherwise jax raises "Only interpret mode is supported".
* Nothing failed to lower in this formulation: axis-0 (cross-warp) and axis-1 reductions of a
  WGMMA-layout fp32 tile, ``WGMMA.reduce(0/1)`` vector loads from SMEM, row/column broadcasts,
  ``lax.fori_loop`` carrying the register tile, and a dynamic-row store ``o_s[t] = ...``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = ["MAX_T", "kda_recurrent_pallas", "kda_state_after_prefix_pallas", "pick_block_v"]

MAX_T = 16  # tokens per call: a decode step or a speculative verify block


def pick_block_v(V: int, block_v: int | None) -> int:
    """block_v as given (checked), or the default: 32 columns of the state per program when V allows."""
    if block_v is not None:
        if V % block_v or block_v % 8:
            raise ValueError(f"block_v={block_v} must divide V={V} and be a multiple of 8")
        return block_v
    for cand in (32, 64, 16, 8):
        if V % cand == 0 and cand <= V:
            return cand
    raise ValueError(f"V={V} must be a multiple of 8")


def kda_recurrent_pallas(q, k, v, g, beta, state, scale=None, *, block_v=None, interpret=False):
    """Fused KDA recurrence over T = 1..16 tokens; see the module docstring.

    ``interpret``: False (compile for the GPU), or a ``plgpu.InterpretGPUParams`` (CPU simulation).
    Returns (o [B,T,H,V] float32, final state [B,H,K,V] float32).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    if not 1 <= T <= MAX_T:
        raise ValueError(f"T={T} must be in 1..{MAX_T}")
    if K % 64:
        raise ValueError(f"K={K} must be a multiple of 64 (WGMMA row tiling)")
    if state.shape != (B, H, K, V):
        raise ValueError(f"state shape {state.shape} != {(B, H, K, V)}")
    bv_ = pick_block_v(V, block_v)
    nv = V // bv_
    scale = float(K ** -0.5 if scale is None else scale)

    f32 = jnp.float32
    q = q.astype(f32)
    k = k.astype(f32)
    g = g.astype(f32)
    beta = beta.astype(f32)[..., None]
    kb = k * beta                                   # beta * k   [B,T,H,K]
    vb = v.astype(f32) * beta                       # beta * v   [B,T,H,V]
    state = state.astype(f32)

    row = plgpu.Layout.WGMMA.reduce(1)              # [K] vectors, broadcast along columns
    col = plgpu.Layout.WGMMA.reduce(0)              # [block_v] vectors, broadcast along rows

    def body(q_g, k_g, kb_g, g_g, vb_g, s_g, o_g, so_g,
             q_s, k_s, kb_s, g_s, vb_s, s_s, o_s, bars):
        b = lax.axis_index("b")
        h = lax.axis_index("h")
        j = lax.axis_index("v")
        cols = pl.ds(j * bv_, bv_)
        srcs = (
            (q_g.at[b, :, h, :], q_s),
            (k_g.at[b, :, h, :], k_s),
            (kb_g.at[b, :, h, :], kb_s),
            (g_g.at[b, :, h, :], g_s),
            (vb_g.at[b, :, h, cols], vb_s),
            (s_g.at[b, h, :, cols], s_s),
        )
        for i, (src, dst) in enumerate(srcs):
            plgpu.copy_gmem_to_smem(src, dst, bars.at[i])
        for i in range(len(srcs)):
            plgpu.barrier_wait(bars.at[i])

        S = plgpu.load(s_s, layout=plgpu.Layout.WGMMA)          # [K, block_v] fp32

        def step(t, S):
            decay = jnp.exp(plgpu.load(g_s.at[t], layout=row))
            kt = plgpu.load(k_s.at[t], layout=row)
            kbt = plgpu.load(kb_s.at[t], layout=row)
            qt = plgpu.load(q_s.at[t], layout=row) * scale
            vbt = plgpu.load(vb_s.at[t], layout=col)
            S = S * decay[:, None]
            u = vbt - jnp.sum(S * kbt[:, None], axis=0)           # beta (v - S^T k)
            S = S + kt[:, None] * u[None, :]
            o_s[t] = jnp.sum(S * qt[:, None], axis=0)              # S^T (scale q)
            return S

        S = lax.fori_loop(0, T, step, S)
        s_s[...] = S
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_g.at[b, :, h, cols])
        plgpu.copy_smem_to_gmem(s_s, so_g.at[b, h, :, cols])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((B, T, H, V), f32),
                  jax.ShapeDtypeStruct((B, H, K, V), f32)),
        scratch_types=(
            plgpu.SMEM((T, K), f32),        # q
            plgpu.SMEM((T, K), f32),        # k
            plgpu.SMEM((T, K), f32),        # beta k
            plgpu.SMEM((T, K), f32),        # g
            plgpu.SMEM((T, bv_), f32),      # beta v (column block)
            plgpu.SMEM((K, bv_), f32),      # state tile (in, then out)
            plgpu.SMEM((T, bv_), f32),      # o (column block)
            plgpu.Barrier(num_barriers=6),
        ),
        grid=(B, H, nv),
        grid_names=("b", "h", "v"),
        interpret=interpret if interpret else None,
    )
    o, s_out = kernel(q, k, kb, g, vb, state)
    return o, s_out


def kda_state_after_prefix_pallas(state, k, v, g, beta, n, *, block_v=None, interpret=False):
    """State after only the first n tokens of a block, through the fused kernel (replay commit).

    Same contract as :func:`lingjax.ops.kda.kda_state_after_prefix`: state [B,H,K,V]; k, g
    [B,T,H,K]; v [B,T,H,V]; beta [B,T,H]; n traced int, 0 <= n <= T <= 16. Tokens t >= n get
    g = 0, beta = 0, an exact identity update in this kernel (module docstring). Returns the state
    [B,H,K,V] float32.
    """
    keep = jnp.arange(k.shape[1]) < n                                  # [T]
    g = jnp.where(keep[None, :, None, None], g, 0)
    beta = jnp.where(keep[None, :, None], beta, 0)
    q = jnp.zeros(k.shape, jnp.float32)                                 # outputs unused
    return kda_recurrent_pallas(q, k, v, g, beta, state, block_v=block_v, interpret=interpret)[1]
