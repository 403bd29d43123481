"""Parts: the unit of writing, checksumming and resuming. A part holds consecutive parameters of
one group (one layer, the MTP layer, or the top level) up to a byte budget; a parameter larger
than the budget is a part of its own. Each part is one orbax PyTree checkpoint, every array stored
in the chunk shape checkpoints_convert.chunks chose for it."""
from __future__ import annotations

import dataclasses
import errno
import inspect
import shutil
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp

from checkpoints_convert.specs import ParamSpec
from lingjax.checkpoint import hash_dir, orbax_handler


class _ChunkedNumpyHandler(ocp.type_handlers.NumpyHandler):
    """orbax's numpy handler, writing each array in its chunk shape from `chunks` (array key ->
    shape; orbax itself offers only a byte budget, which never splits a small axis such as heads),
    and without the deep copy of every array it makes for async saves: ours are synchronous and
    never mutated, and the copy would double peak memory."""

    def __init__(self, chunks: dict[str, tuple[int, ...]]):
        # orbax 0.12.4 (the GPU machine's) has no such switch and always copies: one extra part of peak memory
        no_copy = "deepcopy_host_arrays" in inspect.signature(ocp.type_handlers.NumpyHandler).parameters
        super().__init__(**({"deepcopy_host_arrays": False} if no_copy else {}))
        self.chunks = chunks

    async def _open_and_write(self, value, tspec, ts_context):
        spec = tspec.get("base", tspec)                   # a 'cast' spec wraps the zarr one
        key = spec["kvstore"]["path"].rstrip("/").rsplit("/", 1)[-1]
        chunk = self.chunks.get(key)
        if chunk is None or len(chunk) != value.ndim:
            raise RuntimeError(f"orbax is writing array {key!r} {list(value.shape)} with no chunk shape planned "
                               f"for it (has orbax's layout changed?): {spec['kvstore']['path']}")
        spec["metadata"] = {**spec["metadata"], "chunks": tuple(chunk)}
        return await super()._open_and_write(value, tspec, ts_context)


@dataclasses.dataclass
class Part:
    name: str
    group: str
    specs: list[ParamSpec] = dataclasses.field(default_factory=list)
    nbytes: int = 0                       # estimated stored bytes


def plan_parts(specs: list[ParamSpec], stored_bytes: dict[tuple, int], max_bytes: int) -> list[Part]:
    parts: list[Part] = []
    per_group: dict[str, int] = {}
    for spec in specs:
        b = stored_bytes[spec.path]
        cur = parts[-1] if parts else None
        if cur is None or cur.group != spec.group or cur.nbytes + b > max_bytes:
            k = per_group.get(spec.group, 0)
            per_group[spec.group] = k + 1
            cur = Part(f"{spec.group}-{k}", spec.group)
            parts.append(cur)
        cur.specs.append(spec)
        cur.nbytes += b
    return parts


def save_part(part_dir: Path, arrays: dict[str, np.ndarray], chunks: dict[str, tuple[int, ...]]) -> dict:
    """Write `arrays` as one orbax checkpoint at part_dir (via part_dir.tmp + rename), each array
    chunked as `chunks` says (key -> chunk shape); returns its checksum record
    (lingjax.checkpoint.hash_dir)."""
    tmp = part_dir.with_name(part_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        registry = ocp.type_handlers.create_type_handler_registry((np.ndarray, _ChunkedNumpyHandler(chunks)))
        orbax_handler(registry).save(tmp.absolute(), args=ocp.args.PyTreeSave(arrays))
    except OSError:
        raise
    except Exception as e:  # tensorstore reports I/O failures as ValueError / RuntimeError
        if "no space left" in str(e).lower():
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp)) from e
        raise
    digest = hash_dir(tmp)
    tmp.rename(part_dir)
    return digest
