"""Shared test setup: float64 available everywhere (tests pass explicit dtypes), golden paths, and
compiled executables released after every test module."""
import gc
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's CPU thread pool: at least 8 threads (XLA reads NPROC; default one per core). Mosaic GPU
# interpret mode runs each warpgroup of a kernel that has several (kda_step_fused.PREP_WARPGROUPS)
# as a computation of its own that blocks in barrier-wait callbacks; on a 2-core host the third
# warpgroup never got a thread and the test hung (session 35).
os.environ.setdefault("NPROC", str(max(8, os.cpu_count() or 1)))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", True)
# float32 tests mean float32: no TF32 matmuls on GPU (the H200 default for f32 dots).
jax.config.update("jax_default_matmul_precision", "highest")

DATA = Path(__file__).parent / "data"
LING_TINY = DATA / "ling3-tiny"
DSPARK_TINY = DATA / "dspark-tiny"


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_executables():
    """XLA's CPU backend maps each compiled executable's code into memory regions of its own. One
    pytest process that keeps every executable of the suite alive (jit caches, cached models)
    gains hundreds of mappings per test (24,000 after the first 40 tests, measured) towards the
    kernel's limit of 65,530 (vm.max_map_count); CI's run segfaulted inside XLA's CPU compiler
    ~450 tests in, twice at the same test. Dropping jax's caches after each module keeps the
    count at what one module needs."""
    yield
    jax.clear_caches()
    gc.collect()


