"""Multi-device sharding checks, run by tests/test_sharding.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=4 (the pytest process has already initialised jax
with one CPU device). Prints one JSON object on the last stdout line.

Usage: python tests/sharding_check.py [golden|random|errors|expert_axis|restore|fp8 ...]
"""
from __future__ import annotations

import asyncio
import collections
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from conftest import DSPARK_TINY, LING_TINY  # noqa: E402  (also: x64 on, matmul precision highest)
from helpers import random_model, rel, tiny_config  # noqa: E402
from lingjax import sharding  # noqa: E402
from lingjax.cache import init_cache  # noqa: E402
from lingjax.dspark_config import DSparkConfig  # noqa: E402
from lingjax.model.dspark import DSparkDraft, from_safetensors  # noqa: E402
from lingjax.model.mlp import MoE  # noqa: E402
from lingjax.sampling import SamplingArrays, SamplingParams  # noqa: E402
from lingjax.spec_decode import Decoder, SpecConfig  # noqa: E402
from lingjax.weights import load_hf_model  # noqa: E402

DT = jnp.float32
MAX_NEW = 10
GREEDY = SamplingArrays.from_params(SamplingParams())
BLOCKS = ("kda", "mla", "moe", "dense_mlp")              # named scopes of the target's blocks
OUTSIDE = ("embed", "lm_head", "draft", "accept", "commit")
# The pre-change rule table: the expert axis sharded over 'ep' (routed-expert gather over a sharded axis).
EXPERT_AXIS_RULES = {"heads": "tp", "kv_heads": "tp", "vocab": "tp", "mlp": "tp", "experts": "ep"}


def golden_pair():
    return load_hf_model(LING_TINY, dtype=DT), from_safetensors(DSPARK_TINY, dtype=DT)


