"""Sampling knobs, logit filtering and the speculative acceptance rules (lingjax/sampling.py), and
losslessness of speculative sampling end to end through the Decoder.

Losslessness is tested by frequencies: many independent trials (vectorised with jax.vmap over PRNG
keys, fixed seeds, so every test is deterministic) against the exact target distribution, with a
chi-square goodness-of-fit test at p = 1e-3. A deliberately broken acceptance rule is run through
the same test to show it has the power to catch a non-lossless sampler.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import random_model, tiny_config
from lingjax.cache import init_cache
from lingjax.dspark_config import DSparkConfig
from lingjax.model.dspark import DSparkDraft
from lingjax.sampling import (SamplingArrays, SamplingParams, accept_greedy, accept_sample, filter_logits,
                              sample_token)
from lingjax.spec_decode import Decoder, SpecConfig

ALPHA = 1e-3


# ---- chi-square ----------------------------------------------------------------------------------
def wilson_hilferty(dof: int) -> float:
    """Upper 1e-3 quantile of chi-square(dof), Wilson-Hilferty approximation:
    dof * (1 - 2/(9 dof) + z sqrt(2/(9 dof)))^3 with z = 3.0902, the standard-normal 1 - 1e-3
    quantile. For dof >= 5 it is within 1.2% of the exact value and errs high (dof 5: 20.75 vs
    20.52; dof 35: 66.71 vs 66.62), i.e. slightly conservative."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + 3.0902 * math.sqrt(c)) ** 3


def chi2_critical(dof: int, alpha: float = ALPHA) -> float:
    """Upper alpha-quantile of chi-square(dof): scipy's when installed (it is not a dependency),
    otherwise the Wilson-Hilferty approximation."""
    try:
        from scipy.stats import chi2
    except ImportError:
        assert alpha == 1e-3 and dof >= 5
        return wilson_hilferty(dof)
    return float(chi2.isf(alpha, dof))


def chi_square(samples, probs, what: str):
    """Goodness of fit of integer samples (cell ids) to probs; cells expected < 5 are pooled.
    Returns the statistic; fails the test above the p = ALPHA critical value."""
    probs = np.asarray(probs, np.float64).ravel()
    assert abs(probs.sum() - 1) < 1e-9
    n = len(samples)
    counts = np.bincount(np.asarray(samples).ravel(), minlength=len(probs)).astype(np.float64)
    assert len(counts) == len(probs), f"{what}: sample outside the support"
    exp = probs * n
    small = exp < 5
    assert counts[exp == 0].sum() == 0, f"{what}: sampled a token of probability 0"
    obs_c = np.append(counts[~small], counts[small].sum())
    exp_c = np.append(exp[~small], exp[small].sum())
    keep = exp_c > 0
    obs_c, exp_c = obs_c[keep], exp_c[keep]
    if exp_c[-1] < 5 and len(exp_c) > 1:       # a tiny pooled cell: fold it into the largest one
        big = int(np.argmax(exp_c[:-1]))
        obs_c[big] += obs_c[-1]
        exp_c[big] += exp_c[-1]
        obs_c, exp_c = obs_c[:-1], exp_c[:-1]
    stat = float(((obs_c - exp_c) ** 2 / exp_c).sum())
    dof = len(exp_c) - 1
    crit = chi2_critical(dof)
    assert stat <= crit, f"{what}: chi-square {stat:.1f} > {crit:.1f} (dof {dof}, p < {ALPHA}): not lossless"
    return stat


def chi2_ok(samples, probs) -> bool:
    try:
        chi_square(samples, probs, "")
        return True
    except AssertionError:
        return False


def test_chi2_critical_values():
    # reference values of the chi-square 1 - 1e-3 quantile (tables); approximation within 1.5%
    for dof, exact in [(5, 20.515), (35, 66.619), (100, 149.449)]:
        assert abs(chi2_critical(dof) - exact) / exact < 0.015
        assert 0 <= (wilson_hilferty(dof) - exact) / exact < 0.015


