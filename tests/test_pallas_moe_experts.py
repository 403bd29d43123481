"""Tests for the batch-1 routed-expert MoE kernel (pallas_kernels/moe_experts.py).

On CPU: (1) the XLA dedupe prologue (zero-weight slots not counted); (2) Mosaic GPU interpret
mode with race detection vs lingjax.ops.moe.experts_gather on block-fp8 weights
(lingjax.quant.Fp8Weight) and on bf16 weights at small shapes: shared experts, all tokens on the
same experts, several fp8 scale blocks with very different scales, the SwiGLU clamp, unselected
experts poisoned with NaN (never read), and experts chosen only with combine weight 0 poisoned
too (skipped); (3) cross-lowering for CUDA at the Ling shape, fp8 and bf16. On a GPU
(``JAX_PLATFORMS=cuda``; skipped elsewhere): the compiled kernel at the Ling shape vs
experts_gather. Speed: bench/moe_kernel_timing.py.
"""

import jax

jax.config.update("jax_enable_x64", True)  # process-global (conftest): tests pass dtypes explicitly

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from helpers import assert_no_race_flagged, interpret_only  # noqa: E402
from lingjax.ops.moe import experts_gather  # noqa: E402
from lingjax.param_layout import Matrix  # noqa: E402
from lingjax.quant import FP8, Fp8Weight  # noqa: E402
import pallas_kernels.common as common_mod  # noqa: E402
import pallas_kernels.moe_experts as moe_experts_mod  # noqa: E402
from pallas_kernels.moe_experts import (dedupe_experts, moe_experts_pallas, moe_split, scale_at,  # noqa: E402
                                        scale_rows, weight_bytes)

F32, BF16 = jnp.float32, jnp.bfloat16
INTERPRET = plgpu.InterpretGPUParams(detect_races=True)  # jax 0.12: races raise (on_race="raise")
ON_GPU = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA Hopper GPU (run with JAX_PLATFORMS=cuda)")
# The tests make K-major weights (w_gate_up [E, D, 2, F], w_down [E, F, D]: k_minor=False) and
# transpose them for the K-minor kernels and the model's reference (w_gate_up [E, 2, F, D], w_down
# [E, D, F]); the scales keep their [.., IN blocks, OUT blocks] layout in both.
GU_VIEW, DOWN_VIEW = Matrix((0, 2), (1,), (3,)), Matrix((0,), (1,), (2,))
K_MINOR_GU_VIEW, K_MINOR_DOWN_VIEW = Matrix((0, 1), (3,), (2,)), Matrix((0,), (2,), (1,))


def _k_minor(vgu, sgu, vd, sd):
    """K-major test weights -> the K-minor layout (the kernels' k_minor=True, the model's)."""
    return vgu.transpose(0, 2, 3, 1), sgu, jnp.swapaxes(vd, 1, 2), sd
LING = dict(E=512, D=2560, F=768, k=8)


def _weights(E, D, F, seed=0, kind="fp8"):
    """Random block-fp8 expert weights: fp8 values in +-~8, scales spanning 2**-12..2**-4 so a
    block read with another block's scale is off by up to 256x. kind="bf16": the same weights
    dequantised to plain bf16 arrays, scales None (the kernel's bf16 entry)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    vgu = (2.0 * jax.random.normal(ks[0], (E, D, 2, F), F32)).astype(FP8)
    vd = (2.0 * jax.random.normal(ks[1], (E, F, D), F32)).astype(FP8)
    sgu = 2.0 ** jax.random.randint(ks[2], (E, 2, D // 128, F // 128), -12, -4).astype(F32)
    sd = 2.0 ** jax.random.randint(ks[3], (E, F // 128, D // 128), -12, -4).astype(F32)
    if kind == "bf16":
        return _fp8(vgu, sgu, GU_VIEW)[...], None, _fp8(vd, sd, DOWN_VIEW)[...], None
    return vgu, sgu, vd, sd


def _fp8(values, scale, view, dtype=BF16):
    logical = ("experts", None, None, None) if values.ndim == 4 else ("experts", None, None)
    return Fp8Weight(values, scale, view=view, block=(128, 128), dtype=dtype, logical=logical)


def _reference(x, idx, w, vgu, sgu, vd, sd, limit=None, dtype=BF16):
    """experts_gather on the same fp8 (or bf16: sgu None) weights, given in the kernels' K-major
    test layout and transposed to the model's K-minor one, computing in `dtype` (bf16: the
    model's path)."""
    vgu, _, vd, _ = _k_minor(vgu, None, vd, None)
    if sgu is None:
        gu, d = vgu.astype(dtype), vd.astype(dtype)
    else:
        gu, d = _fp8(vgu, sgu, K_MINOR_GU_VIEW, dtype), _fp8(vd, sd, K_MINOR_DOWN_VIEW, dtype)
    return experts_gather(x.astype(dtype), idx, w, gu, d, limit).astype(F32)


def _poison(bad, vgu, sgu, vd, sd):
    """NaN in every weight (and scale) of the experts where bad [E] is True."""
    nan = jnp.asarray(np.float32("nan")).astype(vgu.dtype)
    vgu = jnp.where(bad[:, None, None, None], nan, vgu)
    vd = jnp.where(bad[:, None, None], nan, vd)
    if sgu is not None:
        sgu = jnp.where(bad[:, None, None, None], jnp.nan, sgu)
        sd = jnp.where(bad[:, None, None], jnp.nan, sd)
    return vgu, sgu, vd, sd


def _routing(M, k, E, mode, seed=0):
    rng = np.random.default_rng(seed)
    if mode == "same":                      # every token picks the same k experts (other order)
        base = rng.choice(E, k, replace=False)
        idx = np.stack([rng.permutation(base) for _ in range(M)])
    elif mode == "overlap":                 # draws from a small pool: experts shared by tokens
        pool = rng.choice(E, min(E, k + 2), replace=False)
        idx = np.stack([rng.choice(pool, k, replace=False) for _ in range(M)])
    else:                                   # independent tokens
        idx = np.stack([rng.choice(E, k, replace=False) for _ in range(M)])
    w = rng.uniform(0.05, 1.0, (M, k))
    return jnp.asarray(idx, jnp.int32), jnp.asarray(w, F32)


def _check(out, ref, tol):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * np.abs(ref).max())


def test_dedupe_experts():
    """M*k <= E: each expert at its first (token, slot) pair in token-major order, -1 at repeats."""
    idx = jnp.asarray([[5, 2, 9], [2, 7, 5]], jnp.int32)
    w = jnp.asarray([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]], F32)
    uniq, wu = dedupe_experts(idx, w, 16)
    assert uniq.shape == (6,) and wu.shape == (6, 2)
    np.testing.assert_array_equal(np.asarray(uniq), [5, 2, 9, -1, 7, -1])
    kept = np.asarray(uniq) >= 0                  # padding slots' rows are not used (kernel 2 writes zeros)
    np.testing.assert_array_equal(np.asarray(wu)[kept], np.asarray([[0.1, 0.6], [0.2, 0.4], [0.3, 0], [0, 0.5]], F32))
    uniq, wu = dedupe_experts(jnp.asarray([[3, 1]] * 5, jnp.int32), jnp.ones((5, 2), F32), 4)
    assert uniq.shape == (4,)                                    # M*k > E: bound min(M*k, E), sorted
    np.testing.assert_array_equal(np.asarray(uniq), [1, 3, -1, -1])
    np.testing.assert_allclose(np.asarray(wu), [[1] * 5, [1] * 5, [0] * 5, [0] * 5])


