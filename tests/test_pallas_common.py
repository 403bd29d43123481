"""pallas_kernels.common helpers that run in plain XLA (any backend)."""
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import X_TOP_EXP, f16_rows


def test_f16_rows_scales_each_row_and_zeroes_non_finite_exponents():
    x = np.array([[1.5, -3.0, 0.25, 0.0],          # max |x| 3 = 0.75 * 2**2: e = 2
                  [0.0, 0.0, 0.0, 0.0],            # all zero: e = 0
                  [1.0, np.inf, 2.0, 0.0],         # inf: e = 0
                  [np.nan, 1.0, 2.0, 4.0],         # nan first: max |x| is nan, e = 0
                  [1.0, 2.0, 4.0, np.nan],         # nan last
                  [-1e-3, 2e-3, 0.0, 5e-4]], np.float32)
    xp, e = f16_rows(jnp.asarray(x, jnp.bfloat16), 8)
    assert xp.shape == (8, 4) and xp.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(e), [2, 0, 0, 0, 0, -8])
    xb = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    want = xb * np.exp2(X_TOP_EXP - np.asarray(e, np.float64))[:, None]
    got = np.asarray(xp[:6], np.float64)
    ok = [0, 1, 5]                    # finite rows: a power-of-two scaling, exact in f16
    np.testing.assert_array_equal(got[ok], want[ok])
    assert np.isinf(got[2, 1]) and np.isnan(got[3, 0]) and np.isnan(got[4, 3])   # the product is not finite either
    np.testing.assert_array_equal(np.asarray(xp[6:], np.float32), 0)
    assert np.abs(got[0]).max() < 2.0 ** 15 <= np.abs(got[0]).max() * 2      # max |x| lands in [2**14, 2**15)
