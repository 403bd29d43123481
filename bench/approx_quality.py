"""Quality cost of each approximate speed mode (lingjax/approx.py), on CPU or GPU.

    python -m bench.approx_quality [--modes "none;expert_keep=0.75;bf16_router_head;..."]
                                   [--windows N] [--seq S] [--prompts P] [--max-new M]

One row per mode set:
  golden rel err / top-1   tests/data/ling3-tiny (random weights, float32): logits of the golden
                           prompt, prefilled to half then extended --block tokens at a time (so the
                           cache modes are read back), against the published code's logits:
                           relative Frobenius error and argmax agreement. The 'none' row is the
                           exact path's floor.
  bits/byte                the embedded model (trained, --dtype) on held-out windows, scored the
                           same way (half prefilled, then --block tokens at a time: verify-sized
                           forwards reading the cache).
  DSpark accept length     greedy DSpark (the embedded draft, block 8) on held-out prompts.
Ends with one JSON record (bench/results/approx_quality-*.json).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

GOLDEN_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "ling3-tiny"
DEFAULT_MODES = "none;expert_keep=0.75;bf16_router_head;bf16_kda_state;fp8_mla_cache;" \
                "expert_keep=0.75,bf16_router_head,bf16_kda_state,fp8_mla_cache"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.approx_quality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=DEFAULT_MODES, help="';'-separated mode sets (each as for --approx)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32", help="embedded model dtype")
    ap.add_argument("--block", type=int, default=8, help="tokens per forward after the half prefill")
    ap.add_argument("--seq", type=int, default=256, help="held-out window length (tokens)")
    ap.add_argument("--windows", type=int, default=16, help="held-out windows scored (evenly over the files)")
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts for the DSpark accept length")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--max-files", type=int, default=None, help="only the first N files of each split")
    ap.add_argument("--no-golden", action="store_true", help="skip the golden-model columns")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    return ap


def blockwise_logits(model, tokens, block: int):
    """tokens [B, T] -> float32 logits [B, T, V]: prefill T//2, then forwards of `block` tokens,
    every one through the model's own (mode-dependent) cache."""
    import jax.numpy as jnp
    from flax import nnx
    graph, params = nnx.split(model)

    def fwd(t, c):
        return _jitted_forward()(graph, params, t, c)
    b, t = tokens.shape
    half = t // 2
    out = fwd(tokens[:, :half], model.init_cache(b, t, with_mtp=False))
    parts, cache = [out.logits], out.cache
    for i in range(half, t, block):
        out = fwd(tokens[:, i:i + block], cache)
        parts.append(out.logits)
        cache = out.cache
    return jnp.concatenate(parts, axis=1).astype(jnp.float32)


_FORWARD = []


def _jitted_forward():
    """One jitted forward (graph static: each mode set compiles once per shape)."""
    if not _FORWARD:
        import jax
        from flax import nnx

        def forward(graph, params, tokens, cache):
            return nnx.merge(graph, params)(tokens, cache, logits="all")
        _FORWARD.append(jax.jit(forward, static_argnums=0))
    return _FORWARD[0]


def golden_columns(modes, block: int) -> dict:
    import jax.numpy as jnp
    import numpy as np

    from lingjax.model.ling import set_approx
    from lingjax.weights import load_hf_model
    g = np.load(GOLDEN_DIR / "golden.npz")
    model = load_hf_model(GOLDEN_DIR, dtype=jnp.float32)
    set_approx(model, modes)
    got = np.asarray(blockwise_logits(model, jnp.asarray(g["long_ids"], jnp.int32), block)[0], np.float64)
    ref = np.asarray(g["long_logits"], np.float64)
    return {"golden_rel_err": float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
            "golden_top1": float((got.argmax(-1) == ref.argmax(-1)).mean())}


