"""bench/router_timing.py as a CPU smoke run: every router selection runs and agrees with the sorted one; bad flags."""
import pytest

from bench import router_timing
from lingjax.ops import moe


def test_smoke_rows_agree(tmp_path):
    before = moe.SORT_FREE_MAX_ROWS
    rec = router_timing.main(["--M", "1,3", "--iters", "1", "--out", str(tmp_path)])
    assert [r["M"] for r in rec["rows"]] == [1, 3] and rec["smoke"]
    assert all(r["same_routing"] for r in rec["rows"])
    assert moe.SORT_FREE_MAX_ROWS == before                         # the bench leaves the model switch alone


@pytest.mark.parametrize("argv", [["--M", "0"], ["--M", "17"], ["--iters", "0"]])
def test_bad_flags(argv, capsys):
    with pytest.raises(SystemExit) as e:
        router_timing.main(argv)
    assert e.value.code == 2 and "--M needs" in capsys.readouterr().err
