"""Approximate speed modes (lingjax/approx.py): off means bit-identical, each mode is wired and
bounded on the golden model, caches keep their storage dtypes, and greedy speculative decoding
stays token-identical to plain greedy decoding under every mode (DSpark and MTP)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import golden, golden_model, rel
from lingjax.approx import FP8_DTYPE, ApproxModes, quantize_fp8_per_token
from lingjax.cache import init_cache
from lingjax.model.ling import LingModel, set_approx
from lingjax.ops import moe as moe_ops
from test_spec_decode import Case, assert_same, generate, small_draft, small_target, tokens

MODES = {"expert_keep": ApproxModes(expert_keep=0.75), "bf16_router_head": ApproxModes(bf16_router_head=True),
         "bf16_kda_state": ApproxModes(bf16_kda_state=True), "fp8_mla_cache": ApproxModes(fp8_mla_cache=True),
         "all": ApproxModes(0.75, True, True, True)}


# ---- the settings record ------------------------------------------------------------------------
def test_parse_and_describe_round_trip():
    assert ApproxModes.parse(None) == ApproxModes.parse("none") == ApproxModes.parse("") == ApproxModes()
    m = ApproxModes.parse(" fp8_mla_cache, expert_keep=0.5 ,bf16_kda_state")
    assert m == ApproxModes(expert_keep=0.5, bf16_kda_state=True, fp8_mla_cache=True)
    assert m.describe() == "expert_keep=0.5,bf16_kda_state,fp8_mla_cache"
    for modes in MODES.values():
        assert ApproxModes.parse(modes.describe()) == modes and modes.any
    assert ApproxModes().describe() == "none" and not ApproxModes().any


@pytest.mark.parametrize("text,msg", [("expert_keep=1", "0 < X < 1"), ("expert_keep=0", "0 < X < 1"),
                                      ("expert_keep=abc", "needs a number"), ("fp16_cache", "unknown approx mode"),
                                      ("bf16_kda_state=1", "unknown approx mode"),
                                      ("bf16_kda_state,bf16_kda_state", "given twice")])
def test_parse_errors(text, msg):
    with pytest.raises(ValueError, match=msg):
        ApproxModes.parse(text)


def test_constructor_validates():
    with pytest.raises(ValueError, match="0 < X < 1"):
        ApproxModes(expert_keep=1.5)
    with pytest.raises(ValueError, match="True or False"):
        ApproxModes(bf16_kda_state=1)
    with pytest.raises(TypeError, match="ApproxModes"):
        set_approx(golden_model("float32"), "bf16_kda_state")


# ---- expert skipping ----------------------------------------------------------------------------
def test_keep_top_share_known_rows():
    idx = jnp.asarray([[5, 2, 7, 1], [3, 0, 6, 4], [1, 2, 3, 0]], jnp.int32)
    w = jnp.asarray([[0.1, 0.6, 0.2, 0.1],     # 0.6 < .75; 0.6+0.2 >= .75*1.0 -> keep slots 1, 2
                     [0.25, 0.25, 0.25, 0.25],  # ties: lower slot first -> keep slots 0, 1, 2
                     [0.0, 0.0, 0.0, 0.0]])     # all zero: keep the first slot only
    new_idx, new_w = moe_ops.keep_top_share(idx, w, 0.75)
    np.testing.assert_array_equal(new_idx, [[2, 2, 7, 2], [3, 0, 6, 3], [1, 1, 1, 1]])
    np.testing.assert_array_equal(new_w, [[0, 0.6, 0.2, 0], [0.25, 0.25, 0.25, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize("keep", [0.3, 0.75, 0.9])
def test_keep_top_share_equals_the_sort_formulation(keep):
    """Random rows with ties and all-zero rows, f32 and bf16. The weights are multiples of 1/16 so
    that every partial sum is exact: the two formulations add in different orders, which could
    otherwise round a slot whose heavier weight sits exactly at keep * total to either side."""
    rng = np.random.default_rng(int(keep * 100))
    idx = jnp.asarray(rng.integers(0, 512, (300, 8)), jnp.int32)
    w = rng.choice([0.0, 0.0625, 0.125, 0.25, 0.5], (300, 8)) * (rng.random((300, 1)) > 0.05)
    for dtype in (jnp.float32, jnp.bfloat16):
        got = moe_ops.keep_top_share(idx, jnp.asarray(w, dtype), keep)
        want = moe_ops._keep_top_share_sorted(idx, jnp.asarray(w, dtype), keep)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(np.asarray(got[1], np.float32), np.asarray(want[1], np.float32))


def test_route_with_expert_keep_renormalises_and_experts_agree():
    rng = np.random.default_rng(0)
    n, d, e, k, f = 40, 16, 16, 4, 8
    x = jnp.asarray(rng.standard_normal((n, d)))
    wr, bias = jnp.asarray(rng.standard_normal((d, e))), jnp.asarray(rng.normal(0, 0.1, e))
    kw = dict(n_group=4, topk_group=2, top_k=k, norm_topk_prob=True, routed_scaling_factor=2.5)
    idx0, w0 = moe_ops.route(x, wr, bias, **kw)
    idx, w = moe_ops.route(x, wr, bias, expert_keep=0.6, **kw)
    kept = np.asarray(w) > 0
    assert (kept.sum(1) >= 1).all() and (kept.sum(1) < k).any()
    np.testing.assert_allclose(np.asarray(w).sum(1), 2.5, rtol=1e-12)                 # renormalised
    np.testing.assert_array_equal(np.asarray(idx)[kept], np.asarray(idx0)[kept])        # same experts kept
    share = np.where(kept, np.asarray(w0), 0).sum(1) / np.asarray(w0).sum(1)
    assert (share >= 0.6 - 1e-12).all()
    ratio = np.where(kept, np.asarray(w) / np.asarray(w0), np.nan)        # kept experts keep their proportions
    np.testing.assert_allclose(ratio[kept], np.broadcast_to(np.nanmax(ratio, 1, keepdims=True), ratio.shape)[kept],
                               rtol=1e-12)
    lightest = np.where(kept, np.asarray(w0), np.inf).min(1) / np.asarray(w0).sum(1)
    assert (share - lightest < 0.6).all()                                   # the fewest experts that reach 0.6
    wgu, wd = jnp.asarray(rng.standard_normal((e, 2, f, d))), jnp.asarray(rng.standard_normal((e, d, f)))
    dense = moe_ops.experts_dense(x, idx, w, wgu, wd)
    np.testing.assert_allclose(moe_ops.experts_gather(x, idx, w, wgu, wd), dense, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(moe_ops.experts_capacity(x, idx, w, wgu, wd, block=8), dense,
                               rtol=1e-10, atol=1e-10)


# ---- off = exact --------------------------------------------------------------------------------
def _decode_logits(model, ids, split=64, block=8):
    """Prefill ids[:split], then extend by `block` tokens at a time: logits of every position."""
    fwd = jax.jit(lambda t, c: model(t, c))
    out = fwd(ids[:, :split], model.init_cache(1, 128))
    parts, cache = [out.logits[0]], out.cache
    for i in range(split, ids.shape[1], block):
        out = fwd(ids[:, i:i + block], cache)
        parts.append(out.logits[0])
        cache = out.cache
    return np.concatenate([np.asarray(p) for p in parts]), cache


def test_all_off_is_bit_identical():
    g = golden()
    ids = jnp.asarray(g["long_ids"], jnp.int32)
    model = golden_model("float32")
    base, _ = _decode_logits(model, ids)
    cfg = model.cfg
    a, b = LingModel(cfg, dtype=jnp.float32), LingModel(cfg, dtype=jnp.float32, approx=ApproxModes())
    np.testing.assert_array_equal(_decode_logits(a, ids)[0], _decode_logits(b, ids)[0])
    assert a.approx == b.approx == ApproxModes()
    try:
        set_approx(model, MODES["all"])
        assert not np.array_equal(_decode_logits(model, ids)[0], base)
    finally:
        set_approx(model, ApproxModes())
    np.testing.assert_array_equal(_decode_logits(model, ids)[0], base)
    for x, y in zip(jax.tree.leaves(model.init_cache(1, 8)), jax.tree.leaves(init_cache(cfg, 1, 8, jnp.float32))):
        assert x.dtype == y.dtype and x.shape == y.shape


# ---- each mode: wired, cache dtypes, bounded error on the golden model ---------------------------
# Measured on the golden tiny model (float32, prefill 64 + blocks of 8): expert_keep 0.67 (random
# router weights spread the combine weight evenly over 16 experts, so 0.75 drops real mass),
# bf16_router_head 0.077, bf16_kda_state 2.6e-4, fp8_mla_cache 0.061; bounds leave ~2x room.
BOUND = {"expert_keep": 1.0, "bf16_router_head": 0.15, "bf16_kda_state": 1e-3, "fp8_mla_cache": 0.12}


@pytest.mark.parametrize("name", list(BOUND))
def test_mode_changes_logits_within_bound(name):
    g = golden()
    model = golden_model("float32")
    ids = jnp.asarray(g["long_ids"], jnp.int32)
    base, _ = _decode_logits(model, ids)
    try:
        set_approx(model, MODES[name])
        got, cache = _decode_logits(model, ids)
    finally:
        set_approx(model, ApproxModes())
    err = rel(got, g["long_logits"])
    assert np.isfinite(got).all() and not np.array_equal(got, base)
    assert err <= BOUND[name], (name, err)
    kda = [c for c in cache.layers if hasattr(c, "state")]
    mla = [c for c in cache.layers if hasattr(c, "latent")] + [cache.mtp]
    assert all(c.state.dtype == (jnp.bfloat16 if name == "bf16_kda_state" else jnp.float32) for c in kda)
    assert all(c.latent.dtype == (FP8_DTYPE if name == "fp8_mla_cache" else jnp.float32) for c in mla)
    assert all((c.latent_scale is not None) == (name == "fp8_mla_cache") for c in mla)


def test_fp8_latent_does_not_depend_on_the_writing_block():
    """Per-token scales: a block written at once equals the same tokens written one by one."""
    g = golden()
    model = golden_model("float32")
    ids = jnp.asarray(g["long_ids"][:, :24], jnp.int32)
    try:
        set_approx(model, MODES["fp8_mla_cache"])
        fwd = jax.jit(lambda t, c: model(t, c))
        whole = fwd(ids, model.init_cache(1, 32)).cache
        cache = model.init_cache(1, 32)
        for i in range(24):
            cache = fwd(ids[:, i:i + 1], cache).cache
    finally:
        set_approx(model, ApproxModes())
    j = model.cfg.layer_kinds().index("mla")
    for a, b in ((whole.layers[j], cache.layers[j]), (whole.mtp, cache.mtp)):
        np.testing.assert_allclose(np.asarray(a.latent_scale), np.asarray(b.latent_scale), rtol=1e-6)
        fa, fb = np.asarray(a.latent, np.float32), np.asarray(b.latent, np.float32)
        assert (fa == fb).mean() > 0.99   # equal up to rare rounding-boundary flips of the fp32 latent


def test_quantize_fp8_per_token_error():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 7, 64)) * [[[1e-3]], [[1.0]], [[100.0]]])
    q, scale = quantize_fp8_per_token(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (3, 7)
    back = np.asarray(q, np.float32) * np.asarray(scale)[..., None]
    assert np.abs(back).max() <= np.abs(np.asarray(x)).max() * (1 + 1e-6)
    assert rel(back, x) < 0.04      # e4m3: 3 mantissa bits


# ---- speculative decoding under each mode --------------------------------------------------------
@pytest.mark.parametrize("name", list(MODES))
def test_greedy_spec_equals_plain_under_mode(name):
    """The plain greedy reference is computed under the same mode; DSpark (real drafts, exact and
    mixed oracles) and MTP must reproduce it token for token."""
    model = set_approx(small_target(0, 2), MODES[name])
    case = Case(model, small_draft(model, 1, 8), np.random.default_rng(0).integers(0, 64, 15))
    for t in (17,):              # past the KDA chunk (16): chunked prefill + state carried
        want = case.expected(t)
        for kind in ("real", "oracle", "mixed"):
            assert_same(tokens(generate(case.decoder("dspark", 8), case.prompt(t), override=case.override(kind))),
                        want, f"{name} dspark {kind} t={t}")
        assert_same(tokens(generate(case.decoder("mtp", 3), case.prompt(t))), want, f"{name} mtp t={t}")
    assert case.model.approx == MODES[name]


# ---- flags: loader / CLI / server / benchmark ------------------------------------------------------
def test_loader_sets_and_checks_modes():
    from conftest import LING_TINY
    from lingjax.loader import LoadError, load_engine
    with pytest.raises(LoadError, match="--approx: unknown approx mode"):
        load_engine(LING_TINY, approx="fp16_everything", quiet=True)
    with pytest.raises(LoadError, match="fp8_mla_cache with --mesh"):
        load_engine(LING_TINY, approx="fp8_mla_cache", mesh="tp=1", quiet=True)
    eng = load_engine(LING_TINY, dtype="float32", spec="mtp", approx="expert_keep=0.5,fp8_mla_cache", quiet=True)
    mods = [layer.mlp for layer in eng.target.layers if hasattr(layer.mlp, "approx")]
    assert eng.target.approx == ApproxModes(expert_keep=0.5, fp8_mla_cache=True)
    assert mods and all(m.approx == eng.target.approx for m in mods)
    assert load_engine(LING_TINY, dtype="float32", quiet=True).target.approx == ApproxModes()


def test_cli_server_and_bench_parse_the_flag():
    from bench import batch1
    from lingjax import generate as cli
    from serve.__main__ import build_parser as serve_parser
    assert cli.build_parser().parse_args(["--approx", "bf16_kda_state"]).approx == "bf16_kda_state"
    assert cli.build_parser().parse_args([]).approx is None
    assert serve_parser().parse_args(["--approx", "fp8_mla_cache"]).approx == "fp8_mla_cache"
    a = batch1.build_parser().parse_args(["--tiny", "--approx", "expert_keep=0.75,bf16_router_head"])
    assert a.approx == [ApproxModes(expert_keep=0.75, bf16_router_head=True)]      # one row set per flag
    a = batch1.build_parser().parse_args(["--tiny", "--approx", "none", "--approx", "fp8_mla_cache"])
    assert a.approx == [ApproxModes(), ApproxModes(fp8_mla_cache=True)]
    assert batch1.build_parser().parse_args(["--tiny"]).approx is None
    with pytest.raises(SystemExit):
        batch1.build_parser().parse_args(["--tiny", "--approx", "expert_keep=2"])
