"""bench.with_settings: module settings applied before a module runs; bad settings refused."""
import sys

import pytest

from bench import with_settings


def test_apply_sets_an_existing_setting(monkeypatch):
    import pallas_kernels.moe_experts as m
    monkeypatch.setattr(m, "LATE_SCALE_WAITS", m.LATE_SCALE_WAITS)      # restored after the test
    line = with_settings.apply("pallas_kernels.moe_experts:LATE_SCALE_WAITS=False")
    assert m.LATE_SCALE_WAITS is False and "LATE_SCALE_WAITS = False" in line


@pytest.mark.parametrize("spec,msg", [("pallas_kernels.moe_experts:NO_SUCH=1", "no setting"),
                                      ("pallas_kernels.moe_experts:LATE_SCALE_WAITS=maybe", "literal"),
                                      ("pallas_kernels.moe_experts", "form")])
def test_apply_refuses_bad_settings(spec, msg):
    with pytest.raises(SystemExit, match=msg):
        with_settings.apply(spec)


def test_main_runs_the_module_after_the_settings(monkeypatch, capsys, tmp_path):
    import lingjax.model.dspark as d
    monkeypatch.setattr(d, "ATTENTION_KERNEL", True)
    mod = tmp_path / "probe_with_settings.py"
    mod.write_text("import sys\nimport lingjax.model.dspark as d\nprint('seen', d.ATTENTION_KERNEL, sys.argv[1:])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    with_settings.main(["lingjax.model.dspark:ATTENTION_KERNEL=False", "-m", "probe_with_settings", "--x", "1"])
    out = capsys.readouterr().out
    assert "seen False ['--x', '1']" in out


def test_main_without_a_module_prints_usage(capsys):
    with pytest.raises(SystemExit) as e:
        with_settings.main(["pallas_kernels.moe_experts:LATE_SCALE_WAITS=True"])
    assert e.value.code == 2 and "package.module:NAME=VALUE" in capsys.readouterr().out
