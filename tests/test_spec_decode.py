"""The on-device speculative loop (lingjax/spec_decode.py) against plain decoding.

Greedy speculative decoding must be token-for-token identical to plain greedy decoding whatever the
drafter proposes (spec/dspark.md, "One speculative step"); users report hybrid models diverging
because of KDA/conv state rollback, so we drive the loop with drafts whose acceptance we control:
  real    the actual drafter (golden tiny DSpark draft, MTP layer, random drafts on random targets):
          acceptance ~ 0 on these random-weight models
  oracle  DraftOverride with the plain greedy continuation, pattern -1: every draft is accepted
  mixed   the same oracle with pattern (0, 3, 1, 8, 2): exactly that many accepted per step
  random  an oracle of random ids: (almost) nothing accepted, every token is a bonus token
at prompt lengths around the KDA chunk size (16) and for every verify length 1..8.

Compile time dominates (every Decoder x prompt length x max_new compiles its prefill and its loop;
a multi-width loop costs about one compile per width), so the matrix is a sparse design:
- one plain reference per target: the greedy continuation of a 15-token prompt; the longer prompts
  (16, 17, 33 tokens) are that prompt extended by its own continuation, so their plain output is the
  reference shifted (a wrong shift would make every spec run from those prompts disagree);
- every override has the same shapes (one oracle array per target, patterns of length 5), so one
  compiled loop serves oracle, mixed and random drafts;
- (verify width, prompt length) pairs are spread over the golden target's runs; the widths the
  golden target does not run (3, 4, 6, 7), the policies, MTP 1-2, stops and sampling run on a small
  random target that compiles ~2.5x faster.
Decoders are cached in a module-level dict.
"""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import DSPARK_TINY
from helpers import golden, golden_model, random_model, tiny_config
from lingjax.dspark_config import DSparkConfig, DSparkConfigError
from lingjax.model.dspark import DSparkDraft, draft_projections, from_safetensors, quantize_draft
from lingjax.quant import Fp8Weight
from lingjax.sampling import SamplingArrays, SamplingParams
from lingjax.spec_decode import FINISH_LENGTH, FINISH_RUNNING, FINISH_STOP, Decoder, DraftOverride, SpecConfig

MAX_NEW = 40                 # generated tokens per spec run (one value: max_new is a static shape)
BASE_LEN = 15                # reference prompt length
EXTRA = 18                   # longest prompt = BASE_LEN + EXTRA = 33 tokens
ORACLE_LEN = 128             # fixed oracle length (>= 33 + MAX_NEW + block + 1): one compiled loop
MIXED = (0, 3, 1, 8, 2)      # accepted drafts per step (8 = all of a block of 8)
ALL = (-1,) * len(MIXED)     # -1: no corruption (every pattern has length 5: same shapes)
KINDS = ("oracle", "mixed", "random")
GREEDY = SamplingArrays.from_params(SamplingParams())
SAMPLED = SamplingArrays.from_params(SamplingParams(temperature=1.0))


