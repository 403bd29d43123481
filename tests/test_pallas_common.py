"""pallas_kernels.common helpers that run in plain XLA (any backend)."""
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import E_MIN, X_TOP_EXP, f16_rows, pow2


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
