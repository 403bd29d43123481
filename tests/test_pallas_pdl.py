"""`pallas_kernels.common.PDL_WAIT` (programmatic dependent launch): every decode-step kernel
cross-lowers for CUDA with it on and is then marked `uses_pdl` (jax launches it with programmatic
stream serialisation), and is not marked with it off (the default). Interpret mode runs the same
kernels without the wait: the interpret tests of each kernel file cover its results."""
import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import common
from pallas_kernels.kda_step_fused import kda_fused_step_pallas
from pallas_kernels.mla_decode import mla_decode_attention_pallas
from pallas_kernels.moe_experts import moe_experts_pallas
from pallas_kernels.skinny_gemm import skinny_gemm_pallas

S = jax.ShapeDtypeStruct
BF16, F32, FP8 = jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn
MARK = "mosaic_gpu.uses_pdl"


def _skinny():
    args = (S((9, 2560), BF16), S((4096, 2560), FP8), S((20, 32), F32))
    return jax.jit(lambda x, w, s: skinny_gemm_pallas(x, w, s, k_minor=True)), args


def _moe():
    E, D, F = 16, 256, 128
    args = (S((9, D), BF16), S((9, 4), jnp.int32), S((9, 4), F32), S((E, 2, F, D), FP8),
            S((E, 2, D // 128, F // 128), F32), S((E, D, F), FP8), S((E, F // 128, D // 128), F32))
    return jax.jit(lambda *a: moe_experts_pallas(*a, k_minor=True)), args


def _kda_step():
    H, K, T = 4, 128, 9
    args = (S((1, T, 5, H, K), BF16), S((1, 3, 3, H, K), BF16), S((4, 3, H, K), BF16), S((H,), F32),
            S((H, K), F32), S((1, T, H), F32), S((1, H, K, K), F32))
    return jax.jit(lambda *a: kda_fused_step_pallas(*a, jnp.int32(T))), args


def _mla():
    T, H, L, Dr, Sq = 9, 2, 512, 64, 256
    args = tuple(S(sh, BF16) for sh in ((1, T * H, L), (1, T * H, Dr), (1, Sq, L), (1, Sq, Dr))) + (S((), jnp.int32),)
    return jax.jit(lambda *a: mla_decode_attention_pallas(*a, heads=H, scale=0.07)), args


@pytest.mark.parametrize("build", [_skinny, _moe, _kda_step, _mla], ids=["skinny", "moe", "kda_step", "mla_decode"])
@pytest.mark.parametrize("on", [False, True], ids=["off", "on"])
def test_pdl_wait_marks_the_kernel(monkeypatch, build, on):
    monkeypatch.setattr(common, "PDL_WAIT", on)
    fn, args = build()
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert (MARK in text) == on


@pytest.mark.parametrize("weights", [1, 2])
@pytest.mark.parametrize("prefetch", [False, True], ids=["wait", "wait+prefetch"])
def test_skinny_gemm_prefetches_its_first_tiles_only_when_asked(monkeypatch, weights, prefetch):
    """PDL_PREFETCH (with PDL_WAIT): the skinny GEMM's programs issue L2 prefetches (TMA) of their
    first weight tiles before the wait, one weight or several in one launch."""
    monkeypatch.setattr(common, "PDL_WAIT", True)
    monkeypatch.setattr(common, "PDL_PREFETCH", prefetch)
    ws = (S((4096, 2560), FP8), S((1024, 2560), FP8))[:weights]
    ss = tuple(S((20, w.shape[0] // 128), F32) for w in ws)
    fn = jax.jit(lambda x, w, s: skinny_gemm_pallas(x, w if weights > 1 else w[0], s if weights > 1 else s[0],
                                                    k_minor=True))
    text = fn.trace(S((9, 2560), BF16), ws, ss).lower(lowering_platforms=("cuda",)).as_text()
    assert MARK in text
    assert ("cp.async.bulk.prefetch.tensor" in text) == prefetch
