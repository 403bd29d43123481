"""The kernels XLA compiles a decode step into for the H200, listed on a host without a GPU.

    python -m bench.xla_kernels [--layers 6] [--spec dspark] [--dtype fp8] [--kernels pallas]
                                [--block-size 8] [--hlo-out step.hlo.txt] [--list]

Needs jax's CUDA plugin (`pip install "jax[cuda13]==0.11.2"`, the device machine's version, in a
separate venv) but no GPU: XLA compiles deviceless for a GPU described by a target config
(`--target-config`, default: the H200's numbers below). Builds the batch-1 benchmark's model
abstractly (random-weight shapes, `nnx.eval_shape`: nothing is allocated but the norm weights,
ones as there, and MLA's kv_b, so the kernels get input bounds as in the benchmark), with the
--kernels switches on (Mosaic GPU kernels are emitted compiled, as
`lingjax.model.kernels.pallas_cross_lowering` does), lowers `Decoder.prefill` and then
`Decoder.run` (the generation loop), compiles the loop and counts the GPU kernels in its
while-loop body: every fusion, custom call (Mosaic GPU kernels are `mosaic_gpu_v2`), copy and
sort, per component (`bench.profile_breakdown.hlo_components`: kda, moe, mla, commit, draft, ...).
The same count the H200's profiles show per step (checked: equal for every component of run 83's
code, see H200_MEMORY_GIB), at ~1-1.5 us per small XLA kernel: a way to see on a CPU what an
XLA-side change does to the launches of a step before a device call. It does not time anything and
says nothing about a kernel's speed.

Counts are per execution of the body's computations: kernels inside a nested loop (the draft's
per-position scan) are listed with the loop's trip count unknown ('in a nested loop').
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time
from pathlib import Path

from bench.profile_breakdown import hlo_components, parse_hlo
from lingjax.dspark_config import DRAFT_DTYPES

# XLA's GpuTargetConfigProto for one H200 SXM (141 GB HBM3e, 4.8 TB/s, 132 SMs, sm_90), in the text
# format of XLA's hlo_opt gpu_specs files. Only what the compiler reads for fusion / tiling choices.
H200_TARGET_CONFIG_TEMPLATE = """\
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: MEMORY_BYTES
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
device_description_str: "NVIDIA H200"
"""
# The target's device memory. XLA's scheduler limit here is 80% of it; the benchmark on the H200 gives
# its allocator 95% of ~149 GB (XLA_PYTHON_CLIENT_MEM_FRACTION, bench/batch1.py). 165 GiB puts the
# limit at ~142 GB, above the full-depth fp8 model's ~128 GB of parameters, as on the device. Checked
# against the H200: for the code of run 83 (3436033), 42 layers, DSpark block 8, this tool counts per
# step kda 525, mla 185, moe 722, commit 74, dense_mlp 22, draft 21, accept 4, lm_head 3, embed 1,
# exactly run 83's profile (bench/results/batch1-dspark-tau5.29-20261205-022137-run83-profile.json;
# not compared: its 'other', 47.7 per step, mostly unnamed device-to-device copies). With the
# nominal 140 GiB XLA rematerialises ops the device does not (8b03886: moe 881 kernels, 682 at 165).
H200_MEMORY_GIB = 165.0
H200_TARGET_CONFIG = H200_TARGET_CONFIG_TEMPLATE.replace("MEMORY_BYTES", str(int(H200_MEMORY_GIB * 2 ** 30)))

# instructions that launch nothing (views, tuples, constants, control flow that is walked into)
_NO_KERNEL = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "while", "conditional",
              "call", "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency",
              "copy-start", "copy-done", "domain"}
_BODY = re.compile(r"\bbody=%?([^\s,{}()]+)")
_NAME = re.compile(r"^\s+(?:ROOT\s+)?%?([^\s=]+)\s*=")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_ENTRY = re.compile(r"^ENTRY\s+%?([^\s(]+)", re.M)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.xla_kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6,
                    help="depth of the model (default 6: the dense first layer, four KDA layers and one MLA "
                         "layer of Ling-3.0-flash's schedule; 42 = full depth, a longer compile)")
    ap.add_argument("--spec", choices=["none", "dspark"], default="dspark", help="decoding method (default dspark)")
    ap.add_argument("--block-size", type=int, default=8, help="DSpark block (default 8: a 9-token verify)")
    ap.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8", help="weights (default fp8)")
    ap.add_argument("--draft-dtype", choices=DRAFT_DTYPES, default="bf16",
                    help="the DSpark draft's projections (fp8: lingjax.model.dspark.quantize_draft)")
    ap.add_argument("--kernels", choices=["pallas", "xla"], default="pallas",
                    help="pallas: every kernel switch on (kda, moe, dense, mla), as the full-depth benchmark "
                         "runs; xla: all off (default pallas)")
    ap.add_argument("--input-len", type=int, default=8192, help="prompt length the cache is sized for")
    ap.add_argument("--output-len", type=int, default=1024, help="tokens the cache is sized for")
    ap.add_argument("--target-config", default=None,
                    help="file with an XLA GpuTargetConfigProto in text format (default: an H200 SXM)")
    ap.add_argument("--memory-gib", type=float, default=H200_MEMORY_GIB,
                    help=f"the default target's device memory (default {H200_MEMORY_GIB}: XLA's limit, ~80%% of it, "
                         "then matches what the benchmark's allocator has on an H200, see H200_MEMORY_GIB). Below "
                         "~150 XLA rematerialises (recomputes) ops of the full-depth fp8 model, kernels named "
                         "*.remat* in the counts")
    ap.add_argument("--hlo-out", default=None, help="write the compiled loop's HLO text here")
    ap.add_argument("--list", action="store_true", help="also list every kernel of the step, in program order")
    return ap


def compile_only_device(target_config: str):
    """A compile-only CUDA device for `target_config` (XLA deviceless compilation); RuntimeError saying
    what to install when jax has no CUDA plugin."""
    from jax.experimental import topologies
    try:
        topo = topologies.get_topology_desc("1x1x1", platform="cuda", topology="1x1x1",
                                            target_config=target_config)
    except Exception as e:       # no plugin: jax raises RuntimeError / ValueError depending on version
        raise RuntimeError(f"no CUDA compiler in this jax ({type(e).__name__}: {str(e)[:200]}): install its CUDA "
                           "plugin in a separate venv, e.g. pip install 'jax[cuda13]==0.11.2' (no GPU needed)") from e
    return topo.devices[0]


def step_kernels(hlo_text: str) -> list[dict]:
    """The kernel-launching instructions of the compiled loop's while body (walked into nested
    calls, conditionals and loops), in program order: [{name, opcode, target, component, nested}]
    (target: a custom call's target; nested: inside a loop within the step)."""
    _, comps, instrs = parse_hlo(hlo_text)
    comp_of_instr = hlo_components(hlo_text)
    bodies = [b for line in hlo_text.splitlines() if " while(" in line for b in _BODY.findall(line)]
    if not bodies:
        raise ValueError("no while loop in this HLO: pass the compiled generation loop (Decoder.run)")
    entry_body = None     # the outermost while: the one called from the ENTRY computation
    entry = _ENTRY.search(hlo_text)
    for name in comps.get(entry.group(1) if entry else None, []):
        if instrs[name].opcode == "while":
            entry_body = next((c for c in instrs[name].callees if c in bodies), None)
    if entry_body is None:
        entry_body = bodies[0]
    targets = {}
    for line in hlo_text.splitlines():
        if "custom_call_target=" in line:
            name, target = _NAME.match(line), _TARGET.search(line)
            if name and target:
                targets[name.group(1)] = target.group(1)
    out, seen = [], set()

    def walk(comp: str, nested: bool):
        if comp in seen:
            return
        seen.add(comp)
        for name in comps.get(comp, []):
            ins = instrs[name]
            if ins.opcode == "fusion" or ins.opcode not in _NO_KERNEL:
                out.append(dict(name=name, opcode=ins.opcode, target=targets.get(name, ""),
                                component=comp_of_instr.get(name) or "other", nested=nested))
            elif ins.opcode in ("while", "conditional", "call"):
                for callee in ins.callees:
                    if callee in comps:
                        walk(callee, nested or ins.opcode == "while")

    walk(entry_body, False)
    return out


def summary(kernels: list[dict]) -> dict:
    """{component: {kernels, mosaic, nested, remat}} and the totals (remat: XLA's recomputed copies)."""
    rows = collections.defaultdict(lambda: collections.Counter())
    for k in kernels:
        r = rows[k["component"]]
        r["kernels"] += 1
        r["mosaic"] += k["target"].startswith("mosaic_gpu")
        r["nested"] += k["nested"]
        r["remat"] += ".remat" in k["name"]
    total = collections.Counter()
    for r in rows.values():
        total.update(r)
    return {"components": {c: dict(r) for c, r in sorted(rows.items())}, "total": dict(total)}


def main(argv=None) -> dict:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.layers < 1 or a.block_size < 1:
        ap.error("--layers and --block-size must be >= 1")
    if a.memory_gib <= 0:
        ap.error(f"--memory-gib must be > 0, got {a.memory_gib}")
    if a.draft_dtype != "bf16" and a.spec != "dspark":
        ap.error(f"--draft-dtype {a.draft_dtype} is only used with --spec dspark")
    try:
        cfg_text = (Path(a.target_config).read_text() if a.target_config else
                    H200_TARGET_CONFIG_TEMPLATE.replace("MEMORY_BYTES", str(int(a.memory_gib * 2 ** 30))))
    except OSError as e:
        ap.error(f"--target-config: {e}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")        # the host runs nothing; XLA compiles for `dev`
    from lingjax import xla_env
    xla_env.configure()
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import SingleDeviceSharding

    from bench.batch1 import accept_pattern, draft_config_for
    from lingjax.config import preset
    from lingjax.model.dense import set_dense_kernel
    from lingjax.model.kernels import pallas_cross_lowering
    from lingjax.model.ling import LingModel
    from lingjax.model.mla import set_mla_kernel
    from lingjax.model.mlp import set_moe_kernel
    from lingjax.quant import quantize_model
    from lingjax.sampling import SamplingArrays, SamplingParams
    from lingjax.spec_decode import Decoder, DraftOverride, SpecConfig

    try:
        dev = compile_only_device(cfg_text)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    on_dev = SingleDeviceSharding(dev)
    cfg = preset("ling3-flash").replace(num_hidden_layers=a.layers)
    kda_kernel = a.kernels

    def build_target():
        m = LingModel(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), kda_kernel=kda_kernel)
        return quantize_model(m) if a.dtype == "fp8" else m

    def concrete_bound_weights(model):
        for _, m in nnx.iter_modules(model):   # the weights the recorded input bounds read (norms, MLA's
            for name in getattr(type(m), "BOUND_WEIGHTS", ()):  # kv_b, the draft's markov_w1) concrete, as
                v = getattr(m, name)                            # the random-weight benchmark has them: only
                if v is not None:                               # that a bound exists matters to the count
                    v.set_value(jnp.ones(v.get_value().shape, v.get_value().dtype))

    target = nnx.eval_shape(build_target)
    concrete_bound_weights(target)
    if a.kernels == "pallas":
        set_moe_kernel(target, "pallas")
        set_dense_kernel(target, "pallas")
        set_mla_kernel(target, "pallas")
    draft = None
    if a.spec == "dspark":
        from lingjax.model.dspark import DSparkDraft, quantize_draft
        dcfg = draft_config_for(cfg, a.block_size)

        def build_draft():
            d = DSparkDraft(dcfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
            return quantize_draft(d) if a.draft_dtype == "fp8" else d
        draft = nnx.eval_shape(build_draft)
        concrete_bound_weights(draft)
    dec = Decoder(target, SpecConfig(a.spec, max(a.block_size, 1)), draft=draft)

    def on_device(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_dev), tree)

    dec.params = on_device(dec.params)
    prompt = jax.ShapeDtypeStruct((1, a.input_len), jnp.int32, sharding=on_dev)
    key = on_device(jax.eval_shape(lambda: jax.random.key(0)))
    samp = on_device(SamplingArrays.from_params(SamplingParams()))
    step_cost = jax.ShapeDtypeStruct((len(dec.spec.widths),), jnp.float32, sharding=on_dev)
    limit = jax.ShapeDtypeStruct((), jnp.int32, sharding=on_dev)
    override = None
    if a.spec == "dspark":   # the benchmark's forced acceptance (shapes only)
        oracle_len = a.input_len + a.output_len + dec.spec.drafts + 8
        override = DraftOverride(jax.ShapeDtypeStruct((oracle_len,), jnp.int32, sharding=on_dev),
                                 jax.ShapeDtypeStruct((len(accept_pattern(5.29)),), jnp.int32, sharding=on_dev),
                                 jax.ShapeDtypeStruct((), jnp.bool_, sharding=on_dev))
    t0 = time.perf_counter()
    with pallas_cross_lowering():
        pre = dec.prefill.lower(dec.params, prompt, a.output_len, limit, key, samp, step_cost)
        state = jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=on_dev), pre.out_info)
        loop = dec.run.lower(dec.params, state, samp, override, limit)
    t1 = time.perf_counter()
    text = loop.compile().as_text()
    t2 = time.perf_counter()
    if a.hlo_out:
        Path(a.hlo_out).write_text(text)
    kernels = step_kernels(text)
    rec = {"bench": "xla_kernels", "layers": a.layers, "spec": a.spec, "block_size": a.block_size,
           "dtype": a.dtype, "kernels": a.kernels, "jax": jax.__version__,
           "lower_s": round(t1 - t0, 1), "compile_s": round(t2 - t1, 1), **summary(kernels)}
    if a.list:
        for k in kernels:
            print(f"  {k['component']:10s} {k['opcode']:12s} {k['name']:40s} {k['target']}"
                  + ("  (in a nested loop)" if k["nested"] else ""))
    print(f"{a.layers} layers, {a.dtype}, {a.spec}, kernels {a.kernels} (jax {jax.__version__}; lowered in "
          f"{rec['lower_s']}s, compiled in {rec['compile_s']}s): GPU kernels per step, by component")
    for comp, r in [*rec["components"].items(), ("total", rec["total"])]:
        print(f"  {comp:10s} {r['kernels']:5d}  (Mosaic GPU {r.get('mosaic', 0)}, in nested loops {r.get('nested', 0)}, "
              f"rematerialised {r.get('remat', 0)})")
    return rec


if __name__ == "__main__":
    main()
