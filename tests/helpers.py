"""Small helpers shared by tests: golden model loading (cached), relative error, random configs."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import mosaic_gpu as plgpu

from conftest import LING_TINY
from lingjax.config import LingConfig
from lingjax.model.ling import LingModel
from lingjax.weights import load_hf_model


# Mosaic GPU interpret mode runs on the CPU backend only (CI); on a GPU the test_gpu_* tests run
# the compiled kernels instead.
interpret_only = pytest.mark.skipif(jax.default_backend() == "gpu",
                                    reason="Mosaic GPU interpret mode runs on the CPU backend only; on a GPU the "
                                           "test_gpu_* tests run the compiled kernel")


# jax 0.12's interpret mode raises on a race (InterpretGPUParams.on_race); 0.11.2 prints it and
# flags it in private state, which the Mosaic GPU kernel tests check after each interpreted call.
RACES_RAISE = "on_race" in getattr(plgpu.InterpretGPUParams, "__dataclass_fields__", {})


def assert_no_race_flagged():
    """Fail if interpret mode flagged a race (jax 0.11.2; with 0.12 the kernel call raised already)."""
    if not RACES_RAISE:
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
        assert not gpu_callbacks.get_races().races_found, "interpret mode detected a race"


def kernel_mode():
    """The kernel switches' test mode: Mosaic GPU interpret mode off-GPU, the compiled kernels on a GPU."""
    import contextlib
    from lingjax.model.kernels import pallas_interpret
    if jax.default_backend() == "gpu":
        return contextlib.nullcontext()
    return pallas_interpret()


def kernel_forward(model, tokens, cache, **kw):
    """One jitted forward of `model` (model(tokens, cache, **kw)) in `kernel_mode`."""
    with kernel_mode():
        return jax.jit(lambda t, c: model(t, c, **kw))(tokens, cache)


def _eqns(jaxpr, stop=lambda eqn: False):
    """Every equation of one run of `jaxpr`, those of nested jaxprs (calls, loops, kernels)
    included, but not inside an equation `stop` accepts (that one is yielded, its body is not)."""
    for eqn in jaxpr.eqns:
        yield eqn
        if stop(eqn):
            continue
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner, stop)


def kernel_call_shapes(fn, *args, name: str) -> list[tuple[int, ...]]:
    """The first operand's shape of each call of the jitted kernel entry point `name`
    (lingjax.model.kernels.shared_call jits it under the function's name) that one run of
    fn(*args) makes, traced in `kernel_mode`."""
    with kernel_mode():
        closed = jax.make_jaxpr(fn)(*args)

    def is_call(eqn) -> bool:
        return eqn.primitive.name in ("pjit", "jit") and eqn.params.get("name") == name
    return [tuple(e.invars[0].aval.shape) for e in _eqns(closed.jaxpr, is_call) if is_call(e)]


def primitive_calls(fn, *args, name: str) -> int:
    """How many times one run of fn(*args), traced in `kernel_mode`, applies the primitive `name`
    outside kernel bodies (each call site of a nested jitted function counted)."""
    with kernel_mode():
        closed = jax.make_jaxpr(fn)(*args)
    return sum(e.primitive.name == name for e in _eqns(closed.jaxpr, lambda e: e.primitive.name == "pallas_call"))


def kernel_calls(fn, *args, name: str) -> int:
    """How many calls of the kernel entry point `name` one run of fn(*args) makes (kernel_call_shapes)."""
    return len(kernel_call_shapes(fn, *args, name=name))


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@functools.lru_cache(maxsize=None)
def golden():
    return dict(np.load(LING_TINY / "golden.npz"))


@functools.lru_cache(maxsize=None)
def golden_model(dtype_name: str) -> LingModel:
    return load_hf_model(LING_TINY, dtype=jnp.dtype(dtype_name))


def tiny_config(**overrides) -> LingConfig:
    """The golden tiny config with overrides (random-config tests)."""
    base = LingConfig.from_json(LING_TINY / "config.json")
    return base.replace(**overrides)


def random_model(cfg: LingConfig, dtype=jnp.float64, seed: int = 0, with_mtp=None,
                 bias_std: float = 0.05) -> LingModel:
    """A LingModel with random weights. bias_std: spread of the routers' expert_bias (a wide one,
    e.g. 1.0, spreads the biased scores, so no token's top-k sits on a near-tie that a kernel's
    different rounding would flip; the kernel-switch tests use it)."""
    model = LingModel(cfg, dtype=dtype, rngs=nnx.Rngs(seed), with_mtp=with_mtp)
    # give expert_bias / A_log / dt_bias non-trivial values so routing and gates are exercised
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if path[-1] == "expert_bias":
            var.set_value(jnp.asarray(rng.normal(0, bias_std, var.shape), var.dtype))
    return model
