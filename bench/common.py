"""Shared benchmark plumbing: environment record, timing, result files (bench/results/*.json)."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def env_info() -> dict:
    import jax
    import jaxlib
    dev = jax.devices()[0]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    return {"device": getattr(dev, "device_kind", str(dev)), "n_devices": jax.device_count(),
            "backend": jax.default_backend(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "python": platform.python_version(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "git_commit": commit, "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def save_result(name: str, record: dict, out_dir: str | Path | None = None) -> Path:
    """Write record (plus env info) to <out_dir or bench/results>/<name>-<timestamp>.json and print one JSON line."""
    record = {**record, "env": env_info()}
    d = Path(out_dir) if out_dir else RESULTS
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=1))
    print(json.dumps(record))
    return path


def block(x):
    """Wait for every array in a pytree."""
    import jax
    jax.block_until_ready(x)
    return x


def time_fn(f, args, iters, warmup):
    """(median seconds of one blocked call, seconds per call when issued back to back)."""
    import jax
    import numpy as np
    for _ in range(max(1, warmup)):
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    t = time.perf_counter()
    outs = [f(*args) for _ in range(iters)]
    jax.block_until_ready(outs)
    return float(np.median(ts)), (time.perf_counter() - t) / iters


LOOP_SMOKE = {"per_iter": 1, "repeats": 1}


def loop_program(f, n_sets: int, iters: int, per_iter: int = 8):
    """(jitted run(arg_sets) -> outputs, calls per iteration) for `time_in_loop`."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    n_calls = max(per_iter, n_sets)

    @jax.jit
    def run(sets):
        picks = [sets[j % len(sets)] for j in range(n_calls)]

        def body(i, carry):
            outs = []
            for args, prev in zip(picks, carry):
                x = args[0]
                dep = jax.tree.leaves(prev)[0].reshape(-1)[0].astype(jnp.float32)
                x = (x.astype(jnp.float32) + 0.0 * dep).astype(x.dtype)   # float x * 0 is not folded
                outs.append(f(x, *args[1:]))
            return tuple(outs)
        shapes = jax.eval_shape(lambda: tuple(f(*args) for args in picks))
        # distinct initial values: calls reading the same arrays would otherwise carry values
        # XLA can prove equal (same init, same update), and its while-loop simplifier merges such
        # carry elements, i.e. the calls (seen on the H200: 8 calls of 3 weight sets ran as 3)
        init = tuple(jax.tree.map(lambda sd, j=j: jnp.full(sd.shape, j + 1, sd.dtype), out)
                     for j, out in enumerate(shapes))
        return lax.fori_loop(0, iters, body, init)

    return run, n_calls     # time_in_loop settings for interpret-mode smoke runs


def time_in_loop(f, arg_sets, iters: int, per_iter: int = 8, repeats: int = 3) -> float:
    """Seconds per call of f(*args) inside one jitted lax.fori_loop of `iters` iterations, each
    calling f max(per_iter, S) times and cycling over the S argument tuples of arg_sets (e.g. weight
    copies at different addresses, together larger than the H200's 60 MB L2, as a model's layers
    are). Call j's first argument x (a floating array) becomes x + 0 * (one element of call j's
    previous output, from the loop carry), so XLA can neither hoist the calls out of the loop nor
    merge two calls reading the same arrays (an optimization_barrier does not stop that), and
    every output is part of the carry, so none is dropped. That dependency is one small fused op
    per call: subtract `loop_overhead` for the call's own time. No dispatch or host round trip per
    call (unlike `time_fn`). Median of `repeats` runs after one warm-up run (compile)."""
    import jax
    import numpy as np
    arg_sets = [tuple(a) for a in arg_sets]
    run, n_calls = loop_program(f, len(arg_sets), iters, per_iter)
    jax.block_until_ready(run(arg_sets))
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(run(arg_sets))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) / (iters * n_calls)


def loop_overhead(arg_sets, iters: int, **kw) -> float:
    """`time_in_loop` of a call that does nothing but return its (dependency-added) first argument:
    the per-call cost of the loop and of the dependency op, to subtract."""
    return time_in_loop(lambda x, *rest: x, arg_sets, iters, **kw)


def loop_rows(rows, iters: int, rec: dict, arg_sets, **kw) -> dict:
    """`time_in_loop` (kw: per_iter, repeats) of each (name, f) row on the same arg_sets: {name:
    seconds per call}. A row that fails is recorded as rec[f"{name}_loop_error"] and left out; the others still run."""
    out = {}
    for name, f in rows:
        try:
            out[name] = time_in_loop(f, arg_sets, iters, **kw)
        except Exception as e:          # noqa: BLE001 -- recorded in the result, not swallowed
            rec[f"{name}_loop_error"] = f"{type(e).__name__}: {str(e)[:800]}"
    return out


def time_rows(rows, iters, warmup, rec: dict) -> dict:
    """`time_fn` for each (name, f, args) row: {name: (median s, pipelined s)}. A row that fails
    (compile error, OOM) is recorded as rec[f"{name}_error"] and left out; the others still run."""
    out = {}
    for name, f, args in rows:
        try:
            out[name] = time_fn(f, args, iters, warmup)
        except Exception as e:          # noqa: BLE001 -- recorded in the result, not swallowed
            rec[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:800]}"
    return out


def kernel_interpret(ap, a, what: str):
    """For kernel benchmarks: plgpu interpret params under --interpret, else False; exits with a
    clear message when a Mosaic GPU kernel would be compiled on a non-GPU backend."""
    import jax
    from jax.experimental.pallas import mosaic_gpu as plgpu
    backend = jax.default_backend()
    if not a.interpret and backend != "gpu":
        ap.error(f"{what} compile(s) for an NVIDIA Hopper GPU; this backend is {backend!r}: pass "
                 "--interpret for a CPU smoke run at small shapes")
    return plgpu.InterpretGPUParams() if a.interpret else False

