"""Chunked KDA forward (prefill) in Pallas Mosaic GPU (`plgpu.kernel`), for the H200 (sm_90a).

Same math as :func:`lingjax.ops.kda.kda_chunked`, over packed sequences:

    q, k, g [T, H, K]   q, k L2-normalised (cast to bf16 here); g = per-channel log decay in [-9, 0]
    v       [T, H, V]   (cast to bf16)
    beta    [T, H]      fp32
    cu_seqlens [S+1]    int32 sequence starts, cu[0] = 0, cu[S] = T (default: one sequence)
    initial_state [S, H, K, V] fp32 or None (zeros)
    -> (o [T, H, V] out_dtype (fp32 by default), final state [S, H, K, V] fp32)

[B, T, H, K] inputs (B equal-length sequences) are accepted too and give o [B, T, H, V].
Two entry points: :func:`kda_prefill_pallas` takes g, normalised q, k and beta (the recurrence
and the in-chunk cumulative sum of g are fused); :func:`kda_prefill_fused_pallas` also fuses the
L2 norm of q, k, Ling's safe gate and the beta sigmoid into kernel 1 (raw projections in).

Design
------
Chunks of C = 64 tokens (the WGMMA M tile). Two kernels, because the intra-chunk work is
parallel over (chunk, head) while the state pass is serial over chunks:

1. ``_prep`` -- grid (chunk slot, head), one warpgroup. TMA-loads the chunk's rows of q, k, v, g
   (or f) into unswizzled SMEM rows of K + PAD elements (a chunk may start at any token, which
   rules out swizzled tiles; the padded row stride keeps the tile loads free of bank conflicts;
   TMA zero-fills past T and past the last head's columns) and its
   beta from a chunk-space copy [H, N * 64] (see ``_beta_chunks``: in token space the box would
   start at an unaligned innermost coordinate), zeroes the rows past the sequence's end, then:
     G      in-chunk cumulative log decay, in place in SMEM by a 64-step fp32 row loop (exact;
            ``cumsum`` does not lower); G_C (last row, fp32) is written out.
     Akk    = beta_i sum_d k_i k_j exp(G_i - G_j), j < i, and Aqk (j <= i, scale folded in q), by
            WGMMA over the head dim in 64-channel parts. exp(G_i - G_j) = exp(G_i - M) exp(M - G_j)
            with M = G at the middle of each 16-token column block J: A += A_J B_J^T, B_J zero
            outside block J's rows, so each column gets exactly its own block's term; rows above
            the block are masked *before* the exp, so each factor is at most exp(8 max|g|): fine
            for g >= -9 (below, factors reach fp32 subnormals and lose precision); the safe gate
            keeps g > -5. Entries above the diagonal are selected away.
     T^-1   = (I + Akk)^-1 block-recursively: the inverse of the 2x2 diagonal blocks is I - L;
            for b = 2, 4, ..., 32 the inverse of the 2b-blocks is D - D E D (D: inverse so far,
            E: L's blocks below D's inside each 2b-block): 10 dependent 64x64x64 products, each
            3 WGMMAs on bf16 hi + lo splits (~2^-16 accurate). Every factor is a bounded
            sub-inverse; the Neumann product (I - L)(I + L^2)...(I + L^32) is exact in theory
            but its powers of L grow combinatorially for correlated keys (1e+5 error at a mean
            key cosine of 0.8 in fp32), so it is not used.
     Both of these run as loops (4 blocks per 64-channel part, 5 levels), not unrolled Python: on the H200 the
     unrolled kernel was instruction-fetch bound (Nsight Compute, session 12: half of its stall
     cycles waiting on instruction fetch at 13.8 cycles per issued instruction).
     W = T^-1 diag(beta) (exp(G) k),  U = T^-1 diag(beta) v  (beta on T^-1's columns keeps v exact)
     Kd = k exp(G_C - G),  Qg = scale q exp(G),  Aqk (stored as soon as it is final).
   Outputs live in chunk space [N, H, 64, .] (N = ceil(T/64) + S - 1 slots, every sequence starts
   a chunk, unused slots are zeros), so kernel 2 reads aligned, swizzled tiles. SMEM is reused
   phase by phase through RefUnions: ~110 KiB, so two CTAs fit on an SM. WGMMA A operands (the
   Akk / Aqk row factors, the inverse's left factors, T^-1 diag(beta)) come from registers
   (A_FROM_REGISTERS): only the B operands go through SMEM.
2. ``_state`` -- grid (sequence, head, V block of ``block_v``), one warpgroup, serial loop over
   the sequence's chunks with the fp32 state tile S [K, block_v] in registers:
     V' = U - W S;  O = Qg S + Aqk V';  S <- exp(G_C) S + Kd^T V'
   WGMMAs with M = 64 or 128 (= K), N = block_v; S and V' are the B operands, in SMEM as bf16
   hi + lo (8 WGMMAs per chunk). Only W S and Kd^T V' are on the serial path: the next chunk's
   tiles are TMA-loaded into the second slot while W S runs, and the previous chunk's O goes out
   while Kd^T V' runs. O rows are stored by TMA in pieces of 64/32/.../1 rows, so a sequence's
   partial last chunk never writes into the next sequence. block_v = 32: H * V / 32 = 128
   programs (132 SMs).
Both kernels place their own SMEM barriers (OWN_BARRIERS; Pallas' automatic ones, two per store
and one per TMA copy, kept the warps in lockstep).

Why C = 64 with 16-token decay blocks rather than 16-token chunks: WGMMA needs M = 64, and the
serial state pass costs per chunk, so 64-token chunks quarter its length (128 steps at T = 8192)
while the 16-token reference blocks keep the exp(+-G) factors in range as 16-token chunks would.

Accuracy: fp32 cumsum, decay factors, inverse and state; bf16 MMA operands for the decay-scaled
k, q factors, W, U, Kd, Qg, Aqk (as FLA's chunk kernel). Relative RMSE vs float64 ~3e-3 on random
inputs (bar 5e-3); keys with a mean cosine near 1 and almost no decay reach ~9e-3.

Status: checked on the H200 (jax 0.11.2; the GPU_CHECKS below, packed sequences starting at any
token included; relative RMSE vs float64 3.3e-3 on outputs, 2.0e-3 on the final state at T=8192)
and on CPU (jax 0.12 and 0.11.2: interpret mode with race detection vs lingjax.ops.kda and the
float64 oracle, cross-lowering for CUDA at H=32, K=V=128; tests/test_pallas_kda_prefill.py). Used
by the model's bf16 / fp8 prefill chunks under ``kda_kernel="pallas"``. Speed
(bench/kda_prefill_timing.py, session 14): T=8192 0.80 ms (kernel 1 0.50, kernel 2 0.34), T=65536
5.7 ms; FLA 1.09 / 8.25, targets 0.55 / 4.1. Known limits (Nsight Compute, session 14): kernel 1
uses 255 registers and 112.7 KiB of SMEM, so 2 CTAs (8 warps) per SM, too few to hide its
latencies; its Akk / Aqk blocks and the inverse take ~0.18 and ~0.16 ms of the 0.50
(bench/kda_prefill_phases.py, measured before OWN_BARRIERS), loads and stores alone 0.19.
Kernel 2 has one CTA per SM and issued ~900 instructions per warp and chunk before OWN_BARRIERS,
a third of them TMA issue and O output bookkeeping. OWN_BARRIERS is checked on the H200 at K = 128
only (kernel 2 uses it at K = 64 too; kernel 1 does not). History: a beta TMA box starting at an unaligned token faulted on the GPU (fixed:
chunk-space beta); unrolled Python loops made kernel 1 instruction-fetch bound (1.48 ms; fixed:
fori_loops); unpadded q, k, G rows cost 8-way bank conflicts per tile load (fixed: PAD).

API notes (same in jax 0.11.2 and 0.12): Lane lowering semantics, set explicitly (the default,
Warpgroup, rejects a dynamic TMA start into tiled SMEM); TMA into tiled SMEM needs 8-aligned rows,
so packed inputs land in unswizzled SMEM; a TMA box's start on the innermost GMEM dimension has to
be 16-byte aligned, which neither Mosaic, interpret mode nor cross-lowering checks (a dynamic
misaligned start is reported to fault on the GPU with an illegal instruction); interpret mode
takes WGMMA operands only from SMEM and has no ``pl.run_state`` (accumulators start at zero here);
nested RefUnions do not unpack; broadcast vectors with ``lax.broadcast_in_dim`` (``x[None, :]``
finds no layout); stores to unswizzled SMEM need ``optimized=False`` (``plgpu.store`` in 0.12,
plain ``ref[...] =`` in 0.11.2).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import store, swizzled

__all__ = ["CHUNK", "GPU_CHECKS", "GpuCheck", "HEAD_DIMS", "MIN_LOG_DECAY", "chunk_tables",
           "kda_prefill_fused_pallas", "kda_prefill_pallas"]

CHUNK = 64          # tokens per chunk (WGMMA M)
# Kernel 1's unswizzled q, k, v, g tiles have rows of K + PAD elements: a row stride that is not a
# multiple of 128 bytes puts the 8 rows a warp touches per WGMMA-layout load in different banks
# (at K elements per row all 8 rows fell into the same banks: 8-way conflicts).
PAD = 8
SUB = 16            # tokens per decay-reference block inside a chunk
_BF, _F32 = jnp.bfloat16, jnp.float32
MIN_LOG_DECAY = -9.0   # per-token log decay g must be >= this (in-chunk decay factors in fp32)
HEAD_DIMS = (64, 128)  # K (= V in Ling) the kernel takes: 64-channel WGMMA parts, SMEM limit
_WG = plgpu.Layout.WGMMA
_ROW = _WG.reduce(1)   # [M] vector indexed by tile row, broadcast along columns
_COL = _WG.reduce(0)   # [N] vector indexed by tile column, broadcast along rows
# No reduction crosses warps (the fused L2 norm sums along rows, inside a warp): no SMEM scratch.
_PARAMS = dict(lowering_semantics=plgpu.LoweringSemantics.Lane, approx_math=True,
               reduction_scratch_bytes=0)


class GpuCheck(NamedTuple):
    """One configuration of the compiled-kernel checks on the H200."""
    name: str
    T: int
    cu: tuple[int, ...] | None = None     # cu_seqlens (None: one sequence)
    fused: bool = False                   # kda_prefill_fused_pallas (raw projections in)
    with_state: bool = False              # pass an initial state
    block_v: int = 32
    H: int = 32                           # Ling-3.0-flash: 32 heads, K = V = 128
    K: int = 128
    V: int = 128
    seed: int | None = None               # input seed (None: T)


# The GPU checks: tests/test_pallas_kda_prefill.py's gpu_only tests and bench/kda_prefill_debug.py
# (one subprocess per configuration and stage) both run this one list.
GPU_CHECKS = (
    GpuCheck("T100", 100),
    GpuCheck("T8192", 8192),
    GpuCheck("T8192_packed3", 8192, cu=(0, 1000, 1001, 8192)),
    GpuCheck("T8192_fused", 8192, fused=True, seed=1),
)


# ----------------------------------------------------------------------------- helpers



def _load(ref, layout=_WG):
    return plgpu.load(ref, layout=layout, optimized=False)



def _iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=_WG)


def _rows(vec, n):
    """[M] row vector -> [M, n]."""
    return lax.broadcast_in_dim(vec, (vec.shape[0], n), [0])


def _cols(vec, m):
    """[N] column vector -> [m, N]."""
    return lax.broadcast_in_dim(vec, (m, vec.shape[0]), [1])


def _zeros(shape):
    return plgpu.layout_cast(jnp.zeros(shape, _F32), _WG)


# ----------------------------------------------------------------------------- chunk tables


def chunk_tables(cu_seqlens, T: int, n_seq: int):
    """Chunk slots of packed sequences (every sequence starts a new 64-token chunk).

    cu_seqlens [S+1] int32 -> tok0 [N] (first token), ntok [N] (valid rows, 0 for unused slots),
    clo [S], chi [S] (chunk range of each sequence; an empty sequence gets one empty chunk).
    N = ceil(T / 64) + S - 1 bounds the number of chunks for any split of T >= 1 tokens.
    """
    C = CHUNK
    N = -(-T // C) + n_seq - 1
    cu = cu_seqlens.astype(jnp.int32)
    lens = cu[1:] - cu[:-1]
    nch = jnp.maximum(1, (lens + C - 1) // C)
    chi = jnp.cumsum(nch).astype(jnp.int32)
    clo = chi - nch
    n = jnp.arange(N, dtype=jnp.int32)
    s = jnp.searchsorted(chi, n, side="right").astype(jnp.int32)
    used = s < n_seq
    s = jnp.minimum(s, n_seq - 1)
    tok0 = cu[s] + C * (n - clo[s])
    ntok = jnp.where(used, jnp.clip(cu[s + 1] - tok0, 0, C), 0)
    return jnp.where(used, tok0, 0), ntok, clo, chi


# ----------------------------------------------------------------------------- kernel 1


def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def _prep_body(K, V, scale, lower_bound, token_space_beta, a_regs, skip, interpret, own_barriers,
               *refs):
    """Kernel 1. With ``lower_bound`` set (fused preprocessing) the inputs are raw q, k, the gate
    projection f (instead of g), beta logits, dt_bias [H, K] and exp(A_log) [H].
    a_regs: WGMMA A operands from registers (see A_FROM_REGISTERS); skip: _SKIP_PHASES;
    own_barriers: compiled with unsafe_no_auto_barriers, so `sync` below orders every SMEM write
    after the reads (by other threads or WGMMAs) it overwrites (see OWN_BARRIERS)."""
    C, KP = CHUNK, 64
    fused = lower_bound is not None
    regs = a_regs and not interpret     # interpret mode's wgmma takes SMEM operands only
    sync = plgpu.commit_smem if own_barriers else (lambda: None)   # a warpgroup barrier
    # SMEM reuse (RefUnion groups, disjoint lifetimes): v_or_rw = v | W's rhs, then W;
    # g_or_inv = g -> G in place | D, E (bf16 hi, lo) of the inverse; d_or_rv = Akk/Aqk operands
    # | U's rhs (v), then U | (fused only) the gate projection f, dead after step 1.
    if fused:
        (tok0_g, ntok_g, q_g, k_g, v_g, f_g, b_g, dtb_g, a_g, w_g, u_g, kd_g, qg_g, aqk_g, gc_g,
         q_s, k_s, v_or_rw, g_or_inv, d_or_rv, b_s, dtb_s, bars) = refs
        (a_s, bc_s), (rv_s,), (f_s,) = d_or_rv
    else:
        (tok0_g, ntok_g, q_g, k_g, v_g, g_g, b_g, w_g, u_g, kd_g, qg_g, aqk_g, gc_g,
         q_s, k_s, v_or_rw, g_or_inv, d_or_rv, b_s, bars) = refs
        (a_s, bc_s), (rv_s,) = d_or_rv
    n, h = lax.axis_index("n"), lax.axis_index("h")
    t0, nt = tok0_g[n], ntok_g[n]
    (v_s,), (rw_s,) = v_or_rw
    (g_s,), (d_op, e_op) = g_or_inv
    rows = pl.ds(t0, C)
    # [T, H * K] views: a box of K + PAD columns per head (the last head's PAD columns are past the
    # array: TMA zero-fills them); only the first K columns are used.
    head = lambda x_g, D: x_g.at[rows, pl.ds(h * D, D + PAD)]
    first = (head(f_g, K), f_s) if fused else (head(g_g, K), g_s)
    # beta comes in chunk space (see _beta_chunks): its box starts at a multiple of 64 tokens on
    # its innermost dimension; the token dimension of q, k, v, g is not innermost, so any t0 works.
    b_rows = rows if token_space_beta else pl.ds(pl.multiple_of(n * C, C), C)
    loads = [first, (b_g.at[h, b_rows], b_s), (head(k_g, K), k_s), (head(q_g, K), q_s),
             (head(v_g, V), v_s)]
    if fused:
        loads.append((dtb_g.at[h], dtb_s))
    for i, (src, dst) in enumerate(loads):
        plgpu.copy_gmem_to_smem(src, dst, bars.at[i])

    # 1. G = in-chunk cumulative sum of g over the valid rows (exact fp32 row loop; in place, or
    #    from the safe gate g = lower_bound * sigmoid(exp(A_log) (f + dt_bias)) when fused).
    plgpu.barrier_wait(bars.at[0])
    # One channel per thread (K = 128), or rows in the replicated column layout (K = 64).
    strided = plgpu.Layout.WG_STRIDED((K,), vec_size=1) if K == 128 else _COL
    if fused:
        plgpu.barrier_wait(bars.at[5])
        dtb, a_h = _load(dtb_s, strided), a_g[h]
        def g_row(r):
            return lower_bound * _sigmoid(a_h * (_load(f_s.at[r, :K], strided).astype(_F32) + dtb))
    else:
        g_row = lambda r: _load(g_s.at[r, :K], strided)

    def cumsum_row(r, acc):
        acc = acc + jnp.where(r < nt, g_row(r), 0.0)
        store(g_s.at[r, :K], acc)
        return acc

    if "cumsum" not in skip:
        lax.fori_loop(0, C, cumsum_row, plgpu.layout_cast(jnp.zeros((K,), _F32), strided))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(g_s.at[C - 1, :K], gc_g.at[n, h])    # G_C

    # Column parts of KP = 64 channels keep every [C, KP] fp32 tile at 32 registers per thread.
    row = _iota((C, KP), 0)
    valid = row < nt
    part = lambda ref, p: ref.at[:, pl.ds(p * KP, KP)]
    G = lambda p: _load(part(g_s, p))
    for i in (1, 2, 3):
        plgpu.barrier_wait(bars.at[i])
    if fused:    # L2 norm: per-row factors applied where q, k are used (no extra bf16 rounding)
        inv_norm = lambda ref: lax.rsqrt(jnp.sum(jnp.square(_load(ref.at[:, :K]).astype(_F32)), axis=1)
                                         + 1e-6)
        rk, rq = inv_norm(k_s), inv_norm(q_s) * scale              # [C] row vectors
        k_scale, q_scale = (lambda: _rows(rk, KP)), (lambda: _rows(rq, KP))
    else:
        k_scale, q_scale = (lambda: 1.0), (lambda: scale)
    kf = lambda p: jnp.where(valid, _load(part(k_s, p)).astype(_F32) * k_scale(), 0.0)
    qf = lambda p: jnp.where(valid, _load(part(q_s, p)).astype(_F32) * q_scale(), 0.0)
    ref_row = lambda r, p: _load(g_s.at[r, pl.ds(p * KP, KP)], _COL)
    beta_of = _sigmoid if fused else (lambda x: x)
    bvec = jnp.where(plgpu.broadcasted_iota(jnp.int32, (C,), 0, layout=_ROW) < nt,
                     beta_of(_load(b_s, _ROW)), 0.0)
    beta_rows = _rows(bvec, KP)

    # 2. Akk (strict) and Aqk (inclusive), one 16-token column block J at a time, each block with
    #    its own decay reference M_J (G at the block's middle row): A += A_J B_J^T with
    #    B_J = k_j exp(M_J - G_j) on the block's rows j (zeros elsewhere, so every column gets
    #    exactly its own block's term) and A_J = k_i exp(G_i - M_J) (beta-scaled for Akk, q for
    #    Aqk) on rows i >= 16 J. Exponents are masked before the exp, so nothing overflows.
    #    A loop, not unrolled Python (see the module docstring: instruction fetch).
    def intra(acc_kk, acc_qk):
        for p in range(K // KP):
            # This part's tiles, loaded once; B_J's rows for every block at once (each row j uses
            # its own block's reference, so B_J is b_own masked to block J's rows) and beta k.
            gp, kp, qp = G(p), kf(p), qf(p)
            m_own = _cols(ref_row(SUB // 2 - 1, p), C)
            for J in range(1, C // SUB):
                m_own = jnp.where(row >= SUB * J, _cols(ref_row(SUB * J + SUB // 2 - 1, p), C), m_own)
            b_own = (kp * jnp.exp(m_own - gp)).astype(_BF)
            bk = beta_rows * kp

            def block(J, carry, p=p, gp=gp, bk=bk, qp=qp, b_own=b_own):
                r0 = SUB * J
                m = _cols(ref_row(r0 + SUB // 2 - 1, p), C)
                in_block = (row >= r0) & (row < r0 + SUB)
                plgpu.wgmma_wait(0)                                # the last MMAs read bc_s, a_s
                sync()
                store(bc_s, jnp.where(in_block, b_own, jnp.zeros_like(b_own)))
                e = jnp.exp(jnp.where(row >= r0, gp - m, -jnp.inf))
                a_kk, a_qk = (bk * e).astype(_BF), (qp * e).astype(_BF)
                if regs:
                    plgpu.commit_smem()
                else:
                    store(a_s.at[0], a_kk)
                    store(a_s.at[1], a_qk)
                    plgpu.commit_smem()
                    a_kk, a_qk = a_s.at[0], a_s.at[1]
                b_t = bc_s.transpose((1, 0))
                plgpu.wgmma(acc_kk, a_kk, b_t)
                plgpu.wgmma(acc_qk, a_qk, b_t)
                if regs:        # register operands must outlive the MMAs that read them
                    plgpu.wgmma_wait(0)
                return carry

            lax.fori_loop(jnp.int32(0), jnp.int32(C // SUB), block, 0)
        return acc_kk[...], acc_qk[...]

    if "intra" in skip:
        akk = aqk = _zeros((C, C))
    else:
        akk, aqk = pl.run_scoped(intra, plgpu.ACC((C, C), _F32), plgpu.ACC((C, C), _F32))
    ri, ci = _iota((C, C), 0), _iota((C, C), 1)
    akk = jnp.where(ri > ci, akk, 0.0)
    # Aqk is final: out now (through B's buffer, which U's right-hand side does not overlap), so
    # that its 32 registers per thread are free for steps 3-5.
    sync()                                                         # the MMAs have read bc_s
    store(bc_s, jnp.where(ri >= ci, aqk, 0.0).astype(_BF))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(bc_s, aqk_g.at[n, h])

    # 3. Right-hand sides of U (v: beta goes on T^-1's columns, so v stays exact) and W (exp(G) k,
    #    written over v), then Kd and Qg in place of k and q.
    plgpu.barrier_wait(bars.at[4])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)    # the Aqk and G_C stores have read B, g_s
    store(rv_s, jnp.where(_iota((C, V), 0) < nt, _load(v_s.at[:, :V]), 0.0).astype(_BF))
    sync()                                                         # v_s read: rw_s overlaps it
    for p in range(K // KP if "rhs" not in skip else 0):
        gp, kp = G(p), kf(p)
        eg = jnp.exp(gp)
        g_last = _cols(ref_row(C - 1, p), C)
        store(part(rw_s, p), (kp * eg).astype(_BF))
        store(part(q_s, p), (qf(p) * eg).astype(_BF))
        store(part(k_s, p), (kp * jnp.exp(g_last - gp)).astype(_BF))

    # 4. (I + Akk)^-1, block-recursively: D = inverse of the 2x2 diagonal blocks (I - L there),
    #    then for b = 2, 4, ..., 32 the inverse of the 2b-blocks is D - D E D, E = L's blocks
    #    below D's blocks inside each 2b-block. Every factor is a true (bounded) sub-inverse, so
    #    this stays accurate for strongly correlated keys, unlike the Neumann product
    #    (I - L)(I + L^2)...(I + L^32), whose powers of L grow combinatorially. g_s's memory is
    #    the scratch now.

    def mm3(a, b):            # a @ b, ~2^-16 accurate; a = (hi, lo) registers or SMEM tiles
        def body(acc):
            plgpu.wgmma(acc, a[0], b.at[0])
            plgpu.wgmma(acc, a[0], b.at[1])
            plgpu.wgmma(acc, a[1], b.at[0])
            return acc[...]
        return pl.run_scoped(body, plgpu.ACC((C, C), _F32))

    def a_split(x, ref):      # fp32 x as an A operand: bf16 (hi, lo) in registers, or via ref
        if regs:
            hi = x.astype(_BF)
            return hi, (x - hi.astype(_F32)).astype(_BF)
        sync()
        _split_store(ref, x)
        plgpu.commit_smem()
        return ref.at[0], ref.at[1]

    # Entry (r, c) below the diagonal joins at the level whose 2b-blocks first hold both r and c:
    # r ^ c in [b, 2b), b = 2 << i, so level i + 1 = the number of t >= 1 with r ^ c >= 2^t
    # (0: inside a 2x2 diagonal block); computed once, one compare per level.
    xor = jnp.bitwise_xor(ri, ci)
    lvl = sum(jnp.where(xor >= 2 ** t, 1, 0) for t in range(1, C.bit_length() - 1))
    lvl = jnp.where(ri > ci, lvl, -1)
    d = jnp.where(ri == ci, 1.0, 0.0) - jnp.where(lvl == 0, akk, 0.0)

    def level(i, d):                                               # b = 2, 4, ..., C / 2
        sync()          # the last level's MMAs (or step 3's g_s reads, G_C store) are done
        _split_store(d_op, d)
        _split_store(e_op, jnp.where(lvl == i + 1, akk, 0.0))
        plgpu.commit_smem()
        de = mm3(a_split(d, None) if regs else (d_op.at[0], d_op.at[1]), e_op)
        return d - mm3(a_split(de, e_op), d_op)                    # (E is consumed)

    if "inverse" not in skip:
        d = lax.fori_loop(jnp.int32(0), jnp.int32(C.bit_length() - 2), level, d)

    # 5. W = T^-1 diag(beta) (exp(G) k), U = T^-1 diag(beta) v, in place of their right-hand
    #    sides.
    beta_c = jnp.where(plgpu.broadcasted_iota(jnp.int32, (C,), 0, layout=_COL) < nt,
                       beta_of(_load(b_s, _COL)), 0.0)
    t_hi, t_lo = a_split(d * _cols(beta_c, C), d_op)

    def wu(acc_w, acc_u):
        for acc, rhs in ((acc_w, rw_s), (acc_u, rv_s)):
            plgpu.wgmma(acc, t_hi, rhs)
            plgpu.wgmma(acc, t_lo, rhs)
        return acc_w[...], acc_u[...]

    if "wu" in skip:
        w, u = _zeros((C, K)), _zeros((C, V))
    else:
        w, u = pl.run_scoped(wu, plgpu.ACC((C, K), _F32), plgpu.ACC((C, V), _F32))
    sync()                                                         # W, U's MMAs are done
    store(rw_s, w.astype(_BF))
    store(rv_s, u.astype(_BF))
    # Kd and Qg leave through swizzled tiles (D's and E's, free now), one 64-channel part each:
    # a TMA store reads dense SMEM, and k_s, q_s rows are K + PAD wide.
    for p in range(K // KP):
        store(e_op.at[p], _load(part(k_s, p)))
        store(d_op.at[p], _load(part(q_s, p)))
    plgpu.commit_smem()
    for src, dst in ((rw_s, w_g), (rv_s, u_g)):
        plgpu.copy_smem_to_gmem(src, dst.at[n, h])
    for p in range(K // KP):
        plgpu.copy_smem_to_gmem(e_op.at[p], kd_g.at[n, h, :, pl.ds(p * KP, KP)])
        plgpu.copy_smem_to_gmem(d_op.at[p], qg_g.at[n, h, :, pl.ds(p * KP, KP)])
    plgpu.wait_smem_to_gmem(0)


# Debugging only (bench/kda_prefill_debug.py --repro sets it in its own worker process): kernel 1
# reads beta in token space as before the fix, to reproduce the fault on the GPU.
_TOKEN_SPACE_BETA = False
# Kernel 1's WGMMA A operands (the Akk / Aqk row factors, the inverse's left factors, T^-1 for W
# and U) from registers instead of SMEM tiles: fewer SMEM stores and fences on the GPU; the same
# products (interpret mode, whose wgmma takes SMEM operands only, always stages them). Read at
# trace time.
A_FROM_REGISTERS = True
# Both kernels compiled with CompilerParams(unsafe_no_auto_barriers=True): Pallas otherwise puts a
# warpgroup barrier before every TMA copy and before and after every SMEM store (~20 per chunk in
# kernel 2, ~240 per program in kernel 1), which keeps the 4 warps in lockstep. Instead, each write
# to SMEM that other threads or WGMMAs have read since the last barrier is preceded by an explicit
# one (`sync` in the kernel bodies), and every write read by TMA / WGMMA is followed by
# commit_smem as before. Read at trace time (kernel 1 keeps Pallas' barriers for K = 64).
OWN_BARRIERS = True
# Timing diagnostics only (bench/kda_prefill_phases.py): kernel 1 phases left out, from
# {"cumsum", "intra", "inverse", "rhs", "wu"}; the outputs are wrong then. Read at trace time.
_SKIP_PHASES: frozenset = frozenset()


def _beta_chunks(beta_t, tok0, ntok):
    """beta [H, T'] (T' >= T, token space) -> [H, N * 64] in chunk space, zeros past each chunk's
    valid rows.

    Why: a TMA box's start on the innermost (contiguous) global dimension has to be 16-byte
    aligned (reported for Hopper TMA elsewhere: a misaligned start faults at run time with
    CUDA_ERROR_ILLEGAL_INSTRUCTION; Mosaic, interpret mode and cross-lowering do not check it;
    ``bench/kda_prefill_debug.py --repro`` tests it on the H200). In token space [H, T] the
    innermost coordinate of a chunk's beta box is its first token, not a multiple of 4 (16 B of
    fp32) whenever a packed sequence starts at cu[s] % 4 != 0 (e.g. cu = [0, 1000, 1001, 8192]).
    In chunk space every box starts at n * 64.
    """
    C = CHUNK
    H, Tp = beta_t.shape
    N = tok0.shape[0]
    r = jnp.arange(C, dtype=jnp.int32)
    idx = jnp.minimum(tok0[:, None] + r, Tp - 1)                    # [N, C]
    vals = jnp.take(beta_t.astype(_F32), idx.reshape(-1), axis=1).reshape(H, N, C)
    return jnp.where(r < ntok[:, None], vals, 0.0).reshape(H, N * C)


def _prep(tok0, ntok, q, k, v, g, beta_t, gate, scale, interpret):
    """Kernel 1 over all N chunk slots and H heads; see the module docstring.

    beta_t: beta (or its logits) as [H, T'] fp32, T' >= T (token space; moved to chunk space here).
    gate: None (g is the log decay) or (dt_bias [H, K], exp(A_log) [H], lower_bound) with g the
    raw gate projection f (fused preprocessing).
    """
    C = CHUNK
    N = tok0.shape[0]
    _, H, K = k.shape
    V = v.shape[-1]
    if _TOKEN_SPACE_BETA:        # the pre-fix layout (debugging only; rows padded to 16 bytes)
        beta_t = jnp.pad(beta_t.astype(_F32), ((0, 0), (0, (-beta_t.shape[1]) % 4)))
    else:
        beta_t = _beta_chunks(beta_t, tok0, ntok)
    sd = lambda *shape, dt=_BF: jax.ShapeDtypeStruct(shape, dt)
    tiled = lambda shape, minor: plgpu.SMEM(shape, _BF, transforms=swizzled(minor))
    # Akk/Aqk A (x2) then B (-> Aqk out; U's rhs overlaps only A) | rhs U -> U | f (dead after step 1)
    late = ((tiled((2, C, 64), 64), tiled((C, 64), 64)),
            (tiled((C, V), V),))
    if gate is not None:
        late += ((plgpu.SMEM((C, K + PAD), _BF),),)
    scratch = [
        plgpu.SMEM((C, K + PAD), _BF),                             # q -> Qg
        plgpu.SMEM((C, K + PAD), _BF),                             # k -> Kd
        plgpu.RefUnion((plgpu.SMEM((C, V + PAD), _BF),), (tiled((C, K), K),)),   # v; rhs W -> W
        plgpu.RefUnion((plgpu.SMEM((C, K + PAD), _F32),), (tiled((2, C, C), C),) * 2),  # G; D, E
        plgpu.RefUnion(*late),
        plgpu.SMEM((C,), _F32),                                    # beta (or its logits)
    ]
    flat = lambda x: x.reshape(x.shape[0], -1)                     # [T, H, D] -> [T, H * D]
    args = [tok0, ntok, flat(q), flat(k), flat(v), flat(g), beta_t]
    lower_bound = None
    if gate is not None:
        dt_bias, a_exp, lower_bound = gate
        scratch.append(plgpu.SMEM((K,), _F32))                     # dt_bias row of this head
        args += [dt_bias, a_exp]
    scratch.append(plgpu.Barrier(num_barriers=6 if gate is not None else 5))
    # K = 64: the cumsum's column layout is replicated (several threads read and write one G
    # element), which needs Pallas' barriers around every store.
    own_barriers = OWN_BARRIERS and K == 128
    return plgpu.kernel(
        functools.partial(_prep_body, K, V, scale, lower_bound, _TOKEN_SPACE_BETA, A_FROM_REGISTERS,
                          frozenset(_SKIP_PHASES), bool(interpret), own_barriers),
        out_type=(sd(N, H, C, K), sd(N, H, C, V), sd(N, H, C, K), sd(N, H, C, K), sd(N, H, C, C),
                  sd(N, H, K, dt=_F32)),
        scratch_types=tuple(scratch),
        grid=(N, H),
        grid_names=("n", "h"),
        kernel_name="kda_prefill_prep",     # the kernel's name in profiles
        compiler_params=plgpu.CompilerParams(**_PARAMS, unsafe_no_auto_barriers=own_barriers),
        interpret=interpret if interpret else None,
    )(*args)


# ----------------------------------------------------------------------------- kernel 2


def _split_store(ref, x):
    """ref[0], ref[1] = bf16 hi, lo parts of the fp32 x (x ~ hi + lo to ~2^-16 relative)."""
    hi = x.astype(_BF)
    store(ref.at[0], hi)
    store(ref.at[1], (x - hi.astype(_F32)).astype(_BF))


def _store_rows(o_s, o_g, r0, nrows, h, cols):
    """TMA-store rows [0, nrows) of o_s to o_g[r0:r0+nrows, h, cols] in power-of-two pieces."""
    off = 0                                    # static for the first piece, traced after
    size = o_s.shape[0]
    while size >= 1:
        @pl.when((nrows & size) != 0)
        def _(off=off, size=size):
            plgpu.copy_smem_to_gmem(o_s.at[pl.ds(off, size)], o_g.at[pl.ds(r0 + off, size), h, cols])

        off = off + (nrows & size)
        size //= 2


def _state_body(K, V, bv, has_s0, own_barriers, clo_g, chi_g, cu_g, w_g, u_g, kd_g, qg_g, aqk_g, gc_g, *refs):
    C = CHUNK
    if has_s0:
        s0_g, *refs = refs
    o_g, st_g, w_s, qg_s, kd_s, aqk_s, u_s, gc_s, s_op, vp_op, o_s, s_io, bars, s0_bar = refs
    s, h, j = lax.axis_index("s"), lax.axis_index("h"), lax.axis_index("j")
    cols = pl.ds(pl.multiple_of(j * bv, bv), bv)
    lo, hi = clo_g[s], chi_g[s]
    tok_lo, tok_hi = cu_g[s], cu_g[s + 1]
    nbuf = 6
    sync = plgpu.commit_smem if own_barriers else (lambda: None)   # see _prep_body

    def issue(c, slot):
        srcs = (w_g.at[c, h], qg_g.at[c, h], kd_g.at[c, h], aqk_g.at[c, h], u_g.at[c, h, :, cols],
                gc_g.at[c, h])
        dsts = (w_s, qg_s, kd_s, aqk_s, u_s, gc_s)
        for i, (src, dst) in enumerate(zip(srcs, dsts)):
            plgpu.copy_gmem_to_smem(src, dst.at[slot], bars.at[slot * nbuf + i])

    issue(lo, 0)
    if has_s0:
        plgpu.copy_gmem_to_smem(s0_g.at[s, h, :, cols], s_io, s0_bar.at[0])
        plgpu.barrier_wait(s0_bar.at[0])
        S = _load(s_io)
    else:
        S = _zeros((K, bv))

    def emit_o(o, i):          # chunk i's O rows out, through o_s (TMA pieces, see _store_rows)
        r0 = tok_lo + i * C
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)            # the last O store has read o_s
        sync()                                                     # (waited by its issuing thread)
        store(o_s, o.astype(o_s.dtype))
        plgpu.commit_smem()
        _store_rows(o_s, o_g, r0, jnp.minimum(C, tok_hi - r0), h, cols)

    # One chunk: V' = U - W S, O = Qg S + Aqk V', S <- exp(G_C) S + Kd^T V'. Only W S and Kd^T V'
    # are on the serial path; the next chunk's loads are issued while W S runs, and the previous
    # chunk's O goes out while Kd^T V' runs (each WGMMA call is one commit group, so waiting for
    # "all but the last 2" waits for exactly the first of two products issued back to back).
    def chunk(c, carry):
        S, o_prev = carry
        i = c - lo
        slot = lax.rem(i, jnp.int32(2))
        for b in range(nbuf):
            plgpu.barrier_wait(bars.at[slot * nbuf + b])
        sync()                          # every warp is past the last chunk's MMAs on s_op, vp_op
        _split_store(s_op, S)
        plgpu.commit_smem()

        def mmas(acc_ws, acc_o, acc_s):
            for part in (0, 1):
                plgpu.wgmma(acc_ws, w_s.at[slot], s_op.at[part])
            for part in (0, 1):
                plgpu.wgmma(acc_o, qg_s.at[slot], s_op.at[part])

            @pl.when(c + 1 < hi)      # the other slot's last reader (chunk c - 1) has finished
            def _():
                issue(c + 1, 1 - slot)

            ws = plgpu.wgmma_accumulator_load(acc_ws, wait_n=2)    # Qg S may still run
            _split_store(vp_op, _load(u_s.at[slot]).astype(_F32) - ws)
            plgpu.commit_smem()
            for part in (0, 1):
                plgpu.wgmma(acc_s, kd_s.at[slot].transpose((1, 0)), vp_op.at[part])
            for part in (0, 1):
                plgpu.wgmma(acc_o, aqk_s.at[slot], vp_op.at[part])

            @pl.when(i > 0)
            def _():
                emit_o(o_prev, i - 1)

            ds = plgpu.wgmma_accumulator_load(acc_s, wait_n=2)     # Aqk V' may still run
            S_new = S * _rows(jnp.exp(_load(gc_s.at[slot], _ROW)), bv) + ds
            return S_new, acc_o[...]

        return pl.run_scoped(mmas, plgpu.ACC((C, bv), _F32), plgpu.ACC((C, bv), _F32),
                             plgpu.ACC((K, bv), _F32))

    S, o_last = lax.fori_loop(lo, hi, chunk, (S, _zeros((C, bv))))
    emit_o(o_last, hi - 1 - lo)        # every sequence has at least one (maybe empty) chunk
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    store(s_io, S)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s_io, st_g.at[s, h, :, cols])
    plgpu.wait_smem_to_gmem(0)


def _state(clo, chi, cu, w, u, kd, qg, aqk, gc, s0, T, bv, out_dtype, interpret):
    """Kernel 2 over (sequence, head, V block); see the module docstring."""
    C = CHUNK
    _, H, _, K = w.shape
    V = u.shape[-1]
    S = clo.shape[0]
    op = swizzled(bv)                   # every WGMMA operand here shares the B operands' swizzle
    args = (clo, chi, cu, w, u, kd, qg, aqk, gc) + (() if s0 is None else (s0,))
    return plgpu.kernel(
        functools.partial(_state_body, K, V, bv, s0 is not None, OWN_BARRIERS),
        out_type=(jax.ShapeDtypeStruct((T, H, V), out_dtype),
                  jax.ShapeDtypeStruct((S, H, K, V), _F32)),
        scratch_types=(
            plgpu.SMEM((2, C, K), _BF, transforms=op),                     # W
            plgpu.SMEM((2, C, K), _BF, transforms=op),                     # Qg
            plgpu.SMEM((2, C, K), _BF, transforms=op),                     # Kd
            plgpu.SMEM((2, C, C), _BF, transforms=op),                     # Aqk
            plgpu.SMEM((2, C, bv), _BF, transforms=op),                    # U (column block)
            plgpu.SMEM((2, K), _F32),                                      # G_C
            plgpu.SMEM((2, K, bv), _BF, transforms=op),                    # S hi, lo (B operand)
            plgpu.SMEM((2, C, bv), _BF, transforms=op),                    # V' hi, lo (B operand)
            plgpu.SMEM((C, bv), out_dtype),                                # O staging
            plgpu.SMEM((K, bv), _F32),                                     # state in / out
            plgpu.Barrier(num_barriers=12),
            plgpu.Barrier(num_barriers=1),
        ),
        grid=(S, H, V // bv),
        grid_names=("s", "h", "j"),
        kernel_name="kda_prefill_state",
        compiler_params=plgpu.CompilerParams(**_PARAMS, unsafe_no_auto_barriers=OWN_BARRIERS),
        interpret=interpret if interpret else None,
    )(*args)


# ----------------------------------------------------------------------------- wrapper


def _prefill(q, k, v, g, beta, gate, initial_state, scale, cu_seqlens, out_dtype, block_v,
             interpret, prep_only=False):
    """Shared wrapper: [B, T, ...] -> packed, checks, chunk tables, the two kernels.

    prep_only (debugging, bench/kda_prefill_debug.py): stop after kernel 1 and return
    ((w, u, kd, qg, aqk, gc), (tok0, ntok, clo, chi, cu)).
    """
    batched = k.ndim == 4
    if batched:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens is only for packed [T, H, K] inputs, got [B, T, H, K] ones")
        B, T1 = k.shape[:2]
        q, k, v, g, beta = (x.reshape(B * T1, *x.shape[2:]) for x in (q, k, v, g, beta))
        cu_seqlens = jnp.arange(B + 1, dtype=jnp.int32) * T1
    if k.ndim != 3:
        raise ValueError(f"k must be [T, H, K] or [B, T, H, K], got shape {k.shape}")
    T, H, K = k.shape
    V = v.shape[-1]
    if T < 1:
        raise ValueError("T must be >= 1")
    g_name, b_name = ("f", "beta_logits") if gate is not None else ("g", "beta")
    for name, x, shape in (("q", q, (T, H, K)), (g_name, g, (T, H, K)), ("v", v, (T, H, V)),
                           (b_name, beta, (T, H))):
        if x.shape != shape:
            raise ValueError(f"{name} has shape {x.shape}, expected {shape} (from k {k.shape})")
    if K not in HEAD_DIMS:
        raise ValueError(f"K={K} must be 64 or 128 (64-channel WGMMA parts; larger K overflows "
                         "the 227 KiB of SMEM)")
    out_dtype = jnp.dtype(out_dtype)
    if V % 64 or V > 256:
        raise ValueError(f"V={V} must be a multiple of 64 (a WGMMA operand tile), at most 256")
    if V % block_v or block_v % 16 or (block_v * out_dtype.itemsize) % 128:
        raise ValueError(f"block_v={block_v} must divide V={V}, be a multiple of 16 and fill "
                         f"whole 128-byte rows of {out_dtype.name}; try 32 (fp32) or 64 (bf16)")
    if cu_seqlens is None:
        cu_seqlens = jnp.array([0, T], jnp.int32)
    if isinstance(cu_seqlens, (np.ndarray, list, tuple)):
        cu_np = np.asarray(cu_seqlens)
        if cu_np.ndim != 1 or cu_np[0] != 0 or cu_np[-1] != T or np.any(np.diff(cu_np) < 0):
            raise ValueError(f"cu_seqlens must rise from 0 to T={T}, got {cu_np.tolist()}")
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    n_seq = cu.shape[0] - 1
    if initial_state is not None and initial_state.shape != (n_seq, H, K, V):
        raise ValueError(f"initial_state shape {initial_state.shape} != {(n_seq, H, K, V)}")
    scale = float(K ** -0.5 if scale is None else scale)

    tok0, ntok, clo, chi = chunk_tables(cu, T, n_seq)
    # beta as [H, T] (contiguous per head); _prep moves it to chunk space for aligned TMA boxes
    beta_t = beta.astype(_F32).T
    g = g.astype(_BF if gate is not None else _F32)
    w, u, kd, qg, aqk, gc = _prep(tok0, ntok, q.astype(_BF), k.astype(_BF), v.astype(_BF), g,
                                  beta_t, gate, scale, interpret)
    if prep_only:
        return (w, u, kd, qg, aqk, gc), (tok0, ntok, clo, chi, cu)
    s0 = None if initial_state is None else initial_state.astype(_F32)
    o, s_final = _state(clo, chi, cu, w, u, kd, qg, aqk, gc, s0, T, block_v, out_dtype, interpret)
    if batched:
        o = o.reshape(B, T1, H, V)
    return o, s_final


def kda_prefill_pallas(q, k, v, g, beta, initial_state=None, scale=None, *, cu_seqlens=None,
                       out_dtype=jnp.float32, block_v=32, interpret=False):
    """Chunked KDA forward over packed sequences (recurrence only); see the module docstring.

    q, k [T, H, K] L2-normalised; g [T, H, K] log decay (>= -9 per token); v [T, H, V];
    beta [T, H]; cu_seqlens [S+1] int32 (None: one sequence). Or [B, T, H, .] inputs with
    cu_seqlens=None (B sequences of T tokens). initial_state [S, H, K, V] or None.
    K in {64, 128}; V % 64 == 0, V <= 256; block_v divides V and block_v * itemsize(out_dtype)
    is a multiple of 128 bytes (fp32: 32, 64, 128; bf16: 64, 128).
    ``interpret``: False (compile for the GPU) or a ``plgpu.InterpretGPUParams``.
    Returns (o [T, H, V] or [B, T, H, V] in out_dtype, final state [S, H, K, V] float32).
    """
    return _prefill(q, k, v, g, beta, None, initial_state, scale, cu_seqlens, out_dtype,
                    block_v, interpret)


def kda_prefill_fused_pallas(q, k, v, f, beta_logits, A_log, dt_bias, initial_state=None,
                             scale=None, *, lower_bound=-5.0, cu_seqlens=None,
                             out_dtype=jnp.float32, block_v=32, interpret=False):
    """As :func:`kda_prefill_pallas`, with the preprocessing fused into kernel 1: q, k are the
    raw (pre-L2-norm) projections, f [T, H, K] the raw gate projection (W_f x, cast to bf16),
    beta_logits [T, H] (W_b x), A_log [H], dt_bias [H*K]. In the kernel: q, k / sqrt(sum^2 +
    1e-6), g = lower_bound * sigmoid(exp(A_log) (f + dt_bias)) (Ling's safe gate; Kimi's
    softplus gate is unbounded and not supported), beta = sigmoid(beta_logits).
    Padding: f = beta_logits = -inf on a token gives g = 0, beta = 0, an exact identity update
    (how a caller masks tokens past a valid length).
    """
    if not MIN_LOG_DECAY <= lower_bound < 0.0:
        raise ValueError(f"lower_bound={lower_bound} must be in [-9, 0): the in-chunk decay "
                         "factors need g >= -9 per token")
    H, K = k.shape[-2:]
    if A_log.shape != (H,) or dt_bias.size != H * K:
        raise ValueError(f"A_log {A_log.shape} / dt_bias {dt_bias.shape} must be [{H}] / [{H * K}]")
    gate = (dt_bias.astype(_F32).reshape(H, K), jnp.exp(A_log.astype(_F32)), float(lower_bound))
    return _prefill(q, k, v, f, beta_logits, gate, initial_state, scale, cu_seqlens, out_dtype,
                    block_v, interpret)
