"""Block fp8 (e4m3) in the published format: `w ~ w_fp8 * scale_inv` per (b0 x b1) block of an
[out, in] weight, scale_inv = amax(|block|) / 448."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from lingjax.safetensors_io import dequantize_block_fp8

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = 448.0


def quantize_block_fp8(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] float -> (fp8 [out, in], float32 scale_inv [ceil(out/b0), ceil(in/b1)]).
    All-zero blocks get scale 1."""
    b0, b1 = block
    o, i = w.shape
    go, gi = math.ceil(o / b0), math.ceil(i / b1)
    padded = np.zeros((go * b0, gi * b1), np.float32)
    padded[:o, :i] = w
    tiles = padded.reshape(go, b0, gi, b1)
    amax = np.abs(tiles).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
    q = np.clip(tiles / scale[:, None, :, None], -FP8_MAX, FP8_MAX).astype(FP8)
    return np.ascontiguousarray(q.reshape(go * b0, gi * b1)[:o, :i]), scale


def dequantize(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """The published dequantisation, float32 (lingjax.safetensors_io.dequantize_block_fp8)."""
    return dequantize_block_fp8(w, scale_inv, block, out_dtype=np.float32)
