"""Hugging Face tensor names -> lingjax parameters: one mapping table, used by the direct loader and by
the converter. Each parameter path of `LingModel` gets the HF names it is built from and a function
that assembles them (transpose [out, in] -> [in, out] for the K-major MLA projections (except the
per-head gate g_proj), lm_head, router and eh_proj; fuse KDA's q/k/v/f/g and the MLPs' gate/up,
stack experts; the KDA (w_beta included), MLA g_proj, MLP and expert weights keep the published
K-minor orientation: lingjax/param_layout.py).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lingjax.config import LingConfig
from lingjax.safetensors_io import CheckpointError, CheckpointReader, dequantize_block_fp8

Path_ = tuple  # an nnx state path, e.g. ('layers', 3, 'attn', 'kv_b')


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    sources: tuple[str, ...]                  # HF tensor names
    build: Callable[..., np.ndarray]          # build(*arrays) -> our layout


def _t(w):
    return np.swapaxes(w, -1, -2)


def _stack(*ws):
    """[out, in] x n -> [n, out, in] (K-minor, as published)"""
    return np.stack(ws)


def plan_for(cfg: LingConfig, with_mtp: bool) -> dict[Path_, TensorPlan]:
    h, k, d = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
    e, ks = cfg.num_experts, cfg.short_conv_kernel_size
    plans: dict[Path_, TensorPlan] = {
        ("embed",): TensorPlan(("model.word_embeddings.weight",), lambda w: w),
        ("norm", "weight"): TensorPlan(("model.norm.weight",), lambda w: w),
        ("lm_head",): TensorPlan(("lm_head.weight",), _t),
    }

    def attn_mla(prefix, hf):
        a = hf + "attention."
        p = {
            (*prefix, "kv_a"): TensorPlan((a + "kv_a_proj_with_mqa.weight",), _t),
            (*prefix, "kv_a_norm", "weight"): TensorPlan((a + "kv_a_layernorm.weight",), lambda w: w),
            (*prefix, "kv_b"): TensorPlan((a + "kv_b_proj.weight",), lambda w: _t(w).reshape(w.shape[1], h, -1)),
            (*prefix, "g_proj"): TensorPlan((a + "g_proj.weight",), lambda w: w),
            (*prefix, "dense"): TensorPlan((a + "dense.weight",), lambda w: _t(w).reshape(h, -1, d)),
        }
        if cfg.q_lora_rank:
            p[(*prefix, "q_a")] = TensorPlan((a + "q_a_proj.weight",), _t)
            p[(*prefix, "q_a_norm", "weight")] = TensorPlan((a + "q_a_layernorm.weight",), lambda w: w)
            p[(*prefix, "q_b")] = TensorPlan((a + "q_b_proj.weight",), lambda w: _t(w).reshape(w.shape[1], h, -1))
        else:
            p[(*prefix, "q_proj")] = TensorPlan((a + "q_proj.weight",), lambda w: _t(w).reshape(d, h, -1))
        return p

    def attn_kda(prefix, hf):
        a = hf + "attention."
        return {
            (*prefix, "w_in"): TensorPlan(tuple(a + f"{n}_proj.weight" for n in "qkvfg"),
                                          lambda *ws: _stack(*ws).reshape(5, h, k, d)),
            (*prefix, "w_beta"): TensorPlan((a + "b_proj.weight",), lambda w: w),
            (*prefix, "conv"): TensorPlan(tuple(a + f"{n}_conv1d.weight" for n in "qkv"),
                                          lambda *ws: np.stack([w[:, 0, :].T for w in ws], axis=1).reshape(ks, 3, h, k)),
            (*prefix, "A_log"): TensorPlan((a + "A_log",), lambda w: w),
            (*prefix, "dt_bias"): TensorPlan((a + "dt_bias",), lambda w: w.reshape(h, k)),
            (*prefix, "o_norm"): TensorPlan((a + "o_norm.weight",), lambda w: w),
            (*prefix, "w_out"): TensorPlan((a + "o_proj.weight",), lambda w: w.reshape(d, h, k)),
        }

    def mlp(prefix, hf, moe: bool):
        m = hf + "mlp."
        if not moe:
            return {
                (*prefix, "w_gate_up"): TensorPlan((m + "gate_proj.weight", m + "up_proj.weight"), _stack),
                (*prefix, "w_down"): TensorPlan((m + "down_proj.weight",), lambda w: w),
            }
        ex = [f"{m}experts.{i}." for i in range(e)]
        return {
            (*prefix, "router"): TensorPlan((m + "gate.weight",), _t),
            (*prefix, "expert_bias"): TensorPlan((m + "gate.expert_bias",), lambda w: w),
            (*prefix, "w_gate_up"): TensorPlan(
                tuple(x + n for x in ex for n in ("gate_proj.weight", "up_proj.weight")),
                lambda *ws: np.stack(ws).reshape(e, 2, *ws[0].shape)),
            (*prefix, "w_down"): TensorPlan(tuple(x + "down_proj.weight" for x in ex), _stack),
            (*prefix, "shared", "w_gate_up"): TensorPlan(
                (m + "shared_experts.gate_proj.weight", m + "shared_experts.up_proj.weight"), _stack),
            (*prefix, "shared", "w_down"): TensorPlan((m + "shared_experts.down_proj.weight",), lambda w: w),
        }

    def block(prefix, hf, kind, moe):
        p = {
            (*prefix, "input_norm", "weight"): TensorPlan((hf + "input_layernorm.weight",), lambda w: w),
            (*prefix, "post_norm", "weight"): TensorPlan((hf + "post_attention_layernorm.weight",), lambda w: w),
        }
        p.update((attn_mla if kind == "mla" else attn_kda)((*prefix, "attn"), hf))
        p.update(mlp((*prefix, "mlp"), hf, moe))
        return p

    for i in range(cfg.num_hidden_layers):
        plans.update(block(("layers", i), f"model.layers.{i}.", "mla" if cfg.is_mla_layer(i) else "kda",
                           cfg.is_moe_layer(i)))
    if with_mtp:
        hf = f"model.layers.{cfg.num_hidden_layers}."
        plans.update({
            ("mtp", "enorm", "weight"): TensorPlan((hf + "enorm.weight",), lambda w: w),
            ("mtp", "hnorm", "weight"): TensorPlan((hf + "hnorm.weight",), lambda w: w),
            ("mtp", "eh_proj"): TensorPlan((hf + "eh_proj.weight",), _t),
            ("mtp", "final_norm", "weight"): TensorPlan((hf + "final_layernorm.weight",), lambda w: w),
        })
        plans.update(block(("mtp", "block"), hf, "mla", cfg.is_moe_layer(cfg.num_hidden_layers)))
    return plans


# Alternative names some exports use.
ALIASES = {".mlp.gate.expert_bias": ".mlp.gate.e_score_correction_bias"}


def resolve_name(reader: CheckpointReader, name: str) -> str:
    if name in reader:
        return name
    for a, b in ALIASES.items():
        if a in name and name.replace(a, b) in reader:
            return name.replace(a, b)
    raise CheckpointError(f"tensor {name} is missing from the checkpoint in {reader.dir}")


def read_hf_tensor(reader: CheckpointReader, name: str, fp8_block=(128, 128)) -> np.ndarray:
    """One HF tensor as float32/float64 numpy, dequantising block-fp8 (`weight_scale_inv`) exactly."""
    name = resolve_name(reader, name)
    w = reader.get(name)
    scale_name = name.replace(".weight", ".weight_scale_inv") if name.endswith(".weight") else None
    if scale_name and scale_name in reader:
        return dequantize_block_fp8(w, reader.get(scale_name), fp8_block)
    if w.dtype == np.float64:
        return w
    return w.astype(np.float32)


def load_hf_params(model_abstract: nnx.Module, reader: CheckpointReader, *, shardings=None,
                   progress: Callable[[int, int], None] | None = None, fp8_block=(128, 128)) -> nnx.Module:
    """Fill an abstract (`nnx.eval_shape`) LingModel with tensors from `reader`.

    shardings: optional {path: jax.sharding.Sharding}; each array is placed directly there.
    """
    cfg: LingConfig = model_abstract.cfg
    graphdef, state = nnx.split(model_abstract)
    flat = dict(nnx.to_flat_state(state))
    plans = plan_for(cfg, with_mtp=model_abstract.mtp is not None)
    missing_params = set(flat) - set(plans)
    if missing_params:
        raise CheckpointError(f"no checkpoint mapping for parameters {sorted(missing_params)[:5]}")
    for n, (path, plan) in enumerate(plans.items()):
        var = flat[path]
        arrays = [read_hf_tensor(reader, s, fp8_block) for s in plan.sources]
        value = plan.build(*arrays)
        want = var.shape if hasattr(var, "shape") else var.value.shape
        if tuple(value.shape) != tuple(want):
            raise CheckpointError(f"{plan.sources[0]}: assembled shape {tuple(value.shape)} does not match the "
                                  f"model's {tuple(want)} for {'.'.join(map(str, path))}")
        dtype = var.dtype if hasattr(var, "dtype") else var.value.dtype
        arr = np.asarray(value).astype(jnp.dtype(dtype))
        sharding = shardings.get(path) if shardings else None
        var.set_value(jax.device_put(arr, sharding) if sharding is not None else jnp.asarray(arr))
        if progress:
            progress(n + 1, len(plans))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def load_hf_model(directory: str | Path, dtype=jnp.bfloat16, *, with_mtp: bool | None = None, progress=None):
    """LingModel from an HF checkpoint directory (config.json + safetensors)."""
    from lingjax.model.ling import LingModel
    cfg = LingConfig.from_json(Path(directory) / "config.json")
    reader = CheckpointReader(directory)
    if with_mtp is None:
        with_mtp = cfg.num_nextn_predict_layers > 0 and f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight" in reader
    abstract = nnx.eval_shape(lambda: LingModel(cfg, dtype=dtype, with_mtp=with_mtp))
    return load_hf_params(abstract, reader, progress=progress, fp8_block=fp8_block_size(directory))


def fp8_block_size(directory: str | Path) -> tuple[int, int]:
    """quantization_config.weight_block_size of an HF config.json (default 128 x 128)."""
    import json
    d = json.loads((Path(directory) / "config.json").read_text())
    block = (d.get("quantization_config") or {}).get("weight_block_size") or [128, 128]
    return int(block[0]), int(block[1])
