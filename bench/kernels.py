"""The fused KDA step kernel against the model's XLA path at Ling shapes: time, error, % of the memory floor.

    python -m bench.kernels [--iters 200] [--block-v 16,32,64,128] [--cases verify9] [--states 35] [--out DIR]
    python -m bench.kernels --cases verify9 --variants "EXP2=False;EXP2=True"   # an A/B of kernel settings
    python -m bench.kernels --interpret --iters 2      # CPU smoke: interpret mode, small shapes

Cases (B=1, H=32, K=V=128; the input projection, conv window and weights bf16; gate parameters,
beta and the state fp32, as in the model). Each row is everything a KDA layer does between its
input projection and its output norm: conv + SiLU, L2 norms, gate, the recurrence.
  decode  T=1   kda_fused_step_pallas (o, state)       vs conv ... + kda_step                (the XLA decode path)
  verify  T=9   kda_fused_step_pallas (o)              vs conv ... + kda_chunked             (the XLA verify path)
  verify  T=16  kda_fused_step_pallas (o)              vs conv ... + kda_chunked
  commit  T=9   kda_fused_step_pallas (state, n=5)     vs conv ... + kda_state_after_prefix (accepted prefix n=5)
A decode or commit has two kernel rows: a new state array, and ``in place`` (state_in_place=True: the
kernel overwrites its state operand, as the model runs it).

Time: `call` = median of --iters jitted calls, each blocked on (includes dispatch); `loop` = one
jitted lax.fori_loop of --iters calls, 8 per loop iteration (the loop's own cost spread over them),
each taking the previous call's state and one of 4 input draws in turn (no dispatch, nothing
loop-invariant to hoist), median of 3 runs / --iters; the chained 4 MiB state may stay in the L2;
the loop's per-call input selection and plumbing are counted in (a verify, which writes no state,
passes its input state on through a one-element update that depends on its o: `next_state`).
`states` (--states N, session 32):
the kernel rows' loop over N distinct states, one call per state per iteration (N = 35, the model's
KDA layers, keeps the states out of the L2 as in the model; not for the XLA rows). `net` (session
21) = the layer benchmarks' in-loop time (bench.kernel_table.time_layer: 8 calls per iteration over the 4 draws,
each call carrying its own state from iteration to iteration, minus the loop's own per-call cost
measured with a call that does nothing): the measure the whole-layer benchmarks use. --profile DIR
adds, per row, the table of XLA / Mosaic kernels one call of that loop runs. Warm-up (compile) runs
are excluded. Floor = the bytes a call must move (state read, and written unless a
verify, inputs, outputs) / the device copy bandwidth measured in this run; `%floor` = floor time /
measured time (the table shows it for `loop`, the JSON for both). Errors: max |kernel - XLA| (and
relative to max |XLA|), and the relative RMSE of each row against the float64 reference
(lingjax.ops.kda.kda_fused_step on the same inputs).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from pathlib import Path
from typing import Callable

from bench.common import int_list, time_fn
from lingjax import xla_env

LING = dict(B=1, H=32, K=128)           # Ling-3.0-flash KDA: 32 heads x 128
SMALL = dict(B=1, H=2, K=64)            # --interpret (CPU smoke)
COMMIT_N = 5
LOOP_SETS = 4                           # distinct input draws cycled through by the timing loop


@dataclasses.dataclass
class Case:
    name: str
    T: int
    commit: bool = False                # state only (replay commit of the first COMMIT_N tokens)

    @property
    def verify(self) -> bool:           # o only (a pending verify block's final state is never used)
        return self.T > 1 and not self.commit


CASES = (Case("decode", 1), Case("verify", 9), Case("verify", 16), Case("commit", 9, commit=True))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=200, help="timed calls per measurement")
    ap.add_argument("--block-v", default="", help="comma list of block_v values (state columns per program) to "
                                                 "compare (default: the kernel's default)")
    ap.add_argument("--interpret", action="store_true",
                    help="run the kernels in Mosaic GPU interpret mode at small shapes (CPU smoke; times meaningless)")
    ap.add_argument("--copy-mib", type=int, default=None,
                    help="size of the bandwidth-probe array (default 1024 MiB on GPU, 8 otherwise)")
    ap.add_argument("--cases", default="", help="comma list of the cases to run, by name and T: "
                    + ",".join(f"{c.name}{c.T}" for c in CASES) + " (default: all)")
    ap.add_argument("--states", type=int, default=0, metavar="N",
                    help="also time each kernel row over N distinct states, one call per state per loop iteration "
                         "(`us/states`; 35 = the model's KDA layers: the states cannot stay in the L2 as the "
                         "chained single state of `us/loop` can); 0 = off")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    ap.add_argument("--no-xla-defaults", action="store_true", help="do not add the command-buffer XLA flags")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="trace each row's `net` loop once more into DIR/<case>-T<T>-<impl> and print the kernels "
                         "of one call (bench.kernel_table)")
    ap.add_argument("--variants", default="", metavar="SETS",
                    help="kernel rows per setting group of pallas_kernels.kda_step_fused, ';'-separated groups of "
                         "comma-separated NAME=VALUE (Python literals), e.g. 'EXP2=False;EXP2=True': "
                         "an A/B in one process (the XLA row and the inputs shared); default: the module's settings")
    ap.add_argument("--no-xla", action="store_true",
                    help="leave out the XLA row of each case (it compiles slowly: ~90 s a case on an H100); the "
                         "first kernel row is then the one the others' max|d.| compare with")
    ap.add_argument("--own-barriers", action="store_true",
                    help="compile the fused step without Pallas' automatic SMEM barriers (kda_step_fused.OWN_BARRIERS "
                         "= True; off by default: no full-depth gain measured) for an A/B")
    return ap


def make_inputs(B, T, H, K, seed=0):
    """(proj [B,T,5,H,K], window [B,3,3,H,K], conv_w [4,3,H,K], A_log [H], dt_bias [H,K], beta [B,T,H])
    and state [B,H,K,K]. The gate parameters put g near 0 (weak decay) so that a state chained over
    many loop iterations stays bounded."""
    import jax
    import jax.numpy as jnp
    r = jax.random.split(jax.random.PRNGKey(seed), 7)
    f32, bf16 = jnp.float32, jnp.bfloat16
    proj = jax.random.normal(r[0], (B, T, 5, H, K), f32).astype(bf16)
    window = jax.random.normal(r[1], (B, 3, 3, H, K), f32).astype(bf16)
    conv_w = (0.5 * jax.random.normal(r[2], (4, 3, H, K), f32)).astype(bf16)
    A_log = jnp.full((H,), -4.0, f32)                       # exp(A_log) small: g ~ -2.5 * exp(-4)
    dt_bias = jax.random.normal(r[3], (H, K), f32)
    beta = jax.nn.sigmoid(jax.random.normal(r[4], (B, T, H), f32))
    state = jax.random.normal(r[5], (B, H, K, K), f32)
    return (proj, window, conv_w, A_log, dt_bias, beta), state


def floor_bytes(case: Case, xs, state) -> int:
    """Bytes one call must move: the state read (and written unless a verify), the projection's q, k,
    v, f channels, the window, weights and gate parameters, the fp32 outputs."""
    proj, *rest = xs
    ins = proj.size * proj.dtype.itemsize * 4 // proj.shape[2] + sum(x.size * x.dtype.itemsize for x in rest)
    out = 0 if case.commit else proj.shape[0] * proj.shape[1] * proj.shape[3] * proj.shape[4] * 4
    return (1 if case.verify else 2) * state.size * 4 + ins + out


def xla_path(case: Case, xs, s):
    """What the model's XLA path computes for the case (lingjax/model/kda.py): (o, state) / (o, s) / (state,)."""
    import jax.numpy as jnp
    from lingjax.ops import kda as ops
    proj, window, conv_w, A_log, dt_bias, beta = xs
    T = proj.shape[1]
    q, k, v, g = ops.kda_block_inputs(jnp.concatenate([window, proj[:, :, :3]], axis=1), proj[:, :, 3],
                                      conv_w, A_log, dt_bias)
    if case.commit:
        return (ops.kda_state_after_prefix(s, k, v, g, beta, jnp.int32(COMMIT_N)),)
    if T == 1:
        o, s1 = ops.kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s)
        return o[:, None], s1
    return ops.kda_chunked(q, k, v, g, beta, s)[0], s