def test_dedupe_skips_zero_weight_slots():
    """A slot with combine weight exactly 0 does not count: 9 (only chosen with weight 0) is
    dropped; 2 stays (token 0 chose it with weight 0.2, token 1 with 0)."""
    idx = jnp.asarray([[5, 2, 9], [2, 7, 5]], jnp.int32)
    w = jnp.asarray([[0.1, 0.2, 0.0], [-0.0, 0.5, 0.6]], F32)
    uniq, wu = dedupe_experts(idx, w, 16)
    np.testing.assert_array_equal(np.asarray(uniq), [5, 2, -1, -1, 7, -1])
    kept = np.asarray(uniq) >= 0
    np.testing.assert_array_equal(np.asarray(wu)[kept], np.asarray([[0.1, 0.6], [0.2, 0], [0, 0.5]], F32))
    uniq, wu = dedupe_experts(idx, jnp.zeros_like(w), 16)          # nothing to run at all
    np.testing.assert_array_equal(np.asarray(uniq), [-1] * 6)
    # an expert first chosen with weight 0 runs at its first pair with a nonzero weight
    uniq, wu = dedupe_experts(jnp.asarray([[5, 2, 9], [9, 7, 5]], jnp.int32),
                              jnp.asarray([[0.1, 0.2, 0.0], [0.4, 0.5, 0.6]], F32), 16)
    np.testing.assert_array_equal(np.asarray(uniq), [5, 2, -1, 9, 7, -1])
    np.testing.assert_array_equal(np.asarray(wu)[3], np.asarray([0, 0.4], F32))
    uniq, wu = dedupe_experts(jnp.asarray([[3, 1]] * 5, jnp.int32),  # M*k > E, the sorted path
                              jnp.asarray([[0.0, 1.0]] * 5, F32), 4)
    np.testing.assert_array_equal(np.asarray(uniq), [1, -1, -1, -1])


@pytest.mark.parametrize("M,k,E", [(9, 8, 512), (16, 8, 512), (4, 3, 12), (7, 2, 16)])
def test_dedupe_experts_matches_a_dense_combine(M, k, E):
    """Both dedupe paths against the dense [M, E] combine matrix: every expert with a nonzero
    weight appears exactly once, carrying each token's weight for it; nothing else appears."""
    rng = np.random.default_rng(M * 100 + E)
    idx = np.stack([rng.choice(min(E, 12), k, replace=False) for _ in range(M)])   # heavy overlap
    w = rng.uniform(0.1, 1.0, (M, k)).astype(np.float32)
    w[rng.random((M, k)) < 0.2] = 0.0
    uniq, wu = (np.asarray(a) for a in dedupe_experts(jnp.asarray(idx, jnp.int32), jnp.asarray(w), E))
    dense = np.zeros((M, E), np.float32)
    np.add.at(dense, (np.arange(M)[:, None], idx), w)
    used = uniq[uniq >= 0]
    assert len(set(used.tolist())) == len(used)                                  # each expert once
    assert set(used.tolist()) == set(np.flatnonzero(dense.any(0)).tolist())
    np.testing.assert_array_equal(wu[uniq >= 0], dense[:, used].T)
    assert np.isfinite(wu).all()          # padding slots' rows: unused (times kernel 2's zeros), finite


@pytest.mark.parametrize("shape,rows", [((3, 2, 20, 6), (1, 240)),     # Ling-3.0 gate/up: a free reshape
                                        ((3, 6, 20), (1, 120)),        # Ling-3.0 down
                                        ((3, 2, 3, 5), (1, 32)),       # 30 -> zero-padded to 32
                                        ((3, 7, 80), (4, 140))])       # 560 floats: 4 rows of 140
def test_scale_rows_index_like_the_stored_scales(shape, rows):
    """scale_rows keeps each expert's scales in row-major order (scale_at(q) is the q-th of the
    expert's stored [.., IN, OUT] blocks), in rows of a multiple of 4 floats, <= 256 per row."""
    s = jax.random.uniform(jax.random.PRNGKey(0), shape, F32)
    r = scale_rows(s, 1)
    assert r.shape == (shape[0], *rows) and r.dtype == F32
    flat = np.asarray(s).reshape(shape[0], -1)
    for e in range(shape[0]):
        got = [float(scale_at(r[e], jnp.int32(q))) for q in range(flat.shape[1])]
        np.testing.assert_array_equal(got, flat[e])
    assert scale_rows(s[0], 0).shape == rows                     # the shared expert's own array


def test_scale_rows_refuses_more_than_one_tma_copy():
    with pytest.raises(ValueError, match="one TMA copy"):
        scale_rows(jnp.zeros((2, 4 * 257), F32), 1)             # 257 rows of 4 floats


def test_dedupe_single_token_keeps_slot_order():
    """M = 1 (plain decode): the slots as they are, zero-weight ones -1; the same experts and
    weights as the sorting path gives for the token (checked against it via a second, empty token)."""
    idx = jnp.asarray([[5, 2, 9, 7]], jnp.int32)
    w = jnp.asarray([[0.1, 0.0, 0.3, 0.4]], F32)
    uniq, wu = dedupe_experts(idx, w, 16)
    np.testing.assert_array_equal(np.asarray(uniq), [5, -1, 9, 7])
    np.testing.assert_allclose(np.asarray(wu), [[0.1], [0], [0.3], [0.4]])
    two_u, two_wu = dedupe_experts(jnp.concatenate([idx, idx]), jnp.concatenate([w, jnp.zeros_like(w)]), 16)
    by_expert = {int(e): float(x) for e, x in zip(np.asarray(two_u), np.asarray(two_wu)[:, 0]) if e >= 0}
    assert by_expert == {int(e): float(x) for e, x in zip(np.asarray(uniq), np.asarray(wu)[:, 0]) if e >= 0}
    uniq, wu = dedupe_experts(idx, jnp.zeros_like(w), 16)          # nothing to run at all
    np.testing.assert_array_equal(np.asarray(uniq), [-1] * 4)
    assert not np.asarray(wu).any()


# (M, D, F, mode, limit, kind): small shapes; D = 256 is 2 scale blocks, F = 256 is 2 blocks / 4 tiles
CASES = [
    (1, 256, 128, "independent", None, "fp8"),
    (3, 256, 256, "overlap", None, "fp8"),
    (9, 256, 128, "same", None, "fp8"),
    (9, 384, 128, "overlap", 0.02, "fp8"),
    (3, 256, 256, "overlap", None, "bf16"),
    (9, 384, 128, "overlap", 0.02, "bf16"),
]


