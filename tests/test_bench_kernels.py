"""CPU smoke test of bench/kernels.py: Pallas kernels in interpret mode at small shapes against
their XLA references (table, JSON line and result file produced, errors small; no timing asserted)."""
import json

import jax
import pytest

from bench import kernels

BASE = ["--interpret", "--iters", "2", "--no-xla-defaults", "--copy-mib", "4"]


def test_kernels_smoke(tmp_path, capsys):
    rec = kernels.main(BASE + ["--block-v", "16", "--states", "2", "--out", str(tmp_path)])   # one variant: slow
    out = capsys.readouterr().out
    assert "us/call" in out and "%floor" in out and "us/states" in out
    assert json.loads(out.strip().splitlines()[-1])["bench"] == "kernels"
    saved = json.loads(open(rec["result_path"]).read())
    assert saved["interpret"] and saved["shape"] == {"B": 1, "H": 2, "K": 64, "V": 64} and "env" in saved
    rows = saved["rows"]
    assert [(r["case"], r["T"], r["impl"]) for r in rows] == [
        ("decode", 1, "xla kda_step"), ("decode", 1, "pallas bv=16"), ("decode", 1, "pallas bv=16 in place"),
        ("verify", 9, "xla kda_chunked"), ("verify", 9, "pallas bv=16"),
        ("verify", 16, "xla kda_chunked"), ("verify", 16, "pallas bv=16"),
        ("commit", 9, "xla kda_state_after_prefix"), ("commit", 9, "pallas bv=16"),
        ("commit", 9, "pallas bv=16 in place")]
    for r in rows:
        assert r["us_call"] > 0 and r["us_loop"] > 0 and r["bytes"] > 2 * 64 * 64 * 4
        kernel = r["impl"].startswith("pallas")
        assert (r["us_states"] > 0 and r["states"] == 2) if kernel else r["us_states"] is None
        assert r["us_net_raw"] > 0 and r["us_net"] == pytest.approx(r["us_net_raw"] - r["loop_overhead_us"])
        verify = r["case"] == "verify"
        assert r["rmse_s_f64"] is None if verify else r["rmse_s_f64"] <= 1e-2    # XLA rows: bf16 rounding
        assert r["rmse_o_f64"] is None if r["case"] == "commit" else r["rmse_o_f64"] <= 1e-2
        if r["impl"].startswith("pallas"):      # float32 arithmetic on the bf16 inputs
            assert r["rmse_o_f64"] is None or r["rmse_o_f64"] <= 1e-5
            assert r["rmse_s_f64"] is None or r["rmse_s_f64"] <= 1e-5
            assert r["max_rel_s"] is None if verify else r["max_rel_s"] <= 5e-2
            assert r["max_rel_o"] is None if r["case"] == "commit" else r["max_rel_o"] <= 5e-2


@pytest.mark.parametrize("extra,msg", [
    (["--iters", "0"], "--iters must be >= 1"),
    (["--states", "-1"], "--states must be >= 0"),
    (["--cases", "verify8"], "--cases verify8: each must be one of decode1,verify9,verify16,commit9"),
    (["--block-v", "24"], "--block-v 24 must divide"),
    (["--block-v", "a,b"], "comma-separated integers"),
])
def test_kernels_bad_flags(capsys, extra, msg):
    with pytest.raises(SystemExit) as e:
        kernels.main(BASE + extra)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the off-GPU error")
def test_kernels_needs_gpu_or_interpret(capsys):
    with pytest.raises(SystemExit) as e:
        kernels.main(["--iters", "1", "--no-xla-defaults"])
    assert e.value.code == 2 and "--interpret" in capsys.readouterr().err


def test_failing_kernel_variant_is_recorded_not_fatal(tmp_path, capsys, monkeypatch):
    from pallas_kernels import kda_step_fused

    def broken(*args, **kw):
        raise RuntimeError("ptxas: too many resources")
    monkeypatch.setattr(kda_step_fused, "kda_fused_step_pallas", broken)
    rec = kernels.main(["--interpret", "--iters", "1", "--no-xla-defaults", "--copy-mib", "4", "--out", str(tmp_path)])
    rows = rec["rows"]
    xla = [r for r in rows if r["impl"].startswith("xla")]
    pallas = [r for r in rows if r["impl"].startswith("pallas")]
    assert len(xla) == 4 and len(pallas) == 6 and all("error" not in r for r in xla)
    assert all("ptxas: too many resources" in r["error"] for r in pallas)
    assert capsys.readouterr().out.count("FAILED: RuntimeError") == 6


