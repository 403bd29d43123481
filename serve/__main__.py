"""`python -m serve [--checkpoint DIR] [--draft DIR] [--host 127.0.0.1] [--port 8000] ...`"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import sys
from pathlib import Path

from lingjax import xla_env
from lingjax.kernel_flags import add_draft_dtype_arg, add_kernel_args


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m serve",
        description="OpenAI-compatible HTTP server for Ling-3.0 + DSpark (lingjax). One engine worker thread "
                    "owns the device and runs requests one at a time (batch 1); the others wait in a bounded "
                    "queue. With no --checkpoint, the embedded default model is served.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--checkpoint", help="Hugging Face checkpoint dir or a converted one (default: the embedded model)")
    ap.add_argument("--draft", help="DSpark draft checkpoint dir (HF or converted)")
    ap.add_argument("--spec", choices=["dspark", "mtp", "none"], default=None,
                    help="drafter; default: dspark when a draft is available, else none")
    ap.add_argument("--block-size", type=int, default=None, help="drafts per speculative step")
    ap.add_argument("--verify-policy", choices=["fixed", "adaptive", "confidence"], default="fixed")
    ap.add_argument("--dtype", choices=["bfloat16", "float32", "float64"], default="bfloat16")
    ap.add_argument("--chunk-steps", type=int, default=16,
                    help="speculative steps per device chunk (streaming and cancellation granularity)")
    ap.add_argument("--mesh", default=None, help="split over devices: 'tp=N[,ep=M]' (default: one device)")
    add_kernel_args(ap)
    add_draft_dtype_arg(ap)
    ap.add_argument("--approx", default=None, metavar="MODES",
                    help="approximate speed modes, off by default (lingjax/approx.py): comma list of "
                         "expert_keep=X, bf16_router_head, bf16_kda_state, fp8_mla_cache")
    ap.add_argument("--max-context", type=int, default=None,
                    help="context length in tokens (default: the model's max_position_embeddings)")
    ap.add_argument("--tokenizer", metavar="DIR", help="load tokenizer.json (+ chat template) from DIR instead")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-queue", type=int, default=8,
                    help="requests that may wait behind the running one; more get 503 with Retry-After")
    ap.add_argument("--api-key", default=os.environ.get("LINGJAX_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on /v1/* (default: $LINGJAX_API_KEY)")
    ap.add_argument("--served-model-name", default=None,
                    help="model id in /v1/models and requests (default: the checkpoint dir name)")
    ap.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="on SIGTERM/SIGINT, seconds the running request may take to finish before it is aborted")
    ap.add_argument("--no-warmup", action="store_true", help="skip the warm-up generation before /health is 200")
    ap.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    # testing / dry-run engines (not in --help)
    ap.add_argument("--tokenizer-byte-level", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fake-engine", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fake-chunk-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    return ap


def engine_factory(args):
    if args.fake_engine:
        from serve.testing import ScriptedEngine
        return lambda: ScriptedEngine(max_context=args.max_context or 512, chunk_steps=args.chunk_steps,
                                      chunk_delay_s=args.fake_chunk_delay)

    def load():
        import jax
        if args.dtype == "float64":
            jax.config.update("jax_enable_x64", True)
        if args.dtype != "bfloat16":  # float32 means float32: no TF32 matmuls on GPU
            jax.config.update("jax_default_matmul_precision", "highest")
        from lingjax.engine import Engine
        from lingjax.loader import load_engine
        engine = load_engine(args.checkpoint, args.draft, dtype=args.dtype, spec=args.spec,
                             block_size=args.block_size, verify_policy=args.verify_policy,
                             chunk_steps=args.chunk_steps, max_context=args.max_context, mesh=args.mesh,
                             kda_kernel=args.kda_kernel, moe_kernel=args.moe_kernel,
                             dense_kernel=args.dense_kernel, mla_kernel=args.mla_kernel, approx=args.approx,
                             draft_dtype=args.draft_dtype)
        tok = None
        if args.tokenizer_byte_level:
            from serve.testing import byte_level_tokenizer
            tok = byte_level_tokenizer()
        elif args.tokenizer:
            from lingjax.tokenizer import load_tokenizer
            tok = load_tokenizer(args.tokenizer)
        if tok is not None:
            engine = Engine(engine.target, tok, engine.draft, spec=engine.spec, chunk_steps=args.chunk_steps,
                            max_context=args.max_context)
        if engine.tokenizer is None:
            logging.getLogger("serve").warning("the checkpoint has no tokenizer.json: only token-id prompts on "
                                               "/v1/completions will work (pass --tokenizer DIR)")
        return engine
    return load


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.max_queue < 1:
        ap.error(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.chunk_steps < 1:
        ap.error(f"--chunk-steps must be >= 1, got {args.chunk_steps}")
    if args.max_context is not None and args.max_context < 4:
        ap.error(f"--max-context must be >= 4, got {args.max_context}")
    if args.approx is not None:
        from lingjax.approx import ApproxModes
        try:
            ApproxModes.parse(args.approx)
        except ValueError as e:
            ap.error(f"--approx: {e}")
    if not args.fake_engine:
        for flag, path in (("--checkpoint", args.checkpoint), ("--draft", args.draft), ("--tokenizer", args.tokenizer)):
            if path is not None and not Path(path).is_dir():
                ap.error(f"{flag} {path}: no such directory")
        if args.checkpoint is None and importlib.util.find_spec("lingjax.embedded") is None:
            ap.error("the embedded default model is not part of this build: pass --checkpoint DIR")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    xla_env.configure()

    import uvicorn

    from serve.app import create_app
    from serve.worker import EngineWorker

    name = args.served_model_name or (
        "lingjax-fake" if args.fake_engine else Path(args.checkpoint).resolve().name if args.checkpoint
        else "lingjax-default")
    exit_code = {"code": 0}
    server: uvicorn.Server | None = None

    def on_fatal(exc: BaseException):
        exit_code["code"] = 1
        if server is not None:
            server.should_exit = True

    worker = EngineWorker(engine_factory(args), max_queue=args.max_queue, warmup=not args.no_warmup,
                          on_fatal=on_fatal)
    app = create_app(worker, model_name=name, api_key=args.api_key, shutdown_grace_s=args.shutdown_timeout)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.serve.begin_shutdown()   # /health -> 503, queued -> 503, running: grace period
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="on",
                            timeout_graceful_shutdown=args.shutdown_timeout + 5)
    server = Server(config)
    # uvicorn re-raises the captured signal after a graceful shutdown; make that a clean exit
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: None)
    logging.getLogger("serve").info(
        "serving %r on http://%s:%d (batch 1, queue %d%s)", name, args.host, args.port, args.max_queue,
        ", API key required" if args.api_key else "")
    server.run()
    return exit_code["code"]


if __name__ == "__main__":
    sys.exit(main())
