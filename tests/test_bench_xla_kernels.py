"""bench/xla_kernels.py's HLO side: which instructions of a compiled generation loop are GPU kernels
of one step (the deviceless compile itself needs jax's CUDA plugin, not in CI)."""
import os

import pytest

from bench import xla_kernels

HLO = """HloModule jit__run, is_scheduled=true, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%fused_a (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p0), metadata={op_name="jit(_run)/while/body/kda/neg"}
}

%fused_b (p0.1: f32[4]) -> f32[4] {
  %p0.1 = f32[4]{0} parameter(0)
  ROOT %r = f32[4]{0} exponential(%p0.1), metadata={op_name="jit(_run)/while/body/draft/exp"}
}

%inner_body (t.1: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t.1 = (s32[], f32[4]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%t.1), index=0
  %v.1 = f32[4]{0} get-tuple-element(%t.1), index=1
  %f.3 = f32[4]{0} fusion(%v.1), kind=kLoop, calls=%fused_b, metadata={op_name="jit(_run)/while/body/draft/exp"}
  ROOT %o.1 = (s32[], f32[4]{0}) tuple(%i.1, %f.3)
}

%fused_lt (p0.2: s32[]) -> pred[] {
  %p0.2 = s32[] parameter(0)
  ROOT %lt.2 = pred[] compare(%p0.2, %p0.2), direction=LT, metadata={op_name="jit(_run)/while/body/draft/lt"}
}

%inner_cond (t.2: (s32[], f32[4])) -> pred[] {
  %t.2 = (s32[], f32[4]{0}) parameter(0)
  %i.2 = s32[] get-tuple-element(%t.2), index=0
  ROOT %f.2 = pred[] fusion(%i.2), kind=kLoop, calls=%fused_lt, metadata={op_name="jit(_run)/while/body/draft/lt"}
}

%command_buffer (p.9: f32[4]) -> f32[4] {
  %p.9 = f32[4]{0} parameter(0)
  ROOT %f.9 = f32[4]{0} fusion(%p.9), kind=kLoop, calls=%fused_a, metadata={op_name="jit(_run)/while/body/moe/neg"}
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[4]{0} get-tuple-element(%t), index=1
  %f.1 = f32[4]{0} fusion(%v), kind=kLoop, calls=%fused_a, metadata={op_name="jit(_run)/while/body/kda/neg"}
  %k.1 = f32[4]{0} custom-call(%f.1), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(_run)/while/body/kda/mpmd_map"}
  %cb.1 = f32[4]{0} call(%k.1), to_apply=%command_buffer
  %c.1 = f32[4]{0} copy(%cb.1), metadata={op_name="jit(_run)/while/body/commit/copy"}
  %b.1 = f32[4]{0} bitcast(%c.1)
  %tt = (s32[], f32[4]{0}) tuple(%i, %b.1)
  %w.1 = (s32[], f32[4]{0}) while(%tt), condition=%inner_cond, body=%inner_body
  ROOT %out = (s32[], f32[4]{0}) tuple(%i, %b.1)
}

%cond (t.3: (s32[], f32[4])) -> pred[] {
  %t.3 = (s32[], f32[4]{0}) parameter(0)
  %i.3 = s32[] get-tuple-element(%t.3), index=0
  ROOT %lt.3 = pred[] compare(%i.3, %i.3), direction=LT
}

ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %f.0 = f32[4]{0} fusion(%p), kind=kLoop, calls=%fused_a, metadata={op_name="jit(_run)/kda/neg"}
  %z = s32[] constant(0)
  %init = (s32[], f32[4]{0}) tuple(%z, %f.0)
  %w = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body
  ROOT %res = f32[4]{0} get-tuple-element(%w), index=1
}
"""


def test_step_kernels_walks_the_outer_loop_body():
    """Fusions, custom calls and copies of the loop body, in order, through command-buffer calls and
    into a nested loop (its condition's kernel too; marked nested); bitcasts, tuples and the ENTRY
    computation's fusion are not counted."""
    got = [(k["name"], k["opcode"], k["target"], k["component"], k["nested"]) for k in xla_kernels.step_kernels(HLO)]
    assert got == [("f.1", "fusion", "", "kda", False),
                   ("k.1", "custom-call", "mosaic_gpu_v2", "kda", False),
                   ("f.9", "fusion", "", "moe", False),
                   ("c.1", "copy", "", "commit", False),
                   ("f.2", "fusion", "", "draft", True),
                   ("f.3", "fusion", "", "draft", True)]


def test_summary_counts_per_component():
    s = xla_kernels.summary(xla_kernels.step_kernels(HLO))
    assert s["total"] == {"kernels": 6, "mosaic": 1, "nested": 2, "remat": 0}
    assert s["components"]["kda"] == {"kernels": 2, "mosaic": 1, "nested": 0, "remat": 0}
    assert s["components"]["draft"]["nested"] == 2


def test_refuses_hlo_without_a_loop():
    with pytest.raises(ValueError, match="no while loop"):
        xla_kernels.step_kernels(HLO.split("%body (")[0] + "ENTRY %main (p: f32[4]) -> f32[4] {\n"
                                 "  ROOT %p = f32[4]{0} parameter(0)\n}\n")


def test_the_target_config_describes_an_h200():
    cfg = xla_kernels.H200_TARGET_CONFIG
    assert "core_count: 132" in cfg and "cuda_compute_capability { major: 9 }" in cfg and '"NVIDIA H200"' in cfg


def test_without_a_cuda_plugin_it_says_what_to_install(capsys, monkeypatch):
    if _has_cuda_plugin():
        pytest.skip("this jax has a CUDA plugin: the deviceless compile would run")
    for var in ("XLA_FLAGS", "JAX_PLATFORMS"):     # main() sets them for its own process: restore after
        monkeypatch.setenv(var, os.environ.get(var, ""))
    with pytest.raises(SystemExit) as e:
        xla_kernels.main(["--layers", "1"])
    assert e.value.code == 2
    assert "jax[cuda13]" in capsys.readouterr().err


def _has_cuda_plugin() -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec("jax_plugins") is not None and any(
            importlib.util.find_spec(f"jax_plugins.{m}") is not None for m in ("xla_cuda13", "xla_cuda12"))
    except ModuleNotFoundError:
        return False


@pytest.mark.parametrize("argv,msg", [(["--memory-gib", "0"], "--memory-gib must be > 0"),
                                      (["--target-config", "/nonexistent/h200.txtpb"], "--target-config"),
                                      (["--layers", "0"], "--layers and --block-size")])
def test_bad_arguments_exit_2_with_the_reason(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        xla_kernels.main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err
