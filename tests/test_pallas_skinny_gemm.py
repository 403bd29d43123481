"""Tests for the skinny GEMM kernel (pallas_kernels/skinny_gemm.py), M = 1..16 tokens.

On CPU: (1) Mosaic GPU interpret mode with race detection vs the float32 XLA reference
(x @ dequantised w) at small shapes, bf16 and block-fp8 weights: M in {1, 5, 9, 16}, several
column tiles and K splits, N not a multiple of 128 (block_n 64, a partial last scale block),
power-of-two block scales (so the comparison is tight), an analytic check that each 128 x 128
block gets its own scale, token rows of very different magnitudes (the fp8 path's f16 operands);
(2) bad inputs; (3) cross-lowering for CUDA (sm_90a) at the Ling shapes. On a GPU
(``JAX_PLATFORMS=cuda``; skipped elsewhere): the compiled kernel at the Ling shapes vs the
reference. Speed: bench/skinny_gemm_timing.py.
"""

import jax

jax.config.update("jax_enable_x64", True)  # process-global (conftest): tests pass dtypes explicitly

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from helpers import assert_no_race_flagged, interpret_only  # noqa: E402
from lingjax.quant import FP8  # noqa: E402
from pallas_kernels.skinny_gemm import (skinny_gemm_config, skinny_gemm_pallas,  # noqa: E402
                                        skinny_gemm_reference, weight_bytes)

F32, BF16 = jnp.float32, jnp.bfloat16
INTERPRET = plgpu.InterpretGPUParams(detect_races=True)  # jax 0.12: races raise (on_race="raise")
ON_GPU = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA Hopper GPU (run with JAX_PLATFORMS=cuda)")
# (K, N): KDA fused q/k/v/f/g input projection, KDA o_proj, lm_head
LING_SHAPES = [(2560, 20480), (4096, 2560), (2560, 157184)]


