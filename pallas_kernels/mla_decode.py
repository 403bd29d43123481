"""Absorbed MLA decode / verify attention over the latent cache (Pallas Mosaic GPU, `plgpu.kernel`),
split over the context like flash-decoding, for query blocks of T = 1..16 tokens.

Contract (the XLA reference is :func:`lingjax.ops.mla.absorbed_attention`, which is what the model's
absorbed path computes; lingjax/model/mla.py):

    q_lat   [B, R, L]       bf16   rows r = t * H + h (token-major, as [B, T, H] flattens): the
                                   absorbed latent query q_nope . W_uk
    q_rope  [B, R, Dr]      bf16   the rotated rope query (same rows)
    latent  [B, S, L]       bf16   the cache's kv_a_layernorm(latent) per position
    k_rope  [B, S, Dr]      bf16   the cache's rotated rope key per position
    pos     int32 scalar           the block's first position: row r sees positions s <= pos + r // H
    -> o    [B, R, L]       float32   softmax_s(scale * (q_lat . latent_s + q_rope . k_rope_s)) . latent

Design
------
* The T x H query rows share one latent K / V, so a program takes a tile of 64 rows (one WGMMA
  M; R padded up, pad rows discarded) against a share of the context, and the context is split
  over ``splits`` programs. Grid ``(B, R / 64, L / cb, splits)``: the third axis splits the
  output's L columns into cb <= 256 wide blocks (a WGMMA N), because one warpgroup's [64, 512]
  float32 accumulator would take 256 registers per thread; each of the column programs recomputes
  the same scores (QK over all L + Dr columns) and keeps only its columns of P . latent.
* Per 64-position chunk (a double-buffered TMA pipeline: the next chunk's latent / rope rows
  load while this one is used): scores = q . [latent | k_rope]^T by WGMMA (the chunk's SMEM
  tiles transposed as B), masked (s <= the row's position), an online softmax in the log2
  domain (FlashAttention's running max m and sum l; P rounded to bf16, the rounding the XLA path
  applies to its normalised probabilities), the accumulator rescaled and acc += P . latent_chunk[:,
  cols] by WGMMA with P as a register A operand. The split's chunks are an even share of the
  ceil((pos + T) / 64) chunks any row can see, computed in the kernel from pos (the cache's
  length S is only an upper bound; S % 8 == 0, the TMA tiles' rows). A cache whose length is
  not a multiple of the chunk reads its last chunk from S - 64 and masks the positions an earlier
  chunk covered.
* Each program writes its normalised partial o = acc / l [64, cb] float32 and (column block 0)
  lse = m + log2 l, only for real rows (R rounded up to 8; at T = 1, 32 of the tile's 64); XLA
  combines the splits: o = sum_i 2^(lse_i - M) o_i / sum_i 2^(lse_i - M). Every row sees
  position 0, so M is finite; an empty split writes lse = -inf and o = 0.

* ``warpgroups=2`` (FlashMLA's split; L = 2 x 256, Dr = 64): grid ``(B, R / 64, splits)``, both
  column blocks in one program, so the scores are computed once and each cache chunk is read
  once per row tile instead of once per (row tile, column block). Warpgroup 0 loads q, computes
  the scores and the softmax, stores P (bf16, over the chunk's rope-key tile, which the scores
  have just used) and alpha, signals ``p_ready``, and accumulates column block 0; warpgroup 1
  waits for P, accumulates block 1 from it (P as an SMEM A operand), waits until warpgroup 0 is
  past the chunk (``free0``) and refills its slot with the chunk after next; ``w1_done`` keeps
  warpgroup 0 at most one chunk ahead (every barrier phase observed before the next). The two
  float32 output tiles take the latent slots' SMEM once both warpgroups pass ``fin`` (a
  RefUnion; SMEM is full to ~100 bytes). The same values as warpgroups=1, bit for bit in
  interpret mode; twice the splits for the same program count (twice the partial bytes).

Interpret mode (CPU tests) takes WGMMA operands only from SMEM: P goes through an SMEM tile there
(`common.a_operand`); the register operand is checked by cross-lowering, then on the H200.

Status (session 19): interpret-mode tests (race detection) against the reference and a float64
oracle, both forms, and cross-lowering for CUDA at the Ling shape (B = 1, H = 32, L = 512, Dr = 64,
T = 1, 9 and 16, 8K-9K-position caches); on the H200 (jax 0.11.2) the GPU tests pass for both forms
and, at an 8K context, the kernel takes 9.6 us at T = 1 and 23.0 us at T = 9 (one fp8 MLA layer
70.8 -> 61.0 us and 107.7 -> 81.9 us against the XLA attention; docs/PERFORMANCE.md, session 19).
The model uses it under ``mla_kernel='pallas'`` (lingjax/model/mla.py; XLA is the default, as for
every kernel switch).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import a_operand, combine_splits, mma_add, pdl_wait, store, swizzled

__all__ = ["BLOCK_ROWS", "MAX_T", "WARPGROUPS", "mla_decode_attention_pallas", "pick_block_s",
           "pick_splits", "warpgroups_for"]

BLOCK_ROWS = 64           # query rows per program (one WGMMA M)
MAX_COLS = 256            # output columns per program (one WGMMA N)
MAX_T = 16                # tokens per call: decode, a speculative verify block
TARGET_PROGRAMS = 132     # the H200's SMs: the default split count aims at one program per SM
# The default form: 1 = one warpgroup per (row tile, column block) program, 2 = both column blocks
# in one program (a scores warpgroup passing P through SMEM to a second one). H200 (session 19, run
# 71, one fp8 MLA layer at an 8K context): 1 vs 2 = 61.0 vs 62.0 us at M = 1, 81.9 vs 81.1 at M = 9,
# so the simpler form stays; bench.mla_layer_timing --mla-warpgroups A/Bs it as a module setting.
WARPGROUPS = 1
_F32, _BF = jnp.float32, jnp.bfloat16
_LOG2E = math.log2(math.e)


def pick_block_s(S: int) -> int:
    """Context positions per chunk: 64, or 32 / 16 for caches shorter than that."""
    for cand in (64, 32, 16):
        if S >= cand:
            return cand
    raise ValueError(f"the cache holds S={S} positions; the kernel needs S >= 16")


def pick_splits(B: int, row_tiles: int, col_blocks: int, chunks: int) -> int:
    """Context splits: enough programs for one per SM (TARGET_PROGRAMS), at most one per chunk."""
    return max(1, min(chunks, TARGET_PROGRAMS // max(1, B * row_tiles * col_blocks)))


def warpgroups_for(L: int, Dr: int, S: int | None = None) -> int:
    """`WARPGROUPS` where that form fits (2 needs L = 2 x 256, Dr = 64 and 64-position chunks), else 1:
    what a caller passes explicitly, so that a traced function's cache key holds the form."""
    fits = _col_blocks(L)[0] == 2 and Dr == BLOCK_ROWS and (S is None or S >= BLOCK_ROWS)
    return WARPGROUPS if fits else 1


