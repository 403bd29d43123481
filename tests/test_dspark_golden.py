"""DSpark draft vs the DeepSpec reference outputs in tests/data/dspark-tiny/golden.npz.

Reproduces the 7-step run of spec/dspark.md ("Ground truth"): the context cache is filled with the
prompt's taps, then after each step with pattern_accepted[i]+1 positions (appended as a padded
chunk of block_size+1 rows of which only the first `count` are valid, like the speculative loop).
"""
import jax

jax.config.update("jax_enable_x64", True)

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file

from lingjax.config import LingConfig, preset
from lingjax.dspark_config import DSparkConfig, DSparkConfigError, dspark_for_ling3_flash
from lingjax.model.dspark import (DSparkDraft, block_token_ids, filter_logits, from_safetensors,
                                  load_dspark_weights)

DATA = Path(__file__).parent / "data"
DRAFT_DIR = DATA / "dspark-tiny"
TARGET_DIR = DATA / "ling3-tiny"


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(DRAFT_DIR / "golden.npz"))


@pytest.fixture(scope="module")
def target_embed_head():
    with safe_open(str(TARGET_DIR / "model.safetensors"), "np") as f:
        return f.get_tensor("model.word_embeddings.weight"), f.get_tensor("lm_head.weight")


@pytest.fixture(scope="module")
def draft_cfg():
    return DSparkConfig.from_json(DRAFT_DIR)


