"""lingjax.sharding: rules and errors in-process; multi-device equivalence in a subprocess with 4
forced host CPU devices (tests/sharding_check.py), since this process already initialised jax.

Golden tiny model (2 heads, 16 experts) + tiny DSpark draft on meshes (tp, ep) = 1x1, 2x1, 1x2, 2x2:
prefill logits vs one device (<= 1e-5 relative, float32), greedy DSpark and plain decoding
token-identical, params really sharded (spec + per-device shard shapes). tp=4 cannot divide the
golden model's 2 heads: a clear error; the 4x1 mesh runs on a random 4-head config instead.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from jax.sharding import PartitionSpec as P

from helpers import golden_model
from lingjax import sharding

HERE = Path(__file__).parent


def test_logical_to_spec_rules():
    assert sharding.logical_to_spec(("embed", None, "heads", "head_dim")) == P(None, None, "tp", None)
    assert sharding.logical_to_spec(("experts", "embed", None, "mlp")) == P("ep", None, None, "tp")
    assert sharding.logical_to_spec(("vocab", "embed")) == P("tp", None)
    assert sharding.logical_to_spec(("latent", None)) == P(None, None)
    # a mesh axis is used at most once per array
    assert sharding.logical_to_spec(("heads", "mlp")) == P("tp", None)
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
    assert sh[("layers", 0, "attn", "w_in")].spec == P(None, None, "tp", None)
    assert sh[("layers", 3, "mlp", "w_gate_up")].spec == P("ep", None, None, "tp")
    assert sh[("lm_head",)].spec == P(None, "tp")
    assert sh[("layers", 3, "mlp", "router")].spec == P(None, None)


@pytest.fixture(scope="module")
def multi():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip())
    proc = subprocess.run([sys.executable, str(HERE / "sharding_check.py")], env=env, capture_output=True,
                          text=True, timeout=600, cwd=HERE.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


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
    assert p["layers.0.attn.w_in"]["shard"] == [128, 5, 2 // tp, 64]
    assert p["lm_head"]["shard"] == [128, 512 // tp]
    assert p["layers.7.mlp.w_gate_up"]["shard"] == [16 // ep, 128, 2, 32 // tp]
    assert p["layers.3.attn.kv_b"]["shard"] == [32, 2 // tp, 64]
    assert all(v["ndev"] == tp * ep for v in p.values())
    assert r["kda_in_spec"] == [None, "tp" if tp > 1 else None]


def test_random_4head_tp4(multi):
    r = multi["random"]["meshes"]["4x1"]
    assert r["rel"] <= 1e-5 and r["argmax_equal"]
    assert r["dspark_equal"] and r["none_equal"]
    assert r["bad"] == []
    assert r["params"]["layers.0.attn.w_in"]["shard"] == [64, 5, 1, 16]
    assert r["params"]["lm_head"]["shard"] == [64, 16]


def test_tp4_on_golden_is_a_clear_error(multi):
    e = multi["errors"]
    assert e["target"] == "heads=2 not divisible by tp=4 (layers.0.attn.A_log)"
    assert "kv_heads=2 not divisible by tp=4" in e["draft"]
    assert e["untouched"]  # nothing moved when the check failed
    assert "tp*ep must equal the device count" in e["mesh"] and "4 device(s) available" in e["mesh"]
    assert e["ep4"] == "ok"  # 16 experts over ep=4
