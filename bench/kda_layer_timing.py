"""One whole Ling-3.0-flash KDA layer (fused input projection, beta, short conv, gate and the
delta-rule recurrence, gated norm, output projection) per call, and where its time goes.

    python -m bench.kda_layer_timing --M 1,9                       # on the H200
    python -m bench.kda_layer_timing --M 1,9 --profile /tmp/kda    # + a kernel-by-kernel table
    python -m bench.kda_layer_timing --M 1,9 --kda-kernel xla,pallas   # A/B of the recurrence kernel
    python -m bench.kda_layer_timing --tiny --M 1,3 --iters 1 --layers 1 --kda-kernel xla --dense-kernel xla
                                                                    # any host (smoke run)

Builds `lingjax.model.kda.KDA` layers with random weights (fp8 128 x 128 blocks by default, as the
full-depth benchmark runs them), sets --dense-kernel on their projections and each --kda-kernel in
turn (one row per kernel and M), gives each a `KDAState` (random state and conv window) and times,
inside one jitted loop (bench.common.time_in_loop over --layers weight copies, the loop's own
per-call cost subtracted):
  * M = 1: a decode step, `layer(x, cache)`, the new state carried to the next call;
  * M > 1: a speculative verify block, `layer(x, cache, pending=True)` (the state untouched), and
    with --commit N the commit of its first N tokens (`lingjax.model.kda.commit_prefix`) in the same
    call, as a DSpark step runs them; that state is carried.
Each row also records the weight bytes a call reads (fp8 values and scales, or bf16) and the
fraction of --copy-bw that is. With --profile DIR it traces that loop once more and prints, per XLA
kernel of one layer call, the µs per call, the count per call, and what the kernel computes
(bench.kernel_table): the table the KDA layer's XLA glue is read from.
"""
from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from bench.common import COPY_BW_H200, add_layer_loop_args, choice_list, int_list
from bench.kernel_table import print_table, time_layer
from lingjax import xla_env


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.kda_layer_timing", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--M", default="1,9",
                    help="comma list of token counts (1..16; default 1,9: decode, a verify of 8 drafts)")
    ap.add_argument("--commit", type=int, default=None,
                    help="with M > 1: also commit the block's first N tokens in each call (0..M; default: "
                         "no commit, the verify alone)")
    ap.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8", help="KDA weights (default fp8)")
    ap.add_argument("--dense-kernel", choices=["pallas", "xla"], default="pallas",
                    help="the input / output projections' kernel (default pallas)")
    ap.add_argument("--kda-kernel", default="pallas",
                    help="comma list of the recurrence's kernels, one row each: pallas (the fused step), xla "
                         "(default pallas)")
    ap.add_argument("--layers", type=int, default=4,
                    help="weight copies (each with its own state) cycled through, as a model's layers are "
                         "(default 4: a fp8 copy is ~63 MB, past the 60 MB L2)")
    ap.add_argument("--copy-bw", type=float, default=COPY_BW_H200,
                    help=f"bytes/s the bytes-per-call fraction is taken of (default {COPY_BW_H200:.3g}: "
                         "the H200's copy bandwidth, bench.common.COPY_BW_H200)")
    add_layer_loop_args(ap, "trace one more loop per row into DIR/<kernel>-M<M> and print its kernels")
    return ap


