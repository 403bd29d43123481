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
