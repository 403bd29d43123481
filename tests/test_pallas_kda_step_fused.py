"""Tests for the fused KDA decode / verify / commit step (pallas_kernels/kda_step_fused.py).

On CPU: Mosaic GPU interpret mode with race detection against the XLA reference
(lingjax.ops.kda.kda_fused_step) and a float64 run of that reference, over T in {1, 3, 9, 16}, head
dims 64 / 128, both gates, f32 and bf16 activations, masked prefixes (commit) and the write flags;
cross-lowering for CUDA at the Ling shape. On a GPU (JAX_PLATFORMS=cuda; skipped elsewhere): the
compiled kernel at the Ling shape against the reference. Speed: bench/kernels.py.
"""

import jax

jax.config.update("jax_enable_x64", True)  # process-global (conftest): tests pass float32 explicitly

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from helpers import assert_no_race_flagged, interpret_only  # noqa: E402
from lingjax.ops.kda import conv_window_after, kda_fused_step  # noqa: E402
from pallas_kernels.kda_step_fused import kda_fused_step_pallas  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16
INTERPRET = plgpu.InterpretGPUParams(detect_races=True)
ON_GPU = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA Hopper GPU (run with JAX_PLATFORMS=cuda)")


def _inputs(B, T, H, K, *, dtype=F32, seed=0, ks=4):
    """Model-like inputs: unit-scale projections, conv weights ~ 1/sqrt(ks), gate parameters that put
    g across (-5, 0), beta in (0, 1), a random state."""
    r = jax.random.split(jax.random.PRNGKey(seed), 8)
    proj = jax.random.normal(r[0], (B, T, 5, H, K), F32).astype(dtype)
    window = jax.random.normal(r[1], (B, ks - 1, 3, H, K), F32).astype(dtype)
    conv_w = (ks ** -0.5 * jax.random.normal(r[2], (ks, 3, H, K), F32)).astype(dtype)
    A_log = 0.5 * jax.random.normal(r[3], (H,), F32)
    dt_bias = 0.5 * jax.random.normal(r[4], (H, K), F32)
    beta = jax.nn.sigmoid(jax.random.normal(r[5], (B, T, H), F32))
    state = jax.random.normal(r[6], (B, H, K, K), F32)
    return proj, window, conv_w, A_log, dt_bias, beta, state


def _run(args, n=None, interpret=INTERPRET, **kw):
    out = jax.block_until_ready(kda_fused_step_pallas(*args, None if n is None else jnp.int32(n),
                                                      interpret=interpret, **kw))
    if interpret:
        assert_no_race_flagged()
    return out


def _reference(args, n=None, dtype=F32, **kw):
    """The XLA reference on the same inputs, computed in `dtype` (float64: an oracle for rounding)."""
    proj, window, conv_w, *rest = args
    if dtype == jnp.float64:      # the kernel's own rounding points are those of its input dtype
        proj, window, conv_w = (x.astype(jnp.float64) for x in (proj, window, conv_w))
        rest = [x.astype(jnp.float64) for x in rest]
    fn = jax.jit(lambda *a: kda_fused_step(*a, None if n is None else jnp.int32(n), **kw))
    return fn(proj, window, conv_w, *rest)


def _rel(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((out - ref) ** 2) / np.mean(ref ** 2)))


# (B, T, H, K, dtype, safe_gate, block_v)
CASES = [
    (1, 1, 2, 64, F32, True, None),
    (2, 3, 1, 64, F32, False, None),
    (1, 9, 2, 128, F32, True, None),
    (1, 16, 1, 64, F32, True, 64),
    (1, 1, 2, 128, BF16, True, None),
    (1, 9, 1, 64, BF16, True, 16),
    (2, 16, 1, 64, BF16, False, None),
]


@pytest.mark.parametrize("B,T,H,K,dtype,safe_gate,block_v", CASES)
@interpret_only
def test_interpret_matches_reference(B, T, H, K, dtype, safe_gate, block_v):
    args = _inputs(B, T, H, K, dtype=dtype, seed=T * 5 + B + H + K)
    o, s = _run(args, safe_gate=safe_gate, block_v=block_v)
    assert o.shape == (B, T, H, K) and o.dtype == F32
    assert s.shape == (B, H, K, K) and s.dtype == F32
    # float32 arithmetic on the kernel's inputs: the reference in float64 is the oracle
    fo, fs = _reference(args, dtype=jnp.float64, safe_gate=safe_gate)
    assert _rel(o, fo) <= 1e-5 and _rel(s, fs) <= 1e-5, (_rel(o, fo), _rel(s, fs))
    # the XLA path in the activation dtype: the same for f32; a bf16 model's XLA path rounds
    # intermediates (conv output, silu) to bf16 where it materialises them, the kernel does not
    ro, rs = _reference(args, safe_gate=safe_gate)
    tol = 2e-6 if dtype == F32 else 1e-2
    assert _rel(o, ro) <= tol and _rel(s, rs) <= tol, (_rel(o, ro), _rel(s, rs))


