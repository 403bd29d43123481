"""Parts: the unit of writing, checksumming and resuming. A part holds consecutive parameters of
one group (one layer, the MTP layer, or the top level) up to a byte budget; a parameter larger
than the budget is a part of its own. Each part is one orbax PyTree checkpoint."""
from __future__ import annotations

import dataclasses
import errno
import shutil
from pathlib import Path

import numpy as np

from checkpoints_convert.specs import ParamSpec
from lingjax.checkpoint import hash_dir, orbax_handler


def _no_copy_registry():
    """orbax's numpy handler deep-copies every array before writing (for async saves); ours are
    synchronous and never mutated, so skip the copy: it would double peak memory."""
    import orbax.checkpoint as ocp
    return ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)))


_NO_COPY_REGISTRY = _no_copy_registry()


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


def save_part(part_dir: Path, arrays: dict[str, np.ndarray], chunk_bytes: int) -> dict:
    """Write `arrays` as one orbax checkpoint at part_dir (via part_dir.tmp + rename); returns
    its checksum record (lingjax.checkpoint.hash_dir)."""
    import orbax.checkpoint as ocp
    tmp = part_dir.with_name(part_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_args = {k: ocp.SaveArgs(chunk_byte_size=chunk_bytes) for k in arrays}
    try:
        orbax_handler(_NO_COPY_REGISTRY).save(tmp.absolute(), args=ocp.args.PyTreeSave(arrays, save_args=save_args))
    except OSError:
        raise
    except Exception as e:  # tensorstore reports I/O failures as ValueError / RuntimeError
        if "no space left" in str(e).lower():
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp)) from e
        raise
    digest = hash_dir(tmp)
    tmp.rename(part_dir)
    return digest
