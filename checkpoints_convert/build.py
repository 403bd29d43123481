"""Assemble one parameter in its stored form under a dtype policy.

--dtype float32   everything float32
--dtype bf16      every parameter in the dtype a bfloat16 LingModel gives it (bf16; A_log, dt_bias,
                  expert_bias stay float32); fp8 sources are dequantised exactly (float32 product)
--dtype fp8       linear weights as block fp8 + float32 scales (quantised here unless the source
                  already is block fp8); high-precision tensors as under bf16
--dtype keep      the source dtypes: block-fp8 linear weights stay fp8 + scales
High-precision tensors (norms, router, expert_bias, A_log, dt_bias, conv, embeddings, lm_head) are
never stored as fp8. Casts happen per source, before the layout op: both are elementwise/layout
only, so the result equals the direct loader's cast-after-build bit for bit.

Matrix sources are handed to the plan's build as `.T` views of a cache-tiled transposed copy, so
the plan's own [out, in] -> [in, out] transposes become plain contiguous copies (numpy's strided
transpose of a large bf16 matrix is an order of magnitude slower).
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from checkpoints_convert.chunks import chunk_shape
from checkpoints_convert.fp8 import FP8, dequantize, quantize_block_fp8
from lingjax.param_layout import Matrix
from checkpoints_convert.source import SourceReader
from checkpoints_convert.specs import ParamSpec
from checkpoints_convert.validate import Source
from lingjax.checkpoint import SCALE_SUFFIX
from lingjax.safetensors_io import DTYPES, CheckpointError

BF16 = np.dtype(ml_dtypes.bfloat16)


def plan_param(spec: ParamSpec, source_dtypes: list[str], mode: str, block: tuple[int, int]) -> dict:
    """The manifest entry of a parameter (path, shape, stored dtype, fp8 view), from headers only."""
    dtypes = [np.dtype(DTYPES[d]) for d in source_dtypes]
    meta = {"path": list(spec.path), "shape": list(spec.shape)}
    if spec.quantisable and (mode == "fp8" or (mode == "keep" and all(d == FP8 for d in dtypes))):
        lay = spec.layout
        n_in, n_out = lay.source_shape(spec.shape)[::-1]
        b_in, b_out = block[1], block[0]                     # published blocks are [out, in]
        scale_shape = [spec.shape[a] for a in lay.stack] + [math.ceil(n_in / b_in), math.ceil(n_out / b_out)]
        return {**meta, "dtype": FP8.name, "fp8": {**lay.meta(), "block": [b_in, b_out], "scale_shape": scale_shape}}
    return {**meta, "dtype": _high_precision_dtype(mode, spec, dtypes).name}


def _high_precision_dtype(mode: str, spec: ParamSpec, dtypes: list[np.dtype]) -> np.dtype:
    plain = [d for d in dtypes if d != FP8]
    if mode == "keep":
        if len(plain) < len(dtypes):                          # dequantised fp8
            plain.append(np.dtype(np.float32) if spec.wide else BF16)
        widest = np.result_type(*plain)
        return np.result_type(widest, np.float32) if spec.wide else widest
    return np.dtype(np.float32) if mode == "float32" or spec.wide else BF16


def stored_nbytes(meta: dict) -> int:
    n = math.prod(meta["shape"]) * np.dtype(_dtype(meta["dtype"])).itemsize
    return n + (4 * math.prod(meta["fp8"]["scale_shape"]) if "fp8" in meta else 0)


def stored_chunks(spec: ParamSpec, meta: dict, chunk_bytes: int) -> dict[str, tuple[int, ...]]:
    """{orbax key: chunk shape} of a parameter (checkpoints_convert.chunks). fp8 scales
    [*stack, IN blocks, OUT blocks] keep the logical axes of the stack dimensions only, as the
    model's `Fp8Weight.scale_inv` does."""
    item = np.dtype(_dtype(meta["dtype"])).itemsize
    out = {spec.key: chunk_shape(meta["shape"], item, spec.logical, chunk_bytes)}
    if "fp8" in meta:
        logical = None if spec.logical is None else (
            tuple(spec.logical[a] for a in spec.layout.stack) + (None, None))
        out[spec.key + SCALE_SUFFIX] = chunk_shape(meta["fp8"]["scale_shape"], 4, logical, chunk_bytes)
    return out


def build_param(spec: ParamSpec, sources: list[Source], reader: SourceReader, meta: dict,
                block: tuple[int, int]) -> dict[str, np.ndarray]:
    """{orbax key: array} of one parameter, as `meta` (plan_param) describes it."""
    if "fp8" in meta:
        return _build_fp8(spec, sources, reader, block)
    target = np.dtype(_dtype(meta["dtype"]))
    arrays = []
    for s in sources:                       # convert one source at a time: peak ~ one parameter
        a = reader.read(s.name)
        if s.scale is not None:
            a = dequantize(a, reader.read(s.scale), block)
        arrays.append(_pretransposed(spec, a.astype(target, copy=False)))
    value = np.ascontiguousarray(spec.build(*arrays))
    _check(spec, value, target)
    return {spec.key: value}


def _build_fp8(spec, sources, reader, block):
    values, scales = [], []
    for s in sources:
        a = reader.read(s.name)
        if s.scale is not None:             # already block fp8: keep the published values
            values.append(_pretransposed(spec, a))
            scales.append(reader.read(s.scale).astype(np.float32))
        else:
            q, sc = quantize_block_fp8(a.astype(np.float32, copy=False), block)
            values.append(_pretransposed(spec, q))
            scales.append(sc)
    value = np.ascontiguousarray(spec.build(*values))
    _check(spec, value, FP8)
    return {spec.key: value, spec.key + SCALE_SUFFIX: spec.layout.scales(spec.shape, *scales)}


def _pretransposed(spec: ParamSpec, a: np.ndarray) -> np.ndarray:
    """For a Matrix source: the same values, laid out so that `a.T` is contiguous."""
    return transpose_copy(a).T if isinstance(spec.layout, Matrix) and a.ndim == 2 else a


def transpose_copy(a: np.ndarray, tile_cols: int = 512) -> np.ndarray:
    """Contiguous a.T of a 2-D array, copied in tiles (cache-line-wide rows of the output)."""
    if a.size < (1 << 16) or a.itemsize not in (1, 2, 4, 8):
        return np.ascontiguousarray(a.T)
    raw = np.dtype(f"u{a.itemsize}")
    src, out = a.view(raw), np.empty(a.shape[::-1], raw)
    rows = max(64 // a.itemsize, 1)
    for i in range(0, src.shape[0], rows):
        for j in range(0, src.shape[1], tile_cols):
            out[j:j + tile_cols, i:i + rows] = src[i:i + rows, j:j + tile_cols].T
    return out.view(a.dtype)


def _check(spec: ParamSpec, value: np.ndarray, dtype):
    if tuple(value.shape) != spec.shape or value.dtype != dtype:
        raise CheckpointError(f"{spec.sources[0]}: assembled {value.dtype}{list(value.shape)} does not match "
                              f"the expected {np.dtype(dtype)}{list(spec.shape)} for {spec.key}")


def _dtype(name: str):
    return BF16 if name == "bfloat16" else (FP8 if name == FP8.name else np.dtype(name))