@pytest.mark.parametrize("M,D,F,mode,limit,kind", CASES)
@interpret_only
def test_interpret_matches_experts_gather(M, D, F, mode, limit, kind):
    E, k = 16, 4
    weights = _weights(E, D, F, seed=M + D + F, kind=kind)
    idx, w = _routing(M, k, E, mode, seed=M)
    x = jax.random.normal(jax.random.PRNGKey(M), (M, D), F32).astype(BF16)
    ref = _reference(x, idx, w, *weights, limit)
    if limit:   # the clamp must be active for this case to test it
        h = _reference(x, idx, w, *weights, None)
        assert np.abs(np.asarray(h) - np.asarray(ref)).max() > 0.1 * np.abs(np.asarray(ref)).max()
    # poison every unselected expert (values and scales): reading one would give NaN
    chosen = np.zeros(E, bool)
    chosen[np.asarray(idx).ravel()] = True
    out = moe_experts_pallas(x, idx, w, *_poison(jnp.asarray(~chosen), *weights), limit, interpret=INTERPRET)
    out = jax.block_until_ready(out)
    assert_no_race_flagged()
    assert out.shape == (M, D) and out.dtype == BF16
    _check(out, ref, 2e-2)                                   # bf16 rounding of h, act, y differ
    _check(out, _reference(x, idx, w, *weights, limit, dtype=F32), 2e-2)


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@interpret_only
def test_interpret_skips_zero_weight_experts(kind):
    """Experts chosen only with combine weight 0 are never read (poisoned with NaN, the output
    stays finite and equals the reference on clean weights); a token whose weights are all 0 gets
    0; a 0-weight slot duplicating another token's expert (what expert_keep produces) is harmless."""
    E, k, D, F = 16, 4, 256, 128
    weights = _weights(E, D, F, seed=7, kind=kind)
    idx = jnp.asarray([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 1, 10]], jnp.int32)
    w = jnp.asarray([[0.5, 0.3, 0.0, 0.2],           # expert 2: weight 0 only
                     [0.0, 0.0, 0.0, 0.0],           # token 1: nothing (4..7 never read)
                     [0.7, 0.0, 0.0, 0.3]], F32)     # 9: weight 0 only; 1: 0 here, > 0 for token 0
    x = jax.random.normal(jax.random.PRNGKey(7), (3, D), F32).astype(BF16)
    ref = _reference(x, idx, w, *weights)
    assert np.isfinite(np.asarray(ref)).all() and not np.asarray(ref)[1].any()
    read = np.zeros(E, bool)
    read[[0, 1, 3, 8, 10]] = True
    out = moe_experts_pallas(x, idx, w, *_poison(jnp.asarray(~read), *weights), interpret=INTERPRET)
    out = jax.block_until_ready(out)
    assert_no_race_flagged()
    _check(out, ref, 2e-2)
    assert not np.asarray(out)[1].any()


# (M, D, F, split_d, split_f, limit, kind): the reduction split over programs (partial sums added
# in XLA); D = 512 is 4 chunks, F = 256 two; slot 1 of token 0 has weight 0 (a padding slot)
SPLIT_CASES = [
    (1, 512, 256, 4, 2, None, "fp8"),
    (1, 512, 256, 2, 1, 0.02, "fp8"),
    (3, 512, 256, 2, 2, None, "bf16"),
    (1, 512, 256, 4, 2, 0.02, "bf16"),
]


@pytest.mark.parametrize("M,D,F,split_d,split_f,limit,kind", SPLIT_CASES)
@interpret_only
def test_interpret_split_reduction_matches(M, D, F, split_d, split_f, limit, kind):
    """Kernel 1 split over D (SwiGLU after the partial sums, in XLA) and kernel 2 split over F
    give the unsplit kernel's result and the reference; padding slots stay unread."""
    E, k = 16, 4
    weights = _weights(E, D, F, seed=3 + M + split_d, kind=kind)
    idx, w = _routing(M, k, E, "independent", seed=M + 11)
    w = w.at[0, 1].set(0.0)                                       # expert idx[0, 1] never read
    x = jax.random.normal(jax.random.PRNGKey(M + 5), (M, D), F32).astype(BF16)
    ref = _reference(x, idx, w, *weights, limit)
    read = np.zeros(E, bool)
    read[np.asarray(idx)[np.asarray(w) != 0]] = True
    poisoned = _poison(jnp.asarray(~read), *weights)
    out = moe_experts_pallas(x, idx, w, *poisoned, limit, split_d=split_d, split_f=split_f,
                             interpret=INTERPRET)
    out = jax.block_until_ready(out)
    assert_no_race_flagged()
    _check(out, ref, 2e-2)
    unsplit = moe_experts_pallas(x, idx, w, *poisoned, limit, split_d=1, split_f=1, interpret=INTERPRET)
    _check(out, unsplit, 1e-2)            # only the float32 summation order and act's rounding differ


# (M, split_d, split_f, limit, shared_limit, kind): the shared expert as the kernels' last slot
SHARED_CASES = [
    (1, None, None, None, None, "fp8"),
    (1, 4, 2, 0.02, 0.05, "fp8"),
    (3, 1, 1, 0.02, None, "fp8"),
    (3, 2, 2, None, 0.05, "bf16"),
]


@pytest.mark.parametrize("M,split_d,split_f,limit,shared_limit,kind", SHARED_CASES)
@interpret_only
def test_interpret_shared_expert_slot(M, split_d, split_f, limit, shared_limit, kind):
    """shared=: the shared expert runs as one more slot of both kernels with weight 1 for every
    token (its own SwiGLU clamp), equal to the routed experts plus the shared expert computed as
    a separate expert; the routed experts' unselected weights stay unread."""
    E, k, D, F = 16, 4, 512, 256
    vgu, sgu, vd, sd = _weights(E + 1, D, F, seed=21 + M, kind=kind)     # expert E: the shared one
    idx, w = _routing(M, k, E, "independent", seed=M + 2)
    x = jax.random.normal(jax.random.PRNGKey(M + 9), (M, D), F32).astype(BF16)
    routed = tuple(None if a is None else a[:E] for a in (vgu, sgu, vd, sd))
    ref = _reference(x, idx, w, *routed, limit)
    only_shared = (jnp.full((M, 1), E, jnp.int32), jnp.ones((M, 1), F32))
    ref = ref + _reference(x, *only_shared, vgu, sgu, vd, sd, shared_limit)
    read = np.zeros(E, bool)
    read[np.asarray(idx).ravel()] = True
    shared = (vgu[E], None if sgu is None else sgu[E], vd[E], None if sd is None else sd[E], shared_limit)
    out = moe_experts_pallas(x, idx, w, *_poison(jnp.asarray(~read), *routed), limit, shared=shared,
                             split_d=split_d, split_f=split_f, interpret=INTERPRET)
    out = jax.block_until_ready(out)
    assert_no_race_flagged()
    assert out.shape == (M, D)
    _check(out, ref, 2e-2)
    if limit != shared_limit:           # the clamps differ where it matters: swapping them shows
        swapped = _reference(x, idx, w, *routed, limit) + _reference(x, *only_shared, vgu, sgu, vd, sd, limit)
        assert np.abs(np.asarray(swapped) - np.asarray(ref)).max() > 0.05 * np.abs(np.asarray(ref)).max()


