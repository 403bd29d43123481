"""Static bounds on the RMSNorm outputs the fp8 kernels take as x_bound (session 24).

`rms_norm_bound` must bound |rms_norm(x, w)| for every x (else a kernel's f16 input overflows);
`record_input_bounds` (run by set_dense_kernel / set_moe_kernel) records it on every norm; the
layers then pass it to the kernels, which drop their per-call reduction over x."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import kernel_mode, primitive_calls, random_model, tiny_config
from lingjax.model.common import RMSNorm, record_input_bounds, rms_norm, rms_norm_bound
from lingjax.model.dense import set_dense_kernel
from lingjax.cache import MLAState
from lingjax.model import dense as dense_proj
from lingjax.model.kda import KDA
from lingjax.model.mla import GatedMLA, mla_output_bound
from lingjax.model.mlp import set_moe_kernel
from lingjax.quant import Fp8Weight, quantize_model

CFG = tiny_config(num_hidden_layers=4, vocab_size=256, qk_nope_head_dim=48, v_head_dim=64,
                  moe_intermediate_size=128)     # as tests/test_dense_kernel_switch.py: shapes the kernels take


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("n", [128, 2560])
def test_bound_holds_for_spiky_and_flat_inputs(n, dtype):
    """The worst input is one large element (its normalised size is sqrt(n)); the bound holds for it
    and for random, flat and tiny rows, with random signed weights, in bf16 and float32."""
    rng = np.random.default_rng(n)
    w = jnp.asarray(rng.normal(0, 3, n), dtype)
    spike = np.zeros((4, n), np.float32)
    spike[0, 7] = 1e4
    spike[1, 0] = -3.0
    spike[2, n - 1] = 1e-3
    spike[3] = 1e-3
    spike[3, 5] = 1.0
    rows = np.concatenate([spike, rng.normal(0, 1, (4, n)), np.ones((1, n)), rng.normal(0, 1e-4, (1, n))])
    x = jnp.asarray(rows, dtype)
    bound = rms_norm_bound(w)
    assert isinstance(bound, float)
    assert bound == pytest.approx(2 * np.sqrt(n) * np.abs(np.asarray(w, np.float64)).max())
    for eps in (0.0, 1e-6):
        y = np.abs(np.asarray(rms_norm(x, w, eps), np.float64))
        assert y.max() <= bound
    # tight within the factor 2: the spike at the weight's largest element reaches ~bound / 2
    top = int(np.argmax(np.abs(np.asarray(w, np.float32))))
    one = np.zeros((1, n), np.float32)
    one[0, top] = 5.0
    y = float(np.abs(np.asarray(rms_norm(jnp.asarray(one, dtype), w, 0.0), np.float64)).max())
    assert bound / 2 * 0.98 <= y <= bound


def test_bound_of_abstract_or_zero_weights():
    assert rms_norm_bound(jax.ShapeDtypeStruct((64,), jnp.bfloat16)) is None
    assert rms_norm_bound(jnp.zeros((64,), jnp.bfloat16)) == 0.0


def test_mla_output_bound_of_abstract_or_zero_weights():
    w = jnp.ones((64,), jnp.bfloat16)
    assert mla_output_bound(jax.ShapeDtypeStruct((64,), jnp.bfloat16), jnp.ones((64, 2, 8)), 4) is None
    assert mla_output_bound(w, jax.ShapeDtypeStruct((64, 2, 8), jnp.bfloat16), 4) is None
    assert mla_output_bound(w, jnp.zeros((64, 2, 8), jnp.bfloat16), 4) == 0.0
    kv_b = np.zeros((64, 2, 8), np.float32)
    kv_b[:, 1, 5] = -0.5                        # W_uv column (h 1, v 1): l1 norm 32
    kv_b[:, 0, 0] = 9.0                         # a W_uk column: not part of the bound
    assert mla_output_bound(w, jnp.asarray(kv_b), 4) == pytest.approx(rms_norm_bound(w) * 32)


def test_mla_output_bound_holds_in_the_layer(monkeypatch):
    """|o| at the gated MLA's output projection stays within the layer's recorded o_bound, over a
    spiky prompt (a few huge hidden values: the latent norm's outputs near their bound) and the
    decode / verify blocks after it, on the absorbed and expanded attention paths."""
    model = random_model(CFG, jnp.bfloat16, seed=5)
    layer = next(m for _, m in nnx.iter_modules(model) if isinstance(m, GatedMLA))
    rng = np.random.default_rng(1)
    lat_w = layer.kv_a_norm.weight
    lat_w.set_value(jnp.asarray(rng.normal(0, 2, lat_w.shape), lat_w.dtype))   # signed, > 1
    record_input_bounds(model)
    assert layer.o_bound is not None and layer.o_bound > 0
    seen = []

    def capture(x, weight, *, k_axes=1, out_dtype=None, x_bound=None):
        seen.append((float(jnp.abs(x.astype(jnp.float32)).max()), x_bound))
        return jnp.einsum("bthv,hvd->btd", x, weight[...])

    monkeypatch.setattr(GatedMLA, "_kernel", lambda self, name, tokens: name == "dense")
    monkeypatch.setattr(dense_proj, "dense_matmul", capture)
    cfg = layer.cfg
    cache = MLAState(jnp.zeros((1, 64, cfg.kv_lora_rank), jnp.bfloat16),
                     jnp.zeros((1, 64, cfg.qk_rope_head_dim), jnp.bfloat16))
    x = rng.normal(0, 1, (1, 40, cfg.hidden_size)).astype(np.float32)
    x[0, ::7, 3] = 3e3                                                  # spikes
    x = jnp.asarray(x, jnp.bfloat16)
    pos = 0
    for t in (24, 1, 9, 5):                  # a long prefix (expanded path) then short blocks
        _, cache = layer(x[:, pos:pos + t], cache, jnp.int32(pos))
        pos += t
    assert len(seen) == 4 and all(b == layer.o_bound for _, b in seen)
    top = max(m for m, _ in seen)
    assert 0 < top <= layer.o_bound, (top, layer.o_bound)


def test_record_sets_every_norm_and_the_kda_output_norm():
    model = random_model(CFG, jnp.bfloat16)
    norms = [m for _, m in nnx.iter_modules(model) if isinstance(m, RMSNorm)]
    kdas = [m for _, m in nnx.iter_modules(model) if isinstance(m, KDA)]
    assert norms and kdas     # recorded at construction (LingModel runs set_dense_kernel), from the init weights
    assert all(m.bound is not None for m in norms) and all(k.o_bound is not None for k in kdas)
    norms[0].weight.set_value(norms[0].weight.get_value() * -4.0)      # signed, larger: its own bound
    record_input_bounds(model)                                         # after a weight change: recorded again
    for m in norms:
        w = np.abs(np.asarray(m.weight.get_value(), np.float64))
        assert m.bound == pytest.approx(2 * np.sqrt(w.size) * w.max())
    assert norms[0].bound == pytest.approx(4 * norms[1].bound * np.sqrt(norms[0].weight.size / norms[1].weight.size))
    for k in kdas:
        assert k.o_bound == pytest.approx(2 * np.sqrt(CFG.head_dim))


@pytest.mark.parametrize("setter", ["dense", "moe"])
def test_kernel_switches_record_the_bounds(setter):
    model = quantize_model(random_model(CFG, jnp.bfloat16))
    if setter == "dense":
        set_dense_kernel(model, "pallas")
    else:
        set_moe_kernel(model, "pallas")
    assert all(m.bound is not None for _, m in nnx.iter_modules(model) if isinstance(m, RMSNorm))
    assert all(m.o_bound is not None for _, m in nnx.iter_modules(model) if isinstance(m, (KDA, GatedMLA)))


def _reduce_max_count(model, tokens, cache, **kw):
    return primitive_calls(lambda t, c: model(t, c, **kw), tokens, cache, name="reduce_max")


def test_bounds_remove_the_kernels_input_reductions():
    """With the bounds recorded, the fp8 projections' inputs need no max over x: every norm-fed
    projection of a verify block and MLA's output projection (`mla_output_bound`) lose their
    reduce_max (the rest, e.g. the MoE down projection's inputs, keep theirs), and the logits do
    not move beyond the f32 summation order."""
    model = quantize_model(random_model(CFG, jnp.bfloat16, bias_std=1.0, seed=3))
    set_moe_kernel(model, "pallas")
    set_dense_kernel(model, "pallas")
    cache = model.init_cache(1, 32)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (1, 9)), jnp.int32)
    with_bounds = _reduce_max_count(model, tokens, cache, pending=True)
    with kernel_mode():
        out = jax.jit(lambda t, c: model(t, c, pending=True))(tokens, cache).logits
    for _, m in nnx.iter_modules(model):
        if isinstance(m, RMSNorm):
            m.bound = None
        if isinstance(m, (KDA, GatedMLA)):
            m.o_bound = None
    without = _reduce_max_count(model, tokens, cache, pending=True)
    with kernel_mode():
        ref = jax.jit(lambda t, c: model(t, c, pending=True))(tokens, cache).logits
    # the bounded fp8 kernel inputs of this model (dense_kernel_plan): KDA w_in and w_out (3
    # layers), the dense MLPs' w_gate_up (2 layers), MLA q_proj and dense (1 layer), the MoE
    # experts (2 layers); kv_a and the shared experts stay on XLA by the rule, lm_head is bf16
    assert not isinstance(model.lm_head, Fp8Weight)
    assert without - with_bounds == 2 * 3 + 2 + 2 + 2, (without, with_bounds)
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-3 * np.abs(ref).max())