# 4 heads / 4 kv heads everywhere so tp=4 divides every sharded dim; 2 layers (fast compile).
RANDOM_4HEAD = dict(num_hidden_layers=2, layer_group_size=2, first_k_dense_replace=1, vocab_size=64,
                    hidden_size=64, intermediate_size=64, num_experts=4, n_group=2, topk_group=1,
                    num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
                    num_attention_heads=4, num_key_value_heads=4, head_dim=16, kv_lora_rank=16,
                    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def random_pair():
    model = random_model(tiny_config(**RANDOM_4HEAD), DT, seed=3, with_mtp=False)
    dc = DSparkConfig.from_dict(dict(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
        intermediate_size=64, vocab_size=64, block_size=8, mask_token_id=63, target_layer_ids=[0, 1],
        markov_rank=4, enable_confidence_head=True, confidence_head_with_markov=True))
    return model, DSparkDraft(dc, dtype=DT, rngs=nnx.Rngs(5))


def forward_logits(model, prompt, mesh=None):
    cache = init_cache(model.cfg, 1, 32, DT)
    if mesh is not None:
        cache = sharding.shard_cache(cache, model.cfg, mesh)
    graph, params = nnx.split(model)

    @jax.jit
    def fwd(params, tokens, cache):
        m = nnx.merge(graph, params)
        out = m(tokens, cache, logits="all")
        return out.logits, out.cache

    logits, new_cache = fwd(params, jnp.asarray(prompt, jnp.int32)[None], cache)
    return np.asarray(logits), new_cache


PROMPT = [5, 17, 3, 42, 9, 11, 2, 30, 7, 25, 13, 8]


def spec_tokens(model, draft, method):
    """Greedy tokens of Decoder(method); also the state after prefill and the compiled loop's HLO."""
    dec = Decoder(model, SpecConfig(method, 8), draft=draft if method == "dspark" else None)
    prompt = jnp.asarray(PROMPT, jnp.int32)[None]
    cost = jnp.ones(len(dec.spec.widths), jnp.float32)
    prefilled = dec.prefill(dec.params, prompt, MAX_NEW, jnp.int32(MAX_NEW), jax.random.key(0), GREEDY, cost)
    args = (dec.params, prefilled, GREEDY, None, jnp.int32(10_000))
    run = dec.run.lower(*args).compile()
    state = run(*args)
    return np.asarray(state.out)[: int(state.n_out)].tolist(), state, prefilled, run.as_text()


def state_mismatches(state, mesh, cfg) -> list[str]:
    """Paths of DecodeState arrays whose sharding is not `sharding.state_shardings`."""
    want = jax.tree.leaves(sharding.state_shardings(state, mesh, cfg))
    got = jax.tree_util.tree_leaves_with_path(state)
    assert len(want) == len(got)
    return [jax.tree_util.keystr(p) for (p, a), w in zip(got, want) if not a.sharding.is_equivalent_to(w, a.ndim)]


def spec_str(a) -> str:
    """An array's PartitionSpec without trailing replicated dimensions (P(None, None) -> 'P()')."""
    spec = list(a.sharding.spec)
    while spec and spec[-1] is None:
        spec.pop()
    return str(jax.sharding.PartitionSpec(*spec))


def collective_report(hlo: str, model, tokens: int) -> dict:
    """Collectives of one compiled decode step, by the named scope they come from, with the number
    of target blocks of each kind and the byte bounds the test checks them against."""
    cfg = model.cfg
    moe = sum(isinstance(layer.mlp, MoE) for layer in model.layers)
    out = dict(blocks=dict(kda=sum(layer.kind == "kda" for layer in model.layers),
                           mla=sum(layer.kind == "mla" for layer in model.layers),
                           moe=moe, dense_mlp=len(model.layers) - moe),
               row_bytes=tokens * cfg.hidden_size * jnp.dtype(DT).itemsize, top_k=cfg.num_experts_per_tok,
               scopes={})
    for c in sharding.collectives(hlo):
        scope = c.scope(BLOCKS + OUTSIDE) or "other"
        s = out["scopes"].setdefault(scope, dict(n=0, max_bytes=0, ops=collections.Counter()))
        s["n"] += 1
        s["max_bytes"] = max(s["max_bytes"], c.nbytes)
        s["ops"][f"{c.kind} {c.shape}"] += 1
    return out


def param_report(model, mesh):
    """Spec + per-device shard shape of a few representative params; also check every param's
    addressable shards have the shape implied by its sharding."""
    flat = dict((".".join(map(str, p)), v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model)))
    bad = [k for k, a in flat.items()
           if any(s.data.shape != a.sharding.shard_shape(a.shape) for s in a.addressable_shards)
           or a.sharding.mesh.shape != mesh.shape]
    pick = {}
    for k in ("embed", "lm_head", "layers.0.attn.w_in", "layers.7.mlp.w_gate_up", "layers.1.mlp.w_gate_up",
              "layers.3.attn.kv_b", "layers.1.attn.kv_b"):
        if k in flat:
            a = flat[k]
            pick[k] = dict(spec=[None if s is None else str(s) for s in a.sharding.spec], shape=list(a.shape),
                           shard=list(a.addressable_shards[0].data.shape), ndev=len(a.sharding.device_set))
    return dict(bad=bad, params=pick)


def run_meshes(pair_fn, meshes):
    t0 = time.time()
    model, draft = pair_fn()
    ref_logits, _ = forward_logits(model, PROMPT)
    ref = {m: spec_tokens(model, draft, m)[0] for m in ("dspark", "none")}
    res = dict(ref=ref, ref_s=time.time() - t0, meshes={})
    for tp, ep in meshes:
        t1 = time.time()
        mesh = sharding.make_mesh(tp, ep, jax.devices()[: tp * ep])
        model, draft = pair_fn()
        sharding.shard_model(model, mesh)
        sharding.shard_model(draft, mesh)
        logits, cache = forward_logits(model, PROMPT, mesh)
        kda = [layer.state for layer in cache.layers if hasattr(layer, "state")][0]
        r = dict(rel=rel(logits, ref_logits), argmax_equal=bool((logits.argmax(-1) == ref_logits.argmax(-1)).all()),
                 kda_in_spec=[None if s is None else str(s) for s in
                              sharding.cache_shardings(init_cache(model.cfg, 1, 4, DT), model.cfg, mesh).layers[0].state.spec],
                 kda_out_ndev=len(kda.sharding.device_set), collectives={}, state_bad={})
        for m in ("dspark", "none"):
            toks, state, prefilled, hlo = spec_tokens(model, draft, m)
            r[m] = toks
            r[m + "_equal"] = toks == ref[m]
            r["collectives"][m] = collective_report(hlo, model, tokens=9 if m == "dspark" else 1)
            r["state_bad"][m] = dict(prefill=state_mismatches(prefilled, mesh, model.cfg),
                                     run=state_mismatches(state, mesh, model.cfg))
            if m == "dspark":
                r["draft_cache_ndev"] = len(state.draft_cache.k[0].sharding.device_set)
                r["draft_cache_spec"] = spec_str(state.draft_cache.k[0])
                r["kda_state_spec"] = spec_str(state.cache.layers[0].state)
        r.update(param_report(model, mesh))
        r["s"] = time.time() - t1
        res["meshes"][f"{tp}x{ep}"] = r
    return res


