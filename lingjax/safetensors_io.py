"""Read Hugging Face safetensors checkpoints (one file or an index + shards) lazily via mmap.

We parse the (simple, documented) safetensors header ourselves so bf16 and fp8 tensors come back
as numpy arrays of `ml_dtypes` types without a framework, and so truncated or missing shards are
reported with the file and tensor they affect.
"""
from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
DTYPE_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint file that is missing, truncated or inconsistent; the message names it."""


class SafetensorsFile:
    """One .safetensors file: `header` (name -> dtype/shape/offsets) and zero-copy `get(name)`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.exists():
            raise CheckpointError(f"missing shard {self.path}")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{self.path} is truncated (no safetensors header)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise CheckpointError(f"{self.path} is truncated (header of {n} bytes, file {size} bytes)")
            try:
                header = json.loads(f.read(n))
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from e
        self.metadata = header.pop("__metadata__", {}) or {}
        self.header = header
        self._base = 8 + n
        data_end = max((v["data_offsets"][1] for v in header.values()), default=0)
        if self._base + data_end > size:
            raise CheckpointError(f"{self.path} is truncated: tensors need {self._base + data_end} bytes, "
                                  f"file has {size}")
        self._mm = None

    def keys(self):
        return self.header.keys()

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
        if self._mm is None:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        start, end = info["data_offsets"]
        arr = np.frombuffer(self._mm, dtype=DTYPES[info["dtype"]], count=(end - start) // np.dtype(DTYPES[info["dtype"]]).itemsize,
                            offset=self._base + start)
        return arr.reshape(info["shape"])

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> str:
        return self.header[name]["dtype"]


class CheckpointReader:
    """All tensors of an HF checkpoint directory: `model.safetensors.index.json` + shards, or one
    `model.safetensors` (or any single *.safetensors)."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise CheckpointError(f"checkpoint directory {self.dir} does not exist")
        index = self.dir / "model.safetensors.index.json"
        self._files: dict[str, SafetensorsFile] = {}
        if index.exists():
            wm = json.loads(index.read_text())["weight_map"]
            self.weight_map = dict(wm)
            for shard in sorted(set(wm.values())):
                self._files[shard] = SafetensorsFile(self.dir / shard)
            for name, shard in wm.items():
                if name not in self._files[shard].header:
                    raise CheckpointError(f"index lists {name} in {shard}, but that shard does not contain it")
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no model.safetensors(.index.json) in {self.dir}")
            self.weight_map = {}
            for p in files:
                f = SafetensorsFile(p)
                self._files[p.name] = f
                self.weight_map.update({k: p.name for k in f.keys()})

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def keys(self):
        return self.weight_map.keys()

    def file_of(self, name: str) -> SafetensorsFile:
        if name not in self.weight_map:
            raise CheckpointError(f"tensor {name} is missing from the checkpoint in {self.dir}")
        return self._files[self.weight_map[name]]

    def get(self, name: str) -> np.ndarray:
        return self.file_of(name).get(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.file_of(name).shape(name)

    def dtype(self, name: str) -> str:
        return self.file_of(name).dtype(name)


def dequantize_block_fp8(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = (128, 128),
                         out_dtype=np.float32) -> np.ndarray:
    """w_bf16 = w_fp8 * scale_inv per (block x block) tile; w [out, in], scale_inv [ceil(out/b0), ceil(in/b1)]."""
    b0, b1 = block
    o, i = w.shape
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), b0, axis=0), b1, axis=1)[:o, :i]
    return (w.astype(np.float32) * s).astype(out_dtype)


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None):
    """Write a .safetensors file (used by tests and the embedded-model trainer)."""
    header, offset, blobs = {}, 0, []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        b = arr.tobytes()
        header[name] = {"dtype": DTYPE_NAMES[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