# ---- targets, drafts, decoders (cached: loading and compiling are the expensive part) -----------
def small_config(layers: int = 2, vocab: int = 64):
    """A 2-4 layer target (KDA + MLA, MoE from layer 1) with MTP: compiles much faster than golden."""
    return tiny_config(num_hidden_layers=layers, layer_group_size=2, first_k_dense_replace=1,
                       vocab_size=vocab, hidden_size=32, intermediate_size=64, num_experts=4, n_group=2,
                       topk_group=1, num_experts_per_tok=2, moe_intermediate_size=16,
                       moe_shared_expert_intermediate_size=16, num_attention_heads=2, num_key_value_heads=2,
                       head_dim=16, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def small_target(seed: int, layers: int = 2, vocab: int = 64):
    return random_model(small_config(layers, vocab), jnp.float64, seed, with_mtp=True)


def small_draft(model, seed: int, block: int, taps=None):
    """A 1-layer random DSpark draft fitting `model` (Markov + confidence heads)."""
    cfg = model.cfg
    taps = taps if taps is not None else sorted({0, cfg.num_hidden_layers - 1})
    dc = DSparkConfig.from_dict(dict(
        hidden_size=cfg.hidden_size, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, intermediate_size=64, vocab_size=cfg.vocab_size, block_size=block,
        mask_token_id=cfg.vocab_size - 1, target_layer_ids=list(taps), markov_rank=4,
        enable_confidence_head=True, confidence_head_with_markov=True))
    return DSparkDraft(dc, dtype=jnp.float64, rngs=nnx.Rngs(seed))


_DECODERS: dict = {}


def make_decoder(model, draft, method="dspark", block=8, policy="fixed", widths=None, *, greedy=True,
                 stop_ids=(), stop_sequences=()) -> Decoder:
    # the cached Decoder holds model and draft, so their ids stay unique while the entry lives
    key = (id(model), id(draft), method, block, policy, widths, greedy, stop_ids, stop_sequences)
    if key not in _DECODERS:
        _DECODERS[key] = Decoder(model, SpecConfig(method, block, policy, widths),
                                 draft=draft if method == "dspark" else None, stop_ids=stop_ids,
                                 stop_sequences=stop_sequences, greedy=greedy)
    return _DECODERS[key]


def generate(dec, prompt, *, max_new=MAX_NEW, limit=None, override=None, step_cost=None, seed=0,
             samp=GREEDY, max_steps=10_000):
    """prefill + run; returns the final DecodeState (on device). Every argument is a device array
    (Python scalars such as DraftOverride.force or max_steps would give the jitted functions a
    different call signature than the device-resident arguments of the transfer-guard test, hence
    a second compile)."""
    cost = jnp.ones(len(dec.spec.widths), jnp.float32) if step_cost is None else jnp.asarray(step_cost, jnp.float32)
    state = dec.prefill(dec.params, jnp.asarray(prompt, jnp.int32)[None], max_new,
                        jnp.int32(max_new if limit is None else limit), jax.random.key(seed), samp, cost)
    return dec.run(dec.params, state, samp, jax.device_put(override), jax.device_put(max_steps))


def tokens(state) -> np.ndarray:
    return np.asarray(state.out)[: int(state.n_out)]


class Case:
    """A target + DSpark draft, its plain greedy reference and the matching draft overrides."""

    def __init__(self, model, draft, base_prompt):
        self.model, self.draft = model, draft
        self.base = np.asarray(base_prompt, np.int32)
        assert len(self.base) == BASE_LEN
        # long enough for the 33-token prompt + MAX_NEW + one block of oracle drafts past the end
        self.ref = tokens(generate(self.decoder("none"), self.base, max_new=EXTRA + MAX_NEW + 9))
        seq = np.concatenate([self.base, self.ref])
        self.oracle = np.zeros(ORACLE_LEN, np.int32)
        self.oracle[: len(seq)] = seq

    def decoder(self, method="dspark", block=8, policy="fixed", widths=None, **kw) -> Decoder:
        return make_decoder(self.model, self.draft, method, block, policy, widths, **kw)

    def prompt(self, t: int) -> np.ndarray:
        """t tokens (15 <= t <= 33): the base prompt extended by its own greedy continuation."""
        return np.concatenate([self.base, self.ref[: t - BASE_LEN]]).astype(np.int32)

    def expected(self, t: int, n: int = MAX_NEW) -> np.ndarray:
        """Plain greedy output for prompt(t): the reference shifted."""
        return self.ref[t - BASE_LEN: t - BASE_LEN + n]

    def override(self, kind):
        """'oracle' | 'mixed' | 'random' | a length-5 pattern tuple -> DraftOverride; 'real' -> None."""
        if kind == "real":
            return None
        if kind == "random":
            ids = np.random.default_rng(1).integers(0, self.model.cfg.vocab_size, ORACLE_LEN)
            return DraftOverride(jnp.asarray(ids, jnp.int32), jnp.asarray(ALL, jnp.int32))
        pattern = {"oracle": ALL, "mixed": MIXED}.get(kind, kind)
        assert len(pattern) == len(MIXED)
        return DraftOverride(jnp.asarray(self.oracle), jnp.asarray(pattern, jnp.int32))


@functools.lru_cache(maxsize=None)
def gold() -> Case:
    return Case(golden_model("float64"), from_safetensors(DSPARK_TINY, dtype=jnp.float64),
                golden()["long_ids"][0, :BASE_LEN])


@functools.lru_cache(maxsize=None)
def small() -> Case:
    model = small_target(0, 2)
    return Case(model, small_draft(model, 1, 8), np.random.default_rng(0).integers(0, 64, BASE_LEN))


# ---- checks ------------------------------------------------------------------------------------
def expected_stats(pattern, width_of_step, total: int = MAX_NEW) -> dict:
    """Statistics of a greedy run with an exact oracle + `pattern`: step i verifies
    width_of_step(i) = n drafts and accepts min(pattern[i % 5], n) of them (-1 = all n), committing
    that + 1 tokens; the prefill gives the first token; the run ends once `total` tokens are out
    (the last step's statistics count in full even when its tokens are cut)."""
    n_out, steps, accepted, drafted = 1, 0, 0, 0
    block = max(width_of_step(i) for i in range(64))
    hist, pos = np.zeros(block + 1, int), np.zeros(block, int)
    while n_out < total:
        n = width_of_step(steps)
        p = pattern[steps % len(pattern)]
        a = n if p < 0 else min(p, n)
        hist[a] += 1
        pos[:a] += 1
        accepted, drafted, n_out, steps = accepted + a, drafted + n, n_out + a + 1, steps + 1
    return dict(steps=steps, accepted=accepted, drafted=drafted, accept_hist=hist, pos_accepted=pos)


def check_stats(state, exp: dict, what=""):
    for name, want in exp.items():
        got = np.asarray(getattr(state, name))
        want = np.asarray(want)
        if got.shape != want.shape:    # accept_hist / pos_accepted are sized by the block, not by n
            want = np.pad(want, (0, got.shape[0] - want.shape[0]))
        np.testing.assert_array_equal(got, want, err_msg=f"{what}: {name}")


def assert_same(got, want, what=""):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or not (got == want).all():
        m = min(len(got), len(want))
        bad = next((i for i in range(m) if got[i] != want[i]), m)
        pytest.fail(f"{what}: speculative output diverges from plain greedy at token {bad} "
                    f"(lengths {len(got)} vs {len(want)})\n got  {got.tolist()}\n want {want.tolist()}")


def check_greedy_lossless(case: Case, dec: Decoder, t: int, kinds, width_of_step=None, **kw):
    """Every kind of drafts: output == plain greedy, finish 'length'; with an exact oracle the
    statistics are the pattern's (width_of_step given)."""
    for kind in kinds:
        st_ = generate(dec, case.prompt(t), override=case.override(kind), **kw)
        what = f"{dec.spec}, prompt {t}, {kind} drafts"
        assert_same(tokens(st_), case.expected(t), what)
        assert int(st_.finish) == FINISH_LENGTH, what
        if width_of_step is not None and kind in ("oracle", "mixed"):
            check_stats(st_, expected_stats(ALL if kind == "oracle" else MIXED, width_of_step), what)


# ---- golden target ------------------------------------------------------------------------------
def test_plain_greedy_matches_golden():
    g = golden()
    want = g["greedy_tokens"]
    st_ = generate(gold().decoder("none"), g["long_ids"][0], max_new=len(want))
    assert_same(tokens(st_), want, "plain greedy vs golden greedy_tokens")
    assert int(st_.finish) == FINISH_LENGTH and int(st_.steps) == len(want) - 1


# (verify width, prompt length) spread over widths {1, 2, 5, 8} and prompts of 15 (< one KDA chunk),
# 16 (exactly one), 17 (one + 1) and 33 (two + 1) tokens; width 8 = the draft's block.
@pytest.mark.parametrize("n,t", [(8, 15), (8, 33), (1, 16), (2, 17), (5, 33)])
def test_dspark_greedy_equals_plain_golden(n, t):
    case = gold()
    dec = case.decoder("dspark", 8, "fixed", None if n == 8 else (n,))
    assert dec.spec.widths == (n,)
    kinds = KINDS + (("real",) if (n, t) == (8, 15) else ())
    check_greedy_lossless(case, dec, t, kinds, width_of_step=lambda i: n)
    st_ = generate(dec, case.prompt(t), override=case.override("random"))
    assert int(st_.accepted) <= 2            # random ids out of 512 are (almost) never accepted
    assert int(st_.drafted) == n * int(st_.steps)


def test_fp8_draft_greedy_equals_plain_golden():
    """A draft held in block fp8 (quantize_draft: its 7 projections per layer, fc and markov_w2;
    not the 1-wide confidence head) may propose other tokens, but the target verifies every
    proposal: the output is still plain greedy's, token for token. (The golden draft's random weights get no
    proposal accepted in float64 either; the embedded model's trained draft measures acceptance:
    docs/PERFORMANCE.md, session 29.)"""
    case = gold()
    fp8 = quantize_draft(nnx.clone(case.draft))
    assert all(isinstance(m.weight, Fp8Weight) for m, _ in draft_projections(fp8))
    assert len(draft_projections(fp8)) == 1 + 7 * fp8.cfg.num_hidden_layers + (fp8.markov_w2 is not None)
    assert not isinstance(fp8.conf_proj.weight, Fp8Weight)
    dec = make_decoder(case.model, fp8, "dspark", 8)
    for t in (15, 33):
        st_ = generate(dec, case.prompt(t))
        assert_same(tokens(st_), case.expected(t), f"fp8 draft, prompt {t}")
        assert int(st_.finish) == FINISH_LENGTH


def test_mtp_greedy_equals_plain_golden():
    case = gold()
    dec = case.decoder("mtp", 3)
    check_greedy_lossless(case, dec, 17, KINDS + ("real",), width_of_step=lambda i: 3)


def test_statistics_follow_the_pattern():
    """accept_hist / accepted / steps / drafted / pos_accepted for the mixed pattern, by hand for the
    first five steps: 1 + (0+1) + (3+1) + (1+1) + (8+1) + (2+1) = 20 tokens."""
    case = gold()
    st_ = generate(case.decoder("dspark", 8), case.prompt(15), limit=20, override=case.override("mixed"))
    assert_same(tokens(st_), case.expected(15, 20), "mixed pattern, limit 20")
    assert int(st_.steps) == 5
    assert int(st_.accepted) == 0 + 3 + 1 + 8 + 2
    assert int(st_.drafted) == 5 * 8
    np.testing.assert_array_equal(st_.accept_hist, [1, 1, 1, 1, 0, 0, 0, 0, 1])
    # draft j (1-based) accepted in the steps accepting >= j drafts
    np.testing.assert_array_equal(st_.pos_accepted, [4, 3, 2, 1, 1, 1, 1, 1])
    assert int(st_.finish) == FINISH_LENGTH


def test_negative_oracle_entries_take_the_drafters_tokens():
    """An oracle of -1 everywhere hands every step the drafter's own proposals: the same run, tokens
    and statistics, as without an override."""
    case = small()
    dec = case.decoder("dspark", 8)
    real = generate(dec, case.prompt(15))
    ov = DraftOverride(jnp.full(ORACLE_LEN, -1, jnp.int32), jnp.asarray(ALL, jnp.int32))
    via = generate(dec, case.prompt(15), override=ov)
    assert_same(tokens(via), tokens(real), "oracle of -1")
    for name in ("steps", "accepted", "drafted"):
        assert int(getattr(via, name)) == int(getattr(real, name)), name


def test_forced_acceptance_compiles_the_draft_pass():
    """The benchmarks' forced acceptance (DraftOverride, force=True) still runs the drafter's whole
    pass: XLA's optimised loop has as many dots in the draft's scope as the loop without an
    override. Before session 26 nothing read the drafter's tokens under an override and XLA
    removed its forward, lm_head pass and Markov chain (3 dots left here instead of 12)."""
    case = small()
    dec = case.decoder("dspark", 8)
    state = dec.prefill(dec.params, jnp.asarray(case.prompt(15))[None], MAX_NEW, jnp.int32(MAX_NEW),
                        jax.random.key(0), GREEDY, jnp.ones(1, jnp.float32))

    def draft_dots(override):
        text = dec.run.lower(dec.params, state, GREEDY, override, jnp.int32(100)).compile().as_text()
        return sum(1 for line in text.splitlines() if "/draft/" in line and re.search(r"\bdot\(", line))

    forced = DraftOverride(jnp.asarray(case.oracle), jnp.asarray(ALL, jnp.int32), jnp.asarray(True))
    real = draft_dots(None)
    assert real >= 10 and draft_dots(forced) == real


def test_max_tokens_cut_inside_a_block():
    case = gold()
    dec = case.decoder("dspark", 8)
    for limit in (1, 2, 5, 14, 19, 23):      # oracle: 1 + 9 + 9 = 19 tokens after two steps
        for kind in ("oracle", "mixed"):
            st_ = generate(dec, case.prompt(15), limit=limit, override=case.override(kind))
            assert_same(tokens(st_), case.expected(15, limit), f"limit {limit}, {kind} drafts")
            assert int(st_.finish) == FINISH_LENGTH and int(st_.n_out) == limit
    st_ = generate(dec, case.prompt(15), limit=14, override=case.override("oracle"))
    assert int(st_.steps) == 2               # the second step's 9 tokens overshoot 14: cut there
    st_ = generate(dec, case.prompt(15), limit=1, override=case.override("oracle"))
    assert int(st_.steps) == 0               # the prefill's token already reaches the limit


def test_loop_runs_without_host_transfers():
    """prefill + the whole loop under jax.transfer_guard('disallow'): no host read or write of
    accept counts, positions or stop flags (spec/dspark.md: 'no host read ... per step')."""
    case = gold()
    dec = case.decoder("dspark", 8)
    args = jax.device_put(dict(prompt=jnp.asarray(case.prompt(15))[None], limit=jnp.int32(MAX_NEW),
                               key=jax.random.key(0), cost=jnp.ones(1, jnp.float32), samp=GREEDY,
                               override=case.override("mixed"), max_steps=10_000))

    def go():
        s = dec.prefill(dec.params, args["prompt"], MAX_NEW, args["limit"], args["key"], args["samp"],
                        args["cost"])
        return dec.run(dec.params, s, args["samp"], args["override"], args["max_steps"])

    jax.block_until_ready(go())              # compile outside the guard
    with jax.transfer_guard("disallow"):
        state = jax.block_until_ready(go())
    assert_same(tokens(state), case.expected(15), "under transfer_guard('disallow')")
    check_stats(state, expected_stats(MIXED, lambda i: 8), "under transfer_guard")


def test_run_in_chunks():
    """Streaming: run(max_steps=k) stops mid-request with finish 'running'; calling it again on the
    returned state continues exactly where it stopped (same tokens and statistics)."""
    case = gold()
    dec = case.decoder("dspark", 8)
    ov = jax.device_put(case.override("mixed"))

    def run(s, k):
        return dec.run(dec.params, s, GREEDY, ov, jax.device_put(k))

    s = dec.prefill(dec.params, jnp.asarray(case.prompt(15))[None], MAX_NEW, jnp.int32(MAX_NEW),
                    jax.random.key(0), GREEDY, jnp.ones(1, jnp.float32))
    s = run(s, 3)
    assert int(s.finish) == FINISH_RUNNING and int(s.steps) == 3
    assert_same(tokens(s), case.expected(15, 1 + 1 + 4 + 2), "after 3 steps")
    for _ in range(3):
        s = run(s, 2)
    assert int(s.steps) == 9 and int(s.finish) == FINISH_RUNNING
    s = run(s, 10_000)
    assert_same(tokens(s), case.expected(15), "after continuing")
    check_stats(s, expected_stats(MIXED, lambda i: 8), "chunked run")
    assert int(run(s, 5).steps) == int(s.steps)   # finished: a no-op


# ---- small random target: remaining widths, policies, MTP 1-2 -------------------------------------
def test_small_every_other_width():
    """Verify widths 3, 4, 6, 7 (the golden target runs 1, 2, 5, 8; the policies below 1, 2, 8)."""
    case = small()
    for n, t in [(3, 15), (4, 16), (6, 17), (7, 33)]:
        dec = case.decoder("dspark", 8, "fixed", None if n == 8 else (n,))
        check_greedy_lossless(case, dec, t, KINDS, width_of_step=lambda i, n=n: n)


def test_adaptive_policy():
    """Lucebox rule (spec/dspark.md): start with the smallest width, verify the largest after two
    fully accepted blocks, shrink when guesses fail. Output stays identical to plain greedy.
    (Widths 1, 2, 8 instead of the default 1, 2, 4, 8: each width is one compiled verify branch.)"""
    case = small()
    dec = case.decoder("dspark", 8, "adaptive", (1, 2, 8))
    check_greedy_lossless(case, dec, 16, KINDS)
    p = case.prompt(16)
    st_ = generate(dec, p, override=case.override("oracle"))      # widths 1, 2, then 8 for good
    check_stats(st_, expected_stats(ALL, lambda i: (1, 2)[i] if i < 2 else 8), "adaptive, oracle")
    st_ = generate(dec, p, override=case.override("random"))      # misses keep it at width 1
    assert int(st_.drafted) <= int(st_.steps) + 2
    st_ = generate(dec, p, override=case.override("mixed"))       # narrow and full-width steps
    assert int(st_.steps) < int(st_.drafted) < 8 * int(st_.steps)


def test_confidence_policy():
    """The confidence policy with the draft's own confidences is lossless; with step costs that make
    one width the only sensible choice, exactly that width is verified every step (the cost is a
    traced argument: one compiled loop checks every width of the policy)."""
    case = small()
    dec = case.decoder("dspark", 8, "confidence", (1, 8))
    widths = dec.spec.widths
    check_greedy_lossless(case, dec, 17, KINDS)                    # real confidences, unit costs
    for i, w in enumerate(widths):
        cost = np.full(len(widths), 1e9, np.float32)
        cost[i] = 1.0
        check_greedy_lossless(case, dec, 17, ("oracle", "mixed"), width_of_step=lambda j, w=w: w,
                              step_cost=cost)


@pytest.mark.parametrize("steps,t,kinds", [(1, 15, ("real",)), (2, 16, KINDS)])
def test_mtp_greedy_equals_plain_small(steps, t, kinds):
    case = small()
    check_greedy_lossless(case, case.decoder("mtp", steps), t, kinds, width_of_step=lambda i: steps)


@settings(max_examples=2, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**16), layers=st.integers(2, 3), prompt_len=st.integers(1, 35),
       method=st.sampled_from(["dspark", "mtp"]), block=st.integers(1, 4),
       policy=st.sampled_from(["fixed", "adaptive", "confidence"]))
