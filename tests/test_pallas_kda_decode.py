"""Tests for the fused KDA recurrent decode/verify kernel (pallas_kernels/kda_decode.py).

On CPU: (1) Mosaic GPU interpret mode with race detection vs the XLA reference
(lingjax.ops.kda.kda_recurrent) and the float64 numpy oracle; (2) cross-lowering for CUDA of the
real Ling shape. On a GPU (``JAX_PLATFORMS=cuda``; skipped elsewhere): the compiled kernel at the
Ling shape (H=32, K=V=128) vs the float64 oracle, bf16 and f32 inputs. Speed: bench/kernels.py.
"""

import jax

jax.config.update("jax_enable_x64", True)  # process-global (conftest): tests pass float32 explicitly

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from helpers import interpret_only  # noqa: E402
from lingjax.ops.kda import (  # noqa: E402
    kda_recurrent, kda_recurrent_numpy, kda_state_after_prefix, l2_normalize)
from pallas_kernels.kda_decode import kda_recurrent_pallas, kda_state_after_prefix_pallas  # noqa: E402

F32 = jnp.float32
INTERPRET = plgpu.InterpretGPUParams(detect_races=True)  # jax 0.12: races raise (on_race="raise")
# jax 0.11.2 has no on_race: a race is printed and flagged in the interpreter's (private) state.
RACES_RAISE = "on_race" in getattr(plgpu.InterpretGPUParams, "__dataclass_fields__", {})
ON_GPU = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA Hopper GPU (run with JAX_PLATFORMS=cuda)")


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


def _assert_no_race_flagged():
    if not RACES_RAISE:
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
        assert not gpu_callbacks.get_races().races_found, "interpret mode detected a race"


def _run_interpret(*args, **kw):
    out = jax.block_until_ready(kda_recurrent_pallas(*args, interpret=INTERPRET, **kw))
    _assert_no_race_flagged()
    return out


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
@interpret_only
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


@interpret_only
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


@pytest.mark.parametrize("n", [0, 3, 5])
@interpret_only
def test_interpret_state_after_prefix(n):
    """Replay commit: masking tokens >= n (g=0, beta=0) is exactly the kernel on the first n tokens."""
    q, k, v, g, beta, state = _inputs(1, 5, 2, 64, 64, gate="near-5", seed=11)
    s = kda_state_after_prefix_pallas(state, k, v, g, beta, jnp.int32(n), interpret=INTERPRET)
    _assert_no_race_flagged()
    if n:
        direct = _run_interpret(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], state)[1]
        np.testing.assert_array_equal(np.asarray(s), np.asarray(direct))
    else:
        np.testing.assert_array_equal(np.asarray(s), np.asarray(state))
    _check(s, kda_state_after_prefix(state, k, v, g, beta, jnp.int32(n)), 1e-5)


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


# ---- real kernel on the GPU (skipped elsewhere) ---------------------------------------------------
def _rel_rmse(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((out - ref) ** 2) / np.mean(ref ** 2)))


def _round_qkv(args, dtype):
    """q, k, v in `dtype` (the kernel's input precision); g, beta stay fp32 as in the model."""
    q, k, v, g, beta, state = args
    return (q.astype(dtype), k.astype(dtype), v.astype(dtype), g, beta, state)


@gpu_only
@pytest.mark.parametrize("gate", ["near0", "near-5"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("T", [1, 9, 16])
def test_gpu_matches_float64_oracle(T, dtype, gate):
    args = _inputs(1, T, 32, 128, 128, gate=gate, seed=100 + T)
    kargs = _round_qkv(args, dtype)
    o, s = jax.block_until_ready(jax.jit(kda_recurrent_pallas)(*kargs))
    assert o.shape == (1, T, 32, 128) and s.shape == (1, 32, 128, 128)
    # the kernel computes in fp32 on exactly its (rounded) inputs: tight vs the oracle on those
    no, ns = kda_recurrent_numpy(*kargs)
    _check(o, no, 1e-4)
    _check(s, ns, 1e-4)
    # accuracy bar (FLA's): relative RMSE <= 5e-3 vs float64 on the unrounded inputs
    fo, fs = kda_recurrent_numpy(*args)
    assert _rel_rmse(o, fo) <= 5e-3 and _rel_rmse(s, fs) <= 5e-3
    # and the XLA reference on the same device
    ro, rs = jax.jit(kda_recurrent)(*(x.astype(F32) for x in kargs))
    _check(o, ro, 1e-5)
    _check(s, rs, 1e-5)


@gpu_only
@pytest.mark.parametrize("block_v", [16, 32, 64, 128])
def test_gpu_every_block_v_batch2(block_v):
    args = _inputs(2, 16, 32, 128, 128, gate="near0", seed=7)
    o, s = jax.jit(kda_recurrent_pallas, static_argnames="block_v")(*args, block_v=block_v)
    no, ns = kda_recurrent_numpy(*args)
    _check(o, no, 1e-4)
    _check(s, ns, 1e-4)


@gpu_only
def test_gpu_decode_chain_and_prefix_commit():
    """Three T=1 decode calls carrying the state, then a 9-token block committed at n=4."""
    q, k, v, g, beta, state = _inputs(1, 12, 32, 128, 128, gate="near-5", seed=5)
    step = jax.jit(kda_recurrent_pallas)
    s = state
    for t in range(3):
        o, s = step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1], s)
    no, ns = kda_recurrent_numpy(q[:, :3], k[:, :3], v[:, :3], g[:, :3], beta[:, :3], state)
    _check(o[:, 0], no[:, 2], 1e-4)
    _check(s, ns, 1e-4)
    blk = (k[:, 3:], v[:, 3:], g[:, 3:], beta[:, 3:])
    c = jax.jit(kda_state_after_prefix_pallas)(s, *blk, jnp.int32(4))
    direct = step(q[:, 3:7], *(x[:, :4] for x in blk), s)[1]
    np.testing.assert_array_equal(np.asarray(c), np.asarray(direct))
    _check(c, kda_recurrent_numpy(q[:, :7], k[:, :7], v[:, :7], g[:, :7], beta[:, :7], state)[1], 1e-4)
