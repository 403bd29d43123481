"""Tests for the absorbed MLA decode / verify attention kernel (pallas_kernels/mla_decode.py).

On CPU: Mosaic GPU interpret mode with race detection against the XLA reference
(lingjax.ops.mla.absorbed_attention) and a float64 run of it, over token counts, head counts,
latent widths (one and two column blocks), several row tiles, batches, context splits (empty ones
included) and caches whose length is not a multiple of the chunk; what lies past a row's position
cannot change its output; cross-lowering for CUDA at the Ling shape. On a GPU (JAX_PLATFORMS=cuda;
skipped elsewhere): the compiled kernel at the Ling shape.
"""

import jax

jax.config.update("jax_enable_x64", True)  # process-global (conftest): tests pass float32 explicitly

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from helpers import assert_no_race_flagged, interpret_only, rel  # noqa: E402
from lingjax.ops.mla import absorbed_attention  # noqa: E402
from pallas_kernels.mla_decode import (WARPGROUPS, mla_decode_attention_pallas, pick_splits,  # noqa: E402
                                       warpgroups_for)

BF16 = jnp.bfloat16
INTERPRET = plgpu.InterpretGPUParams(detect_races=True)
ON_GPU = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA Hopper GPU (run with JAX_PLATFORMS=cuda)")
LING = dict(H=32, L=512, Dr=64)     # Ling-3.0-flash: 32 heads, kv_lora_rank 512, qk_rope_head_dim 64


def _inputs(B, T, H, L, Dr, S, seed=0):
    """(q_lat [B, T*H, L], q_rope [B, T*H, Dr], latent [B, S, L], k_rope [B, S, Dr]), bf16 normals."""
    r = jax.random.split(jax.random.PRNGKey(seed), 4)
    shapes = ((B, T * H, L), (B, T * H, Dr), (B, S, L), (B, S, Dr))
    return tuple(jax.random.normal(k, sh, jnp.float32).astype(BF16) for k, sh in zip(r, shapes))


def _scale(L, Dr):
    return 0.5 * (L + Dr) ** -0.5      # spreads the softmax over a few dozen positions


def _run(args, pos, H, scale, interpret=INTERPRET, **kw):
    o = jax.block_until_ready(mla_decode_attention_pallas(*args, jnp.int32(pos), heads=H, scale=scale,
                                                          interpret=interpret, **kw))
    if interpret:
        assert_no_race_flagged()
    return np.asarray(o)


def _references(args, pos, H, scale):
    """(the XLA reference on the bf16 inputs, the same in float64)."""
    ref = absorbed_attention(*args, jnp.int32(pos), heads=H, scale=scale)
    f64 = absorbed_attention(*(x.astype(jnp.float64) for x in args), jnp.int32(pos), heads=H, scale=scale)
    return np.asarray(ref), np.asarray(f64)


# (B, T, H, L, Dr, S, pos, splits): tiny-model widths (one 32-wide column block, 32-position
# chunks), the Ling widths (two 256-wide column blocks; 9 x 32 rows = 5 row tiles, the last partial),
# two sequences, splits with nothing to do, a cache length that is not a multiple of the chunk
CASES = [
    (1, 1, 2, 32, 16, 40, 20, None),
    (2, 3, 2, 32, 16, 40, 35, 2),
    (1, 9, 32, 512, 64, 320, 250, 4),
    (1, 1, 32, 512, 64, 256, 10, 4),
    (2, 16, 4, 512, 64, 136, 100, 3),
]


@interpret_only
@pytest.mark.parametrize("B,T,H,L,Dr,S,pos,splits", CASES)
def test_interpret_matches_reference_and_float64(B, T, H, L, Dr, S, pos, splits):
    args = _inputs(B, T, H, L, Dr, S, seed=T + S)
    o = _run(args, pos, H, _scale(L, Dr), splits=splits)
    ref, f64 = _references(args, pos, H, _scale(L, Dr))
    assert o.shape == (B, T * H, L) and o.dtype == np.float32
    # measured on CPU: kernel 1.1-1.6e-3 from float64, the XLA reference 1.4-1.7e-3 (both round P to bf16)
    assert rel(o, f64) <= 2.5e-3, rel(o, f64)
    assert rel(o, ref) <= 4e-3, rel(o, ref)


