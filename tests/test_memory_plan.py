"""bench.memory_plan: per-device bytes of the full-size model on a mesh, planned abstractly (no
allocation), on forced host CPU devices in a subprocess (this process's jax has one device)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
GIB = 2 ** 30


def _plan(tmp_path, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    proc = subprocess.run([sys.executable, "-m", "bench.memory_plan", *args, "--out", str(tmp_path)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    return proc


def test_tp4_bf16_splits_the_model_four_ways(tmp_path):
    proc = _plan(tmp_path, "--mesh", "tp=4", "--spec", "none,mtp,dspark", "--block-size", "16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads(next(tmp_path.glob("memory_plan-*.json")).read_text())
    t = rec["rows"]["target params"]
    # bf16 Ling-3.0-flash + MTP: ~127.5e9 params -> ~237 GiB; replicated parts (norms, routers,
    # MLA kv_a, ...) keep one device a little above a quarter
    assert 230 * GIB < t["total_bytes"] < 245 * GIB
    assert t["total_bytes"] / 4 <= t["per_device_bytes"] < 1.02 * t["total_bytes"] / 4
    assert rec["mesh"] == {"tp": 4, "ep": 1} and rec["max_len"] == 9280     # 8192 + 1024 + 16 + 2 in multiples of 64
    assert rec["per_device_gib"] < 139 and "draft params" in rec["rows"]
    assert "per device GiB" in proc.stdout


def test_bad_mesh_is_a_usage_error(tmp_path):
    proc = _plan(tmp_path, "--mesh", "tp=x")
    assert proc.returncode == 2 and "error" in proc.stderr
