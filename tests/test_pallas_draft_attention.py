"""Tests for the DSpark draft's context-attention kernel (pallas_kernels/draft_attention.py) and its
use in the draft (lingjax.model.dspark.ATTENTION_KERNEL).

On CPU: Mosaic GPU interpret mode with race detection against the XLA reference and a float64
softmax, over token counts, grouped query heads, context lengths (zero, within the first chunk,
whole chunks, a cache whose size is not a multiple of the chunk), context splits (empty ones
included), with and without extra keys (the block's own: X = 8, and 5, not whole TMA tiles);
what lies past the valid length cannot change the output; cross-lowering for CUDA at the published
draft's shape; the draft's block pass with the kernel against its XLA path. On a GPU
(JAX_PLATFORMS=cuda; skipped elsewhere): the compiled kernel at the published draft's shape, with
and without extra keys.
"""

import jax

jax.config.update("jax_enable_x64", True)  # process-global (conftest): tests pass float32 explicitly

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from helpers import assert_no_race_flagged, interpret_only, kernel_calls, kernel_mode, rel  # noqa: E402
from lingjax.dspark_config import DSparkConfig  # noqa: E402
from lingjax.model import dense, dspark  # noqa: E402
from lingjax.model.dspark import DSparkDraft  # noqa: E402
from pallas_kernels.draft_attention import (context_attention_pallas, context_attention_reference,  # noqa: E402
                                            pick_splits)

BF16, F32 = jnp.bfloat16, jnp.float32
INTERPRET = plgpu.InterpretGPUParams(detect_races=True)
ON_GPU = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA Hopper GPU (run with JAX_PLATFORMS=cuda)")
PUBLISHED = dict(T=8, H=32, Hk=32, d=128, S=9280)     # the published draft: 32 heads x 128, block 8


def _inputs(B, T, H, Hk, d, S, seed=0):
    r = jax.random.split(jax.random.PRNGKey(seed), 3)
    shapes = ((B, T, H, d), (B, S, Hk, d), (B, S, Hk, d))
    return tuple(jax.random.normal(k, sh, F32).astype(BF16) for k, sh in zip(r, shapes))


def _extra(B, X, Hk, d, seed):
    """(k_extra, v_extra) [B, X, Hk, d] bf16, or None for X = 0."""
    if not X:
        return None, None
    r = jax.random.split(jax.random.PRNGKey(100 + seed), 2)
    return tuple(jax.random.normal(key, (B, X, Hk, d), F32).astype(BF16) for key in r)