def next_state(outs, state):
    """The state the timing loops (`time_loop`, `time_loop_states`) pass to the next call: the
    call's last output. A call that returns its input `state` itself (a verify, which writes no
    state) passes it on made to depend on the call's o by a one-element in-place update that adds
    0 * o[0] (XLA keeps a float x * 0, which is not 0 for inf / NaN; the state is unchanged for a
    finite o). Without a data dependency XLA
    dropped every verify call of a loop iteration but the last (an optimization barrier on (s, o)
    did not stop it): the verify `loop` rows up to session 32 (and session 15's 9.9 us) timed one
    kernel per 8 calls, run 121. The update is one tiny kernel per call, counted in those rows."""
    s = outs[-1]
    if s is not state:
        return s
    dep = outs[0].reshape(-1)[0].astype(s.dtype) * 0.0
    return s.at[(0,) * s.ndim].add(dep)


def chained_call(fn, xs, state):
    """fn(xs, state) with its last output replaced by `next_state` (what a timing loop chains)."""
    outs = fn(xs, state)
    return (*outs[:-1], next_state(outs, state))


def parse_variants(text: str) -> list[dict]:
    """'A=1,B=True;A=2' -> [{'A': 1, 'B': True}, {'A': 2}], settings of pallas_kernels.kda_step_fused
    (bench.with_settings.parse); '' -> [{}] (the module's settings). ValueError saying what is wrong."""
    from bench.with_settings import parse
    from pallas_kernels import kda_step_fused as kf
    return [dict(parse(kf, item) for item in group.split(",") if item.strip())
            for group in [g for g in text.split(";") if g.strip()] or [""]]