def expert_axis():
    """The old rule table (experts over 'ep') on a 1x2 mesh: what the collective check reports."""
    model, _ = golden_pair()
    sharding.shard_model(model, sharding.make_mesh(1, 2, jax.devices()[:2]), EXPERT_AXIS_RULES)
    dec = Decoder(model, SpecConfig("none"))
    state = dec.prefill(dec.params, jnp.asarray(PROMPT, jnp.int32)[None], MAX_NEW, jnp.int32(MAX_NEW),
                        jax.random.key(0), GREEDY, jnp.ones((1,), jnp.float32))
    hlo = dec.run.lower(dec.params, state, GREEDY, None, jnp.int32(1)).compile().as_text()
    return collective_report(hlo, model, tokens=1)


def errors():
    out = {}
    model, draft = golden_pair()
    mesh = sharding.make_mesh(4, 1)
    for name, m in (("target", model), ("draft", draft)):
        try:
            sharding.shard_model(m, mesh)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    # the failed attempt left the model unsharded (all shardings are checked before moving)
    out["untouched"] = len(model.embed.get_value().sharding.device_set) == 1
    try:
        sharding.make_mesh(3, 1)  # 4 devices available
        out["mesh"] = None
    except ValueError as e:
        out["mesh"] = str(e)
    odd = DSparkDraft(DSparkConfig.from_dict(dict(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
        intermediate_size=6, vocab_size=32, block_size=4, mask_token_id=31, target_layer_ids=[0])),
        dtype=DT, rngs=nnx.Rngs(0))
    try:
        sharding.shard_model(odd, sharding.make_mesh(2, 2))
        out["mlp"] = None
    except ValueError as e:
        out["mlp"] = str(e)
    try:
        sharding.shard_model(model, sharding.make_mesh(1, 4, jax.devices()[:4]))  # mlp 256 and 32 over 4: fine
        out["ep4"] = "ok"
    except ValueError as e:
        out["ep4"] = str(e)
    return out


