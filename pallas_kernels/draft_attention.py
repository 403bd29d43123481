"""The DSpark draft's attention over its context cache, split over the context like flash-decoding
(Pallas Mosaic GPU, `plgpu.kernel`), for blocks of T = 1..16 query tokens.

Contract (the XLA reference is :func:`context_attention_reference`: the attention of
:class:`lingjax.model.dspark.DSparkAttention`):

    q       [B, T, H, d]    bf16   the block's queries (normed and roped), H = Hk * g
    k, v    [B, S, Hk, d]   bf16   the draft's context cache (normed and roped keys, values)
    length  [B] int32              positions s < length[b] are valid (at most S)
    scale   float                  the softmax scale
    k_extra, v_extra [B, X, Hk, d] bf16, optional: X <= 64 more keys every query sees (the block's
                                   own: the draft's block attention is not causal)
    -> (o [B, T, H, d] float32: softmax_s(scale q . k_s) . v_s over the valid positions and the
        extra keys, lse [B, T, H] float32: log2 of that softmax's denominator with its max, -inf
        where no key is valid), so that a caller could merge other keys' scores exactly.

Design
------
* Program (b, kv head, split): the kv head's g query heads x T tokens as the rows of one WGMMA
  tile (g * T <= 64; rows r = t * g + i; the XLA prologue pads them to a multiple of 8, rows past
  them are zeros in SMEM and never written out) against an even share of the
  ceil(length / 64) 64-position chunks. Per chunk (double-buffered TMA: the next chunk's K and V
  tiles load while this one is used; each tile the kv head's d columns of S rows, a strided box):
  scores = q . K_chunk^T by WGMMA (K transposed as B), masked to the valid positions, an online
  softmax in the log2 domain (FlashAttention's running max and sum), P rounded to bf16 (as the
  reference rounds its probabilities before P . V), the accumulator rescaled, acc += P . V_chunk
  with P as a register A operand (an SMEM tile in interpret mode). A cache whose S is not a
  multiple of 64 reads its last chunk from S - 64 and masks what an earlier chunk covered.
* The extra keys (the block's own, session 31): every program loads them by TMA next to its
  queries, into a zeroed 64-row K / V tile pair, and adds them after its context chunks as one more
  chunk, masked to the first X columns, and to nothing in all splits but the first (so they count
  once; the masked chunk is an exact no-op on the online softmax).
* Each program writes its split's normalised o [rows, d] and lse [rows] (float32); XLA combines
  the splits (``common.combine_splits``), as for the MLA decode kernel.

Where it helps: the XLA path writes float32 scores [H, S, T] per layer (9.5 MB at the published
draft's 32 heads and a 9,280-position cache), re-reads them for the max, the exponentials and the
sum, and then reads P again for P . V; here K and V are read once and the scores stay on chip.

Status (session 31): interpret-mode tests with race detection against the XLA reference
(`tests/test_pallas_draft_attention.py`), cross-lowering for CUDA at the published draft's shape,
and the same tests on an H100 (runs 111, 113). There, 12-layer DSpark step: 4.514 ms with the
draft's attention in XLA, 4.463 with the context on this kernel (the block's keys merged in XLA),
4.426 with the block's keys as extra keys (run 113's same-call baseline: 4.435). The model uses it
under ``lingjax.model.dspark.ATTENTION_KERNEL`` (on by default) when the draft's projections run on
the skinny GEMM (dense_kernel='pallas').
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import a_operand, combine_splits, mma_add, pdl_wait, store, swizzled

__all__ = ["MAX_T", "BLOCK_S", "context_attention_pallas", "context_attention_reference",
           "pick_splits"]

MAX_T = 16                # block tokens per call
ROWS = 64                 # query rows per program (one WGMMA M)
BLOCK_S = 64              # context positions per chunk
TARGET_PROGRAMS = 264     # two programs per SM of the H200's 132
_F32, _BF = jnp.float32, jnp.bfloat16
_LOG2E = math.log2(math.e)


def pick_splits(B: int, Hk: int, chunks: int) -> int:
    """Context splits: about TARGET_PROGRAMS programs, at most one per chunk."""
    return max(1, min(chunks, TARGET_PROGRAMS // max(1, B * Hk)))


def context_attention_reference(q, k, v, length, k_extra=None, v_extra=None, *, scale: float):
    """The XLA reference of the contract above (the same float32 scores and bf16-rounded P as
    DSparkAttention's XLA path, over the valid context positions and the extra keys)."""
    B, T, H, d = q.shape
    S, Hk = k.shape[1], k.shape[2]
    g = H // Hk
    valid = jnp.arange(S)[None, :] < jnp.broadcast_to(jnp.asarray(length, jnp.int32), (B,))[:, None]
    if k_extra is not None:
        k, v = jnp.concatenate([k, k_extra], 1), jnp.concatenate([v, v_extra], 1)
        valid = jnp.concatenate([valid, jnp.ones((B, k_extra.shape[1]), bool)], 1)
    qg = q.reshape(B, T, Hk, g, d)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(q.dtype), preferred_element_type=_F32) * scale
    s = jnp.where(valid[:, None, None, None, :], s, -jnp.inf)
    m = s.max(-1, keepdims=True)
    m_use = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_use)
    den = p.sum(-1, keepdims=True)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v, preferred_element_type=_F32)
    o = o / jnp.moveaxis(jnp.where(den > 0, den, 1.0), (1, 2, 3), (2, 3, 1))
    lse = jnp.where(den[..., 0] > 0, (m_use[..., 0] + jnp.log(jnp.where(den[..., 0] > 0, den[..., 0], 1.0))) * _LOG2E,
                    -jnp.inf)                                       # [B, Hk, g, T]
    return o.reshape(B, T, H, d), jnp.moveaxis(lse, 3, 1).reshape(B, T, H)


