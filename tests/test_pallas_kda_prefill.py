"""Tests for the chunked KDA prefill kernels (pallas_kernels/kda_prefill.py).

On CPU: (1) Mosaic GPU interpret mode with race detection vs the XLA reference
(lingjax.ops.kda.kda_chunked) and the float64 oracle, over packed sequences (T not a multiple of
the 64-token chunk, empty and one-token sequences, with and without initial state, K = 64 and
128, decay down to -9 per token, strongly correlated keys); the fused-preprocessing variant vs
the float64 oracle; (2) packed sequences give bit-identical results to separate calls and to
[B, T, ...] inputs; (3) the chunk tables and chunk-space beta vs a Python loop; (4) cross-lowering
for CUDA at the Ling shape, also with each build setting (register / SMEM A operands, own /
Pallas' barriers; interpret mode always stages A operands in SMEM, so the register form is checked
by cross-lowering here and on the GPU); (5) bench/kda_prefill_debug.py and
bench/kda_prefill_phases.py in interpret mode on one tiny config.
On a GPU (``JAX_PLATFORMS=cuda``; skipped elsewhere): the compiled kernels for each of
kda_prefill.GPU_CHECKS (H=32, K=V=128, T in {100, 8192}, one or three packed sequences, fused or
not), bf16 inputs, relative RMSE <= 5e-3 vs float64 on 4 heads. GPU triage, one process per check
and kernel stage: bench/kda_prefill_debug.py. Speed: bench/kda_prefill_timing.py.
"""

import jax

jax.config.update("jax_enable_x64", True)  # process-global (conftest): tests pass float32 explicitly

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from lingjax.ops.kda import kda_chunked, kda_gate, kda_recurrent_numpy, l2_normalize  # noqa: E402
from pallas_kernels.kda_prefill import (  # noqa: E402
    CHUNK, GPU_CHECKS, _beta_chunks, chunk_tables, kda_prefill_fused_pallas, kda_prefill_pallas)

F32, BF16 = jnp.float32, jnp.bfloat16
INTERPRET = plgpu.InterpretGPUParams(detect_races=True)  # jax 0.12: races raise (on_race="raise")
# jax 0.11.2 has no on_race: a race is printed and flagged in the interpreter's (private) state.
RACES_RAISE = "on_race" in getattr(plgpu.InterpretGPUParams, "__dataclass_fields__", {})
ON_GPU = jax.default_backend() == "gpu"
# as tests/helpers.interpret_only (not imported: bench/kda_prefill_debug.py imports this module
# outside pytest, where tests/ is not on the path)
interpret_only = pytest.mark.skipif(ON_GPU, reason="Mosaic GPU interpret mode runs on the CPU backend only")
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA Hopper GPU (run with JAX_PLATFORMS=cuda)")
ACCURACY = 5e-3   # relative RMSE vs float64 (FLA's bar); bf16 MMA operands give ~3e-3


def _inputs(T, H, K, V, *, gate, seed=0, n_seq=1, key_corr=0.0):
    """Packed bf16 q, k (L2-normalised), v; fp32 g, beta; fp32 initial state [n_seq, H, K, V].

    key_corr > 0 adds a shared direction to every key of a head (key_corr=2: mean cosine ~0.8).
    """
    rng = np.random.default_rng(seed)
    q = l2_normalize(jnp.asarray(rng.standard_normal((T, H, K)), F32)).astype(BF16)
    k = key_corr * rng.standard_normal((1, H, K)) + rng.standard_normal((T, H, K))
    k = l2_normalize(jnp.asarray(k, F32)).astype(BF16)
    v = jnp.asarray(rng.standard_normal((T, H, V)), BF16)
    if gate == "near0":                       # weak decay: g in (-0.05, 0)
        g = -0.05 * rng.uniform(size=(T, H, K))
    elif gate == "strong":                    # past the safe gate, at the documented limit
        g = -9.0 * rng.uniform(0.9, 1.0, (T, H, K))
    else:                                     # Ling's safe gate (lower bound -5), random input
        f = 2.0 * rng.standard_normal((T, H, K))
        g = kda_gate(jnp.asarray(f), jnp.log(jnp.asarray(rng.uniform(1, 4, H))),
                     jnp.asarray(rng.uniform(-0.5, 0.5, H * K)))
    beta = jax.nn.sigmoid(jnp.asarray(rng.standard_normal((T, H)), F32))
    s0 = jnp.asarray(0.5 * rng.standard_normal((n_seq, H, K, V)), F32)
    return q, k, v, jnp.asarray(g, F32), beta, s0


