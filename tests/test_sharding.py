"""lingjax.sharding: rules and errors in-process; multi-device checks in a subprocess with 4 forced
host CPU devices (tests/sharding_check.py), since this process already initialised jax.

Golden tiny model (2 heads, 16 experts) + tiny DSpark draft on meshes (tp, ep) = 1x1, 2x1, 1x2, 2x2:
prefill logits vs one device (<= 1e-5 relative, float32), greedy DSpark and plain decoding
token-identical, params really sharded (spec + per-device shard shapes), the decode state keeping
`state_shardings` after prefill and after the loop, and the collectives of one compiled decode step
per block. tp=4 cannot divide the golden model's 2 heads: a clear error; the 4x1 mesh runs on a
random 4-head config instead. Also: bytes each device reads in a sharded restore of a converted
checkpoint (2x1, 1x2, 2x2; tp=4 on a random 4-head checkpoint; an old, size-only chunking), and a
block-fp8 model on 2x2 (tokens, collectives).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from helpers import golden_model
from lingjax import sharding
from lingjax.cache import init_cache

HERE = Path(__file__).parent


def test_logical_to_spec_rules():
    assert sharding.logical_to_spec(("embed", None, "heads", "head_dim")) == P(None, None, "tp", None)
    # MLP intermediates (dense, shared, routed experts) over ep*tp; the expert axis stays whole
    assert sharding.logical_to_spec(("experts", "embed", None, "mlp")) == P(None, None, None, ("ep", "tp"))
    assert sharding.logical_to_spec(("experts", "mlp"), {"experts": "ep", "mlp": ("ep", "tp")}) == P("ep", "tp")
    assert sharding.logical_to_spec(("vocab", "embed")) == P("tp", None)
    assert sharding.logical_to_spec(("latent", None)) == P(None, None)
    # a mesh axis is used at most once per array
    assert sharding.logical_to_spec(("heads", "vocab")) == P("tp", None)
    assert sharding.logical_to_spec(("heads", "mlp")) == P("tp", "ep")   # what is left of ('ep', 'tp')
    assert sharding.logical_to_spec(("heads",), {"heads": None}) == P(None)


def test_parse_mesh():
    assert sharding.parse_mesh("tp=4") == (4, 1)
    assert sharding.parse_mesh("tp=2,ep=2") == (2, 2)
    assert sharding.parse_mesh("2x4") == (4, 2)
    assert sharding.parse_mesh("8") == (8, 1)
    with pytest.raises(ValueError, match="unknown mesh axis"):
        sharding.parse_mesh("dp=2")


def test_make_mesh_count_error():
    n = jax.device_count()
    mesh = sharding.make_mesh(n)
    assert mesh.axis_names == ("ep", "tp") and mesh.shape["tp"] == n
    with pytest.raises(ValueError, match=r"tp\*ep must equal the device count"):
        sharding.make_mesh(n + 1)


def test_param_shardings_single_device():
    model = golden_model("float32")
    mesh = sharding.make_mesh(1, 1, jax.devices()[:1])
    sh = sharding.param_shardings(model, mesh)
    assert sh[("layers", 0, "attn", "w_in")].spec == P(None, "tp", None, None)
    assert sh[("layers", 3, "mlp", "w_gate_up")].spec == P(None, None, ("ep", "tp"), None)
    assert sh[("lm_head",)].spec == P(None, "tp")
    assert sh[("layers", 3, "mlp", "router")].spec == P(None, None)


def _check(*what):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip())
    proc = subprocess.run([sys.executable, str(HERE / "sharding_check.py"), *what], env=env, capture_output=True,
                          text=True, timeout=900, cwd=HERE.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def multi():
    return _check()


@pytest.fixture(scope="module")
def kda_multi():
    return _check("kda_kernel")["kda_kernel"]


@pytest.mark.parametrize("mesh", ["1x1", "2x1", "1x2", "2x2"])
def test_golden_mesh_matches_single_device(multi, mesh):
    assert multi["devices"] == 4
    r = multi["golden"]["meshes"][mesh]
    tp, ep = (int(v) for v in mesh.split("x"))
    assert r["rel"] <= 1e-5 and r["argmax_equal"]
    assert r["dspark_equal"], (r["dspark"], multi["golden"]["ref"]["dspark"])
    assert r["none_equal"], (r["none"], multi["golden"]["ref"]["none"])
    assert r["bad"] == []  # every param's shards have the shape its sharding implies
    p = r["params"]
    assert p["layers.0.attn.w_in"]["shard"] == [5, 2 // tp, 64, 128]
    assert p["lm_head"]["shard"] == [128, 512 // tp]
    assert p["layers.7.mlp.w_gate_up"]["shard"] == [16, 2, 32 // (tp * ep), 128]
    assert p["layers.3.attn.kv_b"]["shard"] == [32, 2 // tp, 64]
    assert all(v["ndev"] == tp * ep for v in p.values())
    assert r["kda_in_spec"] == [None, "tp" if tp > 1 else None]


def test_random_4head_tp4(multi):
    r = multi["random"]["meshes"]["4x1"]
    assert r["rel"] <= 1e-5 and r["argmax_equal"]
    assert r["dspark_equal"] and r["none_equal"]
    assert r["bad"] == []
    assert r["params"]["layers.0.attn.w_in"]["shard"] == [5, 1, 16, 64]
    assert r["params"]["lm_head"]["shard"] == [64, 16]


def test_tp4_on_golden_is_a_clear_error(multi):
    e = multi["errors"]
    assert e["target"] == "heads=2 not divisible by tp=4 (layers.0.attn.A_log)"
    assert "kv_heads=2 not divisible by tp=4" in e["draft"]
    assert e["untouched"]  # nothing moved when the check failed
    assert "tp*ep must equal the device count" in e["mesh"] and "4 device(s) available" in e["mesh"]
    assert e["mlp"] == "mlp=6 not divisible by ep*tp=4 (layers.0.mlp.down_proj.weight)"
    assert e["ep4"] == "ok"  # MLP intermediates 256 / 32 over ep=4


# ---- collectives of a compiled decode step ---------------------------------------------------------
HLO = """
  %all-reduce.1 = f32[1,1,128]{2,1,0} all-reduce(%a), channel_id=2, to_apply=%add, metadata={op_name="jit(_run)/while/body/kda/bthk,hkd->btd/dot_general" stack_frame_id=9}
  %ar.2 = (f32[9,128]{1,0}, f32[9,4,128]{2,1,0}) all-reduce(%b, %c), channel_id=3, metadata={op_name="jit(_run)/while/body/moe/dot_general"}
  %ag = s64[2]{0} all-gather(%d), dimensions={0}, metadata={op_name="jit(_run)/while/body/draft/while/body/reduce"}
  %ars = bf16[4,8]{1,0} all-reduce-start(%e), metadata={op_name="jit(f)/embed/gather"}
  %ard = bf16[4,8]{1,0} all-reduce-done(%ars)
  %cp = f8e4m3fn[16]{0} collective-permute(%f), source_target_pairs={{0,1}}
  %dot = f32[1,128]{1,0} dot(%g, %h), metadata={op_name="jit(_run)/while/body/all-reduce/dot"}
