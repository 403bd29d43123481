"""Evaluate the embedded model on the held-out stdlib files.

    python -m lingjax.embedded.evaluate [--dir DIR] [--out results.json]

Reports:
  * bits per byte of the target on held-out files (each file cut into windows of --seq bytes, each
    scored from its own start; at most --windows-per-file windows per file, evenly spaced, so no
    single file dominates; only byte targets count, not the <|endoftext|> separators), next to a
    byte-unigram model fit on the training split;
  * mean accept length of greedy speculative decoding, DSpark (block 8) and MTP (3 steps):
    (accepted drafts + steps) / steps = tokens committed per target verify pass, pooled over
    --prompts held-out prompts of --prompt-len bytes, --max-new new tokens each, no stop ids.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lingjax.cache import init_cache
from lingjax.embedded.config import EOT_ID
from lingjax.embedded.data import load_corpus, unigram_bits_per_byte
from lingjax.embedded.dense_moe import dense_moe_experts
from lingjax.embedded.load import load_embedded

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def heldout_windows(docs, seq: int, per_file: int) -> tuple[np.ndarray, np.ndarray]:
    """Each doc (plus its EOT) cut into consecutive windows of seq+1 tokens (overlapping by one);
    at most `per_file` of them, evenly spaced over the file. Returns [N, seq+1] EOT-padded
    windows and [N, seq] masks of the targets that count (bytes inside the doc)."""
    rows, masks = [], []
    for doc in docs:
        ext = np.concatenate([doc, [EOT_ID]]).astype(np.int32)
        n = max(1, -(-(ext.size - 1) // seq))
        for w in sorted(set(np.linspace(0, n - 1, min(n, per_file)).round().astype(int).tolist())):
            chunk = ext[w * seq:w * seq + seq + 1]
            valid = np.zeros(seq, bool)
            valid[:chunk.size - 1] = chunk[1:] < 256
            rows.append(np.pad(chunk, (0, seq + 1 - chunk.size), constant_values=EOT_ID))
            masks.append(valid)
    return np.stack(rows), np.stack(masks)


def bits_per_byte(target, windows: np.ndarray, masks: np.ndarray, batch: int) -> float:
    graphdef, params = nnx.split(target)

    @jax.jit
    def nll(params, tokens, mask):
        model = nnx.merge(graphdef, params)
        x, y = tokens[:, :-1], tokens[:, 1:]
        with dense_moe_experts():
            out = model(x, init_cache(model.cfg, x.shape[0], x.shape[1], model.dtype, with_mtp=False), logits="all")
        logp = jax.nn.log_softmax(out.logits.astype(jnp.float32), axis=-1)
        tok = jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0]
        return -(tok * mask).sum()

    total = 0.0
    n = windows.shape[0]
    pad = (-n) % batch
    windows = np.concatenate([windows, np.full((pad, windows.shape[1]), EOT_ID, np.int32)])
    masks = np.concatenate([masks, np.zeros((pad, masks.shape[1]), bool)])
    for i in range(0, windows.shape[0], batch):
        total += float(nll(params, jnp.asarray(windows[i:i + batch]), jnp.asarray(masks[i:i + batch])))
    count = int(masks.sum())
    return total / max(count, 1) / math.log(2)


def heldout_prompts(docs, n: int, prompt_len: int, max_new: int) -> list[np.ndarray]:
    """Up to n prompts, one per long-enough held-out file (in sorted order), from the file's middle."""
    out = []
    for doc in docs:
        room = doc.size - prompt_len - max_new
        if room >= 0:
            s = room // 2
            out.append(doc[s:s + prompt_len].astype(np.int32))
        if len(out) == n:
            break
    return out


