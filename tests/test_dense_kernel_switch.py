"""The `dense_kernel` switch ('xla' default | 'pallas'): which projections use the skinny GEMM
(static rule, at the Ling-3.0-flash shapes and at a small config), and a small Ling model giving
the same logits on both for decode (T = 1) and a pending verify block (T = 9).

The kernel needs K % 128 == 0 and N % 64 == 0, so the small config is the golden tiny config with
4 layers (two dense-MLP KDA layers, a MoE KDA layer, a MoE MLA layer), vocab 256, qk_nope_head_dim
48 and v_head_dim 64 (q_proj [128, 2 x 64], dense [2 x 64, 128]) and random weights. Its kv_a
(N = 32 + 16) and shared expert (F = 32) do not fit the kernel and stay on XLA by the rule, as
does a float32 model's lm_head (never quantised). Off-GPU the kernel runs in Mosaic GPU interpret
mode (forwards traced inside `lingjax.model.kernels.pallas_interpret()`); on a GPU
(JAX_PLATFORMS=cuda) the same tests run it compiled.

Tolerance: the kernel rounds its input rows to bf16 (it computes x_bf16 @ w in float32), while a
float32 model's XLA path multiplies float32 x by the (dequantised) weight: each projection then
differs by ~2**-9 relative per input element: observed ~3e-3 relative on the logits after 4
layers with fp8 weights. With bf16 weights both paths round each projection's output to bf16
(after different float32 summation orders) and the kernel also rounds lm_head's input: ~6e-3
(the XLA model's own T = 9 vs T = 1 logits already differ by ~2e-3). TOL = 2e-2 (as for moe_kernel).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bench import kernel_module_size
from conftest import LING_TINY
from helpers import kernel_calls, kernel_forward, kernel_mode, random_model, rel, tiny_config
from lingjax.config import preset
from lingjax.dspark_config import DSparkConfig
from lingjax.generate import build_parser
from lingjax.loader import LoadError, load_engine
from lingjax.model import dense, dspark
from lingjax.model.dense import dense_kernel_plan, set_dense_kernel
from lingjax.model.dspark import DSparkDraft, draft_projections, quantize_draft
from lingjax.model.kernels import pallas_cross_lowering
from lingjax.model.ling import LingModel
from lingjax.param_layout import Matrix
from lingjax.quant import Fp8Weight, quantize, quantize_model
from lingjax.spec_decode import Decoder, SpecConfig

F32, BF16 = jnp.float32, jnp.bfloat16
CFG = tiny_config(num_hidden_layers=4, vocab_size=256, qk_nope_head_dim=48, v_head_dim=64,
                  moe_intermediate_size=128)     # 128: lets moe_kernel='pallas' in the lowering test
PROMPT = 20      # > 16 tokens: prefill stays on XLA with both switches
VERIFY = 9       # a speculative verify block
# The kernel rounds a float32 model's activations to bf16 (KDA's w_out input: ~0.6% on the logits);
# where a token's router scores nearly tie, that flips an expert and the token's logits move by
# ~20%: with seed 0 (since session 9's K-minor layouts changed the random draws) one verify token
# did (router margin 9e-4). A wide expert_bias (std 1.0) and seed 3 give a margin (the gap at the
# top-k and group boundaries of the biased scores at the verify tokens) of 6.3e-2, so TOL checks
# the rounding itself (tests/test_moe_kernel_switch.py, the same rule).
SEED, BIAS_STD = 3, 1.0
MAX_LEN = 64
TOL = 2e-2       # float32 model: the kernel rounds x to bf16 (module docstring; observed ~3e-3)

# Which weights of the small model use the kernel (the rest stay on XLA: why)
SMALL_XLA = {
    "fp8": {"kv_a": "N=48 is not a multiple of 64",
            "shared.w_gate_up": "fp8 scale blocks straddle the stacked matrices",
            "shared.w_down": "K=32 is not a multiple of 128",
            "lm_head": "float32 weights"},
    "bf16_weights": {"kv_a": "N=48 is not a multiple of 64",
                     "shared.w_down": "K=32 is not a multiple of 128"},
}


def _dense_weights(model):
    """(module, name) of every projection listed in a DENSE_WEIGHTS."""
    return [(m, name) for _, m in nnx.iter_modules(model) for name, _ in getattr(type(m), "DENSE_WEIGHTS", ())
            if getattr(m, name, None) is not None]


@functools.lru_cache(maxsize=None)
def models(kind: str):
    """(xla, pallas) twins with the same weights, float32 models. kind: 'fp8' (block-fp8 weights by
    lingjax.quant.quantize_model; lm_head stays float32), 'bf16_weights' (every listed projection,
    lm_head included, stored in bfloat16)."""
    xla = random_model(CFG, dtype=F32, seed=SEED, with_mtp=True, bias_std=BIAS_STD)
    if kind == "fp8":
        quantize_model(xla)
    else:
        for m, name in _dense_weights(xla):
            w = getattr(m, name)
            w.set_value(w.get_value().astype(BF16))
    pallas = set_dense_kernel(nnx.clone(xla), "pallas")
    return xla, pallas


def _ids():
    return jnp.asarray(np.random.default_rng(0).integers(2, CFG.vocab_size, (1, PROMPT + VERIFY)), jnp.int32)


@functools.lru_cache(maxsize=None)
def runs(kind: str):
    """Per model: prefill logits (T = PROMPT), decode logits (T = 1) and pending verify logits
    (T = VERIFY) from the XLA model's prefilled cache, and the MTP layer's output for one token
    (eh_proj and the MTP block's projections) from the XLA model's decode hidden state."""
    ids = _ids()
    out = []
    cache = hidden = None
    for model in models(kind):
        pre = kernel_forward(model, ids[:, :PROMPT], model.init_cache(1, MAX_LEN))
        cache = cache or pre.cache
        dec = kernel_forward(model, ids[:, PROMPT:PROMPT + 1], cache)
        hidden = dec.hidden if hidden is None else hidden
        ver = kernel_forward(model, ids[:, PROMPT:], cache, pending=True)
        with kernel_mode():
            mtp = jax.jit(lambda h, t, c, m=model: m.mtp_forward(h, t, c)[0])(
                hidden, ids[:, PROMPT + 1:PROMPT + 2], cache)
        out.append(dict(prefill=np.asarray(pre.logits[0], np.float64), decode=np.asarray(dec.logits[0], np.float64),
                        verify=np.asarray(ver.logits[0], np.float64), mtp=np.asarray(mtp[0], np.float64)))
    return out


@pytest.mark.parametrize("kind", ["fp8", "bf16_weights"])
def test_decode_and_verify_logits_match(kind):
    x, p = runs(kind)
    np.testing.assert_array_equal(p["prefill"], x["prefill"])      # prefill (T = 20) is XLA on both
    assert np.isfinite(p["decode"]).all() and np.isfinite(p["verify"]).all()
    assert rel(p["decode"], x["decode"]) <= TOL
    assert rel(p["verify"], x["verify"]) <= TOL
    assert rel(p["verify"][0], p["decode"][0]) <= TOL               # same token, T = 9 vs T = 1
    assert np.isfinite(p["mtp"]).all() and rel(p["mtp"], x["mtp"]) <= TOL


def _draft(seed: int = 5):
    """A 1-layer DSpark draft fitting CFG, float32 with its Linear / HeadsOut weights in bfloat16
    (what the kernel streams; markov rank 128 so markov_w2 fits the kernel too)."""
    dc = DSparkConfig.from_dict(dict(
        hidden_size=CFG.hidden_size, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        head_dim=64, intermediate_size=256, vocab_size=CFG.vocab_size, block_size=8,
        mask_token_id=CFG.vocab_size - 1, target_layer_ids=[0, 3], markov_rank=128,
        enable_confidence_head=True, confidence_head_with_markov=True))
    draft = DSparkDraft(dc, dtype=F32, rngs=nnx.Rngs(seed))
    for m, name in _dense_weights(draft):
        w = getattr(m, name)
        w.set_value(w.get_value().astype(BF16))
    return draft


@pytest.mark.parametrize("fp8_draft", [False, True], ids=["bf16_draft", "fp8_draft"])
def test_dspark_draft_follows_the_target_switch(fp8_draft):
    """The Decoder gives a DSpark draft its target's dense_kernel: every draft projection but the
    1-wide confidence head runs on the skinny GEMM, and the draft's base logits are the target's
    lm_head on the kernel. Its proposals (context append, block pass, Markov chain) match the XLA
    draft's: the same tokens, corrected logits within TOL. fp8_draft: the draft's projections held
    in block fp8 (quantize_draft), on the kernel's fp8 path with the norms' and markov_w1's bounds
    as x_bound (the XLA draft dequantises the same fp8 weights)."""
    xla_t, pal_t = models("bf16_weights")
    draft = quantize_draft(_draft()) if fp8_draft else _draft()
    assert isinstance(draft.layers[0].self_attn.o_proj.weight, Fp8Weight) == fp8_draft
    Decoder(xla_t, SpecConfig("dspark", 8), draft=draft)
    assert all(v == "dense_kernel='xla'" for v in dense_kernel_plan(draft).values())
    pal_d = nnx.clone(draft)
    Decoder(pal_t, SpecConfig("dspark", 8), draft=pal_d)
    plan = dense_kernel_plan(pal_d)
    assert {k for k, v in plan.items() if v is not None} == {"conf_proj.weight"}, plan
    assert len(plan) == 10          # fc, q/k/v, o, gate/up/down, markov_w2, conf_proj
    assert (pal_d.markov_bound is not None and pal_d.layers[0].input_layernorm.bound is not None)
    rng = np.random.default_rng(0)
    taps = jnp.asarray(rng.normal(size=(1, 9, draft.cfg.tap_dim)), F32)
    embeds = jnp.asarray(rng.normal(size=(1, 8, CFG.hidden_size)), F32)

    def propose(d, t, head):
        cache = d.append_context(d.init_cache(1, 32), taps, 0)
        hidden = d.forward_block(cache, embeds, 9)
        return d.propose_greedy(hidden, jnp.asarray([3], jnp.int32), head(t))

    ref = jax.jit(lambda: propose(draft, xla_t, lambda t: t.lm_head[...].T))()
    with kernel_mode():
        out = jax.jit(lambda: propose(pal_d, pal_t, lambda t: t.logits))()
    # fc, k + v (context, one launch); q + k + v, o, gate + up, down (block); lm_head; markov_w2
    # (the chain's scan): the Linears of one input share a launch (dspark.linears)
    assert kernel_calls(lambda: propose(pal_d, pal_t, lambda t: t.logits), name="skinny_gemm_pallas") == 8
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    assert rel(np.asarray(out.corrected_logits), np.asarray(ref.corrected_logits)) <= TOL


def test_dense_matmul_multi_refuses_weights_of_different_k():
    a = nnx.Param(jnp.zeros((256, 128), jnp.bfloat16))
    b = nnx.Param(jnp.zeros((384, 128), jnp.bfloat16))
    with pytest.raises(ValueError, match="contracted size K"):
        dense.dense_matmul_multi(jnp.zeros((2, 256), jnp.bfloat16), [a, b])


@pytest.mark.parametrize("kind", ["fp8", "bf16_weights"])
def test_small_model_plan(kind):
    """Which projections of the small model the kernel streams, and why the others stay on XLA."""
    plan = dense_kernel_plan(models(kind)[1])
    assert all(v == "dense_kernel='xla'" for v in dense_kernel_plan(models(kind)[0]).values())
    on = {k for k, v in plan.items() if v is None}
    for key, why in plan.items():
        expect = next((w for suffix, w in SMALL_XLA[kind].items() if key.endswith(suffix)), None)
        assert (why is None) == (expect is None), (key, why)
        assert expect is None or expect in why, (key, why)
    assert {"layers.0.attn.w_in", "layers.0.attn.w_out", "layers.0.mlp.w_gate_up", "layers.0.mlp.w_down",
            "layers.3.attn.q_proj", "layers.3.attn.dense", "mtp.eh_proj"} <= on
    assert ("lm_head" in on) == (kind == "bf16_weights")


def test_kernel_runs_only_for_short_calls():
    """The pallas model's T <= 16 forwards call the skinny GEMM once per recorded projection of
    the main model; its T = 17 forward and the XLA model's
    forwards contain none."""
    xla, pallas = models("fp8")
    ids = _ids()
    cache = pallas.init_cache(1, MAX_LEN)
    main = [k for k, v in dense_kernel_plan(pallas).items() if v is None and not k.startswith("mtp.")]

    def n_kernels(model, tokens):
        return kernel_calls(lambda t, c: model(t, c), tokens, cache, name="skinny_gemm_pallas")

    assert n_kernels(pallas, ids[:, PROMPT:PROMPT + 1]) == len(main) == 12
    assert n_kernels(pallas, ids[:, :16]) == len(main)
    assert n_kernels(pallas, jnp.concatenate([ids, ids[:, :2]], axis=1)[:, :17]) == 0      # T = 17
    assert n_kernels(xla, ids[:, PROMPT:PROMPT + 1]) == 0


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_every_projection_uses_the_kernel_at_flash_shapes(fp8):
    """Ling-3.0-flash (abstract, bfloat16 model, with MTP): all 182 listed projections -- KDA w_in /
    w_out (35 layers), MLA q_proj / kv_a / dense (7 + MTP), dense MLP gate_up / down (2 layers),
    shared expert gate_up / down (40 MoE layers + MTP), lm_head, eh_proj -- fit the kernel."""
    cfg = preset("ling3-flash")

    def build():
        m = LingModel(cfg, dtype=BF16, with_mtp=True)
        return quantize_model(m) if fp8 else m
    model = set_dense_kernel(nnx.eval_shape(build), "pallas")
    plan = dense_kernel_plan(model)
    assert {k: v for k, v in plan.items() if v is not None} == {}
    counts = {}
    for key in plan:
        counts[key.split(".")[-1]] = counts.get(key.split(".")[-1], 0) + 1
    assert counts == dict(w_in=35, w_out=35, q_proj=8, kv_a=8, dense=8, w_gate_up=43, w_down=43,
                          lm_head=1, eh_proj=1)
    assert len(plan) == 182
    assert isinstance(model.layers[0].attn.w_in, Fp8Weight) == fp8
    built = nnx.eval_shape(lambda: LingModel(cfg, dtype=BF16, with_mtp=True, dense_kernel="pallas"))
    assert dense_kernel_plan(built) == plan


def test_fp8_draft_at_flash_shapes():
    """The published Ling-3.0-flash draft (abstract) in block fp8: every projection the skinny GEMM
    streams (fc, 5 x q / k / v / o / gate / up / down, markov_w2) is an Fp8Weight on the kernel."""
    from bench.batch1 import draft_config_for
    dcfg = draft_config_for(preset("ling3-flash"), 8)
    draft = nnx.eval_shape(lambda: quantize_draft(DSparkDraft(dcfg, dtype=BF16, rngs=nnx.Rngs(1))))
    plan = dense_kernel_plan(set_dense_kernel(draft, "pallas"))
    assert {k: v for k, v in plan.items() if v is not None} == {"conf_proj.weight": "N=1 is not a multiple of 64"}
    assert len(plan) == 38
    fp8 = [m for m, _ in draft_projections(draft)]
    assert len(fp8) == 37 and all(isinstance(m.weight, Fp8Weight) for m in fp8)
    assert fp8[4].weight.view == Matrix((), (0, 1), (2,))       # o_proj [heads, head_dim, hidden]
    # one draft pass (context append of 6 rows, the 8-token block, the greedy Markov chain) emitted
    # for CUDA: every fp8 projection call lowers at these shapes (K-major fp8 tiles, markov_w2's
    # K = 256); the base logits take an XLA lm_head here. Lowering only: ptxas is not involved.
    graphdef, state = nnx.split(draft)
    S = jax.ShapeDtypeStruct

    def draft_pass(state, taps, embeds, lm_head):
        d = nnx.merge(graphdef, state)
        cache = d.append_context(d.init_cache(1, 64), taps, 0)
        hidden = d.forward_block(cache, embeds, 6)
        return d.propose_greedy(hidden, jnp.zeros((1,), jnp.int32), lm_head).tokens

    with pallas_cross_lowering():
        text = jax.jit(draft_pass).trace(state, S((1, 6, dcfg.tap_dim), BF16), S((1, 8, dcfg.hidden_size), BF16),
                                         S((dcfg.vocab_size, dcfg.hidden_size), BF16)).lower(
            lowering_platforms=("cuda",)).as_text()
    # fc, the context's k + v per layer (5), the block's q + k + v, o, gate + up, down per layer (20),
    # the attention kernel per layer (5: dspark.ATTENTION_KERNEL), markov_w2 (once: the chain is a scan)
    assert kernel_module_size.launches(text) == 1 + 5 + 20 + 5 * dspark.ATTENTION_KERNEL + 1


def test_fp8_operands_are_the_block_grid():
    """kernel_operands of a fused K-minor fp8 weight (w_in [5, H, K, D], stack axis 0): the [N, K]
    values are a reshape and the scales line up with the 128 x 128 blocks of that matrix."""
    d, h, k = 256, 2, 64
    w = jax.random.normal(jax.random.PRNGKey(0), (5, h, k, d), F32) * jnp.arange(1, 6, dtype=F32)[:, None, None, None]
    view = Matrix((0,), (3,), (1, 2))
    values, scale = quantize(w, view)
    fw = Fp8Weight(values, scale, view=view, block=(128, 128), dtype=F32, logical=(None,) * 4)
    w2, s2 = dense.kernel_operands(fw, -1)
    assert w2.shape == (5 * h * k, d) and s2.shape == (5, d // 128, h * k // 128)     # stack = column groups
    s2 = jnp.moveaxis(s2, 1, 0).reshape(d // 128, 5 * h * k // 128)                 # [K blocks, N blocks]
    deq = w2.astype(F32).reshape(5, 128, 2, 128) * s2.T[:, None, :, None]
    np.testing.assert_array_equal(np.asarray(deq.reshape(5, h, k, d)), np.asarray(fw[...]))
    # contracting over (K, D) would put an out axis into K: not a plain reshape of the view
    assert "not a plain reshape" in dense.kernel_refusal(fw, -2)
    assert "not a plain reshape" in dense.kernel_refusal(fw, 1)          # K-major reading of it
    assert "blocks" in dense.kernel_refusal(
        Fp8Weight(values, scale, view=view, block=(64, 64), dtype=F32, logical=(None,) * 4), -1)


def test_changed_weights_raise_when_traced():
    """A weight recorded for the kernel that no longer fits (quantised after set_dense_kernel:
    the shared expert's F = 32 straddles fp8 blocks) raises when traced, never falls back."""
    before = nnx.eval_shape(lambda: LingModel(CFG, dtype=BF16, dense_kernel="pallas"))
    assert dense_kernel_plan(before)["layers.2.mlp.shared.w_gate_up"] is None
    model = nnx.eval_shape(lambda: quantize_model(LingModel(CFG, dtype=BF16, dense_kernel="pallas")))
    assert isinstance(model.layers[2].mlp.shared.w_gate_up, Fp8Weight)
    assert "w_gate_up" in model.layers[2].mlp.shared.dense_kernel_weights       # recorded before quantising
    graphdef, state = nnx.split(model)
    cache = jax.eval_shape(lambda: model.init_cache(1, MAX_LEN))
    with kernel_mode(), pytest.raises(ValueError, match="call lingjax.model.dense.set_dense_kernel again"):
        jax.eval_shape(lambda s, t, c: nnx.merge(graphdef, s)(t, c), state,
                       jax.ShapeDtypeStruct((1, 1), jnp.int32), cache)


@pytest.mark.parametrize("bad", ["triton", "Pallas", ""])
def test_invalid_switch_value(bad):
    with pytest.raises(ValueError, match="dense_kernel must be one of 'xla', 'pallas'"):
        LingModel(CFG, dtype=F32, dense_kernel=bad)
    m = nnx.eval_shape(lambda: LingModel(CFG, dtype=BF16))
    with pytest.raises(ValueError, match="dense_kernel must be one of"):
        set_dense_kernel(m, bad)


def test_pallas_rejects_unsupported_models():
    with pytest.raises(ValueError, match="float64"):
        nnx.eval_shape(lambda: LingModel(CFG, dtype=jnp.float64, dense_kernel="pallas"))
    f64 = nnx.eval_shape(lambda: quantize_model(LingModel(CFG, dtype=jnp.float64)))
    with pytest.raises(ValueError, match="float64"):
        set_dense_kernel(f64, "pallas")
    with pytest.raises(ValueError, match="no projection the kernel can stream"):     # float32 weights
        nnx.eval_shape(lambda: LingModel(CFG, dtype=F32, dense_kernel="pallas"))
    m = set_dense_kernel(nnx.eval_shape(lambda: LingModel(CFG, dtype=BF16, with_mtp=True)), "pallas")
    assert set_dense_kernel(m, "xla") is m
    assert all(v == "dense_kernel='xla'" for v in dense_kernel_plan(m).values())
    assert all(m_.dense_kernel_weights == () for m_, _ in _dense_weights(m))


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the off-GPU error")
def test_pallas_off_gpu_without_interpret_says_what_to_do():
    _, pallas = models("fp8")
    cache = pallas.init_cache(1, MAX_LEN)
    with pytest.raises(ValueError, match="dense_kernel='pallas' runs a Mosaic GPU kernel, which needs an NVIDIA"):
        jax.jit(lambda t, c: pallas(t, c))(jnp.zeros((1, 1), jnp.int32), cache)


def test_mesh_raises_when_traced():
    """Not split over devices: a trace under kernel_mesh with 2 devices raises."""
    from lingjax.model.kernels import kernel_mesh
    _, pallas = models("bf16_weights")
    mesh = jax.sharding.AbstractMesh((2, 1), ("ep", "tp"))    # only its size is read before the error
    cache = jax.eval_shape(lambda: pallas.init_cache(1, MAX_LEN))
    with kernel_mode(), kernel_mesh(mesh), pytest.raises(ValueError, match="not split over devices"):
        jax.eval_shape(lambda t, c: pallas(t, c), jax.ShapeDtypeStruct((1, 1), jnp.int32), cache)


def test_cross_lowers_for_cuda_with_all_three_kernels():
    """One decode forward of the small model (bfloat16) with kda_kernel, moe_kernel and
    dense_kernel all 'pallas', emitted for CUDA: the text has the Mosaic GPU calls of the KDA
    kernel (3 KDA layers), the expert kernels (2 MoE layers x gate/up + down) and the skinny
    GEMMs. Lowering only: nothing runs, ptxas is not involved."""
    model = nnx.eval_shape(lambda: LingModel(CFG, dtype=BF16, kda_kernel="pallas", moe_kernel="pallas",
                                             dense_kernel="pallas"))
    graphdef, state = nnx.split(model)
    cache = jax.eval_shape(lambda: model.init_cache(1, MAX_LEN))
    n_dense = sum(v is None for k, v in dense_kernel_plan(model).items() if not k.startswith("mtp."))
    assert n_dense == 15    # 3 KDA x 2 + 2 dense MLPs x 2 + MLA q_proj, dense + 2 shared gate_up + lm_head

    def decode(state, tokens, cache):
        return nnx.merge(graphdef, state)(tokens, cache).logits

    with pallas_cross_lowering():
        text = jax.jit(decode).trace(state, jax.ShapeDtypeStruct((1, 1), jnp.int32), cache).lower(
            lowering_platforms=("cuda",)).as_text()
    assert kernel_module_size.launches(text) == n_dense + 3 + 2 * 2


def test_loader_and_cli_flags():
    from serve.__main__ import build_parser as serve_parser
    assert build_parser().parse_args(["--dense-kernel", "pallas"]).dense_kernel == "pallas"
    assert build_parser().parse_args([]).dense_kernel == "xla"
    assert serve_parser().parse_args(["--dense-kernel", "pallas"]).dense_kernel == "pallas"
    assert serve_parser().parse_args([]).dense_kernel == "xla"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--dense-kernel", "cuda"])
    with pytest.raises(LoadError, match="dense_kernel must be one of"):
        load_engine(LING_TINY, dense_kernel="cuda", quiet=True)
    with pytest.raises(LoadError, match="float64"):
        load_engine(LING_TINY, dtype="float64", dense_kernel="pallas", quiet=True)
    with pytest.raises(LoadError, match="--mesh is not supported"):
        load_engine(LING_TINY, dense_kernel="pallas", mesh="tp=2", quiet=True)
    if jax.default_backend() != "gpu":
        with pytest.raises(LoadError, match="needs an NVIDIA Hopper GPU"):
            load_engine(LING_TINY, dense_kernel="pallas", quiet=True)
    else:   # float32 weights: nothing for the kernel to stream
        with pytest.raises(LoadError, match="no projection the kernel can stream"):
            load_engine(LING_TINY, dtype="float32", dense_kernel="pallas", quiet=True)


def test_batch1_flag(capsys, tmp_path):
    from bench import batch1
    base = ["--tiny", "--layers", "4", "--input-len", "32", "--output-len", "4", "--num-prompts", "1",
            "--no-xla-defaults", "--copy-mib", "8"]
    assert batch1.build_parser().parse_args(base).dense_kernel == "xla"
    assert batch1.build_parser().parse_args(base + ["--dense-kernel", "pallas"]).dense_kernel == "pallas"
    bad = [(["--mesh", "tp=2"], "--mesh is not supported"), (["--dtype", "f32"], "bf16 or fp8")]
    if jax.default_backend() != "gpu":
        bad.append(([], "the backend is"))
    for extra, msg in bad:
        with pytest.raises(SystemExit) as e:
            batch1.main(base + ["--dense-kernel", "pallas"] + extra)
        assert e.value.code == 2 and msg in capsys.readouterr().err
    rec = batch1.main(base + ["--out", str(tmp_path)])
    assert rec["dense_kernel"] == "xla"