def with_kernel_settings(fn, settings: dict):
    """fn with pallas_kernels.kda_step_fused's module settings changed while it runs (they are read
    when the kernel is traced, which happens inside the jitted programs that call this)."""
    from pallas_kernels import kda_step_fused as kf
    if not settings:
        return fn

    def run(*args):
        old = {k: getattr(kf, k) for k in settings}
        try:
            for k, v in settings.items():
                setattr(kf, k, v)
            return fn(*args)
        finally:
            for k, v in old.items():
                setattr(kf, k, v)
    return run


def impls(case: Case, V: int, block_vs, interpret, variants=({},), xla: bool = True) -> list[tuple[str, Callable]]:
    """[(label, f(xs, state) -> outputs tuple whose last entry is the state to chain)], XLA first (unless
    xla=False); kernel rows for each block_v and each settings group of `variants` (parse_variants)."""
    out = [("xla " + ("kda_state_after_prefix" if case.commit else "kda_step" if case.T == 1 else "kda_chunked"),
            lambda xs, s: xla_path(case, xs, s))] if xla else []
    for settings in variants:
        tag = " ".join(f"{k}={v}" for k, v in settings.items())
        out += [(label + (f" {tag}" if tag else ""), with_kernel_settings(fn, settings))
                for label, fn in _kernel_impls(case, V, block_vs, interpret)]
    return out


def _kernel_impls(case: Case, V: int, block_vs, interpret) -> list[tuple[str, Callable]]:
    import jax.numpy as jnp
    from pallas_kernels import kda_step_fused as kf
    out = []
    for bv in block_vs:
        label = f"pallas bv={kf.pick_block_v(V, bv)}"
        if case.verify:
            out.append((label, lambda xs, s, bv=bv: (kf.kda_fused_step_pallas(
                *xs, s, write_state=False, block_v=bv, interpret=interpret)[0], s)))
            continue
        for in_place in (False, True):      # the model updates the state in place (kda.STATE_IN_PLACE)
            tag = label + (" in place" if in_place else "")
            if case.commit:
                fn = lambda xs, s, bv=bv, ip=in_place: (kf.kda_fused_step_pallas(
                    *xs, s, jnp.int32(COMMIT_N), write_o=False, block_v=bv, state_in_place=ip,
                    interpret=interpret)[1],)
            else:
                fn = lambda xs, s, bv=bv, ip=in_place: kf.kda_fused_step_pallas(
                    *xs, s, block_v=bv, state_in_place=ip, interpret=interpret)
            out.append((tag, fn))
    return out