@pytest.mark.parametrize("n", [0, 2, 5])
@interpret_only
def test_interpret_prefix_is_the_shorter_block(n):
    """Tokens t >= n are identity updates: the state equals the kernel's own state after a block of
    only the first n tokens, bit for bit (the commit of an accepted prefix)."""
    args = _inputs(1, 5, 2, 64, dtype=BF16, seed=3)
    _, s = _run(args, n, write_o=False)
    if n:
        proj, window, conv_w, A_log, dt_bias, beta, state = args
        _, direct = _run((proj[:, :n], window, conv_w, A_log, dt_bias, beta[:, :n], state))
        np.testing.assert_array_equal(np.asarray(s), np.asarray(direct))
    else:
        np.testing.assert_array_equal(np.asarray(s), np.asarray(args[-1]))
    assert _rel(s, _reference(args, n, dtype=jnp.float64)[1]) <= 1e-5



def _logit_inputs(T, seed, dtype=BF16, H=2, K=64):
    """_inputs with beta replaced by logits (wide: sigmoid from ~0.01 to ~0.99)."""
    args = list(_inputs(1, T, H, K, dtype=dtype, seed=seed))
    logits = 2.5 * jax.random.normal(jax.random.PRNGKey(seed + 77), args[5].shape, F32)
    return args, logits


@pytest.mark.parametrize("T,n", [(1, None), (9, None), (9, 4)])
@interpret_only
def test_interpret_beta_logits_apply_the_sigmoid(T, n):
    """beta_logits=True (the model's fused path, session 24): the kernel applies the sigmoid to each
    token's beta itself, the same outputs as beta = sigmoid(logits) given (the scalar sigmoid in the
    kernel and XLA's may differ in the last bit), and the reference does the same."""
    args, logits = _logit_inputs(T, seed=31 + T)
    given = list(args)
    given[5] = jax.nn.sigmoid(logits)
    args[5] = logits
    o, s = _run(tuple(args), n, beta_logits=True)
    ro, rs = _run(tuple(given), n)
    assert _rel(o, ro) <= 1e-6 and _rel(s, rs) <= 1e-6, (_rel(o, ro), _rel(s, rs))
    fo, fs = _reference(tuple(args), n, dtype=jnp.float64, beta_logits=True)
    assert _rel(o, fo) <= 1e-5 and _rel(s, fs) <= 1e-5, (_rel(o, fo), _rel(s, fs))


@pytest.mark.parametrize("T,n,safe_gate", [(1, None, True), (9, None, False), (9, 4, True)])
@interpret_only
def test_interpret_exp2_matches_reference(T, n, safe_gate, monkeypatch):
    """EXP2 (exp as exp2(x log2 e) in the sigmoids, the gate and the decay) against float64."""
    from pallas_kernels import kda_step_fused
    monkeypatch.setattr(kda_step_fused, "EXP2", True)
    args, logits = _logit_inputs(T, seed=41 + T)
    args[5] = logits
    o, s = _run(tuple(args), n, beta_logits=True, safe_gate=safe_gate)
    fo, fs = _reference(tuple(args), n, dtype=jnp.float64, beta_logits=True, safe_gate=safe_gate)
    assert _rel(o, fo) <= 1e-5 and _rel(s, fs) <= 1e-5, (_rel(o, fo), _rel(s, fs))


def test_exp2_build_cross_lowers(monkeypatch):
    """EXP2 = True (the default) lowers for CUDA at the Ling shape, to a different module than False."""
    from pallas_kernels import kda_step_fused
    args = _inputs(1, 9, 32, 128, dtype=BF16)
    texts = []
    for on in (True, False):
        monkeypatch.setattr(kda_step_fused, "EXP2", on)
        fn = jax.jit(lambda *a: kda_fused_step_pallas(*a, write_state=False))     # traced anew
        texts.append(fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text())
    assert all("mosaic_gpu" in t for t in texts) and texts[0] != texts[1]


