"""How each stored parameter relates to its published source tensors.

A `Matrix` parameter is made of published [out, in] weights, stacked along `stack` axes (fused
q/k/v/f/g, gate/up, experts) and with in/out split over several axes (heads); its in axes come
before its out axes ([in, out], "K-major": MLA, lm_head, router, eh_proj) or after them (the
published [out, in] orientation, "K-minor": the KDA projections and w_beta, MLA's per-head gate
g_proj, the MLP and expert weights, whose weight-streaming kernels take the fp8 tiles as register
operands, pallas_kernels/moe_experts.py, pallas_kernels/skinny_gemm.py). The same description is the fp8
*matrix view* (see lingjax/checkpoint.py): it says how the published block scales line up with the
stored array, and which source shapes to expect.
`Vector` parameters are the source itself (or its flattening); `Conv` is the KDA conv stack.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Matrix:
    stack: tuple[int, ...]
    in_: tuple[int, ...]
    out: tuple[int, ...]

    def n_sources(self, shape) -> int:
        return math.prod(shape[a] for a in self.stack)

    def source_shape(self, shape) -> tuple[int, ...]:
        return (math.prod(shape[a] for a in self.out), math.prod(shape[a] for a in self.in_))

    def build(self, shape, *sources) -> np.ndarray:
        """Sources [OUT, IN] (row-major over the stack axes) -> the stored array of `shape`."""
        perm = self.stack + self.in_ + self.out
        stacked = np.stack([s.T for s in sources]).reshape([shape[a] for a in perm])
        return np.ascontiguousarray(np.transpose(stacked, np.argsort(perm)))

    def scales(self, shape, *scale_invs) -> np.ndarray:
        """Published per-source scales [ceil(OUT/b), ceil(IN/b)] -> [*stack_dims, IN blocks, OUT blocks]."""
        dims = [shape[a] for a in self.stack]
        return np.ascontiguousarray(np.stack([s.T for s in scale_invs]).reshape(*dims, *scale_invs[0].T.shape),
                                    dtype=np.float32)

    def meta(self) -> dict:
        return {"stack": list(self.stack), "in": list(self.in_), "out": list(self.out)}


@dataclasses.dataclass(frozen=True)
class Vector:
    flat: bool = False

    def n_sources(self, shape) -> int:
        return 1

    def source_shape(self, shape) -> tuple[int, ...]:
        return (math.prod(shape),) if self.flat else tuple(shape)

    def build(self, shape, source) -> np.ndarray:
        return source.reshape(shape)


@dataclasses.dataclass(frozen=True)
class Conv:
    """KDA depthwise conv: sources [C, 1, K] (q, k, v) -> stored [K, 3, heads, head_dim]."""

    def n_sources(self, shape) -> int:
        return shape[1]

    def source_shape(self, shape) -> tuple[int, ...]:
        return (math.prod(shape[2:]), 1, shape[0])

    def build(self, shape, *sources) -> np.ndarray:
        return np.stack([w[:, 0, :].T for w in sources], axis=1).reshape(shape)


_M_IO = Matrix((), (0,), (1,))
_M_OI = Matrix((), (1,), (0,))
_M_I_OO = Matrix((), (0,), (1, 2))
_M_II_O = Matrix((), (0, 1), (2,))

# Ling parameters by leaf name (and rank where one name has two layouts).
_LING = {
    "embed": Vector(), "weight": Vector(), "o_norm": Vector(), "A_log": Vector(), "expert_bias": Vector(),
    "dt_bias": Vector(flat=True), "conv": Conv(),
    "lm_head": _M_IO, "router": _M_IO, "kv_a": _M_IO, "q_a": _M_IO,
    "eh_proj": _M_IO,
    "kv_b": _M_I_OO, "q_proj": _M_I_OO, "q_b": _M_I_OO,
    "dense": _M_II_O,
    # KDA: K-minor, as published: w_in [5, H, K, D] (q/k/v/f/g fused), w_beta [H, D], w_out [D, H, K];
    # MLA's per-head gate g_proj [H, D] (w_beta and g_proj: lingjax.model.common.head_gate)
    "w_in": Matrix((0,), (3,), (1, 2)), "w_beta": _M_OI, "w_out": Matrix((), (1, 2), (0,)), "g_proj": _M_OI,
    # MLP / MoE: K-minor, as published: w_gate_up [2, F, D] / [E, 2, F, D], w_down [D, F] / [E, D, F]
    ("w_gate_up", 3): Matrix((0,), (2,), (1,)), ("w_gate_up", 4): Matrix((0, 1), (3,), (2,)),
    ("w_down", 2): Matrix((), (1,), (0,)), ("w_down", 3): Matrix((0,), (2,), (1,)),
}
# Stay in high precision whatever --dtype says (spec/ling3.md): never quantised to fp8.
LING_HIGH_PRECISION = {"embed", "lm_head", "router", "weight", "o_norm", "A_log", "expert_bias", "dt_bias", "conv"}
# Stored as fp8 in an fp8 checkpoint (as published), but held dequantised (in the model dtype: the
# values a per-call dequantisation gives) by a model with fp8 weights (lingjax.quant.is_quantisable):
# the per-head gates w_beta (KDA) and g_proj (MLA), [H, D] = 80 KB of fp8 each, reduced in XLA
# (lingjax.model.common.head_gate). Dequantised per call, XLA spends one kernel per layer and step
# on it (a [H, D] float32 multiply before the reduction: deviceless H200 compile, bench/xla_kernels.py,
# session 24); held dequantised, the reduction reads them as they are, for 80 KB more per layer.
# MLA's kv_b [L, H, nope + V] (4.2 MB of fp8 per layer at the Ling shape), likewise: the decode
# attention's two absorbed products read all of it (lingjax.model.mla `_attend_pallas`); dequantised
# per call, XLA writes a copy of it first (deviceless H200 compile, session 25; session 22 held kv_b
# and the gates dequantised together with the sliced products, which still copied the halves, and
# measured that slower: run 84). bench/roofline.py still counts kv_b at fp8, the bytes it must read.
LING_DEQUANTISED_AT_LOAD = frozenset({"w_beta", "g_proj", "kv_b"})


def ling_layout(path: tuple, shape) -> Matrix | Vector | Conv:
    leaf = path[-1]
    layout = _LING.get((leaf, len(shape)), _LING.get(leaf))
    if layout is None:
        raise KeyError(f"no layout for parameter {'.'.join(map(str, path))}")
    return layout


# DSpark drafts: lingjax.model.dspark's weight map tags each tensor with how it is transformed.
DRAFT_LAYOUTS = {"T": _M_IO, "qkv": _M_I_OO, "o": _M_II_O, "": Vector()}
DRAFT_HIGH_PRECISION = {"markov_head.markov_w2.weight", "confidence_head.proj.weight"}