def oracle(case: Case, xs, state):
    """float64 (o or None, state after the block or prefix) on the same inputs."""
    import jax
    import jax.numpy as jnp
    from lingjax.ops.kda import kda_fused_step
    f64 = [x.astype(jnp.float64) for x in (*xs, state)]
    n = jnp.int32(COMMIT_N) if case.commit else None
    o, s = jax.jit(kda_fused_step)(*f64, n)
    return (None if case.commit else o), s


def time_loop(fn, xs_sets, state, iters: int, repeats: int = 3, unroll: int = 8) -> float:
    """Seconds per call inside one jitted fori_loop chaining the state through `iters` calls,
    `unroll` calls per loop iteration (so the loop's own per-iteration cost, a few us on a GPU, is
    spread over them). xs_sets: the inputs stacked over a leading axis of LOOP_SETS different
    draws; call n reads draw n % LOOP_SETS, so XLA cannot hoist the state-independent work out of
    the loop. The chained state (4 MiB at Ling shapes) can stay in the 60 MB L2 between calls,
    which the model's 35 different layer states cannot: an optimistic bound for the state traffic
    (a verify chains its o instead: `next_state`)."""
    trips = max(1, iters // unroll)
    run = chained_loop(fn, xs_sets, state, trips, unroll)
    return _median_seconds(run, (xs_sets, state), repeats) / (trips * unroll)


def chained_loop(fn, xs_sets, state, trips: int, unroll: int):
    """`time_loop`'s program: jitted run(xs_sets, state), a fori_loop of `trips` iterations of
    `unroll` chained calls of fn (each given `next_state` of the call before)."""
    import jax
    from jax import lax
    shapes = jax.eval_shape(fn, _draw_picker(xs_sets)(0), state)

    def body(pick, i, c):
        for j in range(unroll):
            c = chained_call(fn, pick(i * unroll + j), c[-1])
        return c

    @jax.jit
    def run(xs_sets, state):
        init = (*(jax.numpy.zeros(a.shape, a.dtype) for a in shapes[:-1]), state)
        return lax.fori_loop(0, trips, functools.partial(body, _draw_picker(xs_sets)), init)

    return run


def _draw_picker(xs_sets):
    """pick(n): the inputs of draw n % LOOP_SETS from the stacked draws (a traced index is fine)."""
    import jax
    from jax import lax
    return lambda n: jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, n % LOOP_SETS, keepdims=False), xs_sets)