def test_random_configs_greedy_equals_plain(seed, layers, prompt_len, method, block, policy):
    model = small_target(seed, layers)
    draft = small_draft(model, seed + 1, block) if method == "dspark" else None
    prompt = np.random.default_rng(seed).integers(0, model.cfg.vocab_size, prompt_len)
    want = tokens(generate(make_decoder(model, None, "none"), prompt, max_new=24))
    got = generate(make_decoder(model, draft, method, block, policy), prompt, max_new=24)
    assert_same(tokens(got), want, f"{method} block {block} {policy}, random {layers}-layer target")
    assert int(got.steps) <= 23              # every step commits >= 1 token


# ---- stop conditions -------------------------------------------------------------------------------
STOP_KINDS = KINDS + ((0, 0, 0, 0, 0),)


def _first_new(seq, lo, hi, width=1):
    """First k in [lo, hi) whose `width`-gram ending at k does not occur earlier in seq."""
    grams = [tuple(seq[max(0, i - width + 1): i + 1]) for i in range(len(seq))]
    for k in range(max(lo, width - 1), hi):
        if grams[k] not in grams[width - 1: k]:
            return k
    raise AssertionError(f"no fresh {width}-gram in the reference between {lo} and {hi}")


def test_stop_id_inside_accepted_block():
    case = small()
    ref = case.ref
    # inside the second oracle step's accepted drafts (out[10..17]) and inside the mixed pattern's
    # 9-token step (out[8..16])
    k = _first_new(ref, 11, 16)
    sid = int(ref[k])
    dec = case.decoder("dspark", 8, stop_ids=(sid,))
    for kind in STOP_KINDS:
        st_ = generate(dec, case.prompt(15), override=case.override(kind))
        assert_same(tokens(st_), ref[: k + 1], f"stop id {sid} at output {k}, {kind} drafts")
        assert int(st_.finish) == FINISH_STOP, kind
        if kind == "oracle":                  # an accepted draft of the second step
            assert int(st_.steps) == 2 and int(st_.accepted) == 16
        if kind == (0, 0, 0, 0, 0):
            # every step rejects d_1 while its later (wrong-path) drafts already hold the stop id:
            # drafts that are not accepted must not stop the request
            assert int(st_.steps) == k
    # the limit wins when it comes first; a stop id that is exactly the last allowed token stops
    st_ = generate(dec, case.prompt(15), limit=k, override=case.override("oracle"))
    assert_same(tokens(st_), ref[:k], "limit before the stop id")
    assert int(st_.finish) == FINISH_LENGTH
    st_ = generate(dec, case.prompt(15), limit=k + 1, override=case.override("oracle"))
    assert_same(tokens(st_), ref[: k + 1], "stop id is the last allowed token")
    assert int(st_.finish) == FINISH_STOP


