"""Streaming cost: tok/s of Engine.stream (device chunks read while the next runs) vs one-call
non-streaming Engine.generate, on the same request.

    python -m bench.stream_overhead [--max-tokens 512] [--chunk-steps 16] [--repeats 3]

Uses the embedded default model (bf16) unless --checkpoint/--draft are given.
"""
from __future__ import annotations

import argparse
import time

from lingjax import xla_env


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint")
    ap.add_argument("--draft")
    ap.add_argument("--spec", default=None)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--chunk-steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    xla_env.configure()
    from bench.common import save_result
    from lingjax.generate import DEFAULT_PROMPT
    from lingjax.loader import load_engine
    eng = load_engine(args.checkpoint, args.draft, spec=args.spec, chunk_steps=args.chunk_steps)
    prompt = DEFAULT_PROMPT

    def one(streaming: bool):
        t = time.perf_counter()
        if streaming:
            for c in eng.stream(prompt, max_tokens=args.max_tokens):
                res = c.result
        else:
            res = eng.generate(prompt, max_tokens=args.max_tokens)
        return res, time.perf_counter() - t

    rows = {}
    for mode in (False, True):
        one(mode)  # warm-up / compile
        times, res = [], None
        for _ in range(args.repeats):
            res, dt = one(mode)
            times.append(res.stats.tokens_per_s)
        rows["stream" if mode else "generate"] = {"tokens_per_s": sorted(times)[len(times) // 2],
                                                  "tokens": res.token_ids, "accept_length": res.stats.accept_length}
    same = rows["stream"]["tokens"] == rows["generate"]["tokens"]
    g, s = rows["generate"]["tokens_per_s"], rows["stream"]["tokens_per_s"]
    print(f"generate {g:.0f} tok/s | stream {s:.0f} tok/s | streaming cost {100 * (1 - s / g):.1f}% | "
          f"accept {rows['stream']['accept_length']:.2f} | same tokens: {same}")
    save_result("stream_overhead", {"bench": "stream_overhead", "spec": eng.spec.method, "max_tokens": args.max_tokens,
                                    "chunk_steps": args.chunk_steps, "generate_tok_s": g, "stream_tok_s": s,
                                    "streaming_cost_pct": 100 * (1 - s / g), "same_tokens": same,
                                    "accept_length": rows["stream"]["accept_length"]}, args.out)


if __name__ == "__main__":
    main()
