"""Where kernel 1 of the KDA prefill (pallas_kernels/kda_prefill.py) spends its time: phase deltas.

    python -m bench.kda_prefill_phases [--T 8192] [--iters 20] [--json PATH]
    python -m bench.kda_prefill_phases --interpret --T 100 --heads 2 --iters 1   # CPU smoke

Times kernel 1 alone (H=32 heads, K=V=128, one sequence, the inputs of bench.kda_prefill_timing)
in several builds, each traced and compiled afresh:
  smem            WGMMA A operands staged through SMEM tiles (A_FROM_REGISTERS = False)
  regs            A operands from registers (the default)
  regs-<phase>    the default with one phase left out (kda_prefill._SKIP_PHASES): cumsum (step 1),
                  intra (Akk / Aqk, step 2), inverse (step 4), rhs (the exp-scaled W rhs, Qg, Kd
                  stores, step 3), wu (the W, U products, step 5)
  regs-all        every phase left out: loads, the beta / G_C / output stores only
The outputs of a build with a phase left out are wrong: these rows are timings, nothing else.
A phase's cost is roughly `regs` minus `regs-<phase>` (phases overlap with each other's latency,
so the deltas need not add up). ms = pipelined calls (--iters back to back, one block) / --iters.
Ends with one JSON line; --json PATH also writes it to PATH.
"""
from __future__ import annotations

import argparse

from bench.common import emit_record, int_list, time_rows
from lingjax import xla_env

PHASES = ("cumsum", "intra", "inverse", "rhs", "wu")
VARIANTS = ("smem", "regs") + tuple(f"regs-{p}" for p in PHASES) + ("regs-all",)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.kda_prefill_phases", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", default="8192", help="comma list of token counts")
    ap.add_argument("--heads", type=int, default=32, help="H (Ling: 32)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma list of builds to time (default: all of {', '.join(VARIANTS)})")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per row")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per row (first compiles)")
    ap.add_argument("--interpret", action="store_true",
                    help="Mosaic GPU interpret mode (CPU smoke; times meaningless)")
    ap.add_argument("--json", default=None, help="also write the JSON record to this path")
    return ap


def variant_settings(name: str) -> tuple[bool, frozenset]:
    """Build name -> (A_FROM_REGISTERS, _SKIP_PHASES)."""
    if name not in VARIANTS:
        raise ValueError(f"unknown build {name!r}; choose from {', '.join(VARIANTS)}")
    if name == "smem":
        return False, frozenset()
    phase = name.removeprefix("regs").removeprefix("-")
    return True, frozenset(PHASES if phase == "all" else ((phase,) if phase else ()))


def time_variants(T, H, variants, iters, warmup, interpret) -> dict:
    import jax
    import jax.numpy as jnp
    from bench.kda_prefill_timing import K, make_inputs
    from pallas_kernels import kda_prefill as kp
    q, k, v, g, beta, _ = make_inputs(T, H)
    cu = jnp.array([0, T], jnp.int32)
    tok0, ntok, _, _ = jax.jit(lambda cu: kp.chunk_tables(cu, T, 1))(cu)
    args = (tok0, ntok, q, k, v, g, beta.T)
    rec = {"T": T, "H": H}
    saved = kp.A_FROM_REGISTERS, kp._SKIP_PHASES
    try:
        for name in variants:
            kp.A_FROM_REGISTERS, kp._SKIP_PHASES = variant_settings(name)
            # A fresh function per build: the settings are read when it is traced.
            f = jax.jit(lambda *xs: kp._prep(*xs, None, K ** -0.5, interpret))
            for row, (med, piped) in time_rows([(name, f, args)], iters, warmup, rec).items():
                rec[f"{row}_ms"], rec[f"{row}_pipelined_ms"] = med * 1e3, piped * 1e3
    finally:
        kp.A_FROM_REGISTERS, kp._SKIP_PHASES = saved
    return rec


def main(argv=None) -> dict:
    ap = build_parser()
    a = ap.parse_args(argv)
    Ts = int_list(ap, a.T, "--T")
    variants = [s for s in a.variants.split(",") if s]
    bad = [s for s in variants if s not in VARIANTS]
    if bad or not variants:
        ap.error(f"--variants: unknown {bad}; choose from {', '.join(VARIANTS)}")
    if not Ts or min(Ts) < 1 or a.iters < 1 or a.heads < 1:
        ap.error("--T, --iters and --heads must be >= 1")
    xla_env.configure()
    from bench.common import env_info, kernel_interpret
    interpret = kernel_interpret(ap, a, "the kernels")
    results = []
    for T in Ts:
        rec = time_variants(T, a.heads, variants, a.iters, a.warmup, interpret)
        results.append(rec)
        base = rec.get("regs_pipelined_ms")
        for name in variants:
            if f"{name}_error" in rec:
                print(f"T={T} {name:>14}: FAILED ({rec[name + '_error'][:200]})")
                continue
            ms = rec[f"{name}_pipelined_ms"]
            delta = f"  (regs - this: {base - ms:+.3f} ms)" if base is not None and name != "regs" else ""
            print(f"T={T} {name:>14}: {ms:.3f} ms{delta}")
    record = {"bench": "kda_prefill_phases", "results": results, "env": env_info()}
    emit_record(record, a.json)
    return record


if __name__ == "__main__":
    main()
