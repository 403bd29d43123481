"""CPU smoke test of bench/batch1.py on the tiny random config (no speed numbers asserted) and of
the bytes-per-step model in bench/roofline.py."""
import json
import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from bench import batch1, roofline
from lingjax.config import LingConfig, preset
from lingjax.model.ling import LingModel
from conftest import LING_TINY

BASE = ["--tiny", "--layers", "4", "--input-len", "32", "--output-len", "16", "--num-prompts", "2", "--no-xla-defaults",
        "--copy-mib", "8"]
KEYS = {"ttft_ms", "tpot_ms", "itl_ms", "output_throughput_tok_s", "accept_length", "accept_per_position",
        "peak_device_bytes", "roofline", "ms_per_step", "ms_per_layer_step", "flags"}


@pytest.mark.parametrize("spec,tau,block,dtype", [("none", None, 8, "bf16"), ("mtp", 2.5, 4, "bf16"),
                                                   ("dspark", 3.0, 4, "bf16"), ("dspark", 3.0, 4, "fp8")])
def test_batch1_smoke(tmp_path, capsys, spec, tau, block, dtype):
    argv = BASE + ["--spec", spec, "--block-size", str(block), "--out", str(tmp_path), "--dtype", dtype]
    if tau is not None:
        argv += ["--forced-accept", str(tau)]
    rec = batch1.main(argv)
    assert KEYS <= set(rec)
    saved = json.loads(open(rec["result_path"]).read())
    assert KEYS | {"env"} <= set(saved) and saved["spec"] == spec
    assert saved["env"]["git_commit"] is not None and "jax" in saved["env"]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last)["bench"] == "batch1"
    for k in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert all(v > 0 and math.isfinite(v) for v in rec[k].values())
    assert rec["output_throughput_tok_s"] > 0
    assert rec["total_output_tokens"] == 2 * 16
    expect = tau if tau is not None else 1.0
    assert abs(rec["accept_length"] - expect) <= 0.5
    assert len(rec["accept_per_position"]) == (0 if spec == "none" else block)
    assert 0 < rec["roofline"]["fraction"] < 1e3


@pytest.mark.parametrize("extra,msg", [
    (["--input-len", "4090", "--output-len", "16", "--spec", "dspark"], "exceeds the context"),
    (["--spec", "dspark", "--block-size", "4", "--forced-accept", "6"], "outside 1..block+1"),
    (["--spec", "mtp", "--forced-accept", "0.5"], "outside 1..block+1"),
    (["--spec", "none,eagle"], "expected none, mtp, dspark"),
    (["--spec", "none", "--profile-spec", "none"], "needs --profile"),
    (["--spec", "none", "--profile-prefill"], "needs --profile"),
    (["--spec", "none", "--profile", "p", "--profile-spec", "dspark"], "only methods given to --spec"),
    (["--approx", "none", "--approx", "off"], "the same modes twice"),
    (["--approx", "bf16_kda_state", "--approx", "fp16_all"], "unknown approx mode"),
    (["--compile-workers", "0"], "--compile-workers must be >= 1"),
    (["--pdl", "prefetch"], "give at least one --*-kernel pallas"),
    (["--pdl", "always"], "invalid choice"),
    (["--spec", "none", "--draft-dtype", "fp8"], "only used with --spec dspark"),
    (["--spec", "dspark", "--draft-dtype", "fp4"], "invalid choice"),
])
def test_batch1_bad_flags(capsys, extra, msg):
    with pytest.raises(SystemExit) as e:
        batch1.main(BASE + extra)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_batch1_several_rows_share_one_model(tmp_path, capsys):
    rec = batch1.main(BASE + ["--spec", "none,dspark", "--block-size", "4", "--forced-accept", "1,3",
                              "--out", str(tmp_path), "--dtype", "fp8"])
    rows = rec["rows"]
    assert [(r["spec"], r["forced_accept"]) for r in rows] == [("none", None), ("dspark", 1.0), ("dspark", 3.0)]
    assert [round(r["accept_length"]) for r in rows] == [1, 1, 3]
    assert [r["draft_pass_in_step"] for r in rows] == [False, True, True]
    assert len(list(tmp_path.glob("batch1-*.json"))) == 3
    assert "== summary ==" in capsys.readouterr().out


