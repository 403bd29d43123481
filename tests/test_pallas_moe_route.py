"""Tests for the MoE router's selection kernel (pallas_kernels/moe_route.py).

On CPU: Mosaic GPU interpret mode with race detection against the XLA reference
(lingjax.ops.moe.grouped_top_k_by_rank, the model's selection for <= 16 tokens) at Ling-3.0-flash's
router shape and the tiny test model's, with scores drawn from a few values so that ties inside a
group, between group scores and between candidates all occur; cross-lowering for CUDA at Ling's
shape; the shapes it refuses. On a GPU (JAX_PLATFORMS=cuda; skipped elsewhere): the compiled kernel.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from helpers import assert_no_race_flagged, interpret_only
from lingjax.ops.moe import grouped_top_k_by_rank
from pallas_kernels.moe_route import check_route_shape, route_select_pallas

INTERPRET = plgpu.InterpretGPUParams(detect_races=True)
ON_GPU = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA Hopper GPU (run with JAX_PLATFORMS=cuda)")
LING = dict(E=512, G=8, TG=4, K=8)       # Ling-3.0-flash's router
TINY = dict(E=16, G=4, TG=2, K=4)        # tests/data/ling3-tiny


def _scores(M, E, seed, levels=None):
    """sigmoid-like scores + a bias, float32 [M, E]; `levels`: drawn from that many values (ties)."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    if levels:
        s = jax.random.randint(k1, (M, E), 0, levels).astype(jnp.float32) / levels
    else:
        s = jax.random.uniform(k1, (M, E), jnp.float32)
    return s + 0.1 * jax.random.normal(k2, (E,), jnp.float32)


def _check(b, shape, interpret=INTERPRET):
    got = route_select_pallas(b, n_group=shape["G"], topk_group=shape["TG"], top_k=shape["K"], interpret=interpret)
    ref = grouped_top_k_by_rank(b, shape["G"], shape["TG"], shape["K"])
    assert got.dtype == jnp.int32 and got.shape == ref.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    if interpret:
        assert_no_race_flagged()


@interpret_only
@pytest.mark.parametrize("shape,M,levels", [(LING, 1, None), (LING, 9, 7), (TINY, 3, None), (TINY, 5, 3)])
def test_interpret_matches_reference(shape, M, levels):
    _check(_scores(M, shape["E"], seed=M, levels=levels), shape)


@interpret_only
def test_interpret_all_ties_pick_the_lowest_ids():
    """Every score equal: the first topk_group groups, and in them the lowest expert ids."""
    b = jnp.full((2, 512), 0.5, jnp.float32)
    got = route_select_pallas(b, n_group=8, topk_group=4, top_k=8, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(got), np.tile(np.arange(8, dtype=np.int32), (2, 1)))
    _check(b, LING)


def test_check_route_shape():
    assert check_route_shape(512, 8, 4, 8) == 8 and check_route_shape(16, 4, 2, 4) == 4
    for args, msg in [((512, 7, 4, 8), "do not split"), ((512, 4, 2, 8), "must both fit"),
                      ((16, 16, 2, 1), "must both fit"), ((512, 8, 9, 8), "topk_group=9"),
                      ((512, 8, 1, 16), "offer >= top_k"), ((64 * 128, 128, 4, 8), "must both fit")]:
        with pytest.raises(ValueError, match=msg):
            check_route_shape(*args)
    with pytest.raises(ValueError, match=r"\[M, E\]"):
        route_select_pallas(jnp.zeros((512,)), n_group=8, topk_group=4, top_k=8)


@pytest.mark.parametrize("M", [1, 9, 16])
def test_cross_lowers_for_cuda(M):
    fn = jax.jit(lambda b: route_select_pallas(b, n_group=8, topk_group=4, top_k=8))
    txt = fn.trace(jax.ShapeDtypeStruct((M, 512), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in txt


# ---- real kernel on the GPU (skipped elsewhere) ---------------------------------------------------
@gpu_only
@pytest.mark.parametrize("M,levels", [(1, None), (9, None), (16, 5)])
def test_gpu_matches_reference(M, levels):
    _check(_scores(M, 512, seed=M, levels=levels), LING, interpret=False)
