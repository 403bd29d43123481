"""Weight-only block fp8 (e4m3fn) for Ling's matrices, in the published FP8 checkpoint's format.

A quantised parameter is an `Fp8Weight` module in place of its `nnx.Param`:

    values     float8_e4m3fn, the parameter's own shape and logical axes
    scale_inv  float32 [*stack_dims, ceil(IN/b0), ceil(OUT/b1)]: one scale per b0 x b1 block of the
               parameter's *matrix view* (`lingjax.param_layout.Matrix`: stack axes, in axes, out
               axes) -- the published `weight_scale_inv`, transposed like the weight

`w[...]` returns the dequantised weight (`values * scale_inv` per block, product in float32, as
the published reference) in the compute dtype, so layers use an `Fp8Weight` exactly like a Param;
`take_rows(w, idx)` gathers stacked rows (experts) *before* dequantising, so a decode step reads
only the routed experts' fp8 bytes. XLA fuses the dequantisation into its consumers or not; that
is the baseline the weight-streaming kernels are measured against.

Which parameters: the `Matrix` layouts outside `LING_HIGH_PRECISION` (embedding, lm_head, router,
norms, gates' biases and the KDA conv stay in the compute dtype), i.e. what a published FP8
checkpoint quantises, except `LING_DEQUANTISED_AT_LOAD` (the per-head gates w_beta and g_proj, and
MLA's kv_b), which are stored as fp8 but held dequantised (lingjax/param_layout.py says why).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lingjax.param_layout import LING_DEQUANTISED_AT_LOAD, LING_HIGH_PRECISION, Matrix, ling_layout

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
DEFAULT_BLOCK = (128, 128)


class Fp8Weight(nnx.Module):
    """A block-fp8 matrix parameter. values [param shape] fp8; scale_inv [*stack, IN/b0, OUT/b1] f32."""

    def __init__(self, values, scale_inv, *, view: Matrix, block: tuple[int, int], dtype, logical: tuple):
        self.view = view
        self.block = tuple(block)
        self.dtype = jnp.dtype(dtype)
        self.values = nnx.Param(values, logical=tuple(logical))
        self.scale_inv = nnx.Param(scale_inv, logical=tuple(logical[a] for a in view.stack) + (None, None))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    def __getitem__(self, index):
        if index is not Ellipsis:
            raise TypeError("Fp8Weight supports only w[...] (the whole dequantised weight); use take_rows to gather")
        return dequantize(self.values[...], self.scale_inv[...], self.view, self.block, self.dtype)

    def take(self, idx):
        """Rows idx (any int shape S) of stack axis 0, dequantised: [*S, *shape[1:]] in the compute dtype."""
        if not self.view.stack or self.view.stack[0] != 0:
            raise ValueError(f"take needs stack axis 0 (an expert stack), the view is {self.view}")
        v = jnp.take(self.values[...], idx, axis=0)
        s = jnp.take(self.scale_inv[...], idx, axis=0)
        r = jnp.ndim(idx) - 1
        shift = lambda axes: tuple(a + r for a in axes)          # noqa: E731
        view = Matrix(tuple(range(r + 1)) + shift(self.view.stack[1:]), shift(self.view.in_), shift(self.view.out))
        return dequantize(v, s, view, self.block, self.dtype)

    def slice(self, start, size: int):
        """Rows [start, start + size) of stack axis 0 (start traced), dequantised: [size, *shape[1:]]."""
        if not self.view.stack or self.view.stack[0] != 0:
            raise ValueError(f"slice needs stack axis 0 (an expert stack), the view is {self.view}")
        v = jax.lax.dynamic_slice_in_dim(self.values[...], start, size, axis=0)
        s = jax.lax.dynamic_slice_in_dim(self.scale_inv[...], start, size, axis=0)
        return dequantize(v, s, self.view, self.block, self.dtype)


def take_rows(w, idx):
    """jnp.take(w, idx, axis=0) for a Param-like (anything supporting [...]) or an Fp8Weight."""
    if isinstance(w, Fp8Weight):
        return w.take(idx)
    return jnp.take(w[...], idx, axis=0)


def slice_rows(w, start, size: int):
    """w[start:start+size] along axis 0 (start traced, size static) for a Param-like or an Fp8Weight
    (dequantised): a contiguous slice, no gather."""
    if isinstance(w, Fp8Weight):
        return w.slice(start, size)
    return jax.lax.dynamic_slice_in_dim(w[...], start, size, axis=0)


def dequantize(values, scale_inv, view: Matrix, block, dtype):
    """values [shape] fp8 + scale_inv [*stack, IN/b0, OUT/b1] -> [shape] in `dtype` (f32 product)."""
    shape = values.shape
    if (len(view.in_) == 1 and len(view.out) == 1 and shape[view.in_[0]] % block[0] == 0
            and shape[view.out[0]] % block[1] == 0):
        return _dequantize_in_place(values, scale_inv, view, block, dtype)
    return _dequantize_transposing(values, scale_inv, view, block, dtype)


def _dequantize_transposing(values, scale_inv, view: Matrix, block, dtype):
    """`dequantize` for any view: the weights moved to [*stack, IN, OUT], scaled, moved back."""
    shape = values.shape
    perm = view.stack + view.in_ + view.out
    stack_dims = [shape[a] for a in view.stack]
    n_in = math.prod(shape[a] for a in view.in_)
    n_out = math.prod(shape[a] for a in view.out)
    b0, b1 = block
    v = jnp.transpose(values, perm).astype(jnp.float32).reshape(*stack_dims, n_in, n_out)
    if n_in % b0 == 0 and n_out % b1 == 0:   # broadcast form (no repeated scale array)
        v = v.reshape(*stack_dims, n_in // b0, b0, n_out // b1, b1) * scale_inv[..., :, None, :, None]
    else:
        # block index per row / column (a gather, not repeat + slice: sharded weights narrower than
        # a block then need no extra collective)
        s = jnp.take(jnp.take(scale_inv, jnp.arange(n_in) // b0, axis=-2), jnp.arange(n_out) // b1, axis=-1)
        v = v * s
    w = v.reshape([shape[a] for a in perm]).astype(dtype)
    return jnp.transpose(w, tuple(int(i) for i in np.argsort(perm)))


def _dequantize_in_place(values, scale_inv, view: Matrix, block, dtype):
    """`dequantize` for one in and one out axis, each a multiple of its block, in the stored axis
    order: each block axis splits into (blocks, block) and the scales broadcast over it (the same
    f32 products as the transposing form, without moving the weights: XLA streams it)."""
    shape = values.shape
    labels = {a: i for i, a in enumerate(view.stack)} | {view.in_[0]: len(view.stack),
                                                          view.out[0]: len(view.stack) + 1}
    s = jnp.transpose(scale_inv, [labels[a] for a in range(len(shape))])     # scale dims in axis order
    split, s_shape = [], []
    for a, n in enumerate(shape):
        b = block[0] if a == view.in_[0] else block[1] if a == view.out[0] else None
        split += [n] if b is None else [n // b, b]
        s_shape += [s.shape[a]] if b is None else [s.shape[a], 1]
    v = values.astype(jnp.float32).reshape(split) * s.reshape(s_shape)
    return v.reshape(shape).astype(dtype)


def quantize(w, view: Matrix, block=DEFAULT_BLOCK):
    """w [shape] float -> (values fp8 [shape], scale_inv f32 [*stack, IN/b0, OUT/b1]) with
    scale_inv = amax(|block|) / 448 (all-zero blocks: 1), the published recipe."""
    shape = w.shape
    perm = view.stack + view.in_ + view.out
    stack_dims = [shape[a] for a in view.stack]
    n_in = math.prod(shape[a] for a in view.in_)
    n_out = math.prod(shape[a] for a in view.out)
    b0, b1 = block
    pi, po = -n_in % b0, -n_out % b1
    m = jnp.transpose(w, perm).astype(jnp.float32).reshape(*stack_dims, n_in, n_out)
    padded = jnp.pad(m, [(0, 0)] * len(stack_dims) + [(0, pi), (0, po)])
    tiles = padded.reshape(*stack_dims, (n_in + pi) // b0, b0, (n_out + po) // b1, b1)
    amax = jnp.max(jnp.abs(tiles), axis=(-3, -1))
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
    full = jnp.repeat(jnp.repeat(scale, b0, axis=-2), b1, axis=-1)[..., :n_in, :n_out]
    q = (m / full).astype(FP8)
    values = jnp.transpose(q.reshape([shape[a] for a in perm]), tuple(int(i) for i in np.argsort(perm)))
    return values, scale


def is_quantisable(path: tuple, shape) -> bool:
    """Whether the Ling parameter at `path` (nnx state path) is held as fp8 by an fp8 model."""
    if str(path[-1]) in LING_HIGH_PRECISION or str(path[-1]) in LING_DEQUANTISED_AT_LOAD:
        return False
    return isinstance(ling_layout(tuple(str(p) for p in path), shape), Matrix)   # KeyError: no layout


def quantize_model(model: nnx.Module, block=DEFAULT_BLOCK) -> nnx.Module:
    """Replace every quantisable Param of a Ling model (in place) by an Fp8Weight of its values.

    Works on concrete models and inside `nnx.eval_shape` (abstract values). The compute dtype of
    each Fp8Weight is the Param's dtype. Returns the model.
    """
    from lingjax.sharding import variable_logical
    for path, var in list(nnx.to_flat_state(nnx.state(model, nnx.Param))):
        path = tuple(getattr(p, "key", p) for p in path)
        value = var.get_value()
        if not is_quantisable(path, value.shape):
            continue
        owner = model
        for p in path[:-1]:
            owner = owner[p] if isinstance(p, int) else getattr(owner, p)
        view = ling_layout(tuple(str(p) for p in path), value.shape)
        values, scale = quantize(value, view, block)
        setattr(owner, path[-1], Fp8Weight(values, scale, view=view, block=block, dtype=value.dtype,
                                           logical=variable_logical(var)))
    return model


def fp8_weights(model: nnx.Module) -> list[tuple[tuple, Fp8Weight]]:
    """(path, Fp8Weight) of every fp8 parameter of a model (empty for a bf16 model)."""
    return [(tuple(p), m) for p, m in nnx.iter_graph(model) if isinstance(m, Fp8Weight)]
