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
  (u = beta v - S^T (beta k)).
  q (scaled), k, beta k, g go to SMEM as [T, K] float32 rows, beta v as [T, bv]. A loop, not an
  unrolled sequence: the unrolled form was 1.5 MB of MLIR at T = 9 (vs 0.28 MB) and, in its first
  version on the H200 (session 11), took 25 us per verify call in the model.
* ``PREP_TILED`` (sessions 33-34, off by default until measured; blocks of T >= 2): the
  preparation as one pass over register tiles whose rows are the block's tokens instead of a loop
  over tokens (the loop is a serial chain of ~700 instructions per token, with two cross-warp L2-norm
  reductions, that Nsight Compute found issuing at 0.39 instructions per cycle). q and k share one
  [64, K] tile (q tokens in rows 0.., k tokens in rows ``QK_GAP`` = 32..: warps 0 and 2), the gate
  has its own [64, K] tile and v a [64, span] one, where the span is the fewest whole column
  blocks whose bf16 rows are a multiple of 128 bytes (64 columns for bv = 32; TMA needs 128-byte
  aligned SMEM addresses, and a 64-byte row at W = 3 is not). The L2 norms become row reductions
  within a quad of threads, exp(g) is computed there (off the recurrence's serial path), beta
  scales u in the recurrence, and the new conv window goes out by TMA straight from the
  128-byte rows. The conv weights are widened to float32 rows in SMEM first (a 16-bit
  row-broadcast [K] vector does not lower). Rows past T are computed on unused SMEM rows and never
  read. It compiles with jax 0.11.2 (254 registers, no spills); with ``EXP2`` a verify at T = 9
  executes ~7,400 PTX instructions per thread against ~8,500 for the loop (10,400 for the loop
  without ``EXP2``, the default): the gain it can
  bring is instruction-level parallelism, not fewer instructions. jax 0.12's layout inference does
  not finish on it (the kernel refuses it there).
* Recurrence: a loop over tokens with the [K, bv] state tile in registers in the WGMMA fragment
  layout (K rows over the 4 warps), written with elementwise ops and one-axis reductions only:
  K-vectors in ``WGMMA.reduce(1)`` ("row") layout broadcast along columns (``S * x[:, None]``),
  ``S^T x = sum(S * x[:, None], axis=0)`` (cross-warp, through a small SMEM scratch) giving a
  ``WGMMA.reduce(0)`` ("column") vector, the rank-1 update ``k[:, None] * u[None, :]``. o rows go to
  SMEM, then one TMA store each for o and the state (read once, written once per block). A verify
  skips the state store (write_state=False: its final state is never used), a commit the o store.

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
takes 5.1 us, a verify call (T = 9) 15.5 us, a commit 8.4 us. On CPU (CI): interpret mode with
race detection against the reference, and cross-lowering for CUDA at the Ling shape.
"""

from __future__ import annotations

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
# The preparation as one pass over register tiles whose rows are the block's tokens (module
# docstring), instead of a loop over tokens. The same math up to float32 rounding. Read at trace
# time; off until measured on a GPU; refused with jax >= 0.12 (its layout inference does not end).
PREP_TILED = False
PREP_ROWS = 64    # the WGMMA register tile's rows (>= MAX_T)
PREP_TILED_MIN_T = 2   # tiled only for blocks of at least this many tokens (a decode step keeps the loop)
# exp as exp2(x log2 e) in the kernel (sigmoids, gate, decay): one ex2.approx (relative error
# ~2^-22) and a multiply instead of expf's ~10-instruction range reduction: ~18% fewer PTX
# instructions per thread for a verify at T = 9 (10,400 -> 8,500, the token loop; the tiled
# preparation computes ~225 exps per thread). Off until measured on a GPU (session 34 had none).
# Read at trace time.
EXP2 = False
LOG2_E = 1.4426950408889634
QK_GAP = 32       # tiled: the k rows' offset from the q rows in the q / k tile (>= W + T; a warp's rows
                  # are 16 consecutive rows, so q (rows 0..) and k (rows 32..) fall on warps 0 and 2)


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


def _shift(r, off: int):
    """Row index or slice r moved down by `off` rows."""
    if isinstance(r, pl.Slice):
        return pl.ds(r.start + off, r.size)
    return r + off


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
    tiled = PREP_TILED and T >= PREP_TILED_MIN_T and ks - 1 + T <= QK_GAP
    if tiled and not interpret and jax.__version_info__ >= (0, 12):
        raise NotImplementedError(
            f"PREP_TILED=True does not compile with jax {jax.__version__}: Mosaic GPU's layout inference (jax >= "
            "0.12) searches the SMEM transforms of its tiles without end; use jax 0.11.2 or PREP_TILED=False")
    R = PREP_ROWS if tiled else T                   # token rows of the SMEM preparation buffers
    window, conv_w = window.astype(dt), conv_w.astype(dt)
    A_log, dt_bias, beta, state = (a.astype(f32) for a in (A_log, dt_bias, beta, state))

    # tiled: each program prepares the v columns of a span of whole column blocks whose rows are
    # multiples of 128 bytes (64 bf16 columns for bv = 32), so that the TMA copies of its rows land
    # at 128-byte-aligned SMEM addresses whatever the row (TMA needs that; a 64-byte row at W = 3
    # does not); the recurrence then reads its own bv columns of the span
    span = bv
    if tiled:
        span = next((bv * m for m in range(1, V // bv + 1)
                     if V % (bv * m) == 0 and bv * m * dt.itemsize % 128 == 0), V)
    nv = V // bv
    # free reshapes: the v channel as [.., nv, bv] column blocks, so each program's columns are one
    # leading index of a contiguous [.., K] row; beta padded to >= 4 heads (a TMA row is >= 16 bytes)
    Hp = -(-H // 4) * 4
    beta_p = beta if Hp == H else jnp.pad(beta, ((0, 0), (0, 0), (0, Hp - H)))
    proj_v = proj.reshape(B, T, P, H, V // span, span)
    window_v = window.reshape(B, W, 3, H, V // span, span)
    conv_v = conv_w.reshape(ks, 3, H, V // span, span)

    row = plgpu.Layout.WGMMA.reduce(1)              # [K] vectors, broadcast along columns
    col = plgpu.Layout.WGMMA.reduce(0)              # [bv] vectors, broadcast along rows

    def body(*refs):
        pdl_wait(interpret)
        proj_g, projv_g, win_g, winv_g, cw_g, cwv_g, alog_g, dtb_g, beta_g, n_g, s_g = refs[:11]
        n_out = write_o + state_out + write_window
        outs = refs[11:11 + n_out]
        (qk_s, f_s, v_s, cw_s, cwv_s, dtb_s, beta_s, st_s,
         q_s, k_s, kb_s, g_s, vb_s, o_s, bars, *extra_s) = refs[11 + n_out:]
        n_win = 2 * (write_window and not tiled)         # staging rows of the new window
        win_s, (cwq_s, cwv32_s) = extra_s[:n_win], (extra_s[n_win:] if tiled else (None,) * 2)
        b = lax.axis_index("b")
        h = lax.axis_index("h")
        j = lax.axis_index("v")
        cols = pl.ds(j * bv, bv)
        js, jv = j // (span // bv), pl.ds((j % (span // bv)) * bv, bv)   # this span, its columns in it
        if tiled:   # q / k rows [W + R, K] (the k rows from row QK_GAP) and the span's v columns
            # [W + R, span]: contiguous [R, .] row tiles for the register loads (Mosaic loads no strided tile)
            qk_rows = lambda c, r: qk_s.at[_shift(r, c * QK_GAP)]   # noqa: E731
            v_rows = lambda r: v_s.at[r]                  # noqa: E731
            row_srcs = tuple((src.at[b, :, c, h, :], qk_s.at[pl.ds(c * QK_GAP + r0, n)]) for c in range(2)
                             for src, r0, n in ((win_g, 0, W), (proj_g, W, T)))
            row_srcs += ((winv_g.at[b, :, 2, h, js], v_s.at[pl.ds(0, W)]),
                         (projv_g.at[b, :, 2, h, js], v_s.at[pl.ds(W, T)]))
        else:
            qk_rows = lambda c, r: qk_s.at[r, c]          # noqa: E731
            v_rows = lambda r: v_s.at[r, j]               # noqa: E731
            row_srcs = ((win_g.at[b, :, pl.ds(0, 2), h, :], qk_s.at[pl.ds(0, W)]),
                        (proj_g.at[b, :, pl.ds(0, 2), h, :], qk_s.at[pl.ds(W, T)]),
                        (winv_g.at[b, :, 2, h], v_s.at[pl.ds(0, W)]),
                        (projv_g.at[b, :, 2, h], v_s.at[pl.ds(W, T)]))
        srcs = (   # rows of window ++ proj: history rows 0..W-1, then the block's T rows
            *row_srcs,
            (proj_g.at[b, :, 3, h, :], f_s.at[pl.ds(0, T)]),
            (cw_g.at[:, pl.ds(0, 2), h, :], cw_s),
            (cwv_g.at[:, 2, h, js] if tiled else cwv_g.at[:, 2, h], cwv_s),
            (dtb_g.at[h], dtb_s),
            (beta_g.at[b], beta_s),
            (s_g.at[b, h, :, cols], st_s),            # awaited last (after the preparation)
        )
        for i, (src, dst) in enumerate(srcs):
            plgpu.copy_gmem_to_smem(src, dst, bars.at[i])
        a = jnp.exp(alog_g[h])
        n_valid = n_g[0]
        # a commit (no o rows to write) stops after its n tokens: the rest are identity updates
        steps = T if (write_o or n is None) else n_valid
        for i in range(len(srcs) - 1):
            plgpu.barrier_wait(bars.at[i])

        # ---- preparation, one token per loop step: conv + silu, norms, gate, mask, beta
        def conv(row_of, w_of):
            acc = row_of(0) * w_of(0)
            for i in range(1, ks):
                acc = acc + row_of(i) * w_of(i)
            return acc * _sigmoid(acc)                # silu, in float32

        def prep(t, carry):
            keep = t < n_valid
            qk = [conv(lambda i: plgpu.load(qk_rows(c, t + i), layout=row).astype(f32),
                       lambda i: plgpu.load(cw_s.at[i, c], layout=row).astype(f32)) for c in range(2)]
            v = conv(lambda i: plgpu.load(v_rows(t + i), layout=col).astype(f32),
                     lambda i: plgpu.load(cwv_s.at[i, j], layout=col).astype(f32))
            q = qk[0] * (lax.rsqrt(jnp.sum(qk[0] * qk[0]) + L2_EPS) * scale)
            k = qk[1] * lax.rsqrt(jnp.sum(qk[1] * qk[1]) + L2_EPS)
            x = plgpu.load(f_s.at[t], layout=row).astype(f32) + plgpu.load(dtb_s, layout=row)
            if safe_gate:
                g = lower_bound * _sigmoid(a * x)
            else:                         # -a softplus(x), softplus(x) = max(x, 0) + log(1 + exp(-|x|))
                g = -a * (jnp.maximum(x, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(x))))
            b_t = beta_s[t, h]
            bt = jnp.where(keep, _sigmoid(b_t) if beta_logits else b_t, 0.0)
            q_s[t] = q
            k_s[t] = k
            kb_s[t] = k * bt
            g_s[t] = g * jnp.where(keep, 1.0, 0.0)
            vb_s[t] = v * bt
            return carry

        def prep_tiles():
            """Every token at once, in register tiles whose rows are tokens: q and k together in one
            [R, K] tile (q tokens in rows 0.., k tokens in rows QK_GAP..), the gate [R, K], v [R, span]."""
            wg = plgpu.Layout.WGMMA
            along = wg.reduce(0)                  # [K] / [bv] vectors broadcast along the token rows
            rows = plgpu.broadcasted_iota(jnp.int32, (R,), 0, layout=wg.reduce(1))
            is_q = (rows < QK_GAP).astype(f32)    # 1 on the q rows of the q / k tile, 0 on the k rows

            def conv_tile(tile_of, w_of):
                acc = tile_of(0) * w_of(0)
                for i in range(1, ks):
                    acc = acc + tile_of(i) * w_of(i)
                return acc * _sigmoid(acc)

            # the conv weights as float32 rows first: Mosaic loads no 16-bit row-broadcast [K] vector
            for i in range(ks):
                for c in range(2):
                    cwq_s[i, c] = plgpu.load(cw_s.at[i, c], layout=row).astype(f32)
                cwv32_s[i] = plgpu.load(cwv_s.at[i], layout=col).astype(f32)
            plgpu.commit_smem()

            def qk_weight(i):                     # tap i's q weights on the q rows, k weights on the k rows
                w_k = plgpu.load(cwq_s.at[i, 1], layout=along)
                return w_k[None, :] + is_q[:, None] * (plgpu.load(cwq_s.at[i, 0], layout=along) - w_k)[None, :]

            qk = conv_tile(lambda i: plgpu.load(qk_s.at[pl.ds(i, R)], layout=wg).astype(f32), qk_weight)
            v = conv_tile(lambda i: plgpu.load(v_rows(pl.ds(i, R)), layout=wg).astype(f32),
                          lambda i: plgpu.load(cwv32_s.at[i], layout=along)[None, :])
            row_scale = 1.0 + is_q * (scale - 1.0)  # scale on the q rows
            qk = qk * (lax.rsqrt(jnp.sum(qk * qk, axis=1) + L2_EPS) * row_scale)[:, None]
            x = plgpu.load(f_s, layout=wg).astype(f32) + plgpu.load(dtb_s, layout=along)[None, :]
            if safe_gate:
                g = lower_bound * _sigmoid(a * x)
            else:
                g = -a * (jnp.maximum(x, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(x))))
            keep = (rows < n_valid).astype(f32)   # tokens t >= n: g = 0, the decay exp(0) = 1
            q_s[...] = qk                         # q rows 0.., k rows QK_GAP..
            g_s[...] = _exp(g * keep[:, None])  # the decay factor, off the recurrence's serial path
            vb_s[...] = v

        if tiled:
            prep_tiles()
        else:
            lax.fori_loop(0, steps, prep, jnp.int32(0))
        if write_window and not tiled:   # rows n .. n+W-1 of window ++ proj, staged for the TMA stores
            wqk_s, wv_s = win_s
            for r in range(W):
                wv_s[r] = plgpu.load(v_rows(n_valid + r), layout=col)

            @pl.when(j == 0)
            def _():
                for r in range(W):
                    for c in range(2):
                        wqk_s[r, c] = plgpu.load(qk_rows(c, n_valid + r), layout=row)
        plgpu.commit_smem()                           # the rows above are read in other layouts below
        plgpu.barrier_wait(bars.at[len(srcs) - 1])

        # ---- recurrence (state tile [K, bv] in registers)
        S = plgpu.load(st_s, layout=plgpu.Layout.WGMMA)

        def step(t, S):
            if tiled:       # exp(g) rows (1 past n) and unscaled v rows; beta 0 past n
                b_t = beta_s[t, h]
                bt = jnp.where(t < n_valid, _sigmoid(b_t) if beta_logits else b_t, 0.0)
                S = S * plgpu.load(g_s.at[t], layout=row)[:, None]
                k = plgpu.load(q_s.at[QK_GAP + t], layout=row)
                u = bt * (plgpu.load(vb_s.at[t, jv], layout=col) - jnp.sum(S * k[:, None], axis=0))
                S = S + k[:, None] * u[None, :]
                if write_o:
                    o_s[t] = jnp.sum(S * plgpu.load(q_s.at[t], layout=row)[:, None], axis=0)
                return S
            S = S * _exp(plgpu.load(g_s.at[t], layout=row))[:, None]
            u = plgpu.load(vb_s.at[t], layout=col) - jnp.sum(S * plgpu.load(kb_s.at[t], layout=row)[:, None], axis=0)
            S = S + plgpu.load(k_s.at[t], layout=row)[:, None] * u[None, :]
            if write_o:
                o_s[t] = jnp.sum(S * plgpu.load(q_s.at[t], layout=row)[:, None], axis=0)
            return S

        S = lax.fori_loop(0, steps, step, S)
        if write_state:
            st_s[...] = S
        plgpu.commit_smem()
        if write_o:
            plgpu.copy_smem_to_gmem(o_s, outs[0].at[b, :, h, cols])
        if write_state:      # in place: over the tile this program read at its start (s_g)
            plgpu.copy_smem_to_gmem(st_s, (s_g if state_in_place else outs[write_o]).at[b, h, :, cols])
        if write_window and tiled:   # rows n .. n+W-1 straight from the SMEM rows (128-byte multiples)
            win_g = outs[-1]

            @pl.when(j % (span // bv) == 0)          # the span's v columns, by one of its programs
            def _():
                plgpu.copy_smem_to_gmem(v_s.at[pl.ds(n_valid, W)], win_g.at[b, :, 2, h, pl.ds(js * span, span)])

            @pl.when(j == 0)
            def _():
                for c in range(2):
                    plgpu.copy_smem_to_gmem(qk_rows(c, pl.ds(n_valid, W)), win_g.at[b, :, c, h, :])
        elif write_window:
            win_g = outs[-1]
            plgpu.copy_smem_to_gmem(win_s[1], win_g.at[b, :, 2, h, cols])

            @pl.when(j == 0)
            def _():
                plgpu.copy_smem_to_gmem(win_s[0], win_g.at[b, :, pl.ds(0, 2), h, :])
        plgpu.wait_smem_to_gmem(0)

    out_type = ((jax.ShapeDtypeStruct((B, T, H, V), f32),) * write_o
                + (jax.ShapeDtypeStruct((B, H, K, V), f32),) * state_out
                + (jax.ShapeDtypeStruct((B, W, 3, H, K), dt),) * write_window)
    kernel = plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=(
            # q, k rows of window ++ proj (tiled: [W + R, K], q rows from row 0, k rows from QK_GAP)
            plgpu.SMEM((W + R, K) if tiled else (W + T, 2, K), dt),
            plgpu.SMEM((R, K), dt),             # f rows
            # v rows of window ++ proj (tiled: the span's columns; else every column block)
            plgpu.SMEM((W + R, span) if tiled else (W + T, nv, bv), dt),
            plgpu.SMEM((ks, 2, K), dt),         # q, k conv weights
            plgpu.SMEM((ks, span) if tiled else (ks, nv, bv), dt),   # v conv weights (tiled: the span)
            plgpu.SMEM((K,), f32),              # dt_bias
            plgpu.SMEM((T, Hp), f32),           # beta (every head of the batch row)
            plgpu.SMEM((K, bv), f32),           # state tile (in, then out)
            plgpu.SMEM((R, K), f32),            # scale * normalised q
            plgpu.SMEM((1 if tiled else T, K), f32),   # normalised k (tiled: rows QK_GAP.. of q_s)
            plgpu.SMEM((T if not tiled else 1, K), f32),   # beta k (the token loop only)
            plgpu.SMEM((R, K), f32),            # g (masked); tiled: exp of the masked g
            plgpu.SMEM((R, span), f32),         # beta v; tiled: v (the span's columns)
            plgpu.SMEM((T, bv), f32),           # o
            plgpu.Barrier(num_barriers=12 if tiled else 10),     # one per TMA load
            *((plgpu.SMEM((W, 2, K), dt),        # the new window's q, k rows (first column block)
               plgpu.SMEM((W, bv), dt)) if write_window and not tiled else ()),   # its v columns of this block
            *((plgpu.SMEM((ks, 2, K), f32),      # tiled: the q, k conv weights as float32,
               plgpu.SMEM((ks, span), f32)) if tiled else ()),    # and the span's v conv weights
        ),
        grid=(B, H, V // bv),
        grid_names=("b", "h", "v"),
        kernel_name="kda_fused_step",       # the kernel's name in profiles
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True) if OWN_BARRIERS else None,
        interpret=interpret if interpret else None,
    )
    state_arg = jax.new_ref(state) if state_in_place else state
    outs = kernel(proj, proj_v, window, window_v, conv_w, conv_v, A_log, dt_bias, beta_p, n_tok, state_arg)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    o = outs.pop(0) if write_o else None
    s = outs.pop(0) if state_out else (state_arg[...] if state_in_place else None)
    return (o, s, outs.pop(0)) if write_window else (o, s)
