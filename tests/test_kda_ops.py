"""Tests for the pure-JAX KDA reference ops (lingjax/ops/kda.py)."""

import jax

jax.config.update("jax_enable_x64", True)  # process-global: float32 tests pass float32 explicitly

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

from lingjax.ops.kda import (  # noqa: E402
    kda_chunked,
    kda_gate,
    kda_recurrent,
    kda_recurrent_numpy,
    kda_state_after_prefix,
    kda_step,
    l2_normalize,
)

recurrent_jit = jax.jit(kda_recurrent)
chunked_jit = jax.jit(kda_chunked, static_argnames=("chunk_size",))
prefix_jit = jax.jit(kda_state_after_prefix, static_argnames=("chunk_size",))
step_jit = jax.jit(kda_step)

GATE_MODES = ("tiny", "safe_low", "safe_mixed", "softplus_strong")


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _softplus(x):
    return np.logaddexp(0.0, x)


def make_inputs(seed, B, T, H, K, V, gate_mode="safe_mixed", with_state=True):
    """Random KDA inputs in float64 numpy (q,k L2-normalised, beta = sigmoid(randn))."""
    rng = np.random.default_rng(seed)
    q = np.asarray(l2_normalize(jnp.asarray(rng.standard_normal((B, T, H, K)))))
    k = np.asarray(l2_normalize(jnp.asarray(rng.standard_normal((B, T, H, K)))))
    v = rng.standard_normal((B, T, H, V))
    beta = _sigmoid(rng.standard_normal((B, T, H)))
    if gate_mode == "tiny":  # nearly no decay
        g = -1e-4 * rng.uniform(0.0, 1.0, (B, T, H, K))
    else:
        A_log = np.log(rng.uniform(1.0, 4.0, H))
        dt_bias = rng.uniform(-0.5, 0.5, H * K)
        if gate_mode == "safe_low":  # saturated safe gate: close to the -5 lower bound
            f = rng.uniform(3.0, 8.0, (B, T, H, K))
        elif gate_mode == "safe_mixed":
            f = 2.0 * rng.standard_normal((B, T, H, K))
        else:  # Kimi softplus gate with strong decay, roughly down to -20 per token
            A_log = np.full(H, np.log(4.0))
            dt_bias = np.zeros(H * K)
            f = rng.uniform(-3.0, 5.0, (B, T, H, K))
        g = np.asarray(kda_gate(jnp.asarray(f), jnp.asarray(A_log), jnp.asarray(dt_bias),
                                safe_gate=gate_mode != "softplus_strong"))
    S0 = rng.standard_normal((B, H, K, V)) * 0.5 if with_state else None
    return q, k, v, g, beta, S0


def _j(xs, dtype):
    return [None if x is None else jnp.asarray(x, dtype) for x in xs]


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


# ----------------------------------------------------------------------------- gate / norm


@pytest.mark.parametrize("safe_gate", [True, False])
def test_kda_gate_matches_numpy(safe_gate):
    rng = np.random.default_rng(0)
    H, K = 3, 8
    f = 3.0 * rng.standard_normal((2, 5, H, K))
    A_log = rng.standard_normal(H)
    dt_bias = rng.standard_normal(H * K)
    x = f + dt_bias.reshape(H, K)
    a = np.exp(A_log)[:, None]
    ref = -5.0 * _sigmoid(a * x) if safe_gate else -a * _softplus(x)
    got = kda_gate(jnp.asarray(f), jnp.asarray(A_log), jnp.asarray(dt_bias), safe_gate=safe_gate)
    assert got.dtype == jnp.float64 and got.shape == f.shape
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-12, atol=1e-14)
    assert np.all(np.asarray(got) <= 0)
    # float32 / bfloat16 input -> float32 output
    got32 = kda_gate(jnp.asarray(f, jnp.bfloat16), jnp.asarray(A_log, jnp.float32),
                     jnp.asarray(dt_bias, jnp.float32), safe_gate=safe_gate)
    assert got32.dtype == jnp.float32
    if safe_gate:
        assert np.all(np.asarray(got32) >= -5.0)


def test_l2_normalize():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 16))
    ref = x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(np.asarray(l2_normalize(jnp.asarray(x))), ref, rtol=1e-13)
    y = l2_normalize(jnp.asarray(x, jnp.bfloat16))
    assert y.dtype == jnp.float32
    assert l2_normalize(jnp.asarray(x, jnp.float32)).dtype == jnp.float32


# ----------------------------------------------------------------------------- recurrent


@pytest.mark.parametrize("gate_mode", GATE_MODES)
def test_recurrent_matches_numpy_f64(gate_mode):
    xs = make_inputs(2, B=2, T=23, H=2, K=8, V=4, gate_mode=gate_mode)
    o_ref, s_ref = kda_recurrent_numpy(*xs)
    o, s = recurrent_jit(*_j(xs, jnp.float64))
    assert o.dtype == jnp.float64 and s.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(o), o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(s), s_ref, rtol=1e-12, atol=1e-12)