def main(argv=None) -> dict:
    ap = build_parser()
    a = ap.parse_args(argv)
    ms = int_list(ap, a.M, "--M")
    step_kernels = choice_list(ap, a.kda_kernel, "--kda-kernel", ("pallas", "xla"))
    if not ms or min(ms) < 1 or max(ms) > 16 or a.iters < 1 or a.layers < 1 or not step_kernels:
        ap.error("--M needs token counts in 1..16, --iters and --layers >= 1, --kda-kernel at least one kernel")
    verify_ms = [m for m in ms if m > 1]
    if a.commit is not None and not verify_ms:
        ap.error(f"--commit needs a verify row (an M > 1 in --M), got --M {a.M}")
    if a.commit is not None and not 0 <= a.commit <= min(verify_ms):
        ap.error(f"--commit {a.commit} must be in 0..M for every verify row (M = {min(verify_ms)})")
    if a.copy_bw <= 0:
        ap.error(f"--copy-bw must be > 0, got {a.copy_bw}")
    if not a.no_xla_defaults:
        xla_env.configure()
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from bench.common import save_result
    from lingjax.cache import KDAState
    from lingjax.config import preset
    from lingjax.model import dense, kernels as kernel_ctx
    from lingjax.model.kda import KDA, commit_prefix, set_kda_kernel
    from lingjax.quant import quantize_model

    on_gpu = jax.default_backend() == "gpu"
    cfg = preset("ling3-tiny" if a.tiny else "ling3-flash")
    h, k, ks = cfg.num_attention_heads, cfg.head_dim, cfg.short_conv_kernel_size
    act = jnp.bfloat16

    @nnx.jit                                          # one compile for every copy, not one per eager op
    def make(key):
        m = KDA(cfg, dtype=act, rngs=nnx.Rngs(key))
        return quantize_model(m) if a.dtype == "fp8" else m

    @jax.jit
    def make_state(key):
        k1, k2 = jax.random.split(key)
        state = jax.random.normal(k1, (1, h, k, k), jnp.float32) * 0.1
        conv = jax.random.normal(k2, (1, ks - 1, 3, h, k), jnp.float32).astype(act)
        return KDAState(state, conv)

    mods = [dense.set_dense_kernel(make(jax.random.key(a.seed + i)), a.dense_kernel) for i in range(a.layers)]
    states = [make_state(jax.random.PRNGKey(3000 + a.seed + i)) for i in range(a.layers)]
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(mods[0])))

    def layer_fn(graphdef, M):
        def f(x, st, cache):
            m = nnx.merge(graphdef, st)
            if M == 1:
                return m(x, cache)                     # (y, the state after the token)
            y, pending = m(x, cache, pending=True)
            return y, (commit_prefix(pending, a.commit) if a.commit is not None else cache)
        return f

    rows = []
    for kernel in step_kernels:
        graphdef, params = None, []
        for m in mods:
            set_kda_kernel(m, kernel)
            graphdef, st = nnx.split(m)
            params.append(st)
        uses_pallas = a.dense_kernel == "pallas" or kernel == "pallas"
        ctx = kernel_ctx.pallas_interpret if not on_gpu and uses_pallas else contextlib.nullcontext
        for M in ms:
            f = layer_fn(graphdef, M)
            xs = [jax.random.normal(jax.random.PRNGKey(a.seed + 7 * M + i), (1, M, cfg.hidden_size),
                                    jnp.float32).astype(act) for i in range(a.layers)]
            sets = [(x, st, c) for x, st, c in zip(xs, params, states)]
            what = "decode" if M == 1 else ("verify" + (f"+commit{a.commit}" if a.commit is not None else ""))
            row = {"kda_kernel": kernel, "M": M, "call": what, "bytes": weight_bytes}
            row.update(time_layer(f, sets, a.iters, ctx=ctx, carry_last=True,
                                  profile_dir=Path(a.profile) / f"{kernel}-M{M}" if a.profile else None))
            net = row["layer_us"] * 1e-6
            if net > 0:
                row.update({"GBps": weight_bytes / net / 1e9, "pct_copy_bw": 100 * weight_bytes / net / a.copy_bw})
            print(f"{kernel:6s} M={M:2d} {what:15s}: {row['layer_us']:7.1f} us per KDA layer call "
                  f"({weight_bytes / 1e6:.1f} MB of weights: {row.get('pct_copy_bw', float('nan')):.0f}% of "
                  f"{a.copy_bw / 1e12:.2f} TB/s; loop overhead {row['loop_overhead_us']:.1f} us subtracted)"
                  + ("" if on_gpu else "  [not a GPU: smoke run, not a timing]"), flush=True)
            if a.profile:
                print_table(row["kernels"])
            rows.append(row)
    rec = {"bench": "kda_layer_timing", "dtype": a.dtype, "dense_kernel": a.dense_kernel,
           "kda_kernels": step_kernels, "commit": a.commit, "layers": a.layers, "iters": a.iters,
           "preset": "ling3-tiny" if a.tiny else "ling3-flash", "smoke": not on_gpu, "rows": rows}
    rec["result_path"] = str(save_result("kda_layer_timing", rec, a.out))
    return rec


if __name__ == "__main__":
    main()