"""


def test_collectives_parses_kind_bytes_and_scope():
    cs = sharding.collectives(HLO)
    assert [c.kind for c in cs] == ["all-reduce", "all-reduce", "all-gather", "all-reduce", "collective-permute"]
    assert [c.nbytes for c in cs] == [512, 9 * 128 * 4 + 9 * 4 * 128 * 4, 16, 64, 16]
    scopes = ("kda", "mla", "moe", "draft", "embed")
    assert [c.scope(scopes) for c in cs] == ["kda", "moe", "draft", "embed", None]


def _check_step(rep, tp: int):
    """At most one collective per target block; attention and dense MLP results are [N, D] rows;
    the MoE one is XLA's merged all-reduce of the routed [N, top_k, D] and shared [N, D] partial sums."""
    row, k = rep["row_bytes"], rep["top_k"]
    for block, n_blocks in rep["blocks"].items():
        got = rep["scopes"].get(block, dict(n=0, max_bytes=0))
        assert got["n"] <= n_blocks, (block, got)
        limit = (k + 1) * row if block == "moe" else row
        assert got["max_bytes"] <= limit, (block, got)
        if block in ("kda", "mla") and tp == 1:
            assert got["n"] == 0, (block, got)
        if block in ("moe", "dense_mlp"):       # the MLP intermediate is always split (ep*tp > 1)
            assert got["n"] == n_blocks, (block, got)


