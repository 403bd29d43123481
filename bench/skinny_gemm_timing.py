"""Skinny GEMM kernel (pallas_kernels/skinny_gemm.py) vs XLA at Ling's dense projection shapes.

    python -m bench.skinny_gemm_timing --M 1,9,16 [--iters 50] [--out-dir DIR]
    python -m bench.skinny_gemm_timing --M 9 --shapes 4096x2560 --block-n 64 --split-k 4,8,16  # sweep
    python -m bench.skinny_gemm_timing --interpret --M 1 --shapes 256x128 --iters 1   # CPU smoke

Shapes (KxN, --shapes): 2560x20480 KDA fused q/k/v/f/g input projection, 4096x2560 KDA o_proj,
2560x157184 lm_head. Weights (--dtypes): bf16 (normal * 0.02), and fp8 e4m3 (random bytes, NaN
codes zeroed) with random power-of-two 128 x 128 block scales, made on the device; x bf16 normal.
Rows per (shape, dtype, M). `loop` (the number the tables use): bench.common.time_in_loop, calls
inside one jitted loop over --copies weight copies at different addresses (default: enough to pass
256 MB, so a small weight is not served from the 60 MB L2 as no layer of the model is), minus the
loop's own per-call cost (bench.common.loop_overhead: the dependency op that keeps the calls in the
loop, recorded as loop_overhead_us). Also recorded: the median of --iters blocked calls and
`pipelined` (--iters calls issued back to back, one block at the end), both of which include host
dispatch (~50 us a call), so small projections measure the host, not the kernel:
  kernel   skinny_gemm_pallas (x padding, kernel, split-K sum / transpose), default tiling unless
           --block-n / --split-k / --stages (comma lists: every combination is a row)
  xla      bf16: jax.jit(x @ w); fp8: x @ lingjax.quant.dequantize(w, scale) in bf16 (the model's
           Fp8Weight path: XLA fuses the dequantisation into the dot or not)
bytes = weight bytes + fp8 scales (what a call must read at least); GBps = bytes / loop time;
pct_4p3 = % of 4.3 TB/s (the H200's measured copy bandwidth, the target's yardstick); pct_copy =
% of the copy bandwidth measured in this process (bench.batch1.measure_copy_bandwidth).
max_abs_err / ref_max: kernel (float32 out) vs the float32 reference x @ dequantised w.
Writes bench/results/skinny_gemm_timing-*.json (or --out-dir) via bench.common.save_result;
skinny_gemm_timing-partial.json there holds the rows so far while it runs (left only if killed).
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from bench.common import COPY_BW_H200, choice_list, int_list, loop_timing, time_rows
from lingjax import xla_env

LING_SHAPES = "2560x20480,4096x2560,2560x157184"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.skinny_gemm_timing", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--M", default="1,9,16", help="comma list of token counts (1..16)")
    ap.add_argument("--shapes", default=LING_SHAPES, help="comma list of KxN weight shapes")
    ap.add_argument("--dtypes", default="bf16,fp8", help="weight dtypes: bf16 and/or fp8")
    ap.add_argument("--block-n", default="", help="comma list of block_n overrides (default: kernel's)")
    ap.add_argument("--split-k", default="", help="comma list of split_k overrides")
    ap.add_argument("--stages", default="", help="comma list of pipeline-depth overrides")
    ap.add_argument("--fp8-schedule", default="serial",
                    help="comma list of fp8 schedules: serial (default), pair (two K tiles per step, the "
                         "second converted under the first's WGMMA), async (block scale folded into the f16 "
                         "conversion, each tile's WGMMA left in flight); bf16 rows ignore it")
    ap.add_argument("--fp8-load-layout", default="",
                    help="comma list of register layouts for the fp8 tile loads (wgmma, upcast2x, 8bit; "
                         "default: pallas_kernels.common's); bf16 rows ignore it")
    ap.add_argument("--k-minor", action="store_true",
                    help="weights as [N, K] (K minor, torch's Linear layout): fp8 tiles become register WGMMA "
                         "operands (skinny_gemm_pallas(k_minor=True)); the XLA rows use the same arrays")
    ap.add_argument("--iters", type=int, default=50, help="timed calls per row (loop: iterations of 8+ calls)")
    ap.add_argument("--copies", type=int, default=None,
                    help="weight copies cycled in the loop (default: enough for 256 MB, at least 1)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per row (first compiles)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-xla", action="store_true", help="skip the XLA rows")
    ap.add_argument("--interpret", action="store_true",
                    help="Mosaic GPU interpret mode (CPU smoke; times meaningless)")
    ap.add_argument("--out-dir", default=None, help="result directory (default bench/results)")
    ap.add_argument("--no-xla-defaults", action="store_true", help="do not add the command-buffer XLA flags")
    return ap


def make_weights(K, N, fp8, seed):
    """bf16 w [K, N], or (fp8 w [K, N], scale [K/128, ceil(N/128)] f32), made on the device."""
    import jax
    import jax.numpy as jnp
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    if not fp8:
        make = jax.jit(lambda: (0.02 * jax.random.normal(k1, (K, N), jnp.float32)).astype(jnp.bfloat16))
        return jax.block_until_ready(make()), None

    def fp8_values():
        b = jax.random.bits(k1, (K, N), jnp.uint8)
        b = jnp.where((b & 0x7F) == 0x7F, jnp.uint8(0), b)              # 0x7f / 0xff are NaN in e4m3fn
        return jax.lax.bitcast_convert_type(b, jnp.float8_e4m3fn)

    def scale():
        return 2.0 ** jax.random.randint(k2, (K // 128, -(-N // 128)), -14, -8).astype(jnp.float32)

    return jax.block_until_ready(jax.jit(lambda: (fp8_values(), scale()))())


L2_BUSTER_BYTES = 256 << 20     # > 4x the H200's 60 MB L2
MAX_COPIES = 32                 # Ling's smallest timed weight (fp8 o_proj, 10.5 MB) needs 26


def n_copies(nbytes: int, requested: int | None) -> int:
    """Weight copies the loop cycles through: `requested`, else enough to pass 256 MB (at most
    MAX_COPIES: tiny smoke-test shapes are not timed for real anyway)."""
    return requested if requested else min(MAX_COPIES, max(1, -(-L2_BUSTER_BYTES // nbytes)))


def run_row(M, K, N, dtype, ws_copies, tiling, a, interpret, copy_bw) -> dict:
    """One (M, shape, dtype, tiling) row; ws_copies: [(w, scale or None)] weight copies."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from lingjax.param_layout import Matrix
    from lingjax.quant import dequantize
    from pallas_kernels.skinny_gemm import (skinny_gemm_config, skinny_gemm_pallas,
                                            skinny_gemm_reference, weight_bytes)
    from pallas_kernels.common import fp8_load_layout_set
    fp8 = dtype == "fp8"
    _kn = (lambda w: w.T) if a.k_minor else (lambda w: w)        # the XLA rows' [K, N] operand
    cfg = skinny_gemm_config(M, K, N, fp8, k_minor=a.k_minor, **{k: v for k, v in tiling.items()
                                                                 if k not in ("fp8_schedule", "fp8_load_layout")})
    rec = {"M": M, "K": K, "N": N, "dtype": dtype, "tiling": tiling, "k_minor": a.k_minor,
           "config": {"block_n": cfg.block_n, "split_k": cfg.split_k, "stages": cfg.stages,
                      "m_pad": cfg.m_pad, "smem_bytes": cfg.smem_bytes},
           "bytes": weight_bytes(K, N, jnp.float8_e4m3fn if fp8 else jnp.bfloat16)}
    rec["floor_us"] = rec["bytes"] / COPY_BW_H200 * 1e6
    x = jax.random.normal(jax.random.PRNGKey(a.seed + M), (M, K), jnp.float32).astype(jnp.bfloat16)
    w, s = ws_copies[0]
    ws = (w, s) if fp8 else (w,)
    sets = [(x, *((wc, sc) if fp8 else (wc,))) for wc, sc in ws_copies]
    rec["copies"] = len(sets)
    kw = {k: v for k, v in tiling.items() if k != "fp8_load_layout"}

    def kern_fn(x, *ws, out_dtype=None):      # the load layout is a trace-time setting
        with fp8_load_layout_set(tiling.get("fp8_load_layout")):
            return skinny_gemm_pallas(x, *ws, interpret=interpret, out_dtype=out_dtype, k_minor=a.k_minor, **kw)
    fns = [("kernel", kern_fn)]
    if not a.no_xla:
        if fp8:
            view = Matrix((), (1,), (0,)) if a.k_minor else Matrix((), (0,), (1,))
            fns.append(("xla", lambda x, w, s: x @ _kn(dequantize(w, s, view, (128, 128), jnp.bfloat16))))
        else:
            fns.append(("xla", lambda x, w: x @ _kn(w)))
    for name, (med, piped) in time_rows([(n, jax.jit(f), (x, *ws)) for n, f in fns], a.iters, a.warmup,
                                        rec).items():
        rec[f"{name}_us"], rec[f"{name}_pipelined_us"] = med * 1e6, piped * 1e6
    loop_timing(fns, sets, a.iters, rec, rec["bytes"], copy_bw, smoke=bool(interpret))
    if "kernel_us" in rec:
        out = np.asarray(jax.jit(lambda x, *ws: kern_fn(x, *ws, out_dtype=jnp.float32))(x, *ws))
        ref = np.asarray(jax.jit(lambda *ws: skinny_gemm_reference(x, *ws, k_minor=a.k_minor))(w, s))
        rec["max_abs_err"] = float(np.abs(out - ref).max())
        rec["ref_max"] = float(np.abs(ref).max())
        rec["finite"] = bool(np.isfinite(out).all())
    return rec


