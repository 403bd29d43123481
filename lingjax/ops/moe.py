"""Pure-XLA MoE reference ops: the group-limited sigmoid router and the routed-expert SwiGLU.

Two exact expert paths: `experts_gather` (decode / verify: gathers each token's chosen experts)
and `experts_capacity` (prefill: every expert's first `cap` tokens in one dense pass over
contiguous expert groups, the rest in overflow blocks) — they compute the same function;
`experts_dense` is the test oracle.
Ties in top-k are broken towards the lower index (jax.lax.top_k).

Approximate expert skipping (`route(..., expert_keep=X)`, lingjax/approx.py) keeps the k slots:
a dropped slot gets weight 0 and the index of the token's heaviest expert, so both paths stay
exact for the kept experts (0 * y adds nothing) while the distinct experts a token touches fall to
the kept count: the capacity path (prefill) still runs every expert's dense slots (only its
overflow blocks shrink), and the gather path reads the duplicate rows again (a kernel that skips zero-weight slots, or the cache, turns that into a
saving; measure it on the device).

Expert weights are passed as Param-likes (`w[...]` gives the array) so that block-fp8 weights
(`lingjax.quant.Fp8Weight`) are gathered before they are dequantised; plain arrays work too.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from lingjax.model.common import acc_dtype
from lingjax.quant import Fp8Weight, slice_rows, take_rows


class _Array:
    """A plain array seen as a Param-like (w[...] returns it)."""

    def __init__(self, a):
        self.a = a
        self.shape = a.shape

    def __getitem__(self, index):
        return self.a[index]


def _param_like(w):
    return w if isinstance(w, (Fp8Weight, nnx.Variable)) else _Array(jnp.asarray(w))


# Routers of up to this many tokens select without sorts (SMALL_SELECTION), larger ones through
# lax.top_k ("sort"); all SELECTIONS give the same experts. H200 (session 7, `python -m
# bench.router_timing --M 1,9`): the flat "rank" router 16.9 vs 22.2 us per call at M = 1, 15.4 vs
# 18.7 at M = 9; "grouped-rank" (session 16) 10.7 / 12.4; "grouped-merge" (session 20, run 77)
# 10.2 / 12.2 vs 11.3 / 12.3, one MoE layer 44.4 / 72.1 vs 45.3 / 73.6 us, plain full-depth step
# 4.106 vs 4.191 ms. On the CPU the sort-free paths are slower.
SORT_FREE_MAX_ROWS = 16
SELECTIONS = ("sort", "rank", "grouped-rank", "grouped-merge")
SMALL_SELECTION = "grouped-merge"


def top_k_by_rank(x, k: int, ids=None):
    """jax.lax.top_k without a sort: (values, indices) [..., k], descending, ties to the lower index.

    rank[i] = #{j: x[j] > x[i], or x[j] == x[i] and j < i} is a permutation of 0..n-1 and the k
    entries of rank < k are the top k: n^2 comparisons per row, a few reductions for XLA, where
    lax.top_k is a sort kernel (3 µs each on the H200, three per router call). For the decode /
    verify router (n <= 512, <= 16 rows); NaN entries (never in a router's scores) break it.
    ids (optional, int [..., n], distinct per row): ties go to the lower id instead of the lower
    position, and the returned indices are the chosen entries' ids."""
    n = x.shape[-1]
    pos = jnp.arange(n)
    i = pos if ids is None else ids
    ii, ij = i[..., :, None], i[..., None, :]
    xi, xj = x[..., :, None], x[..., None, :]
    neg = jnp.signbit(x)                                # lax.top_k's total order puts -0.0 below +0.0
    ni, nj = neg[..., :, None], neg[..., None, :]
    tie = (xj == xi) & (nj == ni) & (ij < ii)
    beats = (xj > xi) | ((xj == xi) & ni & ~nj) | tie                       # [..., n, n]: j beats i
    rank = beats.sum(-1, dtype=jnp.int32)                                   # [..., n]
    at = jnp.sum(jnp.where(rank[..., None, :] == jnp.arange(k)[:, None], pos, 0), axis=-1, dtype=jnp.int32)
    chosen = at if ids is None else jnp.take_along_axis(ids, at, axis=-1).astype(jnp.int32)
    return jnp.take_along_axis(x, at, axis=-1), chosen


def router_logits(x, w_router, acc):
    """x [N, D] @ w_router [D, E] accumulated in `acc` (float32): bf16 x bf16 products are exact in
    float32, so the [D, E] weight is not upcast. One token goes in as two identical rows (the first
    row's logits returned): XLA on the GPU rewrites a one-row dot into a float32 product and a
    reduction (9 us on the H200 for Ling's 2560 x 512 router, session 10) but runs two rows as a
    GEMM fusion (2.9 us, run 39); each row's logits are the same either way."""
    if x.shape[0] == 1:
        return jnp.dot(jnp.concatenate([x, x]), w_router, preferred_element_type=acc)[:1]
    return jnp.dot(x, w_router, preferred_element_type=acc)


def grouped_top_k_by_rank(biased, n_group: int, topk_group: int, top_k: int):
    """The group-limited selection of `route` without sorts and without one n^2 comparison over all
    E experts: idx [N, top_k] int32, the same experts in the same order as `route`'s other selections.

    biased [N, E] -> each group's top kk = min(top_k, E/G) by `top_k_by_rank` ([G, E/G, E/G]
    comparisons a row; its top 2 give the group score), the topk_group best groups, then the top_k
    of their G * kk candidates ranked with ties to the lower expert id ([G kk, G kk] comparisons;
    Ling-3.0-flash: 8 * 64^2 + 64^2 instead of 512^2). The same experts in the same order as the
    top_k over every kept group's experts: an expert in that top_k is beaten by fewer than top_k
    experts, so by fewer than kk of its own group's."""
    n, e = biased.shape
    per = e // n_group
    kk = min(top_k, per)
    gv, gi = top_k_by_rank(biased.reshape(n, n_group, per), min(max(kk, 2), per))   # [N, G, r]
    group_score = gv[..., :2].sum(-1)                                       # = top 2 per group, summed
    _, keep = top_k_by_rank(group_score, topk_group)                        # [N, topk_group]
    group_mask = jax.nn.one_hot(keep, n_group, dtype=jnp.bool_).any(axis=1)  # [N, G]
    cand = jnp.where(group_mask[..., None], gv[..., :kk], -jnp.inf).reshape(n, n_group * kk)
    ids = (gi[..., :kk] + per * jnp.arange(n_group, dtype=jnp.int32)[:, None]).reshape(n, n_group * kk)
    return top_k_by_rank(cand, top_k, ids=ids)[1]


def _beats(av, ai, bv, bi):
    """(av, ai) ranks before (bv, bi): the larger value, -0.0 below +0.0 (lax.top_k's total order),
    then the lower id."""
    an, bn = jnp.signbit(av), jnp.signbit(bv)
    return (av > bv) | ((av == bv) & ((bn & ~an) | ((an == bn) & (ai < bi))))


def _merge_top_lists(a, b, fields: int = 2):
    """Two descending lists of K (value, id) pairs (K a power of two; a = (values..., ids...), 2K
    scalars or arrays; fields=3: (values..., ids..., payloads...), 3K, each payload riding with its
    pair) -> the K best of their union, descending: the bitonic merge (pairwise best of a[r] and
    b[K-1-r], then log2 K compare-exchange stages). Exact under `_beats`' strict order (ids
    distinct), so associative and commutative: a reduction combiner."""
    k = len(a) // fields
    out = [[None] * k for _ in range(fields)]             # out[f][r]: field f of entry r
    for r in range(k):
        keep_a = _beats(a[r], a[k + r], b[k - 1 - r], b[2 * k - 1 - r])
        for f in range(fields):
            out[f][r] = jnp.where(keep_a, a[f * k + r], b[f * k + k - 1 - r])
    stride = k // 2
    while stride:
        for r in range(k):
            if r & stride:
                continue
            first = _beats(out[0][r], out[1][r], out[0][r + stride], out[1][r + stride])
            for f in range(fields):
                x, y = out[f][r], out[f][r + stride]
                out[f][r], out[f][r + stride] = jnp.where(first, x, y), jnp.where(first, y, x)
        stride //= 2
    return tuple(x for field in out for x in field)


def _top_lists(values, ids, k2: int, axis: int, payload=None):
    """The top k2 (k2 a power of two) of `values` along `axis`, ties by `_beats`, as one XLA
    reduction whose combiner merges sorted lists: (values [.., k2], ids [.., k2]) descending, with
    the axis removed and a trailing k2 axis; with `payload` (values' shape) a third list, each
    entry's payload. An axis shorter than k2 leaves its lists ending in (-inf, the int dtype's max,
    0) padding, below every real entry."""
    fields = [(values, -jnp.inf), (ids, jnp.iinfo(ids.dtype).max)] + ([] if payload is None else [(payload, 0)])
    operands, inits = [], []
    for x, pad in fields:
        operands += [x] + [jnp.full(x.shape, pad, x.dtype)] * (k2 - 1)
        inits += [jnp.array(pad, x.dtype)] * k2
    out = jax.lax.reduce(tuple(operands), tuple(inits), functools.partial(_merge_top_lists, fields=len(fields)),
                         (axis,))
    return tuple(jnp.stack(out[f * k2:(f + 1) * k2], -1) for f in range(len(fields)))


def grouped_top_k_by_merge(biased, n_group: int, topk_group: int, top_k: int, payload=None):
    """The group-limited selection of `route` in three reductions (no sorts, no n^2 comparisons
    over the experts): idx [N, top_k] int32, the same experts in the same order as the other
    selections; with `payload` [N, E] also (idx, payload at idx [N, top_k]), carried through the
    reductions with the chosen entries (`route` gets the chosen experts' scores this way, with no
    gather after the selection).

    biased [N, E] -> (1) each group's top K2 = next power of two >= max(min(top_k, E/G), 2) as a
    list-merging reduction over the group's experts (its top 2 summed: the group score); (2) the
    groups' ranks ([G, G] comparisons, ties to the lower group) keep topk_group groups; (3) the
    top_k of the kept groups' lists, a list-merging reduction over the groups (unkept ones masked to
    -inf). Each reduction's combiner merges two descending lists bitonically (`_merge_top_lists`);
    the order (value, -0.0 below +0.0, lower expert id) is lax.top_k's, so any reduction order XLA
    picks gives the same lists. An expert in the top_k over every kept group's experts is beaten by
    fewer than top_k experts, so by fewer than K2 >= min(top_k, E/G) of its own group's."""
    n, e = biased.shape
    per = e // n_group
    k2 = 1 << (max(min(top_k, per), 2) - 1).bit_length()
    k_out = 1 << (top_k - 1).bit_length()
    ids = jnp.broadcast_to(jnp.arange(e, dtype=jnp.int32), (n, e))
    grouped = lambda a: a.reshape(n, n_group, per)      # noqa: E731
    lists = _top_lists(grouped(biased), grouped(ids), k2, 2, None if payload is None else grouped(payload))
    gv, gi = lists[:2]                                                      # [N, G, K2]
    group_score = gv[..., 0] + gv[..., 1]                                   # = top 2 per group, summed
    gs_i, gs_j = group_score[..., :, None], group_score[..., None, :]
    g = jnp.arange(n_group)
    g_beats = _beats(gs_j, g[None, :], gs_i, g[:, None])                     # [N, G, G]: group j beats i
    keep = g_beats.sum(-1) < topk_group                                      # [N, G]
    gv = jnp.where(keep[..., None], gv, -jnp.inf)
    pads = (-jnp.inf, jnp.iinfo(jnp.int32).max, 0)
    lists = [gv, *lists[1:]]
    if k2 < k_out:              # groups narrower than top_k: pad each list to the output length
        lists = [jnp.pad(a, ((0, 0), (0, 0), (0, k_out - k2)), constant_values=pad) for a, pad in zip(lists, pads)]
    elif k2 > k_out:
        lists = [a[..., :k_out] for a in lists]
    operands = [a[..., r] for a in lists for r in range(k_out)]
    inits = [jnp.array(pad, a.dtype) for a, pad in zip(lists, pads) for _ in range(k_out)]
    out = jax.lax.reduce(tuple(operands), tuple(inits),
                         functools.partial(_merge_top_lists, fields=len(lists)), (1,))
    idx = jnp.stack(out[k_out:k_out + top_k], -1)
    return idx if payload is None else (idx, jnp.stack(out[2 * k_out:2 * k_out + top_k], -1))


def route(x, w_router, expert_bias, *, n_group: int, topk_group: int, top_k: int,
          norm_topk_prob: bool, routed_scaling_factor: float, expert_keep: float | None = None,
          bf16_logits: bool = False, selection: str | None = None):
    """Group-limited top-k routing (published BailingMoeV3 semantics).

    x [N, D]; w_router [D, E]; expert_bias [E]. Returns (idx [N, k] int32, weight [N, k] acc).
    logits in fp32 (x @ w_router accumulated in float32); s = sigmoid(logits); selection uses s +
    bias: group score = sum of the group's top-2 biased scores, keep `topk_group` groups, top-k
    biased scores inside them.
    Combine weights are the unbiased s of the chosen experts (normalised if norm_topk_prob),
    times routed_scaling_factor.
    Approximate modes (off by default): bf16_logits computes logits and sigmoid in bfloat16;
    expert_keep=X keeps the heaviest experts carrying X of s before normalising (`keep_top_share`).
    selection (SELECTIONS, the same result): "sort" every top-k through lax.top_k, "rank" through
    `top_k_by_rank`, "grouped-rank" `grouped_top_k_by_rank`, "grouped-merge"
    `grouped_top_k_by_merge`; None: SMALL_SELECTION for at most SORT_FREE_MAX_ROWS tokens, else "sort".
    """
    acc = acc_dtype(x.dtype)
    if selection is None:
        selection = SMALL_SELECTION if x.shape[0] <= SORT_FREE_MAX_ROWS else "sort"
    if selection not in SELECTIONS:
        raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
    if bf16_logits:
        s = jax.nn.sigmoid(jnp.dot(x.astype(jnp.bfloat16), w_router.astype(jnp.bfloat16))).astype(acc)
    else:
        s = jax.nn.sigmoid(router_logits(x, w_router, acc))
    biased = s + expert_bias.astype(acc)
    n, e = biased.shape
    if selection == "grouped-rank":
        idx = grouped_top_k_by_rank(biased, n_group, topk_group, top_k)
    elif selection == "grouped-merge":     # the chosen scores come out of its reductions with the ids
        idx, w = grouped_top_k_by_merge(biased, n_group, topk_group, top_k, payload=s)
    else:
        top = top_k_by_rank if selection == "rank" else jax.lax.top_k          # same result
        grouped = biased.reshape(n, n_group, e // n_group)
        group_score = top(grouped, 2)[0].sum(-1)                            # [N, G]
        _, keep = top(group_score, topk_group)                              # [N, topk_group]
        group_mask = jax.nn.one_hot(keep, n_group, dtype=jnp.bool_).any(axis=1)  # [N, G]
        expert_mask = jnp.repeat(group_mask, e // n_group, axis=1)
        masked = jnp.where(expert_mask, biased, -jnp.inf)
        _, idx = top(masked, top_k)
    if selection != "grouped-merge":
        w = jnp.take_along_axis(s, idx, axis=1)
    if expert_keep is not None:
        idx, w = keep_top_share(idx, w, expert_keep)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return idx.astype(jnp.int32), w * routed_scaling_factor


def keep_top_share(idx, w, keep: float):
    """Expert skipping: idx / w [N, k] (w >= 0) -> the same shapes with only the heaviest slots
    whose weights, taken in descending order (ties: lower slot first), reach `keep` of the row's
    total kept: a slot stays if the weight heavier than it is < keep * total (so the heaviest one
    always stays). Dropped slots get weight 0 and the heaviest slot's expert index.

    Sort-free: slot j's 'heavier' weight sums the slots i ordered before it (w_i > w_j, or equal
    and i < j) over a [N, k, k] comparison, which XLA fuses into its neighbours (two argsorts were
    separate sort kernels in every layer of a decode step)."""
    k = w.shape[1]
    slot = jnp.arange(k)
    wi, wj = w[:, :, None], w[:, None, :]                               # [N, i, 1], [N, 1, j]
    before_mask = (wi > wj) | ((wi == wj) & (slot[:, None] < slot[None, :]))
    before = jnp.sum(jnp.where(before_mask, wi, 0), axis=1)             # [N, j]
    kept = (before < keep * w.sum(-1, keepdims=True)) | (slot == jnp.argmax(w, axis=1)[:, None])
    top = jnp.take_along_axis(idx, jnp.argmax(w, axis=1)[:, None], axis=1)
    return jnp.where(kept, idx, top), jnp.where(kept, w, 0.0).astype(w.dtype)


def _keep_top_share_sorted(idx, w, keep: float):
    """The sort formulation of `keep_top_share` (its test oracle)."""
    order = jnp.argsort(-w, axis=1, stable=True)
    ws = jnp.take_along_axis(w, order, axis=1)
    before = jnp.cumsum(ws, axis=1) - ws
    kept_sorted = before < keep * ws.sum(-1, keepdims=True)
    kept_sorted = kept_sorted.at[:, 0].set(True)               # an all-zero row keeps its top slot
    kept = jnp.take_along_axis(kept_sorted, jnp.argsort(order, axis=1), axis=1)
    top = jnp.take_along_axis(idx, order[:, :1], axis=1)
    return jnp.where(kept, idx, top), jnp.where(kept, w, 0.0).astype(w.dtype)


def swiglu(gate, up, limit: float | None):
    """silu(gate) * up, with the optional vLLM/SGLang clamp silu(gate) <= L, up in [-L, L]."""
    act = jax.nn.silu(gate)
    if limit:
        act = jnp.minimum(act, limit)
        up = jnp.clip(up, -limit, limit)
    return act * up


def experts_gather(x, idx, weight, w_gate_up, w_down, limit=None):
    """x [N, D], idx/weight [N, k], w_gate_up [E, 2, F, D], w_down [E, D, F] -> [N, D].

    Reads only the chosen experts (per token). For small N (decode / verify).
    """
    gu = take_rows(_param_like(w_gate_up), idx)                 # [N, k, 2, F, D]
    h = jnp.einsum("nd,nkcfd->nkcf", x.astype(gu.dtype), gu)
    act = swiglu(h[:, :, 0], h[:, :, 1], limit)
    y = jnp.einsum("nkf,nkdf->nkd", act, take_rows(_param_like(w_down), idx))
    acc = acc_dtype(x.dtype)
    return jnp.einsum("nkd,nk->nd", y.astype(acc), weight.astype(acc)).astype(x.dtype)


def _expert_group_size(e: int, group: int) -> int:
    """The largest divisor of e that is <= group (experts per step of the dense pass)."""
    return max(g for g in range(1, min(group, e) + 1) if e % g == 0)


def experts_capacity(x, idx, weight, w_gate_up, w_down, limit=None, *, block: int = 64, group: int = 16):
    """Same function as `experts_gather` for large N (prefill), reading each expert's weights once.

    x [N, D], idx / weight [N, k], w_gate_up [E, 2, F, D], w_down [E, D, F] -> [N, D].
    Each expert's first `cap` assignments (cap = the mean load N k / E rounded up to `block` rows)
    take slots [E, cap], run by a scan over groups of `group` consecutive experts: one contiguous
    weight slice per step (no gather), dequantised and multiplied as one batched GEMM pair, padding
    slots included. Assignments past an expert's cap go to overflow blocks of `block` rows (one
    expert each), run by a while_loop over the used blocks only (none while every expert's load is
    <= cap). Each token then sums its k expert outputs in slot order, in the accumulation dtype.
    The expert outputs are rounded to the weights' compute dtype first, as in the other paths.
    Why: the former prefill path (one expert per 64-row block, scanned: ~10 small kernels per
    block, ~770 blocks per 2048-token chunk) took ~12 ms per layer and chunk on the H200, the bulk
    of the TTFT (session 13, docs/PERFORMANCE.md).
    """
    if block < 1 or group < 1:
        raise ValueError(f"block ({block}) and group ({group}) must be >= 1")
    n, k = idx.shape
    w_gate_up, w_down = _param_like(w_gate_up), _param_like(w_down)
    e = w_gate_up.shape[0]
    a = n * k
    cap = block * max(1, -(-a // (e * block)))
    g = _expert_group_size(e, group)
    flat_e = idx.reshape(-1).astype(jnp.int32)
    tok = jnp.arange(a, dtype=jnp.int32) // k
    order = jnp.argsort(flat_e, stable=True)
    counts = jnp.bincount(flat_e, length=e).astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts
    rank = jnp.zeros((a,), jnp.int32).at[order].set(jnp.arange(a, dtype=jnp.int32) - starts[flat_e[order]])
    in_main = rank < cap

    def ffn(xb, gu, dn):
        """xb [..., T, D], gu [..., 2, F, D], dn [..., D, F] -> [..., T, D] in the weights' dtype."""
        h = jnp.einsum("...td,...cfd->...tcf", xb.astype(gu.dtype), gu)
        return jnp.einsum("...tf,...df->...td", swiglu(h[..., 0, :], h[..., 1, :], limit), dn)

    # dense pass: slot (expert, rank < cap) -> token (padding slots read token 0, never used)
    main_slot = flat_e * cap + rank
    slot_tok = jnp.zeros((e * cap,), jnp.int32).at[jnp.where(in_main, main_slot, e * cap)].set(tok, mode="drop")
    slot_tok = slot_tok.reshape(e // g, g, cap)

    def group_step(_, s):
        xb = x[slot_tok[s]]                                                  # [g, cap, D]
        return None, ffn(xb, slice_rows(w_gate_up, s * g, g), slice_rows(w_down, s * g, g))

    _, y_main = jax.lax.scan(group_step, None, jnp.arange(e // g))          # [E / g, g, cap, D]
    y_main = y_main.reshape(e * cap, -1)

    # overflow pass: the rest, packed by expert into blocks of `block` rows. At most floor(a / block)
    # blocks: m overflowing experts need <= (sum of overflows + m (block - 1)) / block blocks, and
    # their overflows sum to <= a - m cap with cap >= block.
    over = jnp.maximum(counts - cap, 0)
    ocount = (over + block - 1) // block * block
    ostart = jnp.cumsum(ocount) - ocount
    o_slot = ostart[flat_e] + rank - cap                                     # valid where ~in_main
    n_oblocks = max(1, a // block)
    o_tok = jnp.zeros((n_oblocks * block,), jnp.int32).at[
        jnp.where(in_main, n_oblocks * block, o_slot)].set(tok, mode="drop")
    o_expert = jnp.searchsorted(jnp.cumsum(ocount), jnp.arange(n_oblocks) * block, side="right")
    used = ocount.sum() // block
    y_over = jnp.zeros((n_oblocks * block, x.shape[-1]), y_main.dtype)

    def over_step(carry):
        b, y = carry
        ex = jnp.minimum(o_expert[b], e - 1)
        xb = x[jax.lax.dynamic_slice_in_dim(o_tok, b * block, block)]
        yb = ffn(xb, take_rows(w_gate_up, ex), take_rows(w_down, ex))
        return b + 1, jax.lax.dynamic_update_slice_in_dim(y, yb.astype(y.dtype), b * block, axis=0)

    _, y_over = jax.lax.while_loop(lambda c: c[0] < used, over_step, (jnp.int32(0), y_over))

    # combine: out[t] = sum_j weight[t, j] y[slot of (t, j)], j in order
    acc = acc_dtype(x.dtype)
    ym = y_main[jnp.where(in_main, main_slot, 0)]
    yo = y_over[jnp.where(in_main, 0, jnp.clip(o_slot, 0, n_oblocks * block - 1))]
    y = jnp.where(in_main[:, None], ym, yo).reshape(n, k, -1).astype(acc)
    return jnp.einsum("nkd,nk->nd", y, weight.astype(acc)).astype(x.dtype)


def experts_dense(x, idx, weight, w_gate_up, w_down, limit=None):
    """Test oracle: run every expert on every token, combine with a dense [N, E] weight matrix."""
    w_gate_up, w_down = _param_like(w_gate_up)[...], _param_like(w_down)[...]
    e = w_gate_up.shape[0]
    acc = acc_dtype(x.dtype)
    combine = jnp.zeros((x.shape[0], e), acc).at[jnp.arange(x.shape[0])[:, None], idx].add(weight.astype(acc))
    h = jnp.einsum("nd,ecfd->necf", x.astype(w_gate_up.dtype), w_gate_up)
    y = jnp.einsum("nef,edf->ned", swiglu(h[:, :, 0], h[:, :, 1], limit), w_down)
    return jnp.einsum("ned,ne->nd", y.astype(acc), combine).astype(x.dtype)
