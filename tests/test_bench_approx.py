"""CPU smoke test of bench/approx_quality.py with tiny settings: one table, one JSON record."""
import json

import pytest

from bench import approx_quality


def test_approx_quality_smoke(tmp_path, capsys):
    rec = approx_quality.main(["--modes", "none;bf16_kda_state", "--windows", "1", "--seq", "24", "--block", "4",
                               "--prompts", "1", "--prompt-len", "16", "--max-new", "8", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["mode", "golden", "rel", "err", "golden", "top-1", "bits/byte",
                                           "DSpark", "accept"]
    rows = {r["mode"]: r for r in rec["rows"]}
    assert list(rows) == ["none", "bf16_kda_state"]
    assert rows["none"]["golden_rel_err"] < 1e-4 and rows["none"]["golden_top1"] == 1.0   # exact path floor
    assert 0 < rows["bf16_kda_state"]["golden_rel_err"] < 1e-2
    for r in rows.values():
        assert 0 < r["bits_per_byte"] < 8 and 1 <= r["dspark_accept_length"] <= 9
    saved = list(tmp_path.glob("approx_quality-*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["rows"] == rec["rows"]


def test_approx_quality_rejects_bad_modes():
    with pytest.raises(SystemExit):
        approx_quality.main(["--modes", "none;fp16_everything"])