# (T, n, write_o, write_state, write_window, block_v, dtype): a verify, a decode, commits (dynamic n)
WS_CASES = [
    (9, None, True, False, False, None, BF16),
    (1, None, True, True, True, None, F32),
    (5, 3, False, True, True, 16, BF16),
    (5, 0, False, True, False, None, BF16),
    (16, 16, True, True, True, 32, BF16),
]


@pytest.mark.parametrize("n_prep", [1, 2])
@pytest.mark.parametrize("T,n,write_o,write_state,write_window,block_v,dtype", WS_CASES)
@interpret_only
def test_interpret_warp_specialised_is_the_same_kernel(T, n, write_o, write_state, write_window, block_v, dtype,
                                                       n_prep, monkeypatch):
    """PREP_WARPGROUPS = 1 / 2 (the preparation on other warpgroups than the recurrence, one SMEM
    barrier per token): the same outputs bit for bit as the single warpgroup, and no race flagged
    (the race detector checks that every row the recurrence reads was released by its barrier)."""
    from pallas_kernels import kda_step_fused
    args, logits = _logit_inputs(T, seed=60 + T + n_prep, dtype=dtype)
    args[5] = logits
    kw = dict(write_o=write_o, write_state=write_state, write_window=write_window, block_v=block_v,
              beta_logits=True, state_in_place=write_state and not write_o)
    monkeypatch.setattr(kda_step_fused, "PREP_WARPGROUPS", 0)
    want = _run(tuple(args), n, **kw)
    monkeypatch.setattr(kda_step_fused, "PREP_WARPGROUPS", n_prep)
    got = _run(tuple(args), n, **kw)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.mark.parametrize("T,n,write_o", [(9, None, True), (5, 3, False), (5, 0, False)])
@interpret_only
def test_interpret_own_barriers_warp_specialised(T, n, write_o, monkeypatch):
    """OWN_BARRIERS = True (no automatic SMEM barriers) with the warp-specialised build and a
    larger reduction scratch: the race detector finds no unordered SMEM access (the hand audit in
    the OWN_BARRIERS comment), and the outputs are those of the default build bit for bit."""
    from pallas_kernels import kda_step_fused
    args, logits = _logit_inputs(T, seed=90 + T)
    args[5] = logits
    kw = dict(write_o=write_o, write_state=not write_o, state_in_place=not write_o, write_window=not write_o,
              beta_logits=True)
    want = _run(tuple(args), n, **kw)
    monkeypatch.setattr(kda_step_fused, "OWN_BARRIERS", True)
    monkeypatch.setattr(kda_step_fused, "REDUCTION_SCRATCH_BYTES", 4096)
    got = _run(tuple(args), n, **kw)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.mark.parametrize("T,write_o", [(9, True), (9, False), (1, True)])
