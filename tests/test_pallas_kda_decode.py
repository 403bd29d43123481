"""Tests for the fused KDA recurrent decode/verify kernel (pallas_kernels/kda_decode.py).

On CPU: (1) Mosaic GPU interpret mode with race detection vs the XLA reference
(lingjax.ops.kda.kda_recurrent) and the float64 numpy oracle; (2) cross-lowering for CUDA of the
real Ling shape. Registers, spills (ptxas) and speed are only checked on the H200.
"""

import jax

jax.config.update("jax_enable_x64", True)  # process-global (conftest): tests pass float32 explicitly

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from lingjax.ops.kda import kda_recurrent, kda_recurrent_numpy, l2_normalize  # noqa: E402
from pallas_kernels.kda_decode import kda_recurrent_pallas  # noqa: E402

F32 = jnp.float32
INTERPRET = plgpu.InterpretGPUParams(detect_races=True)  # races raise (on_race="raise")


def _inputs(B, T, H, K, V, *, gate, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = l2_normalize(jax.random.normal(ks[0], (B, T, H, K), F32)).astype(F32)
    k = l2_normalize(jax.random.normal(ks[1], (B, T, H, K), F32)).astype(F32)
    v = jax.random.normal(ks[2], (B, T, H, V), F32)
    u = jax.random.uniform(ks[3], (B, T, H, K), F32)
    if gate == "near0":                      # weak decay: g in (-0.05, 0)
        g = -0.05 * u
    else:                                    # strong decay near the safe-gate bound: g in (-5, -4)
        g = -4.0 - u
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H), F32))
    state = jax.random.normal(ks[5], (B, H, K, V), F32)
    return q, k, v, g.astype(F32), beta, state


def _run_interpret(*args, **kw):
    return kda_recurrent_pallas(*args, interpret=INTERPRET, **kw)


def _check(out, ref, rtol):
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    scale = max(np.abs(ref).max(), 1.0)
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=rtol * scale)


# (B, T, H, K=V, gate, block_v): subsampled grid over T in {1,3,9,16}, B/H in {1,2}, K in {64,128}.
CASES = [
    (1, 1, 1, 64, "near0", None),
    (2, 3, 2, 64, "near-5", None),
    (1, 9, 2, 128, "near0", None),
    (2, 16, 1, 128, "near-5", None),
    (1, 16, 2, 64, "near0", 64),             # one column block per head
    (2, 9, 1, 128, "near-5", 16),            # 8 column blocks per head
    (1, 3, 1, 128, "near0", 128),            # whole state in one program
]


@pytest.mark.parametrize("B,T,H,K,gate,block_v", CASES)
def test_interpret_matches_reference(B, T, H, K, gate, block_v):
    args = _inputs(B, T, H, K, K, gate=gate, seed=T * 7 + B + H + K)
    o, s = _run_interpret(*args, block_v=block_v)
    assert o.shape == (B, T, H, K) and o.dtype == F32
    assert s.shape == (B, H, K, K) and s.dtype == F32
    ro, rs = jax.jit(kda_recurrent)(*args)
    _check(o, ro, 1e-5)
    _check(s, rs, 1e-5)
    # and against the float64 oracle (looser: fp32 accumulation over T tokens)
    no, ns = kda_recurrent_numpy(*args)
    _check(o, no, 1e-4)
    _check(s, ns, 1e-4)


def test_interpret_custom_scale_and_bf16_inputs():
    q, k, v, g, beta, state = _inputs(1, 4, 2, 64, 64, gate="near0", seed=3)
    bf = lambda x: x.astype(jnp.bfloat16)
    args = (bf(q), bf(k), bf(v), g, bf(beta), state)
    o, s = _run_interpret(*args, scale=0.3)
    # reference on the same (bf16-rounded) values, in fp32
    ref_args = tuple(x.astype(F32) for x in args)
    ro, rs = jax.jit(kda_recurrent, static_argnames=("scale",))(*ref_args, scale=0.3)
    _check(o, ro, 1e-5)
    _check(s, rs, 1e-5)


def test_rejects_bad_shapes():
    args = _inputs(1, 17, 1, 64, 64, gate="near0")
    with pytest.raises(ValueError, match="T=17"):
        kda_recurrent_pallas(*args, interpret=INTERPRET)
    args = _inputs(1, 2, 1, 64, 64, gate="near0")
    with pytest.raises(ValueError, match="block_v"):
        kda_recurrent_pallas(*args, block_v=24, interpret=INTERPRET)


# Cross-lowering runs the real Mosaic GPU lowering (layout inference, MLIR verification, SMEM
# budget) on this CPU host. It does NOT run ptxas: registers, spills and speed are only checked
# on the H200.
@pytest.mark.parametrize("T", [1, 9, 16])
def test_cross_lowers_for_cuda_real_shape(T):
    args = _inputs(1, T, 32, 128, 128, gate="near0")
    lowered = jax.jit(kda_recurrent_pallas).trace(*args).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "mosaic_gpu" in text
