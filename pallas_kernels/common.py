"""Small helpers the Mosaic GPU kernels share (jax 0.11.2 and 0.12 differences kept here)."""
from __future__ import annotations

from jax.experimental.pallas import mosaic_gpu as plgpu


def swizzled(minor_elems: int, itemsize: int = 2):
    """Tiling + swizzle transforms for a WGMMA operand whose rows hold `minor_elems` elements."""
    sw = min(128, minor_elems * itemsize)
    return (plgpu.TilingTransform((8, sw // itemsize)), plgpu.SwizzleTransform(sw))


def store(ref, x):
    """Store registers `x` to SMEM `ref`, unswizzled tiles included."""
    if hasattr(plgpu, "store"):          # jax >= 0.12
        plgpu.store(ref, x, optimized=False)
    else:                                # jax 0.11: `ref[...] =` falls back when needed
        ref[...] = x
