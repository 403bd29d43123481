"""KDA prefill kernels (pallas_kernels/kda_prefill.py): time per layer, % of the memory floor, error.

    python -m bench.kda_prefill_timing [--T 8192,65536] [--iters 20] [--json PATH]
    python -m bench.kda_prefill_timing --interpret --T 100 --iters 1 --heads 2   # CPU smoke

Shape: H=32 heads (--heads), K=V=128, --seqs equal packed sequences (default 1); bf16 q, k, v;
fp32 g (safe gate of random projections), beta; no initial state; fp32 output.
Rows, each the median over --iters blocked calls after --warmup calls (compile excluded):
  total   kda_prefill_pallas: both kernels plus the small XLA glue (chunk tables, casts, beta^T)
  prep    kernel 1 alone (intra-chunk: cumsum, Akk/Aqk, inverse, W, U, Kd, Qg)
  state   kernel 2 alone (serial state pass and outputs)
  fused   kda_prefill_fused_pallas (L2 norm, gate and beta sigmoid inside kernel 1)
  xla     lingjax.ops.kda.kda_chunked in fp32 (--xla; the model's current path)
`pipelined` = the same call issued --iters times back to back, one block at the end, / --iters
(no host sync in between: closest to device time). Floor = compulsory HBM bytes of the two-kernel
design (inputs, chunk intermediates written and read once, outputs) / the device copy bandwidth
measured here. Anchor (spec/kda.md, this H200): FLA chunk_kda 1.09 ms at 8192, 8.25 ms at 65536.
--check: relative RMSE of `total` vs the float64 recurrence on 4 heads (slow for long T).
Ends with one JSON line; --json PATH also writes it to PATH.
"""
from __future__ import annotations

import argparse

from bench.common import emit_record, int_list, time_rows
from lingjax import xla_env

FLA_MS = {8192: 1.09, 65536: 8.25}      # FLA chunk_kda on the H200 (spec/kda.md)
K = V = 128


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.kda_prefill_timing", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", default="8192,65536", help="comma list of total token counts")
    ap.add_argument("--heads", type=int, default=32, help="H (Ling: 32)")
    ap.add_argument("--seqs", type=int, default=1, help="equal packed sequences per call")
    ap.add_argument("--block-v", type=int, default=32, help="kernel 2's V block (state columns)")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per row")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per row (first compiles)")
    ap.add_argument("--xla", action="store_true", help="also time the XLA kda_chunked reference")
    ap.add_argument("--check", action="store_true", help="relative RMSE vs float64 on 4 heads")
    ap.add_argument("--interpret", action="store_true",
                    help="Mosaic GPU interpret mode (CPU smoke; times meaningless)")
    ap.add_argument("--json", default=None, help="also write the JSON record to this path")
    ap.add_argument("--no-xla-defaults", action="store_true", help="do not add the command-buffer XLA flags")
    ap.add_argument("--pallas-barriers", action="store_true",
                    help="compile the kernels with Pallas' automatic SMEM barriers (kda_prefill.OWN_BARRIERS "
                         "= False; the build before session 14) for an A/B")
    return ap


def make_inputs(T, H, seed=0):
    """bf16 q, k (L2-normalised), v; fp32 g from Ling's safe gate on random projections, beta."""
    import jax
    import jax.numpy as jnp
    from lingjax.ops.kda import kda_gate, l2_normalize
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    f32, bf16 = jnp.float32, jnp.bfloat16
    q = l2_normalize(jax.random.normal(ks[0], (T, H, K), f32)).astype(bf16)
    k = l2_normalize(jax.random.normal(ks[1], (T, H, K), f32)).astype(bf16)
    v = jax.random.normal(ks[2], (T, H, V), f32).astype(bf16)
    f = 2.0 * jax.random.normal(ks[3], (T, H, K), f32)
    g = kda_gate(f, jnp.log(jnp.linspace(1.0, 4.0, H, dtype=f32)), jnp.zeros((H * K,), f32))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (T, H), f32))
    return q, k, v, g, beta, f.astype(bf16)


