"""One whole Ling-3.0-flash gated-MLA layer (projections, cache write, absorbed attention over the
latent cache, gate, output projection) per call at a given context, and where its time goes.

    python -m bench.mla_layer_timing --M 1,9 --context 8192                     # on the H200
    python -m bench.mla_layer_timing --M 1,9 --context 8192 --profile /tmp/mla  # + a kernel-by-kernel table
    python -m bench.mla_layer_timing --M 1,9 --mla-kernel xla,pallas            # A/B of the attention kernel
    python -m bench.mla_layer_timing --M 1,9 --mla-kernel pallas --mla-warpgroups 1,2   # ... of its two forms
    python -m bench.mla_layer_timing --tiny --M 1 --iters 1 --layers 1 --dense-kernel xla --context 64
                                                                                 # any host (smoke run)

Builds `lingjax.model.mla.GatedMLA` layers with random weights (fp8 128 x 128 blocks by default, as
the full-depth benchmark runs them), sets --dense-kernel on their projections and each
--mla-kernel in turn on their absorbed attention (one row per kernel and M), gives each an
`MLAState` cache of --cache-len positions (sized as bench.batch1's Decoder sizes it) whose first
--context positions hold random latent / k_rope values, and times `layer(x, cache, pos)` for
x [1, M, D] at pos = --context inside one jitted loop (bench.common.time_in_loop over --layers
weight copies, the loop's own per-call cost subtracted). Each call's cache is carried through
the loop (`carry_last`; a cache from the loop-invariant arguments would be copied whole before
every write). Even so, on the H200 (session 17, run 67) XLA wrote the block into the cache through
a whole-cache pad fusion here, ~7 us per call, where the decode loop's profile shows ~1.5 us: a
layer's time in this benchmark is ~6 us above its time in the model.

Each row also records the bytes the layer must read -- every MLA weight (fp8 values and block
scales, or bf16) plus the cache's latent and k_rope for the positions the block attends to
(--context + M) -- and the fraction of --copy-bw that is per call. XLA's attention reads the whole
--cache-len cache (masked), recorded as cache_alloc_bytes. With --profile DIR it traces that loop
once more and prints, per XLA kernel of one layer call, the µs per call, the count per call, and
what the kernel computes (bench.kernel_table).
"""
from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from bench.common import COPY_BW_H200, add_layer_loop_args, choice_list, int_list
from bench.kernel_table import print_table, time_layer
from lingjax import xla_env

# bench.batch1's Decoder: cache of (prompt padded to whole prefill chunks) + max_new + drafts + 2 positions
PREFILL_CHUNK = 2048      # lingjax.spec_decode.Decoder.prefill_chunk
OUTPUT_LEN = 1024         # bench.batch1 --output-len
DRAFTS = 8                # bench.batch1 --block-size (speculative rows)
CACHE_ALIGN = 64          # lingjax.spec_decode.CACHE_ALIGN (not imported: that imports jax before xla_env)


