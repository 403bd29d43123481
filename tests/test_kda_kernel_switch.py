"""The `kda_kernel` switch ('xla' default | 'pallas'): validation, and the golden tiny model giving
the same float32 logits on both kernels for prefill + decode and for a pending verify + commit; in
bfloat16 the prefill runs the chunked prefill kernel: logits close to the XLA path's and to the
published float32 logits, with the state carried between prefill chunks and padded prompts.

Off-GPU the Pallas kernel runs in Mosaic GPU interpret mode (the forwards are traced inside
`lingjax.model.kernels.pallas_interpret()`); on a GPU (JAX_PLATFORMS=cuda) the same tests run it compiled.
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
from helpers import golden, golden_model, kernel_call_shapes, kernel_mode, rel, tiny_config
from lingjax.cache import KDAState, init_cache
from lingjax.engine import Engine
from lingjax.generate import build_parser
from lingjax.loader import LoadError, load_engine
from lingjax.model.kda import KDA, KDAPending, KDAPendingFused, set_kda_kernel
from lingjax.model.ling import LingModel, commit
from lingjax.spec_decode import SpecConfig

F32 = jnp.float32
PROMPT = 11      # prefill length (chunked KDA on both kernels)
MAX_LEN = 32
TOL = 2e-5       # float32: the kernel and kda_step / kda_chunked round differently
BF16_TOL = 2e-2  # bf16 model, prefill kernel vs XLA: measured on CPU 6.7e-3 (residual streams), 2.3e-3 and 1.2e-2 (states)


@functools.lru_cache(maxsize=None)
def models():
    """(xla, pallas) float32 golden models sharing the same weights."""
    xla = golden_model("float32")
    with_mtp = xla.mtp is not None
    pallas = nnx.eval_shape(lambda: LingModel(xla.cfg, dtype=F32, with_mtp=with_mtp, kda_kernel="pallas"))
    nnx.update(pallas, nnx.state(xla))
    return xla, pallas


def _fwd(model, pending=False):
    return jax.jit(lambda t, c: model(t, c, pending=pending))


@functools.lru_cache(maxsize=None)
def runs():
    """Per model: logits of prefill + 3 decode steps; of a 4-token pending verify after the
    prefill; of a decode after committing 2 of those 4; and the committed KDA states."""
    return [_run_model(m) for m in models()]


def _run_model(model) -> dict:
    """`runs` of one model."""
    ids = jnp.asarray(golden()["long_ids"][:, :PROMPT + 4], jnp.int32)
    with kernel_mode():
        fwd, fwd_pending = _fwd(model), _fwd(model, pending=True)
        pre = fwd(ids[:, :PROMPT], init_cache(model.cfg, 1, MAX_LEN, F32))
        cache, decode = pre.cache, []
        for i in range(3):
            o = fwd(ids[:, PROMPT + i:PROMPT + i + 1], cache)
            cache = o.cache
            decode.append(np.asarray(o.logits[0, 0]))
        ver = fwd_pending(ids[:, PROMPT:PROMPT + 4], pre.cache)
        # a fresh function: jax.jit(commit) would reuse its trace from an earlier run with other
        # trace-time settings (kda.STATE_IN_PLACE, kda.WINDOW_FROM_KERNEL)
        committed = jax.jit(lambda *a: commit(*a))(ver.cache, ver.pending, jnp.int32(2), pre.cache.pos)
        after = fwd(ids[:, PROMPT + 2:PROMPT + 3], committed)
    states = [c.state for c in committed.layers if isinstance(c, KDAState)]
    windows = [np.asarray(c.conv) for c in (*committed.layers, *cache.layers) if isinstance(c, KDAState)]
    return dict(prefill=np.asarray(pre.logits[0]), decode=np.stack(decode),
                verify=np.asarray(ver.logits[0]), after=np.asarray(after.logits[0, 0]),
                pending=ver.pending, states=states, windows=windows, pos=int(committed.pos))


BF16 = jnp.bfloat16
BF16_PROMPT = 96     # two 64-token chunks, the second partial
BF16_SPLIT = 40      # the same prompt prefilled as 40 + 56 tokens (initial state of the second)
BF16_PAD = 128       # a padded prompt (valid_len = 96), as the engine's prompt buckets do
TAPS = (0, 1)        # KDA layers before the first MoE layer (docs/PERFORMANCE.md: in bf16 this random
                     # model's router flips decisions from layer 2 on, so later layers amplify any
                     # rounding difference; the comparison is made where it is meaningful)


@functools.lru_cache(maxsize=None)
def bf16_prefill_runs():
    """bf16 golden model on each kernel: the residual stream after layers 0 and 1 for the 96-token
    prefill in one forward, in two (40 + 56), and padded to 128 with valid_len 96; the KDA states
    of those layers after each; and the prefill kernel's calls (their token counts, from the jaxprs)."""
    xla = golden_model("bfloat16")
    pallas = set_kda_kernel(nnx.clone(xla), "pallas")
    ids = jnp.asarray(golden()["long_ids"][:, :BF16_PROMPT], jnp.int32)
    padded = jnp.pad(ids, ((0, 0), (0, BF16_PAD - BF16_PROMPT)), constant_values=2)

    def f32(a):
        return np.asarray(a, np.float32)
    out = []
    for model in (xla, pallas):
        cache0 = init_cache(model.cfg, 1, BF16_PAD + 8, BF16)
        fn = lambda t, c, n=None, m=model: m(t, c, tap_layers=TAPS, valid_len=n)   # noqa: E731
        fwd = jax.jit(fn)
        with kernel_mode():
            one = fwd(ids, cache0)
            first = fwd(ids[:, :BF16_SPLIT], cache0)
            second = fwd(ids[:, BF16_SPLIT:], first.cache)
            pad = fwd(padded, cache0, jnp.int32(BF16_PROMPT))
        calls = [shape[1] for args in ((ids, cache0), (ids[:, :BF16_SPLIT], cache0), (ids[:, BF16_SPLIT:], first.cache),
                                       (padded, cache0, jnp.int32(BF16_PROMPT)))
                 for shape in kernel_call_shapes(fn, *args, name="kda_prefill_pallas")]

        def states(o):
            return [f32(o.cache.layers[i].state) for i in TAPS]
        out.append(dict(one=f32(one.taps[0]), split=np.concatenate([f32(first.taps[0]), f32(second.taps[0])]),
                        pad=f32(pad.taps[0, :BF16_PROMPT]), logits_finite=bool(np.isfinite(f32(one.logits)).all()),
                        states=states(one), split_states=states(second), pad_states=states(pad), calls=calls))
    return out


