"""MoE ops (lingjax/ops/moe.py): the group-limited sigmoid router against a numpy reference written
from spec/ling3.md's router semantics, and the three routed-expert paths against each other and a
numpy loop.

Router semantics (spec/ling3.md, "MoE router"): s = sigmoid(x W); selection on s + bias: groups of
E / n_group experts, group score = sum of the group's top-2 biased scores, keep the best topk_group
groups, top-k biased scores inside them; weights = unbiased s of the chosen experts, divided by
their sum (+1e-20) when norm_topk_prob, times routed_scaling_factor.
Tie rule (lingjax's, documented in ops/moe.py): equal scores -> the lower index wins, both for
groups and for experts, and the returned experts are ordered by decreasing biased score.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

from helpers import rel, tiny_config
from lingjax.model import mlp as mlp_mod
from lingjax.ops import moe as moe_ops
from lingjax.ops.moe import experts_capacity, experts_dense, experts_gather, route, swiglu, top_k_by_rank

F64 = jnp.float64


# ---- numpy references ---------------------------------------------------------------------------
def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def route_numpy(x, w, bias, *, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor):
    x, w, bias = (np.asarray(a, np.float64) for a in (x, w, bias))
    s = _sigmoid(x @ w)
    biased = s + bias
    n, e = biased.shape
    per = e // n_group
    idx = np.zeros((n, top_k), np.int64)
    wt = np.zeros((n, top_k))
    for t in range(n):
        groups = biased[t].reshape(n_group, per)
        gscore = [float(np.sort(g)[-1] + np.sort(g)[-2]) for g in groups]
        kept = sorted(range(n_group), key=lambda g: (-gscore[g], g))[:topk_group]   # ties: lower group
        cand = [ex for ex in range(e) if ex // per in kept]
        chosen = sorted(cand, key=lambda ex: (-biased[t, ex], ex))[:top_k]           # ties: lower expert
        ww = s[t, chosen]
        if norm_topk_prob:
            ww = ww / (ww.sum() + 1e-20)
        idx[t], wt[t] = chosen, ww * routed_scaling_factor
    return idx, wt


route_jit = jax.jit(route, static_argnames=("n_group", "topk_group", "top_k", "norm_topk_prob",
                                            "routed_scaling_factor"))


def _route(x, w, bias, **kw):
    idx, wt = route_jit(jnp.asarray(x, F64), jnp.asarray(w, F64), jnp.asarray(bias, F64), **kw)
    return np.asarray(idx), np.asarray(wt)


def _check_route(x, w, bias, **kw):
    idx, wt = _route(x, w, bias, **kw)
    ridx, rwt = route_numpy(x, w, bias, **kw)
    np.testing.assert_array_equal(idx, ridx)
    np.testing.assert_allclose(wt, rwt, rtol=1e-13, atol=0)
    return idx, wt


# ---- route: random configurations ----------------------------------------------------------------
@settings(max_examples=12, deadline=None, derandomize=True, database=None)
@given(data=st.data(), n_group=st.sampled_from([1, 2, 4, 8]), per=st.sampled_from([2, 3, 4, 8]),
       n=st.integers(1, 12), seed=st.integers(0, 2 ** 16), norm=st.booleans())
def test_route_matches_numpy_reference(data, n_group, per, n, seed, norm):
    topk_group = data.draw(st.integers(1, n_group))
    top_k = data.draw(st.integers(1, topk_group * per))
    e, d = n_group * per, 8
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d))
    w = rng.standard_normal((d, e))
    bias = rng.normal(0, 0.3, e)
    kw = dict(n_group=n_group, topk_group=topk_group, top_k=top_k, norm_topk_prob=norm,
              routed_scaling_factor=2.5)
    idx, wt = _check_route(x, w, bias, **kw)
    assert idx.dtype == np.int32
    assert all(len(set(row)) == top_k for row in idx)                    # no expert twice
    kept_groups = {len(set(row // per)) for row in idx}
    assert max(kept_groups) <= topk_group


# ---- top_k_by_rank: lax.top_k without a sort --------------------------------------------------------
@pytest.mark.parametrize("n,k", [(512, 8), (64, 2), (8, 4), (5, 5), (1, 1)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_top_k_by_rank_is_lax_top_k(n, k, dtype):
    """Same values and indices as lax.top_k, ties to the lower index: coarse values (many ties),
    -inf entries (a router's masked groups), rows of one value."""
    rng = np.random.default_rng(n * 31 + k)
    x = np.round(rng.standard_normal((9, 3, n)) * 2) / 2                  # heavy ties
    x[0, 0, : n // 2] = -np.inf
    x[1, 1] = 0.25                                                          # one value everywhere
    x = jnp.asarray(x, dtype)
    got_v, got_i = top_k_by_rank(x, k)
    want_v, want_i = jax.lax.top_k(x, k)
    assert got_i.dtype == jnp.int32 and got_v.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(got_v, np.float32), np.asarray(want_v, np.float32))


@pytest.mark.parametrize("selection", ["rank", "grouped-rank", "grouped-merge"])
@pytest.mark.parametrize("coarse", [False, True])
def test_sort_free_routing_is_the_sorted_routing(selection, coarse):
    """route(selection="rank" / "grouped-rank" / "grouped-merge") and route(selection="sort"): the same experts in the
    same order and the same weights for the same tokens (Ling-3.0-flash router shape, spread bias;
    coarse: scores on a 1/8 grid, so that ties inside and across groups decide); the default
    follows SORT_FREE_MAX_ROWS."""
    rng = np.random.default_rng(7 + coarse)
    e, d = 512, 64
    x = jnp.asarray(rng.standard_normal((20, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((d, e)) * d ** -0.5, jnp.float32)
    bias = jnp.asarray(np.round(rng.standard_normal(e), 1), jnp.float32)   # coarse: ties in the bias
    if coarse:          # x @ w = 0: s = 0.5 everywhere, the selection by a bias with many exact ties
        x, bias = jnp.zeros_like(x), jnp.asarray(np.round(rng.standard_normal(e) * 4) / 8, jnp.float32)
    kw = dict(n_group=8, topk_group=4, top_k=8, norm_topk_prob=True, routed_scaling_factor=2.5)
    big_idx, big_w = route(x, w, bias, selection="sort", **kw)                 # lax.top_k
    small_idx, small_w = route(x[:16], w, bias, selection=selection, **kw)
    np.testing.assert_array_equal(np.asarray(small_idx), np.asarray(big_idx[:16]))
    np.testing.assert_array_equal(np.asarray(small_w), np.asarray(big_w[:16]))
    default_idx, _ = route(x, w, bias, **kw)
    np.testing.assert_array_equal(np.asarray(default_idx), np.asarray(big_idx))
    assert moe_ops.SORT_FREE_MAX_ROWS < 20                                  # 20 rows: lax.top_k by default


@pytest.mark.parametrize("e,n_group,topk_group,top_k", [(16, 4, 2, 4), (16, 4, 2, 6), (64, 8, 3, 8),
                                                        (32, 4, 1, 8), (24, 8, 8, 16), (32, 4, 2, 1),
                                                        (48, 4, 3, 5)])
@pytest.mark.parametrize("select", [moe_ops.grouped_top_k_by_rank, moe_ops.grouped_top_k_by_merge])
def test_grouped_selection_is_the_masked_top_k(e, n_group, topk_group, top_k, select):
    """grouped_top_k_by_rank / _by_merge against the top_k over every kept group's experts, on scores
    with heavy ties, signed zeros and groups with fewer experts than top_k (kk = E/G < top_k)."""
    rng = np.random.default_rng(e + 7 * top_k)
    b = np.round(rng.standard_normal((32, e)) * 2) / 4
    b[0] = 0.0
    b[1, ::2] = -0.0
    b = jnp.asarray(b, jnp.float32)
    n, per = b.shape[0], e // n_group
    group_score = jax.lax.top_k(b.reshape(n, n_group, per), 2)[0].sum(-1)
    keep = jax.lax.top_k(group_score, topk_group)[1]
    mask = jnp.repeat(jax.nn.one_hot(keep, n_group, dtype=jnp.bool_).any(1), per, axis=1)
    want = jax.lax.top_k(jnp.where(mask, b, -jnp.inf), top_k)[1]
    got = select(b, n_group, topk_group, top_k)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    if select is moe_ops.grouped_top_k_by_merge:      # a payload rides through the reductions with its entry
        pay = jnp.asarray(rng.standard_normal((32, e)), jnp.float32)
        got, vals = select(b, n_group, topk_group, top_k, payload=pay)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(vals), np.asarray(jnp.take_along_axis(pay, want, axis=1)))


def test_route_rejects_an_unknown_selection():
    x, w = np.ones((2, 4)), np.zeros((4, 16))
    with pytest.raises(ValueError, match="selection must be one of"):
        route(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), jnp.zeros((16,)), top_k=2,
              selection="heap", **KW)


# ---- route: crafted edge cases ------------------------------------------------------------------
KW = dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)   # E = 16, 4 / group


