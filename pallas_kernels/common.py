"""Small helpers the Mosaic GPU kernels share (jax 0.11.2 and 0.12 differences kept here)."""
from __future__ import annotations

import contextlib

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

X_TOP_EXP = 15   # f16 token rows: each scaled by a power of two to max|x| in [2**14, 2**15)
E_MIN = -100     # f16_rows' smallest row exponent (2**(X_TOP_EXP - E_MIN) and its inverse stay normal floats)
# fp8 'async' schedules multiply each e4m3 value by f16(block scale * 2**SCALE_SHIFT) in registers:
# normal f16 scales for blocks with max |w| in [2.7e-5, 64] (scale = max / 448); a block with max
# |w| > 64 would overflow f16 to inf (a loud failure, not a silent one), smaller blocks lose precision
# gradually (f16 subnormals). The power of two is undone on the float32 output.
SCALE_SHIFT = 10


# Programmatic dependent launch (PDL; session 28, opt-in until measured). A kernel body that
# executes griddepcontrol.wait is marked by jax (`uses_pdl`) and launched with programmatic stream
# serialisation: the GPU may launch it while the kernel before it in the stream finishes, and the
# wait, the body's first statement, holds its work until that kernel has completed and its writes
# are visible. Results are unchanged (every read stays after the wait); what may change is the
# launch gap between a decode step's ~1,300 kernels. Read when a kernel is traced (set it before
# the first trace: lingjax.model.kernels.shared_call caches traced kernels).
# PDL_PREFETCH (with PDL_WAIT): before the wait, the skinny GEMM's programs ask the TMA to bring
# their first weight tiles into L2 (weights are never written during a step, so reading them before
# the kernel before has finished is safe), so the time a launched kernel waits is not wasted.
PDL_WAIT = False
PDL_PREFETCH = False


def pdl_prefetching(interpret) -> bool:
    """Whether a compiled kernel prefetches its first weight tiles before its PDL wait."""
    return PDL_WAIT and PDL_PREFETCH and not interpret


def pdl_prefetch(refs) -> None:
    """Prefetch GMEM views of constant inputs (weights) into L2 (TMA; no SMEM, no wait); callers
    check `pdl_prefetching` first."""
    for ref in refs:
        plgpu.async_prefetch(ref)


def pdl_wait(interpret) -> None:
    """The first statement of the decode-step kernels' bodies (after `pdl_prefetch`, if any):
    griddepcontrol.wait when PDL_WAIT is on and the kernel is compiled (interpret mode runs
    kernels in order anyway and has no such instruction)."""
    if PDL_WAIT and not interpret:
        plgpu.griddepcontrol_wait()