def accept_length(target, draft, prompts, max_new: int, method: str, block: int) -> dict:
    from lingjax.sampling import SamplingArrays, SamplingParams
    from lingjax.spec_decode import Decoder, SpecConfig

    dec = Decoder(target, SpecConfig(method, block), draft=draft if method == "dspark" else None, stop_ids=())
    samp = SamplingArrays.from_params(SamplingParams())
    steps = accepted = 0
    outputs = []
    t0 = time.perf_counter()
    for p in prompts:
        st = dec.prefill(dec.params, jnp.asarray(p)[None], max_new, jnp.int32(max_new), jax.random.key(0), samp,
                         jnp.ones(len(dec.spec.widths), jnp.float32))
        st = dec.run(dec.params, st, samp, None, max_steps=10_000)
        steps += int(st.steps)
        accepted += int(st.accepted)
        outputs.append(np.asarray(st.out[:int(st.n_out)]))
    return {"method": method, "block": block, "prompts": len(prompts), "steps": steps, "accepted": accepted,
            "accept_length": (accepted + steps) / max(steps, 1), "seconds": round(time.perf_counter() - t0, 2),
            "outputs": outputs}


def evaluate(directory=None, *, dtype=jnp.bfloat16, seq: int = 512, windows_per_file: int = 8, batch: int = 16,
             prompts: int = 16, prompt_len: int = 256, max_new: int = 128, max_files: int | None = None,
             mtp_steps: int = 3) -> dict:
    target, draft, tok = load_embedded(dtype, directory)
    corpus = load_corpus(max_files=max_files)
    windows, masks = heldout_windows(corpus.heldout_docs, seq, windows_per_file)
    res: dict = {"dir": str(directory) if directory is not None else "default", "dtype": jnp.dtype(dtype).name,
                 "heldout_files": len(corpus.heldout_files), "heldout_bytes_scored": int(masks.sum())}
    t0 = time.perf_counter()
    res["bits_per_byte"] = bits_per_byte(target, windows, masks, batch)
    res["unigram_bits_per_byte"] = unigram_bits_per_byte(corpus.train, np.concatenate(corpus.heldout_docs))
    res["bpb_seconds"] = round(time.perf_counter() - t0, 2)
    ps = heldout_prompts(corpus.heldout_docs, prompts, prompt_len, max_new)
    ds = accept_length(target, draft, ps, max_new, "dspark", draft.cfg.block_size)
    mt = accept_length(target, None, ps, max_new, "mtp", mtp_steps)
    same = [bool(np.array_equal(a, b)) for a, b in zip(ds["outputs"], mt["outputs"])]
    sample = tok.decode(list(ps[0]) + list(ds["outputs"][0])) if ps else ""
    for r in (ds, mt):
        r.pop("outputs")
    res.update(dspark=ds, mtp=mt, outputs_identical=float(np.mean(same)) if same else None,
               sample_prompt=tok.decode(list(ps[0])) if ps else "", sample=sample)
    return res


def print_table(res: dict) -> None:
    rows = [("held-out bits/byte (target)", f"{res['bits_per_byte']:.4f}"),
            ("held-out bits/byte (byte unigram)", f"{res['unigram_bits_per_byte']:.4f}"),
            (f"DSpark accept length (block {res['dspark']['block']})", f"{res['dspark']['accept_length']:.3f}"),
            (f"MTP accept length ({res['mtp']['block']} steps)", f"{res['mtp']['accept_length']:.3f}"),
            ("DSpark / MTP outputs identical", f"{res['outputs_identical']}")]
    w = max(len(r[0]) for r in rows)
    print(f"{'metric':<{w}}  value")
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    print(f"\nsample (held-out prompt, then greedy continuation):\n{res['sample']}\n")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m lingjax.embedded.evaluate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="weights directory (default: lingjax/embedded/weights)")
    ap.add_argument("--out", help="write the results JSON here")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--windows-per-file", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--max-files", type=int, help="use only the first N files of each split")
    args = ap.parse_args(argv)
    res = evaluate(args.dir, dtype=DTYPES[args.dtype], seq=args.seq, windows_per_file=args.windows_per_file,
                   batch=args.batch, prompts=args.prompts, prompt_len=args.prompt_len, max_new=args.max_new,
                   max_files=args.max_files)
    print_table(res)
    line = {k: v for k, v in res.items() if k not in ("sample", "sample_prompt")}
    print(json.dumps(line))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
