"""Speculative-loop overhead on one GPU: steps/s of the on-device while loop vs a host-synced loop.

    python -m bench.spec_loop --layers 6 --spec dspark --pattern 4 --steps 64

A depth-reduced, full-width Ling-3.0-flash with random bf16 weights (and a random DSpark draft of
the published shape) decodes a random prompt. Acceptance is forced through the real draft / verify /
commit code with `DraftOverride` (oracle = the target's own greedy continuation), then:
  plain    : --spec none, K tokens in one on-device loop
  device   : speculative, K steps in one `run` call (one while_loop, no host reads)
  synced   : speculative, K calls of run(max_steps=1) with a host read of n_out after each
  verify   : the verify forward alone (jitted target on B+1 tokens), and the draft alone
so `device - verify - draft` is the share of a step outside the model's own work.
"""
from __future__ import annotations

import argparse
import time

from lingjax import xla_env


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--spec", choices=["dspark", "mtp"], default="dspark")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--pattern", type=int, default=4, help="accepted drafts per step (forced)")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    ap.add_argument("--no-xla-defaults", action="store_true", help="do not add the command-buffer XLA flags")
    ap.add_argument("--profile", metavar="DIR",
                    help="trace one more on-device run and print a per-component breakdown of a step "
                         "(bench/profile_breakdown.py); outside the model = accept + commit + other + idle")
    args = ap.parse_args(argv)
    if not args.no_xla_defaults:
        xla_env.configure()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from bench.common import block, save_result
    from lingjax.config import preset
    from lingjax.dspark_config import dspark_for_ling3_flash
    from lingjax.model.dspark import DSparkDraft
    from lingjax.model.ling import LingModel
    from lingjax.sampling import SamplingArrays, SamplingParams
    from lingjax.spec_decode import Decoder, DraftOverride, SpecConfig

    cfg = preset("ling3-flash").replace(num_hidden_layers=args.layers)
    dt = jnp.bfloat16
    t0 = time.perf_counter()
    target = nnx.jit(lambda: LingModel(cfg, dtype=dt, rngs=nnx.Rngs(0), with_mtp=args.spec == "mtp"))()
    draft = None
    if args.spec == "dspark":
        dcfg = dspark_for_ling3_flash().replace(target_layer_ids=tuple(range(min(5, args.layers))),
                                               num_target_layers=args.layers)
        draft = nnx.jit(lambda: DSparkDraft(dcfg, dtype=dt, rngs=nnx.Rngs(1)))()
    block(nnx.state(target))
    print(f"init {time.perf_counter() - t0:.1f}s", flush=True)
    samp = SamplingArrays.from_params(SamplingParams())
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, args.prompt_len)), jnp.int32)
    n_tok = args.steps * (args.block_size + 1) + 8
    key = jax.random.key(0)

    def prefill(dec, max_new):
        return dec.prefill(dec.params, prompt, max_new, jnp.int32(max_new), key, samp,
                           jnp.ones((len(dec.spec.widths),), jnp.float32))

    # plain greedy: the oracle and the no-speculation baseline
    plain = Decoder(target, SpecConfig("none"))
    st = block(prefill(plain, n_tok))
    block(plain.run(plain.params, st, samp, None, max_steps=4))                 # compile
    t = time.perf_counter()
    st2 = block(plain.run(plain.params, st, samp, None, max_steps=n_tok - 1))
    plain_s = (time.perf_counter() - t) / (n_tok - 1)
    oracle = jnp.concatenate([prompt[0], st2.out[:int(st2.n_out)], jnp.zeros((64,), jnp.int32)])
    override = DraftOverride(oracle, jnp.asarray([args.pattern], jnp.int32), jnp.asarray(True))

    spec = SpecConfig(args.spec, args.block_size)
    dec = Decoder(target, spec, draft=draft)
    st = block(prefill(dec, n_tok))
    block(dec.run(dec.params, st, samp, override, max_steps=2))               # compile
    t = time.perf_counter()
    sd = block(dec.run(dec.params, st, samp, override, max_steps=args.steps))
    device_s = (time.perf_counter() - t) / int(sd.steps)
    profile = None
    if args.profile:
        from pathlib import Path
        from bench import profile_breakdown as pb
        hlo = pb.dump_hlo(dec.run.lower(dec.params, st, samp, override, max_steps=args.steps).compile(),
                          Path(args.profile) / "run.hlo.txt")
        with jax.profiler.trace(args.profile):
            with jax.profiler.TraceAnnotation("spec_loop_device"):
                sp = block(dec.run(dec.params, st, samp, override, max_steps=args.steps))
        profile = pb.breakdown(args.profile, [hlo.read_text()], steps=int(sp.steps), window_event="spec_loop_device")
        print(pb.format_table(profile))
    t = time.perf_counter()
    s = st
    for _ in range(args.steps):
        s = dec.run(dec.params, s, samp, override, max_steps=1)
        int(s.n_out)                                                          # host sync every step
    synced_s = (time.perf_counter() - t) / args.steps
    same = bool((np.asarray(sd.out[:int(sd.n_out)]) == np.asarray(oracle[args.prompt_len:args.prompt_len + int(sd.n_out)])).all())

    # the model's own work per step: verify forward (+ draft forward)
    w = args.block_size + 1
    graph, params = nnx.split(target)
    vtoks = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, w)), jnp.int32)

    @jax.jit
    def verify(params, cache):
        m = nnx.merge(graph, params)
        out = m(vtoks, cache, logits="all", tap_layers=dec.tap_layers, pending=True)
        return out.logits, out.cache
    block(verify(params, st.cache))
    t = time.perf_counter()
    for _ in range(20):
        r = verify(params, st.cache)
    block(r)
    verify_s = (time.perf_counter() - t) / 20
    draft_s = 0.0
    if draft is not None:
        dgraph, dparams = nnx.split((target, draft))

        @jax.jit
        def run_draft(p, dcache):
            tgt, d = nnx.merge(dgraph, p)
            ids = jnp.concatenate([vtoks[:, :1], jnp.full((1, args.block_size - 1), d.cfg.mask_token_id, jnp.int32)], 1)
            h = d.forward_block(dcache, tgt.embed_tokens(ids), jnp.int32(args.prompt_len))
            return d.propose_greedy(h, vtoks[:, 0], tgt.lm_head[...].T).tokens
        block(run_draft(dparams, st.draft_cache))
        t = time.perf_counter()
        for _ in range(20):
            r = run_draft(dparams, st.draft_cache)
        block(r)
        draft_s = (time.perf_counter() - t) / 20
    acc = (int(sd.accepted) + int(sd.steps)) / int(sd.steps)
    rec = {"bench": "spec_loop", "layers": args.layers, "spec": args.spec, "block_size": args.block_size,
           "forced_accept": args.pattern, "accept_length": acc, "steps": int(sd.steps),
           "plain_ms_per_token": plain_s * 1e3, "device_ms_per_step": device_s * 1e3,
           "synced_ms_per_step": synced_s * 1e3, "verify_ms": verify_s * 1e3, "draft_ms": draft_s * 1e3,
           "outside_model_ms_per_step": (device_s - verify_s - draft_s) * 1e3,
           "spec_tok_per_s": acc / device_s, "plain_tok_per_s": 1 / plain_s, "output_matches_plain": same,
           "profile": profile.as_dict() if profile else None}
    print(f"plain {plain_s*1e3:.2f} ms/token | spec on-device {device_s*1e3:.2f} ms/step, host-synced "
          f"{synced_s*1e3:.2f} ms/step | verify {verify_s*1e3:.2f} ms, draft {draft_s*1e3:.2f} ms | "
          f"accept {acc:.2f} -> {acc/device_s:.0f} tok/s vs plain {1/plain_s:.0f} tok/s | same tokens: {same}")
    save_result("spec_loop", rec, args.out)


if __name__ == "__main__":
    main()