def swizzled(minor_elems: int, itemsize: int = 2):
    """Tiling + swizzle transforms for a WGMMA operand whose rows hold `minor_elems` elements."""
    sw = min(128, minor_elems * itemsize)
    return (plgpu.TilingTransform((8, sw // itemsize)), plgpu.SwizzleTransform(sw))


def store(ref, x):
    """Store registers `x` to SMEM `ref`, unswizzled tiles included."""
    if hasattr(plgpu, "store"):          # jax >= 0.12
        plgpu.store(ref, x, optimized=False)
    else:                                # jax 0.11: `ref[...] =` falls back when needed
        ref[...] = x


def pow2(k):
    """2.0 ** k as float32 for int32 k in [-126, 127] (a normal float), built from its bits: one
    multiply by it scales exactly, where jnp.ldexp is ~20 integer ops and selects per element."""
    return lax.bitcast_convert_type((jnp.asarray(k, jnp.int32) + 127) << 23, jnp.float32)


def row_exponent(a):
    """e with a in [2**(e-1), 2**e) for a >= 0 (float32, any shape), from a's bits, clipped to
    [E_MIN, 128] (so both powers of two below are normal floats: pow2); 128 for inf / nan."""
    biased = (lax.bitcast_convert_type(jnp.asarray(a, jnp.float32), jnp.int32) >> 23) & 0xFF
    return jnp.clip(biased - 126, E_MIN, 128)


def f16_rows(x, rows: int, bound=None):
    """Tokens for an f16 WGMMA operand next to e4m3 weights (sm_90 converts e4m3 -> f16 in
    hardware, not -> bf16). x [M, K] (used as bf16), M <= rows -> (xp [rows, K] float16, e [M]
    int32): row m is x_bf16[m] * 2**(X_TOP_EXP - e[m]), e[m] the exponent of its max |x| (max |x|
    in [2**(e-1), 2**e)) clipped to [E_MIN, 128], so every bf16 value above ~2**-28 * max|x| is
    exact in f16 (below E_MIN every normal bf16 value is: its spacing, >= 2**-133, scales to >=
    2**-18; float32-subnormal values, |x| < 2**-126, become 0 where XLA flushes denormals, as on
    the CPU and the GPU, where the frexp / ldexp form before session 21 kept them); a row with an
    inf / nan gets e = 128 (its product is not finite either way); rows past M are zeros. A
    product computed from row m is undone by ``pow2(e[m] - X_TOP_EXP)``.

    ``bound`` (float32 scalar, traced or not; session 24): the caller guarantees |x| <= bound
    everywhere (an RMSNorm's output, `lingjax.model.common.rms_norm_bound`), and every row takes
    the exponent of the bound instead of its own max: no reduction over x (one XLA kernel fewer
    per call; the model's bounds are recorded numbers, constants in the step: a bound computed
    from the weights inside the step was not hoisted out of the decode loop by XLA). Values above
    ~2**-28 * bound stay exact; a value more than ~2x the bound would overflow f16 to inf (a loud
    failure, never a silently different result)."""
    M, K = x.shape
    if bound is not None and jnp.ndim(bound) != 0:
        raise ValueError(f"the bound must be one scalar for all of x (|x| <= bound), got shape {jnp.shape(bound)}")
    xf = x.astype(jnp.bfloat16).astype(jnp.float32)
    # the exponent from the max's bits: one reduction, no frexp (its zero / subnormal / non-finite
    # selects), and with the clip both powers of two are normal floats (pow2)
    if bound is None:
        e = row_exponent(jnp.max(jnp.abs(xf), axis=1))
    else:
        e = jnp.broadcast_to(row_exponent(bound), (M,))
    xs = (xf * pow2(X_TOP_EXP - e)[:, None]).astype(jnp.float16)
    return jnp.zeros((rows, K), jnp.float16).at[:M].set(xs), e


# Register layout of the SMEM loads that bring an fp8 weight tile to registers (for conversion to a
# 16-bit WGMMA tile). "wgmma": the WGMMA layout, two e4m3 values (2 bytes) per thread and load;
# "upcast2x" (WGMMA_UPCAST_2X) and "8bit" (WGMMA_8BIT): four values (4 bytes) per load, half the
# SMEM load instructions; the converted 16-bit values are stored from the same layout. A trace-time
# setting (bench/moe_kernel_timing.py and bench/skinny_gemm_timing.py --fp8-load-layout sweep it).
FP8_LOAD_LAYOUTS = ("wgmma", "upcast2x", "8bit")
fp8_load_layout = "8bit"    # H200, session 8: kernels 1-5% faster than "wgmma", the step 1.4-2.3% (PERFORMANCE.md)


def load_fp8(ref):
    """fp8 SMEM tile [rows, cols] -> registers in the layout `fp8_load_layout` names."""
    layout = {"wgmma": plgpu.Layout.WGMMA, "upcast2x": plgpu.Layout.WGMMA_UPCAST_2X,
              "8bit": plgpu.Layout.WGMMA_8BIT}[fp8_load_layout]
    return plgpu.load(ref, layout=layout)


@contextlib.contextmanager
def fp8_load_layout_set(name: str | None):
    """Trace the kernels inside with ``fp8_load_layout = name`` (None: leave it as it is)."""
    global fp8_load_layout
    if name is not None and name not in FP8_LOAD_LAYOUTS:
        raise ValueError(f"fp8 load layout {name!r} must be one of {FP8_LOAD_LAYOUTS}")
    old = fp8_load_layout
    fp8_load_layout = name or old
    try:
        yield
    finally:
        fp8_load_layout = old


# How `a_regs` loads an fp8 tile (read at trace time). "wgmma" (the default since session 32): 2 bytes
# per thread straight into the WGMMA layout. "upcast2x" (before): 4 bytes per thread, then a relayout
# to the WGMMA layout (a warp shuffle and three selects per 4 values). In the PTX of the K-minor
# kernels "wgmma" has ~45% fewer instructions per fp8 tile for the skinny GEMM and the MoE gate / up
# kernel, ~20% fewer for the MoE down kernel (two ld.shared.b16 per 4 values instead of an
# ld.shared.b32, a shfl and three selp); the same values in the same registers (GPU tests, bit for
# bit). 12 layers, fp8, DSpark tau 5.29, one H100, one process per row (runs 115, 116): 4.428 ->
# 4.402 and 4.433 -> 4.407 ms per step.
A_REGS_LOADS = ("upcast2x", "wgmma")
A_REGS_LOAD = "wgmma"


def a_regs(tile_ref, scale=None, dtype=jnp.float16):
    """fp8 weight tile [rows, K] (K minor, swizzled) -> the WGMMA A operand in registers: loaded 2
    bytes per thread in the WGMMA layout itself (A_REGS_LOAD = "wgmma"; "upcast2x": 4 bytes per
    thread and a relayout, one warp shuffle per 4 values), converted (fp8 -> f16 exact; or -> f32,
    * scale, -> dtype)."""
    if A_REGS_LOAD not in A_REGS_LOADS:
        raise ValueError(f"A_REGS_LOAD={A_REGS_LOAD!r} must be one of {A_REGS_LOADS}")
    direct = A_REGS_LOAD == "wgmma"
    v = plgpu.load(tile_ref, layout=plgpu.Layout.WGMMA if direct else plgpu.Layout.WGMMA_UPCAST_2X)
    v = v.astype(dtype) if scale is None else (v.astype(jnp.float32) * scale).astype(dtype)
    return v if direct else plgpu.layout_cast(v, plgpu.Layout.WGMMA)


def a_operand(a, tile_ref, interpret):
    """The A operand for plgpu.wgmma: the registers `a` on the GPU; in interpret mode (whose wgmma
    takes SMEM operands only, jax 0.12) `a` stored to the SMEM tile `tile_ref` (same values)."""
    if not interpret:
        return a
    store(tile_ref, a)
    plgpu.commit_smem()
    return tile_ref


def mma_add(acc, a, b_ref, interpret):
    """acc + a . b by WGMMA (acc [64, N] float32 registers, a [64, K] registers or SMEM, b_ref [K, N]
    SMEM); returns when the product is done. On the GPU the accumulator starts from acc
    (``pl.run_state``); interpret mode has no run_state, so there the product is added after."""
    if interpret:
        def fresh(r):
            plgpu.wgmma(r, a, b_ref)
            return r[...]
        return acc + pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32))

    def into(r):
        plgpu.wgmma(r, a, b_ref)
    return pl.run_state(into)(plgpu.ACC.init(acc))


# Refusal shared by the skinny GEMM and the MoE kernels.
ASYNC_K_MINOR = ("fp8_schedule='async' with k_minor=True gave wrong results on the H200 (session 9, run 31: the "
                 "register A operand of a WGMMA still in flight is overwritten by the next tile's conversion); "
                 "use fp8_schedule='serial'")


def combine_splits(o_part, lse, axis: int = 0):
    """Merge the partial softmaxes of flash-decoding splits. o_part [..., n, ..., d] float32 (each
    split's normalised output; n at ``axis``), lse (o_part's shape without d: log2 of each split's
    denominator, max included; -inf: that split saw nothing) -> (o, lse) without the split axis
    (o = 0 and lse = -inf where no split saw anything)."""
    top = jnp.max(lse, axis=axis, keepdims=True)
    top_use = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp2(lse - top_use)
    den = jnp.sum(w, axis=axis)
    den_use = jnp.where(den > 0, den, 1.0)
    # a weighted sum over the split axis (one reduce fusion; an einsum would become a batched dot)
    o = jnp.sum(w[..., None] * o_part, axis=axis) / den_use[..., None]
    return o, jnp.where(den > 0, jnp.squeeze(top_use, axis) + jnp.log2(den_use), -jnp.inf)
