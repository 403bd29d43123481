"""Kernel parity on a depth-reduced, full-width model: the Pallas paths against the XLA path.

    python -m bench.kernel_parity --layers 6 --dtype bf16 --spec none,dspark
    python -m bench.kernel_parity --tiny --interpret --layers 4 --output-len 8     # CPU smoke

Random weights at Ling-3.0-flash widths (the first --layers layers; layer 5 is the first MLA
layer), built once. Its programs are traced twice: every kernel switch 'xla', then the switches in
--kernels 'pallas'. Reported (one JSON record):
  - logits of one prefill forward over the prompt (T = --input-len: the prefill kernel), then a
    9-token verify block and a 1-token decode on that cache (the decode kernels at M = 9 and 1):
    relative error kernels vs XLA (whole and median position: a near-tie in a random router sends
    a position to other experts on either path, a large error at that position only) and top-1
    agreement;
  - the greedy output of each --spec method (DSpark / MTP with random drafters: natural
    acceptance), kernels vs XLA: identical, or the first differing position with the XLA path's
    logit margin there between its token and the kernels' token, in units of the logits' standard
    deviation (a near-tie that bf16 rounding flips is small against 1);
  - under the kernels, each speculative method's tokens against plain greedy decoding's.
The routers' expert_bias is spread (--router-bias-sd) so that expert choice is not a coin toss on
near-ties (with the benchmark's zero bias, XLA alone disagrees with itself between batchings).
Random weights put greedy decoding on near-ties (median top-2 margin ~0.15 logit sd at Ling
widths), where any change of batching splits two paths, XLA against itself included (its decode
steps against one forward over the same tokens). So differences are judged by XLA's logit margin
at them: a tie is within max(--max-tie-margin, the largest margin at which XLA disagrees with
itself). Exit status 1 when a top-1 difference of the forwards or a first difference of two greedy
sequences (kernels vs XLA; speculative vs plain under each build) lies beyond that tolerance.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from lingjax import xla_env

SWITCH_NAMES = ("kda", "moe", "dense", "mla")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.kernel_parity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6, help="depth of the reduced model (default 6: 5 KDA + 1 MLA)")
    ap.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16",
                    help="weights: bf16, or fp8 = block-fp8 weights with bf16 activations")
    ap.add_argument("--kernels", default="kda,moe,dense",
                    help="comma list of the switches set to 'pallas' in the kernel build: kda, moe, dense, mla "
                         "(default kda,moe,dense)")
    ap.add_argument("--spec", default="none,dspark", help="comma list of none, mtp, dspark (greedy output compared)")
    ap.add_argument("--block-size", type=int, default=8, help="drafts per speculative step")
    ap.add_argument("--input-len", type=int, default=512, help="prompt tokens (random ids)")
    ap.add_argument("--output-len", type=int, default=128, help="greedy tokens generated per method")
    ap.add_argument("--max-tie-margin", type=float, default=0.05,
                    help="smallest tie tolerance in logit standard deviations (default 0.05); raised to the "
                         "largest margin at which XLA's greedy decoding disagrees with its own one-forward argmax")
    ap.add_argument("--router-bias-sd", type=float, default=1.0, metavar="SD",
                    help="expert_bias of every MoE router drawn N(0, SD) (benchmark init: zeros). A random "
                         "router's top-8 of 512 sits on near-ties that any rounding flips, on either path; "
                         "a spread bias makes the chosen experts stable while still token-dependent. 0 = zeros")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile-workers", type=int, default=8, metavar="N",
                    help="XLA compilations at a time (threads; every program of both builds is compiled ahead)")
    ap.add_argument("--tiny", action="store_true",
                    help="the tiny test config (expert width 128) instead of Ling-3.0-flash widths")
    ap.add_argument("--interpret", action="store_true",
                    help="run the kernels in Mosaic GPU interpret mode (CPU); default: compiled (H200)")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    return ap


def _kernel_list(ap, text: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [n for n in names if n not in SWITCH_NAMES]
    if not names or bad or len(set(names)) != len(names):
        ap.error(f"--kernels {text!r}: expected a comma list of distinct {', '.join(SWITCH_NAMES)}")
    return names


def _spec_list(ap, text: str) -> tuple[str, ...]:
    specs = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [s for s in specs if s not in ("none", "mtp", "dspark")]
    if not specs or bad or len(set(specs)) != len(specs):
        ap.error(f"--spec {text!r}: expected a comma list of distinct none, mtp, dspark")
    if "none" not in specs:
        specs = ("none",) + specs        # the plain greedy reference of the speculative methods
    return specs


def main(argv=None) -> dict:
    ap = build_parser()
    a = ap.parse_args(argv)
    kernels = _kernel_list(ap, a.kernels)
    specs = _spec_list(ap, a.spec)
    if a.router_bias_sd < 0 or a.max_tie_margin < 0:
        ap.error("--router-bias-sd and --max-tie-margin must be >= 0")
    if a.layers < 1 or a.input_len < 1 or a.output_len < 2 or a.block_size < 1 or a.compile_workers < 1:
        ap.error("--layers >= 1, --input-len >= 1, --output-len >= 2, --block-size >= 1 and "
                 "--compile-workers >= 1 are required")
    xla_env.configure()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from bench.batch1 import TINY_CONFIG, draft_config_for
    from bench.common import block, compile_ahead, save_result
    from lingjax import sharding
    from lingjax.config import LingConfig, preset
    from lingjax.model.dense import set_dense_kernel
    from lingjax.model.kda import set_kda_kernel
    from lingjax.model.mla import set_mla_kernel
    from lingjax.model.kernels import pallas_interpret
    from lingjax.model.ling import LingModel
    from lingjax.model.mlp import set_moe_kernel
    from lingjax.quant import quantize_model
    from lingjax.sampling import SamplingArrays, SamplingParams
    from lingjax.spec_decode import CACHE_ALIGN, Decoder, SpecConfig

    if a.tiny:   # the MoE kernel's tiles need expert widths that are multiples of 128 (tiny: 32)
        cfg = LingConfig.from_json(TINY_CONFIG).replace(moe_intermediate_size=128, num_hidden_layers=a.layers)
    else:
        cfg = preset("ling3-flash").replace(num_hidden_layers=a.layers)
    need = a.input_len + 9 + 1
    if max(need, a.input_len + a.output_len + a.block_size + 2) > cfg.max_position_embeddings:
        ap.error(f"--input-len {a.input_len} + --output-len {a.output_len} exceed the context "
                 f"({cfg.max_position_embeddings})")
    mode = pallas_interpret if a.interpret else contextlib.nullcontext
    fp8 = a.dtype == "fp8"
    t0 = time.perf_counter()
    mesh = sharding.make_mesh(1, 1, jax.devices()[:1])

    def build_target():
        m = LingModel(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), with_mtp="mtp" in specs)
        return quantize_model(m) if fp8 else m
    target = sharding.random_init_sharded(build_target, mesh, seed=a.seed)
    draft = None
    if "dspark" in specs:
        from lingjax.model.dspark import DSparkDraft
        dcfg = draft_config_for(cfg, a.block_size)
        draft = sharding.random_init_sharded(lambda: DSparkDraft(dcfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(1)),
                                             mesh, seed=a.seed + 1)
    if a.router_bias_sd > 0:
        from lingjax.model.mlp import MoE
        bias_key = jax.random.key(a.seed + 2)
        for _, mod in nnx.iter_modules(target):
            if isinstance(mod, MoE):
                bias_key, sub = jax.random.split(bias_key)
                old = mod.expert_bias.get_value()
                mod.expert_bias.set_value(jax.device_put(
                    a.router_bias_sd * jax.random.normal(sub, old.shape, old.dtype), old.sharding))
    block(nnx.state(target))
    print(f"model ready in {time.perf_counter() - t0:.1f}s: {a.layers} layers at "
          f"{'tiny' if a.tiny else 'Ling-3.0-flash'} widths, {a.dtype}", flush=True)

    rng = np.random.default_rng(a.seed)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, a.input_len)), jnp.int32)
    block_toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 9)), jnp.int32)
    samp = SamplingArrays.from_params(SamplingParams())

    def set_switches(value: str):
        set_kda_kernel(target, value if "kda" in kernels else "xla")
        set_moe_kernel(target, value if "moe" in kernels else "xla")
        set_dense_kernel(target, value if "dense" in kernels else "xla")
        set_mla_kernel(target, value if "mla" in kernels else "xla")

    def lower_forwards():
        """The lowered forwards of the model as it is switched now: prefill over the prompt, then a
        9-token verify and a 1-token decode on its cache -> logits ([T, V], [9, V], [1, V])."""
        graph, params = nnx.split(target)

        @jax.jit
        def run(params, prompt, block_toks):
            model = nnx.merge(graph, params)
            cache = model.init_cache(1, -(-(a.input_len + 16) // CACHE_ALIGN) * CACHE_ALIGN)   # the MLA kernel's TMA: S % 8
            pre = model(prompt, cache)
            ver = model(block_toks, pre.cache, pending=True)
            dec = model(block_toks[:, :1], pre.cache)
            return pre.logits[0], ver.logits[0], dec.logits[0]
        return run.lower(params, prompt, block_toks), params

    def lower_sequence_logits():
        """The lowered XLA forward over prompt + output_len generated tokens -> logits [T + n, V]
        (row input_len - 1 + i: the next-token logits after prompt + tokens[:i])."""
        graph, params = nnx.split(target)

        @jax.jit
        def logits_all(params, toks):
            model = nnx.merge(graph, params)
            return model(toks, model.init_cache(1, toks.shape[1])).logits[0]
        return logits_all.lower(params, jnp.zeros((1, a.input_len + a.output_len), jnp.int32)), params

    # Both builds' programs are traced here (each Decoder / forward splits the model as switched
    # then) and compiled together, --compile-workers at a time.
    t = time.perf_counter()
    decoders, fwd = {}, {}
    with mode(), ThreadPoolExecutor(a.compile_workers) as pool:
        for build in ("xla", "pallas"):
            set_switches(build)
            lowered, params = lower_forwards()
            fwd[build] = (pool.submit(lowered.compile), params)
            if build == "xla":
                lowered, params = lower_sequence_logits()
                fwd["sequence"] = (pool.submit(lowered.compile), params)
            for m in specs:
                decoders[(build, m)] = Decoder(target, SpecConfig(m, a.block_size),
                                               draft=draft if m == "dspark" else None)
        set_switches("xla")
        exes = compile_ahead(decoders, lambda key, dec: (prompt, None, jax.random.key(0),
                                                         jnp.ones((len(dec.spec.widths),), jnp.float32)),
                             samp, a.output_len, a.compile_workers, name=lambda key: f"{key[0]} {key[1]}")
        fwd = {b: (f.result(), p) for b, (f, p) in fwd.items()}
    print(f"compiled in {time.perf_counter() - t:.1f}s", flush=True)

    def generate(key) -> list[int]:
        dec, (prefill, loop) = decoders[key], exes[key]
        step_cost = jnp.ones((len(dec.spec.widths),), jnp.float32)
        st = prefill(dec.params, prompt, jnp.int32(a.output_len), jax.random.key(0), samp, step_cost)
        st = loop(dec.params, st, samp, None, a.output_len + 1)
        out, n = jax.device_get((st.out, st.n_out))
        return [int(t) for t in out[:int(n)]]

    results = {}
    for build in ("xla", "pallas"):
        exe, params = fwd[build]
        logits = [np.asarray(x, np.float32) for x in jax.device_get(exe(params, prompt, block_toks))]
        results[build] = (logits, {m: generate((build, m)) for m in specs})

    def next_token_logits(tokens: list[int]):
        """XLA path's next-token logits [len(tokens), V] after prompt + tokens[:i], float64."""
        exe, params = fwd["sequence"]
        toks = np.zeros((1, a.input_len + a.output_len), np.int32)
        toks[0, :a.input_len] = np.asarray(prompt)[0]
        toks[0, a.input_len:a.input_len + len(tokens)] = tokens
        lg = jax.device_get(exe(params, jnp.asarray(toks)))
        return np.asarray(lg[a.input_len - 1:a.input_len - 1 + len(tokens)], np.float64)

    def margin_sd(lg, want: int, got: int) -> float:
        """logit(want) - logit(got) in units of the logits' standard deviation."""
        return float((lg[want] - lg[got]) / lg.std())

    (lx, tx), (lp, tp) = results["xla"], results["pallas"]
    rec = {"bench": "kernel_parity", "model": "random:" + ("tiny" if a.tiny else "ling3-flash"),
           "layers": a.layers, "dtype": a.dtype, "kernels": list(kernels), "input_len": a.input_len,
           "output_len": a.output_len, "block_size": a.block_size, "interpret": a.interpret,
           "router_bias_sd": a.router_bias_sd, "forward": {},
           "greedy": {}, "flags": vars(a)}
    for name, x, p in zip(("prefill", "verify9", "decode1"), lx, lp):
        per_pos = np.linalg.norm(p - x, axis=-1) / np.linalg.norm(x, axis=-1)
        rec["forward"][name] = {"rel_error": float(np.linalg.norm(p - x) / np.linalg.norm(x)),
                                "median_position_rel_error": float(np.median(per_pos)),
                                "top1_agreement": float(np.mean(p.argmax(-1) == x.argmax(-1))),
                                "positions": int(x.shape[0])}
    # XLA's own batching noise: its greedy tokens (decode steps of one token) against the argmax of
    # one forward over the same sequence; where they differ, by how much (logit sd units)
    lg_none = next_token_logits(tx["none"])
    top2 = np.sort(np.partition(lg_none, -2, axis=-1)[:, -2:], axis=-1)
    sd = lg_none.std(axis=-1)
    self_split = [float((lg_none[i].max() - lg_none[i][t]) / sd[i]) for i, t in enumerate(tx["none"])
                  if lg_none[i].argmax() != t]
    tol = max([a.max_tie_margin] + self_split)
    rec["xla_self"] = {"median_top2_margin_sd": float(np.median((top2[:, 1] - top2[:, 0]) / sd)),
                       "greedy_vs_sequence_argmax_differences": len(self_split),
                       "max_margin_sd_of_those": max(self_split, default=0.0), "tie_tolerance_sd": tol}
    failed = []
    for name, x, p in zip(("prefill", "verify9", "decode1"), lx, lp):
        bad = np.nonzero(p.argmax(-1) != x.argmax(-1))[0]
        worst = max((margin_sd(x[i], int(x[i].argmax()), int(p[i].argmax())) for i in bad), default=0.0)
        rec["forward"][name]["worst_disagreement_margin_sd"] = worst
        if worst > tol:
            failed.append(f"{name}: kernel top-1 differs from XLA's where XLA's margin is {worst:.3f} sd (> {tol:.3f})")

    def split(a_seq, b_seq, what):
        """First difference of two greedy sequences and XLA's margin there (a's token - b's)."""
        d = next((i for i, (u, v) in enumerate(zip(a_seq, b_seq)) if u != v), None)
        if d is None:
            return {"identical": True, "first_difference": None}
        m = margin_sd(next_token_logits(a_seq[:d + 1])[d], a_seq[d], b_seq[d])
        if abs(m) > tol:
            failed.append(f"{what}: first difference at token {d} where XLA's margin is {m:.3f} sd (> {tol:.3f})")
        return {"identical": False, "first_difference": d, "xla_margin_sd": m}

    for m in specs:
        row = {"tokens": len(tx[m]), "kernels_vs_xla": split(tx[m], tp[m], f"{m}: kernels vs XLA")}
        if m != "none":
            row["vs_plain_under_xla"] = split(tx["none"], tx[m], f"{m} vs plain, XLA")
            row["vs_plain_under_kernels"] = split(tp["none"], tp[m], f"{m} vs plain, kernels")
        rec["greedy"][m] = row
    rec["failures"] = failed
    print(f"\n== kernel parity: {a.layers} layers, {a.dtype}, kernels {','.join(kernels)} ==")
    for name, r in rec["forward"].items():
        print(f"{name:10s} logits rel. error {r['rel_error']:.2e} (median position {r['median_position_rel_error']:.2e}), "
              f"top-1 agreement {r['top1_agreement']:.3f} ({r['positions']} positions; worst XLA margin where "
              f"they differ {r['worst_disagreement_margin_sd']:.3f} sd)")
    r = rec["xla_self"]
    print(f"XLA alone: median top-2 margin {r['median_top2_margin_sd']:.3f} logit sd; greedy vs one-forward argmax "
          f"differ at {r['greedy_vs_sequence_argmax_differences']} of {len(tx['none'])} tokens (max margin "
          f"{r['max_margin_sd_of_those']:.3f} sd) -> tie tolerance {tol:.3f} sd")

    def fmt(s):
        return "identical" if s["identical"] else f"split at {s['first_difference']} (XLA margin {s['xla_margin_sd']:.3f} sd)"
    for m, r in rec["greedy"].items():
        extra = "" if m == "none" else (f"; vs plain: XLA {fmt(r['vs_plain_under_xla'])}, "
                                        f"kernels {fmt(r['vs_plain_under_kernels'])}")
        print(f"greedy {m:7s} {r['tokens']} tokens: kernels vs XLA {fmt(r['kernels_vs_xla'])}{extra}")
    rec["result_path"] = str(save_result("kernel_parity", rec, a.out))
    if failed:
        print("FAILED: " + "; ".join(failed), file=sys.stderr)
        raise SystemExit(1)
    return rec


if __name__ == "__main__":
    main()
