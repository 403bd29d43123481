"""The ``dense_kernel`` switch: which kernel runs the model's dense projections ('xla' by default).

  "xla"    XLA dots everywhere (the layers' own einsums).
  "pallas" the Mosaic GPU skinny GEMM (pallas_kernels/skinny_gemm.py) for every call of a listed
           projection with at most 16 rows (tokens): decode, a speculative verify block, an MTP
           draft step, the last-position logits of a prefill. Longer calls (prefill) stay on XLA.
           It streams bfloat16 or block-fp8 weights (fp8 dequantised on chip, float32
           accumulation); activations are rounded to bf16 whatever the model dtype (a float32
           model's projections then differ from XLA by bf16 rounding of x). Needs an NVIDIA Hopper
           GPU and float32 accumulation (a bfloat16 / float32 model, not float64). On a CPU backend
           it only runs in interpret mode, traced inside ``kernels.pallas_interpret()``. Not split
           over devices: lingjax.loader refuses it with a mesh, and a trace under
           ``kernels.kernel_mesh`` with more than one device raises.

The projections (a class attribute ``DENSE_WEIGHTS`` of each layer: weight name, number of axes
contracted with the input: the leading ones (k_axes > 0, a K-major [K..., N...] weight) or the
trailing ones (k_axes < 0, a K-minor [N..., K...] weight, the published orientation, which the
kernel takes with ``k_minor=True``: fp8 tiles as register WGMMA operands)):

    KDA         w_in [5, H, K, D] (one GEMM to 5*H*K), w_out [D, H, K], K-minor
    GatedMLA    q_a, q_b, q_proj, kv_a, dense [H, V, D]   (kv_b, used in the absorbed attention
                einsums and the prefill expansion, stays on XLA)
    DenseMLP    w_gate_up [2, F, D] (one GEMM to 2*F), w_down [D, F], K-minor  (dense layers and the MoE
                shared expert; with moe_kernel='pallas' a shared expert as wide as the routed
                ones runs inside the expert kernels instead: lingjax/model/mlp.py)
    LingModel   lm_head [D, V] (float32 logits; argmax / sampling stay in XLA)
    MTPLayer    eh_proj [2D, D]
    DSpark      every Linear (fc, q / k / v, the MLP, markov_w2) and HeadsOut (o_proj) of the draft:
                the Decoder gives the draft the target's switch; its base logits are the target's
                lm_head product (lingjax/spec_decode.py); the Linears of one input (q / k / v,
                gate / up, the context's k / v) share one launch (:func:`dense_matmul_multi`)

Which of them use the kernel is decided once, by :func:`set_dense_kernel` (also run by
``LingModel(dense_kernel=...)``), and recorded per layer in ``dense_kernel_weights``; a weight
stays on XLA by this static rule (:func:`kernel_refusal`), never by a run-time fallback:

  * its dtype: a bfloat16 Param or an Fp8Weight; float32 / float64 Params stay on XLA (the kernel
    would round them to bf16): quantise the model or load it in bfloat16;
  * its [K, N] matrix (K = the product of the contracted axes): K % 128 == 0 and N % 64 == 0;
  * an Fp8Weight also needs 128 x 128 blocks and a matrix view whose [K, N] (or [N, K]) matrix is
    a plain reshape of the stored values (no transposition: the in axes are the contracted ones,
    in order; the stack axes, then the out axes, are the output axes, in order) and, when it has
    stack axes, out blocks that do not straddle two stacked matrices (prod(out) % 128 == 0).
    The scales [*stack, K/128, OUT/128] then become the kernel's [K/128, ceil(N/128)] grid by
    moving the K-block axis first (a few hundred floats per call).

Call ``set_dense_kernel`` after anything that changes the weights' dtype or layout
(lingjax.quant.quantize_model, a checkpoint loader), as for ``set_moe_kernel``: a weight recorded
for the kernel whose layout no longer fits raises when traced. At the Ling-3.0-flash shapes every
listed projection uses the kernel, bf16 or fp8 (tests/test_dense_kernel_switch.py).
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from lingjax.model import kernels
from lingjax.model.common import acc_dtype, bound_arg, record_input_bounds
from lingjax.quant import Fp8Weight
from pallas_kernels import skinny_gemm

DENSE_KERNELS = ("xla", "pallas")
MAX_TOKENS = skinny_gemm.MAX_M
BLOCK = skinny_gemm.BLOCK
N_ALIGN = 64


def check_dense_kernel(kernel: str, dtype=None) -> str:
    """Validate a dense_kernel value (and, given the model dtype, that the kernel supports it)."""
    if kernel not in DENSE_KERNELS:
        raise ValueError(f"dense_kernel must be one of {', '.join(map(repr, DENSE_KERNELS))}, got {kernel!r}")
    if kernel == "pallas" and dtype is not None and acc_dtype(dtype) != jnp.float32:
        raise ValueError(f"dense_kernel='pallas' accumulates in float32; a {jnp.dtype(dtype).name} model "
                         "(float64 accumulation) needs dense_kernel='xla'")
    return kernel


def compute_dtype(weight) -> jnp.dtype:
    """The dtype the layers see for `weight` (`weight[...]`): an Fp8Weight's compute dtype."""
    if isinstance(weight, Fp8Weight):
        return weight.dtype
    return jnp.dtype(weight.get_value().dtype if isinstance(weight, nnx.Variable) else weight.dtype)