@pytest.mark.parametrize("verify, kept", [(True, 8), (False, 1)])
def test_timing_loop_keeps_every_verify_call(verify, kept, monkeypatch):
    """A verify writes no state: unless `next_state` makes the next call depend on its o, XLA drops
    all but the last call of each loop iteration (run 121: the verify rows timed 1 kernel in 8)."""
    import jax.numpy as jnp
    xs_sets = (jnp.arange(kernels.LOOP_SETS * 6, dtype=jnp.float32).reshape(kernels.LOOP_SETS, 6),)
    state = jnp.ones((3, 3), jnp.float32)
    fn = lambda xs, s: (jnp.dot(xs[0].reshape(2, 3), s), s)     # noqa: E731  o only, as a verify
    if not verify:      # the loop without next_state's dependency: what it guards against
        monkeypatch.setattr(kernels, "next_state", lambda outs, state: outs[-1])
    run = kernels.chained_loop(fn, xs_sets, state, trips=2, unroll=8)
    hlo = run.lower(xs_sets, state).compile().as_text()
    assert hlo.count(" dot(") == kept               # a dot is not duplicated into fusions
    out = run(xs_sets, state)
    assert jnp.array_equal(out[-1], state)          # the dependency leaves a finite state unchanged


def test_variants_parse_and_reject():
    assert kernels.parse_variants("") == [{}]
    assert kernels.parse_variants("EXP2=False; EXP2=True,OWN_BARRIERS=True") == [
        {"EXP2": False}, {"EXP2": True, "OWN_BARRIERS": True}]
    with pytest.raises(ValueError, match="no setting 'EXP'"):
        kernels.parse_variants("EXP=True")
    with pytest.raises(ValueError, match="NAME=VALUE"):
        kernels.parse_variants("EXP2")
    with pytest.raises(ValueError, match="not a Python literal"):
        kernels.parse_variants("EXP2=yes")


def test_variant_settings_hold_while_traced_then_restore():
    """A variant's settings are what the kernel sees when traced, and the module's own afterwards."""
    from pallas_kernels import kda_step_fused
    before = kda_step_fused.EXP2
    seen = []
    fn = kernels.with_kernel_settings(lambda x: seen.append(kda_step_fused.EXP2) or x + 1,
                                      {"EXP2": not before})
    assert jax.jit(fn)(1) == 2 and seen == [not before]
    assert kda_step_fused.EXP2 == before
    labels = [label for label, _ in kernels.impls(kernels.CASES[1], 64, [None], False,
                                                   kernels.parse_variants("EXP2=False;EXP2=True"))]
    assert labels == ["xla kda_chunked", "pallas bv=32 EXP2=False", "pallas bv=32 EXP2=True"]
    labels = [label for label, _ in kernels.impls(kernels.CASES[1], 64, [None], False, [{}], xla=False)]
    assert labels == ["pallas bv=32"]


def test_kernels_no_xla_compares_with_the_first_kernel_row(tmp_path, capsys):
    """--no-xla: kernel rows only; the first is the base of the others' max|d.| (here the same
    kernel with another block_v: equal up to summation order)."""
    rec = kernels.main(BASE + ["--no-xla", "--cases", "verify9", "--block-v", "16,32", "--out", str(tmp_path)])
    rows = rec["rows"]
    assert [r["impl"] for r in rows] == ["pallas bv=16", "pallas bv=32"]
    assert rows[0]["max_abs_o"] is None and rows[1]["max_rel_o"] <= 1e-5
    assert all(r["rmse_o_f64"] <= 1e-5 for r in rows)


def test_kernels_bad_variant_flag(capsys):
    with pytest.raises(SystemExit) as e:
        kernels.main(BASE + ["--variants", "NOPE=1"])
    assert e.value.code == 2 and "--variants" in capsys.readouterr().err