def test_bf16_prefill_runs_the_prefill_kernel():
    x, p = bf16_prefill_runs()
    n_kda = sum(1 for kind in golden_model("bfloat16").cfg.layer_kinds() if kind == "kda")
    assert x["calls"] == []
    assert sorted(set(p["calls"])) == [BF16_SPLIT, BF16_PROMPT - BF16_SPLIT, BF16_PROMPT, BF16_PAD]
    assert len(p["calls"]) == 4 * n_kda
    assert p["logits_finite"] and x["logits_finite"]


def test_bf16_prefill_matches_xla_and_golden():
    """The kernel rounds q, k to bf16 (lingjax/model/kda.py): the residual streams after the KDA
    layers 0 and 1 within BF16_TOL of the XLA bf16 path, and no further from the published float32
    model's than it plus BF16_TOL; their states too; prefill in two chunks and a padded prompt give
    the one-forward result."""
    x, p = bf16_prefill_runs()
    gold = np.concatenate([golden()[f"long_hidden_after_layer_{i}"][:BF16_PROMPT] for i in TAPS], axis=-1)
    for key in ("one", "split", "pad"):
        assert rel(p[key], x[key]) <= BF16_TOL, key
        assert rel(p[key], gold) <= rel(x[key], gold) + BF16_TOL, key
    for key in ("states", "split_states", "pad_states"):
        for sp, sx in zip(p[key], x[key], strict=True):
            assert rel(sp, sx) <= BF16_TOL, key
    assert rel(p["split"], p["one"]) <= BF16_TOL          # the state carried between prefill chunks
    assert rel(p["pad"], p["one"]) <= BF16_TOL            # padding past valid_len is an identity


