"""The per-kernel table of a profiled in-loop benchmark (bench.moe_layer_timing, bench.mla_layer_timing,
bench.kda_layer_timing): trace a `bench.common.loop_program` loop once and list, per XLA kernel of
one call, the µs per call, the count per call, and what the kernel computes (the fused HLO opcodes
and the jax source ops named in its metadata). `time_layer` is those benchmarks' shared row: the
in-loop time of one layer call, and the table with a profile directory.
"""
from __future__ import annotations

import collections
import contextlib
import re
from pathlib import Path

_CALLS = re.compile(r"\bcalls=%?([^\s,{}()]+)")
_OPNAME = re.compile(r'op_name="([^"]*)"')
_OPCODE = re.compile(r"=\s*[^=]*?\s([a-z][a-z0-9\-]*)\(")


def fusion_summary(hlo_text: str) -> dict[str, str]:
    """{instruction: 'opcodes | source ops'} for the instructions of compiled HLO text: the opcodes
    of the computation it calls (a fusion's body; counts) and the last two parts of the jax op names
    in it (which lines of the model the kernel computes)."""
    comps: dict[str, list[str]] = {}
    instr_line: dict[str, str] = {}
    current = None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace():
            m = re.match(r"^(?:ENTRY\s+)?%?([^\s(]+)", line)
            current = m.group(1) if m else None
            comps.setdefault(current, [])
            continue
        m = re.match(r"^\s+(?:ROOT\s+)?%?([^\s=]+)\s*=", line)
        if m and current is not None:
            comps[current].append(line)
            instr_line[m.group(1)] = line
    out = {}
    for name, line in instr_line.items():
        body = comps.get(next(iter(_CALLS.findall(line)), None), [line])
        ops = collections.Counter(o for b in body for o in _OPCODE.findall(b)[:1]
                                  if o not in ("parameter", "constant", "bitcast"))
        srcs = {"/".join(n.split("/")[-2:]) for b in body for n in _OPNAME.findall(b)}
        out[name] = (" ".join(f"{o}x{c}" if c > 1 else o for o, c in ops.most_common(6))
                     + " | " + ", ".join(sorted(srcs))[:160])
    return out


def kernel_table(trace_dir: str, hlo_text: str, calls: int) -> list[dict]:
    """Kernels of the traced loop grouped by kernel name (the loop unrolls several layer calls, whose
    copies of a fusion share its kernel name): [{kernel, hlo_ops, us_per_call, count_per_call,
    what}] (most time first; `what` from the first HLO instruction); `calls` = layer calls traced."""
    from bench.profile_breakdown import kernel_events, load_events
    _, events = load_events(trace_dir)
    kernels, _, _ = kernel_events(events)
    summary = fusion_summary(hlo_text)
    acc: dict[str, list] = collections.defaultdict(lambda: [0.0, 0, []])
    for e in kernels:
        op = str(e.args.get("hlo_op", "?"))
        acc[e.name][0] += e.dur
        acc[e.name][1] += 1
        if op not in acc[e.name][2]:
            acc[e.name][2].append(op)
    rows = [{"kernel": k, "hlo_ops": ops, "us_per_call": t / calls, "count_per_call": n / calls,
             "what": summary.get(ops[0], "")} for k, (t, n, ops) in acc.items()]
    return sorted(rows, key=lambda r: -r["us_per_call"])


def profile_loop(f, sets, iters: int, trace_dir: str | Path, ctx=contextlib.nullcontext, per_iter: int = 8,
                 carry_last: bool = False) -> list[dict]:
    """Trace the `iters`-iteration `loop_program` of f over the argument sets once (after its
    compile, traced inside ctx()) into trace_dir and return its `kernel_table`. On a GPU the loop
    is compiled without command buffers: kernels inside a CUDA graph are mostly missing from
    device traces."""
    import jax

    from bench.common import loop_program
    run, n_calls = loop_program(f, len(sets), iters, per_iter, carry_last)
    with ctx():
        opts = {"xla_gpu_enable_command_buffer": ""} if jax.default_backend() == "gpu" else {}
        compiled = run.lower(sets).compile(compiler_options=opts)
        jax.block_until_ready(compiled(sets))
        with jax.profiler.trace(str(trace_dir)):
            jax.block_until_ready(compiled(sets))
    return kernel_table(str(trace_dir), compiled.as_text(), iters * n_calls)


def print_table(rows: list[dict], what: str = "call") -> None:
    """Print a `kernel_table`: its total, then one line per kernel (µs and count per call, name, what)."""
    tot = sum(r["us_per_call"] for r in rows)
    n = sum(r["count_per_call"] for r in rows)
    print(f"  {n:.0f} kernels, {tot:.1f} us of kernel time per {what}:")
    for r in rows:
        print(f"  {r['us_per_call']:7.2f} us x{r['count_per_call']:<5.2f} {r['kernel'][:34]:34s} {r['what']}")


def time_layer(f, sets, iters: int, *, ctx=contextlib.nullcontext, carry_last: bool = False,
               profile_dir: str | Path | None = None) -> dict:
    """One layer benchmark row: f's in-loop seconds per call over the argument sets
    (`bench.common.time_in_loop`, traced inside ctx()) minus the loop's own cost (`loop_overhead`),
    as {layer_us, raw_us, loop_overhead_us}; with profile_dir also {kernels: `profile_loop`'s table}
    (print it with `print_table`). Off a GPU one call per iteration and one repeat: a smoke run."""
    import jax

    from bench.common import loop_overhead, time_in_loop
    kw = {} if jax.default_backend() == "gpu" else {"per_iter": 1, "repeats": 1}
    with ctx():
        overhead = loop_overhead(sets, iters, carry_last=carry_last, **kw)
        t = time_in_loop(f, sets, iters, carry_last=carry_last, **kw)
    row = {"layer_us": (t - overhead) * 1e6, "raw_us": t * 1e6, "loop_overhead_us": overhead * 1e6}
    if profile_dir is not None:
        row["kernels"] = profile_loop(f, sets, iters, profile_dir, ctx, kw.get("per_iter", 8), carry_last=carry_last)
    return row
