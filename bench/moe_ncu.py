"""A few calls of the routed-expert MoE kernels on random Ling-shaped fp8 weights, for Nsight Compute.

    ncu --kernel-name regex:moe_ --launch-skip 2 --launch-count 2 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        python -m bench.moe_ncu --M 9 --shared

The kernels are named after their bodies (moe_gate_up, moe_down). No XLA command-buffer flags
(each kernel launches on its own), no timing: ncu replays each profiled kernel.
"""
from __future__ import annotations

import argparse


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.moe_ncu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--M", type=int, default=9, help="tokens (1..16)")
    ap.add_argument("--calls", type=int, default=3, help="calls of the MoE layer")
    ap.add_argument("--shared", action="store_true", help="with the shared expert slot")
    ap.add_argument("--fp8-schedule", default="serial", help="serial or async")
    ap.add_argument("--k-major", action="store_true",
                    help="weights with the contraction axis major (k_minor=False; default: the model's K-minor layout)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    import jax
    import numpy as np

    from bench.moe_kernel_timing import k_major_weights, make_weights, split_shared
    from pallas_kernels.moe_experts import moe_experts_pallas
    E, D, F, k = 512, 2560, 768, 8
    weights = split_shared(make_weights(E + a.shared, D, F, a.seed), E, None, a.shared)
    routed, shared = k_major_weights(weights) if a.k_major else weights
    rng = np.random.default_rng(a.seed)
    f = jax.jit(lambda *xs: moe_experts_pallas(*xs, shared=shared, fp8_schedule=a.fp8_schedule,
                                                 k_minor=not a.k_major))
    for c in range(a.calls):
        idx = jax.numpy.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(a.M)]), "int32")
        w = jax.numpy.asarray(rng.uniform(0.05, 1.0, (a.M, k)), "float32")
        x = jax.random.normal(jax.random.PRNGKey(c), (a.M, D)).astype("bfloat16")
        jax.block_until_ready(f(x, idx, w, *routed))
    print(f"moe_ncu: {a.calls} calls at M={a.M}{' + shared' if a.shared else ''} done")


if __name__ == "__main__":
    main()
