"""Fused KDA decode / verify / commit step (Pallas Mosaic GPU, `plgpu.kernel`): one launch from a
KDA layer's input projection to its recurrence output, for a block of T = 1..16 tokens.

Contract (the XLA reference is :func:`lingjax.ops.kda.kda_fused_step`, which is what the model's XLA
path computes for these T):

    proj    [B, T, P, H, K]  the fused input projection, channels (q, k, v, f, ...), P >= 4; the
                             model's activation dtype (bf16, or f32 for a float32 model)
    window  [B, W, 3, H, K]  short-conv history: the last W = ks - 1 projected q, k, v inputs
    conv_w  [ks, 3, H, K]    depthwise causal conv weights
    A_log [H], dt_bias [H, K]   gate parameters (float32)
    beta    [B, T, H]        float32, sigmoid applied (beta_logits=True: before the sigmoid, which the
                             kernel applies to each token's scalar)
    state   [B, H, K, V]     float32 (V = K: v is a K-wide projection channel)
    n       int32 scalar     tokens t >= n are identity updates (committing an accepted prefix of a
                             verified block); None: all T tokens
    -> (o [B, T, H, V] float32 or None, state [B, H, K, V] float32 or None)   (write_o / write_state)
       and with write_window=True a third output, the conv window after the block (or after its
       first n tokens): window' [B, W, 3, H, K] = rows n .. n+W-1 of window ++ proj[:, :, :3]

Per token t (spec kda.md): for c in q, k, v: x_c = silu(sum_j conv_w[j, c] * r_{t+j}(c)) over the
rows r of window ++ proj, in float32 throughout (the XLA path of a bf16 model rounds some of these
intermediates to bf16 where it materialises them: ~4e-3 relative on the outputs, measured on CPU,
which is that path's distance from float64 too); q, k L2-normalised (eps 1e-6);
g = lower_bound * sigmoid(exp(A_log) (f + dt_bias)) (the safe gate) or -exp(A_log) softplus(f + dt_bias);
then
    S <- diag(exp g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T (scale q).

Design
------
* Grid ``(B, H, V // block_v)``, one warpgroup (128 threads) per program. Column block j of the
  state, ``S[:, j*block_v:(j+1)*block_v]``, evolves independently of the other columns (every
  update mixes rows only through the full-length k, q, g, which each program computes whole), so
  the V axis is split to get enough programs: B=1, H=32, V=128, block_v=32 -> 128 programs.
* Each program brings into SMEM by TMA: its head's q / k rows of window ++ proj ([W + T, 2, K]: the
  history lands in the first W rows, the block in the next T), the f rows [T, K], the v rows of
  window ++ proj for every column block ([W + T, nv, bv], from free reshapes of window and proj, so
  its own columns are one leading index), the conv weights likewise, dt_bias [K], beta for every
  head of its batch row [T, H] (H padded to >= 4: a TMA row is >= 16 bytes) and its state tile
  [K, bv]; A_log and n are scalar loads. The state copy is awaited last, so it overlaps the
  preparation.
* Preparation, one token per loop step: the conv + silu, the L2 norms (a reduction of a K-vector to
  a scalar), the gate, the mask t < n (g = 0, beta = 0: exactly the identity in the recurrence
  below, exp(0) = 1 and u = 0 so S + k*0 = S for any finite S, so a replay of a block with n
  accepted tokens leaves the state bit for bit as after those n), beta folded into k and v
  (u = beta v - S^T (beta k)). The conv weights are loaded (and widened to float32) once per
  warpgroup before the loop and carried in registers (``HOIST_CONV_WEIGHTS``, session 36). The
  preparation's vectors are the recurrence's WGMMA row / column vectors, which replicate each
  element over several threads; ``STRIDED_PREP`` (opt-in, not yet run on a GPU) prepares one
  element per thread instead.
  q (scaled), k, beta k and the decay exp(g) (computed here, off the recurrence's serial chain,
  session 35) go to SMEM as [T, K] float32 rows, beta v as [T, bv]. A loop, not an
  unrolled sequence: the unrolled form was 1.5 MB of MLIR at T = 9 (vs 0.28 MB) and, in its first
  version on the H200 (session 11), took 25 us per verify call in the model.
* Recurrence: a loop over tokens with the [K, bv] state tile in registers in the WGMMA fragment
  layout (K rows over the 4 warps), written with elementwise ops and one-axis reductions only:
  K-vectors in ``WGMMA.reduce(1)`` ("row") layout broadcast along columns (``S * x[:, None]``),
  ``S^T x = sum(S * x[:, None], axis=0)`` (cross-warp, through a small SMEM scratch) giving a
  ``WGMMA.reduce(0)`` ("column") vector, the rank-1 update ``k[:, None] * u[None, :]``. o rows go to
  SMEM, then one TMA store each for o and the state (read once, written once per block). A verify
  skips the state store (write_state=False: its final state is never used), a commit the o store.
* Warp specialisation (``PREP_WARPGROUPS`` = 1 or 2, session 35; 2 by default, 0 = one warpgroup):
  the program gets 1 + PREP_WARPGROUPS warpgroups. Warpgroup 0 runs the recurrence; the others run
  the preparation (token t on warpgroup 1 + t % PREP_WARPGROUPS; the first also issues the TMA
  loads and writes the window) and arrive on an SMEM barrier per token after storing its rows
  (every thread arrives: each releases its own stores), which the recurrence waits on before
  reading them. The two loops overlap instead of running one after the other. Mosaic puts every
  cross-warp reduction's SMEM scratch at the same offset, so each preparation warpgroup's code is
  lowered inside scoped pads that move its scratch elsewhere (without them the GPU output had NaNs
  where interpret mode, which has no such scratch, passed: run 131). Interpret mode on
  CPU needs a thread per warpgroup in XLA's CPU pool (tests/conftest.py sets NPROC).

* ``write_window`` (session 21): the new conv window, rows n .. n+W-1 of window ++ proj, comes
  out of the kernel (it has those rows in SMEM already) instead of an XLA slice kernel after it:
  each program copies its head's v columns of those rows through registers into a [W, bv] SMEM
  stage (in the [W + T, nv, bv] v rows its columns are strided, which one TMA box cannot read),
  the first column block's program the q and k rows into a [W, 2, K] stage; one TMA store each.
  Its GPU tests pass on the H200 (session 22, run 83); the model's ``kda.WINDOW_FROM_KERNEL`` is
  on (full depth DSpark 8.500 -> 8.422 ms/step, same host).

What stays in XLA around it (lingjax/model/kda.py): the projection GEMMs, beta's logits x w_beta
(the model passes them with beta_logits=True, session 24: the sigmoid in the kernel spares XLA a
kernel after the reduction; deviceless H200 compile, bench.xla_kernels),
the gated output RMSNorm (it needs the whole head's V columns, which four programs share).

* A commit (``write_o=False`` with ``n``) runs both loops over its n accepted tokens only: the
  rest would be identity updates (session 19: 12.6 -> 8.4 us per commit call in the full-depth
  DSpark profile at an accept length of 5.28, the step 8.726 -> 8.621 ms).

Status (H200, jax 0.11.2, sessions 11 and 19; docs/PERFORMANCE.md): GPU tests pass (relative RMSE vs
float64 <= 1e-5; ptxas 109-116 registers, no spills); in the full-depth fp8 model a decode call
takes 5.1 us, a verify call (T = 9) 15.5 us, a commit 8.4 us. Session 35 (an H100, EXP2 off): a
verify call 13.99 us in bench.kernels warp-specialised, 15.64 us with one warpgroup; with the
current defaults 31 GPU tests pass. Session 36 (H100): the hoisted conv weights, 14.08 -> 12.85 us
per verify call. On CPU (CI): interpret mode with race detection against the reference, and
cross-lowering for CUDA at the Ling shape.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import pdl_wait

__all__ = ["MAX_T", "kda_fused_step_pallas", "pick_block_v"]

MAX_T = 16        # tokens per call: a decode step, a speculative verify block or its commit
L2_EPS = 1e-6     # lingjax.ops.kda.l2_normalize
# Compile with CompilerParams(unsafe_no_auto_barriers=True)? Pallas otherwise puts a warpgroup
# barrier before and after every SMEM store (5 row stores per token in the preparation, 1 in the
# recurrence); the prefill kernels gained 6-8% from dropping them (session 14). None is needed
# here: every stored row is written once (by the threads holding it, with equal values where the
# row layout is replicated) and read only after the commit_smem barrier or by TMA; the final state
# store follows the recurrence's cross-warp reductions, whose barriers Mosaic always emits. Off:
# on the H200 (session 15, runs 61-62) it passed the GPU tests (10 of 12 in run 60, the 6 bf16 ones
# in run 61), and the full-depth DSpark step did not change (9.52 vs 9.50 ms; its isolated verify
# rows, 7.8 vs 9.9 us, came from a loop that kept 1 call in 8: bench/kernels.py next_state);
# no measured gain in the model for a hand-audited setting. Read at trace time.
OWN_BARRIERS = False
# exp as exp2(x log2 e) in the kernel (sigmoids, gate, decay): one ex2.approx (relative error
# ~2^-22) and a multiply instead of expf's ~10-instruction range reduction: ~18% fewer PTX
# instructions per thread for a verify at T = 9 (10,400 -> 8,500; 708 -> 536 per token in the
# preparation loop, 406 -> 372 in the recurrence). On an H100 (session 34): verify T = 9 16.91 ->
# 15.93 us per call (`net`), a commit of 5 of 9 tokens unchanged (11.65 vs 11.68), relative RMSE
# vs float64 1.2e-7 -> 1.3e-7. On by default since session 35: with PREP_WARPGROUPS = 2, the
# 12-layer DSpark step on an H100 4.485 -> 4.472 ms (run 133). Read at trace time.
EXP2 = True
LOG2_E = 1.4426950408889634
# Mosaic GPU's SMEM scratch for one cross-warp reduction (plgpu.CompilerParams.reduction_scratch_bytes;
# 2048 is Mosaic's default). A reduction whose partial values do not fit takes several rounds,
# each a store, two barriers and loads. A positive multiple of 1024. Read at trace time.
REDUCTION_SCRATCH_BYTES = 128 * 4 * 4
# Warp specialisation (session 35): 0 = one warpgroup per program runs the preparation loop, then
# the recurrence loop; 1 or 2 = that many extra warpgroups (256 / 384 threads per program) run the
# preparation, token t on warpgroup 1 + t % PREP_WARPGROUPS, and announce each token's rows through
# an SMEM barrier (one per token), while warpgroup 0 runs the recurrence as the rows arrive: the two
# serial chains overlap instead of adding up. The same arithmetic (the same values bit for bit; GPU
# tests, run 132). On an H100 (session 35, runs 132-134, with the decay exp(g) moved into the
# preparation): verify T = 9 15.64 (0) -> 14.44 (1) -> 13.99 us (2) per call (`net`), a commit of 5
# of 9 in place 11.78 -> 11.44 us; the 12-layer DSpark step 4.497 / 4.501 / 4.503 ms (0, EXP2 off)
# -> 4.475 / 4.472 / 4.471 ms (2, EXP2 on). Read at trace time.
PREP_WARPGROUPS = 2
# The conv weights (q, k, v taps, bf16 in SMEM) loaded and converted to float32 once per warpgroup
# before the preparation loop and carried in registers through it, instead of once per token
# (session 36: 64 of the preparation's 132 bf16 -> f32 conversions per token were of these
# loop-invariant rows; deviceless PTX 547 -> 431 instructions per token, 113 -> 135 registers, no
# spills). The same values bit for bit (GPU tests, run 139). On an H100 (run 139, one A/B in one
# process): verify T = 9 14.08 -> 12.85 us per call (`net`); the model-level step not measured.
# On by default since session 36. Read at trace time.
HOIST_CONV_WEIGHTS = True
# The preparation in the warpgroup-strided layout (session 36; off: built, not yet run on a GPU):
# one element of each [K] row per thread (K = 128: no replication) instead of the WGMMA row /
# column vectors, which hold each K-row element 4 times over a warpgroup and each of the program's
# bv v columns 32 times; v is prepared for all V columns (the v rows of every column block are in
# SMEM already) and beta v stored as [T, V // bv, bv] rows, of which the recurrence reads its block.
# Deviceless PTX (H200 target, verify T = 9): 431 -> 148 instructions per token in the preparation
# loop, 135 -> 92 registers, no spills. The L2 norms reduce in another order (not bit for bit the
# default). Needs K % 128 == 0.
# Read at trace time.
STRIDED_PREP = False


def pick_block_v(V: int, block_v: int | None) -> int:
    """block_v as given (checked), or the default: 32 state columns per program when V allows."""
    if block_v is not None:
        if V % block_v or block_v % 8:
            raise ValueError(f"block_v={block_v} must divide V={V} and be a multiple of 8")
        return block_v
    for cand in (32, 64, 16, 8):
        if V % cand == 0:
            return cand
    raise ValueError(f"V={V} must be a multiple of 8")


def _exp(x):
    """exp(x); with EXP2 as 2^(x log2 e), which lowers to one ex2.approx instruction and a multiply
    (jnp.exp lowers to a range-reduced expf of ~10 instructions)."""
    return jnp.exp2(x * LOG2_E) if EXP2 else jnp.exp(x)


def _sigmoid(x):
    return 1.0 / (1.0 + _exp(-x))


def kda_fused_step_pallas(proj, window, conv_w, A_log, dt_bias, beta, state, n=None, *,
                          safe_gate=True, lower_bound=-5.0, scale=None, write_o=True, write_state=True,
                          block_v=None, state_in_place=False, write_window=False, beta_logits=False,
                          interpret=False):
    """Conv + gate + norms + KDA recurrence over T = 1..16 tokens; see the module docstring.

    ``state_in_place`` (with write_state; the model's default since session 19, lingjax.model.kda): the
    float32 start state goes in as a ``jax.new_ref`` that each program overwrites with its final
    tile (it has read that tile first), so the kernel's state output aliases its state operand
    (the mosaic_gpu call's output_operand_aliases) instead of being a fresh buffer that a decode
    loop must copy into its carried state. The same values.
    ``write_window``: also return the conv window after the block (or after its first n tokens),
    [B, W, 3, H, K] in proj's dtype, as a third output.
    ``beta_logits``: beta holds x w_beta before the sigmoid; the kernel applies it per token.
    ``interpret``: False (compile for the GPU), or a ``plgpu.InterpretGPUParams`` (CPU simulation).
    Returns (o [B,T,H,V] float32 or None, state [B,H,K,V] float32 or None), plus the window
    [B,W,3,H,K] with write_window.
    """
    B, T, P, H, K = proj.shape
    ks = conv_w.shape[0]
    W = ks - 1
    V = state.shape[-1]
    if not 1 <= T <= MAX_T:
        raise ValueError(f"T={T} must be in 1..{MAX_T}")
    if P < 4:
        raise ValueError(f"proj has {P} channels; the kernel reads q, k, v, f (proj [B, T, >=4, H, K])")
    if K % 64:
        raise ValueError(f"K={K} must be a multiple of 64 (WGMMA row tiling)")
    if ks < 2:
        raise ValueError(f"conv kernel size {ks} must be >= 2 (a window of ks - 1 history rows)")
    if V != K or state.shape != (B, H, K, V):
        raise ValueError(f"state shape {state.shape} != {(B, H, K, K)} (V = K)")
    if window.shape != (B, W, 3, H, K) or conv_w.shape != (ks, 3, H, K):
        raise ValueError(f"window {window.shape} / conv_w {conv_w.shape} do not match {(B, W, 3, H, K)} / "
                         f"{(ks, 3, H, K)}")
    if A_log.shape != (H,) or dt_bias.shape != (H, K) or beta.shape != (B, T, H):
        raise ValueError(f"A_log {A_log.shape}, dt_bias {dt_bias.shape}, beta {beta.shape} must be "
                         f"{(H,)}, {(H, K)}, {(B, T, H)}")
    if not (write_o or write_state):
        raise ValueError("nothing to write: set write_o and/or write_state")
    if state_in_place and not write_state:
        raise ValueError("state_in_place=True updates the state operand: it needs write_state=True")
    if state_in_place and not hasattr(jax, "new_ref"):
        raise NotImplementedError(f"state_in_place=True needs jax.new_ref (not in jax {jax.__version__}); "
                                  "use state_in_place=False")
    state_out = write_state and not state_in_place        # the state as a separate output
    bv = pick_block_v(V, block_v)
    scale = float(K ** -0.5 if scale is None else scale)
    dt = jnp.dtype(proj.dtype)
    f32 = jnp.float32
    n_tok = jnp.clip(jnp.asarray(T if n is None else n, jnp.int32), 0, T).reshape(1)
    window, conv_w = window.astype(dt), conv_w.astype(dt)
    A_log, dt_bias, beta, state = (a.astype(f32) for a in (A_log, dt_bias, beta, state))

    nv = V // bv
    # free reshapes: the v channel as [.., nv, bv] column blocks, so each program's columns are one
    # leading index of a contiguous [.., K] row; beta padded to >= 4 heads (a TMA row is >= 16 bytes)
    Hp = -(-H // 4) * 4
    beta_p = beta if Hp == H else jnp.pad(beta, ((0, 0), (0, 0), (0, Hp - H)))
    proj_v = proj.reshape(B, T, P, H, nv, bv)
    window_v = window.reshape(B, W, 3, H, nv, bv)
    conv_v = conv_w.reshape(ks, 3, H, nv, bv)

    row = plgpu.Layout.WGMMA.reduce(1)              # [K] vectors, broadcast along columns
    col = plgpu.Layout.WGMMA.reduce(0)              # [bv] vectors, broadcast along rows

    n_prep = PREP_WARPGROUPS
    if n_prep not in (0, 1, 2):
        raise ValueError(f"kda_step_fused.PREP_WARPGROUPS={n_prep} must be 0, 1 or 2")
    strided = STRIDED_PREP
    if strided and K % 128:
        raise ValueError(f"kda_step_fused.STRIDED_PREP needs K % 128 == 0 (one element per thread), got K={K}")
    # the preparation's vectors: [K] rows and the v rows ([nv, bv] for all columns, or [bv] for this block)
    prow = plgpu.Layout.WG_STRIDED((K,), vec_size=1) if strided else row
    pv = plgpu.Layout.WG_STRIDED((nv, bv), vec_size=1) if strided else col
    if REDUCTION_SCRATCH_BYTES <= 0 or REDUCTION_SCRATCH_BYTES % 1024:
        raise ValueError(f"kda_step_fused.REDUCTION_SCRATCH_BYTES={REDUCTION_SCRATCH_BYTES} must be a positive "
                         "multiple of 1024 (Mosaic's SMEM alignment: the warpgroups' scratch pads are that size)")

    def body(*refs):
        pdl_wait(interpret)
        proj_g, projv_g, win_g, winv_g, cw_g, cwv_g, alog_g, dtb_g, beta_g, n_g, s_g = refs[:11]
        n_out = write_o + state_out + write_window
        outs = refs[11:11 + n_out]
        (qk_s, f_s, v_s, cw_s, cwv_s, dtb_s, beta_s, st_s,
         q_s, k_s, kb_s, e_s, vb_s, o_s, bars, *rest) = refs[11 + n_out:]
        ready = rest.pop(0) if n_prep else None     # [T] barriers: token t's rows are in SMEM
        win_s = rest
        b = lax.axis_index("b")
        h = lax.axis_index("h")
        j = lax.axis_index("v")
        cols = pl.ds(j * bv, bv)
        srcs = (   # rows of window ++ proj: history rows 0..W-1, then the block's T rows
            (win_g.at[b, :, pl.ds(0, 2), h, :], qk_s.at[pl.ds(0, W)]),
            (proj_g.at[b, :, pl.ds(0, 2), h, :], qk_s.at[pl.ds(W, T)]),
            (winv_g.at[b, :, 2, h], v_s.at[pl.ds(0, W)]),
            (projv_g.at[b, :, 2, h], v_s.at[pl.ds(W, T)]),
            (proj_g.at[b, :, 3, h, :], f_s),
            (cw_g.at[:, pl.ds(0, 2), h, :], cw_s),
            (cwv_g.at[:, 2, h], cwv_s),
            (dtb_g.at[h], dtb_s),
            (beta_g.at[b], beta_s),
            (s_g.at[b, h, :, cols], st_s),            # awaited last (after the preparation)
        )
        n_valid = n_g[0]
        # a commit (no o rows to write) stops after its n tokens: the rest are identity updates
        steps = T if (write_o or n is None) else n_valid

        def issue_copies():
            for i, (src, dst) in enumerate(srcs):
                plgpu.copy_gmem_to_smem(src, dst, bars.at[i])

        def wait_inputs():
            for i in range(len(srcs) - 1):
                plgpu.barrier_wait(bars.at[i])

        # ---- preparation of token t: conv + silu, norms, gate, mask, beta -> its SMEM rows
        def conv(row_of, w_of):
            acc = row_of(0) * w_of(0)
            for i in range(1, ks):
                acc = acc + row_of(i) * w_of(i)
            return acc * _sigmoid(acc)                # silu, in float32

        def v_rows(ref):         # this block's [bv] columns, or (STRIDED_PREP) all [nv, bv]
            return ref if strided else ref.at[j]

        def conv_weights():      # ([q taps], [k taps]) as float32 [K] rows, [v taps] as v rows
            return ([[plgpu.load(cw_s.at[i, c], layout=prow).astype(f32) for i in range(ks)] for c in range(2)],
                    [plgpu.load(v_rows(cwv_s.at[i]), layout=pv).astype(f32) for i in range(ks)])

        def prep(t, a, w=None):  # w: conv_weights() loaded before the loop (HOIST_CONV_WEIGHTS), or None
            keep = t < n_valid
            w_qk, w_v = conv_weights() if w is None else w
            qk = [conv(lambda i: plgpu.load(qk_s.at[t + i, c], layout=prow).astype(f32),
                       lambda i: w_qk[c][i]) for c in range(2)]
            v = conv(lambda i: plgpu.load(v_rows(v_s.at[t + i]), layout=pv).astype(f32), lambda i: w_v[i])
            q = qk[0] * (lax.rsqrt(jnp.sum(qk[0] * qk[0]) + L2_EPS) * scale)
            k = qk[1] * lax.rsqrt(jnp.sum(qk[1] * qk[1]) + L2_EPS)
            x = plgpu.load(f_s.at[t], layout=prow).astype(f32) + plgpu.load(dtb_s, layout=prow)
            if safe_gate:
                g = lower_bound * _sigmoid(a * x)
            else:                         # -a softplus(x), softplus(x) = max(x, 0) + log(1 + exp(-|x|))
                g = -a * (jnp.maximum(x, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(x))))
            b_t = beta_s[t, h]
            bt = jnp.where(keep, _sigmoid(b_t) if beta_logits else b_t, 0.0)
            q_s[t] = q
            k_s[t] = k
            kb_s[t] = k * bt
            e_s[t] = _exp(g * jnp.where(keep, 1.0, 0.0))   # the decay exp(g); 1 where masked
            vb_s[t] = v * bt

        def stage_window():      # rows n .. n+W-1 of window ++ proj, staged for the TMA stores below
            wqk_s, wv_s = win_s
            for r in range(W):
                wv_s[r] = plgpu.load(v_s.at[n_valid + r, j], layout=col)

            @pl.when(j == 0)
            def _():
                for r in range(W):
                    for c in range(2):
                        wqk_s[r, c] = plgpu.load(qk_s.at[n_valid + r, c], layout=row)

        def store_window():      # after commit_smem
            wqk_s, wv_s = win_s
            win_g = outs[-1]
            plgpu.copy_smem_to_gmem(wv_s, win_g.at[b, :, 2, h, cols])

            @pl.when(j == 0)
            def _():
                plgpu.copy_smem_to_gmem(wqk_s, win_g.at[b, :, pl.ds(0, 2), h, :])

        def prep_carry():        # the preparation loop's invariants, after wait_inputs: exp(A_log[h]) (+ w)
            return (jnp.exp(alog_g[h]), conv_weights()) if HOIST_CONV_WEIGHTS else (jnp.exp(alog_g[h]),)

        # ---- recurrence (state tile [K, bv] in registers); wait_token(t) before token t's rows
        def recurrence(wait_token):
            S = plgpu.load(st_s, layout=plgpu.Layout.WGMMA)

            def step(t, S):
                wait_token(t)
                S = S * plgpu.load(e_s.at[t], layout=row)[:, None]
                vb = plgpu.load(vb_s.at[t, j] if strided else vb_s.at[t], layout=col)
                u = vb - jnp.sum(S * plgpu.load(kb_s.at[t], layout=row)[:, None], axis=0)
                S = S + plgpu.load(k_s.at[t], layout=row)[:, None] * u[None, :]
                if write_o:
                    o_s[t] = jnp.sum(S * plgpu.load(q_s.at[t], layout=row)[:, None], axis=0)
                return S

            S = lax.fori_loop(0, steps, step, S)
            if write_state:
                st_s[...] = S

        def store_outputs():     # after commit_smem
            if write_o:
                plgpu.copy_smem_to_gmem(o_s, outs[0].at[b, :, h, cols])
            if write_state:      # in place: over the tile this program read at its start (s_g)
                plgpu.copy_smem_to_gmem(st_s, (s_g if state_in_place else outs[write_o]).at[b, h, :, cols])

        if not n_prep:           # one warpgroup: the preparation loop, then the recurrence loop
            issue_copies()
            wait_inputs()

            def prep_step(t, carry):
                prep(t, *carry)
                return carry

            lax.fori_loop(0, steps, prep_step, prep_carry())
            if write_window:
                stage_window()
            plgpu.commit_smem()                       # the rows above are read in other layouts below
            plgpu.barrier_wait(bars.at[len(srcs) - 1])
            recurrence(lambda t: None)
            plgpu.commit_smem()
            store_outputs()
            if write_window:
                store_window()
            plgpu.wait_smem_to_gmem(0)
            return

        wg = lax.axis_index("wg")

        def preparation(p):                           # warpgroup p + 1: tokens p, p + n_prep, ..
            @pl.when(wg == p + 1)
            def _():
                if p == 0:
                    issue_copies()
                wait_inputs()

                def prep_step(i, carry):
                    t = p + i * n_prep
                    prep(t, *carry)
                    plgpu.barrier_arrive(ready.at[t])  # each thread releases its own row stores
                    return carry

                lax.fori_loop(0, (steps - p + n_prep - 1) // n_prep, prep_step, prep_carry())
                if write_window and p == 0:
                    stage_window()
                    plgpu.commit_smem()
                    store_window()
                    plgpu.wait_smem_to_gmem(0)

        # A cross-warp reduction (the L2 norms, S^T x) goes through SMEM scratch at the first byte
        # past the allocations in scope where it is lowered, the same bytes for every warpgroup: each
        # preparation warpgroup's code is lowered inside scoped pads of REDUCTION_SCRATCH_BYTES (one
        # more per warpgroup), so the warpgroups' reductions use disjoint scratch. The pads are all
        # entered (a block-wide barrier each) before any warpgroup starts its loop.
        pad = plgpu.SMEM((REDUCTION_SCRATCH_BYTES // 4,), f32)

        def with_pads(p, _pad=None):
            if p + 1 < n_prep:
                pl.run_scoped(functools.partial(with_pads, p + 1), pad, collective_axes="wg")
            preparation(p)

        pl.run_scoped(functools.partial(with_pads, 0), pad, collective_axes="wg")

        @pl.when(wg == 0)                             # the recurrence, token by token as rows arrive
        def _():
            plgpu.barrier_wait(bars.at[len(srcs) - 1])
            recurrence(lambda t: plgpu.barrier_wait(ready.at[t]))
            plgpu.commit_smem()
            store_outputs()
            plgpu.wait_smem_to_gmem(0)

    out_type = ((jax.ShapeDtypeStruct((B, T, H, V), f32),) * write_o
                + (jax.ShapeDtypeStruct((B, H, K, V), f32),) * state_out
                + (jax.ShapeDtypeStruct((B, W, 3, H, K), dt),) * write_window)
    kernel = plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=(
            plgpu.SMEM((W + T, 2, K), dt),      # q, k rows of window ++ proj
            plgpu.SMEM((T, K), dt),             # f rows
            plgpu.SMEM((W + T, nv, bv), dt),    # v rows of window ++ proj, by column block
            plgpu.SMEM((ks, 2, K), dt),         # q, k conv weights
            plgpu.SMEM((ks, nv, bv), dt),       # v conv weights, by column block
            plgpu.SMEM((K,), f32),              # dt_bias
            plgpu.SMEM((T, Hp), f32),           # beta (every head of the batch row)
            plgpu.SMEM((K, bv), f32),           # state tile (in, then out)
            plgpu.SMEM((T, K), f32),            # scale * normalised q
            plgpu.SMEM((T, K), f32),            # normalised k
            plgpu.SMEM((T, K), f32),            # beta k
            plgpu.SMEM((T, K), f32),            # exp(g) (1 where masked)
            plgpu.SMEM((T, nv, bv) if strided else (T, bv), f32),   # beta v (all column blocks: STRIDED_PREP)
            plgpu.SMEM((T, bv), f32),           # o
            plgpu.Barrier(num_barriers=10),
            *((plgpu.Barrier(num_barriers=T),) if n_prep else ()),   # token t prepared
            *((plgpu.SMEM((W, 2, K), dt),        # the new window's q, k rows (first column block)
               plgpu.SMEM((W, bv), dt)) if write_window else ()),   # its v columns of this block
        ),
        grid=(B, H, V // bv),
        grid_names=("b", "h", "v"),
        kernel_name="kda_fused_step",       # the kernel's name in profiles
        **(dict(num_threads=1 + n_prep, thread_name="wg") if n_prep else {}),
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=OWN_BARRIERS,
                                             reduction_scratch_bytes=REDUCTION_SCRATCH_BYTES),
        interpret=interpret if interpret else None,
    )
    state_arg = jax.new_ref(state) if state_in_place else state
    outs = kernel(proj, proj_v, window, window_v, conv_w, conv_v, A_log, dt_bias, beta_p, n_tok, state_arg)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    o = outs.pop(0) if write_o else None
    s = outs.pop(0) if state_out else (state_arg[...] if state_in_place else None)
    return (o, s, outs.pop(0)) if write_window else (o, s)
