"""pallas_kernels.common helpers that run in plain XLA (any backend)."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import E_MIN, X_TOP_EXP, combine_splits, f16_rows, pow2, row_exponent


def test_pow2_is_exact_over_its_range():
    k = np.arange(-126, 128, dtype=np.int32)
    np.testing.assert_array_equal(np.asarray(pow2(jnp.asarray(k))), np.exp2(k.astype(np.float64)).astype(np.float32))


def test_f16_rows_scales_each_row_by_its_max_exponent():
    x = np.array([[1.5, -3.0, 0.25, 0.0],          # max |x| 3 = 0.75 * 2**2: e = 2
                  [0.0, 0.0, 0.0, 0.0],            # all zero: e = E_MIN
                  [1.0, np.inf, 2.0, 0.0],         # inf: e = 128
                  [np.nan, 1.0, 2.0, 4.0],         # nan first: max |x| is nan, e = 128
                  [1.0, 2.0, 4.0, np.nan],         # nan last
                  [-1e-3, 2e-3, 0.0, 5e-4],        # max 2e-3 = 0.512 * 2**-8
                  [3e-35, -1e-36, 0.0, 2e-37],     # max below 2**E_MIN: e = E_MIN, every value still exact
                  [-1.0, 2.0 ** 100, 1.0, 0.0],    # a large row: e = 101
                  [1e-39, -3e-40, 0.0, 0.0]], np.float32)   # a subnormal max (biased exponent 0): e = E_MIN
    xb = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    xp, e = f16_rows(jnp.asarray(x, jnp.bfloat16), 10)
    assert xp.shape == (10, 4) and xp.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(e), [2, E_MIN, 128, 128, 128, -8, E_MIN, 101, E_MIN])
    for m in (0, 5, 7):               # rows with max |x| >= 2**E_MIN: frexp's exponent
        assert e[m] == np.frexp(np.abs(xb[m]).max())[1]
    want = xb * np.exp2(X_TOP_EXP - np.asarray(e, np.float64))[:, None]
    got = np.asarray(xp[:9], np.float64)
    ok = [0, 1, 5, 6]                 # finite rows: a power-of-two scaling, exact in f16
    np.testing.assert_array_equal(got[ok], want[ok])
    # float32 subnormals (< 2**-126): exact, or flushed to zero where XLA flushes denormals (CPU, GPU)
    assert xb[8, 0] != 0 and xb[8, 1] != 0
    assert np.all((got[8] == want[8]) | (got[8] == 0))
    assert got[7, 1] == 2.0 ** 14 and got[7, 0] == 0.0     # values below ~2**-28 max |x| underflow
    assert np.isinf(got[2, 1]) and np.isnan(got[3, 0]) and np.isnan(got[4, 3])   # the product is not finite either
    np.testing.assert_array_equal(np.asarray(xp[9:], np.float32), 0)
    assert np.abs(got[0]).max() < 2.0 ** 15 <= np.abs(got[0]).max() * 2      # max |x| lands in [2**14, 2**15)


def test_f16_rows_with_a_bound_takes_its_exponent_for_every_row():
    """x_bound (an RMSNorm's static bound): every row is scaled by the bound's power of two, no
    reduction over x; values within the bound stay exact and the bound lands in [2**14, 2**15)."""
    x = np.array([[1.5, -3.0, 0.25, 0.0],
                  [0.0, 0.0, 0.0, 0.0],
                  [-1e-3, 2e-3, 0.0, 5e-4],
                  [99.0, -100.0, 3.0, 7.0]], np.float32)
    xb = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    bound = 101.2                                        # 2 * sqrt(2560): ones-weight RMSNorm over 2560
    xp, e = f16_rows(jnp.asarray(x, jnp.bfloat16), 8, jnp.float32(bound))
    assert xp.shape == (8, 4) and xp.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(e), [7, 7, 7, 7])          # 101.2 in [2**6, 2**7)
    np.testing.assert_array_equal(np.asarray(row_exponent(jnp.float32(bound))), 7)
    want = xb * 2.0 ** (X_TOP_EXP - 7)
    np.testing.assert_array_equal(np.asarray(xp[:4], np.float64), want)    # exact: a power-of-two scaling
    np.testing.assert_array_equal(np.asarray(xp[4:], np.float32), 0)
    assert 2.0 ** 14 <= bound * 2.0 ** (X_TOP_EXP - 7) < 2.0 ** 15
    # without a bound the same rows scale by their own maxima (the same products after unscaling)
    _, e_own = f16_rows(jnp.asarray(x, jnp.bfloat16), 8)
    np.testing.assert_array_equal(np.asarray(e_own), [2, E_MIN, -8, 7])


def test_f16_rows_overflows_loudly_past_twice_the_bound():
    """A value above ~2x the bound (a stale or wrong bound) becomes inf, never a silently wrong finite value."""
    x = jnp.asarray([[1.0, 300.0]], jnp.bfloat16)
    xp, _ = f16_rows(x, 8, jnp.float32(100.0))
    assert np.isinf(np.asarray(xp[0, 1], np.float32)) and np.isfinite(np.asarray(xp[0, 0], np.float32))


def test_f16_rows_refuses_a_bound_per_row():
    """x_bound (skinny GEMM, MoE kernels) is one scalar: a per-row array is refused, not broadcast."""
    with pytest.raises(ValueError, match="one scalar"):
        f16_rows(jnp.ones((2, 8), jnp.bfloat16), 8, jnp.ones((2,), jnp.float32))


@pytest.mark.parametrize("axis", [0, 1])
def test_combine_splits_weights_by_each_split_denominator(axis):
    """Splits with denominators 2^3 and 2^1 (log2 sums 3 and 1) and an empty one (-inf), and a row
    no split saw (o = 0, lse = -inf)."""
    o = np.array([[1.0, 1.0], [4.0, 4.0], [0.0, 0.0]], np.float32)[:, None].repeat(2, 1)   # [n=3, R=2, d=2]
    lse = np.array([[3.0, -np.inf], [1.0, -np.inf], [-np.inf, -np.inf]], np.float32)      # [n, R]
    if axis == 1:
        o, lse = o[None], lse[None]                                                      # [B=1, n, R, d]
    got_o, got_lse = combine_splits(jnp.asarray(o), jnp.asarray(lse), axis=axis)
    got_o, got_lse = np.asarray(got_o).reshape(2, 2), np.asarray(got_lse).reshape(2)
    np.testing.assert_allclose(got_o[0], (8 * 1 + 2 * 4) / 10, rtol=1e-6)
    np.testing.assert_allclose(got_lse[0], np.log2(10.0), rtol=1e-6)
    np.testing.assert_array_equal(got_o[1], 0.0)
    assert got_lse[1] == -np.inf


def test_a_regs_refuses_an_unknown_load(monkeypatch):
    """A misspelt common.A_REGS_LOAD is refused when a kernel is traced, naming the choices."""
    import jax

    import pallas_kernels.common as common_mod
    from pallas_kernels.skinny_gemm import skinny_gemm_pallas
    monkeypatch.setattr(common_mod, "A_REGS_LOAD", "wgmma2")
    S = jax.ShapeDtypeStruct
    f = jax.jit(lambda x, w, s: skinny_gemm_pallas(x, w, s, k_minor=True))
    with pytest.raises(ValueError, match=r"A_REGS_LOAD='wgmma2' must be one of \('upcast2x', 'wgmma'\)"):
        f.trace(S((1, 256), jnp.bfloat16), S((128, 256), jnp.float8_e4m3fn),
                S((2, 1), jnp.float32)).lower(lowering_platforms=("cuda",))