def _median_seconds(run, args, repeats: int) -> float:
    """Median wall seconds of `repeats` blocked calls of run(*args), after one untimed (compiling) call."""
    import jax
    import numpy as np
    jax.block_until_ready(run(*args))
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(run(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def time_loop_states(fn, xs_sets, states, iters: int, repeats: int = 3) -> float:
    """`time_loop` with len(states) distinct states (the model's 35 KDA layers each have their own):
    one loop iteration makes one call per state, each carrying its own, so consecutive calls read
    different 4 MiB states and 35 of them (140 MiB) cannot all stay in the L2 as the chained single
    state of `time_loop` can. Seconds per call."""
    import jax
    from jax import lax
    n = len(states)
    pick = _draw_picker(xs_sets)
    trips = max(1, iters // n)
    call = jax.jit(functools.partial(chained_call, fn))      # one function for the n call sites: one copy of the kernel's module to compile
    # (lingjax.model.kernels.shared_call); run 118's 35 direct calls did not compile within 90 s

    def body(i, sts):
        return tuple(call(pick(i * n + j), sts[j])[-1] for j in range(n))

    run = jax.jit(lambda xs_sets, sts: lax.fori_loop(0, trips, body, sts))
    return _median_seconds(run, (xs_sets, states), repeats) / (trips * n)


def _rel_rmse(a, b):
    import numpy as np
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


def as_layer_call(fn):
    """fn(xs, s) -> outputs ending in the state, as the layer benchmarks' f(proj, ..., beta, state) ->
    (out, state) for bench.kernel_table.time_layer (carry_last: the state carried per call)."""
    def f(*args):
        outs = fn(tuple(args[:-1]), args[-1])
        return outs[0], outs[-1]
    return f


def run_case(case: Case, shape: dict, block_vs, interpret, iters: int, copy_bw: float,
             profile: str | None = None, states: int = 0, variants=({},), xla: bool = True) -> list[dict]:
    from bench import kernel_table
    import jax
    import jax.numpy as jnp
    import numpy as np
    draws = [make_inputs(shape["B"], case.T, shape["H"], shape["K"], seed=100 * case.T + r) for r in range(LOOP_SETS)]
    xs, state = draws[0]
    xs_sets = tuple(jnp.stack(a) for a in zip(*(d[0] for d in draws)))
    nbytes = floor_bytes(case, xs, state)
    floor_s = nbytes / copy_bw
    o64, s64 = oracle(case, xs, state)
    rows, ref_out = [], None
    for label, fn in impls(case, shape["K"], block_vs, interpret, variants, xla):
        row = {"case": case.name, "T": case.T, "impl": label, "bytes": nbytes, "floor_us": floor_s * 1e6}
        try:
            f = jax.jit(fn)
            outs = jax.block_until_ready(f(xs, state))
            t_call = time_fn(f, (xs, state), iters, 1)[0]
            # interpret mode (CPU smoke): one run of one call per loop trip, the times mean nothing
            t_loop = time_loop(fn, xs_sets, state, iters, **(dict(repeats=1, unroll=1) if interpret else {}))
            t_states = None
            if states and not label.startswith("xla"):   # kernel rows: the model's distinct states, out of the L2
                sts = tuple(state + 0.0 * i for i in range(states))
                t_states = time_loop_states(fn, xs_sets, sts, iters, **(dict(repeats=1) if interpret else {}))
            tag = f"{case.name}-T{case.T}-{label.replace(' ', '_').replace('=', '')}"
            net_draws = draws[:1] if interpret else draws       # interpret mode (smoke): one call per trip
            net = kernel_table.time_layer(as_layer_call(fn), [(*d[0], d[1]) for d in net_draws], iters,
                                          carry_last=True, profile_dir=Path(profile) / tag if profile else None)
        except Exception as e:      # a kernel variant that fails to compile / run: record it, go on
            if ref_out is None:     # the reference row (XLA, or the first kernel row) must work
                raise
            rows.append({**row, "error": f"{type(e).__name__}: {str(e)[:500]}"})
            continue
        is_ref = ref_out is None
        if is_ref:
            ref_out = outs
        row.update(us_call=t_call * 1e6, us_loop=t_loop * 1e6, us_net=net["layer_us"],
                   us_states=None if t_states is None else t_states * 1e6, states=states or None,
                   us_net_raw=net["raw_us"], loop_overhead_us=net["loop_overhead_us"],
                   pct_floor_call=100 * floor_s / t_call, pct_floor_loop=100 * floor_s / t_loop,
                   pct_floor_net=100 * floor_s / (net["layer_us"] * 1e-6) if net["layer_us"] > 0 else None,
                   rmse_s_f64=None if case.verify else _rel_rmse(outs[-1], s64),
                   rmse_o_f64=None if o64 is None else _rel_rmse(outs[0], o64))
        for name, i in (("s", -1), ("o", 0)):
            if is_ref or (name == "o" and case.commit) or (name == "s" and case.verify):
                row[f"max_abs_{name}"] = row[f"max_rel_{name}"] = None
                continue
            ref = np.asarray(ref_out[i], np.float64)
            d = float(np.abs(np.asarray(outs[i], np.float64) - ref).max())
            row[f"max_abs_{name}"] = d
            row[f"max_rel_{name}"] = d / max(float(np.abs(ref).max()), 1e-30)
        if "kernels" in net:
            row["kernels"] = net["kernels"]
            print(f"{case.name} T={case.T} {label}: {net['layer_us']:.2f} us per call in the net loop")
            kernel_table.print_table(net["kernels"])
        rows.append(row)
    return rows


def _fmt(x, spec):
    width = int(spec.split(".")[0])
    return "-".rjust(width) if x is None else format(x, spec)


def print_table(rows, copy_bw):
    print(f"\ndevice copy bandwidth {copy_bw / 1e9:.1f} GB/s (read + write)")
    has_states = any(r.get("us_states") is not None for r in rows)
    head = (f"{'case':7s} {'T':>3s} {'impl':44s} {'us/call':>9s} {'us/loop':>9s} {'us/net':>8s} {'floor us':>9s} "
            f"{'%floor':>7s} {'max|do|':>9s} {'max|ds|':>9s} {'relo':>8s} {'rels':>8s} "
            f"{'rmse o64':>9s} {'rmse s64':>9s}" + (f" {'us/states':>9s}" if has_states else ""))
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['case']:7s} {r['T']:3d} {r['impl']:44s} FAILED: {r['error'][:200]}")
            continue
        print(f"{r['case']:7s} {r['T']:3d} {r['impl']:44s} {r['us_call']:9.2f} {r['us_loop']:9.2f} {r['us_net']:8.2f} "
              f"{r['floor_us']:9.3f} {r['pct_floor_loop']:6.1f}% {_fmt(r['max_abs_o'], '9.2e')} "
              f"{_fmt(r['max_abs_s'], '9.2e')} {_fmt(r['max_rel_o'], '8.1e')} {_fmt(r['max_rel_s'], '8.1e')} "
              f"{_fmt(r['rmse_o_f64'], '9.1e')} {_fmt(r['rmse_s_f64'], '9.1e')}"
              + (f" {_fmt(r.get('us_states'), '9.2f')}" if has_states else ""))
    print("%floor: of the loop time; us/states: the loop over --states distinct states; us/net: in-loop minus "
          "the loop's own cost (module docstring); max|d.|, rel.: vs the first (XLA) row of the case; "
          "rmse .64: relative RMSE vs the float64 reference (a verify writes no state)\n")


def main(argv=None) -> dict:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.iters < 1:
        ap.error(f"--iters must be >= 1, got {a.iters}")
    if a.states < 0:
        ap.error(f"--states must be >= 0 (0: off), got {a.states}")
    names = {f"{c.name}{c.T}": c for c in CASES}
    picked = [x for x in a.cases.split(",") if x]
    if any(x not in names for x in picked):
        ap.error(f"--cases {a.cases}: each must be one of {','.join(names)}")
    block_vs = int_list(ap, a.block_v, "--block-v") or [None]
    if not a.no_xla_defaults:
        xla_env.configure()     # before jax is imported (parse_variants imports the kernel module)
    try:
        variants = parse_variants(a.variants)
    except ValueError as e:
        ap.error(f"--variants: {e}")
    import jax
    if a.own_barriers:
        from pallas_kernels import kda_step_fused
        kda_step_fused.OWN_BARRIERS = True

    from bench.batch1 import measure_copy_bandwidth
    from bench.common import kernel_interpret, save_result
    backend = jax.default_backend()
    interpret = kernel_interpret(ap, a, "the Pallas kernels")
    shape = SMALL if a.interpret else LING
    for bv in block_vs:
        if bv is not None and (shape["K"] % bv or bv % 8):
            ap.error(f"--block-v {bv} must divide V={shape['K']} and be a multiple of 8")
    copy_bytes = (a.copy_mib or (1024 if backend == "gpu" else 8)) << 20
    copy_bw = measure_copy_bandwidth(copy_bytes)
    rows = []
    for case in [names[x] for x in picked] or CASES:
        print(f"{case.name} T={case.T} ...", file=sys.stderr, flush=True)
        rows.extend(run_case(case, shape, block_vs, interpret, a.iters, copy_bw, a.profile, a.states, variants,
                              xla=not a.no_xla))
    print_table(rows, copy_bw)
    rec = {"bench": "kernels", "shape": {**shape, "V": shape["K"]}, "interpret": a.interpret,
           "input_dtypes": {"proj,window,conv_w": "bfloat16", "A_log,dt_bias,beta,state": "float32"},
           "commit_n": COMMIT_N,
           "iters": a.iters, "copy_bytes_per_s": copy_bw, "copy_probe_bytes": copy_bytes,
           "rows": rows, "flags": vars(a)}
    rec["result_path"] = str(save_result("kernels", rec, a.out))
    return rec


if __name__ == "__main__":
    main()