def _rel(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _make_step(cfg: DSparkConfig, embed, lm_head):
    @nnx.jit
    def step(model, cache, anchors, start):
        ids = block_token_ids(anchors, cfg.block_size, cfg.mask_token_id)
        hidden = model.forward_block(cache, jnp.take(embed, ids, axis=0), start)
        return hidden, model.propose_greedy(hidden, anchors, lm_head)

    @nnx.jit
    def append(model, cache, taps, start, count):
        return model.append_context(cache, taps, start, count)

    return step, append


def _run_golden(golden, embed_head, dtype):
    """Replay the golden run; returns per-step outputs as numpy (batch row 0)."""
    model = from_safetensors(DRAFT_DIR, dtype=dtype)
    cfg = model.cfg
    embed, lm_head = (jnp.asarray(x, dtype) for x in embed_head)
    taps = np.asarray(golden["target_tap_features"])
    step, append = _make_step(cfg, embed, lm_head)
    prompt_len = int(golden["prompt_len"])
    cache = model.init_cache(1, 160)
    cache = model.append_context(cache, jnp.asarray(taps[None, :prompt_len], dtype), 0)
    assert int(cache.length) == prompt_len
    chunk_n = cfg.block_size + 1
    rng = np.random.default_rng(0)
    out = {k: [] for k in ("hidden", "base_logits", "corrected_logits", "draft_tokens", "confidence_logits")}
    for i, (start, anchor) in enumerate(zip(golden["starts"], golden["anchors"])):
        assert int(cache.length) == int(start)
        hidden, prop = step(model, cache, jnp.asarray([anchor], jnp.int32), jnp.int32(start))
        out["hidden"].append(np.asarray(hidden[0]))
        out["base_logits"].append(np.asarray(prop.base_logits[0]))
        out["corrected_logits"].append(np.asarray(prop.corrected_logits[0]))
        out["draft_tokens"].append(np.asarray(prop.tokens[0]))
        out["confidence_logits"].append(np.asarray(prop.confidence_logits[0]))
        # commit accepted + 1 positions: a padded chunk whose tail is garbage (must be masked).
        count = int(golden["pattern_accepted"][i]) + 1
        chunk = rng.normal(0.0, 50.0, (1, chunk_n, taps.shape[1]))
        chunk[0, :count] = taps[start:start + count]
        cache = append(model, cache, jnp.asarray(chunk, dtype), jnp.int32(start), jnp.int32(count))
        assert int(cache.length) == int(start) + count
    return {k: np.stack(v) for k, v in out.items()}


@pytest.mark.parametrize("dtype,tol", [(jnp.float64, 1e-6), (jnp.float32, 1e-4)], ids=["f64", "f32"])
def test_golden_run(golden, target_embed_head, dtype, tol):
    out = _run_golden(golden, target_embed_head, dtype)
    errs = {k: _rel(out[k], golden[k]) for k in ("hidden", "base_logits", "corrected_logits", "confidence_logits")}
    print(f"{jnp.dtype(dtype).name} relative errors:", errs)
    for k, e in errs.items():
        assert e <= tol, (k, e)
    np.testing.assert_array_equal(out["draft_tokens"], golden["draft_tokens"])


def test_batched_rows_at_different_positions(golden, target_embed_head):
    """Batch 2, per-row lengths: row r replays golden step r_step; each row matches the golden."""
    dtype = jnp.float64
    model = from_safetensors(DRAFT_DIR, dtype=dtype)
    cfg = model.cfg
    embed, lm_head = (jnp.asarray(x, dtype) for x in target_embed_head)
    taps = np.asarray(golden["target_tap_features"])
    steps = (3, 0)
    starts = np.asarray([golden["starts"][s] for s in steps], np.int32)
    cache = model.init_cache(2, 128, per_row=True)
    # fill both rows in one call (n = max start), then cut each row back with `count`.
    n = int(starts.max())
    cache = model.append_context(cache, jnp.asarray(np.stack([taps[:n], taps[:n]]), dtype),
                                 jnp.zeros(2, jnp.int32), jnp.asarray(starts))
    np.testing.assert_array_equal(np.asarray(cache.length), starts)
    anchors = jnp.asarray([golden["anchors"][s] for s in steps], jnp.int32)
    step, _ = _make_step(cfg, embed, lm_head)
    hidden, prop = step(model, cache, anchors, jnp.asarray(starts))
    for r, s in enumerate(steps):
        assert _rel(hidden[r], golden["hidden"][s]) < 1e-6
        assert _rel(prop.corrected_logits[r], golden["corrected_logits"][s]) < 1e-6
        np.testing.assert_array_equal(np.asarray(prop.tokens[r]), golden["draft_tokens"][s])


def test_sampling_top_k1_is_greedy_and_q_is_normalised(golden, target_embed_head):
    dtype = jnp.float64
    model = from_safetensors(DRAFT_DIR, dtype=dtype)
    embed, lm_head = (jnp.asarray(x, dtype) for x in target_embed_head)
    taps = np.asarray(golden["target_tap_features"])
    s = int(golden["starts"][0])
    cache = model.append_context(model.init_cache(1, 128), jnp.asarray(taps[None, :s], dtype), 0)
    anchors = jnp.asarray([golden["anchors"][0]], jnp.int32)
    ids = block_token_ids(anchors, model.cfg.block_size, model.cfg.mask_token_id)
    hidden = model.forward_block(cache, jnp.take(embed, ids, axis=0), s)
    key = jax.random.key(0)
    p1 = model.propose_sample(hidden, anchors, lm_head, key, 0.7, top_k=1)
    np.testing.assert_array_equal(np.asarray(p1.tokens[0]), golden["draft_tokens"][0])
    np.testing.assert_allclose(np.asarray(p1.draft_probs).max(-1), 1.0)
    # plain temperature sampling: q_j = softmax(corrected_j / T) with corrected_j from the sampled chain
    t = 1.3
    ps = model.propose_sample(hidden, anchors, lm_head, key, t)
    q = np.asarray(ps.draft_probs[0])
    np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(q, np.asarray(jax.nn.softmax(ps.corrected_logits[0] / t, axis=-1)), rtol=1e-10)
    prev = np.concatenate([np.asarray(anchors), np.asarray(ps.tokens[0, :-1])])
    w1 = np.asarray(model.markov_w1[...])
    w2 = np.asarray(model.markov_w2.weight[...])
    want = np.asarray(ps.base_logits[0]) + w1[prev] @ w2
    np.testing.assert_allclose(np.asarray(ps.corrected_logits[0]), want, rtol=1e-10, atol=1e-12)
    assert np.all(q[np.arange(8), np.asarray(ps.tokens[0])] > 0)


def test_filter_logits():
    x = jnp.log(jnp.asarray([[0.5, 0.2, 0.2, 0.1]], jnp.float64))
    assert np.isinf(np.asarray(filter_logits(x, top_k=2))).tolist() == [[False, False, False, True]]  # tie kept
    assert np.isinf(np.asarray(filter_logits(x, top_p=0.45))).tolist() == [[False, True, True, True]]
    assert np.isinf(np.asarray(filter_logits(x, top_p=0.6))).tolist() == [[False, False, False, True]]
    assert not np.isinf(np.asarray(filter_logits(x, top_p=1.0))).any()


def test_bf16_smoke(golden, target_embed_head):
    """bf16 weights run end to end (no golden tolerance: just finite and mostly the same tokens)."""
    model = from_safetensors(DRAFT_DIR, dtype=jnp.bfloat16)
    embed, lm_head = (jnp.asarray(x, jnp.bfloat16) for x in target_embed_head)
    taps = jnp.asarray(golden["target_tap_features"][None, :96], jnp.bfloat16)
    cache = model.append_context(model.init_cache(1, 128), taps, 0)
    prop = model.draft(cache, jnp.asarray([golden["anchors"][0]], jnp.int32), 96, embed, lm_head)
    assert prop.base_logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(prop.corrected_logits)).all()
    assert cache.k[0].dtype == jnp.bfloat16