def _col_blocks(L: int) -> tuple[int, int]:
    """(number of column blocks, their width cb <= MAX_COLS) for L latent columns."""
    n = -(-L // MAX_COLS)
    if L % n or (L // n) % 16:
        raise ValueError(f"latent width L={L} must split into <= {MAX_COLS}-wide blocks of a multiple of 16")
    return n, L // n


def mla_decode_attention_pallas(q_lat, q_rope, latent, k_rope, pos, *, heads: int, scale: float, splits: int | None = None,
                                block_s: int | None = None, warpgroups: int | None = None, interpret=False):
    """The absorbed attention of a decode / verify block over the latent cache; see the module
    docstring. q_lat [B, R, L], q_rope [B, R, Dr] (R = T * heads), latent [B, S, L], k_rope [B, S, Dr],
    all bf16; pos int32 scalar -> o [B, R, L] float32. ``splits``: context splits (default: `pick_splits`);
    ``block_s``: positions per chunk (default: `pick_block_s`); ``warpgroups``: 1 (one program per
    column block) or 2 (both column blocks in one program; needs L = 2 blocks and 64-position
    chunks), default `WARPGROUPS`; ``interpret``: False (compile for the GPU) or a
    ``plgpu.InterpretGPUParams`` (CPU simulation)."""
    B, R, L = q_lat.shape
    S = latent.shape[1]
    Dr = k_rope.shape[-1]
    if latent.shape != (B, S, L) or k_rope.shape != (B, S, Dr) or q_rope.shape != (B, R, Dr):
        raise ValueError(f"q_lat {q_lat.shape}, q_rope {q_rope.shape}, latent {latent.shape}, k_rope {k_rope.shape}: "
                         "need q_lat [B, R, L], q_rope [B, R, Dr], latent [B, S, L], k_rope [B, S, Dr]")
    if any(jnp.dtype(x.dtype) != _BF for x in (q_lat, q_rope, latent, k_rope)):
        raise ValueError(f"q_lat, q_rope, latent, k_rope must be bfloat16 (got {q_lat.dtype}, {q_rope.dtype}, "
                         f"{latent.dtype}, {k_rope.dtype}); an fp8 or float32 cache needs the XLA path")
    if R % heads:
        raise ValueError(f"R={R} query rows are not a whole number of tokens of {heads} heads")
    T = R // heads
    if not 1 <= T <= MAX_T:
        raise ValueError(f"T={T} tokens; the kernel takes 1..{MAX_T}")
    if S % 8:
        raise ValueError(f"the cache holds S={S} positions; the kernel's TMA copies need S % 8 == 0 "
                         "(lingjax.spec_decode sizes its caches in multiples of 64)")
    if Dr % 16:
        raise ValueError(f"rope width Dr={Dr} must be a multiple of 16")
    nblk, cb = _col_blocks(L)
    bs = pick_block_s(S) if block_s is None else block_s
    if bs not in (16, 32, 64) or bs > S:
        raise ValueError(f"block_s={bs} must be 16, 32 or 64 and <= S={S}")
    wgs = WARPGROUPS if warpgroups is None else warpgroups
    if wgs not in (1, 2) or (wgs == 2 and (nblk != 2 or bs != BLOCK_ROWS or Dr != bs)):
        raise ValueError(f"warpgroups={wgs}: 1, or 2 for a latent of two column blocks (L={L} has {nblk}) "
                         f"read in {BLOCK_ROWS}-position chunks (block_s={bs}) with a rope key as wide "
                         f"(Dr={Dr}: P takes its SMEM tile)")
    row_tiles = -(-R // BLOCK_ROWS)
    Rp = row_tiles * BLOCK_ROWS
    Ro = -(-R // 8) * 8                 # partial rows written: R up to whole 32-byte TMA rows of lse
    last_rows = Ro - (row_tiles - 1) * BLOCK_ROWS
    chunks = -(-S // bs)
    n_split = pick_splits(B, row_tiles, nblk // wgs, chunks) if splits is None else int(splits)
    if not 1 <= n_split <= chunks:
        raise ValueError(f"splits={n_split} must be in 1..{chunks} (the cache's {bs}-position chunks)")
    pos = jnp.asarray(pos, jnp.int32)
    pad = ((0, 0), (0, Rp - R), (0, 0))
    ql, qr = (q_lat, q_rope) if Rp == R else (jnp.pad(q_lat, pad), jnp.pad(q_rope, pad))
    pos1 = pos.reshape(1)               # the block's first position (pos + T, its end, is computed in
                                        # the kernel: as an XLA add it was a kernel launch per call)
    scale_log2 = float(scale) * _LOG2E
    row = plgpu.Layout.WGMMA.reduce(1)
    nbuf = nblk + 1                     # TMA copies per chunk: the latent column blocks, the rope key

    def _softmax_step(q_s, qr_s, lat_s, kr_s, slot, c, lim, m, l):
        """Chunk c (in `slot`): its scores by WGMMA (q against every latent column block and the rope
        key, the SMEM tiles transposed as B), masked to the positions each row sees and an earlier
        chunk did not cover, and the online-softmax update in the log2 domain. lim [64] the rows'
        last positions, m / l [64] the running max / sum -> (p [64, bs] float32, alpha [64], m, l)."""
        def qk(s_ref):
            for i in range(nblk):
                plgpu.wgmma(s_ref, q_s.at[i], lat_s.at[slot, i].transpose((1, 0)))
            plgpu.wgmma(s_ref, qr_s, kr_s.at[slot].transpose((1, 0)))
            return s_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((BLOCK_ROWS, bs), _F32))
        start = jnp.minimum(c * bs, S - bs)
        at = start + plgpu.broadcasted_iota(jnp.int32, (BLOCK_ROWS, bs), 1, layout=plgpu.Layout.WGMMA)
        seen = (at >= c * bs) & (at <= lax.broadcast_in_dim(lim, s.shape, [0]))
        s = jnp.where(seen, s * scale_log2, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)     # a row with nothing seen yet
        alpha = jnp.exp2(m - m_use)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [0]))
        return p, alpha, m_new, l * alpha + p.sum(axis=1)

    def _zero_acc():
        """acc [64, cb] float32 zeros in the WGMMA layout."""
        return plgpu.layout_cast(jnp.zeros((BLOCK_ROWS, cb), _F32), plgpu.Layout.WGMMA)

    def _init_carry():
        """(acc [64, cb] zeros, m [64] -inf, l [64] zeros) in the WGMMA layouts."""
        return (_zero_acc(), plgpu.layout_cast(jnp.full((BLOCK_ROWS,), -jnp.inf, _F32), row),
                plgpu.layout_cast(jnp.zeros((BLOCK_ROWS,), _F32), row))

    def _normalised(acc, l):
        """acc / l per row (rows that saw nothing: acc is 0, l is 0 -> 0)."""
        return acc / lax.broadcast_in_dim(jnp.where(l > 0.0, l, 1.0), acc.shape, [0])

    def _lse(m, l):
        """log2 of each row's softmax denominator (max included); -inf where nothing was seen."""
        return jnp.where(l > 0.0, m + jnp.log(jnp.where(l > 0.0, l, 1.0)) * _LOG2E, -jnp.inf)

    def _chunk_range(pos_g, sp):
        """Split sp's chunks [lo, hi): an even share of the ceil((pos + T) / bs) any row sees."""
        n_need = (pos_g[0] + (T + bs - 1)) // bs
        per = (n_need + (n_split - 1)) // n_split
        lo = jnp.minimum(sp * per, n_need)
        return lo, jnp.minimum(lo + per, n_need)

    def _issue(lat_g, kr_g, b, lat_s, kr_s, bars, c, slot):
        """TMA chunk c's latent column blocks and rope key into `slot` (one barrier per copy)."""
        start = jnp.minimum(c * bs, S - bs)
        for i in range(nblk):
            plgpu.copy_gmem_to_smem(lat_g.at[b, pl.ds(start, bs), pl.ds(i * cb, cb)], lat_s.at[slot, i],
                                    bars.at[slot * nbuf + i])
        plgpu.copy_gmem_to_smem(kr_g.at[b, pl.ds(start, bs)], kr_s.at[slot], bars.at[slot * nbuf + nblk])

    def _load_q(ql_g, qr_g, b, rows, q_s, qr_s, qbar):
        """TMA the row tile's q (latent column blocks, rope part) and wait for it."""
        for i in range(nblk):
            plgpu.copy_gmem_to_smem(ql_g.at[b, rows, pl.ds(i * cb, cb)], q_s.at[i], qbar.at[i])
        plgpu.copy_gmem_to_smem(qr_g.at[b, rows], qr_s, qbar.at[nblk])

    def _wait_q(qbar):
        for i in range(nblk + 1):
            plgpu.barrier_wait(qbar.at[i])

    def _row_limits(pos_g, r):
        """[64] the last position each row of tile r sees: pos + its token (pad rows: the last)."""
        t = (r * BLOCK_ROWS + plgpu.broadcasted_iota(jnp.int32, (BLOCK_ROWS,), 0, layout=row)) // heads
        return pos_g[0] + jnp.minimum(t, T - 1)

    def _rows_out(r, put):
        """put(n) for the tile's real rows: 64, or the last tile's Ro - (row_tiles - 1) * 64."""
        if last_rows == BLOCK_ROWS:
            put(BLOCK_ROWS)
        else:
            pl.when(r < row_tiles - 1)(lambda: put(BLOCK_ROWS))
            pl.when(r == row_tiles - 1)(lambda: put(last_rows))

    def body(ql_g, qr_g, lat_g, kr_g, pos_g, o_g, lse_g):
        pdl_wait(interpret)
        b, r = lax.axis_index("b"), lax.axis_index("r")
        j, sp = lax.axis_index("c"), lax.axis_index("s")
        rows = pl.ds(r * BLOCK_ROWS, BLOCK_ROWS)
        lo, hi = _chunk_range(pos_g, sp)

        def attend(q_s, qr_s, lat_s, kr_s, qbar, bars, *p_s):
            _load_q(ql_g, qr_g, b, rows, q_s, qr_s, qbar)

            def issue(c, slot):
                _issue(lat_g, kr_g, b, lat_s, kr_s, bars, c, slot)

            @pl.when(lo < hi)
            def _():
                issue(lo, 0)

            _wait_q(qbar)
            lim = _row_limits(pos_g, r)              # [64]: broadcast where used (a [64, bs] int32 tile
                                                     # live across the loop would hold 32 registers)

            def chunk(c, carry):
                acc, m, l = carry
                slot = lax.rem(c - lo, jnp.int32(2))
                for i in range(nbuf):
                    plgpu.barrier_wait(bars.at[slot * nbuf + i])

                @pl.when(c + 1 < hi)      # the other slot's readers (chunk c - 1's WGMMAs) have finished
                def _():
                    issue(c + 1, 1 - slot)

                p, alpha, m, l = _softmax_step(q_s, qr_s, lat_s, kr_s, slot, c, lim, m, l)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                acc = mma_add(acc, a_operand(p.astype(_BF), p_s[0] if p_s else None, interpret), lat_s.at[slot, j],
                               interpret)
                return acc, m, l

            return lax.fori_loop(lo, hi, chunk, _init_carry())

        acc, m, l = pl.run_scoped(
            attend,
            plgpu.SMEM((nblk, BLOCK_ROWS, cb), _BF, transforms=swizzled(cb)),          # q, latent part
            plgpu.SMEM((BLOCK_ROWS, Dr), _BF, transforms=swizzled(Dr)),                # q, rope part
            plgpu.SMEM((2, nblk, bs, cb), _BF, transforms=swizzled(cb)),               # latent chunks
            plgpu.SMEM((2, bs, Dr), _BF, transforms=swizzled(Dr)),                     # rope key chunks
            plgpu.Barrier(num_barriers=nblk + 1),
            plgpu.Barrier(num_barriers=2 * nbuf),
            *([plgpu.SMEM((BLOCK_ROWS, bs), _BF, transforms=swizzled(bs))] if interpret else []),  # P
        )

        def emit(o_s, lse_s):        # reuses the SMEM of `attend`'s buffers (a later scope)
            store(o_s, _normalised(acc, l))
            store(lse_s, _lse(m, l))
            plgpu.commit_smem()

            def put(n):              # the tile's first n rows
                out_rows = pl.ds(r * BLOCK_ROWS, n)
                plgpu.copy_smem_to_gmem(o_s.at[pl.ds(0, n)], o_g.at[b, sp, out_rows, pl.ds(j * cb, cb)])

                @pl.when(j == 0)
                def _():
                    plgpu.copy_smem_to_gmem(lse_s.at[pl.ds(0, n)], lse_g.at[b, sp, out_rows])

            _rows_out(r, put)
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(emit, plgpu.SMEM((BLOCK_ROWS, cb), _F32), plgpu.SMEM((BLOCK_ROWS,), _F32))

    def body_two(ql_g, qr_g, lat_g, kr_g, pos_g, o_g, lse_g):
        """warpgroups=2 (module docstring): program (b, r, s) holds both column blocks. Per chunk,
        warpgroup 0: scores, softmax, P and alpha to SMEM, `p_ready`, block 0's P . latent, `free0`;
        warpgroup 1: waits `p_ready`, block 1's P . latent, waits `free0`, `w1_done` (warpgroup 0
        waits for it before its next `p_ready`, so no barrier completes a phase twice unobserved),
        refills the slot with the chunk after next. Each P / alpha buffer is reused two chunks later,
        after that refill. Then both pass `fin`; warpgroup 0 hands l over (`l_ready`)."""
        pdl_wait(interpret)
        b, r, sp = lax.axis_index("b"), lax.axis_index("r"), lax.axis_index("s")
        wg = lax.axis_index("wg")
        rows = pl.ds(r * BLOCK_ROWS, BLOCK_ROWS)
        lo, hi = _chunk_range(pos_g, sp)

        def scoped(q_s, qr_s, kr_s, rv_s, union, qbar, bars, p_ready, free0, w1_done, fin, l_ready):
            lat_s, o_s = union      # rv_s [2, 64]: chunk c's alpha in its slot's row; then l, lse

            def issue(c, slot):
                _issue(lat_g, kr_g, b, lat_s, kr_s, bars, c, slot)

            def wait_chunk(slot):
                for i in range(nbuf):
                    plgpu.barrier_wait(bars.at[slot * nbuf + i])

            def emit(acc, l):
                store(o_s.at[wg], _normalised(acc, l))
                plgpu.commit_smem()
                _rows_out(r, lambda n: plgpu.copy_smem_to_gmem(      # the tile's first n rows
                    o_s.at[wg, pl.ds(0, n)], o_g.at[b, sp, pl.ds(r * BLOCK_ROWS, n), pl.ds(wg * cb, cb)]))

            @pl.when(wg == 0)
            def _scores_warpgroup():
                _load_q(ql_g, qr_g, b, rows, q_s, qr_s, qbar)
                for k in range(2):
                    pl.when(lo + k < hi)(lambda k=k: issue(lo + k, k))
                _wait_q(qbar)
                lim = _row_limits(pos_g, r)

                def chunk(c, carry):
                    acc, m, l = carry
                    slot = lax.rem(c - lo, jnp.int32(2))
                    wait_chunk(slot)
                    p, alpha, m, l = _softmax_step(q_s, qr_s, lat_s, kr_s, slot, c, lim, m, l)
                    p16 = p.astype(_BF)
                    p_s = kr_s.at[slot]       # P over the chunk's rope key, which the scores have used
                    # at most one chunk ahead of warpgroup 1 (each signal below observed before the next)
                    pl.when(c > lo)(lambda: plgpu.barrier_wait(w1_done.at[0]))
                    store(p_s, p16)
                    store(rv_s.at[slot], alpha)
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(p_ready.at[0])
                    acc = mma_add(acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), p_s if interpret else p16,
                                   lat_s.at[slot, wg], interpret)      # block wg (0); a static index does not lower here
                    plgpu.barrier_arrive(free0.at[0])
                    return acc, m, l

                acc, m, l = lax.fori_loop(lo, hi, chunk, _init_carry())
                plgpu.barrier_arrive(fin.at[0])
                plgpu.barrier_wait(fin.at[0])            # warpgroup 1 has read its last alpha
                store(rv_s.at[0], l)
                plgpu.barrier_arrive(l_ready.at[0])
                emit(acc, l)
                lse_s = rv_s.at[1]                     # slot 1's alpha row: its last reader passed `fin`
                store(lse_s, _lse(m, l))
                plgpu.commit_smem()
                _rows_out(r, lambda n: plgpu.copy_smem_to_gmem(lse_s.at[pl.ds(0, n)],
                                                               lse_g.at[b, sp, pl.ds(r * BLOCK_ROWS, n)]))
                plgpu.wait_smem_to_gmem(0)

            @pl.when(wg == 1)
            def _second_warpgroup():
                def chunk(c, acc):
                    slot = lax.rem(c - lo, jnp.int32(2))
                    wait_chunk(slot)
                    plgpu.barrier_wait(p_ready.at[0])
                    alpha = plgpu.load(rv_s.at[slot], layout=row)
                    acc = mma_add(acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), kr_s.at[slot],
                                   lat_s.at[slot, wg], interpret)      # block wg (1)
                    plgpu.barrier_wait(free0.at[0])                             # warpgroup 0 is past chunk c
                    pl.when(c + 1 < hi)(lambda: plgpu.barrier_arrive(w1_done.at[0]))
                    pl.when(c + 2 < hi)(lambda: issue(c + 2, slot))
                    return acc

                acc = lax.fori_loop(lo, hi, chunk, _zero_acc())
                plgpu.barrier_arrive(fin.at[0])
                plgpu.barrier_wait(fin.at[0])
                plgpu.barrier_wait(l_ready.at[0])
                emit(acc, plgpu.load(rv_s.at[0], layout=row))
                plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            scoped,
            plgpu.SMEM((nblk, BLOCK_ROWS, cb), _BF, transforms=swizzled(cb)),          # q, latent part
            plgpu.SMEM((BLOCK_ROWS, Dr), _BF, transforms=swizzled(Dr)),                # q, rope part
            plgpu.SMEM((2, bs, Dr), _BF, transforms=swizzled(Dr)),                     # rope key chunks, then P
            plgpu.SMEM((2, BLOCK_ROWS), _F32),                                         # alpha by slot, then l
            plgpu.RefUnion(plgpu.SMEM((2, nblk, bs, cb), _BF, transforms=swizzled(cb)),  # latent chunks
                           plgpu.SMEM((2, BLOCK_ROWS, cb), _F32)),                     # output staging
            plgpu.Barrier(num_barriers=nblk + 1),
            plgpu.Barrier(num_barriers=2 * nbuf),
            plgpu.Barrier(num_barriers=1),                                             # p_ready
            plgpu.Barrier(num_barriers=1),                                             # free0
            plgpu.Barrier(num_barriers=1),                                             # w1_done
            plgpu.Barrier(num_arrivals=2, num_barriers=1),                             # fin
            plgpu.Barrier(num_barriers=1),                                             # l_ready
            collective_axes="wg",
        )

    threads = dict(num_threads=2, thread_name="wg") if wgs == 2 else {}
    kernel = plgpu.kernel(
        body_two if wgs == 2 else body,
        out_type=(jax.ShapeDtypeStruct((B, n_split, Ro, L), _F32),
                  jax.ShapeDtypeStruct((B, n_split, Ro), _F32)),
        grid=(B, row_tiles, n_split) if wgs == 2 else (B, row_tiles, nblk, n_split),
        grid_names=("b", "r", "s") if wgs == 2 else ("b", "r", "c", "s"),
        kernel_name="mla_decode_attention",    # the kernel's name in profiles
        interpret=interpret if interpret else None,
        **threads,
    )
    o_part, lse = kernel(ql, qr, latent, k_rope, pos1)
    return combine_splits(o_part, lse, axis=1)[0][:, :R]