def _zero_logits(n=3, e=16, d=4):
    """x W == 0 exactly: s = 0.5 for every expert, selection decided by the bias alone."""
    return np.ones((n, d)), np.zeros((d, e))


def test_route_exact_ties_lower_index_wins():
    x, w = _zero_logits()
    # everything tied: groups 0, 1 kept, experts 0..k-1 chosen in index order
    for k in (1, 3, 4, 8):
        idx, wt = _check_route(x, w, np.zeros(16), top_k=k, **KW)
        np.testing.assert_array_equal(idx, np.tile(np.arange(k), (3, 1)))
        np.testing.assert_allclose(wt, 2.5 / k, rtol=1e-15)
    # experts tied inside the best group: the lower index comes first
    bias = np.zeros(16)
    bias[[13, 9, 14]] = 0.25                   # group 3 has 13 and 14 tied, group 2 has 9
    bias[[10]] = 0.125                         # group 2's top-2 sum 0.375 < group 3's 0.5
    idx, _ = _check_route(x, w, bias, top_k=4, **KW)
    np.testing.assert_array_equal(idx[0], [9, 13, 14, 10])   # 0.25 x3 by index, then 0.125
    # groups tied on score: lower group index kept
    bias = np.zeros(16)
    bias[[1, 2, 5, 6, 9, 10]] = 0.5           # groups 0, 1, 2 tie at 1.0; group 3 at 0
    idx, _ = _check_route(x, w, bias, top_k=6, **KW)
    assert set(idx[0]) <= set(range(8))        # groups 0 and 1 only
    np.testing.assert_array_equal(idx[0][:4], [1, 2, 5, 6])