# (M, D, F, mode, split_d, split_f, limit, shared): fp8_schedule='async' (block scale folded into the
# f16 conversion of kernel 1, WGMMAs left in flight in both kernels)
ASYNC_CASES = [
    (1, 512, 256, "independent", 4, 2, None, True),
    (9, 256, 256, "overlap", 1, 1, 0.02, False),
    (3, 512, 256, "independent", 2, 1, None, True),
]


@pytest.mark.parametrize("M,D,F,mode,split_d,split_f,limit,with_shared", ASYNC_CASES)
@interpret_only
def test_interpret_async_schedule_matches(M, D, F, mode, split_d, split_f, limit, with_shared):
    """'async' gives the reference (and the 'serial' schedule, up to summation order and act's
    rounding; the test scales are powers of two, so the f16 products are exact); unselected
    experts stay unread."""
    E, k = 16, 4
    vgu, sgu, vd, sd = _weights(E + 1, D, F, seed=31 + M)
    routed = (vgu[:E], sgu[:E], vd[:E], sd[:E])
    idx, w = _routing(M, k, E, mode, seed=M + 4)
    x = jax.random.normal(jax.random.PRNGKey(M + 13), (M, D), F32).astype(BF16)
    ref = _reference(x, idx, w, *routed, limit)
    shared = None
    if with_shared:
        shared = (vgu[E], sgu[E], vd[E], sd[E], limit)
        ref = ref + _reference(x, jnp.full((M, 1), E, jnp.int32), jnp.ones((M, 1), F32), vgu, sgu, vd, sd, limit)
    read = np.zeros(E, bool)
    read[np.asarray(idx).ravel()] = True
    poisoned = _poison(jnp.asarray(~read), *routed)
    kw = dict(shared=shared, split_d=split_d, split_f=split_f, interpret=INTERPRET)
    out = jax.block_until_ready(moe_experts_pallas(x, idx, w, *poisoned, limit, fp8_schedule="async", **kw))
    assert_no_race_flagged()
    _check(out, ref, 2e-2)
    _check(out, moe_experts_pallas(x, idx, w, *poisoned, limit, **kw), 1e-2)


# (M, mode, split_d, split_f, with_shared, kind): k_minor weights vs the same weights in the
# K-major layout (the same arithmetic: equal up to float32 summation order)
K_MINOR_CASES = [
    (1, "independent", 4, 2, True, "fp8"),
    (9, "overlap", 1, 1, False, "fp8"),
    (3, "independent", 2, 1, True, "bf16"),
    (3, "overlap", 1, 2, True, "fp8"),
]


@pytest.mark.parametrize("M,mode,split_d,split_f,with_shared,kind", K_MINOR_CASES)
@interpret_only
def test_interpret_k_minor_weights_match(M, mode, split_d, split_f, with_shared, kind):
    E, k, D, F = 16, 4, 512, 256
    vgu, sgu, vd, sd = _weights(E + 1, D, F, seed=41 + M, kind=kind)
    routed = tuple(None if a is None else a[:E] for a in (vgu, sgu, vd, sd))
    shared = shared_k = None
    if with_shared:
        one = tuple(None if a is None else a[E:] for a in (vgu, sgu, vd, sd))
        shared = (*(None if a is None else a[0] for a in one), 0.05)
        shared_k = (*(None if a is None else a[0] for a in _k_minor(*one)), 0.05)
    idx, w = _routing(M, k, E, mode, seed=M + 6)
    x = jax.random.normal(jax.random.PRNGKey(M + 17), (M, D), F32).astype(BF16)
    read = np.zeros(E, bool)
    read[np.asarray(idx).ravel()] = True
    poisoned = _poison(jnp.asarray(~read), *routed)
    kw = dict(split_d=split_d, split_f=split_f, interpret=INTERPRET)
    out = moe_experts_pallas(x, idx, w, *_k_minor(*poisoned), 0.02, shared=shared_k, k_minor=True, **kw)
    out = jax.block_until_ready(out)
    assert_no_race_flagged()
    _check(out, moe_experts_pallas(x, idx, w, *poisoned, 0.02, shared=shared, **kw), 1e-3)
    ref = _reference(x, idx, w, *routed, 0.02)
    if with_shared:
        ref = ref + _reference(x, jnp.full((M, 1), E, jnp.int32), jnp.ones((M, 1), F32), vgu, sgu, vd, sd, 0.05)
    _check(out, ref, 2e-2)



@pytest.mark.parametrize("M,split_d,split_f,with_shared,kind", [(9, 1, 1, True, "fp8"), (1, 4, 1, True, "fp8"),
                                                                (3, 2, 2, False, "bf16")])
@interpret_only
def test_interpret_weights_in_act_match(monkeypatch, M, split_d, split_f, with_shared, kind):
    """WEIGHTS_IN_ACT (the default): the combine weights on the activations between the kernels, the
    combine a plain sum: the reference's output within its tolerance, and the weights-in-combine
    output (WEIGHTS_IN_ACT = False) within bf16 rounding (k_minor, as the model runs it; repeated
    experts, the shared slot, a split F)."""
    E, k, D, F = 16, 4, 512, 256
    vgu, sgu, vd, sd = _weights(E + 1, D, F, seed=53 + M, kind=kind)
    routed = _k_minor(*(None if a is None else a[:E] for a in (vgu, sgu, vd, sd)))
    shared = None
    if with_shared:
        one = _k_minor(*(None if a is None else a[E:] for a in (vgu, sgu, vd, sd)))
        shared = (*(None if a is None else a[0] for a in one), 0.05)
    idx, w = _routing(M, k, E, "overlap", seed=M + 4)
    x = jax.random.normal(jax.random.PRNGKey(M + 29), (M, D), F32).astype(BF16)
    kw = dict(split_d=split_d, split_f=split_f, k_minor=True, shared=shared, interpret=INTERPRET)
    monkeypatch.setattr(moe_experts_mod, "WEIGHTS_IN_ACT", False)
    base = moe_experts_pallas(x, idx, w, *routed, 0.02, **kw)
    monkeypatch.setattr(moe_experts_mod, "WEIGHTS_IN_ACT", True)
    out = jax.block_until_ready(moe_experts_pallas(x, idx, w, *routed, 0.02, **kw))
    assert_no_race_flagged()
    _check(out, base, 1e-2)
    ref = _reference(x, idx, w, *(None if a is None else a[:E] for a in (vgu, sgu, vd, sd)), 0.02)
    if with_shared:
        ref = ref + _reference(x, jnp.full((M, 1), E, jnp.int32), jnp.ones((M, 1), F32), vgu, sgu, vd, sd, 0.05)
    _check(out, ref, 2e-2)