@interpret_only
@pytest.mark.parametrize("B,T,H,S,pos,splits", [(1, 9, 32, 320, 250, 4), (1, 1, 32, 256, 10, 4),
                                                (2, 16, 4, 136, 100, 3), (1, 2, 32, 1024, 1000, 2)])
def test_two_warpgroups_equal_one(B, T, H, S, pos, splits):
    """warpgroups=2 (one program for both column blocks, P passed through SMEM) computes the same
    values in the same order: bit for bit the one-warpgroup form (empty splits, several row tiles,
    8 chunks per program in the last case)."""
    args = _inputs(B, T, H, 512, 64, S, seed=T + S)
    one, two = (_run(args, pos, H, _scale(512, 64), splits=splits, warpgroups=w) for w in (1, 2))
    np.testing.assert_array_equal(two, one)


def test_warpgroups_for():
    assert warpgroups_for(512, 64, 9280) == WARPGROUPS
    assert warpgroups_for(32, 16, 64) == warpgroups_for(512, 64, 32) == 1      # tiny widths; 32-position chunks


@interpret_only
def test_first_position_alone_is_its_latent():
    """T = 1 at position 0 sees one position: softmax weight exactly 1, o = latent[0]."""
    args = _inputs(1, 1, 32, 512, 64, 128)
    o = _run(args, 0, 32, 0.1)
    np.testing.assert_array_equal(o[0], np.broadcast_to(np.asarray(args[2][0, 0], np.float32), o[0].shape))


@interpret_only
def test_positions_past_each_row_do_not_matter():
    """Garbage in the cache past the block's last position (and past each row's own position inside
    the block) leaves the output bit for bit the same: masked scores give exactly zero weight."""
    B, T, H, L, Dr, S, pos = 1, 3, 2, 32, 16, 64, 30
    ql, qr, latent, k_rope = _inputs(B, T, H, L, Dr, S)
    o = _run((ql, qr, latent, k_rope), pos, H, 0.2, splits=2, block_s=16)
    garbage = jnp.arange(S)[None, :, None] > pos + T - 1
    o2 = _run((ql, qr, jnp.where(garbage, 1e4, latent).astype(BF16), jnp.where(garbage, -3e3, k_rope).astype(BF16)),
              pos, H, 0.2, splits=2, block_s=16)
    np.testing.assert_array_equal(o, o2)
    # row t = 0 (its H rows) must not see the block's own later positions pos + 1, pos + 2
    later = (jnp.arange(S)[None, :, None] > pos) & (jnp.arange(S)[None, :, None] <= pos + T - 1)
    o3 = _run((ql, qr, jnp.where(later, 50.0, latent).astype(BF16), k_rope), pos, H, 0.2, splits=2, block_s=16)
    np.testing.assert_array_equal(o3[:, :H], o[:, :H])
    assert not np.array_equal(o3[:, H:], o[:, H:])


@interpret_only
def test_split_count_changes_only_rounding():
    """Each split rounds its P to bf16 against its own running max: bf16-level differences
    (measured 4.6e-4), nothing more."""
    args = _inputs(1, 2, 4, 32, 16, 128, seed=3)
    outs = [_run(args, 120, 4, 0.2, splits=n, block_s=16) for n in (1, 2, 4)]      # 8 chunks
    assert rel(outs[1], outs[0]) <= 2e-3 and rel(outs[2], outs[0]) <= 2e-3


def test_default_splits_fill_the_gpu():
    assert pick_splits(1, 5, 2, 145) == 13       # verify T = 9: 5 row tiles x 2 column blocks
    assert pick_splits(1, 1, 2, 145) == 66       # decode T = 1
    assert pick_splits(1, 1, 2, 3) == 3          # never more splits than chunks