def test_route_all_top_experts_in_one_group():
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((5, 6)), rng.standard_normal((6, 16))
    bias = np.zeros(16)
    bias[8:12] = 1.0                            # group 2 dominates every token
    for k in (1, 3, 4):
        idx, _ = _check_route(x, w, bias, top_k=k, **KW)
        assert np.all(idx // 4 == 2)


def test_route_topk_spans_groups_and_group_limit_excludes_best_single_expert():
    x, w = _zero_logits(n=1)
    bias = np.zeros(16)
    bias[0] = 0.9                               # best single expert, but its group's top-2 = 0.9
    bias[[5, 6, 7]] = 0.46                      # group 1: top-2 sum 0.92
    bias[[12, 13, 14, 15]] = 0.455              # group 3: top-2 sum 0.91
    idx, _ = _check_route(x, w, bias, top_k=6, **KW)
    assert 0 not in idx[0]                      # group 0 is not kept although expert 0 is the best
    np.testing.assert_array_equal(idx[0], [5, 6, 7, 12, 13, 14])
    assert set(idx[0] // 4) == {1, 3}           # k = 6 > 4 experts per group: two groups needed
    # k = every expert of the kept groups
    idx, _ = _check_route(x, w, bias, top_k=8, **KW)
    assert sorted(idx[0]) == [4, 5, 6, 7, 12, 13, 14, 15]
    # with all groups kept, plain top-k: expert 0 comes back first
    idx, _ = _check_route(x, w, bias, top_k=6, **{**KW, "topk_group": 4})
    assert idx[0, 0] == 0


@pytest.mark.parametrize("norm", [True, False])
def test_route_norm_topk_prob(norm):
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((7, 6)), rng.standard_normal((6, 16))
    bias = rng.normal(0, 0.2, 16)
    kw = {**KW, "norm_topk_prob": norm, "routed_scaling_factor": 1.75}
    idx, wt = _check_route(x, w, bias, top_k=5, **kw)
    s = _sigmoid(x @ w)
    chosen = np.take_along_axis(s, idx, 1)
    if norm:
        np.testing.assert_allclose(wt.sum(-1), 1.75, rtol=1e-14)
        np.testing.assert_allclose(wt, 1.75 * chosen / chosen.sum(-1, keepdims=True), rtol=1e-14)
    else:
        np.testing.assert_allclose(wt, 1.75 * chosen, rtol=1e-14)


def test_route_bias_changes_selection_not_weights():
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((16, 6)), rng.standard_normal((6, 16))
    kw = {**KW, "norm_topk_prob": False, "routed_scaling_factor": 1.0}
    idx0, wt0 = _check_route(x, w, np.zeros(16), top_k=4, **kw)
    bias = np.linspace(-0.08, 0.08, 16)
    idx1, wt1 = _check_route(x, w, bias, top_k=4, **kw)
    changed = [set(a) != set(b) for a, b in zip(idx0, idx1)]
    assert any(changed) and not all(changed)     # the bias moved some selections, not all
    s = _sigmoid(x @ w)
    # weights are the *unbiased* scores of whatever was chosen
    np.testing.assert_allclose(wt1, np.take_along_axis(s, idx1, 1), rtol=1e-14)
    np.testing.assert_allclose(wt0, np.take_along_axis(s, idx0, 1), rtol=1e-14)
    # where a token's selection did not change, neither did its weights (bias leaves them alone)
    for t in np.flatnonzero(~np.asarray(changed)):
        o0, o1 = np.argsort(idx0[t]), np.argsort(idx1[t])
        np.testing.assert_array_equal(wt0[t][o0], wt1[t][o1])


def test_route_low_precision_inputs_route_in_fp32():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((4, 8)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((8, 16)), jnp.bfloat16)
    idx, wt = route(x, w, jnp.zeros(16, jnp.float32), top_k=4, **KW)
    assert wt.dtype == jnp.float32 and idx.dtype == jnp.int32
    ridx, rwt = route_numpy(np.asarray(x, np.float64), np.asarray(w, np.float64), np.zeros(16), top_k=4, **KW)
    np.testing.assert_array_equal(np.asarray(idx), ridx)
    np.testing.assert_allclose(np.asarray(wt), rwt, rtol=1e-5)


# ---- SwiGLU clamp --------------------------------------------------------------------------------
def test_swiglu_clamp():
    g = np.linspace(-8, 8, 33)
    u = np.linspace(-6, 6, 33)[::-1].copy()
    silu = g * _sigmoid(g)
    ref_off = silu * u
    for lim in (None, 0.0):
        np.testing.assert_allclose(swiglu(jnp.asarray(g), jnp.asarray(u), lim), ref_off, rtol=1e-14)
    lim = 1.5
    ref = np.minimum(silu, lim) * np.clip(u, -lim, lim)     # silu clamped above only; up both ways
    out = np.asarray(swiglu(jnp.asarray(g), jnp.asarray(u), lim))
    np.testing.assert_allclose(out, ref, rtol=1e-14)
    assert not np.allclose(out, ref_off)


# ---- routed experts ------------------------------------------------------------------------------
def experts_numpy(x, idx, wt, w_gate_up, w_down, limit):
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            h = np.einsum("d,cfd->cf", x[t], w_gate_up[e])    # [2, F]
            act = h[0] * _sigmoid(h[0])
            up = h[1]
            if limit:
                act, up = np.minimum(act, limit), np.clip(up, -limit, limit)
            out[t] += wt[t, j] * (w_down[e] @ (act * up))
    return out


def _expert_weights(rng, e, d, f, scale=1.0):
    """w_gate_up [E, 2, F, D], w_down [E, D, F] (K-minor, as the model stores them)."""
    return (rng.standard_normal((e, 2, f, d)) * scale * d ** -0.5, rng.standard_normal((e, d, f)) * f ** -0.5)


def _distinct_idx(rng, n, e, k):
    return np.argsort(rng.random((n, e)), axis=1)[:, :k]


gather_jit = jax.jit(experts_gather, static_argnames=("limit",))
capacity_jit = jax.jit(experts_capacity, static_argnames=("limit", "block", "group"))
dense_jit = jax.jit(experts_dense, static_argnames=("limit",))


def _idx_cases(rng, n, e, k):
    rand = _distinct_idx(rng, n, e, k)                       # E small: many tokens share experts
    same_all = np.tile(np.array([5, 2, 7])[:k], (n, 1))      # every token chooses the same experts
    others = np.array([i for i in range(e) if i != 3])
    shared_first = np.concatenate(                            # expert 3 in every token's set
        [np.full((n, 1), 3), others[_distinct_idx(rng, n, e - 1, k - 1)]], axis=1)
    one_hot = np.tile(np.array([0, 1, 2])[:k], (n, 1))
    one_hot[: n // 2] = [4, 6, 1][:k]                         # two populations, one expert unused
    return {"random": rand, "all_same": same_all, "one_shared": shared_first, "two_sets": one_hot}


@pytest.mark.parametrize("n,limit", [(1, None), (37, None), (37, 0.4)])
def test_experts_paths_agree(n, limit):
    rng = np.random.default_rng(n)
    e, d, f, k = 8, 12, 10, 3
    x = rng.standard_normal((n, d)) * 2.0
    w_gu, w_dn = _expert_weights(rng, e, d, f, scale=2.0)
    for case, idx in _idx_cases(rng, n, e, k).items():
        assert all(len(set(r)) == k for r in idx), case
        wt = rng.uniform(0.1, 1.0, (n, k))
        args = tuple(jnp.asarray(a) for a in (x, idx.astype(np.int32), wt, w_gu, w_dn))
        ref = experts_numpy(x, idx, wt, w_gu, w_dn, limit)
        dense = np.asarray(dense_jit(*args, limit=limit))
        np.testing.assert_allclose(dense, ref, rtol=1e-12, atol=1e-12, err_msg=case)
        gathered = np.asarray(gather_jit(*args, limit=limit))
        np.testing.assert_allclose(gathered, ref, rtol=1e-12, atol=1e-12, err_msg=case)
        for block in (1, 4, 64):
            for group in (1, 3, 16):          # 3: the largest divisor of E = 8 below it, 2
                got = np.asarray(capacity_jit(*args, limit=limit, block=block, group=group))
                np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12,
                                           err_msg=f"capacity {case} block={block} group={group}")


def test_experts_swiglu_limit_is_active():
    """The clamp case above must actually clamp: with large activations the limit changes the result."""
    rng = np.random.default_rng(9)
    n, e, d, f, k = 9, 8, 12, 10, 3
    x = rng.standard_normal((n, d)) * 2.0
    w_gu, w_dn = _expert_weights(rng, e, d, f, scale=2.0)
    idx = _distinct_idx(rng, n, e, k).astype(np.int32)
    wt = rng.uniform(0.1, 1.0, (n, k))
    args = tuple(jnp.asarray(a) for a in (x, idx, wt, w_gu, w_dn))
    off = np.asarray(gather_jit(*args, limit=None))
    on = np.asarray(capacity_jit(*args, limit=0.4, block=4))
    assert rel(on, off) > 0.1
    np.testing.assert_allclose(on, experts_numpy(x, idx, wt, w_gu, w_dn, 0.4), rtol=1e-12, atol=1e-12)


def test_capacity_exact_block_multiples_and_float32():
    """Counts that fill blocks exactly (no padding rows), and float32 agreement with the oracle."""
    rng = np.random.default_rng(11)
    n, e, d, f, k = 16, 4, 8, 6, 2
    idx = np.tile(np.array([[1, 3]]), (n, 1)).astype(np.int32)     # 16 rows per used expert
    x = rng.standard_normal((n, d))
    w_gu, w_dn = _expert_weights(rng, e, d, f)
    wt = rng.uniform(0.1, 1.0, (n, k))
    ref = experts_numpy(x, idx, wt, w_gu, w_dn, None)
    for block in (4, 16):
        args = tuple(jnp.asarray(a) for a in (x, idx, wt, w_gu, w_dn))
        np.testing.assert_allclose(np.asarray(capacity_jit(*args, block=block)), ref, rtol=1e-12, atol=1e-12)
    args32 = tuple(jnp.asarray(a, jnp.float32) for a in (x, wt, w_gu, w_dn))
    args32 = (args32[0], jnp.asarray(idx), *args32[1:])
    for fn in (gather_jit, lambda *a: capacity_jit(*a, block=4), dense_jit):
        out = fn(*args32)
        assert out.dtype == jnp.float32
        assert rel(out, ref) <= 1e-5


def test_moe_layer_gather_and_capacity_paths_agree(monkeypatch):
    """The MoE module's two dispatch paths (forced via MOE_GATHER_MAX_TOKENS) give one function."""
    cfg = tiny_config(expert_swiglu_limit_list=(0.0, 0.0, 0.8), share_expert_swiglu_limit_list=(0.0, 0.0, 0.6))
    layer = mlp_mod.MoE(cfg, 2, dtype=F64, rngs=nnx.Rngs(0))
    assert layer.limit == 0.8 and layer.shared.swiglu_limit == 0.6
    layer.expert_bias.set_value(jnp.asarray(np.random.default_rng(0).normal(0, 0.05, cfg.num_experts)))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 13, cfg.hidden_size)))
    res = []
    for limit in (10 ** 9, 0):
        monkeypatch.setattr(mlp_mod, "MOE_GATHER_MAX_TOKENS", limit)
        res.append(np.asarray(jax.jit(lambda x: layer(x))(x)))
    assert rel(res[0], res[1]) <= 1e-12