def _weights(K, N, fp8, seed=0):
    """bf16 normal weights, or fp8 values in +-~8 with scales 2**-12..2**-4 per 128 x 128 block
    (a block read with another block's scale is off by up to 256x)."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    if not fp8:
        return jax.random.normal(k1, (K, N), F32).astype(BF16), None
    v = (2.0 * jax.random.normal(k1, (K, N), F32)).astype(FP8)
    s = 2.0 ** jax.random.randint(k2, (K // 128, -(-N // 128)), -12, -4).astype(F32)
    return v, s


def _x(M, K, seed=0):
    return jax.random.normal(jax.random.PRNGKey(100 + seed), (M, K), F32).astype(BF16)


def _check(out, ref, tol):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * np.abs(ref).max())


# (M, K, N, fp8, tiling overrides): small shapes; K = 256/384 is 2/3 scale blocks
CASES = [
    (1, 256, 128, False, {}),
    (9, 256, 256, False, dict(block_n=128, split_k=2)),
    (16, 384, 128, False, dict(block_n=64, stages=2)),
    (3, 256, 256, False, dict(block_n=256)),
    (1, 256, 256, True, {}),                                  # block_n 64: 2 programs per scale block
    (9, 384, 256, True, dict(block_n=128, split_k=3)),
    (16, 256, 192, True, {}),                                 # N = 1.5 scale blocks
    (8, 256, 128, True, dict(stages=1)),
]


@pytest.mark.parametrize("M,K,N,fp8,kw", CASES)
@interpret_only
def test_interpret_matches_reference(M, K, N, fp8, kw):
    w, s = _weights(K, N, fp8, seed=M + K + N)
    x = _x(M, K, seed=M)
    out = jax.block_until_ready(skinny_gemm_pallas(x, w, s, interpret=INTERPRET, out_dtype=F32, **kw))
    assert_no_race_flagged()
    assert out.shape == (M, N) and out.dtype == F32
    _check(out, skinny_gemm_reference(x, w, s), 1e-5)      # float32 accumulation, exact operands


# fp8_schedule='pair': two K tiles per pipeline step (an even count per program)
PAIR_CASES = [
    (1, 256, 256, {}),
    (9, 512, 256, dict(block_n=128, split_k=2)),
    (16, 1024, 128, dict(stages=4)),
    (5, 768, 192, dict(split_k=3)),                           # N = 1.5 scale blocks, 2 tiles per program
]


@pytest.mark.parametrize("M,K,N,kw", PAIR_CASES)
@interpret_only
def test_interpret_pair_schedule_matches_reference(M, K, N, kw):
    w, s = _weights(K, N, True, seed=M + K)
    x = _x(M, K, seed=M)
    out = jax.block_until_ready(skinny_gemm_pallas(x, w, s, interpret=INTERPRET, out_dtype=F32,
                                                   fp8_schedule="pair", **kw))
    assert_no_race_flagged()
    _check(out, skinny_gemm_reference(x, w, s), 1e-5)


# fp8_schedule='async': the block scale folded into the f16 conversion, WGMMAs left in flight
ASYNC_CASES = [
    (1, 256, 256, {}),
    (9, 384, 256, dict(block_n=128, split_k=1, stages=2)),
    (16, 512, 192, dict(split_k=2, stages=3)),                # N = 1.5 scale blocks
]


@pytest.mark.parametrize("M,K,N,kw", ASYNC_CASES)
@interpret_only
def test_interpret_async_schedule_matches_reference(M, K, N, kw):
    w, s = _weights(K, N, True, seed=M + K + 1)
    x = _x(M, K, seed=M)
    out = jax.block_until_ready(skinny_gemm_pallas(x, w, s, interpret=INTERPRET, out_dtype=F32,
                                                   fp8_schedule="async", **kw))
    assert_no_race_flagged()
    _check(out, skinny_gemm_reference(x, w, s), 1e-5)   # power-of-two scales: the f16 products are exact


@interpret_only
def test_interpret_async_schedule_rounds_scales_to_f16():
    """Scales that are not powers of two: 'async' rounds scale * 2**10 and each product to f16
    (relative 2**-11 each), well inside the bf16 rounding of the model's dequantised weights."""
    K, N = 256, 128
    w, s = _weights(K, N, True, seed=11)
    s = s * jnp.asarray(np.random.default_rng(0).uniform(1.0, 2.0, s.shape), F32)
    x = _x(3, K, seed=11)
    out = skinny_gemm_pallas(x, w, s, interpret=INTERPRET, out_dtype=F32, fp8_schedule="async")
    ref = skinny_gemm_reference(x, w, s)
    _check(out, ref, 2e-3)
    exact = skinny_gemm_pallas(x, w, s, interpret=INTERPRET, out_dtype=F32)     # 'serial': exact weights
    _check(exact, ref, 1e-5)


# k_minor=True: w [N, K] (fp8 tiles as register WGMMA operands; interpret mode stages them in SMEM)
K_MINOR_CASES = [
    (1, 256, 256, True, {}),
    (9, 384, 192, True, dict(split_k=3)),                     # N = 1.5 scale blocks
    (16, 256, 128, True, dict(block_n=128, stages=1)),
    (5, 256, 256, False, dict(block_n=128, split_k=2)),
    (9, 512, 192, True, dict(stages=2)),
]


@pytest.mark.parametrize("a_regs_load", ["upcast2x", "wgmma"])
@pytest.mark.parametrize("M,K,N,fp8,kw", K_MINOR_CASES)
@interpret_only
def test_interpret_k_minor_matches_reference(monkeypatch, M, K, N, fp8, kw, a_regs_load):
    import pallas_kernels.common as common_mod
    monkeypatch.setattr(common_mod, "A_REGS_LOAD", a_regs_load)      # (fp8: both of a_regs' loads)
    w, s = _weights(K, N, fp8, seed=M + N + 2)
    x = _x(M, K, seed=M)
    out = jax.block_until_ready(skinny_gemm_pallas(x, w.T, s, interpret=INTERPRET, out_dtype=F32, k_minor=True, **kw))
    assert_no_race_flagged()
    _check(out, skinny_gemm_reference(x, w, s), 1e-5)
    _check(out, skinny_gemm_reference(x, w.T, s, k_minor=True), 1e-5)


