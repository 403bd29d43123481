"""The MoE router's group-limited top-k selection in one Pallas Mosaic GPU launch (decode / verify).

Contract (the XLA reference is :func:`lingjax.ops.moe.grouped_top_k_by_rank`, which the model's
router runs for <= 16 tokens):

    biased  [M, E]  float32   sigmoid(router logits) + expert_bias, computed by XLA
    -> idx  [M, top_k] int32  the same experts in the same order as the reference: each group's
                              top-2 scores summed give the group score, the topk_group best groups
                              are kept, and the top_k experts of their candidates are taken in
                              descending score order (every tie to the lower index / expert id).

Why a kernel: in XLA the selection is a chain of dependent reductions (group ranks, group scores,
group ranks, candidate ranks, the pick), 8-10 small fusions of ~1-1.5 us each per MoE layer on the
H200 (session 16's profile), 40 layers a step. Here one warpgroup per token does it all in SMEM and
registers.

Design
------
* Grid ``(M,)``, one warpgroup per token; the token's scores land in SMEM as [G, 64] (a group per
  row; groups narrower than 64 experts are padded with -inf by the caller's reshape).
* Ranks without sorts, as `top_k_by_rank` computes them: for a vector x of 64 entries, a [64, 64]
  tile in the WGMMA layout compares x as a row-layout vector (``x[:, None]``) with itself as a
  column-layout vector (``x[None, :]``); rank_i = #{j beating i} is a sum along the tile's rows
  (exact in float32). Step by step:
  1. per group g: the members' ranks; the group score = the sum of the members of rank < 2,
     accumulated into column g of a [64, 64] tile (one nonzero term per (row, column): exact);
  2. the group scores (a column vector) are stored and reloaded as a row vector: the groups' ranks,
     kept where rank < topk_group;
  3. candidates: each group's members of rank < kk = min(top_k, group size) go to slot g * kk +
     rank (a one-hot [64 members, 64 slots] tile per group, summed over members: exact), with their
     expert id and whether the group is kept (else the score becomes -inf);
  4. the candidates' ranks (ties to the lower expert id) and the pick: out[r] = the id of the
     candidate of rank r, again a one-hot sum.
* Comparisons are on float32 values as XLA computed them (no sigmoid inside the kernel), so the
  choice is the reference's bit for bit. Not reproduced: `top_k_by_rank`'s -0.0-below-+0.0 order
  (a score of -0.0 cannot arise: sigmoid >= +0.0, and s + bias rounds an exact zero to +0.0).
* The ids travel as float32 (exact below 2**24) and leave as int32 rows of 64; the caller slices
  top_k.

Limits (checked): group size 2..64, n_group <= 64, n_group * kk <= 64, topk_group * kk >= top_k
(enough finite candidates). Ling-3.0-flash: E = 512 in 8 groups of 64, top-4 groups, top-8 experts.

Status (session 19): interpret-mode tests (race detection) against `grouped_top_k_by_rank` and
cross-lowering for CUDA at Ling's shape; not yet compiled or timed on a GPU. The model uses it only
under ``lingjax.model.mlp.ROUTE_KERNEL`` with ``moe_kernel='pallas'`` (off by default until measured).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = ["TILE", "check_route_shape", "route_select_pallas"]

TILE = 64                     # entries per ranked vector (the WGMMA layout's 64 rows)
_F32 = jnp.float32
_ONE, _ZERO = np.float32(1.0), np.float32(0.0)   # float32 literals (not float64 under jax_enable_x64)


def check_route_shape(n_experts: int, n_group: int, topk_group: int, top_k: int) -> int:
    """Validate a router shape for the kernel; returns kk = min(top_k, group size). ValueError
    when it does not fit (see the module docstring's limits)."""
    if n_group < 1 or n_experts % n_group:
        raise ValueError(f"{n_experts} experts do not split into {n_group} groups")
    per = n_experts // n_group
    kk = min(top_k, per)
    if not 2 <= per <= TILE or n_group > TILE:
        raise ValueError(f"groups of {per} experts and {n_group} groups must both fit {TILE} (and a group "
                         "needs >= 2 experts for its top-2 score)")
    if not 1 <= topk_group <= n_group or not 1 <= top_k:
        raise ValueError(f"topk_group={topk_group} must be in 1..{n_group} and top_k={top_k} >= 1")
    if n_group * kk > TILE or topk_group * kk < top_k:
        raise ValueError(f"{n_group} groups x {kk} candidates must fit {TILE} slots and the {topk_group} kept "
                         f"groups must offer >= top_k={top_k} candidates")
    return kk


def route_select_pallas(biased, *, n_group: int, topk_group: int, top_k: int, interpret=False):
    """biased [M, E] (float32 scores + bias) -> idx [M, top_k] int32; see the module docstring.
    ``interpret``: False (compile for the GPU) or a ``plgpu.InterpretGPUParams``."""
    if biased.ndim != 2:
        raise ValueError(f"biased must be [M, E], got shape {biased.shape}")
    M, E = biased.shape
    kk = check_route_shape(E, n_group, topk_group, top_k)
    G, per = n_group, E // n_group
    x = biased.astype(_F32).reshape(M, G, per)
    if per < TILE:            # a group per 64-entry row; -inf never beats a score
        x = jnp.pad(x, ((0, 0), (0, 0), (0, TILE - per)), constant_values=-jnp.inf)
    iota = jnp.arange(TILE, dtype=_F32)
    row = plgpu.Layout.WGMMA.reduce(1)            # [64] vectors broadcast along a tile's columns
    col = plgpu.Layout.WGMMA.reduce(0)            # [64] vectors broadcast along a tile's rows

    # Each SMEM ref is loaded in one layout only (Mosaic GPU's layout inference finds no solution
    # for a ref loaded as both rows and columns), so the vectors ranked against themselves have a
    # row copy (…r_s) and a column copy (…c_s).
    def body(x_g, iota_g, out_g, xr_s, xc_s, ir_s, ic_s, rank_s, vr_s, vc_s, keep_s, out_s, bars):
        m = lax.axis_index("m")
        for i, (src, dst) in enumerate(((x_g.at[m], xr_s), (x_g.at[m], xc_s), (iota_g, ir_s), (iota_g, ic_s))):
            plgpu.copy_gmem_to_smem(src, dst, bars.at[i])
        for i in range(4):
            plgpu.barrier_wait(bars.at[i])
        ii = plgpu.load(ir_s, layout=row)
        jj = plgpu.load(ic_s, layout=col)
        # Tiles: a row-layout vector v as R(v) [64, 64] (v_i along row i), a column-layout one as
        # C(v) (v_j down column j), both added to a zero tile Z: Mosaic GPU's layout inference
        # handles float broadcasts against a full tile, not ops on a broadcast [1, 64] / [64, 1]
        # value (e.g. `a[None, :] == 1 & b[:, None] < 2`). Adding 0.0 changes no score (none is -0.0).
        Z = (jj[None, :] + ii[:, None]) * 0.0                 # [64, 64] zeros in the WGMMA layout
        R = lambda v: v[:, None] + Z      # noqa: E731
        C = lambda v: v[None, :] + Z      # noqa: E731

        def ranks(vi, vj, ti, tj):
            """rank_i = #{j: v_j > v_i, or v_j == v_i and t_j < t_i} for row-layout vi, ti and
            column-layout vj, tj (the same entries): a row-layout float32 vector."""
            beats = (C(vj) > R(vi)) | ((C(vj) == R(vi)) & (C(tj) < R(ti)))
            return jnp.sum(jnp.where(beats, _ONE, _ZERO), axis=1)

        # 1. each group's ranks; its top-2 sum into column g
        gsum = None
        for g in range(G):
            xi = plgpu.load(xr_s.at[g], layout=row)
            rank = ranks(xi, plgpu.load(xc_s.at[g], layout=col), ii, jj)
            rank_s[g] = rank
            term = jnp.where((C(jj) == float(g)) & (R(rank) < 2.0), R(xi), 0.0)
            gsum = term if gsum is None else gsum + term
        scores = jnp.where(jj < float(G), jnp.sum(gsum, axis=0), -jnp.inf)      # [64] columns
        vr_s[0] = scores
        vc_s[0] = scores

        # 2. the groups' ranks (a group row per entry; rows >= G are padding, never read)
        grank = ranks(plgpu.load(vr_s.at[0], layout=row), plgpu.load(vc_s.at[0], layout=col), ii, jj)
        keep_s[...] = jnp.where(grank < float(topk_group), _ONE, _ZERO)

        # 3. each group's top kk into slots g * kk + rank, with id and kept flag
        val = ids = ok = None
        for g in range(G):
            rank = plgpu.load(rank_s.at[g], layout=row)
            hit = (C(jj) == R(rank + float(g * kk))) & (R(rank) < float(kk))
            tv = jnp.where(hit, R(plgpu.load(xr_s.at[g], layout=row)), 0.0)
            ti = jnp.where(hit, R(ii + float(g * per)), 0.0)
            to = jnp.where(hit, keep_s[g], 0.0)
            val, ids, ok = (tv, ti, to) if val is None else (val + tv, ids + ti, ok + to)
        cand = jnp.where(jnp.sum(ok, axis=0) > 0.5, jnp.sum(val, axis=0), -jnp.inf)
        cand_id = jnp.sum(ids, axis=0)
        vr_s[1], vc_s[1], vr_s[2], vc_s[2] = cand, cand, cand_id, cand_id

        # 4. the candidates' ranks (ties to the lower expert id) and the pick by rank
        di = plgpu.load(vr_s.at[2], layout=row)
        crank = ranks(plgpu.load(vr_s.at[1], layout=row), plgpu.load(vc_s.at[1], layout=col), di,
                      plgpu.load(vc_s.at[2], layout=col))
        pick = jnp.sum(jnp.where(C(jj) == R(crank), R(di), 0.0), axis=0)
        out_s[...] = pick.astype(jnp.int32)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_s, out_g.at[m])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((M, TILE), jnp.int32),
        scratch_types=(
            plgpu.SMEM((G, TILE), _F32),        # the token's scores, a group per row (row loads)
            plgpu.SMEM((G, TILE), _F32),        # the same (column loads)
            plgpu.SMEM((TILE,), _F32),          # 0..63 (row loads)
            plgpu.SMEM((TILE,), _F32),          # 0..63 (column loads)
            plgpu.SMEM((G, TILE), _F32),        # each group's ranks
            plgpu.SMEM((3, TILE), _F32),        # group scores; candidate scores; candidate ids (row loads)
            plgpu.SMEM((3, TILE), _F32),        # the same (column loads)
            plgpu.SMEM((TILE,), _F32),          # kept flag per group
            plgpu.SMEM((TILE,), jnp.int32),     # the pick
            plgpu.Barrier(num_barriers=4),
        ),
        grid=(M,),
        grid_names=("m",),
        kernel_name="moe_route",
        interpret=interpret if interpret else None,
    )
    return kernel(x, iota)[:, :top_k]