def test_warp_specialised_build_cross_lowers(T, write_o, monkeypatch):
    """PREP_WARPGROUPS = 2 lowers for CUDA at the Ling shape as the model calls it (a verify, a
    commit with the state in place and the window, a decode), with 3 warpgroups per program."""
    from pallas_kernels import kda_step_fused
    monkeypatch.setattr(kda_step_fused, "PREP_WARPGROUPS", 2)
    args = _inputs(1, T, 32, 128, dtype=BF16)
    fn = jax.jit(lambda *a: kda_fused_step_pallas(*a, jnp.int32(max(T // 2, 1)), write_o=write_o,
                                                  write_state=not write_o or T == 1, state_in_place=not write_o,
                                                  write_window=not write_o, beta_logits=True))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_reduction_scratch_setting_cross_lowers(monkeypatch):
    """REDUCTION_SCRATCH_BYTES = 4096 (one round per cross-warp reduction of the [128, 32] tile
    instead of two: 12 -> 8 barriers per token in the recurrence's PTX, session 35) lowers for
    CUDA with the warp-specialised build, to a different module than the default 2048."""
    from pallas_kernels import kda_step_fused
    args = _inputs(1, 9, 32, 128, dtype=BF16)
    texts = []
    for nbytes in (4096, 2048):
        monkeypatch.setattr(kda_step_fused, "REDUCTION_SCRATCH_BYTES", nbytes)
        fn = jax.jit(lambda *a: kda_fused_step_pallas(*a, write_state=False))     # traced anew
        texts.append(fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text())
    assert all("mosaic_gpu" in t for t in texts) and texts[0] != texts[1]


@pytest.mark.parametrize("n_prep", [0, 2])
@pytest.mark.parametrize("T,n,write_o,write_state,write_window,block_v,dtype", WS_CASES[:3])
@interpret_only
def test_interpret_hoisted_conv_weights_are_the_same_kernel(T, n, write_o, write_state, write_window, block_v,
                                                            dtype, n_prep, monkeypatch):
    """HOIST_CONV_WEIGHTS (the conv taps loaded once before the preparation loop, carried in
    registers): the same outputs bit for bit, with one warpgroup and warp-specialised."""
    from pallas_kernels import kda_step_fused
    monkeypatch.setattr(kda_step_fused, "PREP_WARPGROUPS", n_prep)
    args, logits = _logit_inputs(T, seed=130 + T + n_prep, dtype=dtype)
    args[5] = logits
    kw = dict(write_o=write_o, write_state=write_state, write_window=write_window, block_v=block_v,
              beta_logits=True, state_in_place=write_state and not write_o)
    monkeypatch.setattr(kda_step_fused, "HOIST_CONV_WEIGHTS", False)
    want = _run(tuple(args), n, **kw)
    monkeypatch.setattr(kda_step_fused, "HOIST_CONV_WEIGHTS", True)
    got = _run(tuple(args), n, **kw)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def _lowered_verify_and_commit(monkeypatch, setting, values):
    """{(name, value): StableHLO text} of a verify and a commit (state in place, window) at the Ling
    shape, lowered for CUDA with kda_step_fused.<setting> = each of values (traced anew each time)."""
    from pallas_kernels import kda_step_fused
    args = _inputs(1, 9, 32, 128, dtype=BF16)
    texts = {}
    for value in values:
        monkeypatch.setattr(kda_step_fused, setting, value)
        verify = lambda *a: kda_fused_step_pallas(*a, write_state=False, beta_logits=True)
        commit = lambda *a: kda_fused_step_pallas(*a, jnp.int32(5), write_o=False, state_in_place=True,
                                                  write_window=True, beta_logits=True)
        for name, f in (("verify", verify), ("commit", commit)):
            texts[name, value] = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert all("mosaic_gpu" in t for t in texts.values())
    return texts


def test_hoisted_conv_weights_cross_lower(monkeypatch):
    """HOIST_CONV_WEIGHTS lowers for CUDA at the Ling shape (a verify and a commit with the window),
    to different modules than the default."""
    texts = _lowered_verify_and_commit(monkeypatch, "HOIST_CONV_WEIGHTS", (False, True))
    assert texts["verify", True] != texts["verify", False] and texts["commit", True] != texts["commit", False]


# (T, n, n_prep, write_o, write_window): a verify, a commit of 3 of 5 with the window, a decode on one warpgroup
STRIDED_CASES = [(9, None, 2, True, False), (5, 3, 2, False, True), (1, None, 0, True, True)]


@pytest.mark.parametrize("T,n,n_prep,write_o,write_window", STRIDED_CASES)
@interpret_only
def test_interpret_strided_preparation_matches_reference(T, n, n_prep, write_o, write_window, monkeypatch):
    """STRIDED_PREP (the preparation one element per thread, v for all column blocks) against float64
    and within float32 rounding of the default build (the L2 norms sum in another order); the same
    window bit for bit; no race flagged (beta v rows of every block in SMEM)."""
    from pallas_kernels import kda_step_fused
    monkeypatch.setattr(kda_step_fused, "PREP_WARPGROUPS", n_prep)
    args, logits = _logit_inputs(T, seed=140 + T, dtype=BF16, H=2, K=128)
    args[5] = logits
    kw = dict(write_o=write_o, write_state=True, write_window=write_window, beta_logits=True)
    want = _run(tuple(args), n, **kw)
    monkeypatch.setattr(kda_step_fused, "STRIDED_PREP", True)
    got = _run(tuple(args), n, **kw)
    fo, fs = _reference(tuple(args), n, dtype=jnp.float64, beta_logits=True)
    if write_o:
        assert _rel(got[0], fo) <= 1e-5 and _rel(got[0], want[0]) <= 1e-6, (_rel(got[0], fo), _rel(got[0], want[0]))
    assert _rel(got[1], fs) <= 1e-5 and _rel(got[1], want[1]) <= 1e-6, (_rel(got[1], fs), _rel(got[1], want[1]))
    if write_window:
        np.testing.assert_array_equal(np.asarray(got[2], np.float32), np.asarray(want[2], np.float32))


def test_strided_preparation_cross_lowers_and_rejects_small_heads(monkeypatch):
    """STRIDED_PREP lowers for CUDA at the Ling shape (a verify; a commit with the state in place and
    the window) to other modules than the default, and refuses K = 64 (not one element per thread)."""
    texts = _lowered_verify_and_commit(monkeypatch, "STRIDED_PREP", (False, True))
    assert texts["verify", True] != texts["verify", False] and texts["commit", True] != texts["commit", False]
    with pytest.raises(ValueError, match="STRIDED_PREP needs K % 128 == 0"):
        kda_fused_step_pallas(*_inputs(1, 2, 1, 64), interpret=INTERPRET)


def test_warp_specialised_rejects_other_counts(monkeypatch):
    from pallas_kernels import kda_step_fused
    monkeypatch.setattr(kda_step_fused, "PREP_WARPGROUPS", 3)
    with pytest.raises(ValueError, match="PREP_WARPGROUPS=3 must be 0, 1 or 2"):
        kda_fused_step_pallas(*_inputs(1, 2, 1, 64), interpret=INTERPRET)
    monkeypatch.setattr(kda_step_fused, "PREP_WARPGROUPS", 2)
    monkeypatch.setattr(kda_step_fused, "REDUCTION_SCRATCH_BYTES", 3000)
    with pytest.raises(ValueError, match="REDUCTION_SCRATCH_BYTES=3000 must be a positive multiple of 1024"):
        kda_fused_step_pallas(*_inputs(1, 2, 1, 64), interpret=INTERPRET)


@interpret_only
def test_interpret_write_flags():
    args = _inputs(1, 3, 1, 64, seed=9)
    o_full, s_full = _run(args)
    o, s = _run(args, write_state=False)
    assert s is None
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_full))
    o, s = _run(args, write_o=False)
    assert o is None
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_full))