def test_recurrent_dtypes_and_scale():
    xs = make_inputs(3, B=1, T=5, H=2, K=4, V=8, with_state=False)
    o, s = kda_recurrent(*_j(xs, jnp.bfloat16))
    assert o.dtype == jnp.float32 and s.dtype == jnp.float32
    o_ref, _ = kda_recurrent_numpy(*xs, scale=0.3)
    o64, _ = kda_recurrent(*_j(xs, jnp.float64), scale=0.3)
    np.testing.assert_allclose(np.asarray(o64), o_ref, rtol=1e-12, atol=1e-12)


def test_step_equals_recurrent_t1():
    q, k, v, g, beta, S0 = make_inputs(4, B=2, T=1, H=3, K=8, V=16)
    for dt, tol in ((jnp.float64, 1e-13), (jnp.float32, 1e-6)):
        o_r, s_r = recurrent_jit(*_j((q, k, v, g, beta, S0), dt))
        o_s, s_s = step_jit(*_j((q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S0), dt))
        assert o_s.dtype == dt and s_s.dtype == dt
        np.testing.assert_allclose(np.asarray(o_s), np.asarray(o_r[:, 0]), rtol=tol, atol=tol)
        np.testing.assert_allclose(np.asarray(s_s), np.asarray(s_r), rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- chunked

shape_strategy = dict(
    seed=st.integers(0, 2**31 - 1),
    B=st.sampled_from([1, 2]),
    T=st.integers(1, 70),
    H=st.sampled_from([1, 2, 3]),
    K=st.sampled_from([4, 8, 16]),
    V=st.sampled_from([4, 8, 16]),
    chunk_size=st.sampled_from([4, 8, 16]),
    with_state=st.booleans(),
    gate_mode=st.sampled_from(GATE_MODES),
)


@settings(deadline=None, max_examples=20)
@given(**shape_strategy)
def test_chunked_matches_numpy_f64(seed, B, T, H, K, V, chunk_size, with_state, gate_mode):
    xs = make_inputs(seed, B, T, H, K, V, gate_mode, with_state)
    o_ref, s_ref = kda_recurrent_numpy(*xs)
    o, s = chunked_jit(*_j(xs, jnp.float64), chunk_size=chunk_size)
    assert o.shape == (B, T, H, V) and s.shape == (B, H, K, V)
    assert o.dtype == jnp.float64 and s.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(o), o_ref, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(np.asarray(s), s_ref, rtol=1e-10, atol=1e-10)


@settings(deadline=None, max_examples=20)
@given(**shape_strategy)
def test_chunked_matches_numpy_f32(seed, B, T, H, K, V, chunk_size, with_state, gate_mode):
    xs = make_inputs(seed, B, T, H, K, V, gate_mode, with_state)
    o_ref, s_ref = kda_recurrent_numpy(*xs)
    o, s = chunked_jit(*_j(xs, jnp.float32), chunk_size=chunk_size)
    assert o.dtype == jnp.float32 and s.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(o))) and np.all(np.isfinite(np.asarray(s)))
    assert rel_err(o, o_ref) < 2e-5
    assert rel_err(s, s_ref) < 2e-5


def test_chunked_extreme_decay_is_finite():
    """Gates of -20 per token over a full chunk (cumulative -320): no overflow in float32."""
    q, k, v, g, beta, S0 = make_inputs(5, B=1, T=40, H=2, K=8, V=8)
    g = np.full_like(g, -20.0)
    o_ref, s_ref = kda_recurrent_numpy(q, k, v, g, beta, S0)
    o, s = chunked_jit(*_j((q, k, v, g, beta, S0), jnp.float32), chunk_size=16)
    assert np.all(np.isfinite(np.asarray(o))) and np.all(np.isfinite(np.asarray(s)))
    assert rel_err(o, o_ref) < 2e-5 and rel_err(s, s_ref) < 2e-5


# ----------------------------------------------------------------------------- rollback


@pytest.mark.parametrize("T,chunk_size", [(16, 16), (9, 16), (13, 4)])
def test_state_after_prefix(T, chunk_size):
    q, k, v, g, beta, S0 = make_inputs(6 + T, B=2, T=T, H=2, K=8, V=4)
    args = _j((S0, k, v, g, beta), jnp.float64)
    for n in range(T + 1):
        _, s_ref = kda_recurrent_numpy(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], S0)
        s = prefix_jit(*args, jnp.int32(n), chunk_size=chunk_size)
        np.testing.assert_allclose(np.asarray(s), s_ref, rtol=1e-11, atol=1e-11)
    # float32 path
    args32 = _j((S0, k, v, g, beta), jnp.float32)
    s = prefix_jit(*args32, jnp.int32(T // 2), chunk_size=chunk_size)
    _, s_ref = kda_recurrent_numpy(q[:, :T // 2], k[:, :T // 2], v[:, :T // 2],
                                   g[:, :T // 2], beta[:, :T // 2], S0)
    assert s.dtype == jnp.float32 and rel_err(s, s_ref) < 2e-5
