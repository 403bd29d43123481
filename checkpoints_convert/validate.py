"""Check a source checkpoint against the parameter specs before anything is written: every
expected tensor present with the right shape and a usable dtype (all problems are collected),
and tensors nobody asked for listed as warnings."""
from __future__ import annotations

import dataclasses
import math

from lingjax.param_layout import Matrix
from checkpoints_convert.source import FLOAT_DTYPES, FP8_DTYPE, SourceReader
from checkpoints_convert.specs import ParamSpec


@dataclasses.dataclass
class Source:
    name: str                  # resolved tensor name in the checkpoint
    scale: str | None          # its weight_scale_inv (fp8 only)
    nbytes: int


@dataclasses.dataclass
class Validation:
    sources: dict[tuple, list[Source]]      # param path -> its sources, in plan order
    problems: list[str]
    unexpected: list[str]


def validate(reader: SourceReader, specs: list[ParamSpec], fp8_block: tuple[int, int],
             ignore=lambda name: False) -> Validation:
    problems: list[str] = []
    sources: dict[tuple, list[Source]] = {}
    used: set[str] = set()
    for spec in specs:
        if spec.layout.n_sources(spec.shape) != len(spec.sources):
            raise RuntimeError(f"layout of {spec.key} expects {spec.layout.n_sources(spec.shape)} sources, "
                               f"the plan has {len(spec.sources)}")
        want = spec.layout.source_shape(spec.shape)
        found = []
        for name in spec.sources:
            resolved = reader.resolve(name)
            if resolved is None:
                problems.append(f"missing tensor {name}")
                continue
            used.add(resolved)
            shape, dtype = reader.shape(resolved), reader.dtype(resolved)
            if shape != want:
                problems.append(f"{resolved} has shape {list(shape)}, expected {list(want)}")
            scale = None
            if dtype == FP8_DTYPE:
                scale = reader.scale_name(resolved)
                problems += _check_fp8(reader, spec, resolved, scale, want, fp8_block)
                if scale:
                    used.add(scale)
            elif dtype not in FLOAT_DTYPES:
                problems.append(f"{resolved} has dtype {dtype}, expected a float type "
                                f"({', '.join(sorted(FLOAT_DTYPES))}, or {FP8_DTYPE} with weight_scale_inv)")
            nbytes = reader.nbytes(resolved) + (reader.nbytes(scale) if scale else 0)
            found.append(Source(resolved, scale, nbytes))
        sources[spec.path] = found
    unexpected = sorted(n for n in reader.keys() if n not in used and not ignore(n))
    return Validation(sources, problems, unexpected)


def _check_fp8(reader, spec, name, scale, want, block) -> list[str]:
    if not isinstance(spec.layout, Matrix):
        return [f"{name} is {FP8_DTYPE}, but {spec.key} must be stored in high precision"]
    if scale is None:
        return [f"{name} is {FP8_DTYPE} but the checkpoint has no {name}_scale_inv"]
    grid = [math.ceil(want[0] / block[0]), math.ceil(want[1] / block[1])]
    out = []
    if list(reader.shape(scale)) != grid:
        out.append(f"{scale} has shape {list(reader.shape(scale))}, expected {grid} for "
                   f"{block[0]}x{block[1]} blocks (is --fp8-block right?)")
    if reader.dtype(scale) not in FLOAT_DTYPES:
        out.append(f"{scale} has dtype {reader.dtype(scale)}, expected a float type")
    return out