def _line(r) -> str:
    line = (f"{r['dtype']} {r['K']}x{r['N']}{' k-minor' if r.get('k_minor') else ''} M={r['M']} ("
            + (f"{r['tiling']['fp8_schedule']}, " if "fp8_schedule" in r["tiling"] else "")
            + (f"{r['tiling']['fp8_load_layout']} loads, " if "fp8_load_layout" in r["tiling"] else "")
            + f"bn {r['config']['block_n']}, split "
            f"{r['config']['split_k']}, stages {r['config']['stages']}): {r['bytes'] / 1e6:.1f} MB, "
            f"floor {r['floor_us']:.1f} us")
    for n in ("kernel", "xla"):
        if n + "_loop_us" in r:
            line += (f"; {n} {r[n + '_loop_us']:.1f} us in-loop ({r[n + '_GBps']:.0f} GB/s, "
                     f"{r[n + '_pct_4p3']:.0f}% of 4.3 TB/s; pipelined {r.get(n + '_pipelined_us', float('nan')):.1f} us)")
        elif n + "_error" in r or n + "_loop_error" in r:
            line += f"; {n} FAILED (see the JSON)"
    if "max_abs_err" in r:
        line += f"; max|kernel-ref| {r['max_abs_err']:.3g} (ref max {r['ref_max']:.3g})"
    return line