@interpret_only
def test_interpret_state_in_place_equals_a_state_output():
    """state_in_place: the start state updated through a jax.new_ref gives the separate state
    output bit for bit, for a decode step (o and state) and a commit (state only, n < T), also
    inside a jitted loop that carries the state (the decode loop's use)."""
    args = _inputs(1, 5, 2, 64, dtype=BF16, seed=4)
    for n, write_o in ((None, True), (3, False)):
        o_ref, s_ref = _run(args, n, write_o=write_o)
        o, s = _run(args, n, write_o=write_o, state_in_place=True)
        np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref))
        if write_o:
            np.testing.assert_array_equal(np.asarray(o), np.asarray(o_ref))
    *rest, state = args

    def loop(in_place):
        def body(_, st):
            return kda_fused_step_pallas(*rest, st, jnp.int32(3), write_o=False, state_in_place=in_place,
                                         interpret=INTERPRET)[1]
        return jax.jit(lambda st: jax.lax.fori_loop(0, 2, body, st))(state)

    np.testing.assert_array_equal(np.asarray(loop(True)), np.asarray(loop(False)))
    assert_no_race_flagged()
    with pytest.raises(ValueError, match="state_in_place=True updates the state operand"):
        kda_fused_step_pallas(*args, write_state=False, state_in_place=True, interpret=INTERPRET)


@pytest.mark.parametrize("T,n,write_o,in_place,dtype,block_v", [
    (1, None, True, False, BF16, 16),       # a decode step
    (1, None, True, True, F32, None),
    (5, 0, False, True, BF16, 16),          # commits of an accepted prefix: none, some, all
    (5, 2, False, False, BF16, None),
    (5, 5, False, True, F32, 32),
    (3, 2, True, True, BF16, 8),            # a padded decode (valid_len): o, state and window
])
@interpret_only
def test_interpret_window_output(T, n, write_o, in_place, dtype, block_v):
    """write_window: the third output is the window after the first n tokens (bit for bit: a copy),
    and o / state are those of the call without it."""
    args = _inputs(2, T, 2, 64, dtype=dtype, seed=20 + T + (n or 0))
    o, s, w = _run(args, n, write_o=write_o, state_in_place=in_place, block_v=block_v, write_window=True)
    assert w.shape == args[1].shape and w.dtype == args[0].dtype
    want = conv_window_after(args[1], args[0], n)
    np.testing.assert_array_equal(np.asarray(w, np.float32), np.asarray(want, np.float32))
    o_ref, s_ref = _run(args, n, write_o=write_o, block_v=block_v)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref))
    if write_o:
        np.testing.assert_array_equal(np.asarray(o), np.asarray(o_ref))