# ---- sharded restore: bytes each device reads ---------------------------------------------------
class ShardReads:
    """Counts the bytes read from disk for each device during orbax restores (a context manager).

    Orbax reads every distinct shard index of an array once (tensorstore, in C++: no Python file
    I/O to intercept) and places it on each device holding that index. Inside this context the
    array restores and, within an array, the shard reads run one at a time, and tensorstore's
    process-wide file counter `/tensorstore/kvstore/file/bytes_read` is sampled around each shard
    read, so a read's bytes are exactly the chunk files it opened. Patches orbax internals
    (serialization.async_deserialize / _read_array_index_and_device_put), for tests only.
    """

    def __init__(self):
        self.reads = []    # (array key, device ids, index extents, bytes read, chunk shape, itemsize, shape)
        self._locks = {}

    def _lock(self, kind):
        key = (kind, id(asyncio.get_running_loop()))
        return self._locks.setdefault(key, asyncio.Lock())

    @staticmethod
    def _bytes_read() -> int:
        import tensorstore as ts
        for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read"):
            return int(m["values"][0]["value"])
        return 0

    def __enter__(self):
        from orbax.checkpoint._src.serialization import serialization as ser
        self._ser = ser
        self._orig = (ser.async_deserialize, ser._read_array_index_and_device_put)
        orig_deserialize, orig_read = self._orig

        async def deserialize(*args, **kw):
            async with self._lock("array"):      # one array at a time: no concurrent metadata reads
                return await orig_deserialize(*args, **kw)

        async def read(devices, index, t, **kw):
            async with self._lock("shard"):
                before = self._bytes_read()
                out = await orig_read(devices, index, t, **kw)
                n = self._bytes_read() - before
            stored = t
            while stored.base is not None:       # orbax reads through a dtype-cast adapter
                stored = stored.base
            ext = tuple(len(range(*s.indices(d))) for s, d in zip(index, t.shape))
            self.reads.append((stored.kvstore.path.rstrip("/").rsplit("/", 1)[-1], [d.id for d in devices], ext, n,
                               tuple(stored.chunk_layout.read_chunk.shape), stored.dtype.numpy_dtype.itemsize,
                               tuple(t.shape), tuple((s.start or 0) for s in index)))
            return out
        ser.async_deserialize, ser._read_array_index_and_device_put = deserialize, read
        return self

    def __exit__(self, *exc):
        self._ser.async_deserialize, self._ser._read_array_index_and_device_put = self._orig

    def per_array(self) -> dict:
        """{array key: {device id: dict(read, shard, chunks, whole)}}: bytes read for the device's
        index, the index's own bytes, the bytes of the stored chunks it intersects, the array's bytes."""
        out = collections.defaultdict(dict)
        for key, devices, ext, n, chunk, item, shape, start in self.reads:
            covered = 1
            for s0, e, c in zip(start, ext, chunk):
                covered *= (math.ceil((s0 + e) / c) - s0 // c) * c
            rec = dict(read=n, shard=int(np.prod(ext)) * item, chunks=covered * item,
                       whole=int(np.prod(shape)) * item)
            for d in devices:
                out[key][d] = rec
        return dict(out)


# 4 KiB chunks: the tiny model's largest arrays (256-512 KiB) then span 64-128 chunks, as Flash's
# experts (2-4 GiB) do at the converter's default 64 MiB.
RESTORE_CHUNK_MIB = "0.00390625"
RESTORE_MESHES = [(2, 1), (1, 2), (2, 2)]           # (tp, ep) on the golden model; tp=4 on RANDOM_4HEAD


def random_4head_checkpoint(d: Path) -> Path:
    """An HF checkpoint of the RANDOM_4HEAD config (random float32 tensors): golden has only 2 heads."""
    from checkpoints_convert.specs import ling_specs
    from lingjax.config import LingConfig
    from lingjax.safetensors_io import write_safetensors
    raw = json.loads((LING_TINY / "config.json").read_text()) | RANDOM_4HEAD | {"num_nextn_predict_layers": 0}
    rng = np.random.default_rng(7)
    tensors = {name: (0.1 * rng.standard_normal(spec.layout.source_shape(spec.shape))).astype(np.float32)
               for spec in ling_specs(LingConfig.from_dict(raw), with_mtp=False) for name in spec.sources}
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(raw))
    write_safetensors(d / "model.safetensors", tensors)
    return d


def rechunk_size_only(d: Path, chunk_bytes: int) -> None:
    """Rewrite every array of converted checkpoint `d` in place, chunked by size alone (largest
    extents split first, heads never): the layout of checkpoints converted before chunks.py."""
    import shutil
    import tensorstore as ts
    from checkpoints_convert.chunks import chunk_shape
    for zarray in sorted(d.glob("params/*/*/.zarray")):
        spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(zarray.parent)}}
        data = ts.open(spec).result().read().result()
        meta = json.loads(zarray.read_text())
        meta["chunks"] = list(chunk_shape(meta["shape"], data.dtype.itemsize, None, chunk_bytes))
        shutil.rmtree(zarray.parent)
        ts.open({**spec, "metadata": meta}, create=True).result().write(data).result()