def test_capacity_overflow_paths():
    """experts_capacity with loads far over the cap (overflow blocks, some partial), loads of exactly
    the cap, unused experts, and fp8 weights (its contiguous slices vs take_rows' gathers)."""
    from lingjax.param_layout import Matrix
    from lingjax.quant import Fp8Weight, quantize
    rng = np.random.default_rng(5)
    e, d, f, k = 8, 16, 8, 2
    w_gu, w_dn = _expert_weights(rng, e, d, f)
    cases = {
        "hot": (40, np.stack([[0, 1 + i % 7] for i in range(40)])),    # 40 on expert 0 (cap 12 / 16)
        "at_cap": (32, np.stack([[2 * (i % 4), 2 * (i % 4) + 1] for i in range(32)])),   # 8 each, cap 8
        "one_pair": (50, np.tile([[3, 6]], (50, 1))),                            # two experts, 50 each
    }
    for name, (n, idx) in cases.items():
        x = rng.standard_normal((n, d))
        wt = rng.uniform(0.1, 1.0, (n, k))
        args = tuple(jnp.asarray(v) for v in (x, idx.astype(np.int32), wt, w_gu, w_dn))
        ref = experts_numpy(x, idx, wt, w_gu, w_dn, None)
        for block in (4, 8):
            got = np.asarray(capacity_jit(*args, block=block, group=4))
            np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12, err_msg=f"{name} block={block}")
    # fp8: the same dequantised weights through the gather path and the capacity path
    n, idx = cases["hot"]
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    wt = jnp.asarray(rng.uniform(0.1, 1.0, (n, k)), jnp.float32)
    views = (Matrix((0, 1), (3,), (2,)), Matrix((0,), (2,), (1,)))     # the published expert layouts
    fws = []
    for w, view in zip((w_gu, w_dn), views):
        v, s = quantize(jnp.asarray(w, jnp.float32), view, block=(8, 8))
        fws.append(Fp8Weight(v, s, view=view, block=(8, 8), dtype=jnp.float32,
                             logical=(None,) * w.ndim))
    gathered = experts_gather(x, jnp.asarray(idx, jnp.int32), wt, *fws)
    got = experts_capacity(x, jnp.asarray(idx, jnp.int32), wt, *fws, block=4, group=4)
    np.testing.assert_allclose(np.asarray(got), np.asarray(gathered), rtol=1e-5, atol=1e-5)
    for bad in (dict(block=0), dict(group=0)):
        with pytest.raises(ValueError, match="must be >= 1"):
            experts_capacity(x, jnp.asarray(idx, jnp.int32), wt, *fws, **bad)
