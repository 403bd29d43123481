"""Read published tensors one at a time from an HF checkpoint (index + shards, or one file).

Headers come from `lingjax.safetensors_io.CheckpointReader` (which reports missing / truncated
shards). Tensor data is read with positioned reads into private buffers rather than through a
long-lived mmap, so file pages never pile up in the converter's resident memory: a tensor costs
memory only while the parameter it feeds is being built.
"""
from __future__ import annotations

import os
import struct

import numpy as np

from lingjax.safetensors_io import DTYPES, CheckpointError, CheckpointReader
from lingjax.weights import ALIASES

SCALE_SUFFIX = "_scale_inv"          # <name>.weight -> <name>.weight_scale_inv (published fp8)
FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}
FP8_DTYPE = "F8_E4M3"


class SourceReader:
    """Name resolution (aliases, optional `model.` prefix) and tensor reads for one checkpoint."""

    def __init__(self, directory, *, model_prefix_optional: bool = False):
        self.reader = CheckpointReader(directory)
        self.dir = self.reader.dir
        self._prefix_optional = model_prefix_optional
        self._fds: dict[str, int] = {}
        self._bases: dict[str, int] = {}

    def keys(self):
        return self.reader.keys()

    def shard_files(self) -> list[str]:
        """The safetensors files the tensors live in, relative to the checkpoint directory."""
        return sorted(set(self.reader.weight_map.values()))

    def __contains__(self, name: str) -> bool:
        return name in self.reader

    def resolve(self, name: str) -> str | None:
        """The checkpoint's name for published `name`, or None when absent."""
        if name in self.reader:
            return name
        if self._prefix_optional and "model." + name in self.reader:
            return "model." + name
        for a, b in ALIASES.items():
            if a in name and name.replace(a, b) in self.reader:
                return name.replace(a, b)
        return None

    def scale_name(self, name: str) -> str | None:
        """The `weight_scale_inv` tensor of a resolved weight name, if the checkpoint has one."""
        if name.endswith(".weight") and name + SCALE_SUFFIX in self.reader:
            return name + SCALE_SUFFIX
        return None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.reader.shape(name)

    def dtype(self, name: str) -> str:
        return self.reader.dtype(name)

    def nbytes(self, name: str) -> int:
        start, end = self.reader.file_of(name).header[name]["data_offsets"]
        return end - start

    def read(self, name: str) -> np.ndarray:
        """A private copy of tensor `name` (resolved name) as a numpy array of its stored dtype."""
        f = self.reader.file_of(name)
        info = f.header[name]
        if info["dtype"] not in DTYPES:
            raise CheckpointError(f"{f.path}: tensor {name} has unsupported dtype {info['dtype']}")
        fd, base = self._open(f.path)
        start, end = info["data_offsets"]
        out = np.empty(info["shape"], DTYPES[info["dtype"]])
        buf = memoryview(out.reshape(-1).view(np.uint8))
        if out.nbytes != end - start:
            raise CheckpointError(f"{f.path}: tensor {name} has {end - start} bytes, shape needs {out.nbytes}")
        done = 0
        while done < len(buf):
            n = os.preadv(fd, [buf[done:done + (1 << 30)]], base + start + done)
            if n <= 0:
                raise CheckpointError(f"{f.path} is truncated: could not read tensor {name}")
            done += n
        return out

    def _open(self, path) -> tuple[int, int]:
        key = str(path)
        if key not in self._fds:
            fd = os.open(path, os.O_RDONLY)
            (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            self._fds[key], self._bases[key] = fd, 8 + n
        return self._fds[key], self._bases[key]

    def close(self):
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
