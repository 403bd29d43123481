"""Prompts padded to a compiled bucket (valid_len masking) give exactly the unpadded results."""
import jax
import jax.numpy as jnp
import numpy as np

from conftest import DSPARK_TINY
from helpers import golden, golden_model
from lingjax.cache import KDAState, init_cache
from lingjax.model.dspark import from_safetensors
from lingjax.sampling import SamplingArrays, SamplingParams
from lingjax.spec_decode import Decoder, SpecConfig


def test_padded_forward_leaves_the_same_cache():
    model = golden_model("float64")
    ids = jnp.asarray(golden()["long_ids"][:, :37], jnp.int32)
    padded = jnp.concatenate([ids, jnp.full((1, 27), 5, jnp.int32)], axis=1)
    ref = model(ids, init_cache(model.cfg, 1, 64, jnp.float64), logits="all")
    out = model(padded, init_cache(model.cfg, 1, 64, jnp.float64), logits="all", valid_len=jnp.int32(37))
    assert int(out.cache.pos) == 37
    np.testing.assert_allclose(out.logits[:, :37], ref.logits, rtol=1e-10, atol=1e-10)
    for a, b in zip(out.cache.layers, ref.cache.layers):
        if isinstance(a, KDAState):
            np.testing.assert_allclose(a.state, b.state, rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(a.conv, b.conv, rtol=1e-12, atol=1e-14)
        else:   # MLA: real positions identical, the padded tail is junk that later writes overwrite
            np.testing.assert_allclose(a.latent[:, :37], b.latent[:, :37], rtol=1e-12, atol=1e-14)


def test_padded_prefill_decodes_identically():
    model = golden_model("float64")
    draft = from_safetensors(DSPARK_TINY, dtype=jnp.float64)
    samp = SamplingArrays.from_params(SamplingParams())
    ids = golden()["long_ids"][0]
    for spec in (SpecConfig("none"), SpecConfig("dspark", 8)):
        dec = Decoder(model, spec, draft=draft if spec.method == "dspark" else None)
        for t in (37, 50):
            outs = []
            for pad in (0, 64 - t):
                prompt = jnp.asarray(np.concatenate([ids[:t], np.zeros(pad, int)])[None], jnp.int32)
                st = dec.prefill(dec.params, prompt, 16, jnp.int32(16), jax.random.key(0), samp,
                                 jnp.ones((len(spec.widths),), jnp.float32), prompt_len=jnp.int32(t))
                st = dec.run(dec.params, st, samp, None, 100)
                outs.append(np.asarray(st.out[:int(st.n_out)]))
            np.testing.assert_array_equal(outs[0], outs[1])
