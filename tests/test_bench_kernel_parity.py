"""CPU smoke test of bench/kernel_parity.py (kernels in Mosaic GPU interpret mode, tiny widths)."""
import json

import pytest

from bench import kernel_parity


def test_kernel_parity_tiny_interpret(tmp_path, capsys):
    rec = kernel_parity.main(["--tiny", "--interpret", "--layers", "4", "--input-len", "24", "--output-len", "6",
                              "--block-size", "3", "--spec", "mtp", "--kernels", "kda,moe,dense,mla",
                              "--out", str(tmp_path)])
    assert rec["failures"] == [] and set(rec["greedy"]) == {"none", "mtp"}       # plain added as reference
    assert rec["greedy"]["mtp"]["vs_plain_under_kernels"]["identical"] and rec["greedy"]["none"]["tokens"] == 6
    assert rec["xla_self"]["greedy_vs_sequence_argmax_differences"] == 0          # the row indexing lines up
    assert rec["xla_self"]["median_top2_margin_sd"] > 0 and rec["xla_self"]["tie_tolerance_sd"] == 0.05
    for name, r in rec["forward"].items():     # the kernels ran (bf16 rounding differs) and stay close
        assert 0 < r["median_position_rel_error"] < 0.05, (name, r)
    saved = json.loads(open(rec["result_path"]).read())
    assert saved["kernels"] == ["kda", "moe", "dense", "mla"] and "env" in saved
    assert "== kernel parity" in capsys.readouterr().out


@pytest.mark.parametrize("extra,msg", [(["--kernels", "kda,flash"], "--kernels"), (["--spec", "eagle"], "--spec"),
                                       (["--output-len", "1"], "--output-len >= 2"),
                                       (["--router-bias-sd", "-1"], "must be >= 0")])
def test_kernel_parity_bad_flags(capsys, extra, msg):
    with pytest.raises(SystemExit) as e:
        kernel_parity.main(["--tiny", "--interpret"] + extra)
    assert e.value.code == 2 and msg in capsys.readouterr().err
