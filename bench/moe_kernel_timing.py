"""Routed-expert MoE kernel (pallas_kernels/moe_experts.py) vs experts_gather, fp8 or bf16 weights.

    python -m bench.moe_kernel_timing --M 1,9 [--weights fp8|bf16] [--iters 50] [--out-dir DIR]
    python -m bench.moe_kernel_timing --M 1,9 --shared --stages 2,3,4 --split-d 1,2,4 --no-gather  # sweep
    python -m bench.moe_kernel_timing --M 1,9 --shared --fp8-schedule serial,async --no-gather
    python -m bench.moe_kernel_timing --M 1,9 --shared --k-major      # the [E,D,2,F] layout, for comparison
    python -m bench.moe_kernel_timing --interpret --M 1,3 --E 16 --D 256 --F 128 --k 4 --iters 1  # CPU smoke

Shape (default Ling-3.0-flash): E=512 experts, D=2560, F=768, top-k 8, weights in the model's
K-minor layout (w_gate_up [E,2,F,D], w_down [E,D,F]: k_minor=True); --weights fp8 (default):
random fp8 values (random bytes, NaN codes zeroed) with random power-of-two block scales; bf16:
random normal bf16 weights (std 0.02, no scales); made on the device; x bf16; each token picks
k distinct experts uniformly (--seed). Rows per M. `loop` (the number the tables use):
bench.common.time_in_loop, calls inside one jitted loop cycling over 4 routing draws (different
experts, so no expert is served from the L2 by the previous call), minus the loop's own per-call
cost (bench.common.loop_overhead, recorded as loop_overhead_us). Also recorded: the median of
--iters blocked calls and `pipelined` (--iters calls back to back, one block at the end), both
including host dispatch:
  kernel   moe_experts_pallas (prologue + 2 kernels + transpose + combine)
  gather   lingjax.ops.moe.experts_gather with Fp8Weight / bf16 arrays (the model's XLA path)
bytes = weights (+ fp8 scales) of the distinct chosen experts (what each must read at least);
loop_bytes = their mean over the 4 draws; pct_4p3 = loop_bytes / loop time / 4.3 TB/s (the H200's
copy bandwidth, the targets' yardstick), pct_copy = the same against the copy bandwidth measured
in-process (bench.batch1.measure_copy_bandwidth). max_abs_err / ref_max: kernel vs gather.
--split-d / --split-f / --stages / --fp8-schedule / --fp8-load-layout: one row per combination of
the listed overrides (the record's `tiling`; the gather row is timed once per M, with the first
combination). --shared: the shared expert (expert E of E + 1 made) joins as the kernels' last
slot; gather adds it as one more expert with weight 1 per token. --k-major: the kernels get the
weights transposed once to the K-major layout (k_minor=False: w_gate_up [E,D,2,F], w_down
[E,F,D], the model's layout before session 9); no gather row is timed.
Writes bench/results/moe_kernel_timing-*.json (or --out-dir) via bench.common.save_result.
"""
from __future__ import annotations

import argparse
import itertools
import time

from bench.common import choice_list, int_list, loop_timing, time_rows
from lingjax import xla_env


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.moe_kernel_timing", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--M", default="1,9", help="comma list of token counts (1..16)")
    ap.add_argument("--E", type=int, default=512, help="experts")
    ap.add_argument("--D", type=int, default=2560, help="hidden size")
    ap.add_argument("--F", type=int, default=768, help="expert intermediate size")
    ap.add_argument("--k", type=int, default=8, help="experts per token")
    ap.add_argument("--weights", choices=["fp8", "bf16"], default="fp8",
                    help="expert weight format: block fp8 (dequantised on chip) or bf16 (streamed as is)")
    ap.add_argument("--limit", type=float, default=None, help="SwiGLU clamp (default none)")
    ap.add_argument("--iters", type=int, default=50, help="timed calls per row")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per row (first compiles)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-gather", action="store_true", help="skip the experts_gather row")
    ap.add_argument("--split-d", default="", help="comma list of kernel-1 split overrides (default: moe_split)")
    ap.add_argument("--split-f", default="", help="comma list of kernel-2 split overrides (default: moe_split)")
    ap.add_argument("--stages", default="", help="comma list of pipeline-depth overrides (default: 3)")
    ap.add_argument("--fp8-schedule", default="",
                    help="comma list of fp8 schedules (serial, async; default: the kernel's): 'async' folds "
                         "the block scale into the f16 conversion and leaves each chunk's WGMMA in flight")
    ap.add_argument("--fp8-load-layout", default="",
                    help="comma list of register layouts for the fp8 tile loads (wgmma, upcast2x, 8bit; "
                         "default: pallas_kernels.common's): 2 or 4 bytes per thread and SMEM load")
    ap.add_argument("--k-major", action="store_true",
                    help="the kernels on the weights transposed to the K-major layout ([E,D,2,F] / [E,F,D], "
                         "k_minor=False: fp8 tiles converted through SMEM); the gather row is not timed, "
                         "the error check still runs on the model-layout weights")
    ap.add_argument("--shared", action="store_true",
                    help="with a shared expert as one more slot (as the model runs Ling-3.0-flash); its "
                         "weights are one more random expert, its bytes are counted")
    ap.add_argument("--interpret", action="store_true",
                    help="Mosaic GPU interpret mode (CPU smoke; times meaningless)")
    ap.add_argument("--out-dir", default=None, help="result directory (default bench/results)")
    ap.add_argument("--no-xla-defaults", action="store_true", help="do not add the command-buffer XLA flags")
    return ap