@interpret_only
def test_interpret_default_out_dtype_is_x_dtype():
    w, s = _weights(256, 128, True, seed=3)
    x = _x(2, 256)
    out = skinny_gemm_pallas(x, w, s, interpret=INTERPRET)
    assert out.dtype == BF16 and out.shape == (2, 128)
    _check(out, skinny_gemm_reference(x, w, s), 1e-2)


@interpret_only
def test_interpret_each_block_gets_its_own_scale():
    """w = 1, x = 1, scale[kb, nb] = 2**(kb + 3 nb): y[:, n] = 128 * sum_kb scale[kb, n // 128]."""
    K, N = 384, 256
    w = jnp.ones((K, N), FP8)
    kb, nb = np.meshgrid(np.arange(K // 128), np.arange(N // 128), indexing="ij")
    s = jnp.asarray(2.0 ** (kb + 3 * nb), F32)
    expect = 128 * np.repeat((2.0 ** (kb + 3 * nb)).sum(0), 128)
    for kw in ({}, dict(block_n=128, split_k=3)):
        out = skinny_gemm_pallas(jnp.ones((2, K), BF16), w, s, interpret=INTERPRET, out_dtype=F32, **kw)
        np.testing.assert_array_equal(np.asarray(out), np.broadcast_to(expect, (2, N)))


@pytest.mark.parametrize("schedule", ["serial", "async"])
@interpret_only
def test_interpret_grouped_scales_are_the_block_grid(schedule):
    """scale given as stored for a stacked weight, [G, K/128, N/128/G] (G column groups), gives
    each block its own scale like the [K/128, N/128] grid: scale[g, kb, b] = 2**-(kb + 3 (g * 2 + b) + 3)
    (below 'async''s 0.14 bound; powers of two, so exact either way)."""
    K, N, G = 384, 512, 2
    w = jnp.ones((K, N), FP8)
    kb, nb = np.meshgrid(np.arange(K // 128), np.arange(N // 128), indexing="ij")
    grid = 2.0 ** -(kb + 3 * nb + 3)                                        # [K blocks, N blocks]
    grouped = jnp.asarray(grid.reshape(K // 128, G, -1).transpose(1, 0, 2), F32)   # [G, K blocks, N blocks / G]
    expect = 128 * np.repeat(grid.sum(0), 128)
    for kw in ({}, dict(block_n=128, split_k=3 if schedule == "serial" else 1)):   # 'async': >= 2 tiles each
        out = skinny_gemm_pallas(jnp.ones((2, K), BF16), w, grouped, interpret=INTERPRET, out_dtype=F32,
                                 fp8_schedule=schedule, **kw)
        np.testing.assert_array_equal(np.asarray(out), np.broadcast_to(expect, (2, N)))
    with pytest.raises(ValueError, match="column groups"):
        skinny_gemm_pallas(jnp.ones((2, K), BF16), w[:, :448], grouped[:, :, :2], interpret=INTERPRET)


@interpret_only
def test_interpret_fp8_rows_of_different_magnitudes():
    """fp8 weights run on f16 operands with each token row scaled by a power of two: tiny, huge
    (beyond f16's range) and all-zero rows keep their bf16 precision."""
    K, N = 256, 128
    w, s = _weights(K, N, True, seed=7)
    mags = jnp.asarray([1e-30, 1e-6, 1.0, 3e4, 1e30, 0.0], F32)[:, None]
    x = (_x(6, K, seed=7).astype(F32) * mags).astype(BF16)
    out = np.asarray(skinny_gemm_pallas(x, w, s, interpret=INTERPRET, out_dtype=F32), np.float64)
    ref = np.asarray(skinny_gemm_reference(x, w, s), np.float64)
    assert np.isfinite(out).all() and not out[5].any()
    for r in range(5):
        np.testing.assert_allclose(out[r], ref[r], rtol=1e-5, atol=1e-5 * np.abs(ref[r]).max())



@interpret_only
@pytest.mark.parametrize("M,split_k", [(1, 1), (9, 2)])
def test_interpret_fp8_with_x_bound_matches_reference(M, split_k):
    """x_bound (a static bound on |x|, as an RMSNorm's): one power of two for every row instead of
    each row's max, the same products: rows far below the bound included."""
    K, N = 256, 128
    w, s = _weights(K, N, True, seed=3)
    mags = jnp.asarray([1.0, 1e-3, 30.0, 0.0, 1.0, 5.0, 0.5, 2.0, 1.0], F32)[:M, None]
    x = (_x(M, K, seed=3).astype(F32) * mags).astype(BF16)
    bound = float(np.abs(np.asarray(x, np.float32)).max()) * 3.0
    out = skinny_gemm_pallas(x, w, s, jnp.float32(bound), interpret=INTERPRET, out_dtype=F32, split_k=split_k)
    ref = np.asarray(skinny_gemm_reference(x, w, s), np.float64)
    own = skinny_gemm_pallas(x, w, s, interpret=INTERPRET, out_dtype=F32, split_k=split_k)   # each row's max
    out = np.asarray(out, np.float64)
    for r in range(M):
        np.testing.assert_allclose(out[r], ref[r], rtol=1e-5, atol=1e-5 * np.abs(ref[r]).max())
    np.testing.assert_allclose(out, np.asarray(own, np.float64), rtol=1e-6, atol=1e-6 * np.abs(ref).max())

def test_rejects_bad_inputs():
    w, s = _weights(256, 128, True)
    wb, _ = _weights(256, 128, False)
    x = _x(2, 256)
    bad = [
        (dict(x=_x(17, 256), w=wb), "M=17"),
        (dict(x=_x(2, 192), w=wb[:192]), "K=192 must be a multiple of 128"),
        (dict(x=x, w=wb[:, :96]), "N=96 must be a multiple of 64"),
        (dict(x=x, w=wb[:128]), "disagree on K"),
        (dict(x=x, w=wb.astype(F32)), "bfloat16 or float8_e4m3fn"),
        (dict(x=x, w=w), "need scale="),
        (dict(x=x, w=wb, scale=s), "only for float8_e4m3fn"),
        (dict(x=x, w=w, scale=s[:1]), r"scale \(1, 1\) must be \[K/128, ceil\(N/128\)\]"),
        (dict(x=x, w=w, scale=s, block_n=256), "block_n=256"),
        (dict(x=x, w=wb, block_n=96), "block_n=96"),
        (dict(x=x, w=wb, split_k=3), "split_k=3 must divide"),
        (dict(x=x[0], w=wb), "must be 2-D"),
        (dict(x=x, w=w, scale=s, fp8_schedule="fast"), "fp8_schedule='fast' must be one of"),
        (dict(x=_x(2, 384), w=_weights(384, 128, True)[0], scale=_weights(384, 128, True)[1],
              fp8_schedule="pair", split_k=1), "even number of K tiles per program"),
        (dict(x=x, w=w, scale=s, fp8_schedule="async", stages=1), "'async' needs stages >= 2"),
        (dict(x=x, w=w.T, scale=s, k_minor=True, fp8_schedule="pair"), "'pair' is not implemented for k_minor"),
        (dict(x=x, w=w.T, scale=s, k_minor=True, fp8_schedule="async"), "'async' with k_minor=True gave wrong"),
        (dict(x=x, w=w, scale=s, k_minor=True), r"disagree on K"),           # [K, N] given as [N, K]
        (dict(x=x, w=w.T, scale=s.T, k_minor=True), r"scale \(1, 2\) must be \[K/128, ceil\(N/128\)\]"),
    ]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            skinny_gemm_pallas(interpret=INTERPRET, **kw)


def test_weight_bytes():
    assert weight_bytes(2560, 157184) == 2560 * 157184 * 2
    assert weight_bytes(4096, 2560, FP8) == 4096 * 2560 + 32 * 20 * 4
    assert weight_bytes(2560, 576, FP8) == 2560 * 576 + 20 * 5 * 4


def test_default_config_at_ling_shapes():
    """Enough programs for 132 SMs, two programs' SMEM per SM; K split only where columns are few."""
    for fp8 in (False, True):
        for M in (1, 9, 16):
            lm = skinny_gemm_config(M, 2560, 157184, fp8)
            assert (lm.block_n, lm.split_k, lm.m_pad) == (64 if fp8 else 128, 1, 8 if M <= 8 else 16)
            if fp8:      # the H200 sweep's best for the KDA input projection: 64 / split 2 / 2 stages
                w_in = skinny_gemm_config(M, 2560, 20480, fp8)
                assert (w_in.block_n, w_in.split_k, w_in.stages) == (64, 2, 2)
            o = skinny_gemm_config(M, 4096, 2560, fp8)
            assert (o.block_n, o.split_k) == (64, 8)
            for K, N in LING_SHAPES:
                c = skinny_gemm_config(M, K, N, fp8)
                assert (N // c.block_n) * c.split_k >= 132 and c.stages >= 2
                assert c.smem_bytes <= 110 * 1024


def _abstract(M, K, N, fp8):
    S = jax.ShapeDtypeStruct
    if fp8:
        return S((M, K), BF16), S((K, N), FP8), S((K // 128, -(-N // 128)), F32)
    return S((M, K), BF16), S((K, N), BF16)


# Cross-lowering runs the real Mosaic GPU lowering (layout inference, MLIR verification, SMEM
# budget) on this CPU host. It does NOT run ptxas: registers, spills and speed need the H200.
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("K,N", LING_SHAPES + [(2560, 576)])
@pytest.mark.parametrize("M", [1, 9, 16])
def test_cross_lowers_for_cuda_ling_shape(M, K, N, fp8):
    f = jax.jit(lambda *a: skinny_gemm_pallas(*a, out_dtype=F32 if N > 100_000 else None))
    text = f.trace(*_abstract(M, K, N, fp8)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("schedule", ["pair", "async"])
@pytest.mark.parametrize("K,N", LING_SHAPES + [(2560, 576)])
@pytest.mark.parametrize("M", [1, 9])
def test_fp8_schedules_cross_lower_for_cuda_ling_shape(M, K, N, schedule):
    f = jax.jit(lambda *a: skinny_gemm_pallas(*a, out_dtype=F32 if N > 100_000 else None, fp8_schedule=schedule))
    text = f.trace(*_abstract(M, K, N, True)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("K,N", LING_SHAPES + [(2560, 576)])
@pytest.mark.parametrize("M", [1, 9])
def test_k_minor_cross_lowers_for_cuda_ling_shape(M, K, N, fp8):
    x, w, *s = _abstract(M, K, N, fp8)
    f = jax.jit(lambda *a: skinny_gemm_pallas(*a, out_dtype=F32 if N > 100_000 else None, k_minor=True))
    text = f.trace(x, jax.ShapeDtypeStruct((N, K), w.dtype), *s).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("K,N", LING_SHAPES)
@pytest.mark.parametrize("M", [1, 9])
def test_k_minor_a_regs_upcast2x_load_cross_lowers_for_cuda(monkeypatch, M, K, N):
    """common.A_REGS_LOAD = 'upcast2x' (fp8 tiles loaded 4 bytes per thread and relaid; the default,
    'wgmma', is covered above) at the Ling shapes."""
    import pallas_kernels.common as common_mod
    monkeypatch.setattr(common_mod, "A_REGS_LOAD", "upcast2x")
    x, w, *s = _abstract(M, K, N, True)
    f = jax.jit(lambda *a: skinny_gemm_pallas(*a, out_dtype=F32 if N > 100_000 else None, k_minor=True))
    text = f.trace(x, jax.ShapeDtypeStruct((N, K), w.dtype), *s).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("layout", ["wgmma", "upcast2x"])      # the default, 8bit, is covered above
@pytest.mark.parametrize("schedule", ["serial", "async"])
def test_fp8_load_layouts_cross_lower_for_cuda(schedule, layout):
    from pallas_kernels.common import fp8_load_layout_set
    f = jax.jit(lambda *a: skinny_gemm_pallas(*a, fp8_schedule=schedule))
    with fp8_load_layout_set(layout):
        text = f.trace(*_abstract(9, 2560, 20480, True)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


# ---- several weights of one input in one launch --------------------------------------------------
# (M, K, Ns, fp8, k_minor, tiling overrides)
MULTI_CASES = [
    (1, 256, (128, 64, 64), False, False, {}),                  # q / k / v of unequal widths (block_n 64)
    (9, 256, (256, 256), False, True, dict(split_k=2)),        # gate / up, k_minor
    (5, 384, (128, 192), True, False, {}),                      # fp8, N = 1.5 scale blocks in the second
    (16, 256, (128, 128, 128), True, True, dict(block_n=128)),  # fp8 k_minor, one scale block per tile
]


@pytest.mark.parametrize("M,K,Ns,fp8,k_minor,kw", MULTI_CASES)
@interpret_only
def test_interpret_several_weights_match_one_call_each(M, K, Ns, fp8, k_minor, kw):
    """A tuple of weights: the products of one launch equal each weight's own call, bit for bit
    (the same programs, placed side by side), and the reference."""
    ws, ss = zip(*(_weights(K, n, fp8, seed=M + i) for i, n in enumerate(Ns)))
    wk = tuple(w.T for w in ws) if k_minor else ws
    x = _x(M, K, seed=M)
    sc = ss if fp8 else None
    outs = jax.block_until_ready(skinny_gemm_pallas(x, wk, sc, interpret=INTERPRET, out_dtype=F32,
                                                    k_minor=k_minor, **kw))
    assert_no_race_flagged()
    assert isinstance(outs, tuple) and [o.shape for o in outs] == [(M, n) for n in Ns]
    for w, wki, s, out in zip(ws, wk, ss, outs):
        one = skinny_gemm_pallas(x, wki, s, interpret=INTERPRET, out_dtype=F32, k_minor=k_minor,
                                 block_n=kw.get("block_n", 64 if any(n % 128 for n in Ns) else None),
                                 split_k=kw.get("split_k"))
        if skinny_gemm_config(M, K, sum(Ns), fp8, **kw).split_k == skinny_gemm_config(
                M, K, w.shape[1], fp8, block_n=kw.get("block_n"), split_k=kw.get("split_k")).split_k:
            np.testing.assert_array_equal(np.asarray(out), np.asarray(one))
        _check(out, skinny_gemm_reference(x, w, s), 1e-5)


def test_several_weights_refuse_mismatches():
    x = jnp.zeros((2, 256), BF16)
    w1, w2 = jnp.zeros((256, 128), BF16), jnp.zeros((384, 128), BF16)
    with pytest.raises(ValueError, match="disagree on K"):
        skinny_gemm_pallas(x, (w1, w2))
    with pytest.raises(ValueError, match="share a dtype"):
        skinny_gemm_pallas(x, (w1, w1.astype(FP8)), (None, jnp.ones((2, 1), F32)))
    with pytest.raises(ValueError, match="2 weights but 1 scales"):
        skinny_gemm_pallas(x, (w1.astype(FP8),) * 2, (jnp.ones((2, 1), F32),))
    with pytest.raises(ValueError, match="'serial' only"):
        skinny_gemm_pallas(x, (w1.astype(FP8),) * 2, (jnp.ones((2, 1), F32),) * 2, fp8_schedule="async")
    with pytest.raises(ValueError, match="empty"):
        skinny_gemm_pallas(x, ())
    with pytest.raises(ValueError, match="divide every N"):
        skinny_gemm_pallas(x, (w1, jnp.zeros((256, 64), BF16)), block_n=128)
    with pytest.raises(ValueError, match="must be a tuple of their scales"):
        skinny_gemm_pallas(x, (w1.astype(FP8),) * 2, jnp.ones((2, 2, 1), F32))


def test_several_weights_tile_each_weight_whole():
    """Widths that are not all multiples of 128: every program's columns lie in one weight (block_n
    64 by default), for bf16 with any fp8_schedule (bf16 ignores it); traced, not run."""
    x = jax.ShapeDtypeStruct((9, 256), BF16)
    ws = (jax.ShapeDtypeStruct((256, 64), BF16), jax.ShapeDtypeStruct((256, 17344), BF16))
    for schedule in ("serial", "async"):
        outs = jax.eval_shape(lambda x, a, b: skinny_gemm_pallas(x, (a, b), fp8_schedule=schedule), x, *ws)
        assert [o.shape for o in outs] == [(9, 64), (9, 17344)]


@pytest.mark.parametrize("M", [8, 9])
@pytest.mark.parametrize("Ns,k_minor", [((4096, 4096, 4096), False), ((6144, 6144), False), ((4096, 4096), True)])
def test_several_weights_cross_lower_for_cuda_draft_shapes(M, Ns, k_minor):
    """The DSpark draft's fused calls (q / k / v, gate / up, the context's k / v) at its shapes."""
    S = jax.ShapeDtypeStruct
    ws = tuple(S((n, 2560) if k_minor else (2560, n), BF16) for n in Ns)
    f = jax.jit(lambda x, *w: skinny_gemm_pallas(x, w, k_minor=k_minor))
    text = f.trace(S((M, 2560), BF16), *ws).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("M", [1, 9])
def test_several_fp8_weights_cross_lower_for_cuda(M):
    S = jax.ShapeDtypeStruct
    ws = (S((4096, 2560), FP8), S((1536, 2560), FP8))
    ss = (S((20, 32), F32), S((20, 12), F32))
    f = jax.jit(lambda x, w1, w2, s1, s2: skinny_gemm_pallas(x, (w1, w2), (s1, s2), k_minor=True))
    text = f.trace(S((M, 2560), BF16), *ws, *ss).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


# ---- real kernel on the GPU (skipped elsewhere) ---------------------------------------------------
@gpu_only
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("K,N", LING_SHAPES)
@pytest.mark.parametrize("M", [1, 9, 16])
def test_gpu_ling_shape_matches_reference(M, K, N, fp8):
    w, s = _weights(K, N, fp8, seed=1)
    x = _x(M, K, seed=M)
    out = jax.jit(lambda *a: skinny_gemm_pallas(*a, out_dtype=F32))(x, w, *(() if s is None else (s,)))
    ref = jax.jit(skinny_gemm_reference)(x, w, s)
    _check(out, ref, 1e-4)


@gpu_only
@pytest.mark.parametrize("schedule", ["pair", "async"])
@pytest.mark.parametrize("K,N", LING_SHAPES)
@pytest.mark.parametrize("M", [1, 9, 16])
def test_gpu_fp8_schedules_ling_shape_match_reference(M, K, N, schedule):
    w, s = _weights(K, N, True, seed=1)
    x = _x(M, K, seed=M)
    out = jax.jit(lambda *a: skinny_gemm_pallas(*a, out_dtype=F32, fp8_schedule=schedule))(x, w, s)
    _check(out, jax.jit(skinny_gemm_reference)(x, w, s), 1e-4)


@gpu_only
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("K,N", LING_SHAPES)
@pytest.mark.parametrize("M", [1, 9, 16])
def test_gpu_k_minor_ling_shape_matches_reference(M, K, N, fp8):
    w, s = _weights(K, N, fp8, seed=1)
    x = _x(M, K, seed=M)
    wt = jax.jit(lambda a: a.T)(w)
    out = jax.jit(lambda *a: skinny_gemm_pallas(*a, out_dtype=F32, k_minor=True))(
        x, wt, *(() if s is None else (s,)))
    _check(out, jax.jit(skinny_gemm_reference)(x, w, s), 1e-4)


@gpu_only
@pytest.mark.parametrize("K,N", LING_SHAPES)
@pytest.mark.parametrize("M", [1, 9, 16])
def test_gpu_k_minor_a_regs_loads_agree_bit_for_bit(monkeypatch, M, K, N):
    """common.A_REGS_LOAD: the fp8 tiles loaded in the WGMMA layout give the same output, bit for bit,
    as the 4-byte load and relayout (same values in the same registers)."""
    import pallas_kernels.common as common_mod
    w, s = _weights(K, N, True, seed=1)
    x = _x(M, K, seed=M)
    wt = jax.jit(lambda a: a.T)(w)
    outs = []
    for load in ("upcast2x", "wgmma"):
        monkeypatch.setattr(common_mod, "A_REGS_LOAD", load)
        outs.append(np.asarray(jax.jit(lambda *a: skinny_gemm_pallas(*a, out_dtype=F32, k_minor=True))(x, wt, s)))
    np.testing.assert_array_equal(outs[1], outs[0])
    _check(outs[1], jax.jit(skinny_gemm_reference)(x, w, s), 1e-4)


@gpu_only
@pytest.mark.parametrize("kw", [dict(block_n=128, split_k=1), dict(block_n=64, split_k=4, stages=2),
                                dict(block_n=256, stages=2)])
def test_gpu_tiling_overrides(kw):
    w, s = _weights(2560, 4096, False, seed=2)
    x = _x(9, 2560, seed=2)
    _check(skinny_gemm_pallas(x, w, s, out_dtype=F32, **kw), skinny_gemm_reference(x, w, s), 1e-4)


@gpu_only
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("M", [1, 8, 9])
def test_gpu_several_weights_match_reference(M, fp8):
    """q / k / v of the DSpark draft's shape (fp8: the same widths) in one launch."""
    Ns = (4096, 4096, 4096)
    ws, ss = zip(*(_weights(2560, n, fp8, seed=3 + i) for i, n in enumerate(Ns)))
    x = _x(M, 2560, seed=M)
    outs = jax.jit(lambda x, ws, ss: skinny_gemm_pallas(x, ws, ss if fp8 else None, out_dtype=F32))(x, ws, ss)
    for w, s, out in zip(ws, ss, outs):
        _check(out, jax.jit(skinny_gemm_reference)(x, w, s), 1e-4)


@interpret_only
def test_timing_entry_point_cpu_smoke(tmp_path):
    """bench/skinny_gemm_timing.py end to end in interpret mode (tiny shape; times meaningless)."""
    from bench.skinny_gemm_timing import main
    rec = main(["--interpret", "--M", "9", "--shapes", "256x128", "--iters", "1", "--warmup", "1", "--copies", "2",
                "--fp8-schedule", "serial,pair,async", "--fp8-load-layout", "8bit,wgmma", "--no-xla-defaults",
                "--out-dir", str(tmp_path)])
    assert len(rec["results"]) == 7                            # bf16, fp8 serial, pair, async x 2 layouts
    assert [(r["tiling"].get("fp8_schedule"), r["tiling"].get("fp8_load_layout")) for r in rec["results"]] == \
        [(None, None)] + [(s, ly) for s in ("serial", "pair", "async") for ly in ("8bit", "wgmma")]
    for r in rec["results"]:
        assert "kernel_error" not in r and "xla_error" not in r, r
        assert r["finite"] and r["max_abs_err"] <= 1e-5 * r["ref_max"]
        assert r["bytes"] == weight_bytes(256, 128, FP8 if r["dtype"] == "fp8" else BF16)
        assert r["kernel_GBps"] > 0 and "kernel_pct_4p3" in r
    assert len(list(tmp_path.glob("skinny_gemm_timing-*.json"))) == 1      # the partial file is removed
    for r in rec["results"]:
        assert r["copies"] == 2 and r["kernel_loop_us"] > 0 and "loop_overhead_us" in r


def test_timing_entry_point_rejects_bad_load_layout(capsys):
    from bench.skinny_gemm_timing import main
    with pytest.raises(SystemExit):
        main(["--interpret", "--fp8-load-layout", "wgmma,wgmma", "--no-xla-defaults"])
    assert "--fp8-load-layout must be a comma list of distinct" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--interpret", "--k-minor", "--fp8-schedule", "serial,async", "--no-xla-defaults"])
    assert "--k-minor takes --fp8-schedule serial only" in capsys.readouterr().err


@interpret_only
def test_timing_entry_point_k_minor_cpu_smoke(tmp_path):
    """--k-minor: [N, K] weight copies, kernel and XLA rows on them, checked against the reference."""
    from bench.skinny_gemm_timing import main
    rec = main(["--interpret", "--k-minor", "--M", "3", "--shapes", "256x128", "--iters", "1", "--warmup", "1",
                "--copies", "2", "--no-xla-defaults", "--out-dir", str(tmp_path)])
    assert [r["dtype"] for r in rec["results"]] == ["bf16", "fp8"]
    for r in rec["results"]:
        assert r["k_minor"] and "kernel_error" not in r and "xla_error" not in r, r
        assert r["max_abs_err"] <= 1e-5 * r["ref_max"]