def test_rejects_bad_inputs():
    args = _inputs(1, 1, 2, 32, 16, 40)
    ql, qr, latent, k_rope = args
    run = lambda *a, **kw: mla_decode_attention_pallas(*a, jnp.int32(0), **{"heads": 2, "scale": 0.1, **kw})  # noqa: E731
    with pytest.raises(ValueError, match="bfloat16"):
        run(ql.astype(jnp.float32), qr, latent, k_rope)
    with pytest.raises(ValueError, match="need q_lat"):
        run(ql, qr[..., :8], latent, k_rope)
    with pytest.raises(ValueError, match="whole number of tokens"):
        run(*args, heads=3)
    with pytest.raises(ValueError, match="T=17"):
        run(*_inputs(1, 17, 2, 32, 16, 40))
    with pytest.raises(ValueError, match="S % 8 == 0"):
        run(*_inputs(1, 1, 2, 32, 16, 42))
    with pytest.raises(ValueError, match="S >= 16"):
        run(*_inputs(1, 1, 2, 32, 16, 8))
    with pytest.raises(ValueError, match="splits=3"):
        run(*args, splits=3)          # 40 positions = 2 chunks of 32
    with pytest.raises(ValueError, match="block_s=48"):
        run(*args, block_s=48)
    with pytest.raises(ValueError, match="multiple of 16"):
        run(*_inputs(1, 1, 2, 32, 8, 40))
    with pytest.raises(ValueError, match="warpgroups=2"):
        run(*args, warpgroups=2)                  # one 32-wide column block
    with pytest.raises(ValueError, match="warpgroups=3"):
        run(*_inputs(1, 1, 2, 512, 64, 64), warpgroups=3)


# Cross-lowering runs the real Mosaic GPU lowering (layout inference, MLIR verification, the SMEM
# budget) on this CPU host; registers, spills and speed are only checked on the H200.
@pytest.mark.parametrize("T,S,H,L,Dr,wgs", [(1, 9280, 32, 512, 64, 1), (9, 9224, 32, 512, 64, 1),
                                            (16, 8192, 32, 512, 64, 1), (3, 64, 2, 32, 16, 1),
                                            (1, 9280, 32, 512, 64, 2), (9, 9224, 32, 512, 64, 2),
                                            (16, 8192, 32, 512, 64, 2)],
                         ids=["ling-decode", "ling-verify", "ling-16", "tiny", "ling-decode-2wg", "ling-verify-2wg",
                              "ling-16-2wg"])
def test_cross_lowers_for_cuda(T, S, H, L, Dr, wgs):
    """The Ling shape (decode, verify, T = 16; both forms: the two-warpgroup one fills SMEM to
    ~100 bytes of the limit) and the tiny model's widths (32-wide TMA rows)."""
    shapes = [jax.ShapeDtypeStruct(sh, BF16) for sh in ((1, T * H, L), (1, T * H, Dr), (1, S, L), (1, S, Dr))]
    fn = jax.jit(lambda *a: mla_decode_attention_pallas(*a, heads=H, scale=0.07, warpgroups=wgs))
    shapes.append(jax.ShapeDtypeStruct((), jnp.int32))
    assert "mosaic_gpu" in fn.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


# ---- real kernel on the GPU (skipped elsewhere) ---------------------------------------------------
@gpu_only
@pytest.mark.parametrize("wgs", [1, 2])
@pytest.mark.parametrize("T,pos", [(1, 8191), (9, 8200), (16, 100)])
def test_gpu_matches_reference(T, pos, wgs):
    args = _inputs(1, T, LING["H"], LING["L"], LING["Dr"], 9280, seed=T)
    scale = _scale(LING["L"], LING["Dr"])
    o = _run(args, pos, LING["H"], scale, interpret=False, warpgroups=wgs)
    ref, f64 = _references(args, pos, LING["H"], scale)
    assert rel(o, f64) <= 2.5e-3 and rel(o, ref) <= 4e-3, (rel(o, f64), rel(o, ref))