# ---- the extended tier ---------------------------------------------------------------------------
# Tests CI leaves out to stay within its 90 min limit (the whole suite took 91 min on a 2-core host
# like CI's, session 37): further cases of sweeps whose first cases CI runs, bench entry-point smokes
# whose paths other tests cover, and end-to-end repeats of a kernel switch under another setting.
# `./run.sh test` deselects them (-m "not extended"); `LINGJAX_TEST_ALL=1 ./run.sh test` runs them
# too. Entries are node ids under tests/; one without [params] covers every case of that test.
# Seconds on that host beside each (junit durations, session 37).
EXTENDED = [
    "test_bench_kernels.py::test_kernels_smoke",                                          # 638: every kernel row
    # (test_kernels_no_xla_compares_with_the_first_kernel_row runs the entry point in CI)
    "test_bench_kernel_parity.py::test_kernel_parity_tiny_interpret",                     # 356 (the *_kernel_switch tests cover it)
    "test_bench_kda_layer_timing.py::test_smoke_record",                                  # 180
    "test_bench_approx.py::test_approx_quality_smoke",                                    # 97
    "test_bench_batch1.py::test_batch1_smoke[dspark-3.0-4-bf16]",                         # 70 (dspark fp8 in CI)
    "test_bench_batch1.py::test_batch1_smoke[mtp-2.5-4-bf16]",                            # 60
    "test_bench_batch1.py::test_batch1_smoke[none-None-8-bf16]",                          # 55
    "test_bench_batch1.py::test_batch1_approx_row_sets_compiled_ahead",                   # 130
    "test_bench_batch1.py::test_batch1_profile_breakdown",                                # 109 (test_profile_breakdown in CI)
    "test_bench_batch1.py::test_batch1_several_rows_share_one_model",                     # 106
    "test_bench_batch1.py::test_batch1_fp8_draft",                                        # 67 (fp8 draft golden in CI)
    "test_kda_kernel_switch.py::test_engine_greedy_tokens_match[mtp]",                    # 223 ([plain] in CI)
    "test_kda_kernel_switch.py::test_window_from_kernel_gives_the_same_run",              # 102
    "test_kda_kernel_switch.py::test_state_in_place_gives_the_same_run",                  # 91
    "test_moe_kernel_switch.py::test_engine_greedy_mtp_tokens_match[fp8_shared]",         # 167 ([fp8] in CI)
    "test_moe_kernel_switch.py::test_decode_and_verify_logits_match[fp8_shared]",         # 92
    "test_moe_kernel_switch.py::test_bf16_model_verify[bf16_shared]",                     # 90
    "test_moe_kernel_switch.py::test_bf16_model_verify[bf16]",                            # 74 ([bf16_experts] in CI)
    "test_moe_kernel_switch.py::test_rank_selection_gives_the_same_run",                  # 56
    "test_dense_kernel_switch.py::test_decode_and_verify_logits_match[bf16_weights]",     # 45
    "test_approx.py::test_greedy_spec_equals_plain_under_mode[bf16_kda_state]",           # 53 ([all] in CI)
    "test_approx.py::test_greedy_spec_equals_plain_under_mode[bf16_router_head]",         # 50
    "test_approx.py::test_greedy_spec_equals_plain_under_mode[expert_keep]",              # 78
    "test_approx.py::test_greedy_spec_equals_plain_under_mode[fp8_mla_cache]",            # 45
    "test_approx.py::test_mode_changes_logits_within_bound[bf16_router_head]",            # 34
    "test_approx.py::test_mode_changes_logits_within_bound[expert_keep]",                 # 34
    "test_generate_cli.py::test_spec_methods_give_identical_greedy_tokens",               # 117 (test_spec_decode in CI)
    "test_spec_decode.py::test_dspark_greedy_equals_plain_golden[2-17]",                  # 24 ([1-16] [8-15] [8-33] in CI)
    "test_spec_decode.py::test_dspark_greedy_equals_plain_golden[5-33]",                  # 26
    "test_sampling.py::test_spec_sampling_is_lossless_end_to_end[none]",                  # 59
    "test_pallas_kda_prefill.py::test_debug_script_runs_in_interpret_mode",               # 50
    "test_pallas_moe_experts.py::test_timing_entry_point_sweep_with_shared_expert",       # 115
    "test_pallas_moe_experts.py::test_timing_entry_point_k_major_cpu_smoke[bf16]",        # 43
    "test_pallas_moe_experts.py::test_timing_entry_point_bf16_cpu_smoke",                 # 26
    "test_pallas_moe_experts.py::test_interpret_schedule_switches_match[1-4-1-True-True-A_REGS_LOAD-upcast2x-wgmma]",
    "test_pallas_moe_experts.py::test_interpret_schedule_switches_match[1-4-1-True-True-LATE_SCALE_WAITS-False-True]",
    "test_pallas_moe_experts.py::test_interpret_schedule_switches_match[3-2-2-False-False-A_REGS_LOAD-upcast2x-wgmma]",
    "test_pallas_moe_experts.py::test_interpret_schedule_switches_match[3-2-2-False-False-LATE_SCALE_WAITS-False-True]",
    "test_pallas_moe_experts.py::test_interpret_schedule_switches_match[9-1-1-False-False-A_REGS_LOAD-upcast2x-wgmma]",
    "test_pallas_moe_experts.py::test_interpret_schedule_switches_match[9-1-1-False-False-LATE_SCALE_WAITS-False-True]",
    # ^ 160 (both switches at M = 9 with the shared expert in CI)
    "test_pallas_moe_experts.py::test_interpret_async_schedule_matches[1-512-256-independent-4-2-None-True]",   # 26
    "test_pallas_moe_experts.py::test_interpret_async_schedule_matches[3-512-256-independent-2-1-None-True]",   # 46
    "test_pallas_moe_experts.py::test_interpret_k_minor_weights_match[1-independent-4-2-True-fp8]",            # 28
    "test_pallas_moe_experts.py::test_interpret_k_minor_weights_match[3-overlap-1-2-True-fp8]",                # 25
    "test_pallas_moe_experts.py::test_interpret_weights_in_act_match[1-4-1-True-fp8]",                         # 24
    "test_pallas_moe_experts.py::test_interpret_weights_in_act_match[3-2-2-False-bf16]",                       # 23
    "test_pallas_moe_experts.py::test_interpret_x_bound_matches_own_row_scaling[9-1-False]",                   # 25
    "test_pallas_moe_experts.py::test_interpret_shared_expert_slot[3-1-1-0.02-None-fp8]",                      # 17
    "test_pallas_kda_step_fused.py::test_interpret_window_output[3-2-True-True-bfloat16-8]",                   # 41
    "test_pallas_kda_step_fused.py::test_interpret_window_output[5-0-False-True-bfloat16-16]",                 # 22
    "test_pallas_kda_step_fused.py::test_interpret_warp_specialised_is_the_same_kernel[16-16-True-True-True-32-bfloat16-1]",
    "test_pallas_kda_step_fused.py::test_interpret_warp_specialised_is_the_same_kernel[16-16-True-True-True-32-bfloat16-2]",
    "test_pallas_kda_step_fused.py::test_interpret_warp_specialised_is_the_same_kernel[5-0-False-True-False-None-bfloat16-1]",
    "test_pallas_kda_step_fused.py::test_interpret_warp_specialised_is_the_same_kernel[5-0-False-True-False-None-bfloat16-2]",
]


def pytest_collection_modifyitems(config, items):
    """Mark the EXTENDED tests; an entry whose test was collected but not that case is an error
    (a renamed case must be renamed here too)."""
    collected = {item.nodeid.removeprefix("tests/").split("[")[0] for item in items}
    hit = set()
    for item in items:
        nodeid = item.nodeid.removeprefix("tests/")
        for entry in EXTENDED:
            if nodeid == entry or ("[" not in entry and nodeid.startswith(entry + "[")):
                item.add_marker(pytest.mark.extended)
                hit.add(entry)
    stale = [e for e in EXTENDED if e.split("[")[0] in collected and e not in hit]
    if stale:
        raise pytest.UsageError(f"conftest.EXTENDED names tests that were not collected: {stale}")