def context_attention_pallas(q, k, v, length, k_extra=None, v_extra=None, *, scale: float,
                             splits: int | None = None, interpret=False):
    """See the module docstring. q [B, T, H, d], k / v [B, S, Hk, d] (bf16), length [B] or a scalar
    (int32), k_extra / v_extra [B, X, Hk, d] (bf16, X <= 64) or None -> (o [B, T, H, d] float32,
    lse [B, T, H] float32). ``splits``: context splits (default `pick_splits`); ``interpret``: False
    (compile for the GPU) or a ``plgpu.InterpretGPUParams``."""
    B, T, H, d = q.shape
    S, Hk = k.shape[1], k.shape[2]
    if k.shape != (B, S, Hk, d) or v.shape != k.shape:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: need q [B, T, H, d] and k, v [B, S, Hk, d]")
    if any(jnp.dtype(x.dtype) != _BF for x in (q, k, v)):
        raise ValueError(f"q, k, v must be bfloat16 (got {q.dtype}, {k.dtype}, {v.dtype}); use the XLA path")
    if H % Hk:
        raise ValueError(f"H={H} query heads are not a multiple of Hk={Hk} kv heads")
    g = H // Hk
    if not 1 <= T <= MAX_T or g * T > ROWS:
        raise ValueError(f"T={T} tokens x {g} query heads per kv head must be at most {ROWS} rows (T <= {MAX_T})")
    if d not in (64, 128):
        raise ValueError(f"head_dim={d}: the kernel takes 64 or 128")
    if S < BLOCK_S or S % 8:
        raise ValueError(f"the cache holds S={S} positions; the kernel needs S >= {BLOCK_S} and S % 8 == 0")
    has_extra = k_extra is not None
    if has_extra != (v_extra is not None):
        raise ValueError("give both k_extra and v_extra, or neither")
    X = k_extra.shape[1] if has_extra else 0
    if has_extra and (k_extra.shape != (B, X, Hk, d) or v_extra.shape != k_extra.shape
                      or not 1 <= X <= BLOCK_S or any(jnp.dtype(a.dtype) != _BF for a in (k_extra, v_extra))):
        raise ValueError(f"k_extra {k_extra.shape}, v_extra {v_extra.shape} ({k_extra.dtype}, {v_extra.dtype}): need "
                         f"bf16 [B, X, Hk, d] = [{B}, X, {Hk}, {d}] with 1 <= X <= {BLOCK_S}")
    Xp = -(-X // 8) * 8         # whole 8-row TMA tiles; rows past X are masked
    chunks = -(-S // BLOCK_S)
    n_split = pick_splits(B, Hk, chunks) if splits is None else int(splits)
    if not 1 <= n_split <= chunks:
        raise ValueError(f"splits={n_split} must be in 1..{chunks} (the cache's {BLOCK_S}-position chunks)")
    R = g * T
    Rp = -(-R // 8) * 8
    # [B, Hk, Rp, d]: each kv head's rows r = t * g + i (tiny: the block's queries)
    qr = jnp.moveaxis(q.reshape(B, T, Hk, g, d), 2, 1).reshape(B, Hk, R, d)
    if Rp != R:
        qr = jnp.pad(qr, ((0, 0), (0, 0), (0, Rp - R), (0, 0)))
    kf, vf = k.reshape(B, S, Hk * d), v.reshape(B, S, Hk * d)        # free: a kv head's d columns
    extra = ()
    if has_extra:
        pad = ((0, 0), (0, Xp - X), (0, 0), (0, 0))
        extra = tuple((jnp.pad(a, pad) if Xp != X else a).reshape(B, Xp, Hk * d) for a in (k_extra, v_extra))
    lengths = jnp.broadcast_to(jnp.asarray(length, jnp.int32), (B,))
    scale_log2 = float(scale) * _LOG2E
    row = plgpu.Layout.WGMMA.reduce(1)
    bs = BLOCK_S

    def body(q_g, k_g, v_g, len_g, *refs):
        kx_g, vx_g, o_g, lse_g = refs if has_extra else (None, None, *refs)
        pdl_wait(interpret)
        b, h, sp = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
        n_len = jnp.minimum(len_g[b], S)
        n_need = (n_len + (bs - 1)) // bs
        per = (n_need + (n_split - 1)) // n_split
        lo = jnp.minimum(sp * per, n_need)
        hi = jnp.minimum(lo + per, n_need)
        cols = pl.ds(h * d, d)

        def attend(q_s, k_s, v_s, qbar, bars, *more):
            kx_s, vx_s, xbar = more[:3] if has_extra else (None, None, None)
            p_s = more[3:] if has_extra else more
            zeros = plgpu.layout_cast(jnp.zeros((ROWS, d), _BF), plgpu.Layout.WGMMA)
            if Rp < ROWS:            # rows past the block's: zeros (their results are not written)
                store(q_s, zeros)
            if has_extra and Xp < BLOCK_S:    # key rows past the extra ones: zeros (0 * V, never NaN)
                store(kx_s, zeros)
                store(vx_s, zeros)
            if Rp < ROWS or (has_extra and Xp < BLOCK_S):
                plgpu.commit_smem()
            plgpu.copy_gmem_to_smem(q_g.at[b, h], q_s.at[pl.ds(0, Rp)], qbar.at[0])
            if has_extra:
                plgpu.copy_gmem_to_smem(kx_g.at[b, :, cols], kx_s.at[pl.ds(0, Xp)], xbar.at[0])
                plgpu.copy_gmem_to_smem(vx_g.at[b, :, cols], vx_s.at[pl.ds(0, Xp)], xbar.at[1])

            def issue(c, slot):
                start = jnp.minimum(c * bs, S - bs)
                plgpu.copy_gmem_to_smem(k_g.at[b, pl.ds(start, bs), cols], k_s.at[slot], bars.at[2 * slot])
                plgpu.copy_gmem_to_smem(v_g.at[b, pl.ds(start, bs), cols], v_s.at[slot], bars.at[2 * slot + 1])

            @pl.when(lo < hi)
            def _():
                issue(lo, 0)

            plgpu.barrier_wait(qbar.at[0])

            def update(carry, k_tile, v_tile, valid):
                """The online softmax over one 64-key tile; valid(at) [ROWS, bs] bool: which of its
                columns count (at: the column index)."""
                acc, m, l = carry

                def qk(s_ref):
                    plgpu.wgmma(s_ref, q_s, k_tile.transpose((1, 0)))
                    return s_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((ROWS, bs), _F32))
                at = plgpu.broadcasted_iota(jnp.int32, (ROWS, bs), 1, layout=plgpu.Layout.WGMMA)
                s = jnp.where(valid(at), s * scale_log2, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=1))
                m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)     # a row with nothing seen yet
                alpha = jnp.exp2(m - m_use)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [0]))
                l = l * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                acc = mma_add(acc, a_operand(p.astype(_BF), p_s[0] if p_s else None, interpret), v_tile,
                              interpret)
                return acc, m_new, l

            def chunk(c, carry):
                slot = lax.rem(c - lo, jnp.int32(2))
                plgpu.barrier_wait(bars.at[2 * slot])
                plgpu.barrier_wait(bars.at[2 * slot + 1])

                @pl.when(c + 1 < hi)      # the other slot's readers (chunk c - 1's WGMMAs) are done
                def _():
                    issue(c + 1, 1 - slot)

                start = jnp.minimum(c * bs, S - bs)
                return update(carry, k_s.at[slot], v_s.at[slot],
                              lambda at: (start + at >= c * bs) & (start + at < n_len))

            init = (plgpu.layout_cast(jnp.zeros((ROWS, d), _F32), plgpu.Layout.WGMMA),
                    plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, _F32), row),
                    plgpu.layout_cast(jnp.zeros((ROWS,), _F32), row))
            carry = lax.fori_loop(lo, hi, chunk, init)
            if has_extra:            # counted by the first split only
                plgpu.barrier_wait(xbar.at[0])
                plgpu.barrier_wait(xbar.at[1])
                carry = update(carry, kx_s, vx_s, lambda at: (at < X) & (sp == 0))
            return carry

        acc, m, l = pl.run_scoped(
            attend,
            plgpu.SMEM((ROWS, d), _BF, transforms=swizzled(d)),                       # the query rows
            plgpu.SMEM((2, bs, d), _BF, transforms=swizzled(d)),                      # K chunks
            plgpu.SMEM((2, bs, d), _BF, transforms=swizzled(d)),                      # V chunks
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_barriers=4),
            *((plgpu.SMEM((bs, d), _BF, transforms=swizzled(d)),                      # the extra keys
               plgpu.SMEM((bs, d), _BF, transforms=swizzled(d)),                      # and values
               plgpu.Barrier(num_barriers=2)) if has_extra else ()),
            *([plgpu.SMEM((ROWS, bs), _BF, transforms=swizzled(bs))] if interpret else []),   # P
        )

        def emit(o_s, lse_s):        # reuses the SMEM of `attend`'s buffers (a later scope)
            seen = l > 0.0
            store(o_s, acc / lax.broadcast_in_dim(jnp.where(seen, l, 1.0), acc.shape, [0]))
            store(lse_s, jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)) * _LOG2E, -jnp.inf))
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s.at[pl.ds(0, Rp)], o_g.at[sp, b, h])
            plgpu.copy_smem_to_gmem(lse_s.at[pl.ds(0, Rp)], lse_g.at[sp, b, h])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(emit, plgpu.SMEM((ROWS, d), _F32), plgpu.SMEM((ROWS,), _F32))

    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((n_split, B, Hk, Rp, d), _F32),
                  jax.ShapeDtypeStruct((n_split, B, Hk, Rp), _F32)),
        grid=(B, Hk, n_split),
        grid_names=("b", "h", "s"),
        kernel_name="draft_context_attention",    # the kernel's name in profiles
        interpret=interpret if interpret else None,
    )
    o_part, lse_part = kernel(qr, kf, vf, lengths, *extra)
    o, lse = combine_splits(o_part, lse_part)                         # [B, Hk, Rp, d], [B, Hk, Rp]
    o = jnp.moveaxis(o[:, :, :R].reshape(B, Hk, T, g, d), 2, 1).reshape(B, T, H, d)
    lse = jnp.moveaxis(lse[:, :, :R].reshape(B, Hk, T, g), 2, 1).reshape(B, T, H)
    return o, lse
