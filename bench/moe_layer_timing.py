"""One whole Ling-3.0-flash MoE layer (router + routed and shared experts) per call, and where its
time goes: the expert kernels against the XLA work around them.

    python -m bench.moe_layer_timing --M 1,9                      # on the H200
    python -m bench.moe_layer_timing --M 1,9 --profile /tmp/moe   # + a kernel-by-kernel table
    python -m bench.moe_layer_timing --tiny --M 1 --iters 1 --moe-kernel xla   # any host (smoke run)

Builds `lingjax.model.mlp.MoE` layers with random weights (fp8 128 x 128 blocks by default, as the
full-depth benchmark runs them; expert_bias drawn with --bias-std so that routing spreads), sets
--moe-kernel and --dense-kernel, and times `layer(x)` for x [1, M, D] inside one jitted loop
(bench.common.time_in_loop over --layers weight copies, the loop's own per-call cost subtracted).
With --profile DIR it traces that loop once more and prints, per XLA kernel of one layer call,
the µs per call, the count per call, and what the kernel computes (the fused HLO opcodes and the
jax source ops named in its metadata): the table the glue work (router, routing prologue, combine)
is read from.
"""
from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from bench.common import add_layer_loop_args, choice_list, int_list
from bench.kernel_table import fusion_summary, kernel_table, print_table, profile_loop, time_layer  # noqa: F401 (re-exported)
from lingjax import xla_env


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.moe_layer_timing", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--M", default="1,9", help="comma list of token counts (1..16; default 1,9)")
    ap.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8", help="expert / shared weights (default fp8)")
    ap.add_argument("--moe-kernel", default="pallas,xla", help="comma list of MoE kernels to time (default pallas,xla)")
    ap.add_argument("--dense-kernel", choices=["pallas", "xla"], default="pallas",
                    help="the shared expert's kernel when it runs on its own (default pallas)")
    ap.add_argument("--layers", type=int, default=2,
                    help="weight copies cycled through, as a model's layers are (default 2: 2.8 GB fp8, > L2)")
    ap.add_argument("--bias-std", type=float, default=1.0, help="expert_bias spread (default 1.0)")
    add_layer_loop_args(ap, "trace one more loop per row into DIR and print its kernels")
    return ap


def main(argv=None) -> dict:
    ap = build_parser()
    a = ap.parse_args(argv)
    ms = int_list(ap, a.M, "--M")
    kernels = choice_list(ap, a.moe_kernel, "--moe-kernel", ("pallas", "xla"))
    if not ms or min(ms) < 1 or max(ms) > 16 or a.iters < 1 or a.layers < 1 or not kernels:
        ap.error("--M needs token counts in 1..16, --iters and --layers >= 1, --moe-kernel at least one kernel")
    if not a.no_xla_defaults:
        xla_env.configure()
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from bench.common import save_result
    from lingjax.config import preset
    from lingjax.model import dense, kernels as kernel_ctx
    from lingjax.model.mlp import MoE, set_moe_kernel
    from lingjax.quant import quantize_model

    on_gpu = jax.default_backend() == "gpu"
    cfg = preset("ling3-tiny" if a.tiny else "ling3-flash")
    layer = cfg.first_k_dense_replace

    def build(i):
        m = MoE(cfg, layer, dtype=jnp.bfloat16, rngs=nnx.Rngs(a.seed + i))
        m.expert_bias.set_value(jax.random.normal(jax.random.PRNGKey(1000 + a.seed + i), (cfg.num_experts,),
                                                  jnp.float32) * a.bias_std)
        return quantize_model(m) if a.dtype == "fp8" else m

    mods = [build(i) for i in range(a.layers)]
    rows = []
    for kernel in kernels:
        graphdef = None
        states = []
        for m in mods:
            set_moe_kernel(m, kernel)
            dense.set_dense_kernel(m, a.dense_kernel if kernel == "pallas" else "xla")
            graphdef, st = nnx.split(m)
            states.append(st)

        def f(x, st, graphdef=graphdef):
            return nnx.merge(graphdef, st)(x)

        ctx = kernel_ctx.pallas_interpret if not on_gpu and kernel == "pallas" else contextlib.nullcontext
        for M in ms:
            xs = [jax.random.normal(jax.random.PRNGKey(a.seed + 7 * M + i), (1, M, cfg.hidden_size),
                                    jnp.float32).astype(jnp.bfloat16) for i in range(a.layers)]
            sets = [(x, st) for x, st in zip(xs, states)]
            row = {"moe_kernel": kernel, "M": M}
            row.update(time_layer(f, sets, a.iters, ctx=ctx,
                                  profile_dir=Path(a.profile) / f"{kernel}-M{M}" if a.profile else None))
            print(f"{kernel:6s} M={M:2d}: {row['layer_us']:7.1f} us per MoE layer call "
                  f"(loop overhead {row['loop_overhead_us']:.1f} us subtracted)"
                  + ("" if on_gpu else "  [not a GPU: smoke run, not a timing]"), flush=True)
            if a.profile:
                print_table(row["kernels"])
            rows.append(row)
    rec = {"bench": "moe_layer_timing", "dtype": a.dtype, "layers": a.layers, "bias_std": a.bias_std,
           "dense_kernel": a.dense_kernel, "iters": a.iters, "preset": "ling3-tiny" if a.tiny else "ling3-flash",
           "smoke": not on_gpu, "rows": rows}
    rec["result_path"] = str(save_result("moe_layer_timing", rec, a.out))
    return rec


if __name__ == "__main__":
    main()