def test_batch1_approx_row_sets_compiled_ahead(tmp_path, capsys):
    """Two --approx row sets x two methods on one model, their programs compiled ahead in 2 threads."""
    rec = batch1.main(BASE + ["--spec", "none,dspark", "--block-size", "4", "--forced-accept", "3",
                              "--approx", "none", "--approx", "bf16_kda_state,expert_keep=0.5",
                              "--compile-workers", "2", "--num-prompts", "1", "--out", str(tmp_path)])
    rows = rec["rows"]
    assert [(r["approx"], r["spec"]) for r in rows] == [
        ("none", "none"), ("none", "dspark"),
        ("expert_keep=0.5,bf16_kda_state", "none"), ("expert_keep=0.5,bf16_kda_state", "dspark")]
    assert [round(r["accept_length"]) for r in rows] == [1, 3, 1, 3]
    names = sorted(p.name.split("-2026")[0].split("-20")[0] for p in tmp_path.glob("batch1-*.json"))
    assert len(names) == 4 and sum("approx-expert_keep=0.5-bf16_kda_state" in n for n in names) == 2
    out = capsys.readouterr().out
    assert "[compile ahead] 4 prefill + loop pairs" in out and "(compile)" not in out
    saved = json.loads(open(rows[2]["result_path"]).read())
    assert saved["flags"]["approx"] == ["none", "expert_keep=0.5,bf16_kda_state"]