def floor_bytes(T, H, n_seq) -> int:
    """Compulsory HBM bytes: q, k, v (bf16), g, beta (fp32) read; W, U, Kd, Qg, Aqk (bf16) and
    G_C (fp32) written by kernel 1 and read by kernel 2; o (fp32) and the final state written."""
    from pallas_kernels.kda_prefill import CHUNK
    n_chunks = -(-T // CHUNK) + n_seq - 1
    inputs = T * H * (3 * K * 2 + K * 4 + 4)
    chunk = n_chunks * H * (CHUNK * (3 * K + V + CHUNK) * 2 + K * 4)
    return inputs + 2 * chunk + T * H * V * 4 + n_seq * H * K * V * 4




def rel_rmse_f64(o, s, q, k, v, g, beta, cu):
    """Relative RMSE of (o, s) vs the float64 recurrence on 4 heads, per packed sequence."""
    import numpy as np
    from lingjax.ops.kda import kda_recurrent_numpy
    H = q.shape[1]
    heads = sorted({0, H // 4, H // 2, H - 1})
    xs = [np.asarray(x).astype(np.float64)[:, heads] for x in (q, k, v, g, beta)]
    ro, rs = [], []
    for i in range(len(cu) - 1):
        oi, si = kda_recurrent_numpy(*(x[None, cu[i]:cu[i + 1]] for x in xs))
        ro.append(oi[0])
        rs.append(si[0])
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
    return (rel(np.asarray(o, np.float64)[:, heads], np.concatenate(ro)),
            rel(np.asarray(s, np.float64)[:, heads], np.stack(rs)))


def run_T(T, a, interpret, copy_bw) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from lingjax.ops.kda import kda_chunked
    from pallas_kernels import kda_prefill as kp
    H, S = a.heads, a.seqs
    q, k, v, g, beta, f = make_inputs(T, H)
    cu = jnp.asarray(np.linspace(0, T, S + 1).astype(np.int32))
    A_log = jnp.log(jnp.linspace(1.0, 4.0, H, dtype=jnp.float32))
    dt_bias = jnp.zeros((H * K,), jnp.float32)
    kw = dict(block_v=a.block_v, interpret=interpret)
    total = jax.jit(lambda q, k, v, g, b, cu: kp.kda_prefill_pallas(q, k, v, g, b, cu_seqlens=cu, **kw))
    fused = jax.jit(lambda q, k, v, f, b, cu: kp.kda_prefill_fused_pallas(
        q, k, v, f, b, A_log, dt_bias, cu_seqlens=cu, **kw))
    tables = jax.jit(lambda cu: kp.chunk_tables(cu, T, S))
    tok0, ntok, clo, chi = tables(cu)
    beta_t = jnp.pad(beta.T, ((0, 0), (0, (-T) % 4)))
    scale = K ** -0.5
    prep = jax.jit(lambda *xs: kp._prep(*xs, None, scale, interpret))
    prep_args = (tok0, ntok, q, k, v, g, beta_t)
    state = jax.jit(lambda *xs: kp._state(clo, chi, cu, *xs, None, T, a.block_v, jnp.float32,
                                          interpret))
    try:
        mid = jax.block_until_ready(prep(*prep_args))
    except Exception:               # kernel 1 fails: its row records the error, kernel 2 is skipped
        mid = None

    rec = {"T": T, "H": H, "K": K, "V": V, "seqs": S, "block_v": a.block_v,
           "floor_bytes": floor_bytes(T, H, S)}
    rec["floor_ms"] = rec["floor_bytes"] / copy_bw * 1e3
    rows = [("total", total, (q, k, v, g, beta, cu)), ("prep", prep, prep_args)]
    rows += [("state", state, mid)] if mid is not None else []
    rows += [("fused", fused, (q, k, v, f, logit(beta), cu))]
    if a.xla:
        rows.append(("xla", jax.jit(lambda q, k, v, g, b: kda_chunked(
            *(x.astype(jnp.float32)[None] for x in (q, k, v, g, b)))), (q, k, v, g, beta)))
    for name, (med, piped) in time_rows(rows, a.iters, a.warmup, rec).items():
        rec[f"{name}_ms"], rec[f"{name}_pipelined_ms"] = med * 1e3, piped * 1e3
    if "total_ms" not in rec:
        return rec
    rec["pct_floor"] = 100 * rec["floor_ms"] / rec["total_pipelined_ms"]
    if T in FLA_MS:
        rec["fla_ms"] = FLA_MS[T]
        rec["speedup_vs_fla"] = FLA_MS[T] / rec["total_pipelined_ms"]
    if a.check:
        o, s = total(q, k, v, g, beta, cu)
        rec["rmse_o_f64"], rec["rmse_s_f64"] = rel_rmse_f64(o, s, q, k, v, g, beta,
                                                            np.asarray(cu).tolist())
    return rec


def logit(beta):
    import jax.numpy as jnp
    return jnp.log(beta) - jnp.log1p(-beta)


def main(argv=None) -> dict:
    ap = build_parser()
    a = ap.parse_args(argv)
    Ts = int_list(ap, a.T, "--T")
    if not Ts or min(Ts) < 1 or a.iters < 1 or a.seqs < 1 or a.heads < 1:
        ap.error("--T, --iters, --seqs and --heads must be >= 1")
    if not a.no_xla_defaults:
        xla_env.configure()
    import jax
    if a.pallas_barriers:
        from pallas_kernels import kda_prefill
        kda_prefill.OWN_BARRIERS = False

    from bench.batch1 import measure_copy_bandwidth
    from bench.common import env_info, kernel_interpret
    backend = jax.default_backend()
    interpret = kernel_interpret(ap, a, "the kernels")
    copy_bw = measure_copy_bandwidth((1024 if backend == "gpu" else 8) << 20)
    results = []
    for T in Ts:
        rec = run_T(T, a, interpret, copy_bw)
        results.append(rec)
        names = ("total", "prep", "state", "fused", "xla")
        line = " ".join(f"{n} {rec[n + '_pipelined_ms']:.3f} ms" for n in names if n + "_ms" in rec)
        if "pct_floor" in rec:
            line += f"; floor {rec['floor_ms']:.3f} ms = {rec['pct_floor']:.0f}%"
        if "fla_ms" in rec:
            line += f" ({rec['speedup_vs_fla']:.2f}x FLA {rec['fla_ms']} ms)"
        errors = [n for n in names if n + "_error" in rec]
        print(f"T={T}: {line}" + (f"; FAILED: {', '.join(errors)} (see the JSON)" if errors else ""))
    record = {"bench": "kda_prefill", "copy_GBps": copy_bw / 1e9, "pallas_barriers": a.pallas_barriers,
              "results": results,
              "env": env_info()}
    emit_record(record, a.json)
    return record


if __name__ == "__main__":
    main()
