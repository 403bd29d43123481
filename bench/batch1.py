"""Batch-1, concurrency-1 serving benchmark (the SGLang `bench_serving` random recipe, in process).

    python -m bench.batch1 --random-weights [--dtype fp8] [--layers N] [--spec none|mtp|dspark] [--forced-accept 3.5]
    python -m bench.batch1 --random-weights --dtype fp8 --spec none,dspark --forced-accept 1,3.25,5.29,9
    python -m bench.batch1 --checkpoint DIR [--draft DIR] --spec dspark

Several --spec methods and --forced-accept values (comma lists) run in one process on the same
weights: one row each (spec none ignores tau), one warm-up per method (the forced-acceptance
pattern is a traced input, so every tau reuses the compiled loop). Repeated --approx flags add row
sets with approximate modes on the same weights (`--approx none --approx expert_keep=0.75`);
--compile-workers N compiles all row sets' programs ahead, N at a time (full depth: minutes each);
--compile-only stops after that (with JAX_COMPILATION_CACHE_DIR set, the next run loads them).

Random-token prompts of --input-len, --output-len greedy tokens each, --num-prompts requests one
after the other after one excluded warm-up request (32 tokens, same programs). Each request is:
prefill (jitted, blocked on: TTFT), then the whole generation as ONE on-device loop (`Decoder.run`
with max_steps large enough, blocked on: decode time). TPOT = decode time / (output tokens - 1). The loop never returns to the
host between steps, so per-step times are not observed: ITL uses the request's mean step time
split over each step's committed tokens (see `itl_*` in the record).

--forced-accept tau forces a mean accept length tau through the real draft / verify / rollback /
commit code (DraftOverride, force=True, oracle of random tokens), for random weights where the
natural acceptance is ~1. The roofline fraction uses bench/roofline.py (bytes one step must read at
the mean context of each request; routed experts: uniform-routing expectation for the verify
width) over the measured time per step, against a jitted device copy measured here.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys
import time
from pathlib import Path

from lingjax import xla_env
from lingjax.kernel_flags import add_draft_dtype_arg, add_kernel_args

WARMUP_TOKENS = 32      # output tokens of each row's excluded warm-up request
TINY_CONFIG = Path(__file__).resolve().parent.parent / "tests" / "data" / "ling3-tiny" / "config.json"
PDL_MODES = ("off", "wait", "prefetch")   # --pdl: pallas_kernels.common.PDL_WAIT / PDL_PREFETCH


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.batch1", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="HF or converted Ling-3.0 checkpoint directory")
    src.add_argument("--random-weights", action="store_true",
                     help="random bf16 weights at the full Ling-3.0-flash shapes (built on the device)")
    src.add_argument("--config-json", help="random weights for this config.json (small test configs)")
    src.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)   # tests: tests/data/ling3-tiny
    src.add_argument("--embedded", action="store_true",
                     help="the embedded default model with its trained DSpark draft (natural acceptance; CPU smoke)")
    ap.add_argument("--draft", help="DSpark draft checkpoint directory (--spec dspark with --checkpoint)")
    ap.add_argument("--dtype", choices=["bf16", "f32", "fp8"], default="bf16",
                    help="weights: bf16, f32, or fp8 = weight-only block fp8 (128x128 scales, the published "
                         "FP8 format; bf16 activations; needs a converted fp8 checkpoint or --random-weights)")
    ap.add_argument("--layers", type=int, default=None, help="depth-reduced model (random weights only)")
    ap.add_argument("--spec", type=_spec_list, default=["none"],
                    help="none | mtp | dspark, or a comma list of them (each one row)")
    ap.add_argument("--block-size", type=int, default=8, help="drafts per speculative step")
    ap.add_argument("--forced-accept", type=_tau_list, default=None, metavar="TAU[,TAU...]",
                    help="force mean accept length TAU (1 <= TAU <= block+1) through the real spec code; "
                         "a comma list runs one row per value")
    ap.add_argument("--input-len", type=int, default=8192)
    ap.add_argument("--output-len", type=int, default=1024)
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--copy-mib", type=int, default=None,
                    help="size of the bandwidth-probe array (default 1024 MiB on GPU, 64 on CPU)")
    ap.add_argument("--profile", metavar="DIR",
                    help="after the timed requests of the first row of each method, trace one more request "
                         "(--profile-tokens long, loop compiled without CUDA graphs so every kernel is "
                         "traced) into DIR/<row>/ and print a per-component breakdown of a step")
    ap.add_argument("--profile-tokens", type=int, default=64, help="output tokens of the profiled request")
    ap.add_argument("--profile-prefill", action="store_true",
                    help="with --profile: also trace that request's prefill (compiled without CUDA graphs) "
                         "into DIR/<row>/prefill/ and break the TTFT down by component and kernel")
    ap.add_argument("--profile-spec", type=_spec_list, default=None, metavar="METHODS",
                    help="with --profile: profile only these methods' rows (default: every method in --spec; "
                         "each profiled method compiles its loop once more)")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    ap.add_argument("--mesh", default=None,
                    help="split over devices: 'tp=N[,ep=M]'; random weights are then created directly in their shards")
    add_kernel_args(ap)
    add_draft_dtype_arg(ap)
    ap.add_argument("--approx", type=_approx, action="append", default=None, metavar="MODES",
                    help="approximate speed modes (lingjax/approx.py), off by default: comma list of "
                         "expert_keep=X, bf16_router_head, bf16_kda_state, fp8_mla_cache ('none' = exact). "
                         "Repeat the flag to add row sets on the same weights, e.g. --approx none "
                         "--approx expert_keep=0.75")
    ap.add_argument("--compile-workers", type=int, default=1, metavar="N",
                    help="compile every row set's prefill and loop ahead of the runs, N at a time in threads "
                         "(XLA compiles without the GIL; a full-depth loop takes minutes to compile, so "
                         "several --approx / --spec row sets gain from N > 1). 1 = compile at each warm-up")
    ap.add_argument("--compile-only", action="store_true",
                    help="compile every row set's programs ahead (as --compile-workers) and exit without "
                         "running: with JAX_COMPILATION_CACHE_DIR set, a later run loads them from the cache")
    ap.add_argument("--no-xla-defaults", action="store_true", help="do not add the command-buffer XLA flags")
    ap.add_argument("--pdl", choices=PDL_MODES, default="off",
                    help="programmatic dependent launch of the Pallas kernels (pallas_kernels/common.py, "
                         "experimental): 'wait' starts each with griddepcontrol.wait so the GPU may launch it "
                         "while the kernel before drains; 'prefetch' also has the skinny GEMM prefetch its first "
                         "weight tiles into L2 before the wait. Results are unchanged; needs a --*-kernel pallas")
    return ap


def _spec_list(text: str) -> list[str]:
    specs = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in specs if t not in ("none", "mtp", "dspark")]
    if not specs or bad or len(set(specs)) != len(specs):
        raise argparse.ArgumentTypeError(f"{text!r}: expected none, mtp, dspark or a comma list of distinct ones")
    return specs


def _approx(text: str):
    from lingjax.approx import ApproxModes
    try:
        return ApproxModes.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _tau_list(text: str) -> list[float]:
    try:
        return [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number or a comma list of numbers") from None


def _check_args(ap, a) -> None:
    """Flag errors that need no model: exit 2 via ap.error."""
    if not (a.checkpoint or a.random_weights or a.config_json or a.tiny or a.embedded):
        ap.error("choose a model: --checkpoint DIR or --random-weights")
    if a.input_len < 1 or a.output_len < 2 or a.num_prompts < 1:
        ap.error("--input-len >= 1, --output-len >= 2 and --num-prompts >= 1 are required")
    speculative = [s for s in a.spec if s != "none"]
    if speculative and a.block_size < 1:
        ap.error(f"--block-size must be >= 1, got {a.block_size}")
    if a.layers is not None and a.layers < 1:
        ap.error(f"--layers must be >= 1, got {a.layers}")
    if a.layers is not None and (a.checkpoint or a.embedded):
        ap.error("--layers needs random weights (a checkpoint is run at its own depth)")
    if a.embedded and a.dtype == "fp8":
        ap.error("--dtype fp8 needs a converted fp8 checkpoint or --random-weights (the embedded model is not fp8-ready)")
    if a.draft and "dspark" not in a.spec:
        ap.error("--draft is only used with --spec dspark")
    if a.draft_dtype != "bf16" and "dspark" not in a.spec:
        ap.error(f"--draft-dtype {a.draft_dtype} is only used with --spec dspark")
    if "dspark" in a.spec and a.checkpoint and not a.draft:
        ap.error("--spec dspark with --checkpoint needs the DSpark draft checkpoint: --draft DIR "
                 "(a random draft is only built for random target weights)")
    a.approx = a.approx or [_approx("none")]
    labels = [m.describe() for m in a.approx]
    if len(set(labels)) != len(labels):
        ap.error(f"--approx given the same modes twice: {', '.join(labels)}")
    if a.compile_workers < 1:
        ap.error(f"--compile-workers must be >= 1, got {a.compile_workers}")
    if any(m.fp8_mla_cache for m in a.approx) and a.mesh:
        ap.error("--approx fp8_mla_cache with --mesh is not supported yet (no cache sharding for the fp8 scales)")
    if a.moe_kernel == "pallas" and a.mesh:
        ap.error("--moe-kernel pallas with --mesh is not supported yet (the kernel is not split over devices)")
    if a.moe_kernel == "pallas" and a.dtype == "f32":
        ap.error("--moe-kernel pallas streams bf16 or fp8 expert weights: use --dtype bf16 or fp8")
    if a.dense_kernel == "pallas" and a.mesh:
        ap.error("--dense-kernel pallas with --mesh is not supported yet (the kernel is not split over devices)")
    if a.dense_kernel == "pallas" and a.dtype == "f32":
        ap.error("--dense-kernel pallas streams bf16 or fp8 weights: use --dtype bf16 or fp8")
    if a.mla_kernel == "pallas" and a.mesh:
        ap.error("--mla-kernel pallas with --mesh is not supported yet (the kernel is not split over devices)")
    if a.mla_kernel == "pallas" and a.dtype == "f32":
        ap.error("--mla-kernel pallas reads a bf16 latent cache: use --dtype bf16 or fp8")
    if a.mla_kernel == "pallas" and any(m.fp8_mla_cache for m in a.approx):
        ap.error("--mla-kernel pallas reads a bf16 latent cache, not --approx fp8_mla_cache's fp8 one")
    if a.pdl != "off" and all(getattr(a, k) == "xla" for k in ("kda_kernel", "moe_kernel", "dense_kernel",
                                                                  "mla_kernel")):
        ap.error(f"--pdl {a.pdl} changes how the Pallas kernels launch: give at least one --*-kernel pallas")
    if a.profile_tokens < 2:
        ap.error("--profile-tokens must be >= 2")
    if a.profile_spec is not None and not a.profile:
        ap.error("--profile-spec needs --profile DIR")
    if a.profile_prefill and not a.profile:
        ap.error("--profile-prefill needs --profile DIR")
    if a.profile_spec is not None and set(a.profile_spec) - set(a.spec):
        ap.error(f"--profile-spec {','.join(a.profile_spec)}: only methods given to --spec can be profiled "
                 f"(--spec {','.join(a.spec)})")
    for tau in a.forced_accept or ():
        if not speculative:
            if tau != 1:
                ap.error("--forced-accept needs --spec mtp or dspark (plain decoding accepts 1 token per step)")
        elif not (1 <= tau <= a.block_size + 1):
            ap.error(f"--forced-accept {tau} is outside 1..block+1 (= {a.block_size + 1}): a step commits "
                     f"at most block_size drafts plus one bonus token")


def accept_pattern(tau: float, period: int = 64) -> list[int]:
    """Accepted-draft counts per step (cycled) whose running mean tracks tau - 1 as closely as the
    step count allows (Bresenham: the counts are floor / ceil of tau - 1, spread evenly)."""
    x = tau - 1.0
    return [int(math.floor((i + 1) * x + 1e-9) - math.floor(i * x + 1e-9)) for i in range(period)]


def draft_config_for(cfg, block: int):
    """The published Ling-3.0-flash DSpark draft shape, taps clipped to the target's depth. Targets of
    another width (test configs) get the same structure at the target's width / vocabulary."""
    import numpy as np
    from lingjax.dspark_config import dspark_for_ling3_flash
    base = dspark_for_ling3_flash()
    n = cfg.num_hidden_layers
    if n == base.num_target_layers:
        ids = base.target_layer_ids
    else:   # keep 5 taps (the real fc width) spread over the reduced depth when possible
        ids = tuple(sorted({int(round(x)) for x in np.linspace(min(1, n - 1), n - 1, base.num_taps)}))
        if len(ids) < min(base.num_taps, n):
            ids = tuple(range(n - min(base.num_taps, n), n))
    kw = dict(target_layer_ids=ids, num_target_layers=n, block_size=block)
    if cfg.hidden_size != base.hidden_size or cfg.vocab_size != base.vocab_size:
        kw.update(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                  num_key_value_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
                  intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
                  mask_token_id=cfg.vocab_size - 1, markov_rank=min(base.markov_rank, max(8, cfg.hidden_size // 8)))
    return base.replace(**kw)


def _pct(values, q, weights=None) -> float:
    import numpy as np
    v = np.asarray(values, np.float64)
    if weights is None:
        return float(np.percentile(v, q))
    w = np.asarray(weights, np.float64)
    order = np.argsort(v)
    v, w = v[order], w[order]
    cw = np.cumsum(w)
    return float(v[min(np.searchsorted(cw, q / 100.0 * cw[-1]), len(v) - 1)])


def measure_copy_bandwidth(nbytes: int, repeats: int = 5, chain: int = 10) -> float:
    """Bytes/s of a device-to-device elementwise pass (x + 1, in place through buffer donation, so
    no second buffer is needed next to a resident model), counting bytes read + written. Each
    measurement issues `chain` passes back to back and blocks once, so the host round trip and
    dispatch (~0.1-0.3 ms, a third of one 1 GiB pass on an H200) are amortised; median of
    `repeats` measurements after one warm-up chain. (Until 2026-11-30 one blocked pass was timed:
    2.0-2.7 TB/s on the H200 instead of the ~4.3 TB/s a pipelined copy reaches.)"""
    import jax
    import jax.numpy as jnp
    import numpy as np
    n = max(1, nbytes // 4)
    f = jax.jit(lambda a: a + jnp.float32(1), donate_argnums=0)

    def one() -> float:
        y = jax.block_until_ready(jnp.zeros((n,), jnp.float32))
        t = time.perf_counter()
        for _ in range(chain):
            y = f(y)
        jax.block_until_ready(y)
        return (time.perf_counter() - t) / chain

    one()
    return 2 * n * 4 / float(np.median([one() for _ in range(repeats)]))


def main(argv=None) -> dict:
    ap = build_parser()
    a = ap.parse_args(argv)
    _check_args(ap, a)
    if not a.no_xla_defaults:
        xla_env.configure()
    # a full-size fp8 model (~127 GB) needs more than JAX's default 75% preallocation of an H200
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from bench import roofline
    from bench.common import block, compile_ahead, save_result
    from lingjax.config import ConfigError, LingConfig, preset
    from lingjax.model.ling import LingModel
    from lingjax.sampling import SamplingArrays, SamplingParams
    from lingjax.spec_decode import Decoder, DraftOverride, SpecConfig

    from lingjax.model.dspark import quantize_draft
    from lingjax.model.kernels import check_runnable
    from lingjax.quant import quantize_model
    from pallas_kernels import common as pallas_common
    pallas_common.PDL_WAIT = a.pdl != "off"            # read when the kernels are traced, below
    pallas_common.PDL_PREFETCH = a.pdl == "prefetch"
    try:
        check_runnable(dict(kda_kernel=a.kda_kernel, moe_kernel=a.moe_kernel, dense_kernel=a.dense_kernel,
                            mla_kernel=a.mla_kernel), a.mesh)
    except ValueError as e:
        ap.error(str(e))
    dt = {"bf16": jnp.bfloat16, "f32": jnp.float32, "fp8": jnp.bfloat16}[a.dtype]   # compute dtype
    fp8 = a.dtype == "fp8"
    # ---- config (validated before any weight is built) ------------------------------------------
    try:
        if a.embedded:
            from lingjax.embedded.load import load_embedded
            emb_target, emb_draft, _ = load_embedded(dt)
            cfg = emb_target.cfg
        elif a.checkpoint:
            cfg = LingConfig.from_json(a.checkpoint)
        elif a.config_json or a.tiny:
            cfg = LingConfig.from_json(a.config_json or TINY_CONFIG)
        else:
            cfg = preset("ling3-flash")
        if a.layers is not None:
            cfg = cfg.replace(num_hidden_layers=a.layers)
    except (ConfigError, OSError) as e:
        ap.error(str(e))
    B_max = a.block_size if any(x != "none" for x in a.spec) else 0
    if a.input_len + a.output_len + B_max > cfg.max_position_embeddings:
        ap.error(f"--input-len {a.input_len} + --output-len {a.output_len} + block {B_max} = "
                 f"{a.input_len + a.output_len + B_max} exceeds the context (max_position_embeddings "
                 f"{cfg.max_position_embeddings})")

    # ---- models (built once, shared by every row) -----------------------------------------------
    t0 = time.perf_counter()
    draft = None
    mesh = None
    from lingjax import sharding
    if a.mesh:
        try:
            mesh = sharding.make_mesh(*sharding.parse_mesh(a.mesh))
        except ValueError as e:
            ap.error(str(e))
    decoders = {}
    try:
        if a.embedded:
            target, draft = emb_target, emb_draft
            if a.kda_kernel != "xla":
                from lingjax.model.kda import set_kda_kernel
                set_kda_kernel(target, a.kda_kernel)
        elif a.checkpoint:
            from lingjax.checkpoint import ConvertedCheckpointError, load_model
            try:
                target = load_model(a.checkpoint, dt, fp8_weights=fp8)
            except ConvertedCheckpointError as e:
                print(f"error: {e}", file=sys.stderr)
                raise SystemExit(2)
            if a.draft:
                from lingjax.loader import load_draft
                draft = load_draft(a.draft, dt)
            if a.kda_kernel != "xla":
                from lingjax.model.kda import set_kda_kernel
                set_kda_kernel(target, a.kda_kernel)
        else:
            # parameter by parameter, each created on its device(s): a full-size model never
            # exists in another dtype or on the host (fp8: quantised layout built abstractly)
            init_mesh = mesh if mesh is not None else sharding.make_mesh(1, 1, jax.devices()[:1])
            with_mtp = "mtp" in a.spec

            def build_target():
                m = LingModel(cfg, dtype=dt, rngs=nnx.Rngs(0), with_mtp=with_mtp, kda_kernel=a.kda_kernel)
                return quantize_model(m) if fp8 else m
            target = sharding.random_init_sharded(build_target, init_mesh, seed=0)
            if "dspark" in a.spec:
                from lingjax.model.dspark import DSparkDraft
                dcfg_r = draft_config_for(cfg, a.block_size)

                def build_draft():
                    d = DSparkDraft(dcfg_r, dtype=dt, rngs=nnx.Rngs(1))
                    return quantize_draft(d) if a.draft_dtype == "fp8" else d
                draft = sharding.random_init_sharded(build_draft, init_mesh, seed=1)
        if draft is not None and a.draft_dtype == "fp8":       # a loaded draft (a random one is built in fp8;
            quantize_draft(draft)                              # quantize_draft skips what is fp8 already)
        if a.moe_kernel != "xla":       # after any fp8 quantisation: it checks the expert weights
            from lingjax.model.mlp import set_moe_kernel
            set_moe_kernel(target, a.moe_kernel)
        if a.dense_kernel != "xla":     # after any fp8 quantisation: it records which weights it streams
            from lingjax.model.dense import set_dense_kernel
            set_dense_kernel(target, a.dense_kernel)
        if a.mla_kernel != "xla":
            from lingjax.model.mla import set_mla_kernel
            set_mla_kernel(target, a.mla_kernel)
        if mesh is not None and a.checkpoint:
            sharding.shard_model(target, mesh)
            if draft is not None:
                sharding.shard_model(draft, mesh)
        block(nnx.state(target))
        if draft is not None:
            block(nnx.state(draft))
        from lingjax.model.ling import set_approx
        for modes in a.approx:     # each Decoder splits the model now: its graph keeps these modes
            set_approx(target, modes)
            for method in a.spec:
                decoders[(modes, method)] = Decoder(target, SpecConfig(method, max(a.block_size, 1)),
                                                    draft=draft if method == "dspark" else None)
    except ValueError as e:   # draft / MTP that does not fit, bad block size
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    load_s = time.perf_counter() - t0
    cfg = target.cfg
    print(f"model ready in {load_s:.1f}s: {cfg.num_hidden_layers} layers, {a.dtype}, spec {','.join(a.spec)}"
          + (f" block {a.block_size}" if B_max else "")
          + ("" if len(a.approx) == 1 and not a.approx[0].any else
             f", approx {' | '.join(m.describe() for m in a.approx)}"), flush=True)
    dev = jax.devices()[0]
    copy_bytes = (a.copy_mib or (1024 if dev.platform == "gpu" else 64)) << 20
    # the roofline of a step on a mesh is the devices' summed bandwidth (each streams its shards)
    n_devices = mesh.size if mesh is not None else 1
    copy_bw = measure_copy_bandwidth(copy_bytes) * n_devices
    rng = np.random.default_rng(a.seed)
    samp = SamplingArrays.from_params(SamplingParams())

    def request_inputs(dec, pattern, output_len):
        """(prompt [1, input_len], draft override or None, sampling key, step_cost [widths])."""
        B = dec.spec.drafts
        prompt = jax.device_put(jnp.asarray(rng.integers(0, cfg.vocab_size, (1, a.input_len)), jnp.int32))
        override = None
        if pattern is not None:
            # sized for --output-len whatever this request's length: one compiled loop serves all
            oracle = jnp.asarray(rng.integers(0, cfg.vocab_size, (a.input_len + a.output_len + B + 8,)), jnp.int32)
            override = block(DraftOverride(oracle, pattern, jnp.asarray(True)))
        key = jax.random.key(int(rng.integers(0, 2**31 - 1)))
        step_cost = jnp.ones((len(dec.spec.widths),), jnp.float32)
        return block(prompt), override, key, step_cost

    def one_request(dec, pattern, output_len, hlo_path=None, trace_dir=None, compiled=None):
        """prefill + the whole generation as one device loop; returns timings and statistics.
        trace_dir: profile the generation loop (not the prefill) there, compiled WITHOUT command
        buffers (kernels inside a CUDA graph are mostly missing from device traces), and write that
        executable's HLO to hlo_path (both for the profile breakdown). compiled: this row's
        (prefill, loop) executables from compile_ahead, for output_len == --output-len."""
        prompt, override, key, step_cost = request_inputs(dec, pattern, output_len)
        prefill_profile = None
        if trace_dir is not None and a.profile_prefill:
            prefill_profile = _trace_prefill(dec, (dec.params, prompt, a.output_len, jnp.int32(output_len), key,
                                                   samp, step_cost), Path(trace_dir) / "prefill")
        t = time.perf_counter()
        if compiled is not None:
            prefill_exe, run = compiled
            st = block(prefill_exe(dec.params, prompt, jnp.int32(output_len), key, samp, step_cost))
        else:
            st = block(dec.prefill(dec.params, prompt, a.output_len, jnp.int32(output_len), key, samp, step_cost))
            run = dec.run
        t1 = time.perf_counter()
        trace = contextlib.nullcontext()
        if trace_dir is not None:
            from bench.profile_breakdown import dump_hlo
            run = dec.run.lower(dec.params, st, samp, override, output_len + 1).compile(
                compiler_options={"xla_gpu_enable_command_buffer": ""})
            dump_hlo(run, hlo_path)
            block(run(dec.params, st, samp, override, output_len + 1))        # warm-up
            trace = jax.profiler.trace(str(trace_dir))
            t1 = time.perf_counter()
        with trace, jax.profiler.TraceAnnotation("batch1_decode"):   # the profile breakdown's window
            sd = block(run(dec.params, st, samp, override, output_len + 1))
        t2 = time.perf_counter()
        n_out, steps, acc, hist, pos = jax.device_get((sd.n_out, sd.steps, sd.accepted, sd.accept_hist,
                                                       sd.pos_accepted))
        return {"ttft": t1 - t, "decode": t2 - t1, "n_out": int(n_out), "steps": int(steps),
                "accepted": int(acc), "hist": np.asarray(hist), "pos": np.asarray(pos),
                "prefill_profile": prefill_profile}

    def taus_of(method):
        return [None] if method == "none" or not a.forced_accept else a.forced_accept

    def pattern_of(tau):
        return None if tau is None else jnp.asarray(accept_pattern(tau), jnp.int32)

    if a.compile_only and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        print("warning: --compile-only without JAX_COMPILATION_CACHE_DIR keeps nothing for a later run",
              file=sys.stderr)
    compiled = {}
    if a.compile_only or a.compile_workers > 1:
        compiled = compile_ahead(decoders, lambda key, dec: request_inputs(dec, pattern_of(taus_of(key[1])[0]),
                                                                           a.output_len),
                                 samp, a.output_len, a.compile_workers,
                                 name=lambda key: f"{key[1]} approx {key[0].describe()}")
    if a.compile_only:
        return {"compiled": len(compiled)}
    records = []
    for (modes, method), dec in decoders.items():
        taus = taus_of(method)
        name = method + ("" if modes.describe() == "none" else f" approx {modes.describe()}")
        exe = compiled.get((modes, method))
        t = time.perf_counter()
        # warm-up (compiles unless compiled ahead), excluded: a short request through the same
        # programs (the output length is a traced limit; max_new, the static cache size, is fixed)
        one_request(dec, pattern_of(taus[0]), min(a.output_len, WARMUP_TOKENS), compiled=exe)
        print(f"[{name}] warm-up request" + ("" if exe else " (compile)") + f" {time.perf_counter() - t:.1f}s",
              flush=True)
        for tau in taus:
            pattern = pattern_of(tau)
            reqs = []
            t_wall = time.perf_counter()
            for _ in range(a.num_prompts):
                reqs.append(one_request(dec, pattern, a.output_len, compiled=exe))
            wall = time.perf_counter() - t_wall
            rec = _record(a, cfg, dec, draft, tau, reqs, wall, copy_bw, copy_bytes, load_s, dev, roofline, n_devices,
                          approx=modes)
            if a.profile and tau == taus[0] and method in (a.profile_spec or a.spec):   # first row per method
                rec["profile"] = _profile_row(a, dec, pattern, one_request, rec)
            _print_row(rec)
            label = re.sub(r"[^A-Za-z0-9_.=-]+", "-", modes.describe())
            rec["result_path"] = str(save_result(f"batch1-{method}" + ("" if tau is None else f"-tau{tau:g}")
                                                 + ("" if label == "none" else f"-approx-{label}"), rec, a.out))
            records.append(rec)
    if len(records) > 1:
        _print_summary(records)
    return records[0] if len(records) == 1 else {"rows": records}


def _record(a, cfg, dec, draft, tau, reqs, wall, copy_bw, copy_bytes, load_s, dev, roofline, n_devices=1,
            approx=None) -> dict:
    """The result record of one row (one spec method at one forced acceptance, one approx mode set)."""
    import numpy as np
    method, B = dec.spec.method, dec.spec.drafts
    ttft = np.array([r["ttft"] for r in reqs])
    tpot = np.array([r["decode"] / (r["n_out"] - 1) for r in reqs])
    itl_v, itl_w = [], []
    for r in reqs:
        step_t = r["decode"] / max(r["steps"], 1)
        for acc_n, count in enumerate(r["hist"]):
            if count:
                itl_v.append(step_t / (acc_n + 1))
                itl_w.append(count * (acc_n + 1))
    itl_v, itl_w = np.array(itl_v), np.array(itl_w, np.float64)
    total_out = sum(r["n_out"] for r in reqs)
    total_steps = sum(r["steps"] for r in reqs)
    decode_s = sum(r["decode"] for r in reqs)
    accept_len = 1.0 + sum(r["accepted"] for r in reqs) / total_steps
    per_pos = (sum(r["pos"] for r in reqs) / total_steps).tolist() if B else []
    step_s = decode_s / total_steps
    dcfg = draft.cfg if (draft is not None and method == "dspark") else None
    rb = []
    for r in reqs:   # bytes per step at the request's mean context (input + half the output)
        ctx = a.input_len + r["n_out"] / 2
        rb.append((roofline.step_bytes(cfg, a.dtype, method, a.block_size, ctx, dcfg, draft_dtype=a.draft_dtype),
                   r["steps"]))
    bytes_step = sum(sb.total * n for sb, n in rb) / total_steps
    achieved_bw = bytes_step / step_s
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    peak = (stats or {}).get("peak_bytes_in_use")

    def ms3(x, w=None):
        return {"mean": float(np.average(x, weights=w)) * 1e3, "median": _pct(x, 50, w) * 1e3,
                "p99": _pct(x, 99, w) * 1e3}

    return {
        "bench": "batch1", "model": "embedded" if a.embedded else a.checkpoint or (
            "random:" + (a.config_json or ("tiny" if a.tiny else "ling3-flash"))),
        "layers": cfg.num_hidden_layers, "dtype": a.dtype, "spec": method, "kda_kernel": a.kda_kernel,
        "moe_kernel": a.moe_kernel, "dense_kernel": a.dense_kernel, "mla_kernel": a.mla_kernel,
        "approx": approx.describe() if approx is not None else "none",
        "block_size": a.block_size if B else 0, "forced_accept": tau,
        # session 26: forced-acceptance steps include the drafter's own pass (before, XLA removed it)
        "draft_pass_in_step": method != "none",
        "input_len": a.input_len, "output_len": a.output_len, "num_prompts": a.num_prompts,
        "ttft_ms": ms3(ttft), "tpot_ms": ms3(tpot), "itl_ms": ms3(itl_v, itl_w),
        "output_throughput_tok_s": total_out / wall, "wall_s": wall, "total_output_tokens": total_out,
        "accept_length": accept_len, "accept_per_position": per_pos,
        "steps": total_steps, "ms_per_step": step_s * 1e3,
        "ms_per_layer_step": step_s * 1e3 / cfg.num_hidden_layers,
        "peak_device_bytes": peak,
        "roofline": {"bytes_per_step": bytes_step, "bytes_breakdown": rb[0][0].as_dict(),
                     "achieved_bytes_per_s": achieved_bw, "copy_bytes_per_s": copy_bw,
                     "devices": n_devices, "copy_bytes_per_s_per_device": copy_bw / n_devices,
                     "copy_probe_bytes": copy_bytes, "fraction": achieved_bw / copy_bw,
                     "experts_per_layer": rb[0][0].experts_per_layer, "experts": "uniform-routing expectation"},
        "load_s": load_s, "flags": {k: ([m.describe() for m in v] if k == "approx" else v) for k, v in vars(a).items()},
    }


def _print_row(rec) -> None:
    m, B = rec, rec["block_size"]
    print()
    title = f"spec {m['spec']}" + (f", block {B}" if B else "") + (
        f", forced accept {m['forced_accept']:g}" if m["forced_accept"] is not None else "") + (
        f", approx {m['approx']}" if m["approx"] != "none" else "")
    print(f"== {title} ({m['layers']} layers, {m['dtype']}) ==")
    print(f"{'metric':28s} {'mean':>10s} {'median':>10s} {'p99':>10s}")
    for name, key in (("TTFT (ms)", "ttft_ms"), ("TPOT excl. first (ms)", "tpot_ms"), ("ITL per token (ms)", "itl_ms")):
        v = m[key]
        print(f"{name:28s} {v['mean']:10.3f} {v['median']:10.3f} {v['p99']:10.3f}")
    print(f"{'output throughput':28s} {m['output_throughput_tok_s']:10.1f} tok/s  ({m['total_output_tokens']} tokens "
          f"in {m['wall_s']:.2f}s)")
    per_pos = m["accept_per_position"]
    print(f"{'accept length':28s} {m['accept_length']:10.3f}" + (f"  per position {', '.join(f'{p:.2f}' for p in per_pos)}" if B else ""))
    print(f"{'time per step':28s} {m['ms_per_step']:10.3f} ms  ({m['ms_per_layer_step']:.3f} ms per layer = step / "
          f"{m['layers']} layers)")
    peak = m["peak_device_bytes"]
    print(f"{'peak device memory':28s} " + (f"{peak/2**30:10.2f} GiB" if peak is not None else "       n/a"))
    r = m["roofline"]
    print(f"{'roofline':28s} {r['bytes_per_step']/1e9:10.3f} GB/step -> {r['achieved_bytes_per_s']/1e9:.1f} GB/s "
          f"achieved vs copy {r['copy_bytes_per_s']/1e9:.1f} GB/s"
          + (f" ({r['devices']} devices)" if r.get("devices", 1) > 1 else "")
          + f" = {r['fraction']*100:.1f}% (experts/layer "
          f"{r['experts_per_layer']:.1f}, uniform routing)")
    if "profile" in m:
        print(m["profile"]["table"])
    print()


def _print_summary(records) -> None:
    print("== summary ==")
    print(f"{'spec':8s} {'tau':>6s} {'accept':>7s} {'ms/step':>8s} {'TPOT ms':>8s} {'tok/s':>8s} {'TTFT ms':>8s} "
          f"{'roofline':>9s}  approx")
    for m in records:
        tau = "-" if m["forced_accept"] is None else f"{m['forced_accept']:g}"
        print(f"{m['spec']:8s} {tau:>6s} {m['accept_length']:7.2f} {m['ms_per_step']:8.3f} {m['tpot_ms']['mean']:8.3f} "
              f"{m['output_throughput_tok_s']:8.1f} {m['ttft_ms']['mean']:8.1f} {m['roofline']['fraction']*100:8.1f}%"
              f"  {m['approx']}")


# the model's own kernels (the rest of a step: accept, commit bookkeeping, 'other', launch gaps)
MODEL_COMPONENTS = ("kda", "mla", "moe", "dense_mlp", "embed", "lm_head", "draft")


def _profile_row(a, dec, pattern, one_request, rec) -> dict:
    """Trace one more request of this row (--profile-tokens long) and break a step down by component
    (bench/profile_breakdown.py: device kernels mapped to the model's named scopes)."""
    import jax
    from bench import profile_breakdown as pb
    tau = rec["forced_accept"]
    d = Path(a.profile) / (dec.spec.method + ("" if tau is None else f"-tau{tau:g}"))
    hlo = d / "run.hlo.txt"
    t = time.perf_counter()
    r = one_request(dec, pattern, min(a.profile_tokens, a.output_len), hlo_path=hlo, trace_dir=d)
    try:
        b = pb.breakdown(d, [hlo.read_text()], steps=r["steps"], window_event="batch1_decode")
    except pb.ProfileBreakdownError as e:      # keep the row's measurements; say what failed
        return {"dir": str(d), "error": str(e), "table": f"profile breakdown failed: {e}"}
    # Busy kernel time per step is comparable with the timed (graph-captured) step; the idle of
    # this host-driven, graph-less run is not, so 'outside the model' uses the timed step time.
    step_us = rec["ms_per_step"] * 1e3
    model = sum(b.per_step_us[c] for c in MODEL_COMPONENTS if c in b.per_step_us)
    extra = (f"\nprofiled run (no CUDA graphs, {time.perf_counter() - t:.0f}s incl. compile): model kernels "
             f"{model:.0f} us/step of the timed {step_us:.0f} us/step -> {100 * (1 - model / step_us):.1f}% of "
             f"a step outside the model's kernels (accept/commit/other kernels, launch gaps, idle)")
    out = {"dir": str(d), "table": pb.format_table(b) + extra, "model_kernels_us_per_step": model,
           "outside_model_share": 1 - model / step_us, **b.as_dict()}
    pp = r["prefill_profile"]
    if pp is not None:
        try:
            bp = pb.breakdown(pp["dir"], [Path(pp["hlo"]).read_text()], steps=None, window_event="batch1_prefill",
                              top=12)
        except pb.ProfileBreakdownError as e:
            out["prefill"] = {"error": str(e)}
            out["table"] += f"\nprefill profile breakdown failed: {e}"
        else:
            out["prefill"] = {"dir": pp["dir"], "wall_ms": pp["wall_s"] * 1e3, **bp.as_dict()}
            out["table"] += (f"\nprefill of {a.input_len} tokens, traced without CUDA graphs: "
                             f"{pp['wall_s'] * 1e3:.1f} ms wall (the timed TTFT, with graphs: "
                             f"{rec['ttft_ms']['mean']:.1f} ms)\n" + pb.format_table(bp))
    return out


def _trace_prefill(dec, args, trace_dir: Path) -> dict:
    """Compile dec.prefill without command buffers (kernels inside CUDA graphs are mostly missing
    from device traces), warm it up, trace one call under the 'batch1_prefill' annotation and save
    its HLO for the breakdown. args: dec.prefill's positional arguments (the third, max_new, is
    static). Returns {"dir", "hlo", "wall_s"} (wall of the traced call)."""
    import jax
    from bench.common import block
    from bench.profile_breakdown import dump_hlo
    exe = dec.prefill.lower(*args).compile(compiler_options={"xla_gpu_enable_command_buffer": ""})
    hlo = dump_hlo(exe, trace_dir / "prefill.hlo.txt")
    call_args = args[:2] + args[3:]                  # the compiled call takes no static max_new
    block(exe(*call_args))                                                # warm-up
    with jax.profiler.trace(str(trace_dir)):
        t = time.perf_counter()
        with jax.profiler.TraceAnnotation("batch1_prefill"):
            block(exe(*call_args))
        wall = time.perf_counter() - t
    return {"dir": str(trace_dir), "hlo": str(hlo), "wall_s": wall}


if __name__ == "__main__":
    main()