def test_rejects_bad_inputs():
    args = _inputs(1, 2, 1, 64)
    proj, window, conv_w, A_log, dt_bias, beta, state = args
    with pytest.raises(ValueError, match="T=17"):
        kda_fused_step_pallas(*_inputs(1, 17, 1, 64), interpret=INTERPRET)
    with pytest.raises(ValueError, match="channels"):
        kda_fused_step_pallas(proj[:, :, :3], *args[1:], interpret=INTERPRET)
    with pytest.raises(ValueError, match="multiple of 64"):
        kda_fused_step_pallas(*_inputs(1, 2, 1, 32), interpret=INTERPRET)
    with pytest.raises(ValueError, match="window"):
        kda_fused_step_pallas(proj, window[:, :2], *args[2:], interpret=INTERPRET)
    with pytest.raises(ValueError, match="beta"):
        kda_fused_step_pallas(proj, window, conv_w, A_log, dt_bias, beta[:, :1], state, interpret=INTERPRET)
    with pytest.raises(ValueError, match="block_v"):
        kda_fused_step_pallas(*args, block_v=24, interpret=INTERPRET)
    with pytest.raises(ValueError, match="nothing to write"):
        kda_fused_step_pallas(*args, write_o=False, write_state=False, interpret=INTERPRET)


# Cross-lowering runs the real Mosaic GPU lowering (layout inference, MLIR verification, SMEM
# budget) on this CPU host; registers, spills and speed are only checked on the H200.
@pytest.mark.parametrize("T,write_o,write_state", [(1, True, True), (9, True, False), (9, False, True)])
def test_cross_lowers_for_cuda_real_shape(T, write_o, write_state):
    args = _inputs(1, T, 32, 128, dtype=BF16)
    fn = jax.jit(lambda *a: kda_fused_step_pallas(*a, jnp.int32(T), write_o=write_o, write_state=write_state))
    assert "mosaic_gpu" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("T,write_o", [(1, True), (9, False)])
def test_state_in_place_cross_lowers_with_an_alias(T, write_o):
    """state_in_place at the Ling shape (a decode step, a commit): the mosaic_gpu call aliases its
    state operand to an output, so a loop's carried state can be updated without a copy."""
    args = _inputs(1, T, 32, 128, dtype=BF16)
    fn = jax.jit(lambda *a: kda_fused_step_pallas(*a, jnp.int32(T), write_o=write_o, state_in_place=True))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "output_operand_aliases" in text