# schedule switches of the kernels that must not change a bit of the output: (module global, the
# setting compared against, the setting tested)
SCHEDULE_SWITCHES = [("LATE_SCALE_WAITS", False, True), ("A_REGS_LOAD", "upcast2x", "wgmma")]


def _switch_module(name):
    """The module whose global `name` is the switch (A_REGS_LOAD: pallas_kernels.common)."""
    return common_mod if name == "A_REGS_LOAD" else moe_experts_mod


@pytest.mark.parametrize("switch,base_value,value", SCHEDULE_SWITCHES)
@pytest.mark.parametrize("M,split_d,split_f,with_shared,k_minor", [(9, 1, 1, True, True), (1, 4, 1, True, True),
                                                                   (3, 2, 2, False, False), (9, 1, 1, False, False)])
@interpret_only
def test_interpret_schedule_switches_match(monkeypatch, M, split_d, split_f, with_shared, k_minor, switch,
                                           base_value, value):
    """Schedule switches give the same output, bit for bit (fp8, repeated experts and padding slots,
    the shared slot, split reductions, both weight layouts): LATE_SCALE_WAITS (the scale copies
    awaited where they are first read, not before the weight pipelines) and A_REGS_LOAD (the K-minor
    fp8 tiles' load into registers; interpret mode checks the arithmetic of both branches)."""
    E, k, D, F = 16, 4, 512, 256
    vgu, sgu, vd, sd = _weights(E + 1, D, F, seed=61 + M)
    orient = _k_minor if k_minor else (lambda *a: a)
    routed = orient(*(a[:E] for a in (vgu, sgu, vd, sd)))
    shared = (*(a[0] for a in orient(*(a[E:] for a in (vgu, sgu, vd, sd)))), 0.05) if with_shared else None
    idx, w = _routing(M, k, E, "overlap", seed=M + 13)
    x = jax.random.normal(jax.random.PRNGKey(M + 31), (M, D), F32).astype(BF16)
    kw = dict(split_d=split_d, split_f=split_f, k_minor=k_minor, shared=shared, interpret=INTERPRET)
    monkeypatch.setattr(_switch_module(switch), switch, base_value)
    base = jax.block_until_ready(moe_experts_pallas(x, idx, w, *routed, 0.02, **kw))
    monkeypatch.setattr(_switch_module(switch), switch, value)
    out = jax.block_until_ready(moe_experts_pallas(x, idx, w, *routed, 0.02, **kw))
    assert_no_race_flagged()
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(base, np.float32))


@pytest.mark.parametrize("M,split_d,with_shared", [(1, 4, True), (9, 1, False)])
@interpret_only
def test_interpret_x_bound_matches_own_row_scaling(M, split_d, with_shared):
    """x_bound (a static bound on |x|, as an RMSNorm's): every token row scaled by the bound's
    power of two instead of its own max gives the same output (k_minor fp8, as the model runs it)."""
    E, k, D, F = 16, 4, 512, 256
    vgu, sgu, vd, sd = _weights(E + 1, D, F, seed=77 + M)
    routed = tuple(a[:E] for a in (vgu, sgu, vd, sd))
    shared = (*(a[0] for a in _k_minor(*(a[E:] for a in (vgu, sgu, vd, sd)))), None) if with_shared else None
    idx, w = _routing(M, k, E, "overlap", seed=M + 9)
    mags = jnp.asarray([1.0, 1e-3, 20.0, 0.5, 1.0, 3.0, 0.25, 1.0, 8.0], F32)[:M, None]
    x = (jax.random.normal(jax.random.PRNGKey(M + 23), (M, D), F32) * mags).astype(BF16)
    bound = jnp.float32(float(np.abs(np.asarray(x, np.float32)).max()) * 5.0)
    kw = dict(split_d=split_d, k_minor=True, shared=shared, interpret=INTERPRET)
    out = jax.block_until_ready(moe_experts_pallas(x, idx, w, *_k_minor(*routed), x_bound=bound, **kw))
    assert_no_race_flagged()
    own = moe_experts_pallas(x, idx, w, *_k_minor(*routed), **kw)
    _check(out, own, 1e-3)

def test_k_minor_checks():
    vgu, sgu, vd, sd = _k_minor(*_weights(4, 256, 128))
    x, idx, w = jnp.zeros((1, 256), BF16), jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2), F32)
    with pytest.raises(ValueError, match=r"do not match \[E, 2, F, D\]"):
        moe_experts_pallas(x, idx, w, vgu, sgu, jnp.swapaxes(vd, 1, 2), sd, k_minor=True, interpret=INTERPRET)
    with pytest.raises(ValueError, match="fp8 scales"):
        moe_experts_pallas(x, idx, w, vgu, sgu, vd, jnp.swapaxes(sd, -1, -2), k_minor=True, interpret=INTERPRET)
    with pytest.raises(ValueError, match="shared expert weights"):
        moe_experts_pallas(x, idx, w, vgu, sgu, vd, sd, k_minor=True, interpret=INTERPRET,
                           shared=(vgu[0].transpose(2, 0, 1), sgu[0], vd[0], sd[0], None))
    with pytest.raises(ValueError, match="'async' with k_minor=True gave wrong results"):
        moe_experts_pallas(x, idx, w, vgu, sgu, vd, sd, k_minor=True, fp8_schedule="async", interpret=INTERPRET)
    assert moe_split(9, 2560, 768, k_minor=True) == (2, 1)       # 9 x 12 x 2 = 216 and 9 x 40 = 360 programs
    assert moe_split(67, 2560, 768, k_minor=True) == (1, 1)      # a verify block: unsplit


def test_shared_expert_checks():
    vgu, sgu, vd, sd = _weights(4, 256, 128)
    x, idx, w = jnp.zeros((1, 256), BF16), jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2), F32)
    with pytest.raises(ValueError, match="shared expert weights"):
        moe_experts_pallas(x, idx, w, vgu, sgu, vd, sd, shared=(vgu[0, :128], sgu[0], vd[0], sd[0], None),
                           interpret=INTERPRET)
    with pytest.raises(ValueError, match="shared expert scales"):
        moe_experts_pallas(x, idx, w, vgu, sgu, vd, sd, shared=(vgu[0], None, vd[0], sd[0], None),
                           interpret=INTERPRET)


def test_default_split_follows_program_count():
    """One token's 8 Ling experts: kernel 1 split 4 over D (96 -> 384 programs), kernel 2 split 2
    over F (160 -> 320); a 9-token block's ~66 experts fill the GPU unsplit."""
    assert moe_split(8, 2560, 768) == (4, 2)
    assert moe_split(72, 2560, 768) == (1, 1)
    assert moe_split(16, 2560, 768) == (2, 1)


