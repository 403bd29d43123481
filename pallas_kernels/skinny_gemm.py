"""Skinny GEMM for M = 1..16 tokens (Pallas Mosaic GPU, `plgpu.kernel`): weight-bandwidth bound.

    x      [M, K]   activations (any float dtype; used as bf16), M <= 16
    w      [K, N]   bfloat16, or float8_e4m3fn with
    scale  [K/128, ceil(N/128)] float32: one scale per 128 x 128 block of w (the
           :class:`lingjax.quant.Fp8Weight` layout of a 2-D ``Matrix((), (0,), (1,))`` view), or
           [G, K/128, N/128/G] for a stacked (fused) weight whose G stacked parts are column
           groups of N: its scales as stored, no transpose (the caller reshapes the values to [K, N])
    -> y [M, N] = x @ dequantise(w)   in ``out_dtype`` (default x.dtype), float32 accumulation

Used for the dense projections of a decode step (KDA fused input projection 2560 -> 5 x 4096,
o_proj 4096 -> 2560, MLA projections, dense MLP, lm_head 2560 -> 157184: the logits come back and
argmax runs in XLA). Every weight byte (and scale) is read from HBM exactly once per call; fp8
weights are dequantised on chip and never written back as bf16.

Design
------
* Grid ``(N / block_n, split_k)``: program (j, s) owns output columns ``[j*bn, (j+1)*bn)`` and the
  K range ``[s*K/S, (s+1)*K/S)``. It streams w in [128, bn] tiles (one fp8 scale block per tile)
  through ``plgpu.emit_pipeline`` (TMA into SMEM, ``stages`` buffers in flight) together with
  the matching [m_pad, 128] chunk of the zero-padded tokens ``xp`` (L2 hits after the first CTA).
* Tensor cores with the **weight tile as A** (``w_tile.T``: bn output features as WGMMA rows, a
  transposed SMEM operand) and the tokens as B (``x_chunk.T``, N = m_pad = 8 for M <= 8, else 16):
  ``acc[n, m] += sum_k w[k, n] x[m, k]`` in float32. bf16 weights go straight from the TMA buffer
  (swizzled) to the WGMMA.
* fp8: the tile arrives swizzled, is loaded to registers, converted to **float16** (exact: every
  e4m3 value is an f16; sm_90 converts e4m3 -> f16 in hardware, two values per instruction, but
  has no e4m3 -> bf16), stored to a swizzled SMEM tile and multiplied into a fresh accumulator;
  the block scale is applied to that [bn, m_pad] float32 product (``carry += scale[k_blk, n_blk]
  * p``: 8 or 16 multiplies per thread per tile instead of one per weight element; each tile's
  scale is a scalar load from GMEM where the scales are stored, issued before the tile converts;
  session 20). The tokens are f16 too:
  each row of x (bf16) is scaled in XLA by a power of two that puts its max |x| in [2**14, 2**15),
  so every bf16 value above ~2**-28 * max|x| is exact in f16, and the output row is scaled back;
  with ``x_bound`` (session 24: a static bound on |x|, an RMSNorm's) every row takes the bound's
  power of two instead, and the per-call reduction over x (one XLA kernel) is gone.
  Net: the float32 product of x_bf16 and the exact dequantised weight, up to float32 summation
  order -- more exact than the model's XLA path, which rounds ``w * scale`` to bf16. One scale
  block per tile: ``block_n`` in {64, 128} for fp8.
* fp8 ``fp8_schedule='pair'`` (opt-in; session 6: not faster than 'serial'): each pipeline step takes two K
  tiles (two BlockSpecs per operand, even / odd tile); tile a is converted and its WGMMA issued,
  tile b is converted into a second f16 buffer while that WGMMA runs, then tile b's WGMMA, one
  wait, and both products are scaled into the carry. Half the steps, each converting one tile
  under an MMA; the pipeline keeps max(2, stages // 2) steps in flight (one program per SM
  at bn = 128: two f16 buffers of 32 KiB).
* fp8 ``fp8_schedule='async'`` (opt-in; on the H200 not faster than 'serial', session 8): the
  block scale multiplies the converted f16 tile in registers (f16(scale * 2**SCALE_SHIFT), one
  accumulator for the whole K range) and each tile's WGMMA stays in flight while the next tile
  converts (buffers released one pipeline step late; stages >= 2). Rounds scale and products to
  f16 (2**-11 relative), finer than the model's bf16 dequantisation.
* ``k_minor=True`` (session 8; on the H200 since run 31): w as [N, K] (torch's Linear
  layout). Each [bn, 128] tile is then a WGMMA A operand as it lies: bf16 straight from the TMA
  buffer, fp8 loaded into registers in the WGMMA layout (2 bytes per thread, ``common.a_regs``;
  before session 32 4 bytes and a relayout), converted to f16 and multiplied from the registers:
  no f16 SMEM tile (interpret mode, which cannot take a register operand, stages it through SMEM:
  ``common.a_operand``).
* K-major fp8 tiles come from SMEM to registers 4 bytes per thread (``common.load_fp8``, session
  8: 2-5% faster than the WGMMA layout's 2 bytes, before the tiles are stored back to SMEM as f16).
* Output: a [bn, m_pad] tile per program, TMA'd to ``part [split_k, N, m_pad]`` (float32 when
  split_k > 1 or fp8, else out_dtype); XLA then sums the splits, unscales the rows and transposes
  ``[:, :M]`` to [M, N] in one fusion (``split_k * N * m_pad * 4`` bytes, ~1-5% of the weight
  bytes at the Ling shapes; XLA may still move the transpose into a consumer's kernel of its own).
* split_k exists because most Ling matrices have too few column tiles to fill 132 SMs (o_proj:
  20 tiles of 128). Defaults: bf16: block_n = 128, or 64 when N has fewer than 132 tiles of 128
  (or N is not a multiple of 128); split_k = the smallest divisor of K/128 that gives >= 264
  programs (two per SM) with >= 4 K tiles each, else the largest with >= 4 K tiles; stages = as
  many as fit ~110 KiB of SMEM (so two programs can share an SM), between 2 and 8. fp8 (tuned on
  the H200, session 7): block_n = 64, 2 stages, split_k aiming at >= 528 programs (four per SM).

* Several weights of one input (a tuple ``w``, session 27): their programs side by side in one
  grid, each program's weight picked by a static range check on its column tile; the part array
  holds the products one after the other and XLA splits them. Per further weight one launch, one
  pipeline ramp and one output fusion fewer (the DSpark draft's q / k / v and gate / up).

Launches per call: (fp8 without x_bound: the row max of x,) the x pad/convert fusion, the kernel,
the split-K sum / transpose fusion ('pair' and 'async' also transpose the scales to one [K/128] row
per column block, for one TMA per program).

Status: runs on the H200 (jax 0.11.2): its GPU tests pass at the Ling shapes, M in {1, 9, 16},
bf16 and fp8 (tests/test_pallas_skinny_gemm.py). In-loop time (bench/skinny_gemm_timing.py,
docs/PERFORMANCE.md): bf16 lm_head 97% of 4.3 TB/s, bf16 2560 -> 20480 75-80%, o_proj 52-60%;
fp8 25-69%: the serial per-tile convert -> store -> WGMMA -> wait chain, not memory, sets the
fp8 time; smaller programs, more of them in flight (the session-7 fp8 defaults) brought the KDA
input projection from 31.6 to 24.5 us (50%). ``fp8_schedule='pair'`` overlaps half the
conversions with a WGMMA; its GPU tests pass on the H200 but it was not faster (session 6: 35.0
vs 31.6 us), so the model keeps 'serial'.
On CPU (CI): interpret mode with race detection against :func:`skinny_gemm_reference` and
cross-lowering for CUDA at the Ling shapes. Per tile the (fp8) dequantisation, the WGMMA and its wait run back to back; only the
TMA loads are pipelined. No persistent / stream-K schedule: wave quantisation is handled only by
split_k.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import (ASYNC_K_MINOR, SCALE_SHIFT, X_TOP_EXP, a_operand, a_regs, f16_rows, load_fp8,
                                    pdl_prefetch, pdl_prefetching, pdl_wait, pow2, store, swizzled)

__all__ = ["MAX_M", "BLOCK", "FP8_SCHEDULES", "SkinnyConfig", "skinny_gemm_config", "skinny_gemm_pallas",
           "skinny_gemm_reference", "weight_bytes"]

MAX_M = 16            # tokens per call (decode or a speculative verify block)
BLOCK = 128           # K tile = fp8 scale block (both dims)
N_SMS = 132           # H200
MIN_K_TILES = 4       # default split_k keeps at least this many K tiles per program
SMEM_TARGET = 110 * 1024   # default stages: fit two programs per SM (227 KiB)
_BF, _F16, _F32, _FP8 = jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn
FP8_SCHEDULES = ("serial", "pair", "async")
# fp8 defaults from the H200 sweep (session 7, bench/skinny_gemm_timing.py --block-n 64,128
# --split-k 1,2,4 --stages 2,4, M = 1): 2560 -> 20480 in 24.5 us at block_n 64, split 2, 2 stages
# against 31.6 us at the earlier 128 / 2 / 4 (the serial convert -> WGMMA chain per tile gains from
# more, smaller programs in flight, ~36 KiB of SMEM each)
FP8_STAGES = 2
FP8_PROGRAMS_PER_SM = 4
_WG = plgpu.Layout.WGMMA


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    block_n: int      # output columns per program (WGMMA rows)
    split_k: int      # programs along K (partial sums added in XLA)
    stages: int       # TMA pipeline buffers
    m_pad: int        # tokens padded to the WGMMA N (8 or 16)
    smem_bytes: int   # SMEM of the pipeline scope (the output tile reuses it afterwards)




def _smem_bytes(block_n, stages, m_pad, fp8, n_kblocks, k_minor=False):
    w_tile = BLOCK * block_n * (1 if fp8 else 2)
    x_tile = m_pad * BLOCK * 2
    f16_tile = 0 if k_minor else BLOCK * block_n * 2     # k_minor: the A operand from registers
    extra = (f16_tile + 4 * n_kblocks) if fp8 else 0     # dequantised tile + scales
    return stages * (w_tile + x_tile) + extra


def skinny_gemm_config(M: int, K: int, N: int, fp8: bool, *, block_n=None, split_k=None,
                       stages=None, k_minor=False) -> SkinnyConfig:
    """The tiling `skinny_gemm_pallas` uses for these shapes (None = the default heuristic)."""
    m_pad = 8 if M <= 8 else MAX_M
    nk = K // BLOCK
    if block_n is None:
        block_n = 64 if fp8 or N % 128 or N // 128 < N_SMS else 128
    nt = N // block_n
    if split_k is None:
        divs = [s for s in range(1, nk + 1) if nk % s == 0 and nk // s >= MIN_K_TILES] or [1]
        full = [s for s in divs if nt * s >= (FP8_PROGRAMS_PER_SM if fp8 else 2) * N_SMS]
        split_k = full[0] if full else divs[-1]
    if stages is None and fp8:
        stages = FP8_STAGES
    if stages is None:
        per = _smem_bytes(block_n, 1, m_pad, fp8, 0, k_minor) - _smem_bytes(block_n, 0, m_pad, fp8, 0, k_minor)
        fixed = _smem_bytes(block_n, 0, m_pad, fp8, nk, k_minor)
        stages = max(2, min(8, (SMEM_TARGET - fixed) // per))
    stages = max(1, min(stages, nk // split_k))   # emit_pipeline shrinks it the same way
    return SkinnyConfig(block_n, split_k, stages, m_pad, _smem_bytes(block_n, stages, m_pad, fp8, nk, k_minor))


def _kernel_call(xp, ws, s_ts, cfg: SkinnyConfig, part_dtype, interpret, fp8_schedule="serial", k_minor=False):
    """xp [m_pad, K] bf16 (f16 for fp8 w), ws: one or more weights w_i [K, N_i] (k_minor: [N_i, K])
    of one dtype, s_ts: their scales (f32) or None: as stored, [G, K/128, N_i/128/G] ('serial'), or
    [N_i/128 blocks, K/128 (+pad)] ('pair', 'async', one weight)
    -> part [split_k, sum N_i, m_pad] part_dtype: the products side by side, one launch. Program j's
    column tile belongs to the weight whose tile range holds j (a static range check per weight).
    fp8_schedule: 'serial' | 'pair' | 'async' (module docstring; 'async' wants s_t pre-multiplied
    by 2**SCALE_SHIFT)."""
    Ns = [w.shape[0] if k_minor else w.shape[1] for w in ws]
    K = ws[0].shape[1] if k_minor else ws[0].shape[0]
    N = sum(Ns)
    fp8 = s_ts is not None
    bn, S, mp = cfg.block_n, cfg.split_k, cfg.m_pad
    tile_lo = [sum(Ns[:i]) // bn for i in range(len(Ns) + 1)]       # weight i: output tiles [lo_i, lo_i+1)
    kps = K // BLOCK // S                                   # K tiles per program
    ks = kps * BLOCK
    x_tf = swizzled(BLOCK, 2)
    w_tf = swizzled(bn, 2)
    if k_minor:        # [bn, 128] tiles: the WGMMA A operand as they lie (fp8: via registers)
        w_spec = plgpu.BlockSpec((bn, BLOCK), lambda i: (0, i), transforms=swizzled(BLOCK, 1 if fp8 else 2))
    else:
        w_spec = plgpu.BlockSpec((BLOCK, bn), lambda i: (i, 0), transforms=swizzled(bn, 1) if fp8 else w_tf)
    specs = [w_spec, plgpu.BlockSpec((mp, BLOCK), lambda i: (0, i), transforms=x_tf)]

    def store_out(y, part_g, j, s):
        def scoped(o_s):
            store(o_s, y.astype(part_dtype))
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, part_g.at[s, pl.ds(j * bn, bn)])
            plgpu.wait_smem_to_gmem(0)
        pl.run_scoped(scoped, plgpu.SMEM((bn, mp), part_dtype))

    def operands(w_g, x_g, j, s):
        cols, ks_ = pl.ds(j * bn, bn), pl.ds(s * ks, ks)
        return (w_g.at[cols, ks_] if k_minor else w_g.at[ks_, cols], x_g.at[:, ks_])

    def f16_tile():
        """The f16 weight tile in SMEM (k_minor fp8: interpret mode's copy of the register operand)."""
        if k_minor:
            return plgpu.SMEM((bn, BLOCK), _F16, transforms=swizzled(BLOCK, 2))
        return plgpu.SMEM((BLOCK, bn), _F16, transforms=w_tf)

    def body_bf16(x_g, w_g, part_g, j, jo):
        s = lax.axis_index("k")

        def scoped(acc):
            def step(_, w_s, x_s):
                plgpu.wgmma(acc, w_s if k_minor else w_s.T, x_s.T)
                plgpu.wgmma_wait(0)

            plgpu.emit_pipeline(step, grid=(kps,), in_specs=specs,
                                max_concurrent_steps=cfg.stages)(*operands(w_g, x_g, j, s))
            return acc[...]

        store_out(pl.run_scoped(scoped, plgpu.ACC((bn, mp), _F32)), part_g, jo, s)

    def body_fp8(x_g, w_g, s_g, part_g, j, jo):
        """s_g: the scales as stored, [column groups, K/128, N/128 / groups] (no transpose)."""
        s = lax.axis_index("k")
        nb_g = s_g.shape[2]
        grp, jb = divmod((j * bn) // BLOCK, nb_g)       # this program's column block of the scales

        def scoped(*wb):
            wb_s = wb[0] if wb else None          # the f16 tile (k_minor: interpret mode only)

            def a_tile(w8_s):
                """The fp8 tile as an exact f16 WGMMA A operand [bn, 128]."""
                if k_minor:                                     # in registers
                    return a_operand(a_regs(w8_s), wb_s, interpret)
                wb_s[...] = load_fp8(w8_s).astype(_F16)         # fp8 [128, bn]; one cvt per 2 values
                plgpu.commit_smem()
                return wb_s.T

            def step(idxs, w8_s, x_s, carry):
                (i,) = idxs
                sc = s_g[grp, s * kps + i, jb]          # a scalar load from GMEM (L2), issued first
                a = a_tile(w8_s)

                def mma(acc):
                    plgpu.wgmma(acc, a, x_s.T)
                    plgpu.wgmma_wait(0)
                    return acc[...]

                p = pl.run_scoped(mma, plgpu.ACC((bn, mp), _F32))
                return carry + p * sc

            zero = plgpu.layout_cast(jnp.zeros((bn, mp), _F32), _WG)
            return plgpu.emit_pipeline(step, grid=(kps,), in_specs=specs,
                                       max_concurrent_steps=cfg.stages,
                                       init_carry=zero)(*operands(w_g, x_g, j, s))

        y = pl.run_scoped(scoped, f16_tile()) if not k_minor or interpret else scoped()
        store_out(y, part_g, jo, s)

    def body_fp8_pair(x_g, w_g, s_g, part_g, j, jo):
        """Two K tiles per pipeline step: tile b's conversion runs while tile a's WGMMA does."""
        s = lax.axis_index("k")
        pair_specs = [plgpu.BlockSpec((BLOCK, bn), lambda i, o=o: (2 * i + o, 0), transforms=swizzled(bn, 1))
                      for o in (0, 1)] + [plgpu.BlockSpec((mp, BLOCK), lambda i, o=o: (0, 2 * i + o), transforms=x_tf)
                                          for o in (0, 1)]

        def scoped(wb_s, s_s, bar):
            plgpu.copy_gmem_to_smem(s_g.at[(j * bn) // BLOCK], s_s, bar.at[0])

            def step(idxs, wa_s, wb8_s, xa_s, xb_s, carry):
                (i,) = idxs
                wb_s.at[0][...] = load_fp8(wa_s).astype(_F16)
                plgpu.commit_smem()

                def mma(acc_a, acc_b):
                    plgpu.wgmma(acc_a, wb_s.at[0].T, xa_s.T)             # in flight while ...
                    wb_s.at[1][...] = load_fp8(wb8_s).astype(_F16)   # ... b converts
                    plgpu.commit_smem()
                    plgpu.wgmma(acc_b, wb_s.at[1].T, xb_s.T)
                    plgpu.wgmma_wait(0)
                    return acc_a[...], acc_b[...]

                pa, pb = pl.run_scoped(mma, plgpu.ACC((bn, mp), _F32), plgpu.ACC((bn, mp), _F32))
                pl.when(i == 0)(lambda: plgpu.barrier_wait(bar.at[0]))
                k0 = s * kps + 2 * i
                return carry + pa * s_s[k0] + pb * s_s[k0 + 1]

            zero = plgpu.layout_cast(jnp.zeros((bn, mp), _F32), _WG)
            wsl, xsl = operands(w_g, x_g, j, s)
            return plgpu.emit_pipeline(step, grid=(kps // 2,), in_specs=pair_specs,
                                       max_concurrent_steps=max(2, cfg.stages // 2),
                                       init_carry=zero)(wsl, wsl, xsl, xsl)

        y = pl.run_scoped(scoped, plgpu.SMEM((2, BLOCK, bn), _F16, transforms=w_tf),
                          plgpu.SMEM((s_g.shape[1],), _F32), plgpu.Barrier(num_barriers=1))
        store_out(y, part_g, jo, s)

    def body_fp8_async(x_g, w_g, s_g, part_g, j, jo):
        """Block scale folded into the f16 conversion: one accumulator, each tile's WGMMA left in
        flight while the next tile converts (s_g holds scale * 2**SCALE_SHIFT; k_minor: the scaled
        tile stays in registers as the A operand)."""
        s = lax.axis_index("k")
        async_specs = [plgpu.BlockSpec(sp.block_shape, sp.index_map, transforms=sp.transforms,
                                       delay_release=1) for sp in specs]

        def scoped(s_s, bar, *wb):
            wb_s = wb[0] if wb else None          # the f16 tile (k_minor: interpret mode only)
            plgpu.copy_gmem_to_smem(s_g.at[(j * bn) // BLOCK], s_s, bar.at[0])

            def mma(acc):
                def step(idxs, w8_s, x_s):
                    (i,) = idxs
                    pl.when(i == 0)(lambda: plgpu.barrier_wait(bar.at[0]))
                    sc = s_s[s * kps + i].astype(_F16)
                    if k_minor:
                        a = a_regs(w8_s) * sc
                        if interpret:                       # its SMEM staging tile is reused
                            plgpu.wgmma_wait(0)
                        a = a_operand(a, wb_s, interpret)
                    else:
                        v = load_fp8(w8_s).astype(_F16) * sc
                        plgpu.wgmma_wait(0)                 # the previous tile's WGMMA has read wb_s
                        wb_s[...] = v
                        plgpu.commit_smem()
                        a = wb_s.T
                    plgpu.wgmma(acc, a, x_s.T)              # left in flight (x_s released a step late)

                plgpu.emit_pipeline(step, grid=(kps,), in_specs=async_specs,
                                    max_concurrent_steps=cfg.stages)(*operands(w_g, x_g, j, s))
                return acc[...]

            return pl.run_scoped(mma, plgpu.ACC((bn, mp), _F32))

        y = pl.run_scoped(scoped, plgpu.SMEM((s_g.shape[1],), _F32), plgpu.Barrier(num_barriers=1),
                          *((f16_tile(),) if not k_minor or interpret else ()))
        store_out(y, part_g, jo, s)

    inner = {"serial": body_fp8, "pair": body_fp8_pair, "async": body_fp8_async}[fp8_schedule] if fp8 else body_bf16
    nw = len(ws)

    def first_tiles(w_g, j):
        """GMEM views of program (j, k)'s first weight tiles (those the pipeline loads first)."""
        s = lax.axis_index("k")
        cols = pl.ds(j * bn, bn)
        rows = [pl.ds(s * ks + i * BLOCK, BLOCK) for i in range(min(cfg.stages, kps))]
        return [w_g.at[cols, r] if k_minor else w_g.at[r, cols] for r in rows]

    def body(x_g, *refs):
        """Dispatch program jo to its weight: (x, w_0.., [s_0..], part)."""
        w_gs, part_g = refs[:nw], refs[-1]
        s_gs = refs[nw:2 * nw] if fp8 else (None,) * nw
        jo = lax.axis_index("n")

        def on_own_weight(fn):
            """fn(i, j) for the weight i that program jo's column tile belongs to, j its tile there."""
            if nw == 1:
                return fn(0, jo)
            for i in range(nw):
                lo, hi = tile_lo[i], tile_lo[i + 1]
                pl.when((jo >= lo) & (jo < hi))(lambda i=i, lo=lo: fn(i, jo - lo))

        if pdl_prefetching(interpret):
            on_own_weight(lambda i, j: pdl_prefetch(first_tiles(w_gs[i], j)))
        pdl_wait(interpret)
        on_own_weight(lambda i, j: inner(x_g, w_gs[i], *((s_gs[i],) if fp8 else ()), part_g, j, jo))

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((S, N, mp), part_dtype),
        grid=(N // bn, S),
        grid_names=("n", "k"),
        kernel_name=inner.__name__,       # the kernel's name in profiles
        interpret=interpret if interpret else None,
    )
    return kernel(xp, *ws, *(s_ts if fp8 else ()))


def skinny_gemm_pallas(x, w, scale=None, x_bound=None, *, block_n=None, split_k=None, stages=None,
                       interpret=False, out_dtype=None, fp8_schedule="serial", k_minor=False):
    """y [M, N] = x [M, K] @ w [K, N] (w bf16, or fp8 e4m3 dequantised with `scale`); see the
    module docstring. ``block_n``/``split_k``/``stages``: tiling overrides (None = default, see
    :func:`skinny_gemm_config`). ``interpret``: False (compile for the GPU) or a
    ``plgpu.InterpretGPUParams``. ``out_dtype``: default x.dtype (float32 for lm_head logits).
    ``fp8_schedule``: 'serial' (default: convert, WGMMA, wait per K tile), 'pair' (two K tiles
    per pipeline step, the second converted while the first multiplies; needs an even number of
    K tiles per program) or 'async' (module docstring); neither beat 'serial' on the H200.
    ``k_minor``: w is [N, K] (K minor, torch's Linear layout; scale as always [K/128, ceil(N/128)],
    the Fp8Weight convention of [IN blocks, OUT blocks]); fp8 tiles become the WGMMA A operand in
    registers, no f16 SMEM tile ('serial'; 'async' is refused). H200, run 31: 2560 x 20480 M=1
    20.1 vs 22.6 us.
    ``x_bound``: optional float32 scalar with |x| <= x_bound guaranteed by the caller (fp8 only:
    the tokens' f16 scaling then needs no reduction over x, `common.f16_rows`).

    Several weights of one input (session 27): ``w`` a tuple of weights w_i [K, N_i] (k_minor
    [N_i, K]) of one dtype and ``scale`` the tuple of their scales (or None for bf16) -> the tuple
    of y_i = x @ w_i, computed in ONE launch (the programs of all the weights side by side, each
    N_i a multiple of block_n; fp8: 'serial' only): e.g. a layer's q, k and v projections, or gate
    and up, whose separate calls each pay a launch, a pipeline ramp and an output fusion. The
    default tiling follows the summed N, so split_k (and with it the float32 summation order) can
    differ from a call per weight: the same products up to float32 rounding, bit for bit where
    the tiling is the same.
    """
    if fp8_schedule not in FP8_SCHEDULES:
        raise ValueError(f"fp8_schedule={fp8_schedule!r} must be one of {FP8_SCHEDULES}")
    if k_minor and fp8_schedule == "async":
        raise ValueError(ASYNC_K_MINOR)
    multi = isinstance(w, (tuple, list))
    ws = tuple(w) if multi else (w,)
    if multi:
        if not ws:
            raise ValueError("w is an empty tuple: give at least one weight")
        if scale is not None and not isinstance(scale, (tuple, list)):
            raise ValueError("with a tuple of weights, scale= must be a tuple of their scales (one per fp8 "
                             "weight), or None for bfloat16 weights")
        scales = (None,) * len(ws) if scale is None else tuple(scale)
        if len(scales) != len(ws):
            raise ValueError(f"{len(ws)} weights but {len(scales)} scales: give one scale per fp8 weight (or "
                             "scale=None for bfloat16 weights)")
        if len(ws) > 1 and fp8_schedule != "serial" and ws[0].dtype == _FP8:
            raise ValueError(f"several fp8 weights in one call run fp8_schedule='serial' only, got {fp8_schedule!r}")
    else:
        scales = (scale,)
    w_dims = "[N, K]" if k_minor else "[K, N]"
    if x.ndim != 2 or any(wi.ndim != 2 for wi in ws):
        raise ValueError(f"x {x.shape} and w {[wi.shape for wi in ws] if multi else w.shape} must be 2-D: [M, K] "
                         f"and {w_dims} (reshape fused weights to {w_dims} first)")
    M, K = x.shape
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if not 1 <= M <= MAX_M:
        raise ValueError(f"M={M} tokens must be in 1..{MAX_M}; use x @ w (XLA) for prefill-sized M")
    fp8 = ws[0].dtype == _FP8
    if any(wi.dtype != ws[0].dtype for wi in ws):
        raise ValueError(f"the weights of one call must share a dtype, got {[str(wi.dtype) for wi in ws]}")
    if ws[0].dtype not in (_BF, _FP8):
        raise ValueError(f"w must be bfloat16 or float8_e4m3fn, got {ws[0].dtype}; cast it once at load time")
    if K % BLOCK:
        raise ValueError(f"K={K} must be a multiple of {BLOCK} (the K tile / fp8 scale block): pad w's "
                         "rows and x's columns with zeros once at load time")
    nk = K // BLOCK
    Ns, s_given = [], []
    for wi, sc in zip(ws, scales):
        N, K2 = wi.shape if k_minor else wi.shape[::-1]
        if K2 != K:
            raise ValueError(f"x {x.shape} and w {wi.shape} disagree on K")
        if fp8 and sc is None:
            raise ValueError("fp8 weights need scale= [K/128, ceil(N/128)] float32 (Fp8Weight.scale_inv)")
        if not fp8 and sc is not None:
            raise ValueError("scale= is only for float8_e4m3fn weights; got bfloat16 weights")
        if N % 64:
            raise ValueError(f"N={N} must be a multiple of 64 (the smallest WGMMA tile): pad w's columns "
                             "with zeros once at load time and slice the output")
        nb = -(-N // BLOCK)
        if fp8:
            given = tuple(sc.shape)
            sc = sc.astype(_F32)
            if sc.ndim == 2:
                sc = sc[None]                  # one column group
            if sc.ndim != 3 or sc.shape[1] != nk or sc.shape[0] * sc.shape[2] != nb or (
                    sc.shape[0] > 1 and N != sc.shape[0] * sc.shape[2] * BLOCK):
                raise ValueError(f"scale {given} must be [K/128, ceil(N/128)] = {(nk, nb)} (one float32 "
                                 "per 128 x 128 block of w), or [G, K/128, N/128/G] for G column groups of whole "
                                 "128-column blocks (a stacked weight's scales as stored)")
        Ns.append(N)
        s_given.append(sc)
    N = sum(Ns)
    allowed = (64, 128) if fp8 else (64, 128, 256)
    if block_n is not None and (block_n not in allowed or any(n % block_n for n in Ns)):
        raise ValueError(f"block_n={block_n} must be one of {allowed} (one fp8 scale block per tile) "
                         f"and divide every N ({Ns})")
    if block_n is None and len(ws) > 1 and any(n % 128 for n in Ns):
        block_n = 64                                   # each weight's columns whole tiles
    if split_k is not None and (split_k < 1 or nk % split_k):
        raise ValueError(f"split_k={split_k} must divide K/{BLOCK}={nk}")
    if stages is not None and stages < 1:
        raise ValueError(f"stages={stages} must be >= 1")
    if fp8 and k_minor and fp8_schedule == "pair":
        raise ValueError("fp8_schedule='pair' is not implemented for k_minor weights; use 'serial'")
    cfg = skinny_gemm_config(M, K, N, fp8, block_n=block_n, split_k=split_k, stages=stages, k_minor=k_minor)
    if any(n % cfg.block_n for n in Ns):     # each program's columns must lie in one weight (_kernel_call)
        raise AssertionError(f"block_n={cfg.block_n} does not divide every weight's N {Ns}")
    if fp8 and fp8_schedule == "async" and cfg.stages < 2:
        raise ValueError(f"fp8_schedule='async' needs stages >= 2 (a tile's buffers are released one step "
                         f"late, while its WGMMA runs); got stages={cfg.stages}")
    if fp8 and fp8_schedule == "pair" and (nk // cfg.split_k) % 2:
        raise ValueError(f"fp8_schedule='pair' needs an even number of K tiles per program; K/128={nk} over "
                         f"split_k={cfg.split_k} gives {nk // cfg.split_k}: pass split_k= to make it even, "
                         "or use fp8_schedule='serial'")

    xb = x.astype(_BF)
    s_ts = None
    if fp8:
        xp, e = f16_rows(xb, cfg.m_pad, x_bound)   # f16 tokens, each row scaled by 2**(X_TOP_EXP - e)
        if fp8_schedule == "serial":          # the kernel reads each tile's scale where it is stored
            s_ts = tuple(s_given)
        else:       # scales as [N blocks, K blocks]: a program's scales are one row (one TMA), 16-byte rows
            sc, nb = s_given[0], -(-Ns[0] // BLOCK)
            s_t = jnp.swapaxes(jnp.moveaxis(sc, 1, 0).reshape(nk, nb), 0, 1)
            s_t = jnp.pad(s_t, ((0, 0), (0, -nk % 4))) if nk % 4 else s_t
            if fp8_schedule == "async":     # the kernel multiplies f16 weights by f16(scale * 2**SHIFT)
                s_t = s_t * 2.0 ** SCALE_SHIFT
                e = e - SCALE_SHIFT
            s_ts = (s_t,)
    else:
        xp = jnp.zeros((cfg.m_pad, K), _BF).at[:M].set(xb)
    part_dtype = _F32 if cfg.split_k > 1 or fp8 else out_dtype
    part = _kernel_call(xp, ws, s_ts, cfg, part_dtype, interpret, fp8_schedule, k_minor)   # [S, N, m_pad]
    # the split-K sum as explicit adds, then slice, row scale, cast and only then the transpose: XLA
    # makes all of it one kernel; part.sum(0)[:, :M].T (before session 24) made two, a transposing
    # reduction and an elementwise kernel (deviceless H200 compile, bench/xla_kernels.py)
    y = part[0]
    for s in range(1, cfg.split_k):
        y = y + part[s]
    y = y[:, :M]                                                          # [N, M]
    if fp8:
        y = y * pow2(e - X_TOP_EXP)[None, :]
    if not multi:
        return y.astype(out_dtype).T
    offs = [sum(Ns[:i]) for i in range(len(Ns) + 1)]
    return tuple(y[offs[i]:offs[i + 1]].astype(out_dtype).T for i in range(len(Ns)))


def skinny_gemm_reference(x, w, scale=None, k_minor=False):
    """float32 x @ dequantise(w) (XLA): the exact product the kernel approximates (k_minor: w
    [N, K]; scale [K/128, ceil(N/128)] either way)."""
    if scale is not None:
        from lingjax.param_layout import Matrix
        from lingjax.quant import dequantize
        view = Matrix((), (1,), (0,)) if k_minor else Matrix((), (0,), (1,))
        w = dequantize(w, scale, view, (BLOCK, BLOCK), _F32)
    w = w.astype(_F32)
    return jnp.dot(x.astype(_F32), w.T if k_minor else w, precision=lax.Precision.HIGHEST)


def weight_bytes(K: int, N: int, dtype=_BF) -> int:
    """HBM bytes of w (+ float32 block scales for fp8) one call reads."""
    if jnp.dtype(dtype) == _FP8:
        return K * N + math.ceil(K / BLOCK) * math.ceil(N / BLOCK) * 4
    return K * N * jnp.dtype(dtype).itemsize
