"""Chunk shapes of the stored arrays: which bytes a sharded restore has to read.

A device restoring its shard reads every stored chunk its shard intersects (whole chunk files), so
a chunk that straddles a shard boundary is read by two devices. Rule for one array of `shape`,
with the model's logical axis names (`lingjax.model.common`):

1. Sharded axes. Every axis the partition rules may shard (SHARDED_AXES: heads, kv_heads, vocab,
   mlp, experts; `lingjax.sharding`) is cut into s = gcd(n, MAX_SPLIT) equal slabs, MAX_SPLIT = 8:
   a 1-, 2-, 4- or 8-way shard of that axis (whichever of these divides n, as sharding requires)
   then starts and ends on chunk boundaries, so each device reads exactly its shard. Axes are cut
   in SHARDED_AXES order; s is halved while a slab would fall below
   min(chunk_bytes, MIN_SPLIT_BYTES = 1 MiB): small arrays (norms, A_log, per-head gates) are not
   worth a file per slab and are read whole, or aligned for fewer devices.
2. Size. While the chunk is larger than chunk_bytes (--chunk-size), its largest extent is reduced
   to the next smaller divisor of the extent step 1 left (a divisor of a slab stays aligned).

Chunk extents always divide the array's dimensions (no ragged edge chunks). Flash at the default
64 MiB, bf16: KDA w_in [5, 32, 128, 2560] -> [5, 4, 128, 2560] (12.5 MiB, 8 chunks); routed
experts w_gate_up [512, 2, 768, 2560] -> [64, 2, 96, 2560] (60 MiB, 64 chunks); embed
[157184, 2560] -> [9824, 2560] (48 MiB, 16 chunks); A_log [32] and w_beta [32, 2560] stay whole.

Checkpoints written before this rule (orbax's size-only choice, heads never split) restore the
same values; devices just read more bytes.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

MAX_SPLIT = 8                       # the most devices one array axis is sharded over
MIN_SPLIT_BYTES = 1 << 20           # no slab of step 1 smaller than this (or than chunk_bytes)
SHARDED_AXES = ("heads", "kv_heads", "vocab", "mlp", "experts")   # cut in this order
RULE = f"sharded-axes-gcd{MAX_SPLIT}-min{MIN_SPLIT_BYTES}"        # recorded in the manifest


def chunk_shape(shape: Sequence[int], itemsize: int, logical: Sequence[str | None] | None,
                chunk_bytes: int) -> tuple[int, ...]:
    """The stored chunk shape of an array (see the module docstring); `logical` None: no axis is
    sharded (size rule only)."""
    shape = tuple(max(1, int(n)) for n in shape)       # zarr has no 0-sized chunks
    logical = tuple(logical) if logical is not None else (None,) * len(shape)
    if len(logical) != len(shape):
        raise ValueError(f"logical axes {logical} do not match shape {shape}")
    chunk = list(shape)
    floor = min(chunk_bytes, MIN_SPLIT_BYTES)
    for name in SHARDED_AXES:
        for axis in (a for a, n in enumerate(logical) if n == name):
            s = math.gcd(shape[axis], MAX_SPLIT)
            while s > 1 and math.prod(chunk) * itemsize // s < floor:
                s //= 2
            chunk[axis] //= s
    steps = [_divisors(c) for c in chunk]               # ascending; the last one is the current extent
    while math.prod(chunk) * itemsize > chunk_bytes and max(chunk) > 1:
        axis = max(range(len(chunk)), key=lambda a: (chunk[a], -a))
        steps[axis].pop()
        chunk[axis] = steps[axis][-1]
    return tuple(chunk)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