def _split(x, cu):
    return [x[None, cu[i]:cu[i + 1]] for i in range(len(cu) - 1)]


def _reference(q, k, v, g, beta, s0, cu, ref):
    """Per-sequence reference: 'oracle' (float64 numpy) or 'xla' (kda_chunked, fp32)."""
    os, ss = [], []
    for i, xs in enumerate(zip(*(_split(x.astype(F32), cu) for x in (q, k, v, g, beta)))):
        st = None if s0 is None else s0[i:i + 1]
        if ref == "oracle":
            o, s = kda_recurrent_numpy(*xs, None if st is None else np.asarray(st))
        else:
            o, s = jax.jit(kda_chunked)(*xs, st)
        os.append(np.asarray(o, np.float64)[0])
        ss.append(np.asarray(s, np.float64)[0])
    return np.concatenate(os), np.stack(ss)


def _rel_rmse(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def _assert_no_race_flagged():
    """tests/helpers.assert_no_race_flagged, repeated here for the reason interpret_only is (above)."""
    if not RACES_RAISE:
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
        assert not gpu_callbacks.get_races().races_found, "interpret mode detected a race"


def _run_interpret(*args, **kw):
    out = jax.block_until_ready(kda_prefill_pallas(*args, interpret=INTERPRET, **kw))
    _assert_no_race_flagged()
    return out


# (T, H, K, V, block_v, cu_seqlens, with initial state, gate, key correlation)
CASES = [
    (100, 1, 64, 64, 32, None, False, "near0", 0.0),             # one sequence, 1.5 chunks
    (100, 2, 128, 64, 64, [0, 37, 37, 100], True, "safe", 0.0),  # an empty sequence; 37 + 63
    (130, 1, 128, 128, 128, [0, 64, 65, 130], True, "strong", 0.0),  # 64, 1 and 65 tokens
    # Keys with mean cosine ~0.8 and weak decay: (I + Akk)^-1 stays moderate but the powers of
    # Akk are huge (a Neumann-product inverse (I - L)(I + L^2)... is off by > 1e3 here).
    (150, 1, 128, 64, 32, [0, 20, 150], True, "near0", 2.0),
]


# g < -6 overflows only the masked (upper-triangle) entries of the in-chunk products; numpy
# reports that inside the interpreter's matmul, the kernel selects those entries away.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("T,H,K,V,block_v,cu,with_state,gate,key_corr", CASES)
@interpret_only
def test_interpret_matches_references(T, H, K, V, block_v, cu, with_state, gate, key_corr):
    n_seq = 1 if cu is None else len(cu) - 1
    q, k, v, g, beta, s0 = _inputs(T, H, K, V, gate=gate, seed=T + H + V, n_seq=n_seq,
                                   key_corr=key_corr)
    s0 = s0 if with_state else None
    o, s = _run_interpret(q, k, v, g, beta, s0, block_v=block_v,
                          cu_seqlens=None if cu is None else np.asarray(cu, np.int32))
    assert o.shape == (T, H, V) and o.dtype == F32
    assert s.shape == (n_seq, H, K, V) and s.dtype == F32
    cu = [0, T] if cu is None else cu
    for ref in ("oracle", "xla"):
        ro, rs = _reference(q, k, v, g, beta, s0, cu, ref)
        assert _rel_rmse(o, ro) < ACCURACY, ref
        assert _rel_rmse(s, rs) < ACCURACY, ref
        np.testing.assert_allclose(o, ro, atol=0.05 * np.abs(ro).max())


def _raw_inputs(T, H, K, V, seed):
    """Inputs of the fused kernel: raw q, k, v, gate projection f, beta logits, A_log, dt_bias."""
    rng = np.random.default_rng(seed)
    q, k = (jnp.asarray(rng.standard_normal((T, H, K)) * sd, BF16) for sd in (3.0, 0.5))
    v = jnp.asarray(rng.standard_normal((T, H, V)), BF16)
    f = jnp.asarray(2.0 * rng.standard_normal((T, H, K)), BF16)
    beta_logits = jnp.asarray(rng.standard_normal((T, H)), F32)
    A_log = jnp.log(jnp.asarray(rng.uniform(1, 4, H), F32))
    dt_bias = jnp.asarray(rng.uniform(-0.5, 0.5, H * K), F32)
    return q, k, v, f, beta_logits, A_log, dt_bias


@interpret_only
def test_fused_preprocessing_interpret():
    """L2 norm, safe gate and beta sigmoid in kernel 1 vs the same math in float64 + the oracle."""
    T, H, K, V, cu = 150, 1, 128, 64, [0, 90, 150]
    q, k, v, f, bl, A_log, dt_bias = _raw_inputs(T, H, K, V, seed=3)
    s0 = _inputs(T, H, K, V, gate="near0", n_seq=2)[-1]
    o, s = jax.block_until_ready(kda_prefill_fused_pallas(
        q, k, v, f, bl, A_log, dt_bias, s0, cu_seqlens=np.asarray(cu, np.int32), block_v=64,
        interpret=INTERPRET))
    _assert_no_race_flagged()
    x64 = lambda x: jnp.asarray(x, jnp.float64)
    pre = (l2_normalize(x64(q)), l2_normalize(x64(k)), x64(v),
           kda_gate(x64(f), x64(A_log), x64(dt_bias)), jax.nn.sigmoid(x64(bl)))
    ro, rs = _reference(*pre, s0, cu, "oracle")
    assert _rel_rmse(o, ro) < ACCURACY
    assert _rel_rmse(s, rs) < ACCURACY
    with pytest.raises(ValueError, match="lower_bound"):
        kda_prefill_fused_pallas(q, k, v, f, bl, A_log, dt_bias, lower_bound=-20.0)


@interpret_only
def test_fused_neg_inf_padding_is_exact_identity():
    """f = beta_logits = -inf past n tokens gives g = 0, beta = 0 there: the state and the first n
    outputs equal those of the n-token call bit for bit (how a caller masks a padded prompt)."""
    T, H, K, V, n = 100, 1, 64, 64, 70
    q, k, v, f, bl, A_log, dt_bias = _raw_inputs(T, H, K, V, seed=2)
    real = jnp.arange(T) < n
    f_pad = jnp.where(real[:, None, None], f, -jnp.inf).astype(f.dtype)
    bl_pad = jnp.where(real[:, None], bl, -jnp.inf)
    o, s = kda_prefill_fused_pallas(q, k, v, f_pad, bl_pad, A_log, dt_bias, block_v=64,
                                    interpret=INTERPRET)
    o_n, s_n = kda_prefill_fused_pallas(q[:n], k[:n], v[:n], f[:n], bl[:n], A_log, dt_bias,
                                        block_v=64, interpret=INTERPRET)
    np.testing.assert_array_equal(s, s_n)
    np.testing.assert_array_equal(o[:n], o_n)
    assert bool(jnp.isfinite(o).all())


@interpret_only
def test_packed_equals_separate_and_batched():
    """Every sequence starts a new chunk, so packing must not change a single bit; [B, T, ...]
    inputs are B packed sequences of T tokens."""
    T1, H, K, V = 40, 1, 64, 64
    q, k, v, g, beta, s0 = _inputs(2 * T1, H, K, V, gate="safe", seed=5, n_seq=2)
    cu = np.array([0, T1, 2 * T1], np.int32)
    o, s = _run_interpret(q, k, v, g, beta, s0, cu_seqlens=cu, block_v=64)
    o2, s2 = _run_interpret(*(x[T1:] for x in (q, k, v, g, beta)), s0[1:], block_v=64)  # 2nd alone
    np.testing.assert_array_equal(o[T1:], o2)
    np.testing.assert_array_equal(s[1], s2[0])
    ob, sb = _run_interpret(*(x.reshape(2, T1, *x.shape[1:]) for x in (q, k, v, g, beta)), s0,
                            block_v=64)
    np.testing.assert_array_equal(ob.reshape(o.shape), o)
    np.testing.assert_array_equal(sb, s)


def test_chunk_tables_match_a_python_loop():
    rng = np.random.default_rng(0)
    for _ in range(8):
        lens = rng.integers(0, 200, rng.integers(1, 6))
        lens[rng.integers(len(lens))] += 1                 # T >= 1
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        T = int(cu[-1])
        tok0, ntok, clo, chi = (np.asarray(x) for x in chunk_tables(jnp.asarray(cu), T, len(lens)))
        want = [(cu[s] + CHUNK * i, min(CHUNK, cu[s + 1] - cu[s] - CHUNK * i))
                for s in range(len(lens)) for i in range(max(1, -(-lens[s] // CHUNK)))]
        assert len(tok0) >= len(want)
        assert list(zip(tok0[:len(want)], ntok[:len(want)])) == want
        assert not ntok[len(want):].any()
        assert list(chi - clo) == [max(1, -(-n // CHUNK)) for n in lens]
        assert clo[0] == 0 and list(clo[1:]) == list(chi[:-1])


def test_beta_chunks_are_aligned_chunk_space():
    """beta reaches kernel 1 in chunk space [H, N * 64], so each chunk's TMA box starts at a
    multiple of 64 tokens on beta's innermost (contiguous) dimension. In token space [H, T] it
    would start at the chunk's first token: not 16-byte aligned when a sequence starts at
    cu[s] % 4 != 0, an illegal instruction on the H200 (interpret mode and cross-lowering do not
    check it)."""
    rng = np.random.default_rng(1)
    for cu in ([0, 1000, 1001, 1100], [0, 37, 37, 100], [0, 5], [0, 64, 130]):
        T, S, H = cu[-1], len(cu) - 1, 3
        beta = rng.uniform(size=(H, T + 3)).astype(np.float32)      # padded rows are ignored
        tok0, ntok, _, _ = chunk_tables(jnp.asarray(cu, jnp.int32), T, S)
        got = np.asarray(_beta_chunks(jnp.asarray(beta), tok0, ntok))
        assert got.shape == (H, len(tok0) * CHUNK)
        want = np.zeros_like(got)
        for n, (t0, nt) in enumerate(zip(np.asarray(tok0), np.asarray(ntok))):
            want[:, n * CHUNK:n * CHUNK + nt] = beta[:, t0:t0 + nt]
        np.testing.assert_array_equal(got, want)


def test_rejects_bad_arguments():
    q, k, v, g, beta, s0 = _inputs(20, 1, 128, 64, gate="near0")
    with pytest.raises(ValueError, match="block_v"):
        kda_prefill_pallas(q, k, v, g, beta, block_v=24, interpret=INTERPRET)
    with pytest.raises(ValueError, match="cu_seqlens"):
        kda_prefill_pallas(q, k, v, g, beta, cu_seqlens=np.array([0, 5, 19]), interpret=INTERPRET)
    with pytest.raises(ValueError, match="initial_state"):
        kda_prefill_pallas(q, k, v, g, beta, jnp.zeros((2, 1, 128, 64)), interpret=INTERPRET)
    q96, k96, v96, g96, beta96, _ = _inputs(20, 1, 96, 64, gate="near0")
    with pytest.raises(ValueError, match="K=96"):
        kda_prefill_pallas(q96, k96, v96, g96, beta96, interpret=INTERPRET)


# Cross-lowering runs the real Mosaic GPU lowering (layout inference, MLIR verification, the SMEM
# budget) on this CPU host. It does NOT run ptxas: registers, spills and speed need the H200.
@pytest.mark.parametrize("T,n_seq,with_state,block_v",
                         [(100, 1, False, 32), (8192, 3, True, 32), (8192, 1, True, 64)])
def test_cross_lowers_for_cuda_real_shape(T, n_seq, with_state, block_v):
    H, K, V = 32, 128, 128
    sds = jax.ShapeDtypeStruct
    args = [sds((T, H, K), BF16), sds((T, H, K), BF16), sds((T, H, V), BF16), sds((T, H, K), F32),
            sds((T, H), F32), sds((n_seq + 1,), jnp.int32)]
    if with_state:
        args.append(sds((n_seq, H, K, V), F32))

    def f(q, k, v, g, beta, cu, s0=None):
        return kda_prefill_pallas(q, k, v, g, beta, s0, cu_seqlens=cu, block_v=block_v)

    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 2          # both kernels


def test_fused_cross_lowers_for_cuda_real_shape():
    T, H, K, V = 8192, 32, 128, 128
    sds = jax.ShapeDtypeStruct
    args = (sds((T, H, K), BF16), sds((T, H, K), BF16), sds((T, H, V), BF16),
            sds((T, H, K), BF16), sds((T, H), F32), sds((H,), F32), sds((H * K,), F32))
    text = jax.jit(kda_prefill_fused_pallas).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 2


def test_build_settings_cross_lower_and_take_effect(monkeypatch):
    """The trace-time settings (A_FROM_REGISTERS, OWN_BARRIERS; the GPU default is both on) each
    cross-lower at the Ling shape, and each changes the kernels' modules (a setting that is read
    nowhere would give the same text)."""
    from pallas_kernels import kda_prefill as kp
    T, H, K, V = 300, 32, 128, 128
    sds = jax.ShapeDtypeStruct
    args = (sds((T, H, K), BF16), sds((T, H, K), BF16), sds((T, H, V), BF16), sds((T, H, K), F32),
            sds((T, H), F32))
    texts = {}
    for regs in (True, False):
        for own in (True, False):
            monkeypatch.setattr(kp, "A_FROM_REGISTERS", regs)
            monkeypatch.setattr(kp, "OWN_BARRIERS", own)
            f = lambda *a: kp.kda_prefill_pallas(*a)       # a fresh function: traced anew
            texts[regs, own] = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert texts[regs, own].count("mosaic_gpu") >= 2
    assert len(set(texts.values())) == 4


def test_phases_bench_settings_and_interpret_smoke(monkeypatch):
    """bench/kda_prefill_phases.py: build names map to the kernel settings; two builds run on CPU."""
    monkeypatch.setenv("LINGJAX_NO_XLA_DEFAULTS", "1")          # leave this process's XLA_FLAGS
    from bench import kda_prefill_phases as ph
    from pallas_kernels import kda_prefill as kp
    assert ph.variant_settings("smem") == (False, frozenset())
    assert ph.variant_settings("regs") == (True, frozenset())
    assert ph.variant_settings("regs-inverse") == (True, frozenset({"inverse"}))
    assert ph.variant_settings("regs-all") == (True, frozenset(ph.PHASES))
    with pytest.raises(ValueError, match="unknown build"):
        ph.variant_settings("regs-nothing")
    rec = ph.main(["--interpret", "--T", "70", "--heads", "1", "--iters", "1", "--warmup", "0",
                   "--variants", "regs,regs-all"])
    row = rec["results"][0]
    assert row["T"] == 70 and row["regs_ms"] > 0 and row["regs-all_ms"] > 0
    assert not any(k.endswith("_error") for k in row)
    assert kp._SKIP_PHASES == frozenset() and kp.A_FROM_REGISTERS     # restored afterwards


# ----------------------------------------------------------------------------- GPU only


def _oracle_heads(q, k, v, g, beta, heads, cu, s0=None):
    """float64 recurrence for a few heads (heads are independent), per sequence."""
    pick = lambda x: np.asarray(x).astype(np.float64)[:, heads]
    xs = [pick(x) for x in (q, k, v, g, beta)]
    outs, states = [], []
    for i in range(len(cu) - 1):
        st = None if s0 is None else np.asarray(s0, np.float64)[i:i + 1, heads]
        o, s = kda_recurrent_numpy(*(x[None, cu[i]:cu[i + 1]] for x in xs), st,
                                   scale=q.shape[-1] ** -0.5)
        outs.append(o[0])
        states.append(s[0])
    return np.concatenate(outs), np.stack(states)


def gpu_check_call(case, interpret=False):
    """The call one of GPU_CHECKS makes (also used by bench/kda_prefill_debug.py).

    Returns (fn, args, pre, cu): fn(*args, prep_only=False) -> (o, s) runs the kernels (prep_only:
    kernel 1's outputs and the chunk tables); pre = (q, k, v, g, beta, s0) are the inputs of the
    references after any fused preprocessing (float64 where x64 is on); cu the sequence bounds.
    """
    from pallas_kernels import kda_prefill as kp
    T, H, K, V = case.T, case.H, case.K, case.V
    cu = [0, T] if case.cu is None else list(case.cu)
    seed = T if case.seed is None else case.seed
    s0 = None
    if case.with_state:
        s0 = jnp.asarray(0.5 * np.random.default_rng(seed + 1).standard_normal(
            (len(cu) - 1, H, K, V)), F32)
    cu_arr = None if case.cu is None else jnp.asarray(cu, jnp.int32)
    kw = dict(cu_seqlens=cu_arr, block_v=case.block_v, interpret=interpret)
    if case.fused:
        q, k, v, f, bl, A_log, dt_bias = _raw_inputs(T, H, K, V, seed=seed)
        gate = (dt_bias.astype(F32).reshape(H, K), jnp.exp(A_log.astype(F32)), -5.0)

        def fn(q, k, v, f, bl, s0, prep_only=False):
            if prep_only:
                return kp._prefill(q, k, v, f, bl, gate, s0, None, kw["cu_seqlens"], F32,
                                   case.block_v, interpret, prep_only=True)
            return kda_prefill_fused_pallas(q, k, v, f, bl, A_log, dt_bias, s0, **kw)
        x64 = lambda x: jnp.asarray(x, jnp.float64)
        pre = (l2_normalize(x64(q)), l2_normalize(x64(k)), x64(v),
               kda_gate(x64(f), x64(A_log), x64(dt_bias)), jax.nn.sigmoid(x64(bl)), s0)
        return fn, (q, k, v, f, bl, s0), pre, cu
    q, k, v, g, beta, _ = _inputs(T, H, K, V, gate="safe", seed=seed)

    def fn(q, k, v, g, beta, s0, prep_only=False):
        if prep_only:
            return kp._prefill(q, k, v, g, beta, None, s0, None, kw["cu_seqlens"], F32,
                               case.block_v, interpret, prep_only=True)
        return kda_prefill_pallas(q, k, v, g, beta, s0, **kw)
    return fn, (q, k, v, g, beta, s0), (q, k, v, g, beta, s0), cu


def _check_on_gpu(case):
    fn, args, pre, cu = gpu_check_call(case)
    o, s = jax.block_until_ready(jax.jit(fn)(*args))
    assert bool(jnp.isfinite(o).all()) and bool(jnp.isfinite(s).all())
    heads = [0, 7, 19, 31]
    ro, rs = _oracle_heads(*pre[:5], heads, cu, pre[5])
    assert _rel_rmse(np.asarray(o)[:, heads], ro) <= ACCURACY
    assert _rel_rmse(np.asarray(s)[:, heads], rs) <= ACCURACY


# An illegal instruction poisons the process's CUDA context: every later GPU test of the same
# pytest process then fails too. bench/kda_prefill_debug.py runs each check in its own process.
@gpu_only
@pytest.mark.parametrize("case", [c for c in GPU_CHECKS if not c.fused], ids=lambda c: c.name)
def test_gpu_real_shape_accuracy(case):
    _check_on_gpu(case)


@gpu_only
@pytest.mark.parametrize("case", [c for c in GPU_CHECKS if c.fused], ids=lambda c: c.name)
def test_gpu_fused_real_shape_accuracy(case):
    _check_on_gpu(case)


# ----------------------------------------------------------------------------- GPU triage script


def test_debug_script_runs_in_interpret_mode(tmp_path):
    """bench/kda_prefill_debug.py on CPU: one tiny config, kernel 1 alone and both kernels, each
    in its own process, plus --repro (the pre-fix token-space beta; interpret mode does not
    check TMA alignment, so it passes here)."""
    import json
    from pathlib import Path

    from bench import kda_prefill_debug as dbg
    rec = dbg.main(["--interpret", "--configs", "T100", "--repro", "--out-dir", str(tmp_path),
                    "--timeout-s", "240"])
    rows = rec["rows"]
    assert [(r["config"], r["stage"], r["status"]) for r in rows] == [
        ("T100", "prep", "ok"), ("T100", "pipeline", "ok"),
        ("T8192_packed3_aligned", "prep", "ok"), ("T8192_packed3", "prep", "ok")]
    prep, pipe = rows[:2]
    assert prep["case"]["H"] == 1 and prep["case"]["T"] == 100 and prep["finite"]
    assert prep["gc_rel_rmse"] < 1e-5 and prep["phase"] == "done" and prep["compile_s"] > 0
    assert max(pipe[k] for k in ("rmse_o_f64", "rmse_s_f64", "rmse_o_xla", "rmse_s_xla")) < ACCURACY
    assert rows[3]["token_space_beta"] and rows[3]["case"]["cu"] == [0, 18, 19, 150]
    saved = json.loads(Path(rec["result_path"]).read_text())
    assert saved["summary"][-1] == "T8192_packed3/prep (token-space beta): ok" and "env" in saved
    assert saved["repro"].startswith("not reproduced")       # interpret mode does not fault
    assert (tmp_path / "kda_prefill_debug.log").read_text().count("=== ") == 4
    assert not (tmp_path / "kda_prefill_debug-partial.json").exists()


def test_debug_script_records_timeouts_and_ptxas(tmp_path):
    from bench import kda_prefill_debug as dbg
    rec = dbg.main(["--interpret", "--configs", "T100", "--timeout-s", "0.05",
                    "--out-dir", str(tmp_path)])
    # kernel 1 timed out: kernel 2 alone runs (and times out too), the pipeline is skipped
    assert [(r["stage"], r["status"]) for r in rec["rows"]] == [
        ("prep", "timeout"), ("state", "timeout"), ("pipeline", "skipped")]
    text = """ptxas info    : Compiling entry function 'mosaic_gpu_prep' for 'sm_90a'
ptxas info    : Function properties for mosaic_gpu_prep
    148 bytes stack frame, 148 bytes spill stores, 152 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 148 bytes cumulative stack size, 416 bytes smem
ptxas info    : Compiling entry function 'mosaic_gpu_state' for 'sm_90a'
ptxas info    : Used 90 registers"""
    kernels, lines = dbg.parse_ptxas(text)
    assert kernels == [
        {"function": "mosaic_gpu_prep", "arch": "sm_90a", "stack_bytes": 148,
         "spill_store_bytes": 148, "spill_load_bytes": 152, "registers": 168, "smem_bytes": 416},
        {"function": "mosaic_gpu_state", "arch": "sm_90a", "registers": 90}]
    assert len(lines) == 6
