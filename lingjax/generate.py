"""`python -m lingjax.generate [PROMPT]`: generate text (streamed) with Ling-3.0 + DSpark.

With no flags it runs the embedded default model (a small Ling-3.0-architecture model trained on
Python's standard library source, with its DSpark draft) on CPU or GPU.
"""
from __future__ import annotations

import argparse
import json
import sys

from lingjax import xla_env
from lingjax.kernel_flags import add_draft_dtype_arg, add_kernel_args

DEFAULT_PROMPT = "import os\n\n\ndef read_config(path):\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m lingjax.generate",
        description="Generate text with Ling-3.0 (KDA + gated MLA + MoE) and speculative decoding. "
                    "With no --checkpoint, the embedded default model is used.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("prompt", nargs="?", default=None, help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    ap.add_argument("--checkpoint", help="Hugging Face checkpoint dir or a converted one (checkpoints_convert)")
    ap.add_argument("--draft", help="DSpark draft checkpoint dir (HF or converted)")
    ap.add_argument("--spec", choices=["dspark", "mtp", "none"], default=None,
                    help="drafter: dspark (needs a draft), mtp (the target's own NEXTN layer), none; "
                         "default: dspark when a draft is available, else none")
    ap.add_argument("--block-size", type=int, default=None,
                    help="drafts per step (DSpark block, at most the draft's; MTP steps, default 3)")
    ap.add_argument("--verify-policy", choices=["fixed", "adaptive", "confidence"], default="fixed",
                    help="how many drafts to verify per step")
    ap.add_argument("--prompt-ids", help="comma-separated token ids instead of text, e.g. 3,5,7")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    ap.add_argument("--thinking", choices=["on", "off"], default="on", help="chat template thinking mode")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens at most")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0, help="0 = off")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32", "float64"], default="bfloat16")
    ap.add_argument("--chunk-steps", type=int, default=16, help="speculative steps per device chunk")
    ap.add_argument("--mesh", default=None, help="split over devices: 'tp=N[,ep=M]' (default: one device)")
    add_kernel_args(ap)
    add_draft_dtype_arg(ap)
    ap.add_argument("--approx", default=None, metavar="MODES",
                    help="approximate speed modes (off by default; quality cost in bench/approx_quality.py): "
                         "comma list of expert_keep=X, bf16_router_head, bf16_kda_state, fp8_mla_cache")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    ap.add_argument("--logits-out", metavar="FILE.npy", help="save float32 logits of every prompt position [T, V]")
    ap.add_argument("--quiet", action="store_true", help="no progress messages on stderr")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.prompt is not None and args.prompt_ids is not None:
        ap.error("give either PROMPT or --prompt-ids, not both")
    if args.max_tokens < 1:
        ap.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.block_size is not None and args.block_size < 1:
        ap.error(f"--block-size must be >= 1, got {args.block_size}")
    prompt_ids = None
    if args.prompt_ids is not None:
        try:
            prompt_ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            ap.error(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}")
    xla_env.configure()
    import jax
    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    if args.dtype != "bfloat16":  # float32 means float32: no TF32 matmuls on GPU
        jax.config.update("jax_default_matmul_precision", "highest")
    from lingjax.engine import RequestError
    from lingjax.loader import LoadError, load_engine
    from lingjax.sampling import SamplingParams
    try:
        sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
        engine = load_engine(args.checkpoint, args.draft, dtype=args.dtype, spec=args.spec,
                             block_size=args.block_size, verify_policy=args.verify_policy,
                             chunk_steps=args.chunk_steps, quiet=args.quiet or args.json, mesh=args.mesh,
                             kda_kernel=args.kda_kernel, moe_kernel=args.moe_kernel,
                             dense_kernel=args.dense_kernel, mla_kernel=args.mla_kernel, approx=args.approx,
                             draft_dtype=args.draft_dtype)
        if prompt_ids is not None:
            prompt = prompt_ids
        else:
            text = DEFAULT_PROMPT if args.prompt is None else args.prompt
            if args.chat:
                if engine.tokenizer is None:
                    raise RequestError("--chat needs a tokenizer (tokenizer.json in the checkpoint)")
                text = engine.tokenizer.render_chat([{"role": "user", "content": text}],
                                                    thinking=args.thinking == "on")
            prompt = text
        if args.logits_out:
            import numpy as np
            np.save(args.logits_out, engine.prompt_logits(prompt))
        if args.json:
            r = engine.generate(prompt, sampling=sampling, max_tokens=args.max_tokens, stop=args.stop)
            print(json.dumps({"token_ids": r.token_ids, "text": r.text, "finish_reason": r.finish_reason,
                              "stats": vars(r.stats)}))
            return 0
        if isinstance(prompt, str):
            sys.stdout.write(prompt)
        for chunk in engine.stream(prompt, sampling=sampling, max_tokens=args.max_tokens, stop=args.stop):
            sys.stdout.write(chunk.text if engine.tokenizer else " ".join(map(str, chunk.token_ids)) + " ")
            sys.stdout.flush()
            if chunk.result is not None:
                st = chunk.result.stats
                print(f"\n[{st.completion_tokens} tokens, finish={chunk.result.finish_reason}, ttft {st.ttft_s:.2f}s, "
                      f"{st.tokens_per_s:.1f} tok/s, accept length {st.accept_length:.2f}]", file=sys.stderr)
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (RequestError, LoadError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
