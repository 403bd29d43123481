"""How the model's opt-in Pallas kernels (kda_kernel / moe_kernel / dense_kernel = 'pallas') are
run: compiled on a GPU, in Mosaic GPU interpret mode inside `pallas_interpret()` (CPU tests),
emitted for CUDA inside `pallas_cross_lowering()` (lowering checks on a CPU host), and split over
a device mesh inside `kernel_mesh(mesh)` (the Decoder sets it for sharded params; only the KDA
kernel splits). Each is a context seen only while tracing: a function jitted earlier keeps what it
was traced with."""
from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

from lingjax.kernel_flags import SWITCHES

_INTERPRET: contextvars.ContextVar = contextvars.ContextVar("pallas_interpret", default=None)
_MESH: contextvars.ContextVar = contextvars.ContextVar("pallas_kernel_mesh", default=None)


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar, value):
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def pallas_interpret(params=None):
    """Kernels traced inside this block run in Mosaic GPU interpret mode (`params`: a
    plgpu.InterpretGPUParams, default plain) — how CPU tests run the Pallas paths."""
    return _setting(_INTERPRET, params if params is not None else plgpu.InterpretGPUParams())


def pallas_cross_lowering():
    """Kernels traced inside this block are emitted compiled even off-GPU, for
    `.lower(lowering_platforms=("cuda",))` checks on a CPU host (nothing can run)."""
    return _setting(_INTERPRET, False)


def kernel_mesh(mesh):
    """Kernels traced inside this block that know how to split (the KDA kernel, by heads over
    'tp') run per device under shard_map on `mesh` (None or a one-device mesh: not split)."""
    return _setting(_MESH, mesh if mesh is not None and mesh.size > 1 else None)


def current_mesh():
    """The mesh set by `kernel_mesh` (None: one device)."""
    return _MESH.get()


def interpret_arg(switch: str):
    """The `interpret=` argument for a kernel call of the `switch` ('kda_kernel' / 'moe_kernel' /
    'dense_kernel'):
    False (compile) on a GPU or under pallas_cross_lowering, the params under pallas_interpret;
    a ValueError saying what to do on any other backend."""
    interpret = _INTERPRET.get()
    if interpret is None and jax.default_backend() != "gpu":
        raise ValueError(f"{switch}='pallas' runs a Mosaic GPU kernel, which needs an NVIDIA Hopper GPU; "
                         f"the backend is {jax.default_backend()!r}. Use {switch}='xla' (tests on CPU trace "
                         "the model inside lingjax.model.kernels.pallas_interpret()).")
    return interpret or False


@functools.cache
def _jitted(fn, static: tuple[str, ...]):
    return jax.jit(fn, static_argnames=static)


def shared_call(fn, *arrays, **settings):
    """fn(*arrays, **settings) through one cached `jax.jit` per kernel entry point.

    Inside a traced program, calls with the same shapes and settings then lower to ONE function
    that each call site calls: a Mosaic GPU kernel's serialized module (up to ~2 MB) appears once
    per program instead of once per layer. XLA's compile time grows with that text at every call
    site (bench.compile_scaling), which made the 42-layer programs compile for 5 minutes and more.
    arrays: positional array arguments (or None); settings: static keyword settings (hashable).
    The numbers are those of fn called directly, and each call keeps its call site's name scope
    in a profile (bench.profile_breakdown on the H200 attributes the calls per layer kind)."""
    return _jitted(fn, tuple(sorted(settings)))(*arrays, **settings)


def check_runnable(kernels: dict[str, str], mesh) -> None:
    """ValueError, saying what to do, for a 'pallas' switch this process cannot run: no GPU backend,
    or a mesh for a kernel that is not split over devices. `kernels`: {switch name: value}."""
    for name, _, on_mesh in SWITCHES:
        flag = "--" + name.replace("_", "-")
        if kernels.get(name, "xla") != "pallas":
            continue
        if mesh is not None and not on_mesh:
            raise ValueError(f"{flag} pallas with --mesh is not supported yet: the kernel is not split over "
                             f"devices; use {flag} xla")
        if jax.default_backend() != "gpu":
            raise ValueError(f"{flag} pallas needs an NVIDIA Hopper GPU (a Mosaic GPU kernel); the backend is "
                             f"{jax.default_backend()!r}: use {flag} xla")