@pytest.mark.parametrize("T,write_o,block_v", [(1, True, None), (9, False, None), (9, False, 16), (1, True, 8)])
def test_window_output_cross_lowers(T, write_o, block_v):
    """write_window at the Ling shape (a decode step, a commit) with the state in place."""
    args = _inputs(1, T, 32, 128, dtype=BF16)
    fn = jax.jit(lambda *a: kda_fused_step_pallas(*a, jnp.int32(max(T // 2, 1)), write_o=write_o, block_v=block_v,
                                                  state_in_place=True, write_window=True))
    assert "mosaic_gpu" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("T,write_o", [(1, True), (9, True), (9, False)])
def test_beta_logits_cross_lower(T, write_o):
    """beta_logits=True at the Ling shape (decode, verify, commit as the model runs them): the
    scalar sigmoid per token lowers for CUDA."""
    args = _inputs(1, T, 32, 128, dtype=BF16)
    fn = jax.jit(lambda *a: kda_fused_step_pallas(*a, jnp.int32(T), write_o=write_o, write_state=not write_o or T == 1,
                                                  state_in_place=not write_o, write_window=not write_o,
                                                  beta_logits=True))
    assert "mosaic_gpu" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_own_barriers_build_cross_lowers(monkeypatch):
    """OWN_BARRIERS = True (no automatic SMEM barriers, bench/kernels.py --own-barriers) lowers
    too, to a different module than the default."""
    from pallas_kernels import kda_step_fused
    args = _inputs(1, 9, 32, 128, dtype=BF16)
    texts = []
    for own in (True, False):
        monkeypatch.setattr(kda_step_fused, "OWN_BARRIERS", own)
        fn = jax.jit(lambda *a: kda_fused_step_pallas(*a, jnp.int32(9)))     # traced anew
        texts.append(fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text())
    assert all("mosaic_gpu" in t for t in texts) and texts[0] != texts[1]


# ---- real kernel on the GPU (skipped elsewhere) ---------------------------------------------------
@gpu_only
@pytest.mark.parametrize("safe_gate", [True, False], ids=["safe", "softplus"])
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("T", [1, 9, 16])
def test_gpu_matches_reference(T, dtype, safe_gate):
    args = _inputs(1, T, 32, 128, dtype=dtype, seed=100 + T)
    o, s = _run(args, interpret=False, safe_gate=safe_gate)
    fo, fs = _reference(args, dtype=jnp.float64, safe_gate=safe_gate)
    assert _rel(o, fo) <= 1e-5 and _rel(s, fs) <= 1e-5, (_rel(o, fo), _rel(s, fs))
    ro, rs = _reference(args, safe_gate=safe_gate)
    tol = 2e-6 if dtype == F32 else 1e-2
    assert _rel(o, ro) <= tol and _rel(s, rs) <= tol, (_rel(o, ro), _rel(s, rs))
    n = max(T // 2, 1)
    _, sp = _run(args, n, interpret=False, write_o=False, safe_gate=safe_gate)
    assert _rel(sp, _reference(args, n, dtype=jnp.float64, safe_gate=safe_gate)[1]) <= 1e-5


@gpu_only
@pytest.mark.parametrize("T,n", [(1, None), (9, None), (9, 5)])
def test_gpu_exp2_matches_reference(T, n, monkeypatch):
    """EXP2 on the GPU (ex2.approx) at the Ling shape against float64, as the default exp
    (session 34: 3 passed on an H100)."""
    from pallas_kernels import kda_step_fused
    monkeypatch.setattr(kda_step_fused, "EXP2", True)
    args, logits = _logit_inputs(T, seed=51 + T, H=32, K=128)
    args[5] = logits
    o, s = _run(tuple(args), n, interpret=False, beta_logits=True)
    fo, fs = _reference(tuple(args), n, dtype=jnp.float64, beta_logits=True)
    assert _rel(o, fo) <= 1e-5 and _rel(s, fs) <= 1e-5, (_rel(o, fo), _rel(s, fs))


@gpu_only
@pytest.mark.parametrize("T,n", [(1, None), (9, None), (9, 4)])
def test_gpu_beta_logits_apply_the_sigmoid(T, n):
    args, logits = _logit_inputs(T, seed=31 + T, H=32, K=128)
    given = list(args)
    given[5] = jax.nn.sigmoid(logits)
    args[5] = logits
    o, s = _run(tuple(args), n, interpret=False, beta_logits=True)
    ro, rs = _run(tuple(given), n, interpret=False)
    assert _rel(o, ro) <= 1e-6 and _rel(s, rs) <= 1e-6, (_rel(o, ro), _rel(s, rs))


@gpu_only
@pytest.mark.parametrize("T,n,write_o", [(1, None, True), (9, 5, False)])
def test_gpu_state_in_place_equals_a_state_output(T, n, write_o):
    """state_in_place on the H200 at the Ling shape (a decode step; a commit of 5 of 9 tokens):
    the same state (and o) bit for bit as the separate state output."""
    args = _inputs(1, T, 32, 128, dtype=BF16, seed=200 + T)
    o_ref, s_ref = _run(args, n, interpret=False, write_o=write_o)
    o, s = _run(args, n, interpret=False, write_o=write_o, state_in_place=True)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref))
    if write_o:
        np.testing.assert_array_equal(np.asarray(o), np.asarray(o_ref))


@gpu_only
@pytest.mark.parametrize("T,n,write_o", [(1, None, True), (9, 5, False), (9, 0, False)])
def test_gpu_window_output(T, n, write_o):
    """write_window on the H200 at the Ling shape: the window after n tokens, bit for bit, and the
    same o / state as without it."""
    args = _inputs(1, T, 32, 128, dtype=BF16, seed=300 + T)
    o, s, w = _run(args, n, interpret=False, write_o=write_o, state_in_place=True, write_window=True)
    want = conv_window_after(args[1], args[0], n)
    np.testing.assert_array_equal(np.asarray(w, np.float32), np.asarray(want, np.float32))
    o_ref, s_ref = _run(args, n, interpret=False, write_o=write_o)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref))
    if write_o:
        np.testing.assert_array_equal(np.asarray(o), np.asarray(o_ref))


