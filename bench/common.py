"""Shared benchmark plumbing: environment record, timing, result files (bench/results/*.json)."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def env_info() -> dict:
    import jax
    import jaxlib
    dev = jax.devices()[0]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    return {"device": getattr(dev, "device_kind", str(dev)), "n_devices": jax.device_count(),
            "backend": jax.default_backend(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "python": platform.python_version(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "git_commit": commit, "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def save_result(name: str, record: dict, out_dir: str | Path | None = None) -> Path:
    """Write record (plus env info) to <out_dir or bench/results>/<name>-<timestamp>.json and print one JSON line."""
    record = {**record, "env": env_info()}
    d = Path(out_dir) if out_dir else RESULTS
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=1))
    print(json.dumps(record))
    return path


def block(x):
    """Wait for every array in a pytree."""
    import jax
    jax.block_until_ready(x)
    return x


def time_fn(f, args, iters, warmup):
    """(median seconds of one blocked call, seconds per call when issued back to back)."""
    import jax
    import numpy as np
    for _ in range(max(1, warmup)):
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    t = time.perf_counter()
    outs = [f(*args) for _ in range(iters)]
    jax.block_until_ready(outs)
    return float(np.median(ts)), (time.perf_counter() - t) / iters


def time_rows(rows, iters, warmup, rec: dict) -> dict:
    """`time_fn` for each (name, f, args) row: {name: (median s, pipelined s)}. A row that fails
    (compile error, OOM) is recorded as rec[f"{name}_error"] and left out; the others still run."""
    out = {}
    for name, f, args in rows:
        try:
            out[name] = time_fn(f, args, iters, warmup)
        except Exception as e:          # noqa: BLE001 -- recorded in the result, not swallowed
            rec[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:800]}"
    return out


def kernel_interpret(ap, a, what: str):
    """For kernel benchmarks: plgpu interpret params under --interpret, else False; exits with a
    clear message when a Mosaic GPU kernel would be compiled on a non-GPU backend."""
    import jax
    from jax.experimental.pallas import mosaic_gpu as plgpu
    backend = jax.default_backend()
    if not a.interpret and backend != "gpu":
        ap.error(f"{what} compile(s) for an NVIDIA Hopper GPU; this backend is {backend!r}: pass "
                 "--interpret for a CPU smoke run at small shapes")
    return plgpu.InterpretGPUParams() if a.interpret else False