def test_stop_id_as_the_prefill_token():
    """A prompt whose first generated token (from the prefill) is the stop id: finished at once,
    one token out, and running the loop on that state does nothing."""
    case = small()
    k = _first_new(case.ref, 11, 16)
    dec = case.decoder("dspark", 8, stop_ids=(int(case.ref[k]),))
    st_ = generate(dec, case.prompt(BASE_LEN + k), override=case.override("oracle"))
    assert_same(tokens(st_), case.ref[k: k + 1], "stop id from the prefill")
    assert int(st_.finish) == FINISH_STOP and int(st_.steps) == 0


def test_stop_sequence():
    """A 2-token stop sequence, preferably straddling the oracle's step boundary (step 1 commits
    out[1..9], step 2 out[10..18]: a partial match at the end of one step completes in the next),
    next to a 3-token sequence that never occurs (mixed lengths: right-aligned padding)."""
    case = small()
    ref = case.ref
    grams = [tuple(ref[i - 1: i + 1]) for i in range(1, len(ref))]
    j = 10 if grams[9] not in grams[:9] else _first_new(ref, 10, 30, width=2)
    absent = [t for t in range(case.model.cfg.vocab_size) if t not in set(ref.tolist())][:3]
    assert len(absent) == 3
    seqs = ((int(ref[j - 1]), int(ref[j])), tuple(absent))
    dec = case.decoder("dspark", 8, stop_sequences=seqs)
    for kind in STOP_KINDS:
        st_ = generate(dec, case.prompt(15), override=case.override(kind))
        assert_same(tokens(st_), ref[: j + 1], f"stop sequence {seqs[0]} ending at {j}, {kind} drafts")
        assert int(st_.finish) == FINISH_STOP
    if j == 10:
        assert int(generate(dec, case.prompt(15), override=case.override("oracle")).steps) == 2
    # cut by the limit between its two tokens: not a stop
    st_ = generate(dec, case.prompt(15), limit=j, override=case.override("oracle"))
    assert_same(tokens(st_), ref[:j], "limit inside the stop sequence")
    assert int(st_.finish) == FINISH_LENGTH


