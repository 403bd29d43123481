"""Build an Engine from paths: an HF or converted checkpoint (or the embedded default model), an
optional DSpark draft, and the speculative settings. Shared by the CLI, the server and benchmarks."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import jax.numpy as jnp

from lingjax.approx import ApproxModes
from lingjax.dspark_config import DRAFT_DTYPES
from lingjax.engine import Engine
from lingjax.model import kernels
from lingjax.model.dense import check_dense_kernel, set_dense_kernel
from lingjax.model.mla import check_mla_kernel, set_mla_kernel
from lingjax.model.kda import check_kda_kernel, set_kda_kernel
from lingjax.model.mlp import check_moe_kernel, set_moe_kernel
from lingjax.spec_decode import SpecConfig

DTYPES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float32": jnp.float32, "float64": jnp.float64}


class LoadError(ValueError):
    """A checkpoint or draft that cannot be loaded as asked; the message names the path and why."""


def _log(msg: str, quiet: bool):
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def load_draft(path: str | Path, dtype):
    from lingjax.checkpoint import is_converted_checkpoint, load_converted_draft
    from lingjax.model.dspark import from_safetensors
    path = Path(path)
    if not path.is_dir():
        raise LoadError(f"draft directory {path} does not exist")
    if is_converted_checkpoint(path):
        return load_converted_draft(path, dtype)
    return from_safetensors(path, dtype=dtype)


def load_engine(checkpoint: str | Path | None = None, draft: str | Path | None = None, *, dtype: str = "bfloat16",
                spec: str | None = None, block_size: int | None = None, verify_policy: str = "fixed",
                chunk_steps: int = 16, max_context: int | None = None, quiet: bool = False,
                mesh: str | None = None, kda_kernel: str = "xla", moe_kernel: str = "xla",
                dense_kernel: str = "xla", mla_kernel: str = "xla",
                approx: str | ApproxModes | None = None, draft_dtype: str = "bf16") -> Engine:
    """checkpoint None = the embedded default model (and its draft unless `draft` is given).

    mesh: 'tp=N[,ep=M]' (lingjax.sharding.parse_mesh) to split the target and draft over N*M
    devices (heads / vocab over tp, MLP and expert intermediates over ep x tp); None = one device.
    kda_kernel: 'xla' | 'pallas' (the fused Mosaic GPU KDA kernel for decode / verify / commit;
    NVIDIA Hopper GPU only), see lingjax/model/kda.py.
    moe_kernel: 'xla' | 'pallas' (the Mosaic GPU routed-expert kernel for calls of <= 16 tokens;
    fp8 or bfloat16 expert weights, NVIDIA Hopper GPU only), see lingjax/model/mlp.py.
    dense_kernel: 'xla' | 'pallas' (the Mosaic GPU skinny GEMM for the dense projections and lm_head
    of calls of <= 16 tokens; fp8 or bfloat16 weights, NVIDIA Hopper GPU only), see lingjax/model/dense.py.
    mla_kernel: 'xla' | 'pallas' (the Mosaic GPU flash-decoding kernel for the absorbed MLA attention of
    calls of <= 16 tokens; a bfloat16 model without fp8_mla_cache, NVIDIA Hopper GPU only), see
    lingjax/model/mla.py.
    approx: approximate speed modes, an ApproxModes or its text form ('expert_keep=0.75,bf16_router_head,
    bf16_kda_state,fp8_mla_cache'; lingjax/approx.py); None = every mode off (exact).
    draft_dtype: 'bf16' (the draft's projections as loaded) | 'fp8' (held in block fp8,
    lingjax.model.dspark.quantize_draft: half their bytes per step; the output stays the target's,
    which verifies every draft; only the acceptance can change)."""
    if dtype not in DTYPES:
        raise LoadError(f"unknown dtype {dtype!r}; choose from bfloat16, float32, float64")
    if draft_dtype not in DRAFT_DTYPES:
        raise LoadError(f"unknown draft dtype {draft_dtype!r}; choose from {', '.join(DRAFT_DTYPES)}")
    jdtype = DTYPES[dtype]
    try:
        check_kda_kernel(kda_kernel, dtype=jdtype)
        check_moe_kernel(moe_kernel, dtype=jdtype)
        check_dense_kernel(dense_kernel, dtype=jdtype)
        check_mla_kernel(mla_kernel, dtype=jdtype)
        kernels.check_runnable(dict(kda_kernel=kda_kernel, moe_kernel=moe_kernel, dense_kernel=dense_kernel,
                                    mla_kernel=mla_kernel), mesh)
    except ValueError as e:
        raise LoadError(str(e)) from None
    try:
        modes = approx if isinstance(approx, ApproxModes) else ApproxModes.parse(approx)
    except ValueError as e:
        raise LoadError(f"--approx: {e}") from None
    if modes.fp8_mla_cache and mesh is not None:
        raise LoadError("--approx fp8_mla_cache with --mesh is not supported yet (the cache shardings have no "
                        "entry for the per-token scales); drop one of them")
    t0 = time.perf_counter()
    tokenizer, target, drafter = None, None, None
    if checkpoint is None:
        from lingjax.embedded.load import load_embedded
        _log("loading the embedded default model ...", quiet)
        target, drafter, tokenizer = load_embedded(jdtype)
    else:
        from lingjax.checkpoint import load_model
        path = Path(checkpoint)
        if not path.is_dir():
            raise LoadError(f"checkpoint directory {path} does not exist")
        _log(f"loading {path} ({dtype}) ...", quiet)
        target = load_model(path, jdtype)
        if (path / "tokenizer.json").exists():
            from lingjax.tokenizer import load_tokenizer
            tokenizer = load_tokenizer(path)
    from lingjax.model.ling import set_approx
    set_approx(target, modes)
    try:
        set_kda_kernel(target, kda_kernel)
        set_moe_kernel(target, moe_kernel)
        set_dense_kernel(target, dense_kernel)
        set_mla_kernel(target, mla_kernel)
    except ValueError as e:
        raise LoadError(f"{checkpoint or 'embedded model'}: {e}") from None
    if draft is not None:
        _log(f"loading draft {draft} ...", quiet)
        drafter = load_draft(draft, jdtype)
    method = spec or ("dspark" if drafter is not None else "none")
    if draft_dtype != "bf16":           # before any sharding: the fp8 values are then split like the weights
        if method != "dspark" or drafter is None:
            raise LoadError(f"--draft-dtype {draft_dtype} applies to a DSpark draft; this engine runs --spec "
                            f"{method}" + ("" if drafter is not None else " without a draft (--draft DIR)"))
        from lingjax.model.dspark import quantize_draft
        quantize_draft(drafter)
    if mesh is not None:
        from lingjax import sharding
        tp, ep = sharding.parse_mesh(mesh)
        m = sharding.make_mesh(tp, ep)
        sharding.shard_model(target, m)
        if drafter is not None:
            sharding.shard_model(drafter, m)
        _log(f"sharded over mesh tp={tp} x ep={ep}", quiet)
    if method == "dspark" and drafter is None:
        raise LoadError("--spec dspark needs a draft: pass --draft DIR (DSpark checkpoint)")
    default_block = drafter.cfg.block_size if (method == "dspark" and drafter is not None) else 3
    spec_cfg = SpecConfig(method, block_size or default_block, verify_policy)
    engine = Engine(target, tokenizer, drafter if method == "dspark" else None, spec=spec_cfg,
                    chunk_steps=chunk_steps, max_context=max_context)
    _log(f"loaded in {time.perf_counter() - t0:.1f}s (spec={method}, block={spec_cfg.block_size}, "
         f"policy={verify_policy}, kda_kernel={kda_kernel}, moe_kernel={moe_kernel}, "
         f"dense_kernel={dense_kernel}, mla_kernel={mla_kernel}, approx={modes.describe()})", quiet)
    return engine
