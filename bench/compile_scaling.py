"""How XLA's compile time grows with the number of Mosaic GPU call sites in one program.

    python -m bench.compile_scaling --kernels prefill,prefill+shared,skinny,xla --sites 1,4  # H200
    python -m bench.compile_scaling --kernels skinny --sites 1,2 --lower-only     # any host

A full-depth model with the Pallas kernels compiled for many minutes longer than the XLA path,
although calls of one kernel share one Mosaic compile (kernel hash). Every call site carried its
kernel's serialized module in the HLO (bench.kernel_module_size), so this times programs that are
N calls of ONE kernel chained through their outputs, for several N (H200, session 6: the prefill
kernel cost ~7 s per direct call site, and ~6 s in all for 16 sites through shared_call):
  prefill  the fused KDA prefill kernel on a 2048-token chunk (H = 32, K = V = 128, ~2 MB per site)
  skinny   the fp8 skinny GEMM, x [1, 2560] @ w [2560, 20480] (the KDA input projection, ~0.1 MB)
  xla      the same chain with XLA's dot on a bf16 weight (no Mosaic call: the control)
A "+shared" suffix calls the kernel through lingjax.model.kernels.shared_call (one cached jit: the
module text appears once however many call sites), as the model does.
Each program is lowered and compiled in a fresh jit (JAX's persistent cache off for the run); a
per-site cost that stays flat as N grows means every call site pays it.
"""
from __future__ import annotations

import argparse
import time

from bench.common import int_list

KERNELS = ("prefill", "skinny", "xla", "prefill+shared", "skinny+shared")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.compile_scaling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", default="prefill,skinny,xla", help=f"comma list of {', '.join(KERNELS)}")
    ap.add_argument("--sites", default="1,4,16", help="comma list of call-site counts (default 1,4,16)")
    ap.add_argument("--lower-only", action="store_true",
                    help="lower for CUDA only (any host; no compile times): checks the programs build")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    return ap


def chain(kind: str, n: int):
    """(fn, example args as ShapeDtypeStructs) for n chained calls of one kernel."""
    import jax
    import jax.numpy as jnp

    from lingjax.model.kernels import shared_call
    from pallas_kernels import kda_prefill, skinny_gemm

    sds = jax.ShapeDtypeStruct
    kind, shared = kind.removesuffix("+shared"), kind.endswith("+shared")

    def call(fn, *args, **kw):
        return shared_call(fn, *args, **kw) if shared else fn(*args, **kw)
    if kind == "prefill":
        T, H, K = 2048, 32, 128

        def fn(q, k, v, f, b, a_log, dt_bias):
            for _ in range(n):   # the output feeds the next call's v: n distinct, ordered call sites
                o, _ = call(kda_prefill.kda_prefill_fused_pallas, q, k, v, f, b, a_log, dt_bias, lower_bound=-5.0)
                v = o.astype(v.dtype)
            return v
        bf = jnp.bfloat16
        return fn, (sds((T, H, K), bf), sds((T, H, K), bf), sds((T, H, K), bf), sds((T, H, K), bf),
                    sds((T, H), bf), sds((H,), jnp.float32), sds((H * K,), jnp.float32))
    D, N = 2560, 20480
    if kind == "skinny":
        def fn(x, w, s):
            for _ in range(n):
                x = call(skinny_gemm.skinny_gemm_pallas, x, w, s)[:, :D]
            return x
        return fn, (sds((1, D), jnp.bfloat16), sds((D, N), jnp.float8_e4m3fn),
                    sds((D // 128, N // 128), jnp.float32))
    if kind == "xla":
        def fn(x, w):
            for _ in range(n):
                x = jnp.dot(x, w)[:, :D]
            return x
        return fn, (sds((1, D), jnp.bfloat16), sds((D, N), jnp.bfloat16))
    raise ValueError(f"unknown kernel {kind!r}: one of {KERNELS}")


def main(argv=None) -> dict:
    ap = build_parser()
    a = ap.parse_args(argv)
    kinds = [k for k in a.kernels.split(",") if k]
    bad = [k for k in kinds if k not in KERNELS]
    if bad or not kinds:
        ap.error(f"--kernels: unknown {bad}; choose from {', '.join(KERNELS)}")
    sites = int_list(ap, a.sites, "--sites")
    if not sites or min(sites) < 1:
        ap.error("--sites needs counts >= 1")
    import jax

    from bench.common import save_result
    from lingjax.model.kernels import pallas_cross_lowering

    if not a.lower_only and jax.default_backend() != "gpu":
        ap.error(f"compiling needs an NVIDIA Hopper GPU (backend {jax.default_backend()!r}); pass --lower-only")
    if not a.lower_only:                     # times real compiles, not loads from a persistent cache
        jax.config.update("jax_enable_compilation_cache", False)
    rows = []
    for kind in kinds:
        for n in sites:
            fn, args = chain(kind, n)
            t0 = time.perf_counter()
            with pallas_cross_lowering():
                lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
            t1 = time.perf_counter()
            text_bytes = len(lowered.as_text())
            compile_s = None
            if not a.lower_only:
                lowered.compile()
                compile_s = time.perf_counter() - t1
            row = {"kernel": kind, "sites": n, "lower_s": t1 - t0, "compile_s": compile_s,
                   "program_text_bytes": text_bytes}
            rows.append(row)
            per = "" if compile_s is None else f"  compile {compile_s:7.1f} s ({compile_s / n:6.2f} s per site)"
            print(f"{kind:8s} x{n:<4d} lower {row['lower_s']:6.1f} s  text {text_bytes / 1e6:7.1f} MB{per}",
                  flush=True)
    rec = {"bench": "compile_scaling", "lower_only": a.lower_only, "rows": rows}
    rec["result_path"] = str(save_result("compile_scaling", rec, a.out))
    return rec


if __name__ == "__main__":
    main()
