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
COPY_BW_H200 = 4.3e12     # bytes/s: the H200's device-to-device copy bandwidth (read + write), spec/gpu.md


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


def emit_record(record: dict, json_path: str | None) -> None:
    """Print record as one JSON line (a benchmark's last line) and, with json_path, write it there."""
    text = json.dumps(record)
    print(text)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(text + "\n")


def block(x):
    """Wait for every array in a pytree."""
    import jax
    jax.block_until_ready(x)
    return x


def int_list(ap, text: str, flag: str) -> list[int]:
    """'1,9,16' -> [1, 9, 16] for a command-line flag; a non-integer exits 2 via ap.error."""
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        ap.error(f"{flag} must be comma-separated integers, got {text!r}")


def choice_list(ap, text: str, flag: str, choices) -> list[str]:
    """'serial,async' -> ['serial', 'async'] for a command-line flag whose values must be distinct
    members of `choices` (empty text: []); anything else exits 2 via ap.error."""
    vals = [t.strip() for t in text.split(",") if t.strip()]
    if set(vals) - set(choices) or len(set(vals)) != len(vals):
        ap.error(f"{flag} must be a comma list of distinct {', '.join(choices)}, got {text!r}")
    return vals


def add_layer_loop_args(ap, profile_help: str) -> None:
    """The options the one-layer in-loop benchmarks share (bench.moe_layer_timing,
    bench.mla_layer_timing): --iters, --seed, --tiny, --profile, --out, --no-xla-defaults."""
    ap.add_argument("--iters", type=int, default=50, help="loop iterations per timing (default 50)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="the ling3-tiny preset (smoke runs on a CPU)")
    ap.add_argument("--profile", metavar="DIR", default=None, help=profile_help)
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    ap.add_argument("--no-xla-defaults", action="store_true", help="do not add the command-buffer XLA flags")


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


def loop_program(f, n_sets: int, iters: int, per_iter: int = 8, carry_last: bool = False):
    """(jitted run(arg_sets) -> outputs, calls per iteration) for `time_in_loop`. The loop carries
    each call's last output and a float32 tag per call (1, 2, ...: distinct, so XLA cannot prove
    two calls' carries equal and merge them; on the H200 its while-loop simplifier merged 8 calls
    of 3 weight sets into 3 when the carries started equal). Call j's first argument x (floating)
    becomes x + 0 * tag_j, tag_j itself becomes tag_j + 0 * (an element of call j's previous
    output), and (x, *rest) then pass through one optimization_barrier, so no part of a call is
    loop-invariant: XLA hoists neither the call nor its x-independent work (a dequantisation, a
    routing prologue) out of the loop.

    carry_last: the last argument is a state that f updates and returns, f(x, *rest, state) ->
    (out, new_state) of state's structure (a layer and its KV cache): call j's state starts as
    its argument set's and is carried from one iteration to the next (each call its own copy), so
    an update in place (a cache write) stays in place, as in a decode loop. Without it, a state
    taken from the loop-invariant argument sets is copied whole before every update. The carried
    state skips the barrier: it changes every iteration, so nothing can be hoisted from it."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    n_calls = max(per_iter, n_sets)

    @jax.jit
    def run(sets):
        picks = [sets[j % len(sets)] for j in range(n_calls)]
        for args in picks:
            if not jnp.issubdtype(jnp.result_type(args[0]), jnp.floating):
                raise TypeError(f"time_in_loop: the first argument must be a floating array (it carries the loop "
                                f"dependency), got {jnp.result_type(args[0])}")

        def body(i, carry):
            tags, prevs = carry
            deps = jnp.stack([jnp.sum(jax.tree.leaves(p)[0].ravel()[:1].astype(jnp.float32)) for p in prevs])
            tags = tags + 0.0 * deps                          # float 0 * y is not folded (NaN, inf)
            outs = []
            for j, args in enumerate(picks):
                x = args[0] + (0.0 * tags[j]).astype(args[0].dtype)
                if carry_last:
                    x, *rest = lax.optimization_barrier((x, *args[1:-1]))
                    rest = (*rest, prevs[j][1])
                else:
                    x, *rest = lax.optimization_barrier((x, *args[1:]))
                outs.append(f(x, *rest))
            return tags, tuple(outs)
        shapes = jax.eval_shape(lambda: tuple(f(*args) for args in picks))
        prevs = jax.tree.map(lambda sd: jnp.zeros(sd.shape, sd.dtype), shapes)
        if carry_last:
            def sig(tree):
                return jax.tree.structure(tree), [(jnp.shape(v), jnp.result_type(v)) for v in jax.tree.leaves(tree)]
            for args, out in zip(picks, shapes):
                if not (isinstance(out, tuple) and len(out) == 2 and sig(out[1]) == sig(args[-1])):
                    raise TypeError("time_in_loop(carry_last=True): f must return (out, new_state) with new_state "
                                    "of its last argument's structure, shapes and dtypes")
            prevs = tuple((p[0], args[-1]) for p, args in zip(prevs, picks))
        init = (jnp.arange(1, n_calls + 1, dtype=jnp.float32), prevs)
        return lax.fori_loop(0, iters, body, init)[1]

    return run, n_calls


def time_in_loop(f, arg_sets, iters: int, per_iter: int = 8, repeats: int = 3, carry_last: bool = False) -> float:
    """Seconds per call of f(*args) inside one jitted lax.fori_loop of `iters` iterations, each
    calling f max(per_iter, S) times and cycling over the S argument tuples of arg_sets (e.g. weight
    copies at different addresses, together larger than the H200's 60 MB L2, as a model's layers
    are). `loop_program` keeps every call, whole, inside the loop (no hoisting, merging or dead
    code); its dependency ops are small fused ops per call: subtract `loop_overhead` for the call's
    own time (`loop_fields`). No dispatch or host round trip per call (unlike `time_fn`). Median
    of `repeats` runs after one warm-up run (compile). carry_last: f's last argument is a state
    it updates and returns, carried across iterations (`loop_program`)."""
    import jax
    import numpy as np
    arg_sets = [tuple(a) for a in arg_sets]
    run, n_calls = loop_program(f, len(arg_sets), iters, per_iter, carry_last)
    jax.block_until_ready(run(arg_sets))
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(run(arg_sets))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) / (iters * n_calls)


def loop_overhead(arg_sets, iters: int, carry_last: bool = False, **kw) -> float:
    """`time_in_loop` of a call that does nothing but return its (dependency-added) first argument
    (and, with carry_last, its state unchanged): the per-call cost of the loop and of the
    dependency op, to subtract."""
    f = (lambda x, *rest: (x, rest[-1])) if carry_last else (lambda x, *rest: x)
    return time_in_loop(f, arg_sets, iters, carry_last=carry_last, **kw)


def loop_fields(name: str, t: float, overhead: float, nbytes: float, copy_bw: float) -> dict:
    """Record fields of one in-loop row: raw and net (minus the loop's own cost) µs per call, GB/s
    and % of COPY_BW_H200 (the targets' yardstick) and of the measured copy bandwidth for
    nbytes per call. A call within 10% of the overhead is not resolvable: an error field instead."""
    net = t - overhead
    out = {f"{name}_loop_raw_us": t * 1e6}
    if net < 0.1 * t:
        out[f"{name}_loop_error"] = (f"{t * 1e6:.2f} us per call is within 10% of the loop's own cost "
                                     f"({overhead * 1e6:.2f} us): not resolvable")
        return out
    out.update({f"{name}_loop_us": net * 1e6, f"{name}_GBps": nbytes / net / 1e9,
                f"{name}_pct_4p3": 100 * nbytes / net / COPY_BW_H200, f"{name}_pct_copy": 100 * nbytes / net / copy_bw})
    return out


def loop_timing(rows, arg_sets, iters: int, rec: dict, nbytes: float, copy_bw: float, *,
                smoke: bool = False) -> None:
    """In-loop timing of each (name, f) row on arg_sets into rec: loop_overhead_us, then each
    row's `loop_fields` (or its error). smoke: LOOP_SMOKE settings (interpret mode: not a
    timing). A failed overhead run is recorded as rec["loop_overhead_error"] and skips the rows."""
    kw = LOOP_SMOKE if smoke else {}
    try:
        overhead = loop_overhead(arg_sets, iters, **kw)
    except Exception as e:                        # noqa: BLE001 -- recorded, the caller's other rows still run
        rec["loop_overhead_error"] = f"{type(e).__name__}: {str(e)[:800]}"
        return
    rec["loop_overhead_us"] = overhead * 1e6
    for name, t in loop_rows(rows, iters, rec, arg_sets, **kw).items():
        rec.update(loop_fields(name, t, overhead, nbytes, copy_bw))


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


def compile_ahead(decoders: dict, inputs, samp, output_len: int, workers: int, name=str) -> dict:
    """AOT-compile every decoder's prefill and generation loop, `workers` XLA compilations at a time.

    decoders: {key: lingjax.spec_decode.Decoder}; inputs(key, dec) -> (prompt [1, T], draft override
    or None, PRNG key, step_cost) like the requests' (shapes matter, not values); name(key): its
    label in the progress lines. Tracing and lowering run in this thread (they hold the GIL); XLA's
    compile releases it, so the compilations overlap in the pool. On one device a loop is lowered
    from its prefill's output shapes and compiled alongside it; on several, once its prefill is
    compiled (the loop's input shardings are the prefill's output shardings).
    Returns {key: (prefill, loop)} executables for requests of `output_len` tokens: call them as
    prefill(params, prompt, limit, key, samp, step_cost) and loop(params, state, samp, override, max_steps)."""
    import jax
    import jax.numpy as jnp
    from concurrent.futures import ThreadPoolExecutor, as_completed

    t0 = time.perf_counter()
    out, args = {}, {}
    one_device = jax.device_count() == 1

    def timed(label, lowered):
        t = time.perf_counter()
        exe = lowered.compile()
        print(f"[compile ahead] {label} compiled in {time.perf_counter() - t:.0f}s", flush=True)
        return exe

    def state_of(info):
        return jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=getattr(o, "sharding", None)),
                            info)
    with ThreadPoolExecutor(workers) as pool:
        prefills, loops = {}, {}
        for key, dec in decoders.items():
            prompt, override, rkey, step_cost = args[key] = inputs(key, dec)
            t = time.perf_counter()
            lowered = dec.prefill.lower(dec.params, prompt, output_len, jnp.int32(output_len), rkey, samp, step_cost)
            print(f"[compile ahead] {name(key)} prefill lowered in {time.perf_counter() - t:.0f}s", flush=True)
            prefill = pool.submit(timed, f"{name(key)} prefill", lowered)
            if one_device:
                t = time.perf_counter()
                loop = dec.run.lower(dec.params, state_of(lowered.out_info), samp, override, output_len + 1)
                print(f"[compile ahead] {name(key)} loop lowered in {time.perf_counter() - t:.0f}s", flush=True)
                loops[pool.submit(timed, f"{name(key)} loop", loop)] = (key, prefill)
            else:
                prefills[prefill] = key
        for fut in as_completed(prefills):
            key = prefills[fut]
            dec, override = decoders[key], args[key][1]
            lowered = dec.run.lower(dec.params, state_of(fut.result().out_info), samp, override, output_len + 1)
            loops[pool.submit(timed, f"{name(key)} loop", lowered)] = (key, fut)
        for fut in as_completed(loops):
            key, prefill = loops[fut]
            out[key] = (prefill.result(), fut.result())
            print(f"[compile ahead] {name(key)}: ready at {time.perf_counter() - t0:.0f}s",
                  flush=True)
    print(f"[compile ahead] {len(out)} prefill + loop pairs in {time.perf_counter() - t0:.1f}s "
          f"({workers} at a time)", flush=True)
    return out