def _axes(ndim: int, k_axes: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(contracted axes, output axes) of a weight of rank `ndim` (k_axes: module docstring)."""
    if k_axes > 0:
        return tuple(range(k_axes)), tuple(range(k_axes, ndim))
    return tuple(range(ndim + k_axes, ndim)), tuple(range(ndim + k_axes))


def _matrix_shape(shape, k_axes: int) -> tuple[int, int]:
    """(K, N) of a weight `shape` whose `k_axes` axes are contracted."""
    k_ax, n_ax = _axes(len(shape), k_axes)
    return math.prod(shape[a] for a in k_ax), math.prod(shape[a] for a in n_ax)


def kernel_refusal(weight, k_axes: int) -> str | None:
    """None if the skinny GEMM can stream `weight` (a Param or Fp8Weight whose leading `k_axes`
    axes, or trailing -k_axes axes, are contracted with the input), else why it stays on XLA
    (module docstring). Reads only shapes and dtypes: works on abstract models (nnx.eval_shape)."""
    shape = tuple(weight.shape)
    K, N = _matrix_shape(shape, k_axes)
    if isinstance(weight, Fp8Weight):
        view = weight.view
        k_ax, n_ax = _axes(len(shape), k_axes)
        if weight.block != (BLOCK, BLOCK):
            return f"fp8 blocks {weight.block}, not {BLOCK} x {BLOCK}"
        if tuple(view.in_) != k_ax or tuple(view.stack) + tuple(view.out) != n_ax:
            return f"fp8 matrix view {view} is not a plain reshape to [K, N] with {k_axes} contracted axes"
        n_out = math.prod(shape[a] for a in view.out)
        if view.stack and n_out % BLOCK:
            return f"fp8 scale blocks straddle the stacked matrices (out size {n_out} % {BLOCK} != 0)"
    else:
        dt = compute_dtype(weight)
        if dt != jnp.bfloat16:
            return f"{dt.name} weights (the kernel streams bfloat16 or block-fp8)"
    if K % BLOCK:
        return f"K={K} is not a multiple of {BLOCK}"
    if N % N_ALIGN:
        return f"N={N} is not a multiple of {N_ALIGN}"
    return None


def kernel_operands(weight, k_axes: int):
    """(w [K, N] (k_axes > 0) or [N, K] (k_axes < 0) bfloat16 or float8_e4m3fn, scale [G, K/128,
    N/128/G] float32 or None) for skinny_gemm_pallas: reshapes of the stored values and scales (G =
    the product of the view's stack dims, the column groups of N; no transpose). Raises ValueError
    for a weight :func:`kernel_refusal` refuses."""
    why = kernel_refusal(weight, k_axes)
    if why is not None:
        raise ValueError(f"dense_kernel='pallas': a weight {tuple(weight.shape)} recorded for the kernel no "
                         f"longer fits it ({why}); call lingjax.model.dense.set_dense_kernel again after "
                         "changing the weights (e.g. after lingjax.quant.quantize_model)")
    K, N = _matrix_shape(tuple(weight.shape), k_axes)
    matrix = (K, N) if k_axes > 0 else (N, K)
    if isinstance(weight, Fp8Weight):
        scale = weight.scale_inv.get_value()                  # [*stack, K/128, OUT/128]
        scale = scale.reshape(-1, K // BLOCK, scale.shape[-1])
        return weight.values.get_value().reshape(matrix), scale
    return weight.get_value().reshape(matrix), None


def dense_matmul(x, weight, *, k_axes: int = 1, out_dtype=None, x_bound=None):
    """x [..., *contracted dims] @ weight -> [..., *output dims] on the skinny GEMM (at most
    MAX_TOKENS rows); k_axes > 0: weight [K..., N...], k_axes < 0: weight [N..., K...] (module
    docstring). out_dtype: default what the XLA path gives (x's dtype promoted with the weight's
    compute dtype). x_bound: optional static bound on |x| (an RMSNorm's recorded ``bound``,
    lingjax.model.common.record_input_bounds), which spares fp8 weights a reduction over x
    (pallas_kernels.common.f16_rows). Compiled on a GPU, interpreted inside kernels.pallas_interpret().
    One weight's case of :func:`dense_matmul_multi` (the same kernel, grid and products)."""
    return dense_matmul_multi(x, [weight], k_axes=k_axes, out_dtype=out_dtype, x_bound=x_bound)[0]


def dense_matmul_multi(x, weights, *, k_axes: int = 1, out_dtype=None, x_bound=None):
    """(x @ w for w in weights) on the skinny GEMM in ONE launch (skinny_gemm_pallas with a tuple of
    weights): weights of one input, e.g. a layer's q / k / v projections, each [K..., N_i...]
    (k_axes > 0) or [N_i..., K...] (k_axes < 0) with the same contracted size K and the same kind
    (all bfloat16 or all block-fp8). The same products as one dense_matmul per weight up to
    float32 summation order (the tiling follows the summed width, so split_k may differ); a call
    saves each further weight a launch, a pipeline ramp and an output fusion. Returns the tuple of
    outputs [..., *output dims of w_i]. The weights' kernel operands (kernel_operands) are traced
    into each call: switches read at trace time (e.g. lingjax.model.dspark.FUSED_LINEARS) take
    effect for programs traced after they are set."""
    ops = [kernel_operands(w, k_axes) for w in weights]
    if kernels.current_mesh() is not None:
        raise ValueError("dense_kernel='pallas' is not split over devices (no shard_map over the projections); "
                         "use dense_kernel='xla' on a device mesh")
    Ks = {_matrix_shape(tuple(w.shape), k_axes)[0] for w in weights}
    if len(Ks) != 1:
        raise ValueError(f"weights {[tuple(w.shape) for w in weights]} of one call must share the contracted "
                         f"size K (k_axes={k_axes}), got {sorted(Ks)}")
    fp8 = {s is not None for _, s in ops}
    if len(fp8) != 1:
        raise ValueError("weights of one call must all be block-fp8 or all bfloat16")
    (K,) = Ks
    interpret = kernels.interpret_arg("dense_kernel")
    k_ax = _axes(len(weights[0].shape), k_axes)[0]
    lead = x.shape[:x.ndim - len(k_ax)]
    dtypes = {jnp.dtype(out_dtype or jnp.promote_types(x.dtype, compute_dtype(w))) for w in weights}
    if len(dtypes) != 1:
        raise ValueError(f"weights of one call give different output dtypes {sorted(map(str, dtypes))}")
    scales = tuple(s for _, s in ops) if fp8 == {True} else None
    ys = kernels.shared_call(skinny_gemm.skinny_gemm_pallas, x.reshape(-1, K), tuple(w for w, _ in ops), scales,
                             bound_arg(x_bound), interpret=interpret, out_dtype=dtypes.pop(), k_minor=k_axes < 0)
    return tuple(y.reshape(*lead, *(w.shape[a] for a in _axes(len(w.shape), k_axes)[1]))
                 for y, w in zip(ys, weights))


def uses_kernel(module, name: str, tokens: int) -> bool:
    """Whether `module`'s weight `name` runs on the kernel for a call of `tokens` rows (static)."""
    return tokens <= MAX_TOKENS and name in getattr(module, "dense_kernel_weights", ())


def dense_kernel_plan(model: nnx.Module) -> dict[str, str | None]:
    """'path.to.weight' -> None (on the kernel for <= 16 tokens) or why it stays on XLA, for every
    projection listed in a DENSE_WEIGHTS of `model`'s layers (all on XLA when dense_kernel is 'xla').
    A MoE's shared expert that joins the expert kernels (moe_kernel='pallas',
    lingjax.model.mlp.shared_kernel_weights) is listed by this rule too, but its <= 16-token calls
    run inside the expert kernels, not the skinny GEMM."""
    plan = {}
    for path, m in nnx.iter_modules(model):
        for name, _ in getattr(type(m), "DENSE_WEIGHTS", ()):
            if getattr(m, name, None) is None:
                continue
            key = ".".join(map(str, (*path, name)))
            if name in getattr(m, "dense_kernel_weights", ()):
                plan[key] = None
            elif getattr(m, "dense_kernel", "xla") == "xla":
                plan[key] = "dense_kernel='xla'"
            else:
                plan[key] = kernel_refusal(getattr(m, name), dict(type(m).DENSE_WEIGHTS)[name])
    return plan


def set_dense_kernel(model: nnx.Module, kernel: str, *, require_any: bool = True) -> nnx.Module:
    """Switch every layer of `model` with dense projections to `kernel`, in place, recording which
    weights use it (module docstring); call it before the model is split / jitted (the choice is
    static) and after any fp8 quantisation. For 'pallas', raises ValueError for a float64 model,
    or (``require_any``) when no projection can use the kernel (e.g. float32 weights: quantise the
    model or load it in bfloat16). Also records the norms' output bounds the kernels take as
    x_bound (lingjax.model.common.record_input_bounds). Returns `model`."""
    check_dense_kernel(kernel)
    on = 0
    for _, m in nnx.iter_modules(model):
        specs = getattr(type(m), "DENSE_WEIGHTS", None)
        if specs is None:
            continue
        if kernel == "pallas" and getattr(m, "dtype", None) is not None:
            check_dense_kernel(kernel, m.dtype)               # LingModel: the activation dtype
        chosen = []
        for name, k_axes in specs:
            w = getattr(m, name, None)
            if w is None or kernel != "pallas":
                continue
            check_dense_kernel(kernel, compute_dtype(w))
            if kernel_refusal(w, k_axes) is None:
                chosen.append(name)
        m.dense_kernel = kernel
        m.dense_kernel_weights = tuple(chosen)
        on += len(chosen)
    if kernel == "pallas" and on == 0 and require_any:
        raise ValueError("dense_kernel='pallas' found no projection the kernel can stream (it needs bfloat16 "
                         "or block-fp8 weights with K % 128 == 0 and N % 64 == 0): quantise the model "
                         "(lingjax.quant.quantize_model), load it in bfloat16, or use dense_kernel='xla'")
    return record_input_bounds(model)