# ---- sampling ----------------------------------------------------------------------------------
def test_greedy_after_sampling_is_unchanged():
    """Same Decoder objects: greedy request -> sampled requests -> the greedy request again."""
    case = small()
    greedy_dec = case.decoder("dspark", 8, "fixed", (3,))          # compiled by the widths test
    sample_dec = case.decoder("dspark", 8, greedy=False)
    first = tokens(generate(greedy_dec, case.prompt(15), override=case.override("mixed")))
    assert_same(first, case.expected(15), "greedy before sampling")
    for seed in (1, 2):
        generate(sample_dec, case.prompt(15), seed=seed, samp=SAMPLED)
    again = generate(greedy_dec, case.prompt(15), override=case.override("mixed"), seed=7, samp=SAMPLED)
    assert_same(tokens(again), first, "greedy after sampled requests (sampling knobs are ignored)")
    check_stats(again, expected_stats(MIXED, lambda i: 3), "greedy after sampled requests")


def test_sampling_seeds():
    case = small()
    dec = case.decoder("dspark", 8, greedy=False)
    outs = {seed: tokens(generate(dec, case.prompt(15), seed=seed, samp=SAMPLED)) for seed in (3, 4, 5)}
    np.testing.assert_array_equal(tokens(generate(dec, case.prompt(15), seed=3, samp=SAMPLED)), outs[3])
    assert all(len(o) == MAX_NEW for o in outs.values())
    assert len({tuple(o) for o in outs.values()}) == 3, "different seeds gave identical samples"
    # a near-zero temperature through the sampling path is greedy
    cold = SamplingArrays.from_params(SamplingParams(temperature=1e-6))
    assert_same(tokens(generate(dec, case.prompt(15), seed=3, samp=cold)), case.expected(15), "T -> 0")


