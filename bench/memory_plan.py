"""Memory plan per device for the batch-1 benchmark on a mesh, without allocating anything.

    python -m bench.memory_plan --mesh tp=4 [--dtype bf16|fp8] [--spec none,mtp,dspark]
                                [--block-size 16] [--input-len 8192 --output-len 1024]

Builds the full-size Ling-3.0-flash target (+ MTP layer, + the DSpark draft) abstractly
(`nnx.eval_shape`), applies lingjax.sharding's rules on a mesh of tp x ep devices (forced host CPU
devices when the machine has fewer: only shapes are used), and sums, per device, the bytes of every
parameter shard and of the decode caches (KDA state by head, MLA latent replicated, DSpark context
cache) sized as bench.batch1 sizes them. Not counted: XLA's temporaries (prefill chunk activations,
the step's workspace), measured on one H200 as the gap between the model and the peak in
docs/PERFORMANCE.md. Prints a table and writes a JSON record (bench/common.save_result).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys

GIB = 2 ** 30
H200_USABLE_GIB = 139.0      # what the device tool reports for one H200


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.memory_plan", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--mesh", default="tp=4", help="'tp=N[,ep=M]' (lingjax.sharding.parse_mesh)")
    ap.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16", help="weight format (fp8: block fp8)")
    ap.add_argument("--spec", default="none,mtp,dspark", help="methods whose models are resident (comma list)")
    ap.add_argument("--block-size", type=int, default=16, help="DSpark block (the largest planned run)")
    ap.add_argument("--input-len", type=int, default=8192)
    ap.add_argument("--output-len", type=int, default=1024)
    ap.add_argument("--out", default=None, help="results directory (default bench/results; '-' = none)")
    return ap


def _shard_bytes(shape, dtype, sharding) -> int:
    import numpy as np
    return int(np.prod(sharding.shard_shape(tuple(shape)), dtype=np.int64)) * np.dtype(dtype).itemsize


def _param_bytes(abstract, mesh) -> tuple[int, int]:
    """(bytes on one device, bytes of the whole model) of an abstract module's variables."""
    import numpy as np

    from lingjax import sharding
    shardings = sharding.param_shardings(abstract, mesh)
    per_dev = total = 0
    for path, var in sharding._flat_vars(abstract):
        s = shardings[tuple(path)]
        per_dev += _shard_bytes(var.shape, var.dtype, s)
        total += int(np.prod(var.shape, dtype=np.int64)) * np.dtype(var.dtype).itemsize
    return per_dev, total


def _tree_bytes(tree, shardings) -> int:
    import jax
    return sum(_shard_bytes(x.shape, x.dtype, s) for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))


def plan(a) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from bench.batch1 import draft_config_for
    from lingjax import sharding
    from lingjax.cache import init_cache
    from lingjax.config import preset
    from lingjax.model.dspark import DSparkDraft
    from lingjax.model.ling import LingModel
    from lingjax.quant import quantize_model
    from lingjax.spec_decode import CACHE_ALIGN

    tp, ep = sharding.parse_mesh(a.mesh)
    mesh = sharding.make_mesh(tp, ep, jax.devices()[: tp * ep])
    cfg = preset("ling3-flash")
    methods = [m.strip() for m in a.spec.split(",") if m.strip()]
    dt = jnp.bfloat16

    def build_target():
        m = LingModel(cfg, dtype=dt, rngs=nnx.Rngs(0), with_mtp="mtp" in methods)
        return quantize_model(m) if a.dtype == "fp8" else m
    target = nnx.eval_shape(build_target)
    rows = {}
    rows["target params"] = _param_bytes(target, mesh)
    b = a.block_size if any(m != "none" for m in methods) else 0
    max_len = a.input_len + a.output_len + b + 2          # as Decoder._prefill sizes it (one chunk multiple)
    max_len = -(-max_len // CACHE_ALIGN) * CACHE_ALIGN    # ... in whole multiples of lingjax.spec_decode.CACHE_ALIGN
    cache = jax.eval_shape(lambda: init_cache(cfg, 1, max_len, dt, with_mtp="mtp" in methods))
    rows["target caches"] = (_tree_bytes(cache, sharding.cache_shardings(cache, cfg, mesh)),
                             sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)))
    if "dspark" in methods:
        dcfg = draft_config_for(cfg, a.block_size)
        draft = nnx.eval_shape(lambda: DSparkDraft(dcfg, dtype=dt, rngs=nnx.Rngs(1)))
        rows["draft params"] = _param_bytes(draft, mesh)
        dcache = jax.eval_shape(lambda: draft.init_cache(1, max_len))
        rows["draft context cache"] = (_tree_bytes(dcache, sharding.cache_shardings(dcache, None, mesh)),
                                       sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(dcache)))
    per_dev = sum(v[0] for v in rows.values())
    return dict(mesh=dict(tp=tp, ep=ep), dtype=a.dtype, spec=methods, block_size=a.block_size, max_len=max_len,
                rows={k: dict(per_device_bytes=v[0], total_bytes=v[1]) for k, v in rows.items()},
                per_device_bytes=per_dev, per_device_gib=per_dev / GIB,
                headroom_gib=H200_USABLE_GIB - per_dev / GIB)


def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.block_size < 1:
        ap.error(f"--block-size must be >= 1, got {a.block_size}")
    # only shapes are used: without enough devices, plan on forced host CPU devices (set before
    # jax starts, so the device count comes from the text; parse_mesh below validates it)
    n_dev = math.prod(int(n) for n in re.findall(r"=\s*(\d+)", a.mesh)) or 1
    if "jax" not in sys.modules and not os.environ.get("JAX_PLATFORMS"):
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={n_dev}").strip()
    import jax

    from lingjax.sharding import parse_mesh
    try:
        tp, ep = parse_mesh(a.mesh)
    except ValueError as e:
        ap.error(str(e))
    if jax.device_count() < tp * ep:
        ap.error(f"--mesh {a.mesh} needs {tp * ep} devices, jax sees {jax.device_count()} "
                 f"(run without JAX_PLATFORMS set to plan on forced host CPU devices)")
    res = plan(a)
    print(f"mesh tp={tp} ep={ep}, {a.dtype} weights, spec {','.join(res['spec'])}, context {res['max_len']}")
    print(f"{'':22s} {'per device GiB':>15s} {'whole model GiB':>16s}")
    for k, v in res["rows"].items():
        print(f"{k:22s} {v['per_device_bytes'] / GIB:15.2f} {v['total_bytes'] / GIB:16.2f}")
    print(f"{'total':22s} {res['per_device_gib']:15.2f}   (H200 usable ~{H200_USABLE_GIB:.0f} GiB: "
          f"{res['headroom_gib']:.1f} GiB left for XLA temporaries)")
    if a.out != "-":
        from bench.common import save_result
        path = save_result("memory_plan", res, a.out)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
