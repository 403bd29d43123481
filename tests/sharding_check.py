"""Multi-device sharding checks, run by tests/test_sharding.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=4 (the pytest process has already initialised jax
with one CPU device). Prints one JSON object on the last stdout line.

Usage: python tests/sharding_check.py [golden|random|errors ...]
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from conftest import DSPARK_TINY, LING_TINY  # noqa: E402  (also: x64 on, matmul precision highest)
from helpers import random_model, rel, tiny_config  # noqa: E402
from lingjax import sharding  # noqa: E402
from lingjax.cache import init_cache  # noqa: E402
from lingjax.dspark_config import DSparkConfig  # noqa: E402
from lingjax.model.dspark import DSparkDraft, from_safetensors  # noqa: E402
from lingjax.sampling import SamplingArrays, SamplingParams  # noqa: E402
from lingjax.spec_decode import Decoder, SpecConfig  # noqa: E402
from lingjax.weights import load_hf_model  # noqa: E402

DT = jnp.float32
MAX_NEW = 10
GREEDY = SamplingArrays.from_params(SamplingParams())


def golden_pair():
    return load_hf_model(LING_TINY, dtype=DT), from_safetensors(DSPARK_TINY, dtype=DT)


def random_pair():
    """4 heads / 4 kv heads everywhere so tp=4 divides every sharded dim; 2 layers (fast compile)."""
    cfg = tiny_config(num_hidden_layers=2, layer_group_size=2, first_k_dense_replace=1, vocab_size=64,
                      hidden_size=64, intermediate_size=64, num_experts=4, n_group=2, topk_group=1,
                      num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=16, kv_lora_rank=16,
                      qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    model = random_model(cfg, DT, seed=3, with_mtp=False)
    dc = DSparkConfig.from_dict(dict(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
        intermediate_size=64, vocab_size=64, block_size=8, mask_token_id=63, target_layer_ids=[0, 1],
        markov_rank=4, enable_confidence_head=True, confidence_head_with_markov=True))
    return model, DSparkDraft(dc, dtype=DT, rngs=nnx.Rngs(5))


def forward_logits(model, prompt, mesh=None):
    cache = init_cache(model.cfg, 1, 32, DT)
    if mesh is not None:
        cache = sharding.shard_cache(cache, model.cfg, mesh)
    graph, params = nnx.split(model)

    @jax.jit
    def fwd(params, tokens, cache):
        m = nnx.merge(graph, params)
        out = m(tokens, cache, logits="all")
        return out.logits, out.cache

    logits, new_cache = fwd(params, jnp.asarray(prompt, jnp.int32)[None], cache)
    return np.asarray(logits), new_cache


def spec_tokens(model, draft, method):
    dec = Decoder(model, SpecConfig(method, 8), draft=draft if method == "dspark" else None)
    prompt = jnp.asarray(PROMPT, jnp.int32)[None]
    cost = jnp.ones(len(dec.spec.widths), jnp.float32)
    state = dec.prefill(dec.params, prompt, MAX_NEW, jnp.int32(MAX_NEW), jax.random.key(0), GREEDY, cost)
    state = dec.run(dec.params, state, GREEDY, None, jnp.int32(10_000))
    return np.asarray(state.out)[: int(state.n_out)].tolist(), state


PROMPT = [5, 17, 3, 42, 9, 11, 2, 30, 7, 25, 13, 8]


def param_report(model, mesh):
    """Spec + per-device shard shape of a few representative params; also check every param's
    addressable shards have the shape implied by its sharding."""
    flat = dict((".".join(map(str, p)), v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model)))
    bad = [k for k, a in flat.items()
           if any(s.data.shape != a.sharding.shard_shape(a.shape) for s in a.addressable_shards)
           or a.sharding.mesh.shape != mesh.shape]
    pick = {}
    for k in ("embed", "lm_head", "layers.0.attn.w_in", "layers.7.mlp.w_gate_up", "layers.1.mlp.w_gate_up",
              "layers.3.attn.kv_b", "layers.1.attn.kv_b"):
        if k in flat:
            a = flat[k]
            pick[k] = dict(spec=[None if s is None else str(s) for s in a.sharding.spec], shape=list(a.shape),
                           shard=list(a.addressable_shards[0].data.shape), ndev=len(a.sharding.device_set))
    return dict(bad=bad, params=pick)


def run_meshes(pair_fn, meshes):
    t0 = time.time()
    model, draft = pair_fn()
    ref_logits, _ = forward_logits(model, PROMPT)
    ref = {m: spec_tokens(model, draft, m)[0] for m in ("dspark", "none")}
    res = dict(ref=ref, ref_s=time.time() - t0, meshes={})
    for tp, ep in meshes:
        t1 = time.time()
        mesh = sharding.make_mesh(tp, ep, jax.devices()[: tp * ep])
        model, draft = pair_fn()
        sharding.shard_model(model, mesh)
        sharding.shard_model(draft, mesh)
        logits, cache = forward_logits(model, PROMPT, mesh)
        kda = [layer.state for layer in cache.layers if hasattr(layer, "state")][0]
        r = dict(rel=rel(logits, ref_logits), argmax_equal=bool((logits.argmax(-1) == ref_logits.argmax(-1)).all()),
                 kda_in_spec=[None if s is None else str(s) for s in
                              sharding.cache_shardings(init_cache(model.cfg, 1, 4, DT), model.cfg, mesh).layers[0].state.spec],
                 kda_out_ndev=len(kda.sharding.device_set))
        for m in ("dspark", "none"):
            toks, state = spec_tokens(model, draft, m)
            r[m] = toks
            r[m + "_equal"] = toks == ref[m]
            if m == "dspark":
                r["draft_cache_ndev"] = len(state.draft_cache.k[0].sharding.device_set)
                r["draft_cache_spec"] = str(state.draft_cache.k[0].sharding)
        r.update(param_report(model, mesh))
        r["s"] = time.time() - t1
        res["meshes"][f"{tp}x{ep}"] = r
    return res


def errors():
    out = {}
    model, draft = golden_pair()
    mesh = sharding.make_mesh(4, 1)
    for name, m in (("target", model), ("draft", draft)):
        try:
            sharding.shard_model(m, mesh)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    # the failed attempt left the model unsharded (all shardings are checked before moving)
    out["untouched"] = len(model.embed.get_value().sharding.device_set) == 1
    try:
        sharding.make_mesh(3, 1)  # 4 devices available
        out["mesh"] = None
    except ValueError as e:
        out["mesh"] = str(e)
    try:
        sharding.shard_model(model, sharding.make_mesh(1, 4, jax.devices()[:4]))  # 16 experts / 4: fine
        out["ep4"] = "ok"
    except ValueError as e:
        out["ep4"] = str(e)
    return out


def main(argv):
    what = argv or ["golden", "random", "errors"]
    res = dict(devices=jax.device_count())
    t0 = time.time()
    if "golden" in what:
        res["golden"] = run_meshes(golden_pair, [(1, 1), (2, 1), (1, 2), (2, 2)])
    if "random" in what:
        res["random"] = run_meshes(random_pair, [(4, 1)])
    if "errors" in what:
        res["errors"] = errors()
    res["total_s"] = time.time() - t0
    print(json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1:])