# ---- bad input ---------------------------------------------------------------------------------
def _draft_cfg(**kw):
    base = dict(hidden_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, intermediate_size=64, vocab_size=512, block_size=4, mask_token_id=511,
                target_layer_ids=[1, 2], markov_rank=4)
    base.update(kw)
    return DSparkConfig.from_dict(base)


def _abstract_draft(**kw):
    return nnx.eval_shape(lambda: DSparkDraft(_draft_cfg(**kw), dtype=jnp.float64, rngs=nnx.Rngs(0)))


def test_block_larger_than_draft():
    with pytest.raises(ValueError, match=r"block size 9 is larger than the draft was built for \(8\)"):
        Decoder(golden_model("float64"), SpecConfig("dspark", 9),
                draft=from_safetensors(DSPARK_TINY, dtype=jnp.float64))


def test_draft_that_does_not_fit_the_target():
    model = golden_model("float64")
    c = model.cfg
    fits = functools.partial(DSparkConfig.check_fits_target, target_hidden_size=c.hidden_size,
                             target_num_layers=c.num_hidden_layers, vocab_size=c.vocab_size)
    with pytest.raises(DSparkConfigError, match=r"draft hidden_size 64 != target hidden_size 128"):
        fits(_draft_cfg(hidden_size=64, head_dim=16))
    with pytest.raises(DSparkConfigError, match=r"target_layer_ids \[1, 8\] contain \[8\], out of range"):
        fits(_draft_cfg(target_layer_ids=[1, 8]))
    with pytest.raises(DSparkConfigError, match="num_target_layers=12, target has 8 layers"):
        fits(_draft_cfg(num_target_layers=12))
    with pytest.raises(DSparkConfigError, match="vocab_size 600 != target vocab_size 512"):
        fits(_draft_cfg(vocab_size=600, mask_token_id=599))
    fits(_draft_cfg())                                   # a fitting draft passes
    # the Decoder runs the same check (a ValueError the CLI can print) before compiling anything
    with pytest.raises(ValueError, match=r"does not fit the target.*\[12\], out of range for a target with 8"):
        Decoder(model, SpecConfig("dspark", 4), draft=_abstract_draft(target_layer_ids=[3, 12]))
    with pytest.raises(ValueError, match="does not fit the target.*hidden_size 64 != target hidden_size 128"):
        Decoder(model, SpecConfig("dspark", 4), draft=_abstract_draft(hidden_size=64, head_dim=16))


