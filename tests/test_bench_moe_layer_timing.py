"""bench/moe_layer_timing.py: a CPU smoke run with its kernel table, the HLO summary, bad flags."""
import pytest

from bench import moe_layer_timing

HLO = """HloModule m

%fused_computation (p0: f32[4], p1: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  %p1 = f32[4]{0} parameter(1)
  %n = f32[4]{0} negate(%p0), metadata={op_name="jit(f)/route/neg"}
  ROOT %a = f32[4]{0} add(%n, %p1), metadata={op_name="jit(f)/route/add"}
}

ENTRY %main (x: f32[4], y: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %y = f32[4]{0} parameter(1)
  ROOT %loop_add_fusion = f32[4]{0} fusion(%x, %y), kind=kLoop, calls=%fused_computation
}
"""


def test_fusion_summary_names_ops_and_sources():
    what = moe_layer_timing.fusion_summary(HLO)["loop_add_fusion"]
    ops, srcs = what.split(" | ")
    assert set(ops.split()) == {"negate", "add"}
    assert srcs == "route/add, route/neg"


def test_smoke_with_kernel_table(tmp_path):
    rec = moe_layer_timing.main(["--tiny", "--M", "1", "--iters", "1", "--layers", "1", "--moe-kernel", "xla",
                                 "--profile", str(tmp_path / "prof"), "--out", str(tmp_path)])
    (row,) = rec["rows"]
    assert rec["smoke"] and row["M"] == 1 and row["moe_kernel"] == "xla" and row["layer_us"] > 0
    assert row["kernels"] and any("dot" in k["what"] for k in row["kernels"])


@pytest.mark.parametrize("argv", [["--M", "0"], ["--M", "17"], ["--iters", "0"], ["--layers", "0"]])
def test_bad_flags(argv, capsys):
    with pytest.raises(SystemExit) as e:
        moe_layer_timing.main(argv)
    assert e.value.code == 2 and "--M needs" in capsys.readouterr().err


def test_bad_kernel_name(capsys):
    with pytest.raises(SystemExit) as e:
        moe_layer_timing.main(["--moe-kernel", "triton"])
    assert e.value.code == 2 and "--moe-kernel" in capsys.readouterr().err