# ---- SamplingParams ----------------------------------------------------------------------------
def test_sampling_params_validation():
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy
    for bad in (dict(temperature=-1.0), dict(temperature=float("nan")), dict(top_p=0.0), dict(top_p=1.5),
                dict(top_k=-1)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    arr = SamplingArrays.from_params(SamplingParams(temperature=0.0, top_p=0.5, top_k=3))
    assert float(arr.temperature) > 0 and float(arr.top_p) == 0.5 and int(arr.top_k) == 3


# ---- filter_logits -----------------------------------------------------------------------------
def _kept(x):
    return np.isfinite(np.asarray(x))


def test_filter_top_k():
    x = jnp.asarray([0.5, 3.0, -1.0, 2.0, 1.0])
    np.testing.assert_array_equal(_kept(filter_logits(x, top_k=1)), [0, 1, 0, 0, 0])
    np.testing.assert_array_equal(_kept(filter_logits(x, top_k=3)), [0, 1, 0, 1, 1])
    assert _kept(filter_logits(x, top_k=0)).all()        # 0 = off
    assert _kept(filter_logits(x, top_k=5)).all()
    assert _kept(filter_logits(x, top_k=99)).all()       # larger than the vocabulary
    kept = filter_logits(x, top_k=3)
    np.testing.assert_array_equal(np.asarray(kept)[_kept(kept)], [3.0, 2.0, 1.0])   # values unchanged
    # per row of a batch
    xb = jnp.asarray([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    np.testing.assert_array_equal(_kept(filter_logits(xb, top_k=2)), [[0, 1, 1], [1, 1, 0]])


def test_filter_top_p():
    p = np.asarray([0.5, 0.3, 0.15, 0.05])
    x = jnp.log(jnp.asarray(p))[jnp.asarray([2, 0, 3, 1])]           # shuffled: [0.15, 0.5, 0.05, 0.3]
    np.testing.assert_array_equal(_kept(filter_logits(x, top_p=0.4)), [0, 1, 0, 0])
    np.testing.assert_array_equal(_kept(filter_logits(x, top_p=0.5)), [0, 1, 0, 0])   # 0.5 reached
    np.testing.assert_array_equal(_kept(filter_logits(x, top_p=0.51)), [0, 1, 0, 1])
    np.testing.assert_array_equal(_kept(filter_logits(x, top_p=0.9)), [1, 1, 0, 1])
    assert _kept(filter_logits(x, top_p=1.0)).all()
    np.testing.assert_array_equal(_kept(filter_logits(x, top_p=1e-9)), [0, 1, 0, 0])  # always the top one
    # top-k first, then top-p over the renormalised survivors: top-2 = {0.5, 0.3} -> 0.625, 0.375
    np.testing.assert_array_equal(_kept(filter_logits(x, top_k=2, top_p=0.6)), [0, 1, 0, 0])
    np.testing.assert_array_equal(_kept(filter_logits(x, top_k=2, top_p=0.7)), [0, 1, 0, 1])


def test_filter_ties_are_kept():
    x = jnp.asarray([2.0, 1.0, 2.0, 0.0, 1.0])
    np.testing.assert_array_equal(_kept(filter_logits(x, top_k=1)), [1, 0, 1, 0, 0])
    np.testing.assert_array_equal(_kept(filter_logits(x, top_k=3)), [1, 1, 1, 0, 1])
    # top-p: the two tied maxima carry 2e^2/(2e^2+2e+1) ~ 0.66 > 0.5, but the threshold token's tie
    # partner is kept as well
    np.testing.assert_array_equal(_kept(filter_logits(x, top_p=0.3)), [1, 0, 1, 0, 0])
    np.testing.assert_array_equal(_kept(filter_logits(x, top_p=0.7)), [1, 1, 1, 0, 1])
    z = jnp.zeros(4)                                                  # all tied: nothing removed
    assert _kept(filter_logits(z, top_k=1, top_p=0.1)).all()


def test_filter_traced_top_k_and_top_p():
    traces = []

    @jax.jit
    def f(x, k, p):
        traces.append(1)
        return filter_logits(x, k, p)

    x = jnp.asarray([0.5, 3.0, -1.0, 2.0, 1.0])
    for k, want in [(1, [0, 1, 0, 0, 0]), (2, [0, 1, 0, 1, 0]), (4, [1, 1, 0, 1, 1]), (0, [1, 1, 1, 1, 1])]:
        np.testing.assert_array_equal(_kept(f(x, jnp.int32(k), jnp.float32(1.0))), want, err_msg=f"k={k}")
    np.testing.assert_array_equal(_kept(f(x, jnp.int32(0), jnp.float32(1e-6))), [0, 1, 0, 0, 0])
    assert len(traces) == 1, "top_k / top_p values must not retrace"
    # a batch of rows with one traced k
    xb = jnp.stack([x, -x])
    np.testing.assert_array_equal(_kept(f(xb, jnp.int32(2), jnp.float32(1.0))), [[0, 1, 0, 1, 0], [1, 0, 1, 0, 0]])


def test_sample_token_top_k_1_is_argmax():
    logits = jax.random.normal(jax.random.key(0), (16,))
    s = SamplingArrays.from_params(SamplingParams(temperature=2.0, top_k=1))
    toks = jax.vmap(lambda k: sample_token(k, logits, s))(jax.random.split(jax.random.key(1), 64))
    assert (np.asarray(toks) == int(jnp.argmax(logits))).all()


# ---- accept_greedy -----------------------------------------------------------------------------
def _onehot_logits(best, vocab=8):
    """Logits whose argmax per slot is `best`."""
    x = np.random.default_rng(0).normal(size=(len(best), vocab)) * 0.1
    x[np.arange(len(best)), best] = 5.0
    return jnp.asarray(x)


def test_accept_greedy():
    best = [3, 1, 4, 1, 5]                    # target argmax at slots [anchor, d1, d2, d3, d4]
    logits = _onehot_logits(best)
    cases = [                                 # (drafts, n, accepted, bonus)
        ([3, 1, 4, 1], 4, 4, 5),              # all match: bonus after the last draft
        ([3, 1, 0, 1], 4, 2, 4),              # first mismatch at d3: bonus = argmax of slot 2
        ([0, 1, 4, 1], 4, 0, 3),              # d1 wrong: nothing accepted, later matches ignored
        ([3, 1, 4, 1], 2, 2, 4),              # n limits acceptance even though d3, d4 match
        ([3, 1, 4, 1], 0, 0, 3),
        ([3, 2, 4, 1], 1, 1, 1),
    ]
    f = jax.jit(accept_greedy)                # n traced
    for drafts, n, a, bonus in cases:
        got = f(logits, jnp.asarray(drafts, jnp.int32), jnp.int32(n))
        assert (int(got[0]), int(got[1])) == (a, bonus), (drafts, n)
        got = accept_greedy(logits, jnp.asarray(drafts, jnp.int32), n)
        assert (int(got[0]), int(got[1])) == (a, bonus), (drafts, n)


# ---- accept_sample: unit-level losslessness -----------------------------------------------------
V, N_DRAFTS, TRIALS = 6, 2, 20_000


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def filtered_probs(logits, temperature=1.0, top_k=0, top_p=1.0):
    """Reference target distribution (numpy, independent of lingjax): softmax(logits / T) restricted
    to the top-k tokens, then to the smallest prefix (by probability) whose mass reaches top_p."""
    logits = np.asarray(logits, np.float64) / temperature
    out = np.zeros_like(logits)
    for idx in np.ndindex(logits.shape[:-1]):
        z = logits[idx]
        order = np.argsort(-z, kind="stable")
        keep = order[:top_k] if top_k else order
        p = _softmax(z[keep])
        above = np.cumsum(p) - p
        keep = keep[above < top_p]
        out[idx + (slice(None),)][keep] = _softmax(z[keep])
    return out


def _simulate(logits, q, samp, trials, seed, *, broken=False, one_hot=False):
    """Two rounds of draft -> accept_sample on a context-free target: position i has target logits
    logits[i] and draft distribution q[i]. Round 1 starts at position 0, round 2 at a + 1. Returns
    (first token, second token, accepted count of round 1) per trial."""
    logits, q = jnp.asarray(logits), jnp.asarray(q)
    n = N_DRAFTS

    def rnd(key, start):
        k_draft, k_acc = jax.random.split(key)
        lw = jax.lax.dynamic_slice_in_dim(logits, start, n + 1)
        qw = jax.lax.dynamic_slice_in_dim(q, start, n)
        if one_hot:                          # deterministic drafter: d_j = argmax q_j, q = None
            d = jnp.argmax(qw, -1).astype(jnp.int32)
            a, bonus = accept_sample(k_acc, lw, d, None, n, samp)
        else:
            d = jax.random.categorical(k_draft, jnp.log(qw), axis=-1).astype(jnp.int32)
            if broken:                       # a non-lossless rule: resample from p, not the residual
                a, _ = accept_sample(k_acc, lw, d, qw, n, samp)
                p = jax.nn.softmax(lw / samp.temperature, -1)
                bonus = jax.random.categorical(jax.random.fold_in(k_acc, 1), jnp.log(p[a])).astype(jnp.int32)
            else:
                a, bonus = accept_sample(k_acc, lw, d, qw, n, samp)
        emitted = jnp.where(jnp.arange(n + 1) < a, jnp.concatenate([d, jnp.zeros(1, jnp.int32)]), bonus)
        return a, emitted

    def trial(key):
        k1, k2 = jax.random.split(key)
        a, e1 = rnd(k1, 0)
        _, e2 = rnd(k2, a + 1)
        return e1[0], jnp.where(a >= 1, e1[1], e2[0]), a

    keys = jax.random.split(jax.random.key(seed), trials)
    return [np.asarray(x) for x in jax.jit(jax.vmap(trial))(keys)]


def _problem(seed, temperature=1.0, top_k=0, top_p=1.0, q_equals_p=False):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 1.0, (N_DRAFTS + 4, V))        # positions 0..5 (round 2 may start at 3)
    p = filtered_probs(logits, temperature, top_k, top_p)
    q = p.copy() if q_equals_p else rng.dirichlet(np.ones(V) * 0.7, N_DRAFTS + 4)
    samp = SamplingArrays.from_params(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    return logits, q, p, samp


@pytest.mark.parametrize("variant", ["random_q", "one_hot_q", "q_equals_p", "filtered"])
def test_accept_sample_is_lossless(variant):
    kw = dict(filtered=dict(temperature=0.7, top_k=4, top_p=0.9), q_equals_p=dict(q_equals_p=True)).get(variant, {})
    logits, q, p, samp = _problem(10, **kw)
    first, second, a = _simulate(logits, q, samp, TRIALS, 11, one_hot=variant == "one_hot_q")
    chi_square(first, p[0], f"{variant}: first token")
    chi_square(first * V + second, np.outer(p[0], p[1]), f"{variant}: (first, second) pair")
    # acceptance rate of d1: P(accept) = sum_x min(p, q) (one-hot q: p(d1)); 5-sigma binomial bound
    qq = np.eye(V)[np.argmax(q[0])] if variant == "one_hot_q" else q[0]
    rate = np.minimum(p[0], qq).sum()
    got = (a >= 1).mean()
    assert abs(got - rate) < 5 * math.sqrt(rate * (1 - rate) / TRIALS) + 1e-9, (got, rate)
    if variant == "q_equals_p":
        assert (a == N_DRAFTS).all()         # p == q: every draft accepted


def test_chi_square_catches_a_broken_sampler():
    """The same test on a sampler that resamples from p after a rejection (instead of from
    normalize(max(0, p - q))) must fail: the tests above have the power to see the bias."""
    logits, q, p, samp = _problem(10)
    first, second, _ = _simulate(logits, q, samp, TRIALS, 11, broken=True)
    assert not chi2_ok(first, p[0]) or not chi2_ok(first * V + second, np.outer(p[0], p[1]))


def test_accept_sample_respects_n_and_support():
    """n = 0 verifies nothing (bonus from p_0); a draft outside the filtered support is rejected."""
    logits = jnp.asarray([[5.0, 0.0, 0.0, -9.0], [0.0, 5.0, 0.0, 0.0], [0.0, 0.0, 5.0, 0.0]])
    s = SamplingArrays.from_params(SamplingParams(temperature=1.0, top_k=1))
    keys = jax.random.split(jax.random.key(0), 256)
    drafts = jnp.asarray([0, 1], jnp.int32)
    a, b = jax.vmap(lambda k: accept_sample(k, logits, drafts, None, 2, s))(keys)
    assert (np.asarray(a) == 2).all() and (np.asarray(b) == 2).all()     # top-1: deterministic
    a, b = jax.vmap(lambda k: accept_sample(k, logits, drafts, None, 1, s))(keys)
    assert (np.asarray(a) == 1).all() and (np.asarray(b) == 1).all()
    a, b = jax.vmap(lambda k: accept_sample(k, logits, jnp.asarray([3, 1], jnp.int32), None, 2, s))(keys)
    assert (np.asarray(a) == 0).all() and (np.asarray(b) == 0).all()     # d1 = 3 has p = 0


# ---- end to end through the Decoder -------------------------------------------------------------
E2E_V, E2E_PROMPT, E2E_TRIALS = 6, (1, 4, 2, 5, 0, 3, 3), 20_000


def _e2e_target():
    cfg = tiny_config(num_hidden_layers=2, layer_group_size=2, first_k_dense_replace=2, vocab_size=E2E_V,
                      hidden_size=32, intermediate_size=64, num_experts=4, n_group=2, topk_group=1,
                      num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=16, kv_lora_rank=16,
                      qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    model = random_model(cfg, jnp.float64, 3, with_mtp=True)
    dc = DSparkConfig.from_dict(dict(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        intermediate_size=64, vocab_size=E2E_V, block_size=3, mask_token_id=E2E_V - 1,
        target_layer_ids=[0, 1], markov_rank=4, enable_confidence_head=True, confidence_head_with_markov=True))
    return model, DSparkDraft(dc, dtype=jnp.float64, rngs=nnx.Rngs(4))


def _exact_three_token_probs(model, samp_kw):
    """P(x1, x2, x3 | prompt) of plain sampling, from the target's logits for every 2-token prefix."""
    v = E2E_V
    prefixes = np.array([(a, b) for a in range(v) for b in range(v)], np.int32)        # [v^2, 2]
    seqs = np.concatenate([np.tile(np.asarray(E2E_PROMPT, np.int32), (v * v, 1)), prefixes], axis=1)
    cache = init_cache(model.cfg, v * v, seqs.shape[1] + 1, jnp.float64)
    logits = np.asarray(jax.jit(lambda t, c: model(t, c).logits)(jnp.asarray(seqs), cache))
    t = len(E2E_PROMPT)
    p1 = filtered_probs(logits[0, t - 1], **samp_kw)                                    # [v]
    p2 = filtered_probs(logits[::v, t], **samp_kw)                                      # [v(x1), v]
    p3 = filtered_probs(logits[:, t + 1], **samp_kw).reshape(v, v, v)                   # [x1, x2, x3]
    return p1[:, None, None] * p2[:, :, None] * p3


_E2E: dict = {}


def e2e_run(method: str):
    """(model, decoder, jitted vmapped sampler) for `method`, built once. The sampler returns the
    first three generated tokens for a batch of PRNG keys, vectorised with jax.vmap through the
    Decoder's own (un-jitted) prefill and loop."""
    if method not in _E2E:
        if "target" not in _E2E:
            _E2E["target"] = _e2e_target()
        model, draft = _E2E["target"]
        block = {"none": 1, "dspark": 3, "mtp": 2}[method]
        dec = Decoder(model, SpecConfig(method, block), draft=draft if method == "dspark" else None,
                      greedy=False)
        prompt = jnp.asarray(E2E_PROMPT, jnp.int32)[None]
        cost = jnp.ones(len(dec.spec.widths), jnp.float32)

        @jax.jit
        def many(params, keys, samp):
            def one(key):
                s = dec._prefill(params, prompt, 3, jnp.int32(3), key, samp, cost)
                s = dec._run(params, s, samp, None, max_steps=8)
                return s.out[:3], s.n_out
            return jax.vmap(one)(keys)

        _E2E[method] = (model, dec, many)
    return _E2E[method]


def e2e_keys(seed: int, trials: int = E2E_TRIALS):
    return jax.random.split(jax.random.key(seed), trials)


@pytest.mark.parametrize("method", ["none", "dspark", "mtp"])
def test_spec_sampling_is_lossless_end_to_end(method):
    """Tokens 1-3 after a fixed prompt over 20k seeds vs the exact distribution of plain sampling.
    Token 1 comes from the prefill; tokens 2-3 from the first speculative step (accepted drafts,
    the residual after a rejection, or the bonus) or the next one. 'none' is the control; DSpark
    samples its drafts from q (rejection sampling with q), MTP drafts greedily (one-hot q). DSpark
    also runs with temperature 0.7, top-k 4, top-p 0.9 (traced knobs: the same compiled loop)."""
    model, dec, many = e2e_run(method)
    settings_ = [dict(temperature=1.0)]
    if method == "dspark":
        settings_.append(dict(temperature=0.7, top_k=4, top_p=0.9))
    v = E2E_V
    for i, kw in enumerate(settings_):
        samp = SamplingArrays.from_params(SamplingParams(**kw))
        out, n = many(dec.params, e2e_keys(100 + i), samp)
        out = np.asarray(out)
        assert (np.asarray(n) == 3).all()
        probs = _exact_three_token_probs(model, dict(temperature=kw["temperature"], top_k=kw.get("top_k", 0),
                                                     top_p=kw.get("top_p", 1.0)))
        chi_square(out[:, 0], probs.sum((1, 2)), f"{method} {kw}: token 1")
        chi_square(out[:, 0] * v + out[:, 1], probs.sum(2), f"{method} {kw}: tokens 1-2")
        chi_square((out[:, 0] * v + out[:, 1]) * v + out[:, 2], probs, f"{method} {kw}: tokens 1-3")


def test_vmapped_decoder_matches_single_runs():
    """The vectorised trials above are the Decoder's own jitted prefill + run, seed by seed."""
    _, dec, many = e2e_run("dspark")
    samp = SamplingArrays.from_params(SamplingParams(temperature=1.0))
    keys = e2e_keys(100)
    out = np.asarray(many(dec.params, keys, samp)[0])
    cost = jnp.ones(1, jnp.float32)
    for i in range(3):
        s = dec.prefill(dec.params, jnp.asarray(E2E_PROMPT, jnp.int32)[None], 3, jnp.int32(3), keys[i], samp, cost)
        s = dec.run(dec.params, s, samp, None, max_steps=8)
        np.testing.assert_array_equal(np.asarray(s.out[:3]), out[i])
