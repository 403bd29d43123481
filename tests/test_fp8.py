"""Weight-only block fp8 (lingjax/quant.py): format against the converter's numpy quantiser and the
checkpoint dequantiser, gathered-expert dequantisation, and an fp8 model computing exactly what the
same model with the dequantised weights computes (prefill, decode, speculative greedy)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from checkpoints_convert.fp8 import quantize_block_fp8
from helpers import golden_model, rel
from lingjax.cache import init_cache
from lingjax.checkpoint import dequantize_fp8
from lingjax.param_layout import Matrix
from lingjax.quant import FP8, Fp8Weight, dequantize, fp8_weights, quantize, quantize_model, take_rows
from lingjax.sampling import SamplingArrays, SamplingParams
from lingjax.spec_decode import Decoder, SpecConfig

F32 = jnp.float32


@pytest.mark.parametrize("shape,view,block", [
    ((256, 384), Matrix((), (0,), (1,)), (128, 128)),            # divisible: broadcast form
    ((200, 3, 70), Matrix((1,), (0,), (2,)), (128, 64)),         # ragged blocks, a stack axis
    ((6, 64, 2, 48), Matrix((0, 2), (1,), (3,)), (32, 16)),      # experts [E, D, 2, F]
    ((4, 8, 96), Matrix((), (0, 1), (2,)), (16, 32)),            # in split over two axes
])
def test_quantize_matches_published_recipe(shape, view, block):
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, shape).astype(np.float32)
    w[(0,) * len(shape)] = 0.0
    values, scale = quantize(jnp.asarray(w), view, block)
    assert values.dtype == FP8 and values.shape == shape
    # the converter's recipe on each published [out, in] matrix: same values and scales
    perm = view.stack + view.in_ + view.out
    stack = [shape[a] for a in view.stack]
    n_in = int(np.prod([shape[a] for a in view.in_]))
    mats = np.transpose(w, perm).reshape(-1, n_in, int(np.prod([shape[a] for a in view.out])))
    qv = np.transpose(np.asarray(values), perm).reshape(mats.shape)
    sv = np.asarray(scale).reshape(-1, *scale.shape[len(stack):])
    for i, m in enumerate(mats):
        q_ref, s_ref = quantize_block_fp8(m.T, (block[1], block[0]))
        np.testing.assert_array_equal(qv[i].T.astype(np.float32), q_ref.astype(np.float32))
        np.testing.assert_allclose(sv[i].T, s_ref, rtol=2e-7)   # XLA may divide by 448 as * (1/448)
    fp8 = {"stack": view.stack, "in": view.in_, "out": view.out, "block": block}
    ref = dequantize_fp8(np.asarray(values), np.asarray(scale), fp8, np.float32, xp=np)
    got = dequantize(values, scale, view, block, F32)
    np.testing.assert_array_equal(np.asarray(got), ref)
    assert rel(got, w) < 0.05                                   # e4m3: ~2-3% relative error


def test_take_rows_dequantises_only_the_gathered_experts():
    rng = np.random.default_rng(1)
    view = Matrix((0, 2), (1,), (3,))
    w = jnp.asarray(rng.normal(size=(8, 64, 2, 48)), F32)
    values, scale = quantize(w, view, (32, 16))
    fw = Fp8Weight(values, scale, view=view, block=(32, 16), dtype=F32, logical=("experts", "embed", None, "mlp"))
    idx = jnp.asarray([[3, 0], [7, 3], [1, 1]], jnp.int32)
    full = fw[...]
    np.testing.assert_array_equal(np.asarray(take_rows(fw, idx)), np.asarray(full)[np.asarray(idx)])
    np.testing.assert_array_equal(np.asarray(take_rows(fw, jnp.int32(5))), np.asarray(full)[5])
    with pytest.raises(TypeError, match="take_rows"):
        fw[0]


def _fp8_and_dequantised():
    """(fp8 model, the same model with each fp8 weight replaced by its dequantised values)."""
    q = quantize_model(nnx.clone(golden_model("float32")))
    d = nnx.clone(q)
    for path, fw in fp8_weights(q):
        owner = d
        for p in path[:-1]:
            owner = owner[p] if isinstance(p, int) else getattr(owner, p)
        setattr(owner, path[-1], nnx.Param(fw[...], logical=tuple(fw.values.get_metadata()["logical"])))
    return q, d


def test_quantised_params_are_the_published_set():
    q, _ = _fp8_and_dequantised()
    names = {p[-1] for p, _ in fp8_weights(q)}
    assert {"w_in", "w_out", "w_gate_up", "w_down", "kv_a", "dense"} <= names
    assert not names & {"embed", "lm_head", "router", "conv", "A_log", "dt_bias", "expert_bias"}
    assert not names & {"w_beta", "g_proj", "kv_b"}    # stored as fp8, held dequantised (LING_DEQUANTISED_AT_LOAD)
    assert isinstance(q.embed, nnx.Param) and q.embed[...].dtype == F32


def test_fp8_model_equals_model_with_dequantised_weights():
    q, d = _fp8_and_dequantised()
    ids = jnp.asarray(np.random.default_rng(2).integers(0, q.cfg.vocab_size, (1, 70)), jnp.int32)
    outs = []
    for m in (q, d):
        cache = init_cache(m.cfg, 1, 96, F32)
        o = m(ids, cache)                                     # prefill: chunked KDA, capacity-path MoE
        o2 = m(ids[:, :1], o.cache)                           # decode: recurrent KDA, gathered MoE
        o3 = m(ids[:, :5], o2.cache, pending=True)            # verify block
        outs.append((o.logits, o2.logits, o3.logits))
    for a, b in zip(*outs):
        assert rel(a, b) < 1e-6
    full = golden_model("float32")(ids, init_cache(q.cfg, 1, 96, F32)).logits
    assert 1e-4 < rel(outs[0][0], full) < 0.5                 # fp8 really changed the weights


def test_fp8_speculative_greedy_equals_plain_greedy():
    q, _ = _fp8_and_dequantised()
    greedy = SamplingArrays.from_params(SamplingParams())
    prompt = jnp.asarray(np.random.default_rng(3).integers(0, q.cfg.vocab_size, (1, 21)), jnp.int32)
    toks = {}
    for method in ("none", "mtp"):
        dec = Decoder(q, SpecConfig(method, 4))
        st = dec.prefill(dec.params, prompt, 12, jnp.int32(12), jax.random.key(0), greedy,
                         jnp.ones((len(dec.spec.widths),), F32))
        st = dec.run(dec.params, st, greedy, None, 64)
        toks[method] = np.asarray(st.out)[: int(st.n_out)].tolist()
    assert len(toks["none"]) == 12 and toks["mtp"] == toks["none"]


def test_fp8_param_shardings_follow_the_weight():
    from lingjax import sharding
    q, _ = _fp8_and_dequantised()
    mesh = sharding.make_mesh(1, 1, jax.devices()[:1])
    sh = sharding.param_shardings(q, mesh)
    P = jax.sharding.PartitionSpec
    assert sh[("layers", 3, "mlp", "w_gate_up", "values")].spec == P(None, None, ("ep", "tp"), None)
    assert sh[("layers", 3, "mlp", "w_gate_up", "scale_inv")].spec == jax.sharding.PartitionSpec(None, None, None, None)


@pytest.mark.parametrize("shape,view,block", [((4, 2, 48, 64), Matrix((0, 1), (3,), (2,)), (32, 16)),
                                              ((4, 64, 48), Matrix((0,), (2,), (1,)), (16, 16)),
                                              ((64, 48), Matrix((), (0,), (1,)), (32, 16))])
def test_dequantize_in_place_equals_the_transposing_form(shape, view, block):
    """One in and one out axis in whole blocks take the in-place form: bit-identical to the general
    (transposing) one in the compute dtype; slice_rows gives take_rows' rows."""
    from lingjax.quant import _dequantize_in_place, _dequantize_transposing, slice_rows
    w = jnp.asarray(np.random.default_rng(3).normal(size=shape), F32)
    values, scale = quantize(w, view, block)
    for dt in (jnp.bfloat16, F32):
        a = _dequantize_in_place(values, scale, view, block, dt)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(_dequantize_transposing(values, scale, view, block, dt)))
        np.testing.assert_array_equal(np.asarray(dequantize(values, scale, view, block, dt)), np.asarray(a))
    if view.stack:
        fw = Fp8Weight(values, scale, view=view, block=block, dtype=F32, logical=(None,) * len(shape))
        np.testing.assert_array_equal(np.asarray(slice_rows(fw, jnp.int32(1), 2)),
                                      np.asarray(take_rows(fw, jnp.arange(1, 3))))