def main(argv=None) -> dict:
    ap = build_parser()
    a = ap.parse_args(argv)
    Ms = int_list(ap, a.M, "--M")
    if a.copies is not None and a.copies < 1:
        ap.error(f"--copies must be >= 1, got {a.copies}")
    if not Ms or min(Ms) < 1 or max(Ms) > 16 or a.iters < 1:
        ap.error("--M values must be in 1..16 and --iters >= 1")
    try:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in a.shapes.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--shapes must be a comma list of KxN, got {a.shapes!r}")
    if not shapes or any(len(s) != 2 or s[0] % 128 or s[1] % 64 for s in shapes):
        ap.error("--shapes: each KxN needs K a multiple of 128 and N a multiple of 64")
    dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    if not dtypes or set(dtypes) - {"bf16", "fp8"}:
        ap.error(f"--dtypes must be a comma list of bf16/fp8, got {a.dtypes!r}")
    grids = {k: int_list(ap, v, "--" + k.replace("_", "-")) or [None]
             for k, v in (("block_n", a.block_n), ("split_k", a.split_k), ("stages", a.stages))}
    tilings = [{k: v for k, v in zip(grids, combo) if v is not None}
               for combo in itertools.product(*grids.values())]
    from pallas_kernels.skinny_gemm import FP8_SCHEDULES
    from pallas_kernels.common import FP8_LOAD_LAYOUTS
    layouts = choice_list(ap, a.fp8_load_layout, "--fp8-load-layout", FP8_LOAD_LAYOUTS) or [None]
    schedules = choice_list(ap, a.fp8_schedule, "--fp8-schedule", FP8_SCHEDULES)
    if not schedules:
        ap.error(f"--fp8-schedule must name at least one of {', '.join(FP8_SCHEDULES)}")
    if a.k_minor and set(schedules) - {"serial"}:
        ap.error("--k-minor takes --fp8-schedule serial only (the kernel refuses 'pair' and 'async' "
                 "for [N, K] weights)")
    if not a.no_xla_defaults:
        xla_env.configure()
    import jax

    from bench.batch1 import measure_copy_bandwidth
    from bench.common import RESULTS, kernel_interpret, save_result
    interpret = kernel_interpret(ap, a, "the kernel")
    copy_bw = measure_copy_bandwidth((1024 if jax.default_backend() == "gpu" else 8) << 20)
    results = []
    # rewritten after every row, removed at the end: what a killed run (a device time limit) leaves
    partial = Path(a.out_dir or RESULTS) / "skinny_gemm_timing-partial.json"
    partial.parent.mkdir(parents=True, exist_ok=True)
    for K, N in shapes:
        for dtype in dtypes:
            from pallas_kernels.skinny_gemm import weight_bytes
            import jax.numpy as jnp
            nbytes = weight_bytes(K, N, jnp.float8_e4m3fn if dtype == "fp8" else jnp.bfloat16)
            copies = [make_weights(K, N, dtype == "fp8", a.seed + j) for j in range(n_copies(nbytes, a.copies))]
            if a.k_minor:           # [N, K] values (the scales keep their [K/128, N/128] layout)
                copies = [(jax.block_until_ready(jax.jit(lambda v: v.T)(w)), s) for w, s in copies]
            for M in Ms:
                fp8_rows = [dict(t, fp8_schedule=sc, **({"fp8_load_layout": ly} if ly else {}))
                            for t in tilings for sc in schedules for ly in layouts]
                for tiling in (fp8_rows if dtype == "fp8" else tilings):
                    try:
                        rec = run_row(M, K, N, dtype, copies, tiling, a, interpret, copy_bw)
                    except ValueError as e:     # a tiling override that does not fit this shape
                        rec = {"M": M, "K": K, "N": N, "dtype": dtype, "tiling": tiling,
                               "kernel_error": f"ValueError: {e}"}
                        print(f"{dtype} {K}x{N} M={M} {tiling}: {e}")
                    else:
                        print(_line(rec))
                    results.append(rec)
                    partial.write_text(json.dumps({"bench": "skinny_gemm_timing", "partial": True,
                                                   "copy_GBps": copy_bw / 1e9, "results": results}))
            del copies
    record = {"bench": "skinny_gemm_timing", "copy_GBps": copy_bw / 1e9, "results": results}
    save_result("skinny_gemm_timing", record, a.out_dir)
    partial.unlink(missing_ok=True)
    return record


if __name__ == "__main__":
    main()
