"""The `kda_kernel` switch ('xla' default | 'pallas'): validation, and the golden tiny model giving
the same float32 logits on both kernels for prefill + decode and for a pending verify + commit.

Off-GPU the Pallas kernel runs in Mosaic GPU interpret mode (the forwards are traced inside
`lingjax.model.kernels.pallas_interpret()`); on a GPU (JAX_PLATFORMS=cuda) the same tests run it compiled.
"""
from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import LING_TINY
from helpers import golden, golden_model, rel, tiny_config
from lingjax.cache import KDAState, init_cache
from lingjax.engine import Engine
from lingjax.generate import build_parser
from lingjax.loader import LoadError, load_engine
from lingjax.model.kda import KDA, KDAPending, KDAPendingPallas, set_kda_kernel
from lingjax.model.kernels import pallas_interpret
from lingjax.model.ling import LingModel, commit
from lingjax.spec_decode import SpecConfig

F32 = jnp.float32
PROMPT = 11      # prefill length (chunked KDA on both kernels)
MAX_LEN = 32
TOL = 2e-5       # float32: the kernel and kda_step / kda_chunked round differently


def kernel_mode():
    """Interpret mode off-GPU (tests only); the compiled kernel on a GPU."""
    if jax.default_backend() == "gpu":
        return contextlib.nullcontext()
    return pallas_interpret()


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
    ids = jnp.asarray(golden()["long_ids"][:, :PROMPT + 4], jnp.int32)
    out = []
    for model in models():
        with kernel_mode():
            fwd, fwd_pending = _fwd(model), _fwd(model, pending=True)
            pre = fwd(ids[:, :PROMPT], init_cache(model.cfg, 1, MAX_LEN, F32))
            cache, decode = pre.cache, []
            for i in range(3):
                o = fwd(ids[:, PROMPT + i:PROMPT + i + 1], cache)
                cache = o.cache
                decode.append(np.asarray(o.logits[0, 0]))
            ver = fwd_pending(ids[:, PROMPT:PROMPT + 4], pre.cache)
            committed = jax.jit(commit)(ver.cache, ver.pending, jnp.int32(2), pre.cache.pos)
            after = fwd(ids[:, PROMPT + 2:PROMPT + 3], committed)
        states = [c.state for c in committed.layers if isinstance(c, KDAState)]
        out.append(dict(prefill=np.asarray(pre.logits[0]), decode=np.stack(decode),
                        verify=np.asarray(ver.logits[0]), after=np.asarray(after.logits[0, 0]),
                        pending=ver.pending, states=states, pos=int(committed.pos)))
    return out


def test_prefill_and_decode_logits_match():
    x, p = runs()
    np.testing.assert_array_equal(p["prefill"], x["prefill"])      # prefill is XLA on both
    assert rel(p["decode"], x["decode"]) <= TOL


def test_verify_and_commit_match():
    x, p = runs()
    assert rel(p["verify"], x["verify"]) <= TOL
    kinds = [type(q) for q in p["pending"] if q is not None]
    assert kinds and all(k is KDAPendingPallas for k in kinds)
    assert all(type(q) is KDAPending for q in x["pending"] if q is not None)
    assert p["pos"] == x["pos"] == PROMPT + 2
    for sp, sx in zip(p["states"], x["states"], strict=True):
        assert sp.dtype == sx.dtype == F32
        assert rel(sp, sx) <= TOL
    assert rel(p["after"], x["after"]) <= TOL


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