def test_bf16_prefill_cross_lowers_for_cuda():
    """A 200-token bfloat16 prefill with kda_kernel='pallas', emitted for CUDA: two Mosaic GPU
    calls (the prefill kernel's two stages) per KDA layer. Lowering only: nothing runs."""
    from lingjax.model.kernels import pallas_cross_lowering
    model = nnx.eval_shape(lambda: LingModel(tiny_config(), dtype=BF16, kda_kernel="pallas"))
    graphdef, state = nnx.split(model)
    cache = jax.eval_shape(lambda: model.init_cache(1, 256))

    def prefill(state, tokens, cache):
        return nnx.merge(graphdef, state)(tokens, cache, logits="last").logits

    with pallas_cross_lowering():
        text = jax.jit(prefill).trace(state, jax.ShapeDtypeStruct((1, 200), jnp.int32), cache).lower(
            lowering_platforms=("cuda",)).as_text()
    n_kda = sum(1 for kind in model.cfg.layer_kinds() if kind == "kda")
    assert kernel_module_size.launches(text) == 2 * n_kda
    assert len(kernel_module_size.call_sizes(text)) == 2        # one module copy per stage (shared_call)


def test_float32_prefill_stays_on_xla():
    """A float32 model keeps kda_chunked for prefill (the kernel would round q, k to bf16)."""
    _, p = models()
    kdas = [m for _, m in nnx.iter_modules(p) if isinstance(m, KDA)]
    assert kdas and not any(m._prefill_kernel(64, False, F32) for m in kdas)
    assert all(m._prefill_kernel(64, False, BF16) and not m._prefill_kernel(64, True, BF16)
               and not m._prefill_kernel(1, False, BF16) for m in kdas)
    for cfg in (tiny_config(kda_safe_gate=False), tiny_config(head_dim=192)):   # softplus gate; K the kernel lacks
        other = set_kda_kernel(nnx.eval_shape(lambda c=cfg: LingModel(c, dtype=BF16)), "pallas")
        assert not any(m._prefill_kernel(64, False, BF16) for _, m in nnx.iter_modules(other) if isinstance(m, KDA))


def test_prefill_and_decode_logits_match():
    x, p = runs()
    np.testing.assert_array_equal(p["prefill"], x["prefill"])      # prefill is XLA on both
    assert rel(p["decode"], x["decode"]) <= TOL


def test_verify_and_commit_match():
    x, p = runs()
    assert rel(p["verify"], x["verify"]) <= TOL
    kinds = [type(q) for q in p["pending"] if q is not None]
    assert kinds and all(k is KDAPendingFused for k in kinds)
    assert all(type(q) is KDAPending for q in x["pending"] if q is not None)
    assert p["pos"] == x["pos"] == PROMPT + 2
    for sp, sx in zip(p["states"], x["states"], strict=True):
        assert sp.dtype == sx.dtype == F32
        assert rel(sp, sx) <= TOL
    assert rel(p["after"], x["after"]) <= TOL


def test_state_in_place_gives_the_same_run(monkeypatch):
    """kda.STATE_IN_PLACE on (the decode step and the commit update the state through a jax.new_ref)
    and off (a separate state output): the Pallas run's decode, verify and post-commit logits and
    committed states, bit for bit."""
    from lingjax.model import kda
    _, p = runs()                                   # the default (on)
    assert kda.STATE_IN_PLACE
    monkeypatch.setattr(kda, "STATE_IN_PLACE", False)
    q = _run_model(models()[1])
    for key in ("decode", "verify", "after"):
        np.testing.assert_array_equal(q[key], p[key])
    for sq, sp in zip(q["states"], p["states"], strict=True):
        np.testing.assert_array_equal(np.asarray(sq), np.asarray(sp))


def test_window_from_kernel_gives_the_same_run(monkeypatch):
    """kda.WINDOW_FROM_KERNEL on (the decode step and the commit write the new conv window) and off
    (an XLA slice of window ++ projection): the same logits, states and conv windows (after the
    commit and after the decode steps): bit for bit on the CPU (interpret mode); on a GPU within
    float32 rounding, since XLA:GPU picks its fusions and GEMM algorithms per graph and the two
    graphs differ (measured on an H100: logits 2e-6 apart at most)."""
    from lingjax.model import kda
    x, p = runs()                                   # the default
    monkeypatch.setattr(kda, "WINDOW_FROM_KERNEL", not kda.WINDOW_FROM_KERNEL)
    q = _run_model(models()[1])

    def same(a, b):
        a, b = np.asarray(a), np.asarray(b)
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(a, b)
        else:
            assert rel(a, b) <= 1e-5
    for key in ("decode", "verify", "after"):
        same(q[key], p[key])
    for a, b in zip(q["states"], p["states"], strict=True):
        same(a, b)
    for a, b, c in zip(q["windows"], p["windows"], x["windows"], strict=True):
        same(a, b)
        assert rel(b, c) <= TOL                     # the XLA model's (its projections round differently)