@pytest.mark.parametrize("method", ["none", "dspark"])
@pytest.mark.parametrize("mesh", ["2x1", "1x2", "2x2"])
def test_decode_step_one_collective_per_block(multi, mesh, method):
    """Golden model (6 KDA + 2 MLA blocks, 2 dense MLP + 6 MoE, D=128, top-4), one compiled decode
    step (N = 1 token for 'none', 9 verified for 'dspark'), collectives per block after the change:
      tp=2 (2x1), 2x2: KDA 1 all-reduce [N,128] each, MLA 1, dense MLP 1, MoE 1 (one all-reduce of
        ([N,128], [N,4,128]): routed + shared); ep=2 (1x2): attention 0, MLP/MoE 1 each.
      Before (experts over 'ep'): 1x2 one all-reduce per MoE block of the 4 gathered experts'
        *weights* (196608 B); 2x2 two per MoE block (weights over ep + outputs over tp).
    Outside the blocks: 'none' embed lookup 1 all-reduce, argmax over the vocab-sharded lm_head 2
    tiny all-gathers; 'dspark' adds the draft (o_proj + MLP per layer, its block embedding, and in
    the Markov chain's scan body one all-reduce + two all-gathers that run once per drafted token)."""
    tp, _ = (int(v) for v in mesh.split("x"))
    _check_step(multi["golden"]["meshes"][mesh]["collectives"][method], tp)


@pytest.mark.parametrize("method", ["none", "dspark"])
def test_decode_step_collectives_tp4_and_one_device(multi, method):
    _check_step(multi["random"]["meshes"]["4x1"]["collectives"][method], 4)
    assert multi["golden"]["meshes"]["1x1"]["collectives"][method]["scopes"] == {}


def test_collective_check_catches_the_expert_axis_rules(multi):
    """Sharding the expert axis over 'ep' makes the routed-expert gather all-reduce the gathered
    expert weights: the payload check fails there (this is why 'experts' is no longer sharded)."""
    rep = multi["expert_axis"]
    moe = rep["scopes"]["moe"]
    assert moe["n"] == rep["blocks"]["moe"]
    assert moe["max_bytes"] > 20 * (rep["top_k"] + 1) * rep["row_bytes"]


# ---- cache shardings pinned across prefill and the loop ---------------------------------------------
@pytest.mark.parametrize("mesh", ["1x1", "2x1", "1x2", "2x2"])
def test_decode_state_keeps_cache_shardings(multi, mesh):
    r = multi["golden"]["meshes"][mesh]
    tp, ep = (int(v) for v in mesh.split("x"))
    for method in ("none", "dspark"):
        assert r["state_bad"][method] == dict(prefill=[], run=[]), method
    assert r["kda_state_spec"] == str(P(None, "tp") if tp > 1 else P())          # KDA state by head
    assert r["draft_cache_spec"] == str(P(None, None, "tp") if tp > 1 else P())  # draft k/v by kv head
    assert r["draft_cache_ndev"] == tp * ep


def test_state_shardings_single_device():
    model = golden_model("float32")
    mesh = sharding.make_mesh(1, 1, jax.devices()[:1])
    cache = init_cache(model.cfg, 1, 8, jnp.float32)
    sh = sharding.state_shardings(dict(cache=cache, n=jnp.int32(0)), mesh, model.cfg)
    assert sh["cache"].layers[0].state.spec == P(None, None) and sh["cache"].layers[3].latent.spec == P()
    assert sh["n"].spec == P()
    assert sharding.params_mesh(nnx.state(model)) is None


# ---- sharded restore: bytes read per device ----------------------------------------------------------
# tp x ep; the golden checkpoint (float32 and fp8) on 2x1, 1x2, 2x2, a random 4-head one (float32) on 4x1
RESTORE = [("float32", m) for m in ("2x1", "1x2", "2x2", "4x1")] + [("fp8", m) for m in ("2x1", "1x2", "2x2")]
HEADS_SHARDED = ("attn.w_in", "attn.w_out", "attn.q_proj", "attn.dense")


def _restored(multi, name, mesh):
    return multi["restore"][name][mesh]["arrays"]


@pytest.mark.parametrize("name,mesh", RESTORE)
def test_restore_reads_only_the_chunks_of_each_shard(multi, name, mesh):
    """Checkpoint chunked at 4 KiB: every device's reads are exactly the stored chunks its own shard
    intersects (tensorstore's file byte counter, sampled around each shard read)."""
    tp, ep = (int(v) for v in mesh.split("x"))
    arrays = _restored(multi, name, mesh)
    assert len(arrays) > (20 if mesh == "4x1" else 100)
    for key, devices in arrays.items():
        assert sorted(devices) == [str(i) for i in range(tp * ep)], key
        for d, r in devices.items():
            assert r["read"] == r["chunks"] >= r["shard"], (key, d, r)
    if name == "float32":
        assert multi["restore"][name][mesh]["value_mismatch"] == []


