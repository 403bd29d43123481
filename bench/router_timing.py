"""The MoE router (lingjax.ops.moe.route) with each of its selections: sorts vs rank comparisons.

    python -m bench.router_timing --M 1,9            # on the H200
    python -m bench.router_timing --M 1 --iters 2     # any host (a smoke run, not a timing)

Ling-3.0-flash router: x [M, 2560] bf16 @ router [2560, 512] bf16, fp32 sigmoid scores plus a
spread bias, 8 groups (top-2 sum), 4 groups kept, top-8 experts, normalised weights. Rows per M:
`sort` (every top-k through jax.lax.top_k, a sort kernel on the GPU), `rank` (top_k_by_rank:
comparisons and reductions, one 512 x 512 comparison per token for the final top-8; session 7),
`grouped-rank` (grouped_top_k_by_rank: each group's top-8 by rank, then the top-8 of the 64
group top-8s, the unkept groups' masked; session 16) and `grouped-merge` (grouped_top_k_by_merge:
the same as list-merging reductions; the model's selection for M <= SORT_FREE_MAX_ROWS = 16),
µs per call inside one jitted loop (bench.common.time_in_loop, the loop's own per-call cost
subtracted), and whether each gives the sorted selection's experts and weights for the same inputs.
"""
from __future__ import annotations

import argparse

from bench.common import int_list


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.router_timing", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--M", default="1,9", help="comma list of token counts (1..16; default 1,9)")
    ap.add_argument("--iters", type=int, default=50, help="loop iterations per timing (default 50)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    return ap


def main(argv=None) -> dict:
    ap = build_parser()
    a = ap.parse_args(argv)
    ms = int_list(ap, a.M, "--M")
    if not ms or min(ms) < 1 or max(ms) > 16 or a.iters < 1:
        ap.error("--M needs token counts in 1..16 and --iters >= 1")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench.common import loop_overhead, save_result, time_in_loop
    from lingjax.config import preset
    from lingjax.ops import moe

    cfg = preset("ling3-flash")
    d, e = cfg.hidden_size, cfg.num_experts
    kw = dict(n_group=cfg.n_group, topk_group=cfg.topk_group, top_k=cfg.num_experts_per_tok,
              norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor)
    key = jax.random.PRNGKey(a.seed)
    kx, kw_, kb = jax.random.split(key, 3)
    w = (jax.random.normal(kw_, (d, e), jnp.float32) * d ** -0.5).astype(jnp.bfloat16)
    bias = jax.random.normal(kb, (e,), jnp.float32)
    smoke = jax.default_backend() != "gpu"
    rows = []
    for m in ms:
        x = jax.random.normal(jax.random.fold_in(kx, m), (m, d), jnp.float32).astype(jnp.bfloat16)
        sets = [(x + i, w, bias) for i in range(4)]
        row = {"M": m}
        outs = {}
        overhead = loop_overhead(sets, a.iters)
        row["loop_overhead_us"] = overhead * 1e6
        for name in moe.SELECTIONS:
            def f(x, w, b, selection=name):
                return moe.route(x, w, b, selection=selection, **kw)
            outs[name] = [np.asarray(o) for o in jax.jit(f)(*sets[0])]
            t = time_in_loop(f, sets, a.iters)
            row[f"{name}_us"] = (t - overhead) * 1e6
            row[f"{name}_raw_us"] = t * 1e6
        same = {name: bool(all(np.array_equal(p, q) for p, q in zip(outs["sort"], outs[name])))
                for name in moe.SELECTIONS[1:]}
        row["same_routing"] = all(same.values())
        row["same_routing_by_selection"] = same
        rows.append(row)
        times = ", ".join(f"{name} {row[name + '_us']:6.1f}" for name in moe.SELECTIONS)
        print(f"M={m:2d}: {times} us per call (loop overhead {row['loop_overhead_us']:.1f} us subtracted); "
              f"same routing as sort: {same}" + ("  [not a GPU: smoke run, not a timing]" if smoke else ""),
              flush=True)
    rec = {"bench": "router_timing", "iters": a.iters, "smoke": smoke, "rows": rows}
    rec["result_path"] = str(save_result("router_timing", rec, a.out))
    return rec


if __name__ == "__main__":
    main()
