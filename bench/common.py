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
