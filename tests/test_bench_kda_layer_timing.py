"""bench.kda_layer_timing on the CPU: a smoke record (not a timing) and its argument checks."""
import pytest

from bench import kda_layer_timing


def test_smoke_record(tmp_path):
    rec = kda_layer_timing.main(["--tiny", "--M", "1,3", "--iters", "1", "--layers", "1", "--dense-kernel", "xla",
                                 "--kda-kernel", "xla,pallas", "--commit", "2", "--out", str(tmp_path)])
    assert rec["bench"] == "kda_layer_timing" and rec["smoke"] and rec["preset"] == "ling3-tiny"
    assert rec["dtype"] == "fp8" and rec["commit"] == 2 and rec["kda_kernels"] == ["xla", "pallas"]
    assert [(r["kda_kernel"], r["M"], r["call"]) for r in rec["rows"]] == [
        ("xla", 1, "decode"), ("xla", 3, "verify+commit2"), ("pallas", 1, "decode"), ("pallas", 3, "verify+commit2")]
    assert all(r["bytes"] > 0 and r["raw_us"] > 0 for r in rec["rows"])


@pytest.mark.parametrize("argv, msg", [
    (["--M", "0"], "--M needs"), (["--M", "17"], "--M needs"), (["--iters", "0"], "--M needs"),
    (["--layers", "0"], "--M needs"), (["--kda-kernel", "triton"], "--kda-kernel must be"),
    (["--kda-kernel", ""], "--kda-kernel at least"), (["--M", "1", "--commit", "1"], "needs a verify row"),
    (["--M", "1,4", "--commit", "5"], "must be in 0..M"), (["--copy-bw", "0"], "--copy-bw"),
])
def test_rejects_bad_arguments(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        kda_layer_timing.main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_time_layer_row_with_a_profile(tmp_path):
    """bench.kernel_table.time_layer (the layer benchmarks' shared row) on a toy layer with a
    carried state: the timing fields, and with profile_dir the kernel table with the layer's dot."""
    import jax.numpy as jnp
    from jax import lax

    from bench.kernel_table import time_layer

    def f(x, w, cache):
        return x @ w, lax.dynamic_update_slice_in_dim(cache, x, 3, axis=0)
    sets = [(jnp.ones((2, 64), jnp.float32), jnp.ones((64, 64), jnp.float32), jnp.zeros((16, 64), jnp.float32))]
    row = time_layer(f, sets, 2, carry_last=True, profile_dir=tmp_path / "prof")
    assert row["raw_us"] > 0 and row["loop_overhead_us"] > 0
    assert row["layer_us"] == pytest.approx(row["raw_us"] - row["loop_overhead_us"])
    assert row["kernels"] and any("dot" in r["what"] for r in row["kernels"])
    assert "kernels" not in time_layer(f, sets, 1, carry_last=True)