def decoder_cache_len(context: int, output_len: int = OUTPUT_LEN, drafts: int = DRAFTS,
                      chunk: int = PREFILL_CHUNK) -> int:
    """The MLA cache length `lingjax.spec_decode.Decoder` allocates for a prompt of `context`
    tokens: chunks * chunk + max_new + drafts + 2, rounded up to a multiple of CACHE_ALIGN (9280
    at context 8192 with batch1's defaults)."""
    c = min(context, chunk)
    n = c * -(-context // c) + output_len + drafts + 2
    return -(-n // CACHE_ALIGN) * CACHE_ALIGN


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.mla_layer_timing", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--M", default="1,9",
                    help="comma list of token counts (1..16; default 1,9: decode, a verify of 8 drafts)")
    ap.add_argument("--context", type=int, default=8192,
                    help="cached positions before the block; the block sits at positions context..context+M-1 "
                         "(default 8192)")
    ap.add_argument("--cache-len", type=int, default=None,
                    help="positions of the allocated cache (default: as the Decoder sizes it for bench.batch1, "
                         f"context rounded up to {PREFILL_CHUNK}-token prefill chunks + {OUTPUT_LEN} output + "
                         f"{DRAFTS} drafts + 2, in multiples of {CACHE_ALIGN}: 9280 at context 8192)")
    ap.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8", help="MLA weights (default fp8)")
    ap.add_argument("--dense-kernel", choices=["pallas", "xla"], default="pallas",
                    help="the q / kv_a / output projections' kernel (default pallas)")
    ap.add_argument("--mla-kernel", default="xla",
                    help="comma list of the absorbed attention's kernels, one row each: xla, pallas (the "
                         "flash-decoding kernel over the latent cache; bf16 cache) (default xla)")
    ap.add_argument("--mla-warpgroups", default=None,
                    help="comma list of the Pallas kernel's forms, one row each: 1 (a program per column block), "
                         "2 (both column blocks per program) (default: pallas_kernels.mla_decode.WARPGROUPS)")
    ap.add_argument("--layers", type=int, default=4,
                    help="weight copies (each with its own cache) cycled through, as a model's layers are "
                         "(default 4: a fp8 copy is 32 MB, so 4 keep each weight's reuse distance past the 60 MB L2)")
    ap.add_argument("--copy-bw", type=float, default=COPY_BW_H200,
                    help=f"bytes/s the bytes-per-call fraction is taken of (default {COPY_BW_H200:.3g}: "
                         "the H200's copy bandwidth, bench.common.COPY_BW_H200)")
    add_layer_loop_args(ap, "trace one more loop per row into DIR/<kernel>[-<N>wg]-M<M> and print its kernels")
    return ap


def main(argv=None) -> dict:
    ap = build_parser()
    a = ap.parse_args(argv)
    ms = int_list(ap, a.M, "--M")
    attn_kernels = choice_list(ap, a.mla_kernel, "--mla-kernel", ("xla", "pallas"))
    forms = [int(w) for w in choice_list(ap, a.mla_warpgroups, "--mla-warpgroups", ("1", "2"))] \
        if a.mla_warpgroups is not None else [None]
    if not forms:
        ap.error("--mla-warpgroups needs at least one form")
    if not ms or min(ms) < 1 or max(ms) > 16 or a.iters < 1 or a.layers < 1 or not attn_kernels:
        ap.error("--M needs token counts in 1..16, --iters and --layers >= 1, --mla-kernel at least one kernel")
    if a.context < 1:
        ap.error(f"--context must be >= 1, got {a.context}")
    cache_len = decoder_cache_len(a.context) if a.cache_len is None else a.cache_len
    if a.context + max(ms) > cache_len:
        ap.error(f"--context {a.context} + M {max(ms)} does not fit --cache-len {cache_len} (the block is written "
                 f"at positions context..context+M-1)")
    if "pallas" in attn_kernels and cache_len % 8:
        ap.error(f"--mla-kernel pallas needs a --cache-len that is a multiple of 8 (its TMA tiles), got {cache_len}")
    if a.copy_bw <= 0:
        ap.error(f"--copy-bw must be > 0, got {a.copy_bw}")
    if not a.no_xla_defaults:
        xla_env.configure()
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from bench.common import save_result
    from lingjax.cache import MLAState
    from lingjax.config import preset
    from lingjax.model import dense, kernels as kernel_ctx
    from lingjax.model.mla import GatedMLA, check_mla_kernel
    from pallas_kernels import mla_decode
    from lingjax.quant import quantize_model

    on_gpu = jax.default_backend() == "gpu"
    cfg = preset("ling3-tiny" if a.tiny else "ling3-flash")
    lat, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    act = jnp.bfloat16

    @nnx.jit                                          # one compile for every copy, not one per eager op
    def make(key):
        m = GatedMLA(cfg, dtype=act, rngs=nnx.Rngs(key))
        return quantize_model(m) if a.dtype == "fp8" else m

    def build(i):
        return dense.set_dense_kernel(make(jax.random.key(a.seed + i)), a.dense_kernel)

    @jax.jit
    def fill_cache(key):
        k1, k2 = jax.random.split(key)
        filled = (jnp.arange(cache_len) < a.context)[None, :, None]          # zeros past the context, as decoded
        return MLAState(jnp.where(filled, jax.random.normal(k1, (1, cache_len, lat), jnp.float32), 0).astype(act),
                        jnp.where(filled, jax.random.normal(k2, (1, cache_len, rope), jnp.float32), 0).astype(act))

    graphdef, states = None, []
    for i in range(a.layers):
        graphdef, st = nnx.split(build(i))
        states.append(st)
    caches = [fill_cache(jax.random.PRNGKey(2000 + a.seed + i)) for i in range(a.layers)]
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(states[0]))
    cache_alloc_bytes = sum(x.nbytes for x in jax.tree.leaves(caches[0]))
    pos = jnp.int32(a.context)                          # traced, as the decode loop's position

    def layer_fn(kernel):
        def f(x, pos, st, cache):
            m = nnx.merge(graphdef, st)
            m.mla_kernel = check_mla_kernel(kernel, act)
            return m(x, cache, pos)                     # (y, cache with the block written)
        return f

    uses_pallas = a.dense_kernel == "pallas" or "pallas" in attn_kernels
    ctx = kernel_ctx.pallas_interpret if not on_gpu and uses_pallas else contextlib.nullcontext

    def one_row(kernel, form, M) -> dict:
        """Time (and with --profile, trace) the layer on `kernel` (and Pallas `form`) at M tokens."""
        mla_decode.WARPGROUPS = default_form if form is None else form     # read when the layer is traced
        f = layer_fn(kernel)
        xs = [jax.random.normal(jax.random.PRNGKey(a.seed + 7 * M + i), (1, M, cfg.hidden_size),
                                jnp.float32).astype(act) for i in range(a.layers)]
        sets = [(x, pos, st, c) for x, st, c in zip(xs, states, caches)]
        used = mla_decode.warpgroups_for(lat, rope, cache_len) if kernel == "pallas" else None   # the form it ran
        label = kernel + (f"-{used}wg" if kernel == "pallas" else "")
        timed = time_layer(f, sets, a.iters, ctx=ctx, carry_last=True,
                           profile_dir=Path(a.profile) / f"{label}-M{M}" if a.profile else None)
        net = timed["layer_us"] * 1e-6
        cache_bytes = (a.context + M) * (lat + rope) * jnp.dtype(act).itemsize
        nbytes = weight_bytes + cache_bytes
        row = {"mla_kernel": kernel, "warpgroups": used, "M": M, **timed, "bytes": nbytes, "cache_bytes": cache_bytes}
        if net > 0:
            row.update({"GBps": nbytes / net / 1e9, "pct_copy_bw": 100 * nbytes / net / a.copy_bw})
        print(f"{label:10s} M={M:2d}: {row['layer_us']:7.1f} us per MLA layer call at context {a.context} "
              f"({nbytes / 1e6:.1f} MB: {row.get('pct_copy_bw', float('nan')):.0f}% of {a.copy_bw / 1e12:.2f} TB/s; "
              f"loop overhead {row['loop_overhead_us']:.1f} us subtracted)"
              + ("" if on_gpu else "  [not a GPU: smoke run, not a timing]"), flush=True)
        if a.profile:
            print_table(row["kernels"])
        return row

    default_form = mla_decode.WARPGROUPS
    variants = [(k, w) for k in attn_kernels for w in (forms if k == "pallas" else [None])]
    try:
        rows = [one_row(kernel, form, M) for M in ms for kernel, form in variants]
    finally:
        mla_decode.WARPGROUPS = default_form
    rec = {"bench": "mla_layer_timing", "dtype": a.dtype, "dense_kernel": a.dense_kernel,
           "mla_kernels": attn_kernels, "mla_warpgroups": forms, "layers": a.layers,
           "iters": a.iters, "context": a.context, "cache_len": cache_len,
           "preset": "ling3-tiny" if a.tiny else "ling3-flash", "weight_bytes": weight_bytes,
           "cache_alloc_bytes": cache_alloc_bytes, "copy_bw": a.copy_bw, "smoke": not on_gpu, "rows": rows}
    rec["result_path"] = str(save_result("mla_layer_timing", rec, a.out))
    return rec


if __name__ == "__main__":
    main()
