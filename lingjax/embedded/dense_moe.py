"""Run the model's MoE layers through `experts_dense` while tracing (training / scoring only).

`lingjax.model.mlp.MoE` picks `experts_gather` (few tokens) or `experts_capacity` (many) from
`lingjax.ops.moe`; both compute the same function as the oracle `experts_dense`. For training on
tens of thousands of tokens with 16 small experts, running every expert on every token is a few
large matmuls, far faster on a GPU than the scanned expert groups (and its gradient is simple).
The router, the combine weights and the shared expert stay the model's own code.

Used as a context manager *inside* a function that jax traces: the patch is active while the
model is traced and is undone right after. `record` (a list) receives each MoE call's expert
indices [N, k] in call order (decoder layers, then the MTP block), for load statistics.
"""
from __future__ import annotations

import contextlib

from lingjax.model.mlp import MoE
from lingjax.ops import moe as moe_ops


@contextlib.contextmanager
def dense_moe_experts(record: list | None = None):
    saved = moe_ops.experts_gather, moe_ops.experts_capacity

    def dense(x, idx, weight, w_gate_up, w_down, limit=None, **_):
        if record is not None:
            record.append(idx)
        return moe_ops.experts_dense(x, idx, weight, w_gate_up, w_down, limit)

    moe_ops.experts_gather = moe_ops.experts_capacity = dense
    try:
        yield record
    finally:
        moe_ops.experts_gather, moe_ops.experts_capacity = saved


def moe_modules(model) -> list[MoE]:
    """The MoE blocks of a LingModel in forward call order (decoder layers, then the MTP block)."""
    mods = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
    if model.mtp is not None and isinstance(model.mtp.block.mlp, MoE):
        mods.append(model.mtp.block.mlp)
    return mods