def _float64(q, k, v, length, scale, k_extra=None, v_extra=None):
    """(o, lse) in float64 numpy, no bf16 rounding of P: the oracle both paths approximate."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, H, d = q.shape
    g = H // k.shape[2]
    valid = np.arange(k.shape[1])[None, :] < np.broadcast_to(np.asarray(length), (B,))[:, None]
    if k_extra is not None:
        k = np.concatenate([k, np.asarray(k_extra, np.float64)], 1)
        v = np.concatenate([v, np.asarray(v_extra, np.float64)], 1)
        valid = np.concatenate([valid, np.ones((B, k_extra.shape[1]), bool)], 1)
    kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)          # [B, S, H, d]
    s = np.einsum("bthd,bshd->bhts", q, kk) * scale
    s = np.where(valid[:, None, None, :], s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    den = p.sum(-1, keepdims=True)
    o = np.einsum("bhts,bshd->bthd", p, vv) / np.moveaxis(np.where(den > 0, den, 1.0), 1, 2)
    lse = np.where(den[..., 0] > 0, (m[..., 0] + np.log(np.where(den[..., 0] > 0, den[..., 0], 1.0))) / np.log(2),
                   -np.inf)
    return o, np.moveaxis(lse, 1, 2)


CASES = [  # B, T, H, Hk, d, S, lengths, splits, X (extra keys)
    (1, 8, 4, 4, 128, 256, [200], 2, 0),
    (1, 8, 4, 4, 128, 200, [200], 3, 0),     # S not a multiple of 64: the last chunk read from S - 64
    (2, 3, 4, 2, 64, 128, [77, 5], 2, 0),    # grouped heads (g = 2), rows padded to 8, two batch rows
    (1, 16, 2, 2, 64, 128, [128], 2, 0),     # T = 16
    (1, 8, 8, 2, 128, 192, [64], 3, 0),      # g = 4: 32 rows; an empty split
    (2, 1, 2, 2, 128, 64, [0, 64], 1, 0),    # nothing valid in one row: o = 0, lse = -inf
    (1, 8, 4, 4, 128, 256, [200], 3, 8),     # the block's 8 keys as extra keys
    (2, 3, 4, 2, 64, 128, [77, 5], 2, 5),    # 5 extra keys (padded to a TMA tile), grouped heads
    (2, 8, 2, 2, 128, 128, [0, 64], 2, 8),   # extra keys only in one row (no valid context), empty splits
]


@pytest.mark.parametrize("B,T,H,Hk,d,S,lengths,splits,X", CASES)
@interpret_only
def test_interpret_matches_reference_and_float64(B, T, H, Hk, d, S, lengths, splits, X):
    q, k, v = _inputs(B, T, H, Hk, d, S, seed=B + T + S)
    kx, vx = _extra(B, X, Hk, d, seed=S)
    length = jnp.asarray(lengths, jnp.int32)
    scale = d ** -0.5
    o, lse = context_attention_pallas(q, k, v, length, kx, vx, scale=scale, splits=splits, interpret=INTERPRET)
    o, lse = jax.block_until_ready((o, lse))
    assert_no_race_flagged()
    ro, rl = context_attention_reference(q, k, v, length, kx, vx, scale=scale)
    fo, fl = _float64(q, k, v, length, scale, kx, vx)
    seen = (np.asarray(lengths) > 0) | (X > 0)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), np.broadcast_to(seen[:, None, None], lse.shape))
    np.testing.assert_array_equal(np.asarray(o)[~seen], 0.0)
    if seen.any():
        o_s, ro_s, fo_s = (np.asarray(a)[seen] for a in (o, ro, fo))
        assert rel(o_s, fo_s) <= 5e-3 and rel(ro_s, fo_s) <= 5e-3       # both round P to bf16
        assert rel(o_s, ro_s) <= 5e-3
        np.testing.assert_allclose(np.asarray(lse)[seen], fl[seen], atol=1e-4, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(rl)[seen], fl[seen], atol=1e-4, rtol=1e-5)


@interpret_only
def test_positions_past_the_length_do_not_matter():
    q, k, v = _inputs(1, 8, 4, 4, 128, 256, seed=3)
    length = jnp.asarray([130], jnp.int32)
    noise = jax.random.normal(jax.random.PRNGKey(9), k.shape, F32).astype(BF16) * 100
    past = (jnp.arange(256) >= 130)[None, :, None, None]
    def run(kk, vv):
        return context_attention_pallas(q, kk, vv, length, scale=0.09, splits=3, interpret=INTERPRET)

    a = run(k, v)
    b = run(jnp.where(past, noise, k), jnp.where(past, noise, v))
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
    np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))


def test_rejects_bad_inputs():
    q, k, v = _inputs(1, 8, 4, 4, 128, 128)
    with pytest.raises(ValueError, match="bfloat16"):
        context_attention_pallas(q.astype(F32), k, v, 3, scale=0.1)
    with pytest.raises(ValueError, match="kv heads"):
        context_attention_pallas(_inputs(1, 8, 3, 2, 128, 128)[0], *_inputs(1, 8, 4, 2, 128, 128)[1:], 3, scale=0.1)
    with pytest.raises(ValueError, match="rows"):
        context_attention_pallas(*_inputs(1, 9, 8, 1, 128, 128), 3, scale=0.1)           # 72 rows > 64
    with pytest.raises(ValueError, match="head_dim"):
        context_attention_pallas(*_inputs(1, 8, 2, 2, 32, 128), 3, scale=0.1)
    with pytest.raises(ValueError, match="S % 8"):
        context_attention_pallas(*_inputs(1, 8, 2, 2, 64, 100), 3, scale=0.1)
    with pytest.raises(ValueError, match="splits"):
        context_attention_pallas(q, k, v, 3, scale=0.1, splits=3)                         # 2 chunks
    kx, vx = _extra(1, 8, 4, 128, seed=0)
    with pytest.raises(ValueError, match="neither"):
        context_attention_pallas(q, k, v, 3, kx, scale=0.1)
    with pytest.raises(ValueError, match="X <= 64"):
        context_attention_pallas(q, k, v, 3, *_extra(1, 65, 4, 128, seed=0), scale=0.1)
    with pytest.raises(ValueError, match="bf16"):
        context_attention_pallas(q, k, v, 3, kx.astype(F32), vx, scale=0.1)


def test_default_splits_fill_the_gpu():
    assert pick_splits(1, 32, 145) == 8          # the published draft: 32 heads x 8 splits = 256 programs
    assert pick_splits(1, 32, 4) == 4            # at most one split per chunk
    assert pick_splits(4, 128, 145) == 1


@pytest.mark.parametrize("extra", [False, True])
def test_cross_lowers_for_cuda_published_shape(extra):
    p = PUBLISHED
    S = jax.ShapeDtypeStruct
    kv = S((1, p["S"], p["Hk"], p["d"]), BF16)
    xs = (S((1, p["T"], p["Hk"], p["d"]), BF16),) * 2 if extra else ()
    args = (S((1, p["T"], p["H"], p["d"]), BF16), kv, kv, S((1,), jnp.int32), *xs)
    f = jax.jit(lambda q, k, v, n, *x: context_attention_pallas(q, k, v, n, *x, scale=p["d"] ** -0.5))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 1


def _bf16_draft(seed=4):
    """A 2-layer bf16 DSpark draft with head_dim 64 (the kernel's smallest) and 2 query heads per kv
    head; its projections on the skinny GEMM (dense_kernel='pallas', as the Decoder sets it)."""
    dc = DSparkConfig.from_dict(dict(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        intermediate_size=256, vocab_size=256, block_size=8, mask_token_id=255, target_layer_ids=[0, 1]))
    draft = DSparkDraft(dc, dtype=BF16, rngs=nnx.Rngs(seed))
    dense.set_dense_kernel(draft, "pallas")
    return draft


def test_draft_block_pass_with_the_kernel_matches_xla(monkeypatch):
    """ATTENTION_KERNEL: the draft's block pass with its attention on the kernel (the context and,
    as the kernel's extra keys, the block's own keys) gives the XLA pass's hidden states within bf16
    rounding (a 96-position context in a 128-row cache: masked positions, a partial chunk), one
    kernel call per layer."""
    draft = _bf16_draft()
    rng = np.random.default_rng(1)
    taps = jnp.asarray(rng.normal(size=(1, 96, draft.cfg.tap_dim)), BF16)
    embeds = jnp.asarray(rng.normal(size=(1, 8, 128)), BF16)

    def make_block():       # a fresh function per setting: jax caches traces per function
        def block():
            cache = draft.append_context(draft.init_cache(1, 128), taps, 0)
            return draft.forward_block(cache, embeds, 96)
        return block

    with kernel_mode():
        monkeypatch.setattr(dspark, "ATTENTION_KERNEL", False)
        ref = jax.jit(make_block())()
        assert kernel_calls(make_block(), name="context_attention_pallas") == 0
        monkeypatch.setattr(dspark, "ATTENTION_KERNEL", True)
        out = jax.jit(make_block())()
    assert kernel_calls(make_block(), name="context_attention_pallas") == 2
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert rel(np.asarray(out, np.float32), np.asarray(ref, np.float32)) <= 2e-2


@gpu_only
@pytest.mark.parametrize("X", [0, 8])
def test_gpu_published_shape_matches_reference(X):
    p = PUBLISHED
    q, k, v = _inputs(1, p["T"], p["H"], p["Hk"], p["d"], p["S"], seed=11)
    xs = tuple(a for a in _extra(1, X, p["Hk"], p["d"], seed=11) if a is not None)
    length = jnp.asarray([8704], jnp.int32)
    o, lse = jax.jit(lambda q, k, v, n, *x: context_attention_pallas(q, k, v, n, *x, scale=p["d"] ** -0.5))(
        q, k, v, length, *xs)
    ro, rl = jax.jit(lambda q, k, v, n, *x: context_attention_reference(q, k, v, n, *x, scale=p["d"] ** -0.5))(
        q, k, v, length, *xs)
    assert rel(np.asarray(o), np.asarray(ro)) <= 5e-3
    np.testing.assert_allclose(np.asarray(lse), np.asarray(rl), atol=1e-3)