def restored_reads(d: Path, tp: int, ep: int, fp8: bool, ref: dict | None) -> dict:
    """Restore converted checkpoint `d` onto a tp x ep mesh: bytes each device read per array, the
    arrays' specs, and (with `ref`, {key: array}) the keys whose restored values differ."""
    from lingjax.checkpoint import abstract_model, load_converted
    t0 = time.time()
    mesh = sharding.make_mesh(tp, ep, jax.devices()[: tp * ep])
    shardings = sharding.param_shardings(abstract_model(d, DT, fp8_weights=fp8), mesh)
    with ShardReads() as counter:
        model = load_converted(d, DT, shardings=shardings, fp8_weights=fp8)
    params = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}
    r = dict(arrays=counter.per_array(), specs={k: str(a.sharding.spec) for k, a in params.items()})
    if ref is not None:
        r["value_mismatch"] = [k for k, a in params.items() if not np.array_equal(np.asarray(a), ref[k])]
    r["s"] = time.time() - t0
    return r


def restore():
    """Convert the golden checkpoint (float32 and fp8) and restore it onto the meshes RESTORE_MESHES,
    a random 4-head checkpoint onto tp=4, and the float32 one rechunked the old way (size only) onto
    2x2: bytes each device reads, and the restored float32 values against the HF loader's."""
    from checkpoints_convert import main as convert
    chunk_bytes = int(float(RESTORE_CHUNK_MIB) * (1 << 20))

    def ref_params(src):
        return {".".join(map(str, p)): np.asarray(v.get_value())
                for p, v in nnx.to_flat_state(nnx.state(load_hf_model(src, dtype=DT)))}

    def converted(src, d, *flags):
        assert convert([str(src), str(d), "-q", "--chunk-size", RESTORE_CHUNK_MIB, *flags]) == 0
        return d
    out = {}
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        ref = ref_params(LING_TINY)
        for name, flags, fp8 in (("float32", ["--dtype", "float32"], False),
                                 ("fp8", ["--dtype", "fp8", "--fp8-block", "32"], True)):
            d = converted(LING_TINY, work / name, *flags)
            out[name] = {f"{tp}x{ep}": restored_reads(d, tp, ep, fp8, None if fp8 else ref)
                         for tp, ep in RESTORE_MESHES}
        src4 = random_4head_checkpoint(work / "hf-4head")
        d = converted(src4, work / "float32-4head", "--dtype", "float32")
        out["float32"]["4x1"] = restored_reads(d, 4, 1, False, ref_params(src4))
        rechunk_size_only(work / "float32", chunk_bytes)
        out["old_chunks"] = {"2x2": restored_reads(work / "float32", 2, 2, False, ref)}
    return out


# ---- block fp8 ----------------------------------------------------------------------------------
def fp8():
    """quantize_model(golden) sharded 2x2 vs one device: greedy tokens, plus the step's collectives."""
    from lingjax.quant import quantize_model
    block = (16, 16)      # several blocks per matrix in the tiny model; some straddle shard boundaries
    model, _ = golden_pair()
    ref = spec_tokens(quantize_model(model, block), None, "none")[0]
    model, _ = golden_pair()
    quantize_model(model, block)
    sharding.shard_model(model, sharding.make_mesh(2, 2))
    toks, _, _, hlo = spec_tokens(model, None, "none")
    return dict(ref=ref, none=toks, none_equal=toks == ref, collectives=collective_report(hlo, model, tokens=1),
                values_spec=spec_str(model.layers[3].mlp.w_gate_up.values.get_value()),
                scale_spec=spec_str(model.layers[3].mlp.w_gate_up.scale_inv.get_value()))


# ---- the Pallas KDA kernel on a mesh ------------------------------------------------------------
def _kda_reference_kernels():
    """XLA stand-ins for the three fused-step entry points of lingjax.model.kda (decode, verify,
    commit: pallas_kernels.kda_step_fused with its write flags): the Mosaic GPU interpreter cannot
    run one kernel on several devices at once (its end-of-kernel barrier check sees the other
    devices' barriers), so on CPU the shard_map split around the kernel is checked with these, and
    the real kernel only by cross-lowering it for CUDA."""
    from lingjax.ops import kda as kda_ops
    shapes = []

    def step(*args, interpret=False, state_in_place=False, write_window=False, **settings):
        # state_in_place only says where the kernel writes the new state; the values are the same
        shapes.append(list(args[0].shape))          # proj [B, T, 5, H, K]
        o, s = kda_ops.kda_fused_step(*args, **settings)
        if not write_window:
            return o, s
        return o, s, kda_ops.conv_window_after(args[1], args[0], args[7] if len(args) > 7 else None)

    return dict(_fused_decode=step, _fused_verify=lambda *a, **kw: step(*a, **kw)[0],
                _fused_commit=lambda *a, **kw: (step(*a, **kw)[1:] if kw.get("write_window")
                                                else step(*a, **kw)[1])), shapes