def test_missing_drafters_and_bad_spec():
    no_mtp = random_model(small_config(2), jnp.float64, 0, with_mtp=False)
    with pytest.raises(ValueError, match="--spec mtp needs the target's MTP layer"):
        Decoder(no_mtp, SpecConfig("mtp", 2))
    with pytest.raises(ValueError, match="--spec dspark needs a DSpark draft model"):
        Decoder(no_mtp, SpecConfig("dspark", 4))
    with pytest.raises(ValueError, match="unknown speculative method 'eagle'"):
        SpecConfig("eagle")
    with pytest.raises(ValueError, match="unknown verify policy 'greedy'"):
        SpecConfig("dspark", 8, "greedy")
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        SpecConfig("mtp", 0)
    with pytest.raises(ValueError, match=r"verify widths \(2, 9\) must lie in 1..block_size \(8\)"):
        SpecConfig("dspark", 8, "fixed", (2, 9)).widths


def test_embedding_tap_minus_one():
    model = small_target(5, 2)
    draft = small_draft(model, 6, 2, taps=(-1, 1))
    prompt = np.arange(5) % model.cfg.vocab_size
    got = tokens(generate(make_decoder(model, draft, "dspark", 2), prompt, max_new=6))
    want = tokens(generate(make_decoder(model, None, "none"), prompt, max_new=6))
    assert_same(got, want, "dspark with an embedding tap")


