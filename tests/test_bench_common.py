"""bench/common.py's in-loop timing: every call stays inside the loop (none hoisted, merged or
dropped), and bench.batch1's copy-bandwidth probe runs in place."""
import re

import jax
import jax.numpy as jnp

from bench.batch1 import measure_copy_bandwidth
from bench.common import LOOP_SMOKE, loop_overhead, loop_program, time_in_loop


def _sets(n):
    return [(jnp.full((4, 256), j + 1.0, jnp.bfloat16), jnp.ones((256, 512), jnp.bfloat16)) for j in range(n)]


def _body_and_entry(text: str):
    comps = re.split(r"\n(?=\S)", text)
    entry = next(c for c in comps if c.startswith("ENTRY"))
    while_line = next(line for line in entry.splitlines() if " while(" in line)
    body_name = re.search(r"body=%?([^\s,]+)", while_line).group(1)
    body = next(c for c in comps if c.lstrip("%").startswith(body_name + " "))
    return body, entry


def _called(comp: str, comps_text: str) -> int:
    """Dots inside comp, directly or in the fusions it calls."""
    n = comp.count(" dot(")
    for callee in re.findall(r"calls=%?([^\s,]+)", comp):
        fused = next((c for c in re.split(r"\n(?=\S)", comps_text) if c.lstrip("%").startswith(callee + " ")), "")
        n += fused.count(" dot(")
    return n


def test_every_call_stays_in_the_loop():
    """8 calls per iteration over 3 argument sets (3 distinct (x, w) pairs, so 5 calls repeat an
    earlier one's arrays): all 8 dots are in the while body, none in the entry computation."""
    sets = _sets(3)
    run, n_calls = loop_program(lambda x, w: x @ w, len(sets), iters=4, per_iter=8)
    assert n_calls == 8
    text = run.lower(sets).compile().as_text()
    body, entry = _body_and_entry(text)
    assert _called(body, text) == 8
    assert _called(entry, text) == 0
    out = run(sets)
    assert len(out) == 8 and all(o.shape == (4, 512) for o in out)
    assert float(out[0][0, 0]) == 256.0 and float(out[1][0, 0]) == 512.0   # x = j + 1 times 256 ones


def test_x_independent_work_stays_in_the_loop():
    """A call whose weight is dequantised inside it (work that does not depend on x): the
    dequantisation runs in the loop, not once before it (XLA hoisted it before the barrier)."""
    sets = [(jnp.full((4, 256), j + 1.0, jnp.bfloat16), jnp.ones((256, 512), jnp.float8_e4m3fn),
             jnp.full((2, 4), 0.5, jnp.float32)) for j in range(2)]

    def f(x, w, s):
        scale = jnp.repeat(jnp.repeat(s, 128, 0), 128, 1)
        return x @ (w.astype(jnp.float32) * scale).astype(jnp.bfloat16)
    run, _ = loop_program(f, len(sets), iters=2, per_iter=4)
    text = run.lower(sets).compile().as_text()
    body, entry = _body_and_entry(text)
    weight_ops = [line for line in entry.splitlines()[1:] if "[256,512]" in line and "parameter(" not in line
                  and " while(" not in line and "tuple(" not in line]
    assert weight_ops == [], weight_ops
    assert float(run(sets)[0][0, 0]) == 128.0


def test_first_argument_must_be_floating():
    import pytest
    with pytest.raises(TypeError, match="floating"):
        time_in_loop(lambda i, w: w, [(jnp.ones((2,), jnp.int32), jnp.ones((2,)))], iters=1, **LOOP_SMOKE)


def test_loop_fields():
    from bench.common import loop_fields
    ok = loop_fields("kernel", 30e-6, 2e-6, 1e8, 4e12)
    assert ok["kernel_loop_us"] == pytest_approx(28.0) and ok["kernel_pct_4p3"] == pytest_approx(100 * 1e8 / 28e-6 / 4.3e12)
    bad = loop_fields("kernel", 2.1e-6, 2e-6, 1e8, 4e12)
    assert "kernel_loop_us" not in bad and "not resolvable" in bad["kernel_loop_error"]


def pytest_approx(v):
    import pytest
    return pytest.approx(v)


def test_more_sets_than_per_iter_and_positive_times():
    sets = _sets(10)
    run, n_calls = loop_program(lambda x, w: x @ w, len(sets), iters=2, per_iter=8)
    assert n_calls == 10
    assert time_in_loop(lambda x, w: x @ w, sets, iters=2, **LOOP_SMOKE) > 0
    assert loop_overhead(sets, iters=2, **LOOP_SMOKE) > 0


def test_copy_probe_runs_in_place():
    bw = measure_copy_bandwidth(4 << 20, repeats=2, chain=3)
    assert bw > 0 and bw == bw


def test_choice_list(capsys):
    import argparse

    import pytest

    from bench.common import choice_list
    ap = argparse.ArgumentParser()
    assert choice_list(ap, "serial, async", "--x", ("serial", "async")) == ["serial", "async"]
    assert choice_list(ap, "", "--x", ("serial",)) == []
    for bad in ("serial,serial", "fast"):
        with pytest.raises(SystemExit):
            choice_list(ap, bad, "--x", ("serial", "async"))
        assert "--x must be a comma list of distinct serial, async" in capsys.readouterr().err


def test_carry_last_carries_each_calls_state():
    """carry_last: f's last argument is carried from iteration to iteration, one copy per call
    (3 iterations x 4 calls over 2 sets: each call's counter ends at 3, the sets' own stay 0)."""
    sets = [(jnp.full((2,), j + 1.0), jnp.zeros((3,), jnp.int32)) for j in range(2)]
    run, n_calls = loop_program(lambda x, s: (2 * x, s + 1), len(sets), iters=3, per_iter=4, carry_last=True)
    out = run(sets)
    assert n_calls == 4 and [o[1].tolist() for o in out] == [[3, 3, 3]] * 4
    assert [float(o[0][0]) for o in out] == [2.0, 4.0, 2.0, 4.0] and sets[0][1].tolist() == [0, 0, 0]
    assert loop_overhead(sets, 2, carry_last=True, **LOOP_SMOKE) > 0
    import pytest
    with pytest.raises(TypeError, match="new_state"):
        time_in_loop(lambda x, s: x, sets, iters=1, carry_last=True, **LOOP_SMOKE)