def kda_kernel():
    """kda_kernel='pallas' on meshes 2x1, 1x2, 2x2 (float32 golden pair): greedy tokens with the
    kernel split per device (shard_map over heads) vs the XLA kernel on one device; the heads each
    kernel call sees; the sharded loop cross-lowered for CUDA with the real kernel."""
    from lingjax.model import kda as kda_module
    from lingjax.model.kda import set_kda_kernel
    from lingjax.model.kernels import pallas_cross_lowering, pallas_interpret

    def pair(kernel, mesh):
        model = load_hf_model(LING_TINY, dtype=jnp.float32)
        draft = from_safetensors(DSPARK_TINY, dtype=jnp.float32)
        set_kda_kernel(model, kernel)
        if mesh is not None:
            sharding.shard_model(model, mesh)
            sharding.shard_model(draft, mesh)
        return model, draft
    out = dict(ref={m: spec_tokens(*pair("xla", None), m)[0] for m in ("none", "dspark")}, meshes={})
    real = {name: getattr(kda_module, name) for name in ("_fused_decode", "_fused_verify", "_fused_commit")}
    window_default = kda_module.WINDOW_FROM_KERNEL
    # "+window": kda.WINDOW_FROM_KERNEL flipped from its default (the kernels' window output split too)
    for (tp, ep), methods in (((2, 1), ("dspark",)), ((1, 2), ("dspark",)),
                              ((2, 2), ("none", "dspark", "none+window", "dspark+window"))):
        mesh = sharding.make_mesh(tp, ep, jax.devices()[: tp * ep])
        r = out["meshes"][f"{tp}x{ep}"] = {}
        for key in methods:
            m = key.removesuffix("+window")
            stand_ins, shapes = _kda_reference_kernels()
            for name, fn in stand_ins.items():
                setattr(kda_module, name, fn)
            kda_module.WINDOW_FROM_KERNEL = window_default != key.endswith("+window")
            model, draft = pair("pallas", mesh)
            try:
                with pallas_interpret():
                    toks, state, prefilled, hlo = spec_tokens(model, draft, m)
            finally:
                for name, fn in real.items():
                    setattr(kda_module, name, fn)
                kda_module.WINDOW_FROM_KERNEL = window_default
            rep = collective_report(hlo, model, tokens=9 if m == "dspark" else 1)
            r[key] = dict(tokens=toks, equal=toks == out["ref"][m], call_heads=sorted({s[3] for s in shapes}),
                        kda=rep["scopes"].get("kda", dict(n=0)), kda_blocks=rep["blocks"]["kda"],
                        state_bad=state_mismatches(state, mesh, model.cfg))
        if (tp, ep) == (2, 2):
            model, draft = pair("pallas", mesh)
            dec = Decoder(model, SpecConfig("dspark", 8), draft=draft)
            with pallas_cross_lowering():
                text = dec.run.trace(dec.params, prefilled, GREEDY, None, jnp.int32(100)).lower(
                    lowering_platforms=("cuda",)).as_text()
            r["cuda_mosaic_calls"] = text.count("mosaic_gpu")
    return out


def main(argv):
    what = argv or ["golden", "random", "errors", "expert_axis", "restore", "fp8"]   # kda_kernel: on request
    res = dict(devices=jax.device_count(), s={})
    t0 = time.time()
    for name, fn in (("golden", lambda: run_meshes(golden_pair, [(1, 1), (2, 1), (1, 2), (2, 2)])),
                     ("random", lambda: run_meshes(random_pair, [(4, 1)])),
                     ("errors", errors), ("expert_axis", expert_axis), ("restore", restore), ("fp8", fp8),
                     ("kda_kernel", kda_kernel)):
        if name in what:
            t1 = time.time()
            res[name] = fn()
            res["s"][name] = time.time() - t1
    res["total_s"] = time.time() - t0
    print(json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1:])