def test_batch1_compile_only_fills_the_persistent_cache(tmp_path):
    """--compile-only compiles ahead and exits; a second process then finds the programs in the
    persistent compilation cache (the plan for full-depth kernel rows split over device calls)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).parent.parent
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(root),
           "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    argv = [sys.executable, "-m", "bench.batch1"] + BASE + ["--num-prompts", "1", "--spec", "dspark",
                                                           "--forced-accept", "3", "--block-size", "4",
                                                           "--out", str(tmp_path / "res")]
    first = subprocess.run(argv + ["--compile-only"], capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "[compile ahead] 1 prefill + loop pairs" in first.stdout and not (tmp_path / "res").exists()
    cached = set(os.listdir(tmp_path / "cache"))
    assert cached
    second = subprocess.run(argv + ["--compile-workers", "2"], capture_output=True, text=True, timeout=300,
                            cwd=root, env=env)
    assert second.returncode == 0, second.stderr[-2000:]
    assert json.loads(second.stdout.strip().splitlines()[-1])["bench"] == "batch1"
    def programs(names):       # cache entries are named <jitted function>-<key hash>
        return {n for n in names if n.startswith(("jit__prefill-", "jit__run-"))}
    assert len(programs(cached)) == 2                                   # the prefill and the loop
    assert programs(os.listdir(tmp_path / "cache")) == programs(cached)  # the run loaded both


def test_batch1_profile_breakdown(tmp_path, capsys):
    """--profile traces one more request per row of the --profile-spec methods and attributes its
    device time to components."""
    rec = batch1.main(BASE + ["--spec", "none,dspark", "--block-size", "4", "--forced-accept", "3", "--out",
                              str(tmp_path), "--profile", str(tmp_path / "prof"), "--profile-tokens", "8",
                              "--profile-spec", "dspark", "--profile-prefill"])
    plain, spec = rec["rows"]
    assert "profile" not in plain and not (tmp_path / "prof" / "none").exists()
    prof = spec["profile"]
    assert prof["steps"] >= 2
    for comp in ("kda", "mla", "moe", "draft", "lm_head"):
        assert prof["total_us"][comp] > 0, comp
    assert (tmp_path / "prof" / "dspark-tau3" / "run.hlo.txt").exists()
    pre = prof["prefill"]                       # --profile-prefill: the TTFT's breakdown
    assert pre["wall_ms"] > 0 and pre["steps"] is None
    for comp in ("kda", "mla", "moe", "embed"):
        assert pre["total_us"][comp] > 0, comp
    assert (tmp_path / "prof" / "dspark-tau3" / "prefill" / "prefill.hlo.txt").exists()
    out = capsys.readouterr().out
    assert "kda" in out and "traced without CUDA graphs" in out


def test_batch1_embedded_model_smoke(tmp_path):
    """The benchmark on the embedded default model and its trained draft (natural acceptance)."""
    rec = batch1.main(["--embedded", "--input-len", "48", "--output-len", "24", "--num-prompts", "1", "--spec",
                       "none,dspark", "--out", str(tmp_path), "--no-xla-defaults", "--copy-mib", "8"])
    none, dspark = rec["rows"]
    assert none["model"] == "embedded" and none["accept_length"] == 1.0
    assert dspark["accept_length"] >= 1.0 and len(dspark["accept_per_position"]) == 8
    assert all(r["total_output_tokens"] == 24 for r in (none, dspark))


def test_batch1_fp8_draft(tmp_path):
    """--draft-dtype fp8: the random draft is built with its projections in block fp8, the run
    completes, and the roofline counts those projections' bytes as fp8 (less than a bf16 draft's)."""
    from lingjax.config import LingConfig
    rec = batch1.main(BASE + ["--spec", "dspark", "--forced-accept", "3", "--draft-dtype", "fp8",
                              "--out", str(tmp_path)])
    row = rec                                               # one row: the record itself
    assert row["flags"]["draft_dtype"] == "fp8" and row["accept_length"] > 1.0
    cfg = LingConfig.from_json(batch1.TINY_CONFIG).replace(num_hidden_layers=4)
    dcfg = batch1.draft_config_for(cfg, 8)
    ctx = 32 + 16 / 2                                       # input + half the output
    fp8 = roofline.step_bytes(cfg, "bf16", "dspark", 8, ctx, dcfg, draft_dtype="fp8").draft
    bf16 = roofline.step_bytes(cfg, "bf16", "dspark", 8, ctx, dcfg).draft
    assert row["roofline"]["bytes_breakdown"]["draft"] == pytest.approx(fp8) and fp8 < bf16


def test_batch1_fp8_needs_an_fp8_ready_checkpoint(capsys):
    with pytest.raises(SystemExit) as e:
        batch1.main(["--checkpoint", str(LING_TINY), "--dtype", "fp8", "--input-len", "32", "--output-len", "8", "--no-xla-defaults"])
    assert e.value.code == 2
    assert "converted checkpoints only" in capsys.readouterr().err


def test_batch1_dspark_checkpoint_needs_draft(capsys):
    with pytest.raises(SystemExit) as e:
        batch1.main(["--checkpoint", str(LING_TINY), "--spec", "dspark", "--no-xla-defaults"])
    assert e.value.code == 2
    assert "--draft" in capsys.readouterr().err


def test_accept_pattern_mean():
    for tau in (1.0, 1.5, 2.5, 3.3, 9.0):
        p = batch1.accept_pattern(tau)
        assert abs(sum(p) / len(p) - (tau - 1)) < 0.02
        assert set(p) <= {math.floor(tau - 1), math.ceil(tau - 1)}


@pytest.mark.parametrize("cfg", [LingConfig.from_json(LING_TINY / "config.json"),
                                 preset("ling3-flash").replace(num_hidden_layers=7)])
def test_roofline_param_count_matches_model(cfg):
    for mtp in (False, True):
        m = nnx.eval_shape(lambda: LingModel(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), with_mtp=mtp))
        n = sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
        assert n == roofline.param_count(cfg, mtp)


def test_roofline_flash_numbers():
    cfg = preset("ling3-flash")
    one = roofline.step_bytes(cfg, "bf16", "none", context=9216)
    assert 9.5e9 < one.weights < 11e9             # ~5.1B active params in bf16
    assert abs(one.experts_per_layer - 8) < 1e-9
    spec = roofline.step_bytes(cfg, "bf16", "dspark", 8, 9216, batch1.draft_config_for(cfg, 8))
    assert spec.tokens == 9 and spec.total > one.total and spec.draft > 0
    half = roofline.step_bytes(cfg.replace(num_hidden_layers=21), "bf16", "none", context=9216)
    assert half.weights < 0.6 * one.weights
    # the draft's projections in fp8 (quantize_draft): 1.17 GB of bf16 layer / fc / context k-v
    # weights and 8 x 80 MB of markov_w2 reads, halved; the target's part is unchanged
    spec8 = roofline.step_bytes(cfg, "fp8", "dspark", 8, 9216, batch1.draft_config_for(cfg, 8), draft_dtype="fp8")
    spec16 = roofline.step_bytes(cfg, "fp8", "dspark", 8, 9216, batch1.draft_config_for(cfg, 8))
    assert spec8.weights == spec16.weights and spec16.draft == spec.draft
    assert 0.88e9 < spec16.draft - spec8.draft < 0.93e9


def test_mesh_random_weights_created_in_shards(tmp_path):
    """--mesh on 2 forced CPU devices: weights built shard by shard, programs compiled ahead (each loop
    after its prefill: the loop's input shardings), the run completes."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).parent.parent
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(root),
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    r = subprocess.run([sys.executable, "-m", "bench.batch1", "--tiny", "--input-len", "32", "--output-len", "8",
                        "--num-prompts", "1", "--spec", "dspark", "--forced-accept", "3", "--mesh", "tp=2",
                        "--compile-workers", "2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    assert rec["env"]["n_devices"] == 2 and abs(rec["accept_length"] - 3.0) <= 0.5
    assert "[compile ahead] 1 prefill + loop pairs" in r.stdout
