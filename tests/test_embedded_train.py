"""The embedded-model trainer: a CPU smoke run end to end (train -> files -> load -> evaluate), and
checks that the training graphs compute what inference computes (draft blocks vs the real
context-cache path, the dense MoE patch vs the model's expert paths, the data split)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lingjax.cache import init_cache
from lingjax.embedded import config as ecfg
from lingjax.embedded.data import WindowSampler, encode_bytes, is_heldout, list_sources, stdlib_root
from lingjax.embedded.dense_moe import dense_moe_experts
from lingjax.embedded.load import load_embedded, save_embedded
from lingjax.embedded.train import draft_blocks, markov_teacher_forced
from lingjax.model.dspark import DSparkDraft, block_token_ids
from lingjax.model.ling import LingModel
from lingjax.tokenizer import build_byte_level_tokenizer

ROOT = Path(__file__).resolve().parents[1]
# Fast CPU compiles for the subprocesses (they run a few steps; code quality does not matter).
ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
           XLA_FLAGS="--xla_backend_optimization_level=0")


def _run(*args):
    r = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"{args[0]} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def test_smoke_train_load_evaluate(tmp_path):
    out = tmp_path / "w"
    _run("lingjax.embedded.train", "--out", str(out), "--smoke")
    for name in ("target.safetensors", "draft.safetensors", "target_config.json", "draft_config.json",
                 "tokenizer.json", "train_log.json"):
        assert (out / name).is_file(), name
    log = json.loads((out / "train_log.json").read_text())
    assert log["seed"] == 0 and log["target"]["steps"] == 8 and log["draft"]["steps"] == 6
    for phase in ("target", "draft"):
        hist = log[phase]["history"]
        assert all(math.isfinite(h["loss"]) for h in hist), hist
    t_hist = log["target"]["history"]
    assert t_hist[-1]["ce"] < t_hist[0]["ce"], t_hist

    target, draft, tok = load_embedded(jnp.float32, directory=out)
    assert isinstance(target, LingModel) and isinstance(draft, DSparkDraft)
    assert target.cfg.vocab_size == tok.vocab_size == ecfg.VOCAB_SIZE
    assert draft.cfg.mask_token_id == tok.token_to_id("<|mask|>")
    assert target.cfg.eos_token_id == tok.token_to_id("<|endoftext|>")
    assert sum(x.size for x in jax.tree.leaves(nnx.state(target))) == log["target"]["parameters"]
    assert target.layers[0].attn.A_log.get_value().dtype == jnp.float32

    res_file = tmp_path / "eval.json"
    _run("lingjax.embedded.evaluate", "--dir", str(out), "--out", str(res_file), "--seq", "64",
         "--windows-per-file", "1", "--batch", "4", "--prompts", "2", "--prompt-len", "32", "--max-new", "12",
         "--max-files", "12")
    res = json.loads(res_file.read_text())
    assert 0 < res["bits_per_byte"] < 16 and 0 < res["unigram_bits_per_byte"] < 8
    for method in ("dspark", "mtp"):
        assert res[method]["prompts"] == 2
        assert 1.0 <= res[method]["accept_length"] <= res[method]["block"] + 1


def test_missing_weights_message(tmp_path):
    try:
        load_embedded(directory=tmp_path)
    except FileNotFoundError as e:
        assert "lingjax.embedded.train" in str(e)
    else:
        raise AssertionError("load_embedded on an empty directory did not raise")


def _small_models():
    tcfg, dcfg = ecfg.smoke_configs()
    target = LingModel(tcfg, dtype=jnp.float32, rngs=nnx.Rngs(1))
    draft = DSparkDraft(dcfg, dtype=jnp.float32, rngs=nnx.Rngs(2))
    return target, draft


def test_draft_training_blocks_match_inference_path():
    """The vmapped training blocks (one context cache per window, length = anchor) equal the
    inference path: append_context of the taps before the anchor, forward_block, the greedy chain."""
    target, draft = _small_models()
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 256, size=(2, 40)), jnp.int32)
    anchors = jnp.asarray([[3, 17, 30], [1, 9, 32]], jnp.int32)
    got = jax.jit(lambda t, a: draft_blocks(draft, target, t, a))(tokens, anchors)
    bk = draft.cfg.block_size
    full = jax.jit(lambda t: target(t, init_cache(target.cfg, 2, 40, jnp.float32, with_mtp=False),
                                    tap_layers=draft.cfg.target_layer_ids))(tokens)

    @jax.jit
    def reference(taps, anchor, a):
        cache = draft.append_context(draft.init_cache(1, 64), taps, 0, count=a)   # positions < a only
        ids = block_token_ids(anchor, bk, draft.cfg.mask_token_id)
        hidden = draft.forward_block(cache, target.embed_tokens(ids), a)
        return hidden, draft.propose_greedy(hidden, anchor, target.lm_head[...].T)

    for row in range(2):
        for j, a in enumerate(np.asarray(anchors[row])):
            anchor = tokens[row, a][None]
            hidden, prop = reference(full.taps[row:row + 1], anchor, jnp.int32(a))
            np.testing.assert_allclose(got.hidden[row, j], hidden[0], rtol=2e-4, atol=2e-4)
            # Markov / confidence formulas: teacher forcing with the draft's own chain = propose_greedy
            prev = jnp.concatenate([anchor, prop.tokens[0, :-1]])
            corr, conf = markov_teacher_forced(draft, hidden[0], prop.base_logits[0], prev)
            np.testing.assert_allclose(corr, prop.corrected_logits[0], rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(conf, prop.confidence_logits[0], rtol=1e-4, atol=1e-4)
            # labels: the target's argmax at positions a..a+Bk-1; prev: anchor then the labels
            np.testing.assert_array_equal(got.labels[row, j], jnp.argmax(full.logits[row, a:a + bk], -1))
            np.testing.assert_array_equal(got.prev[row, j], jnp.concatenate([anchor, got.labels[row, j, :-1]]))


def test_dense_moe_patch_is_exact():
    target, _ = _small_models()
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, size=(2, 48)), jnp.int32)
    cache = init_cache(target.cfg, 2, 48, jnp.float32)
    ref = jax.jit(lambda t: target(t, cache).logits)(tokens)    # 96 tokens: the capacity path
    rec = []

    def patched(t):
        with dense_moe_experts(rec):
            return target(t, cache).logits
    got = jax.jit(patched)(tokens)
    assert len(rec) == target.cfg.num_hidden_layers - target.cfg.first_k_dense_replace
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_save_load_roundtrip(tmp_path):
    target, draft = _small_models()
    save_embedded(tmp_path, target, draft)
    t2, d2, _ = load_embedded(jnp.float32, directory=tmp_path)
    for a, b in ((target, t2), (draft, d2)):
        fa, fb = dict(nnx.to_flat_state(nnx.state(a))), dict(nnx.to_flat_state(nnx.state(b)))
        assert fa.keys() == fb.keys()
        for k in fa:
            x, y = np.asarray(fa[k].get_value()), np.asarray(fb[k].get_value())
            np.testing.assert_allclose(y, x, rtol=1e-2, atol=1e-6, err_msg=str(k))
    # float32 parameters of the bf16 model (A_log, dt_bias, expert_bias) are stored exactly
    np.testing.assert_array_equal(t2.layers[0].attn.A_log.get_value(), target.layers[0].attn.A_log.get_value())


def test_data_split_and_sampler():
    files = list_sources()
    assert files == sorted(files) and len(files) > 100
    assert not any(part in ("test", "site-packages") for f in files for part in f.split("/")[:-1])
    held = [f for f in files if is_heldout(f)]
    assert 0 < len(held) < len(files) // 5
    assert held == [f for f in files if is_heldout(f)]
    data = (stdlib_root() / files[0]).read_bytes()[:3000]
    assert encode_bytes(data).tolist() == build_byte_level_tokenizer().encode(data.decode("utf-8", "ignore")).ids \
        or not data.isascii()
    toks = np.arange(1000, dtype=np.uint16)
    a, b = WindowSampler(toks, 3, 50, 7).next(), WindowSampler(toks, 3, 50, 7).next()
    np.testing.assert_array_equal(a, b)
    assert a.shape == (3, 50) and np.all(np.diff(a, axis=1) == 1)