def test_verify_then_commit_equals_plain_decode():
    """On the Pallas path, committing 2 verified tokens then decoding one gives the same logits as
    decoding those 3 tokens one by one (same kernel, exact identity updates past the prefix)."""
    _, p = runs()
    assert rel(p["verify"][:3], p["decode"]) <= TOL
    assert rel(p["after"], p["decode"][2]) <= TOL


@pytest.mark.parametrize("bad", ["triton", "Pallas", ""])
def test_invalid_switch_value(bad):
    cfg = tiny_config()
    with pytest.raises(ValueError, match="kda_kernel must be one of 'xla', 'pallas'"):
        LingModel(cfg, dtype=F32, kda_kernel=bad)
    with pytest.raises(ValueError, match="kda_kernel must be one of"):
        KDA(cfg, dtype=F32, rngs=nnx.Rngs(0), kda_kernel=bad)


def test_pallas_rejects_unsupported_models():
    with pytest.raises(ValueError, match="float64"):
        nnx.eval_shape(lambda: LingModel(tiny_config(), dtype=jnp.float64, kda_kernel="pallas"))
    with pytest.raises(ValueError, match="head_dim % 64"):
        nnx.eval_shape(lambda: LingModel(tiny_config(head_dim=32), dtype=F32, kda_kernel="pallas"))


def test_set_kda_kernel_switches_every_kda_layer():
    m = nnx.eval_shape(lambda: LingModel(tiny_config(), dtype=jnp.bfloat16))
    kdas = [mod for _, mod in nnx.iter_modules(m) if isinstance(mod, KDA)]
    assert kdas and all(k.kda_kernel == "xla" for k in kdas)
    assert set_kda_kernel(m, "pallas") is m
    assert all(k.kda_kernel == "pallas" for k in kdas)
    with pytest.raises(ValueError, match="kda_kernel must be one of"):
        set_kda_kernel(m, "cuda")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the off-GPU error")
def test_pallas_off_gpu_without_interpret_says_what_to_do():
    _, pallas = models()
    cache = init_cache(pallas.cfg, 1, MAX_LEN, F32)
    with pytest.raises(ValueError, match="needs an NVIDIA Hopper GPU"):           # traced (jit)
        _fwd(pallas)(jnp.zeros((1, 1), jnp.int32), cache)
    with pytest.raises(ValueError, match="needs an NVIDIA Hopper GPU"):           # engine
        Engine(pallas, spec=SpecConfig("mtp", 2)).generate([3, 4, 5], max_tokens=2)


@pytest.mark.parametrize("spec", [SpecConfig("none"), SpecConfig("mtp", 2)], ids=["plain", "mtp"])
def test_engine_greedy_tokens_match(spec):
    """The whole decode loop (on-device while loop; MTP: draft, pending verify, commit) on both kernels."""
    prompt = [int(t) for t in golden()["long_ids"][0][:PROMPT]]
    toks = []
    for model in models():
        with kernel_mode():
            r = Engine(model, spec=spec).generate(prompt, max_tokens=8)
        toks.append(r.token_ids)
    assert toks[0] == toks[1] and len(toks[0]) == 8


def test_loader_and_cli_flag():
    assert build_parser().parse_args(["--kda-kernel", "pallas"]).kda_kernel == "pallas"
    assert build_parser().parse_args([]).kda_kernel == "xla"
    with pytest.raises(LoadError, match="kda_kernel must be one of"):
        load_engine(LING_TINY, kda_kernel="cuda", quiet=True)
    with pytest.raises(LoadError, match="float64"):
        load_engine(LING_TINY, dtype="float64", kda_kernel="pallas", quiet=True)
    if jax.default_backend() != "gpu":
        with pytest.raises(LoadError, match="needs an NVIDIA Hopper GPU"):
            load_engine(LING_TINY, dtype="float32", kda_kernel="pallas", quiet=True)
    else:
        eng = load_engine(LING_TINY, dtype="float32", kda_kernel="pallas", quiet=True)
        assert all(m.kda_kernel == "pallas" for _, m in nnx.iter_modules(eng.target) if isinstance(m, KDA))