# ---- loading ------------------------------------------------------------------------------------
def test_load_model_prefix_and_errors(draft_cfg):
    tensors = load_file(str(DRAFT_DIR / "model.safetensors"))
    model = nnx.eval_shape(lambda: DSparkDraft(draft_cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    load_dspark_weights(model, {"model." + k: v for k, v in tensors.items()})
    np.testing.assert_array_equal(np.asarray(model.fc.weight[...]), tensors["fc.weight"].T)
    np.testing.assert_array_equal(np.asarray(model.layers[1].self_attn.q_proj.weight[...]).reshape(128, 128),
                                  tensors["layers.1.self_attn.q_proj.weight"].T)

    missing = dict(tensors)
    del missing["layers.1.mlp.up_proj.weight"]
    with pytest.raises(DSparkConfigError, match="layers.1.mlp.up_proj.weight"):
        load_dspark_weights(nnx.eval_shape(lambda: DSparkDraft(draft_cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))),
                            missing)
    bad = dict(tensors)
    bad["markov_head.markov_w1.weight"] = np.zeros((512, 8), np.float32)
    with pytest.raises(DSparkConfigError, match="markov_w1.*shape"):
        load_dspark_weights(nnx.eval_shape(lambda: DSparkDraft(draft_cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))),
                            bad)
    extra = dict(tensors, **{"layers.2.mlp.up_proj.weight": np.zeros((256, 128), np.float32)})
    with pytest.raises(DSparkConfigError, match="unexpected"):
        load_dspark_weights(nnx.eval_shape(lambda: DSparkDraft(draft_cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))),
                            extra)


# ---- config -------------------------------------------------------------------------------------
def _raw_cfg() -> dict:
    return json.loads((DRAFT_DIR / "config.json").read_text())


def test_config_from_json(draft_cfg):
    c = draft_cfg
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == \
        (128, 2, 4, 2, 32)
    assert c.target_layer_ids == (1, 2, 4, 5, 6) and c.tap_dim == 640
    assert (c.block_size, c.mask_token_id, c.markov_rank, c.markov_head_type) == (8, 511, 16, "vanilla")
    assert c.enable_confidence_head and c.confidence_head_with_markov and c.confidence_in_dim == 144
    assert DSparkConfig.from_dict(c.to_dict()) == c
    tgt = LingConfig.from_json(TARGET_DIR)
    c.check_fits_target(tgt.hidden_size, tgt.num_hidden_layers, tgt.vocab_size)


@pytest.mark.parametrize("nest", ["dspark_config", "dflash_config"])
def test_config_nested(nest):
    raw = _raw_cfg()
    keys = ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "markov_rank",
            "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
    nested = {k: raw.pop(k) for k in keys}
    nested["block_size"] = 4
    raw[nest] = nested
    c = DSparkConfig.from_dict(raw)
    assert c.block_size == 4 and c.mask_token_id == 511 and c.target_layer_ids == (1, 2, 4, 5, 6)
    assert c.markov_rank == 16 and c.confidence_head_with_markov


def test_config_defaults():
    raw = {k: v for k, v in _raw_cfg().items()
           if k not in ("block_size", "target_layer_ids", "num_target_layers", "markov_rank",
                        "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")}
    c = DSparkConfig.from_dict(raw)
    assert c.block_size == 8 and c.target_layer_ids == (1, 11, 23, 29, 35)
    assert not c.has_markov and not c.enable_confidence_head


def test_config_errors():
    with pytest.raises(DSparkConfigError, match="markov_head_type"):
        DSparkConfig.from_dict(dict(_raw_cfg(), markov_head_type="gated"))
    with pytest.raises(DSparkConfigError, match="attention_bias"):
        DSparkConfig.from_dict(dict(_raw_cfg(), attention_bias=True))
    with pytest.raises(DSparkConfigError, match="strictly increasing"):
        DSparkConfig.from_dict(dict(_raw_cfg(), target_layer_ids=[2, 1, 4, 5, 6]))
    with pytest.raises(DSparkConfigError, match="out of range"):
        DSparkConfig.from_dict(dict(_raw_cfg(), target_layer_ids=[1, 2, 4, 5, 8]))  # num_target_layers 8
    with pytest.raises(DSparkConfigError, match="missing"):
        DSparkConfig.from_dict({k: v for k, v in _raw_cfg().items() if k != "intermediate_size"})
    assert issubclass(DSparkConfigError, ValueError)


def test_check_fits_target(draft_cfg):
    with pytest.raises(ValueError, match="hidden_size 128 != target hidden_size 256"):
        draft_cfg.check_fits_target(256, 8, 512)
    with pytest.raises(ValueError, match="out of range"):
        draft_cfg.replace(num_target_layers=None).check_fits_target(128, 6, 512)  # layer 6 needs >= 7 layers
    with pytest.raises(ValueError, match="vocab_size"):
        draft_cfg.check_fits_target(128, 8, 1024)


def test_ling3_flash_preset_fits():
    c = dspark_for_ling3_flash()
    t = preset("ling3-flash")
    c.check_fits_target(t.hidden_size, t.num_hidden_layers, t.vocab_size)
    assert c.tap_dim == 12800 and c.confidence_in_dim == 2560 + 256
    # abstract build only (about 0.6 B params without embed / lm_head)
    m = nnx.eval_shape(lambda: DSparkDraft(c, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
    assert 5e8 < n < 7e8