def test_rejects_bad_inputs():
    vgu, sgu, vd, sd = _weights(4, 256, 128)
    x = jnp.zeros((17, 256), BF16)
    idx, w = jnp.zeros((17, 2), jnp.int32), jnp.ones((17, 2), F32)
    with pytest.raises(ValueError, match="M=17"):
        moe_experts_pallas(x, idx, w, vgu, sgu, vd, sd, interpret=INTERPRET)
    x, idx, w = x[:2], idx[:2], w[:2]
    with pytest.raises(ValueError, match="float8_e4m3fn"):                     # mixed dtypes
        moe_experts_pallas(x, idx, w, vgu.astype(BF16), sgu, vd, sd, interpret=INTERPRET)
    with pytest.raises(ValueError, match="or both bfloat16"):                  # float32 weights
        moe_experts_pallas(x, idx, w, vgu.astype(F32), None, vd.astype(F32), None, interpret=INTERPRET)
    with pytest.raises(ValueError, match="scales"):
        moe_experts_pallas(x, idx, w, vgu, sgu[:, :, :1], vd, sd, interpret=INTERPRET)
    with pytest.raises(ValueError, match="scales"):                            # fp8 without scales
        moe_experts_pallas(x, idx, w, vgu, None, vd, None, interpret=INTERPRET)
    with pytest.raises(ValueError, match="take no scales"):
        moe_experts_pallas(x, idx, w, vgu.astype(BF16), sgu, vd.astype(BF16), sd, interpret=INTERPRET)
    with pytest.raises(ValueError, match="split_d=3 must divide"):
        moe_experts_pallas(x, idx, w, vgu, sgu, vd, sd, split_d=3, interpret=INTERPRET)
    with pytest.raises(ValueError, match="split_f=-1 must divide"):
        moe_experts_pallas(x, idx, w, vgu, sgu, vd, sd, split_f=-1, interpret=INTERPRET)
    with pytest.raises(ValueError, match="stages=0 must be >= 1"):
        moe_experts_pallas(x, idx, w, vgu, sgu, vd, sd, stages=0, interpret=INTERPRET)
    with pytest.raises(ValueError, match=r"stages=1 must be >= 1 \(>= 2 for fp8_schedule='async'"):
        moe_experts_pallas(x, idx, w, vgu, sgu, vd, sd, stages=1, fp8_schedule="async", interpret=INTERPRET)
    with pytest.raises(ValueError, match="fp8_schedule='pair' must be one of"):
        moe_experts_pallas(x, idx, w, vgu, sgu, vd, sd, fp8_schedule="pair", interpret=INTERPRET)
    with pytest.raises(ValueError, match="multiples of 128"):
        moe_experts_pallas(x[:, :64], idx, w, vgu[:, :64].astype(BF16), None, vd[..., :64].astype(BF16), None,
                           interpret=INTERPRET)


def test_weight_bytes():
    assert weight_bytes(8, 2560, 768) == 8 * (3 * 2560 * 768 + 3 * 20 * 6 * 4)
    assert weight_bytes(8, 2560, 768, fp8=False) == 8 * 3 * 2560 * 768 * 2


