"""What the Pallas kernels put into a program: kernel launches, distinct kernels, module text.

    python -m bench.kernel_module_size --layers 6 --dtype fp8 --tokens 1,9,2048
    python -m bench.kernel_module_size --tiny --layers 4 --tokens 1,9,200          # CI-sized

Cross-lowers one forward of the model (all three kernel switches 'pallas') for CUDA on any host
(nothing runs, no weights: abstract shapes) at each --tokens length (1: decode; 2-16: a verify
block, KDA states pending, as the speculative decoder runs it; more: a prefill chunk) and counts
the kernel launches per forward (`mosaic_gpu` custom calls, each counted once per call of the
function holding it), the distinct kernels (kernel hash), and the `mosaic_gpu` custom-call
instructions in the program text (`calls`), each holding its kernel's whole serialized module.
XLA's compile time grows with that text at every instruction (bench.compile_scaling); the model
calls its kernels through lingjax.model.kernels.shared_call, so each distinct kernel's module
appears once however many layers launch it. This shows how much module text a program hands XLA,
so a change that grows or shrinks it can be checked on a CPU.
"""
from __future__ import annotations

import argparse
import collections
import functools
import re
import time

from bench.common import int_list


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.kernel_module_size", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6, help="model depth (default 6: 5 KDA + 1 MLA at Flash widths)")
    ap.add_argument("--dtype", choices=["bf16", "fp8"], default="fp8")
    ap.add_argument("--tokens", default="1,9,2048", help="comma list of forward lengths (default 1,9,2048)")
    ap.add_argument("--tiny", action="store_true", help="the tiny test config (expert width 128) instead of Flash widths")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    return ap


def call_sizes(hlo_text: str) -> list[tuple[bytes, int]]:
    """(kernel hash, characters of the call's line) for each Mosaic GPU custom call in HLO text."""
    out = []
    for line in hlo_text.splitlines():
        if "custom_call" in line and "mosaic_gpu" in line:
            m = re.search(r'kernel_hash\s*=\s*"((?:[^"\\]|\\.)*)"', line)
            out.append(((m.group(1) if m else line[:200]).encode(), len(line)))
    return out


def launches(text: str) -> int:
    """Mosaic GPU kernel launches of one run of `main` in StableHLO text: each function's own
    `mosaic_gpu` custom calls plus, for each `call @f` in it, f's launches."""
    own, calls, name = collections.Counter(), collections.defaultdict(list), None
    for line in text.splitlines():
        m = re.match(r"\s*func\.func \w+ @([\w.$-]+)\(", line)
        if m:
            name = m.group(1)
        elif name is not None:
            if "custom_call" in line and "mosaic_gpu" in line:
                own[name] += 1
            calls[name] += re.findall(r"\bcall @([\w.$-]+)\(", line)

    @functools.cache
    def total(f):
        return own[f] + sum(total(g) for g in calls[f])
    return total("main")


def main(argv=None) -> dict:
    ap = build_parser()
    a = ap.parse_args(argv)
    lengths = int_list(ap, a.tokens, "--tokens")
    if not lengths or min(lengths) < 1 or a.layers < 1:
        ap.error("--tokens needs positive lengths and --layers >= 1")
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from bench.batch1 import TINY_CONFIG
    from bench.common import save_result
    from lingjax.config import LingConfig, preset
    from lingjax.model.dense import set_dense_kernel
    from lingjax.model.kernels import pallas_cross_lowering
    from lingjax.model.ling import LingModel
    from lingjax.model.mlp import set_moe_kernel
    from lingjax.quant import quantize_model

    if a.tiny:
        cfg = LingConfig.from_json(TINY_CONFIG).replace(moe_intermediate_size=128, num_hidden_layers=a.layers)
    else:
        cfg = preset("ling3-flash").replace(num_hidden_layers=a.layers)

    def build():
        m = LingModel(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), with_mtp=False, kda_kernel="pallas")
        return quantize_model(m) if a.dtype == "fp8" else m
    model = nnx.eval_shape(build)
    set_moe_kernel(model, "pallas")
    set_dense_kernel(model, "pallas")
    graphdef, state = nnx.split(model)
    cache = jax.eval_shape(lambda: model.init_cache(1, max(lengths) + 16))

    def forward(state, tokens, cache):
        t = tokens.shape[1]    # 2..16 tokens: a verify block (pending KDA states), as the Decoder runs it
        return nnx.merge(graphdef, state)(tokens, cache, logits="last", pending=1 < t <= 16).logits

    rows = []
    for t in lengths:
        t0 = time.perf_counter()
        with pallas_cross_lowering():
            text = jax.jit(forward).trace(state, jax.ShapeDtypeStruct((1, t), jnp.int32), cache).lower(
                lowering_platforms=("cuda",)).as_text()
        calls = call_sizes(text)
        per_kernel = collections.defaultdict(list)
        for h, n in calls:
            per_kernel[h].append(n)
        kernels = sorted(((max(v), len(v)) for v in per_kernel.values()), reverse=True)
        rows.append({"tokens": t, "launches": launches(text), "calls": len(calls), "distinct_kernels": len(per_kernel),
                     "module_text_bytes": sum(n for _, n in calls), "program_text_bytes": len(text),
                     "largest_kernels": [{"bytes_per_call": b, "calls": c} for b, c in kernels[:6]],
                     "lowering_s": time.perf_counter() - t0})
    print(f"== Mosaic GPU kernels per forward: {a.layers} layers, {a.dtype}, "
          f"{'tiny' if a.tiny else 'Ling-3.0-flash'} widths, all three kernels ==")
    for r in rows:
        big = ", ".join(f"{k['bytes_per_call'] / 1e6:.2f} MB x {k['calls']}" for k in r["largest_kernels"][:3])
        print(f"T={r['tokens']:<6d} {r['launches']:3d} kernel launches, {r['calls']:3d} custom calls in the text, "
              f"{r['distinct_kernels']:2d} distinct kernels, module text "
              f"{r['module_text_bytes'] / 1e6:6.1f} MB of {r['program_text_bytes'] / 1e6:6.1f} MB (largest: {big})")
    rec = {"bench": "kernel_module_size", "layers": a.layers, "dtype": a.dtype, "tiny": a.tiny, "rows": rows}
    rec["result_path"] = str(save_result("kernel_module_size", rec, a.out))
    return rec


if __name__ == "__main__":
    main()