@pytest.mark.parametrize("name,mesh", RESTORE)
def test_restore_big_params_read_only_their_shard(multi, name, mesh):
    """Embedding, lm_head, dense MLPs and routed experts: each device reads exactly its shard, 1/tp
    (vocab) or 1/(ep*tp) (mlp) of the array."""
    tp, ep = (int(v) for v in mesh.split("x"))
    arrays = _restored(multi, name, mesh)
    split = {k: tp for k in ("embed", "lm_head")}
    split.update({k: tp * ep for k in arrays if k.endswith(("mlp.w_gate_up", "mlp.w_down"))})
    assert len(split) == 2 + 2 * (2 if mesh == "4x1" else 9)
    for key, n in split.items():
        for d, r in arrays[key].items():
            assert r["read"] == r["shard"] == r["whole"] // n, (key, d, r)


@pytest.mark.parametrize("name,mesh", RESTORE)
def test_restore_heads_sharded_params_read_only_their_shard(multi, name, mesh):
    """KDA and MLA projections sharded over their heads axis (tp): the converter cuts that axis into
    per-shard chunks (checkpoints_convert/chunks.py), so each device reads 1/tp of the array."""
    tp, _ = (int(v) for v in mesh.split("x"))
    arrays = _restored(multi, name, mesh)
    keys = [k for k in arrays if k.endswith(HEADS_SHARDED)]
    assert {".".join(k.split(".")[-2:]) for k in keys} == set(HEADS_SHARDED)
    for key in keys:
        for d, r in arrays[key].items():
            assert r["read"] == r["shard"] == r["whole"] // tp, (key, d, r)


def test_restore_old_chunking_same_values(multi):
    """The float32 checkpoint rechunked by size alone, as checkpoints were converted before chunks.py
    (heads never split), restores the same values on 2x2; its heads-sharded arrays are read whole."""
    r = multi["restore"]["old_chunks"]["2x2"]
    assert r["value_mismatch"] == []
    for d, v in r["arrays"]["layers.0.attn.w_in"].items():
        assert v["read"] == v["whole"] == 2 * v["shard"], (d, v)


# ---- block fp8 on a mesh ---------------------------------------------------------------------------
def test_fp8_sharded_tokens_match_one_device(multi):
    f = multi["fp8"]
    assert f["none_equal"] and len(f["ref"]) == 10, (f["none"], f["ref"])
    assert f["values_spec"] == str(P(None, None, ("ep", "tp")))     # trailing None dropped by the array
    rep = f["collectives"]
    assert rep["scopes"]["moe"]["n"] == rep["blocks"]["moe"]


def test_fp8_decode_step_one_collective_per_block(multi):
    """quant.dequantize gathers the scales of weights narrower than a block by block index: repeat +
    slice made GSPMD add a collective-permute per KDA / MLA block (then for w_beta and g_proj,
    which fp8 models now hold dequantised: param_layout.LING_DEQUANTISED_AT_LOAD)."""
    _check_step(multi["fp8"]["collectives"], 2)


# ---- kda_kernel='pallas' on a mesh ----------------------------------------------------------------
@pytest.mark.parametrize("mesh,method", [("2x1", "dspark"), ("1x2", "dspark"), ("2x2", "none"), ("2x2", "dspark"),
                                         ("2x2", "none+window"), ("2x2", "dspark+window")])
def test_kda_kernel_split_over_heads(kda_multi, mesh, method):
    """The Pallas KDA kernel under shard_map: each call sees its device's heads (golden: 2 heads, so
    1 per device at tp=2, both at tp=1), greedy tokens equal the one-device XLA run, the state keeps
    its shardings, and the split adds no collective to the KDA blocks. On CPU the kernel body is an
    XLA stand-in with its signature (see sharding_check._kda_reference_kernels)."""
    r = kda_multi["meshes"][mesh][method]     # "+window": kda.WINDOW_FROM_KERNEL flipped from its default
    tp = int(mesh.split("x")[0])
    assert r["equal"], (r["tokens"], kda_multi["ref"][method.removesuffix("+window")])
    assert r["call_heads"] == [2 // tp]
    assert r["state_bad"] == []
    assert r["kda"]["n"] <= r["kda_blocks"] and (tp > 1 or r["kda"]["n"] == 0), r["kda"]


def test_kda_kernel_on_a_mesh_cross_lowers_for_cuda(kda_multi):
    """The sharded speculative loop (2x2 mesh) with the real Mosaic GPU kernel inside shard_map lowers
    for CUDA (the interpreter cannot run it on several CPU devices at once)."""
    assert kda_multi["meshes"]["2x2"]["cuda_mosaic_calls"] > 0
