"""What to convert: one `ParamSpec` per model parameter, from the shared mapping tables
(`lingjax.weights.plan_for` for Ling, the DSpark draft's weight map for drafts) and the model's
abstract (`nnx.eval_shape`) parameters."""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from lingjax.param_layout import (DRAFT_HIGH_PRECISION, DRAFT_LAYOUTS, LING_HIGH_PRECISION, Conv,
                                        Matrix, Vector, ling_layout)
from lingjax.checkpoint import param_key
from lingjax.sharding import variable_logical


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    path: tuple                          # nnx state path of the parameter
    sources: tuple[str, ...]             # published tensor names (before alias / prefix resolution)
    build: Callable[..., np.ndarray]     # build(*sources) -> the stored layout
    shape: tuple[int, ...]               # the model's parameter shape
    wide: bool                           # the model keeps it in float32 even when running bf16
    layout: Matrix | Vector | Conv
    quantisable: bool                    # may be stored as block fp8
    group: str                           # parts never mix groups: 'top', 'layers.3', 'mtp'
    logical: tuple | None                # the parameter's logical axis names (lingjax.sharding)

    @property
    def key(self) -> str:
        return param_key(self.path)


def _abstract_params(module) -> dict[tuple, nnx.Variable]:
    return dict(nnx.to_flat_state(nnx.state(module)))


def _group(path: tuple) -> str:
    if path[0] == "layers":
        return f"layers.{path[1]}"
    return "mtp" if path[0] == "mtp" else "top"


def ling_specs(cfg, with_mtp: bool) -> list[ParamSpec]:
    from lingjax.model.ling import LingModel
    from lingjax.weights import plan_for
    params = _abstract_params(nnx.eval_shape(lambda: LingModel(cfg, dtype=jnp.bfloat16, with_mtp=with_mtp)))
    plans = plan_for(cfg, with_mtp)
    if set(plans) != set(params):
        raise RuntimeError(f"plan_for and LingModel disagree: {sorted(set(plans) ^ set(params))[:5]}")
    specs = []
    for path, plan in plans.items():
        v = params[path].get_value()
        layout = ling_layout(path, v.shape)
        specs.append(ParamSpec(path, plan.sources, plan.build, tuple(v.shape), v.dtype == jnp.float32, layout,
                               isinstance(layout, Matrix) and path[-1] not in LING_HIGH_PRECISION, _group(path),
                               variable_logical(params[path])))
    return specs


def draft_specs(cfg) -> list[ParamSpec]:
    from lingjax.model.dspark import DSparkDraft, draft_weight_map
    model = nnx.eval_shape(lambda: DSparkDraft(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    paths = {id(v): p for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)}
    specs = []
    for name, (var, how) in draft_weight_map(model).items():
        v, layout, path = var.get_value(), DRAFT_LAYOUTS[how], paths[id(var)]
        specs.append(ParamSpec(path, (name,), functools.partial(layout.build, tuple(v.shape)), tuple(v.shape),
                               v.dtype == jnp.float32, layout,
                               isinstance(layout, Matrix) and name not in DRAFT_HIGH_PRECISION, _group(path),
                               variable_logical(var)))
    return specs