@pytest.mark.parametrize("method", ["none", "dspark", "mtp"])
def test_chunked_prefill_equals_one_pass(method):
    """A prompt longer than prefill_chunk is prefilled in scanned chunks (the last one partial, and
    with a padded prompt bucket): same continuation as the one-pass prefill, for every drafter."""
    case = small()
    dec = Decoder(case.model, SpecConfig(method, 4), draft=case.draft if method == "dspark" else None,
                  prefill_chunk=8)
    t = BASE_LEN + EXTRA                                            # 33 tokens: 5 chunks of 8
    kind = "real" if method == "none" else "mixed"
    st_ = generate(dec, case.prompt(t), override=case.override(kind))
    assert_same(tokens(st_), case.expected(t), f"{method}, chunked prefill")
    padded = np.concatenate([case.prompt(t), np.zeros(7, np.int32)])[None]     # bucket of 40, 33 real
    cost = jnp.ones(len(dec.spec.widths), jnp.float32)
    state = dec.prefill(dec.params, jnp.asarray(padded), MAX_NEW, jnp.int32(MAX_NEW), jax.random.key(0), GREEDY,
                        cost, prompt_len=jnp.int32(t))
    st_ = dec.run(dec.params, state, GREEDY, jax.device_put(case.override(kind)), jax.device_put(10_000))
    assert_same(tokens(st_), case.expected(t), f"{method}, chunked prefill of a padded bucket")
    with pytest.raises(ValueError, match="prefill_chunk"):
        Decoder(case.model, SpecConfig("none", 4), prefill_chunk=0)
