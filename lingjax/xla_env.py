"""XLA settings the decode loop relies on; must run before jax initialises its backend.

With `--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL --xla_gpu_graph_min_graph_size=1` the
data-dependent `while_loop` of the speculative decoder becomes one CUDA graph with a device-side
condition (spec/gpu.md: 27.6 us/iter instead of 85.7 us with a host round trip per iteration).
Flags the user already set in XLA_FLAGS win; LINGJAX_NO_XLA_DEFAULTS=1 disables all of this.
"""
from __future__ import annotations

import os

DEFAULT_GPU_FLAGS = (
    "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
    "--xla_gpu_graph_min_graph_size=1",
)


def configure(extra: tuple[str, ...] = ()) -> str:
    """Add our default XLA flags (unless the user set the same flag) and return XLA_FLAGS."""
    if os.environ.get("LINGJAX_NO_XLA_DEFAULTS") == "1":
        return os.environ.get("XLA_FLAGS", "")
    flags = os.environ.get("XLA_FLAGS", "").split()
    have = {f.split("=")[0] for f in flags}
    for f in (*DEFAULT_GPU_FLAGS, *extra):
        if f.split("=")[0] not in have:
            flags.append(f)
    os.environ["XLA_FLAGS"] = " ".join(flags)
    return os.environ["XLA_FLAGS"]
