"""Batch-1 routed-expert MoE kernel (Pallas Mosaic GPU, `plgpu.kernel`) for M = 1..16 tokens.

Same contract as :func:`lingjax.ops.moe.experts_gather` with block-fp8 expert weights
(:class:`lingjax.quant.Fp8Weight` layout, 128 x 128 blocks) or plain bf16 expert weights:

    x          [M, D]           activations (any float dtype; used as bf16)
    idx, w     [M, k]           router top-k expert ids (int32) and combine weights
    w_gate_up  [E, D, 2, F]     float8_e4m3fn   gu_scale   [E, 2, D/128, F/128] float32
    w_down     [E, F, D]        float8_e4m3fn   down_scale [E, F/128, D/128]    float32
               (or both bfloat16 with gu_scale = down_scale = None)
    -> y [M, D] in x.dtype:  y[m] = sum_j w[m, j] * down_e(swiglu(gate_e(x[m]), up_e(x[m]), limit))

A slot whose combine weight is exactly 0 (``expert_keep``, lingjax/approx.py) is skipped: an
expert chosen only with weight 0 is not read at all.

Design
------
* XLA prologue (tiny): the M*k ids of the slots with a nonzero combine weight are deduplicated
  into U = min(M*k, E) slots (static bound; each expert at its first (token, slot) pair, padding
  slots at repeats and zero-weight slots; sorted and compacted only when M*k > E): one reduction
  gives the slot table ``[U, M + 2]`` (`dedupe_table`: the combine weights ``wu [U, M]``, rows of
  padding slots unused: kernel 2 writes zeros for those slots; a repeat count and the expert id,
  from which each program reads its slot's expert, ``uniq[u]`` below, -1 for padding), x is
  zero-padded to ``xp [16, D]`` bf16. fp8 block scales are not gathered: each
  program copies its expert's whole scale block (``scale_rows``: the stored [.., IN, OUT] blocks
  flattened, a free reshape for Ling-3.0) to SMEM with one TMA and indexes it there (session 10;
  before, a gather, transpose, pad and concatenation per call: XLA kernels of ~1.5 us each).
* bf16 weights (a static switch: no scales given) take the same kernels without the
  dequantisation: the pipeline's TMA lands each chunk directly in a swizzled SMEM tile that is
  the WGMMA A operand (no register round trip, no scale loads). Bytes per expert double.
* Kernel 1 (gate/up), grid ``(U, F / 64, split_d)``: program (u, j, s) streams expert uniq[u]'s
  gate and up columns ``[:, j*64:(j+1)*64]`` over the s-th of split_d ranges of D in 128-row
  chunks (one fp8 scale block per chunk) through ``plgpu.emit_pipeline`` (TMA into SMEM, 3
  stages), multiplied on the tensor cores with the **weight tile as A** (transposed SMEM operand,
  64 output features as WGMMA rows) and the 16 padded tokens as B (the x chunk [16, 128],
  transposed SMEM operand): ``acc[f, m] += sum_d W[d, f] x[m, d]`` in fp32. fp8 chunks (swizzled
  TMA tiles, loaded to registers 4 bytes per thread: ``common.load_fp8``) are converted to
  **float16** in registers (exact: sm_90 converts e4m3 -> f16 in
  hardware, two values per instruction), stored to a swizzled f16 tile and multiplied into a
  fresh accumulator that the chunk's block scale then weights into a float32 carry (as in
  skinny_gemm); the tokens are f16 too, each row of x scaled in XLA by a power of two that puts
  its max |x| in [2**14, 2**15) (with ``x_bound``, session 24: the bound's, no reduction over x)
  and undone on the carries: the float32 product of x_bf16 and the exact dequantised weight (the
  reference rounds ``w * scale`` to bf16 first). SwiGLU (optional
  clamp) on the fp32 accumulators; ``act [U, F, 16]`` bf16 is written (the reference also
  rounds h to bf16; here only act is rounded). With split_d > 1 (one token: 8
  experts x 12 column tiles = 96 programs of 20 serial chunks would leave most SMs idle, so
  `moe_split` picks 4: 384 programs of 5 chunks) the programs write float32 partial gate / up
  products and XLA sums them and applies SwiGLU in the fusion that also transposes act.
* ``fp8_schedule='async'`` (opt-in, not faster on the H200): kernel 1 multiplies each converted f16
  tile by f16(scale * 2**SCALE_SHIFT) in registers (one accumulator, no per-chunk product), both
  kernels leave each chunk's WGMMA in flight while the next chunk converts (the pipeline releases a
  chunk's buffers one step late). The f16 rounding of scale and product (2**-11 relative each) is
  finer than the reference's bf16 dequantisation; block scales must stay below 0.14 (common.py).
* ``k_minor=True`` (session 8; the model's layout since session 9): the weights with the
  contraction axis minor (w_gate_up [E, 2, F, D], w_down [E, D, F]: the published checkpoint's
  orientation). Each tile [64, 128] then lies as a WGMMA A operand wants it: bf16 tiles go from the
  TMA buffer unchanged; fp8 tiles are loaded into registers in the WGMMA layout (2 bytes per
  thread, `common.A_REGS_LOAD`; before session 32 4 bytes and a relayout), converted (kernel 1:
  exact f16; kernel 2: f32 * scale -> bf16), and the WGMMA takes
  A from registers: no 16-bit SMEM tile, a third of the shared-memory traffic, and SMEM for 3 CTAs
  per SM. Kernel 2 then owns 64 rows of D per program (the register tile). Mosaic GPU's interpret
  mode cannot take a register A operand, so there the operand goes through an SMEM tile
  (`common.a_operand`); the register path itself is checked by cross-lowering and on the GPU. The
  'async' schedule is refused with it (wrong results on the H200: a register operand of a WGMMA in
  flight was overwritten).
* An XLA transpose ``act -> [U, 16, F]`` (U*F*16*2 bytes) between the kernels: WGMMA B with
  N = 16 lowers only as a transposed (K-minor) operand, and a register tile cannot be stored
  transposed (both checked by cross-lowering, jax 0.11.2 and 0.12).
* Kernel 2 (down), grid ``(U, D / 128, split_f)``: program (u, j, s) streams the s-th F range
  of w_down[uniq[u], :, j*128:...] in 128-row chunks (split_f = 2 for one token); fp8 chunks are
  dequantised in registers (fp8 -> f32, * block scale, -> bf16: the reference ``Fp8Weight``
  dequantisation, bit for bit) into a swizzled bf16 tile; A = that tile transposed (128 output
  rows), B = act chunk [16, 128] transposed; writes the per-expert output ``yu [U, D, 16]``
  (bf16, each expert's output rounded once as in the reference; float32 partial sums when F is
  split).
* Shared expert (``shared=``, optional): one more slot, the last (u = U: not a row of the
  table), whose programs read the shared expert's own weight and scale arrays ([D, 2, F], [F, D],
  its own SwiGLU clamp) and whose combine weight is 1 for every token: the MoE layer's routed and
  shared experts in the same two launches, summed in float32 (the model uses it when the shared
  expert is as wide as a routed one).
* Combine across experts (``WEIGHTS_IN_ACT``, the default since session 27): the transpose
  between the kernels also multiplies each slot's activations by its tokens' weights, act[u, m] *
  wu[u, m], so kernel 2's outputs come weighted and the combine is the plain XLA sum
  ``y[m, d] = sum_s,u yu[s, u, d, m]``. Before (WEIGHTS_IN_ACT = False): an XLA reduction
  ``y[m, d] = sum_s,u wu[u, m] * yu[s, u, d, m]`` (no
  atomics: deterministic, and the extra traffic U*D*16*2 bytes is ~1.5% of the weight bytes).
* fp8: each program's block-scale copy (and kernel 1's token scales) is awaited where it is first
  read, inside the weight pipeline's first step, so it overlaps the first chunks' loads
  (``LATE_SCALE_WAITS``, session 30).
* Padding slots (uniq = -1) skip all their loads and matmuls (``pl.when``): only the selected
  experts' weights are read, each exactly once per call however many tokens chose it. Kernel 2
  writes zeros for them (kernel 1 leaves their act rows unwritten; only kernel 2's padding
  programs would read them, and they do not).

Bytes per call (fp8): n_used * 3 * D * F weight bytes (5.9 MB per Ling expert) + their scales
+ small traffic (x per program from L2; act 4 * U * F * 16 * 2 B with the transpose; yu
2 * U * D * 16 * 2 B). 5 launches (prologue fusions, kernel 1, transpose, kernel 2, combine).
Ling at M = 1: 8 experts = 47.2 MB of weights -> 11 us at the H200's 4.3 TB/s copy bandwidth;
M = 9 with random routing ~ 67 distinct experts ~ 395 MB -> 92 us. bf16: twice the weight bytes.

Status: runs on the H200 (jax 0.11.2): its GPU tests pass at the Ling shape (M in {1, 9, 16},
independent / shared experts, the SwiGLU clamp, zero-weight slots; tests/test_pallas_moe_experts.py).
Measured (docs/PERFORMANCE.md, "Weight-streaming kernels" and "Full depth with all kernels"):
isolated, `bench/moe_kernel_timing.py` (session 9, K-minor fp8, shared expert included), M = 9
152 us (62% of 4.3 TB/s), M = 1 38.6 us; in the full-depth fp8 DSpark step (session 30, run 108)
kernel 1 moves its bytes at ~4.4 TB/s and kernel 2 at ~3.6 TB/s (the remaining gap: kernel 2;
neither 128-row programs nor the late scale waits close it). Tile sizes and pipeline depth were
swept in session 8 (K-major). On CPU (CI): interpret mode with race detection against
``experts_gather`` (unselected experts and experts chosen only with weight 0 poisoned with NaN) and
cross-lowering for CUDA at the Ling shape. At M = 1 kernel 1's grid is about one wave on the
H200's 132 SMs, so skipped (zero-weight) experts free SMs without shortening the call (expert
skipping saved nothing end to end, session 5).
Expert ids must lie in [0, E) (not checked: traced).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import (ASYNC_K_MINOR, SCALE_SHIFT, X_TOP_EXP, a_operand, a_regs, f16_rows, load_fp8,
                                    pdl_wait, pow2, store, swizzled)

__all__ = ["MAX_M", "BLOCK", "FP8_SCHEDULES", "moe_experts_pallas", "moe_split", "dedupe_table", "dedupe_experts",
           "slot_experts", "weight_bytes"]

MAX_M = 16          # tokens per call (decode or a speculative verify block); also the padded N
BLOCK = 128         # fp8 scale block (both dims) = K chunk of every matmul
TF = 64             # kernel 1: F columns per program (WGMMA M rows of the gate and up tiles)
TD = 128            # kernel 2: D columns per program (WGMMA M rows)
TD_K_MINOR = 64     # kernel 2 with k-minor weights: D rows per program (the A tile in registers)
STAGES = 3          # TMA pipeline depth (default of `stages`)
FP8_SCHEDULES = ("serial", "async")
N_SMS = 132         # H200: the splits below aim at >= 2 programs per SM
# Where the combine weights go (read at trace time). False: the per-expert outputs yu [U, D, 16]
# are weighted and summed in one XLA reduction, y[m] = sum_u wu[u, m] yu[u, :, m] (an einsum with a
# [M, D] output: ~5 us per verify-block call on the H200, session 22). True (session 27): the
# weights scale each expert's activations in the XLA transpose between the two kernels (act[u, m]
# * wu[u, m], a fusion that exists anyway), so kernel 2 writes weighted outputs and the combine is
# a plain sum over the slots with the [D, M] layout kernel 2 writes. One more bf16 rounding (of
# act * w) than the reference's order. On by default since the H100 A/B of session 27 (12 layers,
# fp8, DSpark tau 5.29, same host: 4.697 -> 4.646 ms/step). Read when a program is traced (set it
# before the first trace: lingjax.model.kernels.shared_call caches traced kernels).
WEIGHTS_IN_ACT = True
# fp8 'serial' kernels: await the expert's block-scale copy (and kernel 1 the tokens' x scales)
# where they are first read (the first chunk's product, the SwiGLU) instead of before the weight
# pipeline starts, so those small copies overlap the first weight chunks' loads rather than delay
# them (each down program streams only 6 chunks of 8 KiB at Ling's shape). Same values, bit for
# bit (GPU test). On since session 30: 12 layers, fp8, DSpark tau 5.29, one H100, same call (run
# 109): 4.624 / 4.621 ms per step without, 4.600 with. Read at trace time.
LATE_SCALE_WAITS = True
_BF, _F16, _F32, _FP8 = jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn
_WG = plgpu.Layout.WGMMA




def dedupe_table(idx, w, n_experts: int):
    """idx [M, k] int32, w [M, k] -> table [U, M + 2] float32, the kernels' slot list.

    U = min(M*k, n_experts) (static). Row u is slot u: columns :M its combine weights wu[u, m]
    (the sum of token m's weights for the slot's expert), column M zero where the slot runs its
    expert and > 0 where it repeats an earlier slot's, column M + 1 the expert id (-1: none).
    The slot's expert is ``slot_experts``' rule: the id where column M is 0, else -1 (a padding
    slot). Rows of padding slots' weights are not used (kernel 2 writes zeros for those slots, so
    any finite weight there combines to 0; on the M*k <= E path they hold the repeated expert's
    weights, on the others zeros).
    A (token, slot) whose combine weight is exactly 0 (``expert_keep`` in lingjax/approx.py drops
    slots that way) does not count: an expert chosen only with weight 0 is in no slot, so the
    kernels never read it (its contribution, 0 * y, is dropped; y is not computed).
    M*k <= n_experts (every verify block of Ling-3.0-flash): slot u is the u-th (token, slot) pair
    in token-major order, kept where its expert was not chosen by an earlier pair: one [M*k, M*k]
    comparison and one reduction over the pairs giving the weights, the count of earlier pairs
    with the same expert and the pair's own id (the diagonal's term), so the table is that
    reduction's output and the kernels read it as it is (session 28: the select that made
    ``uniq`` from it was one more XLA kernel per MoE layer; sessions 16 and 25 removed the sort,
    cumsum and scatter). One token (M = 1, every plain decode step) is the same
    rule without comparisons: the router's k slots of one token name distinct experts (a caller's
    duplicate slot would be read twice and still combine exactly). Otherwise (more slots than
    experts: small test models) the slots hold the sorted distinct ids, compacted to the front.
    """
    M, k = idx.shape
    U = min(M * k, n_experts)
    if M == 1 and k <= n_experts:
        keep = w[0] != 0
        return jnp.stack([jnp.where(keep, w[0].astype(_F32), 0.0), jnp.where(keep, 0.0, 1.0),
                          idx[0].astype(_F32)], axis=1)[:U]
    if M * k <= n_experts:
        ids = jnp.where(w.reshape(-1) != 0, idx.reshape(-1).astype(jnp.int32), -1)     # [M*k]
        pair = jnp.arange(M * k)
        same = (ids[:, None] == ids[None, :]) & (ids[:, None] >= 0)                     # [u, j]
        tok = pair // k                                                                 # token of pair j
        # one sum over the pairs j: columns :M token m's weight for expert ids[u] (token m chose it
        # in at most one slot: one nonzero term per (u, m), exact; a select and sum, not a dot,
        # which a GPU may run in TF32), column M the count of earlier pairs with the same expert,
        # column M + 1 ids[u] (only j = u contributes; -1 for a zero-weight pair; exact in float32)
        hit = same[:, :, None] & (tok[:, None] == jnp.arange(M)[None, :])[None]          # [u, j, m]
        terms = jnp.concatenate([jnp.where(hit, w.reshape(1, -1, 1).astype(_F32), 0.0),
                                 jnp.where(same & (pair[None, :] < pair[:, None]), 1.0, 0.0)[:, :, None],
                                 jnp.where(pair[None, :] == pair[:, None], ids[None, :], 0).astype(_F32)[:, :, None]],
                                axis=2)
        return jnp.sum(terms, axis=1)                                                   # [u, M + 2]
    flat = jnp.where(w.reshape(-1) != 0, idx.reshape(-1).astype(jnp.int32), n_experts)  # 0: sentinel E
    s = jnp.sort(flat)                                               # sentinels sort last
    new = jnp.concatenate([jnp.ones((1,), bool), s[1:] != s[:-1]]) & (s < n_experts)
    slot = jnp.cumsum(new) - 1                                       # [M*k] slot of each sorted id
    uniq = jnp.full((U,), -1, jnp.int32).at[jnp.where(new, slot, U)].set(s, mode="drop")
    onehot = idx[:, :, None] == uniq[None, None, :]                  # [M, k, U]
    wu = jnp.einsum("mku,mk->um", onehot.astype(_F32), w.astype(_F32))
    return jnp.concatenate([wu, jnp.where(uniq >= 0, 0.0, 1.0)[:, None], uniq.astype(_F32)[:, None]], axis=1)


def _expert_of(repeats, expert_id):
    """A slot's expert from its table columns M and M + 1 (arrays, or a kernel's scalars): the id
    where the slot repeats no earlier one, else -1 (int32)."""
    return jnp.where(repeats == 0, expert_id.astype(jnp.int32), -1)


def slot_experts(table):
    """dedupe_table's [U, M + 2] -> each slot's expert [U] int32, -1 for a padding slot (the rule the
    kernels apply to their slot's row)."""
    return _expert_of(table[:, -2], table[:, -1])


def dedupe_experts(idx, w, n_experts: int):
    """idx [M, k] int32, w [M, k] -> (uniq [U] int32, -1 padded; wu [U, M] float32): `dedupe_table`
    as the slots' experts and their tokens' combine weights."""
    table = dedupe_table(idx, w, n_experts)
    return slot_experts(table), table[:, :idx.shape[0]]


def _slot_expert(table_g, row):
    """In a kernel: slot ``row``'s expert from the GMEM dedupe table (`slot_experts`' rule on one row;
    a scalar int32, -1 for a padding slot)."""
    cols = table_g.shape[1]
    return _expert_of(table_g[row, cols - 2], table_g[row, cols - 1])


def scale_rows(s, lead: int):
    """Block scales s [*lead, ...] (float32) -> [*lead, R, C]: each expert's trailing axes flattened
    in order (index q = row-major position) into R rows of C <= 256 floats, C a multiple of 4 (16
    bytes): one TMA copy brings an expert's scales to SMEM, indexed by ``scale_at`` with no
    per-call gather, transpose or pad in XLA. Zero-padded to a multiple of 4 floats first when the
    block count is not (small test shapes; Ling-3.0: 2 x 20 x 6 and 6 x 20 need no pad). Raises
    ValueError when R would exceed 256 (a TMA box dimension)."""
    n = 1
    for d in s.shape[lead:]:
        n *= d
    flat = s.astype(_F32).reshape(*s.shape[:lead], n)
    n4 = -(-n // 4) * 4
    if n4 != n:
        flat = jnp.pad(flat, [(0, 0)] * lead + [(0, n4 - n)])
    c = max(c for c in range(4, min(256, n4) + 1, 4) if n4 % c == 0)
    if n4 // c > 256:
        raise ValueError(f"{n} block scales per expert do not fit one TMA copy of <= 256 rows of <= 256 floats")
    return flat.reshape(*s.shape[:lead], n4 // c, c)


def scale_at(s_s, q):
    """The scale at flat index q (a traced int32) of an SMEM copy of `scale_rows` [R, C]."""
    c = s_s.shape[-1]
    return s_s[0, q] if s_s.shape[0] == 1 else s_s[q // c, q % c]


def _silu_clamp(g, u, limit):
    act = g / (1.0 + jnp.exp(-g))
    if limit:
        act = jnp.minimum(act, limit)
        u = jnp.minimum(jnp.maximum(u, -limit), limit)
    return act * u


def _split(programs: int, chunks: int, min_chunks: int, waves: int = 2) -> int:
    """Programs per output tile along the reduction: the smallest divisor S of `chunks` that gives
    >= waves * N_SMS programs with >= min_chunks chunks each, else the largest with min_chunks (1
    if none). One token's 8 experts give kernel 1 only 8 x F/64 = 96 programs of D/128 = 20
    chunks, each a serial dequantise -> WGMMA chain: splitting the reduction shortens the chain."""
    divs = [s for s in range(1, chunks + 1) if chunks % s == 0 and chunks // s >= min_chunks] or [1]
    full = [s for s in divs if programs * s >= waves * N_SMS]
    return full[0] if full else divs[-1]


def _gate_up(table, xp, w_gate_up, su_gu, limits, split, stages, interpret, shared=None, x_scale=None,
             fp8_async=False, k_minor=False):
    """Kernel 1 -> act [U, F, MAX_M] bf16 (split == 1), or (split > 1) the partial gate and up
    products [split, U, 2, F, MAX_M] float32 over split ranges of D, summed and SwiGLU'd by the
    caller (fp8: still to be multiplied by x_scale per token); U = len(table) (`dedupe_table`'s
    slots, + 1 with a shared expert). Rows of padding slots are left unwritten. ``shared`` =
    (w_shared [D, 2, F], its scale rows or None): one more slot, u = len(table), reads it instead
    of w_gate_up[uniq[u]] (uniq = `slot_experts(table)`).

    bf16 weights (su_gu None): xp [MAX_M, D] bf16, the tiles go to the WGMMA as they land.
    fp8 weights: xp [MAX_M, D] float16, each token row scaled by a power of two (x_scale [MAX_M]
    float32 undoes it); su_gu every expert's block scales [2, D/128, F/128] as `scale_rows` [E, R,
    C] (a program copies its expert's to SMEM); each fp8 tile is converted to f16 (exact)
    and multiplied into a fresh accumulator that its block scale then weights (module docstring);
    with ``fp8_async`` the scale times 2**SCALE_SHIFT multiplies the f16 tile
    instead and the WGMMAs run asynchronously. limits: (routed, shared) SwiGLU clamps.
    ``k_minor``: w_gate_up [E, 2, F, D] (w_shared [2, F, D]), D minor: each tile [TF, 128] is the
    WGMMA A operand as it lies (bf16), or (fp8) converted to f16 in registers and multiplied from
    there (no f16 SMEM tile)."""
    if k_minor:
        E, _, F, D = w_gate_up.shape
    else:
        E, D, _, F = w_gate_up.shape
    n_routed = table.shape[0]
    w_shared, s_shared = shared if shared is not None else (None, None)
    shared = w_shared is not None
    U = n_routed + shared
    fp8 = su_gu is not None
    nd, nf = D // BLOCK, F // BLOCK
    x_tf = swizzled(BLOCK, 2)
    w_tf = swizzled(TF, 2)
    kps = D // BLOCK // split                 # D chunks per program
    ds = kps * BLOCK
    col = _WG.reduce(0)                       # [MAX_M] per-token vectors

    wb_tile = fp8 and (not k_minor or interpret)     # an f16 gate / up tile in SMEM
    late_waits = LATE_SCALE_WAITS and not fp8_async

    def moe_gate_up(table_g, x_g, w_g, *refs):
        pdl_wait(interpret)
        refs = list(refs)
        wsh_g = refs.pop(0) if shared else None
        if fp8:
            s_g, xs_g = refs.pop(0), refs.pop(0)
            ssh_g = refs.pop(0) if shared else None
            out_g = refs.pop(0)
            wb_s = refs.pop(0) if wb_tile else None
            s_s, xs_s, o_s, bar = refs
        else:
            out_g, o_s = refs
        u = lax.axis_index("u")
        j = lax.axis_index("f")
        p = lax.axis_index("s")
        e = _slot_expert(table_g, jnp.minimum(u, n_routed - 1))     # (the shared slot's is not used)
        jb = (j * TF) // BLOCK                             # the column tile's scale block
        cols = pl.ds(j * TF, TF)
        rows = pl.ds(p * ds, ds)
        x_spec = plgpu.BlockSpec((MAX_M, BLOCK), lambda i: (0, i), transforms=x_tf)

        def stream_bf16(sources):
            def scoped(acc_g, acc_u):
                def step(_, g_s, u_s, x_s):
                    plgpu.wgmma(acc_g, g_s if k_minor else g_s.T, x_s.T)
                    plgpu.wgmma(acc_u, u_s if k_minor else u_s.T, x_s.T)
                    plgpu.wgmma_wait(0)

                w_spec = (plgpu.BlockSpec((TF, BLOCK), lambda i: (0, i), transforms=swizzled(BLOCK, 2)) if k_minor
                          else plgpu.BlockSpec((BLOCK, TF), lambda i: (i, 0), transforms=w_tf))
                plgpu.emit_pipeline(step, grid=(kps,), in_specs=[w_spec, w_spec, x_spec],
                                    max_concurrent_steps=stages)(*sources, x_g.at[:, rows])
                return acc_g[...], acc_u[...]

            return pl.run_scoped(scoped, plgpu.ACC((TF, MAX_M), _F32), plgpu.ACC((TF, MAX_M), _F32))

        def gu_scale(c, k):
            """The block scale of gate (c = 0) or up (c = 1) for D chunk k of this column tile."""
            return scale_at(s_s, (c * nd + k) * nf + jb)

        def stream_fp8(sources, s_src):
            """fp8: per chunk, the gate and up tiles as exact f16 WGMMA A operands (an f16 SMEM tile,
            or with k_minor registers), a fresh product each, weighted into the carry by its scale."""
            plgpu.copy_gmem_to_smem(s_src, s_s, bar.at[0])
            if not late_waits:
                plgpu.barrier_wait(bar.at[0])

            def a_tiles(g8_s, u8_s):
                if k_minor:                                  # [TF, 128] tiles, converted in registers
                    return [a_operand(a_regs(src), None if wb_s is None else wb_s.at[c], interpret)
                            for c, src in enumerate((g8_s, u8_s))]
                for c, src in enumerate((g8_s, u8_s)):       # [128, TF] tiles; e4m3 -> f16 is exact
                    wb_s.at[c][...] = load_fp8(src).astype(_F16)
                plgpu.commit_smem()
                return [wb_s.at[0].T, wb_s.at[1].T]

            def step(idxs, g8_s, u8_s, x_s, carry):
                (i,) = idxs
                a = a_tiles(g8_s, u8_s)

                def mma(acc_g, acc_u):
                    plgpu.wgmma(acc_g, a[0], x_s.T)
                    plgpu.wgmma(acc_u, a[1], x_s.T)
                    plgpu.wgmma_wait(0)
                    return acc_g[...], acc_u[...]

                pg, pu = pl.run_scoped(mma, plgpu.ACC((TF, MAX_M), _F32), plgpu.ACC((TF, MAX_M), _F32))
                if late_waits:       # the scales' copy ran alongside the first chunks' loads
                    pl.when(i == 0)(lambda: plgpu.barrier_wait(bar.at[0]))
                k = p * kps + i
                return carry[0] + pg * gu_scale(0, k), carry[1] + pu * gu_scale(1, k)

            w_spec = (plgpu.BlockSpec((TF, BLOCK), lambda i: (0, i), transforms=swizzled(BLOCK, 1)) if k_minor
                      else plgpu.BlockSpec((BLOCK, TF), lambda i: (i, 0), transforms=swizzled(TF, 1)))
            zero = plgpu.layout_cast(jnp.zeros((TF, MAX_M), _F32), _WG)
            return plgpu.emit_pipeline(step, grid=(kps,), in_specs=[w_spec, w_spec, x_spec],
                                       max_concurrent_steps=stages,
                                       init_carry=(zero, zero))(*sources, x_g.at[:, rows])

        def stream_fp8_async(sources, s_src):
            """Block scales folded into the f16 conversion (f16(scale * 2**SCALE_SHIFT), exact powers
            of two apart): one accumulator per output, each chunk's WGMMAs left in flight while the
            next converts (k_minor: the scaled tiles stay in registers as the A operands)."""
            plgpu.copy_gmem_to_smem(s_src, s_s, bar.at[0])
            plgpu.barrier_wait(bar.at[0])

            def scale16(c, k):
                return (gu_scale(c, k) * 2.0 ** SCALE_SHIFT).astype(_F16)

            def scoped(acc_g, acc_u):
                def step(idxs, g8_s, u8_s, x_s):
                    (i,) = idxs
                    k = p * kps + i
                    if k_minor:
                        a = [a_regs(src) * scale16(c, k) for c, src in enumerate((g8_s, u8_s))]
                        if interpret:                # its SMEM staging tiles are reused below
                            plgpu.wgmma_wait(0)
                        a = [a_operand(a[c], None if wb_s is None else wb_s.at[c], interpret) for c in range(2)]
                    else:
                        vs = [load_fp8(src).astype(_F16) * scale16(c, k) for c, src in enumerate((g8_s, u8_s))]
                        plgpu.wgmma_wait(0)          # the previous chunk's WGMMAs have read wb_s
                        for c in range(2):
                            wb_s.at[c][...] = vs[c]
                        plgpu.commit_smem()
                        a = [wb_s.at[0].T, wb_s.at[1].T]
                    plgpu.wgmma(acc_g, a[0], x_s.T)      # left in flight (the chunk's buffers
                    plgpu.wgmma(acc_u, a[1], x_s.T)      # are released a step late)

                if k_minor:
                    w_spec = plgpu.BlockSpec((TF, BLOCK), lambda i: (0, i), transforms=swizzled(BLOCK, 1),
                                             delay_release=1)
                else:
                    w_spec = plgpu.BlockSpec((BLOCK, TF), lambda i: (i, 0), transforms=swizzled(TF, 1),
                                             delay_release=1)
                xa_spec = plgpu.BlockSpec((MAX_M, BLOCK), lambda i: (0, i), transforms=x_tf, delay_release=1)
                plgpu.emit_pipeline(step, grid=(kps,), in_specs=[w_spec, w_spec, xa_spec],
                                    max_concurrent_steps=stages)(*sources, x_g.at[:, rows])
                return acc_g[...], acc_u[...]

            return pl.run_scoped(scoped, plgpu.ACC((TF, MAX_M), _F32), plgpu.ACC((TF, MAX_M), _F32))

        def expert(sources, s_src, limit):
            """Stream one expert's gate / up columns (sources: their two [ds, TF] GMEM views; s_src:
            its scale rows in GMEM, fp8)."""
            if fp8:
                res = (stream_fp8_async if fp8_async else stream_fp8)(sources, s_src)
            else:
                res = stream_bf16(sources)
            if split == 1:
                g, up = res
                if fp8:              # undo the tokens' power-of-two scaling (per column)
                    if late_waits:
                        plgpu.barrier_wait(bar.at[1])
                    xs = plgpu.load(xs_s, layout=col)[None, :]
                    g, up = g * xs, up * xs
                store(o_s, _silu_clamp(g, up, limit).astype(_BF))
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_s, out_g.at[u, cols])
            else:
                for c in range(2):
                    store(o_s.at[c], res[c])
                plgpu.commit_smem()
                for c in range(2):
                    plgpu.copy_smem_to_gmem(o_s.at[c], out_g.at[p, u, c, cols])
            plgpu.wait_smem_to_gmem(0)

        routed = (e >= 0) & (u < n_routed) if shared else e >= 0
        if fp8 and split == 1:
            plgpu.copy_gmem_to_smem(xs_g, xs_s, bar.at[1])
            if late_waits:       # awaited where the expert reads them, or here by a padding slot
                pl.when(~(routed | (u == n_routed)) if shared else ~routed)(
                    lambda: plgpu.barrier_wait(bar.at[1]))
            else:
                plgpu.barrier_wait(bar.at[1])
        s_e = (lambda: s_g.at[e]) if fp8 else (lambda: None)          # (views made inside pl.when)
        s_sh = ssh_g if fp8 and shared else None
        if k_minor:
            pl.when(routed)(lambda: expert((w_g.at[e, 0, cols, rows], w_g.at[e, 1, cols, rows]), s_e(), limits[0]))
            if shared:
                pl.when(u == n_routed)(lambda: expert((wsh_g.at[0, cols, rows], wsh_g.at[1, cols, rows]), s_sh,
                                                      limits[1]))
        else:
            pl.when(routed)(lambda: expert((w_g.at[e, rows, 0, cols], w_g.at[e, rows, 1, cols]), s_e(), limits[0]))
            if shared:
                pl.when(u == n_routed)(lambda: expert((wsh_g.at[rows, 0, cols], wsh_g.at[rows, 1, cols]), s_sh,
                                                      limits[1]))

    if split == 1:
        out_tile = plgpu.SMEM((TF, MAX_M), _BF)
        out_type = jax.ShapeDtypeStruct((U, F, MAX_M), _BF)
    else:
        out_tile = plgpu.SMEM((2, TF, MAX_M), _F32)
        out_type = jax.ShapeDtypeStruct((split, U, 2, F, MAX_M), _F32)
    tile = (plgpu.SMEM((2, TF, BLOCK), _F16, transforms=swizzled(BLOCK, 2)) if k_minor     # (interpret)
            else plgpu.SMEM((2, BLOCK, TF), _F16, transforms=w_tf))                         # f16 gate / up chunk
    scratch = (*((tile,) if wb_tile else ()),
               plgpu.SMEM(su_gu.shape[1:], _F32),                       # the expert's scales
               plgpu.SMEM((MAX_M,), _F32),                              # the tokens' x scales
               out_tile, plgpu.Barrier(num_barriers=2)) if fp8 else (out_tile,)
    kernel = plgpu.kernel(
        moe_gate_up,        # the function name is the kernel name in profiles
        out_type=out_type,
        scratch_types=scratch,
        grid=(U, F // TF, split),
        grid_names=("u", "f", "s"),
        interpret=interpret if interpret else None,
    )
    return kernel(table, xp, w_gate_up, *((w_shared,) if shared else ()),
                  *((su_gu, x_scale) if fp8 else ()), *((s_shared,) if fp8 and shared else ()))


def _down(table, act_t, w_down, su_d, split, stages, interpret, shared=None, fp8_async=False, k_minor=False):
    """Kernel 2: act_t [U, MAX_M, F] bf16 -> yu [split, U, D, MAX_M], the per-expert outputs
    (weighted when the caller weighted act_t: WEIGHTS_IN_ACT) over split ranges of F (zeros for
    padding slots; the caller sums the splits): bfloat16 when split == 1 (each expert's output
    rounded once, as the reference's bf16 einsum does; half the bytes for the combine to read),
    float32 partial sums otherwise; U = len(table) (+ 1 with a
    shared expert). su_d: every expert's block scales [F/128, D/128] as `scale_rows` [E, R, C]
    (fp8 weights) or None (bf16 weights). ``shared`` = (w_shared [F, D], its scale rows or None):
    one more slot, u = len(table). ``fp8_async``: each chunk's WGMMA is left in flight while the
    next chunk dequantises (the same bf16 tile values).
    ``k_minor``: w_down [E, D, F] (w_shared [D, F]); programs own TD_K_MINOR rows of D and (fp8)
    dequantise each [TD_K_MINOR, 128] tile in registers as the WGMMA A operand (no bf16 SMEM tile)."""
    if k_minor:
        E, D, F = w_down.shape
    else:
        E, F, D = w_down.shape
    td = TD_K_MINOR if k_minor else TD
    n_routed = table.shape[0]
    w_shared, s_shared = shared if shared is not None else (None, None)
    shared = w_shared is not None
    U = n_routed + shared
    nd = D // BLOCK
    fp8 = su_d is not None
    out_dtype = _BF if split == 1 else _F32
    a_tf = swizzled(BLOCK, 2)
    w_tf = swizzled(td, 2)
    kps = F // BLOCK // split                 # F chunks per program
    fs = kps * BLOCK
    wb_tile = fp8 and (not k_minor or interpret)     # a bf16 down tile in SMEM
    late_waits = LATE_SCALE_WAITS and not fp8_async

    def moe_down(table_g, act_g, w_g, *refs):
        pdl_wait(interpret)
        refs = list(refs)
        wsh_g = refs.pop(0) if shared else None
        if fp8:
            s_g = refs.pop(0)
            ssh_g = refs.pop(0) if shared else None
            y_g = refs.pop(0)
            wb_s = refs.pop(0) if wb_tile else None
            s_s, o_s, bar = refs
        else:
            y_g, o_s = refs
        u = lax.axis_index("u")
        j = lax.axis_index("d")
        p = lax.axis_index("s")
        e = _slot_expert(table_g, jnp.minimum(u, n_routed - 1))     # (the shared slot's is not used)
        db = (j * td) // BLOCK                             # the row tile's scale block
        cols = pl.ds(j * td, td)
        rows = pl.ds(p * fs, fs)

        def down_scale(i):
            """The block scale of this program's F chunk i."""
            return scale_at(s_s, (p * kps + i) * nd + db)

        def expert(source, s_src):
            """Stream one expert's [fs, td] block of w_down ([td, fs] if k_minor; its GMEM view;
            s_src: its scale rows in GMEM, fp8)."""
            if fp8:
                plgpu.copy_gmem_to_smem(s_src, s_s, bar.at[0])
                if not late_waits:
                    plgpu.barrier_wait(bar.at[0])

            def scoped(acc):
                def step(idxs, w_s, a_s):
                    (i,) = idxs
                    if fp8 and late_waits:   # the scales' copy ran alongside the first chunks' loads
                        pl.when(i == 0)(lambda: plgpu.barrier_wait(bar.at[0]))
                    if k_minor:
                        if fp8:      # dequantised in registers: the A operand from there
                            a = a_regs(w_s, down_scale(i), _BF)
                            if fp8_async and interpret:      # its SMEM staging tile is reused
                                plgpu.wgmma_wait(0)
                            w_s = a_operand(a, wb_s, interpret)
                        plgpu.wgmma(acc, w_s, a_s.T)
                        if not fp8_async:
                            plgpu.wgmma_wait(0)
                        return
                    if fp8:      # dequantise the fp8 chunk into the swizzled bf16 tile
                        v = load_fp8(w_s)                                 # swizzled fp8 tile
                        v = (v.astype(_F32) * down_scale(i)).astype(_BF)
                        if fp8_async:
                            plgpu.wgmma_wait(0)      # the previous chunk's WGMMA has read wb_s
                        store(wb_s, v)
                        plgpu.commit_smem()
                        w_s = wb_s
                    plgpu.wgmma(acc, w_s.T, a_s.T)
                    if not fp8_async:
                        plgpu.wgmma_wait(0)

                late = 1 if fp8_async else 0         # async: buffers released one step late
                if k_minor:
                    w_spec = plgpu.BlockSpec((td, BLOCK), lambda i: (0, i), delay_release=late,
                                             transforms=swizzled(BLOCK, 1 if fp8 else 2))
                else:
                    w_spec = plgpu.BlockSpec((BLOCK, td), lambda i: (i, 0),
                                             transforms=swizzled(td, 1) if fp8 else w_tf, delay_release=late)
                plgpu.emit_pipeline(
                    step,
                    grid=(kps,),
                    in_specs=[w_spec, plgpu.BlockSpec((MAX_M, BLOCK), lambda i: (0, i), transforms=a_tf,
                                                      delay_release=late)],
                    max_concurrent_steps=stages,
                )(source, act_g.at[u, :, rows])
                return acc[...]

            y = pl.run_scoped(scoped, plgpu.ACC((td, MAX_M), _F32))
            store(o_s, y.astype(out_dtype))

        routed = (e >= 0) & (u < n_routed) if shared else e >= 0
        s_e = (lambda: s_g.at[e]) if fp8 else (lambda: None)          # (views made inside pl.when)
        s_sh = ssh_g if fp8 and shared else None
        if k_minor:
            pl.when(routed)(lambda: expert(w_g.at[e, cols, rows], s_e()))
            if shared:
                pl.when(u == n_routed)(lambda: expert(wsh_g.at[cols, rows], s_sh))
        else:
            pl.when(routed)(lambda: expert(w_g.at[e, rows, cols], s_e()))
            if shared:
                pl.when(u == n_routed)(lambda: expert(wsh_g.at[rows, cols], s_sh))

        @pl.when((e < 0) & (u < n_routed) if shared else e < 0)     # padding slot: reads nothing, writes zeros
        def _():
            store(o_s, plgpu.layout_cast(jnp.zeros((td, MAX_M), out_dtype), _WG))

        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, y_g.at[p, u, cols])
        plgpu.wait_smem_to_gmem(0)

    out_tile = plgpu.SMEM((td, MAX_M), out_dtype)
    tile = (plgpu.SMEM((td, BLOCK), _BF, transforms=swizzled(BLOCK, 2)) if k_minor     # (interpret)
            else plgpu.SMEM((BLOCK, td), _BF, transforms=w_tf))                        # dequantised down chunk
    scratch = (*((tile,) if wb_tile else ()),
               plgpu.SMEM(su_d.shape[1:], _F32),                        # the expert's scales
               out_tile, plgpu.Barrier(num_barriers=1)) if fp8 else (out_tile,)
    kernel = plgpu.kernel(
        moe_down,
        out_type=jax.ShapeDtypeStruct((split, U, D, MAX_M), out_dtype),
        scratch_types=scratch,
        grid=(U, D // td, split),
        grid_names=("u", "d", "s"),
        interpret=interpret if interpret else None,
    )
    return kernel(table, act_t, w_down, *((w_shared,) if shared else ()), *((su_d,) if fp8 else ()),
                  *((s_shared,) if fp8 and shared else ()))


def moe_experts_pallas(x, idx, w, w_gate_up, gu_scale, w_down, down_scale, limit=None, *,
                       shared=None, split_d=None, split_f=None, stages=STAGES, fp8_schedule="serial",
                       k_minor=False, x_bound=None, interpret=False):
    """Routed experts for M = 1..16 tokens; see the module docstring.

    x [M, D]; idx, w [M, k]; either block-fp8 weights: w_gate_up [E, D, 2, F] float8_e4m3fn +
    gu_scale [E, 2, D/128, F/128] f32, w_down [E, F, D] fp8 + down_scale [E, F/128, D/128] f32;
    or bf16 weights (streamed as they are) with gu_scale = down_scale = None. limit: optional
    SwiGLU clamp. Slots with w == 0 are skipped (`dedupe_experts`).
    ``shared``: optional shared expert run in the same kernels as one more slot with combine
    weight 1 for every token, ``(w_gate_up [D, 2, F], gu_scale [2, D/128, F/128] | None, w_down
    [F, D], down_scale [F/128, D/128] | None, limit)``, the routed experts' dtype and F.
    ``split_d`` / ``split_f``: programs per output tile along D (kernel 1) / F (kernel 2); must
    divide D/128 / F/128; None = :func:`moe_split` (split when there are too few programs).
    ``stages``: TMA pipeline depth of both kernels (chunks in flight per program).
    ``fp8_schedule``: 'serial' (per chunk: convert, WGMMA, wait; kernel 1 scales each chunk's
    product) or 'async' (kernel 1 multiplies the f16 tile by its scale, both kernels leave each
    chunk's WGMMA in flight while the next chunk converts; needs stages >= 2). bf16 ignores it.
    ``k_minor``: the weight values with the contraction axis minor, as the published checkpoint
    stores them: w_gate_up [E, 2, F, D], w_down [E, D, F] (shared: [2, F, D], [D, F]); the scales
    as always [.., IN blocks, OUT blocks] (the Fp8Weight convention); fp8 tiles then become the
    WGMMA A operand in registers (no 16-bit SMEM tile; 'serial' only: 'async' is refused). The
    model's layout since session 9: M=9 152 vs 178 us with the shared expert on the H200 (run 31).
    ``x_bound``: optional float32 scalar with |x| <= x_bound guaranteed by the caller (fp8: the
    tokens' f16 scaling then needs no reduction over x, `common.f16_rows`).
    ``interpret``: False (compile for the GPU) or a ``plgpu.InterpretGPUParams``. -> [M, D] x.dtype.
    """
    M, D = x.shape
    if k_minor:
        E, two, F, D2 = w_gate_up.shape
        gu_want, d_want = "[E, 2, F, D]", (E, D, F)
    else:
        E, D2, two, F = w_gate_up.shape
        gu_want, d_want = "[E, D, 2, F]", (E, F, D)
    gs_want, ds_want = (E, 2, D // BLOCK, F // BLOCK), (E, F // BLOCK, D // BLOCK)     # [.., IN, OUT] blocks
    if not 1 <= M <= MAX_M:
        raise ValueError(f"M={M} tokens must be in 1..{MAX_M}")
    if idx.shape != w.shape or idx.ndim != 2 or idx.shape[0] != M:
        raise ValueError(f"idx {idx.shape} and w {w.shape} must both be [M={M}, k]")
    if (D2, two) != (D, 2) or w_down.shape != d_want:
        raise ValueError(f"weights w_gate_up {w_gate_up.shape}, w_down {w_down.shape} do not match "
                         f"{gu_want} / {list(d_want)} with D={D}{' (k_minor)' if k_minor else ''}")
    fp8 = w_gate_up.dtype == _FP8
    if w_gate_up.dtype != w_down.dtype or w_gate_up.dtype not in (_FP8, _BF):
        raise ValueError(f"weights must both be float8_e4m3fn (with block scales) or both bfloat16 "
                         f"(no scales), got {w_gate_up.dtype}, {w_down.dtype}")
    if D % BLOCK or F % BLOCK:
        raise ValueError(f"D={D} and F={F} must be multiples of {BLOCK} (the fp8 scale block and "
                         "the K chunk of both kernels)")
    nd, nf = D // BLOCK, F // BLOCK
    if not fp8:
        if gu_scale is not None or down_scale is not None:
            raise ValueError("bfloat16 weights take no scales: pass gu_scale=None, down_scale=None")
    elif gu_scale is None or down_scale is None or gu_scale.shape != gs_want \
            or down_scale.shape != ds_want:
        shapes = [None if a is None else a.shape for a in (gu_scale, down_scale)]
        raise ValueError(f"fp8 scales {shapes[0]}, {shapes[1]} must be {gs_want}, "
                         f"{ds_want} (128 x 128 blocks)")

    if shared is not None:
        sh_gu, sh_gu_scale, sh_d, sh_d_scale, sh_limit = shared
        if sh_gu.shape != w_gate_up.shape[1:] or sh_d.shape != w_down.shape[1:] \
                or sh_gu.dtype != w_gate_up.dtype or sh_d.dtype != w_down.dtype:
            raise ValueError(f"shared expert weights {sh_gu.shape} {sh_gu.dtype}, {sh_d.shape} {sh_d.dtype} must "
                             f"be one routed expert's {w_gate_up.shape[1:]} and {w_down.shape[1:]} in the routed "
                             f"experts' dtype {w_gate_up.dtype}")
        if fp8 != (sh_gu_scale is not None) or fp8 != (sh_d_scale is not None) or (fp8 and (
                sh_gu_scale.shape != gs_want[1:] or sh_d_scale.shape != ds_want[1:])):
            raise ValueError(f"shared expert scales must be {gs_want[1:]} and {ds_want[1:]} for fp8 weights, "
                             "None for bfloat16 weights")
    U = min(M * idx.shape[1], E) + (shared is not None)
    auto_d, auto_f = moe_split(U, D, F, k_minor)
    split_d, split_f = split_d or auto_d, split_f or auto_f
    if fp8_schedule not in FP8_SCHEDULES:
        raise ValueError(f"fp8_schedule={fp8_schedule!r} must be one of {FP8_SCHEDULES}")
    if k_minor and fp8_schedule == "async":
        raise ValueError(ASYNC_K_MINOR)
    fp8_async = fp8 and fp8_schedule == "async"
    if stages < 1 or (fp8_async and stages < 2):
        raise ValueError(f"stages={stages} must be >= 1 (>= 2 for fp8_schedule='async': a chunk's buffers are "
                         "released one step late, while its WGMMA runs)")
    if split_d < 1 or split_f < 1 or nd % split_d or nf % split_f:
        raise ValueError(f"split_d={split_d} must divide D/128={nd} and split_f={split_f} must divide "
                         f"F/128={nf}")

    table = dedupe_table(idx, w, E)                                     # [U, M + 2]
    wu = table[:, :M]                                                   # [U, M]
    if shared is not None:   # the kernels' last slot (not in the table): the shared expert, weight 1
        wu = jnp.concatenate([wu, jnp.ones((1, M), _F32)])              # (fused into the combine)
    x_scale = None
    if fp8:          # kernel 1 multiplies f16 tokens, each row scaled into f16's range
        xp, ex = f16_rows(x, MAX_M, x_bound)
        shift = X_TOP_EXP + (SCALE_SHIFT if fp8_async else 0)
        x_scale = jnp.zeros((MAX_M,), _F32).at[:M].set(pow2(ex - shift))
    else:
        xp = jnp.zeros((MAX_M, D), _BF).at[:M].set(x.astype(_BF))
    su_gu = su_d = None
    sh1 = sh2 = None
    if fp8:          # every expert's scales, copied to SMEM by the programs that read the expert
        su_gu, su_d = scale_rows(gu_scale, 1), scale_rows(down_scale, 1)     # [E, R, C]
    if shared is not None:
        sh1 = (sh_gu, scale_rows(sh_gu_scale, 0) if fp8 else None)
        sh2 = (sh_d, scale_rows(sh_d_scale, 0) if fp8 else None)
    limits = (limit, limit if shared is None else sh_limit)
    act = _gate_up(table, xp, w_gate_up, su_gu, limits, split_d, stages, interpret, sh1, x_scale, fp8_async,
                   k_minor)
    if split_d > 1:     # [split, U, 2, F, MAX_M] partial sums -> SwiGLU in XLA (one fusion with the transpose)
        gu = act.sum(0) if x_scale is None else act.sum(0) * x_scale
        act = _silu_clamp(gu[:, 0], gu[:, 1], limits[0])                         # [U, F, MAX_M]
        if limits[1] != limits[0]:
            act = jnp.concatenate([act[:-1], _silu_clamp(gu[-1:, 0], gu[-1:, 1], limits[1])])
        act = act.astype(_BF)
    act_t = jnp.swapaxes(act, 1, 2)                                             # [U, MAX_M, F]
    if WEIGHTS_IN_ACT:       # token m's weight for slot u on its activations (fused into the transpose)
        wpad = jnp.zeros((wu.shape[0], MAX_M), _F32).at[:, :M].set(wu)
        act_t = (act_t.astype(_F32) * wpad[:, :, None]).astype(_BF)
    yu = _down(table, act_t, w_down, su_d, split_f, stages, interpret, sh2,
               fp8_async, k_minor)                                              # [split, U, D, MAX_M]
    if WEIGHTS_IN_ACT:
        return yu.astype(_F32).sum((0, 1))[:, :M].T.astype(x.dtype)
    return jnp.einsum("sudm,um->md", yu[..., :M].astype(_F32), wu).astype(x.dtype)


def moe_split(U: int, D: int, F: int, k_minor: bool = False) -> tuple[int, int]:
    """Default (split_d, split_f) for U expert slots: kernel 1 splits D when U * F/64 programs are
    too few (one token: 8 x 12 = 96 -> split 4, 5 chunks each; k_minor: one wave of programs is
    enough, 9 x 12 = 108 -> split 2), kernel 2 splits F the same way (8 x D/128 = 160 -> 2, 3
    chunks each; k_minor: 8 x D/64 = 320 -> no split); a 9-token verify block (~66 experts)
    splits neither. H200, k_minor, one token + the shared expert (run 34): split_d 1 / 2 / 4
    35.8 / 35.4 / 39.2 us per MoE call, split_f 1 / 2 38.9 / 39.6."""
    td = TD_K_MINOR if k_minor else TD
    return (_split(U * (F // TF), D // BLOCK, 4, waves=1 if k_minor else 2), _split(U * (D // td), F // BLOCK, 2))


def weight_bytes(n_experts_used: int, D: int, F: int, fp8: bool = True) -> int:
    """HBM bytes of expert weights (fp8 + f32 scales, or bf16) the kernels read for
    `n_experts_used` experts."""
    if not fp8:
        return n_experts_used * 3 * D * F * 2
    return n_experts_used * (3 * D * F + 3 * (D // BLOCK) * (F // BLOCK) * 4)