@gpu_only
@pytest.mark.parametrize("n_prep", [1, 2])
@pytest.mark.parametrize("T,n,write_o", [(1, None, True), (9, None, True), (9, 5, False), (9, 0, False)])
def test_gpu_warp_specialised_is_the_same_kernel(T, n, write_o, n_prep, monkeypatch):
    """PREP_WARPGROUPS = 1 / 2 compiled at the Ling shape as the model calls it (decode, verify, a
    commit with the state in place and the window): the same outputs bit for bit as one warpgroup.
    Only this test saw run 131's bug (the warpgroups shared Mosaic's reduction scratch): interpret
    mode has no such scratch."""
    from pallas_kernels import kda_step_fused
    args, logits = _logit_inputs(T, seed=70 + T, H=32, K=128)
    args[5] = logits
    kw = dict(write_o=write_o, write_state=not write_o or T == 1, state_in_place=not write_o,
              write_window=not write_o, beta_logits=True)
    monkeypatch.setattr(kda_step_fused, "PREP_WARPGROUPS", 0)
    want = _run(tuple(args), n, interpret=False, **kw)
    monkeypatch.setattr(kda_step_fused, "PREP_WARPGROUPS", n_prep)
    got = _run(tuple(args), n, interpret=False, **kw)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@gpu_only
@pytest.mark.parametrize("T,n,write_o", [(1, None, True), (9, None, True), (9, 5, False)])
def test_gpu_strided_preparation_matches_reference(T, n, write_o, monkeypatch):
    """STRIDED_PREP compiled at the Ling shape as the model calls the kernel: against float64 and
    within float32 rounding of the default build; the window bit for bit."""
    from pallas_kernels import kda_step_fused
    args, logits = _logit_inputs(T, seed=150 + T, H=32, K=128)
    args[5] = logits
    kw = dict(write_o=write_o, write_state=True, state_in_place=not write_o, write_window=not write_o,
              beta_logits=True)
    want = _run(tuple(args), n, interpret=False, **kw)
    monkeypatch.setattr(kda_step_fused, "STRIDED_PREP", True)
    got = _run(tuple(args), n, interpret=False, **kw)
    fo, fs = _reference(tuple(args), n, dtype=jnp.float64, beta_logits=True)
    if write_o:
        assert _rel(got[0], fo) <= 1e-5 and _rel(got[0], want[0]) <= 1e-6, (_rel(got[0], fo), _rel(got[0], want[0]))
    assert _rel(got[1], fs) <= 1e-5 and _rel(got[1], want[1]) <= 1e-6, (_rel(got[1], fs), _rel(got[1], want[1]))
    if not write_o:
        np.testing.assert_array_equal(np.asarray(got[2], np.float32), np.asarray(want[2], np.float32))


@gpu_only
@pytest.mark.parametrize("settings", [{"REDUCTION_SCRATCH_BYTES": 4096},
                                      {"REDUCTION_SCRATCH_BYTES": 4096, "OWN_BARRIERS": True},
                                      {"HOIST_CONV_WEIGHTS": False}],
                         ids=["scratch4096", "scratch4096-own-barriers", "conv-weights-per-token"])
@pytest.mark.parametrize("T,n,write_o", [(1, None, True), (9, None, True), (9, 5, False), (9, 0, False)])
def test_gpu_reduction_settings_are_the_same_kernel(T, n, write_o, settings, monkeypatch):
    """The larger reduction scratch (one round per cross-warp reduction), OWN_BARRIERS, and the conv
    weights loaded per token (HOIST_CONV_WEIGHTS off), each against the defaults (warp-specialised,
    hoisted weights), compiled at the Ling shape as the model calls the kernel: the same outputs
    bit for bit (run 139: 7 passed with the hoisted weights as the setting under test)."""
    from pallas_kernels import kda_step_fused
    args, logits = _logit_inputs(T, seed=80 + T, H=32, K=128)
    args[5] = logits
    kw = dict(write_o=write_o, write_state=not write_o or T == 1, state_in_place=not write_o,
              write_window=not write_o, beta_logits=True)
    want = _run(tuple(args), n, interpret=False, **kw)
    for name, value in settings.items():
        monkeypatch.setattr(kda_step_fused, name, value)
    got = _run(tuple(args), n, interpret=False, **kw)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