def _ling_abstract(M, kind="fp8"):
    E, D, F, k = LING["E"], LING["D"], LING["F"], LING["k"]
    S = jax.ShapeDtypeStruct
    if kind == "bf16":
        return (S((M, D), BF16), S((M, k), jnp.int32), S((M, k), F32),
                S((E, D, 2, F), BF16), None, S((E, F, D), BF16), None)
    return (S((M, D), BF16), S((M, k), jnp.int32), S((M, k), F32),
            S((E, D, 2, F), FP8), S((E, 2, D // 128, F // 128), F32),
            S((E, F, D), FP8), S((E, F // 128, D // 128), F32))


# Cross-lowering runs the real Mosaic GPU lowering (layout inference, MLIR verification, SMEM
# budget) on this CPU host. It does NOT run ptxas: registers, spills and speed need the H200.
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("M,limit", [(1, None), (9, 7.0), (16, None)])
def test_cross_lowers_for_cuda_ling_shape(M, limit, kind):
    f = jax.jit(lambda *a: moe_experts_pallas(*a, limit=limit))
    text = f.trace(*_ling_abstract(M, kind)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 2                     # both kernels are Mosaic GPU calls


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("M", [1, 9])
def test_cross_lowers_for_cuda_with_shared_expert(M, kind):
    args = _ling_abstract(M, kind)
    D, F = LING["D"], LING["F"]
    S = jax.ShapeDtypeStruct
    dt = FP8 if kind == "fp8" else BF16
    sh = (S((D, 2, F), dt), S((2, D // 128, F // 128), F32) if kind == "fp8" else None,
          S((F, D), dt), S((F // 128, D // 128), F32) if kind == "fp8" else None)
    f = jax.jit(lambda *a: moe_experts_pallas(*a[:7], limit=7.0, shared=(*a[7:], 5.0)))
    text = f.trace(*args, *sh).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 2


@pytest.mark.parametrize("layout", ["wgmma", "upcast2x"])      # the default, 8bit, is covered above
@pytest.mark.parametrize("M", [1, 9])
def test_fp8_load_layouts_cross_lower_for_cuda(M, layout):
    from pallas_kernels.common import fp8_load_layout_set
    with fp8_load_layout_set(layout):
        text = jax.jit(moe_experts_pallas).trace(*_ling_abstract(M)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 2


def test_fp8_load_layout_set_restores_and_checks():
    from pallas_kernels import common
    before = common.fp8_load_layout
    with common.fp8_load_layout_set("upcast2x"):
        assert common.fp8_load_layout == "upcast2x"
        with common.fp8_load_layout_set(None):                  # None: leave it as it is
            assert common.fp8_load_layout == "upcast2x"
    assert common.fp8_load_layout == before
    with pytest.raises(ValueError, match="'16bit' must be one of"):
        with common.fp8_load_layout_set("16bit"):
            pass
    assert common.fp8_load_layout == before


@pytest.mark.parametrize("M", [1, 9])
def test_async_schedule_cross_lowers_for_cuda_with_shared_expert(M):
    D, F = LING["D"], LING["F"]
    S = jax.ShapeDtypeStruct
    sh = (S((D, 2, F), FP8), S((2, D // 128, F // 128), F32), S((F, D), FP8), S((F // 128, D // 128), F32))
    f = jax.jit(lambda *a: moe_experts_pallas(*a[:7], limit=7.0, shared=(*a[7:], 5.0), fp8_schedule="async"))
    text = f.trace(*_ling_abstract(M), *sh).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 2


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("M", [1, 9, 16])
def test_k_minor_cross_lowers_for_cuda_with_shared_expert(M, kind):
    """k_minor: the fp8 tiles as register WGMMA A operands (interpret mode cannot run those)."""
    E, D, F, k = LING["E"], LING["D"], LING["F"], LING["k"]
    S = jax.ShapeDtypeStruct
    dt, fp8 = (FP8, True) if kind == "fp8" else (BF16, False)
    sc = lambda *shape: S(shape, F32) if fp8 else None
    args = (S((M, D), BF16), S((M, k), jnp.int32), S((M, k), F32), S((E, 2, F, D), dt), sc(E, 2, D // 128, F // 128),
            S((E, D, F), dt), sc(E, F // 128, D // 128))
    sh = (S((2, F, D), dt), sc(2, D // 128, F // 128), S((D, F), dt), sc(F // 128, D // 128))
    f = jax.jit(lambda *a: moe_experts_pallas(*a[:7], limit=7.0, shared=(*a[7:], 5.0), k_minor=True))
    text = f.trace(*args, *sh).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 2


@pytest.mark.parametrize("switch,value", [("LATE_SCALE_WAITS", True), ("LATE_SCALE_WAITS", False),
                                          ("A_REGS_LOAD", "wgmma"), ("A_REGS_LOAD", "upcast2x")])
@pytest.mark.parametrize("M", [1, 9])
def test_schedule_switches_cross_lower_for_cuda(monkeypatch, M, switch, value):
    """The schedule switches' settings (LATE_SCALE_WAITS on: a barrier wait inside the pipelines'
    first step; A_REGS_LOAD: how the fp8 tiles are loaded into registers) lower for CUDA at the
    Ling shape, k_minor fp8 with the shared expert, as the model runs it."""
    monkeypatch.setattr(_switch_module(switch), switch, value)
    E, D, F, k = LING["E"], LING["D"], LING["F"], LING["k"]
    S = jax.ShapeDtypeStruct
    args = (S((M, D), BF16), S((M, k), jnp.int32), S((M, k), F32), S((E, 2, F, D), FP8),
            S((E, 2, D // 128, F // 128), F32), S((E, D, F), FP8), S((E, F // 128, D // 128), F32))
    sh = (S((2, F, D), FP8), S((2, D // 128, F // 128), F32), S((D, F), FP8), S((F // 128, D // 128), F32))
    f = jax.jit(lambda *a: moe_experts_pallas(*a[:7], limit=7.0, shared=(*a[7:], 5.0), k_minor=True))
    text = f.trace(*args, *sh).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 2


# ---- real kernel on the GPU (skipped elsewhere) ---------------------------------------------------
def _ling_with_shared(M, seed, kind="fp8", mode="independent"):
    """Ling-shaped inputs with expert E of E + 1 random ones as the shared expert (own clamp 5.0,
    routed 7.0): (x, idx, w, routed weights, shared tuple, reference [M, D])."""
    E, D, F, k = LING["E"], LING["D"], LING["F"], LING["k"]
    vgu, sgu, vd, sd = _weights(E + 1, D, F, seed=seed, kind=kind)
    routed = tuple(None if a is None else a[:E] for a in (vgu, sgu, vd, sd))
    shared = (*(None if a is None else a[E] for a in (vgu, sgu, vd, sd)), 5.0)
    idx, w = _routing(M, k, E, mode, seed=M)
    x = jax.random.normal(jax.random.PRNGKey(M), (M, D), F32).astype(BF16)
    ref_fn = jax.jit(_reference, static_argnames=("limit", "dtype"))
    ref = ref_fn(x, idx, w, *routed, limit=7.0) + ref_fn(
        x, jnp.full((M, 1), E, jnp.int32), jnp.ones((M, 1), F32), vgu, sgu, vd, sd, limit=5.0)
    return x, idx, w, routed, shared, ref

@gpu_only
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("mode", ["independent", "same"])
@pytest.mark.parametrize("M", [1, 9, 16])
def test_gpu_ling_shape_matches_experts_gather(M, mode, kind):
    E, D, F, k = LING["E"], LING["D"], LING["F"], LING["k"]
    weights = _weights(E, D, F, seed=1, kind=kind)
    idx, w = _routing(M, k, E, mode, seed=M)
    x = jax.random.normal(jax.random.PRNGKey(M), (M, D), F32).astype(BF16)
    out = jax.jit(moe_experts_pallas)(x, idx, w, *weights)
    ref = jax.jit(_reference)(x, idx, w, *weights)
    _check(out, ref, 2e-2)
    _check(out, jax.jit(_reference, static_argnames=("limit", "dtype"))(x, idx, w, *weights, dtype=F32), 2e-2)


@gpu_only
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("M", [1, 9])
def test_gpu_ling_shape_shared_expert(M, kind):
    """The shared expert as the kernels' last slot (expert E of E + 1 random ones), own clamp."""
    x, idx, w, routed, shared, ref = _ling_with_shared(M, 2, kind)
    out = jax.jit(lambda *a: moe_experts_pallas(*a, limit=7.0, shared=shared))(x, idx, w, *routed)
    _check(out, ref, 2e-2)


@gpu_only
@pytest.mark.parametrize("mode", ["independent", "same"])
@pytest.mark.parametrize("M", [1, 9, 16])
def test_gpu_async_schedule_ling_shape(M, mode):
    """fp8_schedule='async' at the Ling shape with the shared expert and clamps, vs the reference."""
    x, idx, w, routed, shared, ref = _ling_with_shared(M, 3, mode=mode)
    out = jax.jit(lambda *a: moe_experts_pallas(*a, limit=7.0, shared=shared, fp8_schedule="async"))(
        x, idx, w, *routed)
    _check(out, ref, 2e-2)


@gpu_only
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("M", [1, 9, 16])
def test_gpu_k_minor_ling_shape(M, kind):
    """k_minor weights (register A operands for fp8) at the Ling shape with the shared expert, vs
    the default layout's kernel and the reference."""
    x, idx, w, routed, shared, ref = _ling_with_shared(M, 6, kind)
    vgu, sgu, vd, sd = _k_minor(*(None if a is None else a[None] for a in shared[:4]))
    shared_k = (vgu[0], None if sgu is None else sgu[0], vd[0], None if sd is None else sd[0], 5.0)
    out = jax.jit(lambda *a: moe_experts_pallas(*a, limit=7.0, shared=shared_k, k_minor=True))(
        x, idx, w, *_k_minor(*routed))
    base = jax.jit(lambda *a: moe_experts_pallas(*a, limit=7.0, shared=shared))(x, idx, w, *routed)
    # one bf16 ulp apart at most: each expert's output is rounded to bf16 (F not split) or summed in
    # float32 first (the K-major kernel splits F for one token), and the accumulation orders differ
    _check(out, base, 1e-2)
    _check(out, ref, 2e-2)


@gpu_only
@pytest.mark.parametrize("switch,base_value,value", SCHEDULE_SWITCHES)
@pytest.mark.parametrize("M", [1, 9, 16])
def test_gpu_schedule_switches_ling_shape(monkeypatch, M, switch, base_value, value):
    """The schedule switches on the GPU: k_minor fp8 at the Ling shape with the shared expert, bit for
    bit the output of the base setting (LATE_SCALE_WAITS: the kernels that await their scales
    first; A_REGS_LOAD: the 4-byte load and relayout), and the reference's within tolerance."""
    x, idx, w, routed, shared, ref = _ling_with_shared(M, 8, mode="overlap" if M > 1 else "independent")
    vgu, sgu, vd, sd = _k_minor(*(a[None] for a in shared[:4]))
    shared_k = (vgu[0], sgu[0], vd[0], sd[0], 5.0)
    run = lambda: jax.jit(lambda *a: moe_experts_pallas(*a, limit=7.0, shared=shared_k, k_minor=True))(  # noqa: E731
        x, idx, w, *_k_minor(*routed))
    monkeypatch.setattr(_switch_module(switch), switch, base_value)
    base = run()
    monkeypatch.setattr(_switch_module(switch), switch, value)
    out = run()
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(base, np.float32))
    _check(out, ref, 2e-2)


@gpu_only
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_gpu_ling_shape_clamp(kind):
    E, D, F, k = LING["E"], LING["D"], LING["F"], LING["k"]
    weights = _weights(E, D, F, seed=2, kind=kind)
    idx, w = _routing(9, k, E, "overlap", seed=3)
    x = jax.random.normal(jax.random.PRNGKey(3), (9, D), F32).astype(BF16)
    f = jax.jit(lambda *a: moe_experts_pallas(*a, limit=0.02))
    ref = jax.jit(lambda *a: _reference(*a, limit=0.02))(x, idx, w, *weights)
    _check(f(x, idx, w, *weights), ref, 2e-2)


@gpu_only
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_gpu_ling_shape_skips_zero_weight_experts(kind):
    """Half of each token's slots get weight 0 and point at experts no one else chose, which are
    poisoned with NaN: the compiled kernel must not read them."""
    E, D, F, k = LING["E"], LING["D"], LING["F"], LING["k"]
    weights = _weights(E, D, F, seed=4, kind=kind)
    idx, w = _routing(9, k, E, "independent", seed=5)
    zero = np.zeros((9, k), bool)
    zero[:, k // 2:] = True
    w = jnp.where(jnp.asarray(zero), 0.0, w)
    live = np.zeros(E, bool)
    live[np.asarray(idx)[~zero]] = True
    x = jax.random.normal(jax.random.PRNGKey(5), (9, D), F32).astype(BF16)
    out = jax.jit(moe_experts_pallas)(x, idx, w, *_poison(jnp.asarray(~live), *weights))
    _check(out, jax.jit(_reference)(x, idx, w, *weights), 2e-2)


@interpret_only
def test_timing_entry_point_cpu_smoke(tmp_path):
    """bench/moe_kernel_timing.py end to end in interpret mode (tiny shape; times meaningless)."""
    from bench.moe_kernel_timing import main
    rec = main(["--interpret", "--M", "2", "--E", "8", "--D", "256", "--F", "128", "--k", "2",
                "--fp8-load-layout", "upcast2x", "--iters", "1", "--warmup", "1", "--no-xla-defaults",
                "--out-dir", str(tmp_path)])
    (r,) = rec["results"]
    assert r["tiling"] == {"fp8_load_layout": "upcast2x"}
    assert "kernel_error" not in r and "gather_error" not in r, r
    assert r["k_minor"] and "gather_us" in r                   # the model's layout: the gather row is timed
    assert r["finite"] and r["max_abs_err"] <= 2e-2 * r["ref_max"]
    assert r["bytes"] == r["n_experts_used"] * (3 * 256 * 128 + 3 * 2 * 1 * 4)
    assert len(list(tmp_path.glob("moe_kernel_timing-*.json"))) == 1


@interpret_only
def test_timing_entry_point_bf16_cpu_smoke(tmp_path):
    from bench.moe_kernel_timing import main
    rec = main(["--interpret", "--weights", "bf16", "--M", "3", "--E", "8", "--D", "128", "--F", "128",
                "--k", "2", "--iters", "1", "--warmup", "1", "--no-xla-defaults", "--out-dir", str(tmp_path)])
    (r,) = rec["results"]
    assert rec["weights"] == r["weights"] == "bf16"
    assert "kernel_error" not in r and "gather_error" not in r, r
    assert r["finite"] and r["max_abs_err"] <= 2e-2 * r["ref_max"]
    assert r["bytes"] == r["n_experts_used"] * 3 * 128 * 128 * 2


@interpret_only
def test_timing_entry_point_sweep_with_shared_expert(tmp_path):
    """--shared and a tiling sweep: one row per (split_d, stages, fp8_schedule) combination, the shared expert's
    bytes counted, every row matching gather ('async': K-major weights only, so no gather row)."""
    from bench.moe_kernel_timing import main
    rec = main(["--interpret", "--shared", "--k-major", "--M", "1", "--E", "8", "--D", "256", "--F", "128", "--k", "2",
                "--split-d", "1,2", "--stages", "3", "--fp8-schedule", "serial,async", "--limit", "0.05",
                "--iters", "1", "--warmup", "1", "--no-xla-defaults", "--out-dir", str(tmp_path)])
    rows = rec["results"]
    assert [r["tiling"] for r in rows] == [{"split_d": d, "stages": s, "fp8_schedule": c}
                                           for d in (1, 2) for s in (3,) for c in ("serial", "async")]
    for r in rows:
        assert r["shared"] and r["n_experts_used"] == 3                       # 2 routed + the shared one
        assert "kernel_error" not in r and r["finite"] and r["max_abs_err"] <= 2e-2 * r["ref_max"], r
        assert "gather_us" not in r and not r["k_minor"]


def test_timing_entry_point_rejects_bad_sweeps(capsys):
    from bench.moe_kernel_timing import main
    for flag, value, msg in (("--fp8-load-layout", "16bit", "--fp8-load-layout must be"),
                             ("--fp8-schedule", "pair", "--fp8-schedule must be"),
                             ("--fp8-schedule", "async", "needs --k-major")):
        with pytest.raises(SystemExit):
            main(["--interpret", flag, value, "--no-xla-defaults"])
        assert msg in capsys.readouterr().err


@interpret_only
@pytest.mark.parametrize("weights", ["fp8", "bf16"])
def test_timing_entry_point_k_major_cpu_smoke(tmp_path, weights):
    """--k-major: the kernel on transposed weights (+ shared expert), checked against gather on the
    originals; no gather row is timed."""
    from bench.moe_kernel_timing import main
    rec = main(["--interpret", "--k-major", "--shared", "--weights", weights, "--M", "3", "--E", "8", "--D", "256",
                "--F", "128", "--k", "2", "--iters", "1", "--warmup", "1", "--no-xla-defaults",
                "--out-dir", str(tmp_path)])
    (r,) = rec["results"]
    assert not r["k_minor"] and "gather_us" not in r and "kernel_error" not in r, r
    assert r["finite"] and r["max_abs_err"] <= 2e-2 * r["ref_max"]