def make_weights(E, D, F, seed, kind="fp8"):
    """(w_gate_up fp8 [E,2,F,D], gu_scale [E,2,D/128,F/128], w_down fp8 [E,D,F], down_scale
    [E,F/128,D/128]): the model's K-minor layout; kind="bf16": (w_gate_up bf16, None, w_down bf16,
    None)."""
    import jax
    import jax.numpy as jnp
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)

    def fp8(key, shape):
        b = jax.random.bits(key, shape, jnp.uint8)
        b = jnp.where((b & 0x7F) == 0x7F, jnp.uint8(0), b)          # 0x7f / 0xff are NaN in e4m3fn
        return jax.lax.bitcast_convert_type(b, jnp.float8_e4m3fn)

    def scale(key, shape):
        return 2.0 ** jax.random.randint(key, shape, -14, -8).astype(jnp.float32)

    if kind == "bf16":
        make = jax.jit(lambda: (0.02 * jax.random.normal(ks[0], (E, 2, F, D), jnp.bfloat16), None,
                                0.02 * jax.random.normal(ks[2], (E, D, F), jnp.bfloat16), None))
        return jax.block_until_ready(make())
    make = jax.jit(lambda: (fp8(ks[0], (E, 2, F, D)), scale(ks[1], (E, 2, D // 128, F // 128)),
                            fp8(ks[2], (E, D, F)), scale(ks[3], (E, F // 128, D // 128))))
    return jax.block_until_ready(make())




LOOP_DRAWS = 4      # routing draws the loop cycles through (different experts: no L2 reuse)


def split_shared(weights, E, limit, shared: bool):
    """make_weights' arrays -> (the E routed experts' (vgu, sgu, vd, sd), the shared expert's
    moe_experts_pallas tuple or None). With --shared make_weights makes E + 1 experts and the last
    one is the shared expert; the routed arrays are sliced once here, not per row."""
    if not shared:
        return weights, None
    vgu, sgu, vd, sd = weights
    sh = (vgu[E], None if sgu is None else sgu[E], vd[E], None if sd is None else sd[E], limit)
    routed = (vgu[:E], None if sgu is None else sgu[:E], vd[:E], None if sd is None else sd[:E])
    return routed, sh


def k_major_weights(weights):
    """`split_shared`'s (routed, shared) -> the same weights with the contraction axis major
    (moe_experts_pallas(k_minor=False)): w_gate_up [E,2,F,D] -> [E,D,2,F], w_down [E,D,F] -> [E,F,D];
    the scales stay as they are ([.., IN blocks, OUT blocks])."""
    import jax
    import jax.numpy as jnp

    def one(vgu, sgu, vd, sd, experts_axis: bool):     # False: the shared expert's [2, F, D] / [D, F]
        perm = (0, 3, 1, 2) if experts_axis else (2, 0, 1)
        return jnp.transpose(vgu, perm), sgu, jnp.swapaxes(vd, -1, -2), sd

    routed, shared = weights
    routed = jax.block_until_ready(jax.jit(lambda *w: one(*w, True))(*routed))
    if shared is not None:
        shared = (*jax.block_until_ready(jax.jit(lambda *w: one(*w, False))(*shared[:4])), shared[4])
    return routed, shared


def run_M(M, a, weights, interpret, copy_bw, tiling=None, gather_row=True, kernel_weights=None) -> dict:
    """One row: M tokens, kernel `tiling` overrides ({split_d, split_f, stages, fp8_schedule,
    fp8_load_layout}); weights: the result of `split_shared` (for the gather path, and the
    kernel's unless kernel_weights, the same in `k_major_weights`' layout, are given)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from lingjax.ops.moe import experts_gather
    from lingjax.param_layout import Matrix
    from lingjax.quant import Fp8Weight
    from pallas_kernels.common import fp8_load_layout_set
    from pallas_kernels.moe_experts import moe_experts_pallas, weight_bytes
    tiling = tiling or {}
    (vgu, sgu, vd, sd), shared = weights
    k_routed, k_shared = kernel_weights or weights
    rng = np.random.default_rng(a.seed + M)

    def draw(j):
        idx = jnp.asarray(np.stack([rng.choice(a.E, a.k, replace=False) for _ in range(M)]), jnp.int32)
        w = jnp.asarray(rng.uniform(0.05, 1.0, (M, a.k)), jnp.float32)
        x = jax.random.normal(jax.random.PRNGKey(a.seed + 100 * M + j), (M, a.D), jnp.float32).astype(jnp.bfloat16)
        return x, idx, w
    draws = [draw(j) for j in range(LOOP_DRAWS)]
    x, idx, w = draws[0]
    used = [int(np.unique(np.asarray(d[1])).size) + a.shared for d in draws]
    n_used = used[0]
    fp8 = a.weights == "fp8"
    rec = {"M": M, "E": a.E, "D": a.D, "F": a.F, "k": a.k, "weights": a.weights, "limit": a.limit,
           "shared": a.shared, "tiling": tiling, "n_experts_used": n_used,
           "bytes": weight_bytes(n_used, a.D, a.F, fp8=fp8)}
    rec["floor_us"] = rec["bytes"] / copy_bw * 1e6
    kw = {k: v for k, v in tiling.items() if k != "fp8_load_layout"}

    def kern_fn(*xs):                 # the load layout is a trace-time setting
        with fp8_load_layout_set(tiling.get("fp8_load_layout")):
            return moe_experts_pallas(*xs, limit=a.limit, shared=k_shared, k_minor=kernel_weights is None,
                                      interpret=interpret, **kw)
    kern = jax.jit(kern_fn)

    def gather_fn(x, idx, w, vgu, sgu, vd, sd):     # weights are arguments, not jit constants
        if shared is not None:                       # the shared expert as expert E, weight 1
            vgu, vd = (jnp.concatenate([a_, b_[None]]) for a_, b_ in ((vgu, shared[0]), (vd, shared[2])))
            if fp8:
                sgu, sd = (jnp.concatenate([a_, b_[None]]) for a_, b_ in ((sgu, shared[1]), (sd, shared[3])))
            idx = jnp.concatenate([idx, jnp.full((idx.shape[0], 1), a.E, idx.dtype)], axis=1)
            w = jnp.concatenate([w, jnp.ones((w.shape[0], 1), w.dtype)], axis=1)
        fgu, fd = vgu, vd                            # bf16: plain arrays
        if fp8:
            bf = jnp.bfloat16
            fgu = Fp8Weight(vgu, sgu, view=Matrix((0, 1), (3,), (2,)), block=(128, 128), dtype=bf,
                            logical=("experts", None, "mlp", "embed"))
            fd = Fp8Weight(vd, sd, view=Matrix((0,), (2,), (1,)), block=(128, 128), dtype=bf,
                           logical=("experts", "embed", "mlp"))
        return experts_gather(x, idx, w, fgu, fd, a.limit)

    gather = jax.jit(gather_fn)
    timed_gather = gather_row and not a.no_gather and kernel_weights is None   # the same arguments as the kernel
    fns = [("kernel", kern_fn)] + ([("gather", gather_fn)] if timed_gather else [])
    args = (x, idx, w, *k_routed)
    for name, (med, piped) in time_rows([(n, jax.jit(f), args) for n, f in fns], a.iters, a.warmup,
                                        rec).items():
        rec[f"{name}_us"], rec[f"{name}_pipelined_us"] = med * 1e6, piped * 1e6
    sets = [(xj, ij, wj, *k_routed) for xj, ij, wj in draws]
    # every draw is called equally often (8 calls per iteration, or 4 in a smoke run, over 4 draws)
    rec["loop_bytes"] = float(np.mean([weight_bytes(n, a.D, a.F, fp8=fp8) for n in used]))
    loop_timing(fns, sets, a.iters, rec, rec["loop_bytes"], copy_bw, smoke=bool(interpret))
    if "kernel_us" in rec:
        out = np.asarray(kern(x, idx, w, *k_routed), np.float32)
        ref = np.asarray(gather(x, idx, w, vgu, sgu, vd, sd), np.float32)
        rec["max_abs_err"] = float(np.abs(out - ref).max())
        rec["ref_max"] = float(np.abs(ref).max())
        rec["finite"] = bool(np.isfinite(out).all())
    return rec


def main(argv=None) -> dict:
    ap = build_parser()
    a = ap.parse_args(argv)
    Ms = int_list(ap, a.M, "--M")
    if not Ms or min(Ms) < 1 or max(Ms) > 16 or a.iters < 1:
        ap.error("--M values must be in 1..16 and --iters >= 1")
    if a.D % 128 or a.F % 128 or not 1 <= a.k <= a.E:
        ap.error("--D and --F must be multiples of 128 and 1 <= --k <= --E")
    if not a.no_xla_defaults:
        xla_env.configure()
    import jax

    from bench.batch1 import measure_copy_bandwidth
    from bench.common import kernel_interpret, save_result
    backend = jax.default_backend()
    interpret = kernel_interpret(ap, a, "the kernel")
    copy_bw = measure_copy_bandwidth((1024 if backend == "gpu" else 8) << 20)
    grids = {k: int_list(ap, v, "--" + k.replace("_", "-")) or [None]
             for k, v in (("split_d", a.split_d), ("split_f", a.split_f), ("stages", a.stages))}
    from pallas_kernels.moe_experts import FP8_SCHEDULES
    schedules = choice_list(ap, a.fp8_schedule, "--fp8-schedule", FP8_SCHEDULES)
    if schedules and a.weights != "fp8":
        ap.error("--fp8-schedule is for --weights fp8")
    if "async" in schedules and not a.k_major:
        ap.error("--fp8-schedule async needs --k-major (the K-minor kernels refuse it: wrong results on the H200)")
    grids["fp8_schedule"] = schedules or [None]
    from pallas_kernels.common import FP8_LOAD_LAYOUTS
    grids["fp8_load_layout"] = choice_list(ap, a.fp8_load_layout, "--fp8-load-layout", FP8_LOAD_LAYOUTS) or [None]
    tilings = [{k: v for k, v in zip(grids, combo) if v is not None} for combo in itertools.product(*grids.values())]
    weights = split_shared(make_weights(a.E + a.shared, a.D, a.F, a.seed, a.weights), a.E, a.limit, a.shared)
    kernel_weights = k_major_weights(weights) if a.k_major else None
    results = []
    for M, (n_tiling, tiling) in itertools.product(Ms, enumerate(tilings)):
        rec = run_M(M, a, weights, interpret, copy_bw, tiling, gather_row=n_tiling == 0,
                    kernel_weights=kernel_weights)
        rec["k_minor"] = not a.k_major
        results.append(rec)
        tags = (" +shared" if a.shared else "") + (" k-major" if a.k_major else "")
        line = (f"M={M}{tags} {tiling or 'default tiling'}: {rec['n_experts_used']} "
                f"experts, {rec['bytes'] / 1e6:.1f} MB, floor {rec['floor_us']:.1f} us")
        for n in ("kernel", "gather"):
            if n + "_loop_us" in rec:
                line += (f"; {n} {rec[n + '_loop_us']:.1f} us in-loop ({rec[n + '_pct_4p3']:.0f}% of 4.3 TB/s, "
                         f"{rec[n + '_pct_copy']:.0f}% of copy bw; pipelined {rec.get(n + '_pipelined_us', float('nan')):.1f} us)")
            elif n + "_error" in rec or n + "_loop_error" in rec:
                line += f"; {n} FAILED (see the JSON)"
        if "max_abs_err" in rec:
            line += f"; max|kernel-gather| {rec['max_abs_err']:.3g} (ref max {rec['ref_max']:.3g})"
        print(line)
    record = {"bench": "moe_kernel_timing", "weights": a.weights, "copy_GBps": copy_bw / 1e9, "results": results}
    save_result("moe_kernel_timing", record, a.out_dir)
    return record


if __name__ == "__main__":
    main()