def bits_per_byte(model, windows, masks, block: int) -> float:
    import jax
    import jax.numpy as jnp
    import numpy as np
    total = 0.0
    for row, mask in zip(windows, masks):
        x = jnp.asarray(row[None, :-1])
        logp = jax.nn.log_softmax(blockwise_logits(model, x, block)[0], axis=-1)
        tok = np.asarray(jnp.take_along_axis(logp, jnp.asarray(row[1:, None]), axis=-1)[:, 0], np.float64)
        total -= float((tok * mask).sum())
    return total / max(int(masks.sum()), 1) / math.log(2)


def embedded_columns(modes, target, draft, windows, masks, prompts, a) -> dict:
    from lingjax.embedded.evaluate import accept_length
    from lingjax.model.ling import set_approx
    set_approx(target, modes)
    bpb = bits_per_byte(target, windows, masks, a.block)
    acc = accept_length(target, draft, prompts, a.max_new, "dspark", draft.cfg.block_size)
    return {"bits_per_byte": bpb, "dspark_accept_length": acc["accept_length"], "dspark_steps": acc["steps"]}


def main(argv=None) -> dict:
    ap = build_parser()
    a = ap.parse_args(argv)
    from lingjax.approx import ApproxModes
    try:
        mode_sets = [ApproxModes.parse(m) for m in a.modes.split(";")]
    except ValueError as e:
        ap.error(f"--modes: {e}")
    if a.block < 1 or a.seq < 2 or a.windows < 1 or a.prompts < 1 or a.max_new < 2 or a.prompt_len < 1:
        ap.error("--block >= 1, --seq >= 2, --windows >= 1, --prompts >= 1, --prompt-len >= 1, --max-new >= 2")
    from lingjax import xla_env
    xla_env.configure()
    import jax
    import jax.numpy as jnp
    import numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")

    from bench.common import save_result
    from lingjax.embedded.data import load_corpus
    from lingjax.embedded.evaluate import heldout_prompts, heldout_windows
    from lingjax.embedded.load import load_embedded
    from lingjax.model.ling import set_approx

    target, draft, _ = load_embedded({"bfloat16": jnp.bfloat16, "float32": jnp.float32}[a.dtype])
    corpus = load_corpus(max_files=a.max_files)
    windows, masks = heldout_windows(corpus.heldout_docs, a.seq, 1)
    pick = np.unique(np.linspace(0, len(windows) - 1, min(a.windows, len(windows))).round().astype(int))
    windows, masks = windows[pick], masks[pick]
    prompts = heldout_prompts(corpus.heldout_docs, a.prompts, a.prompt_len, a.max_new)
    if not prompts:
        ap.error(f"no held-out file is long enough for --prompt-len {a.prompt_len} + --max-new {a.max_new}")
    rows = []
    for modes in mode_sets:
        t0 = time.perf_counter()
        row = {"mode": modes.describe()}
        if not a.no_golden:
            row.update(golden_columns(modes, a.block))
        row.update(embedded_columns(modes, target, draft, windows, masks, prompts, a))
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(f"  {row}", file=sys.stderr, flush=True)
    set_approx(target, ApproxModes())
    print_table(rows)
    record = {"bench": "approx_quality", "embedded_dtype": a.dtype, "block": a.block, "seq": a.seq,
              "windows": int(len(windows)), "bytes_scored": int(masks.sum()), "prompts": len(prompts),
              "prompt_len": a.prompt_len, "max_new": a.max_new, "rows": rows}
    save_result("approx_quality", record, a.out)
    return record


def print_table(rows) -> None:
    cols = [("mode", "mode", "{}"), ("golden_rel_err", "golden rel err", "{:.2e}"),
            ("golden_top1", "golden top-1", "{:.3f}"), ("bits_per_byte", "bits/byte", "{:.4f}"),
            ("dspark_accept_length", "DSpark accept", "{:.3f}")]
    cols = [c for c in cols if c[0] in rows[0]]
    cells = [[c[1] for c in cols]] + [[fmt.format(r[k]) for k, _, fmt in cols] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cols))]
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
