"""Sharding the Ling target, the DSpark draft and their caches over a device mesh (jax.sharding).

Approach: every parameter carries logical axis names (`nnx.Param(..., logical=(...))`, see
lingjax.model.common). A small rule table maps logical names onto mesh axes; each parameter and
each cache array is `device_put` with the resulting `NamedSharding`, and the existing jitted code
(Decoder.prefill / Decoder.run, the model forward) is compiled as-is: XLA's GSPMD partitioner
propagates the input shardings and inserts the collectives (e.g. the all-reduce after a
heads-sharded output projection, the reduction of a greedy argmax over a vocab-sharded lm_head).
Results are therefore the single-device results up to floating-point summation order.

Mesh axes: ('ep', 'tp'). Default rules:
    heads, kv_heads, vocab -> 'tp'     mlp -> ('ep', 'tp')     everything else replicated.
Every MLP intermediate (dense, shared and routed experts) is split over all ep*tp devices; the
expert axis itself stays whole. A batch-1 decode step then costs one all-reduce per attention block
(over tp) and one per MLP / MoE block (over ep*tp), and every device streams 1/(ep*tp) of each
routed expert. Sharding the expert axis ('experts' -> 'ep') would make the routed-expert gather
(`jnp.take` over a sharded axis) all-reduce the gathered expert *weights* every step; it needs an
expert-parallel MoE kernel first. `collectives` lists what a compiled step really communicates.

A mesh axis is used at most once per array (a later dimension keeps only the mesh axes of its rule
that no earlier dimension used; with none left it is replicated). A dimension not divisible by its
mesh axes' size is an error naming the parameter, the logical axis, the dimension and the mesh
axes (strict=False replicates that dimension instead).
"""
from __future__ import annotations

import re
import warnings
from typing import Mapping, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("ep", "tp")

# logical axis name -> mesh axis, tuple of mesh axes (split over their product) or None (replicated)
Rules = Mapping[str, "str | tuple[str, ...] | None"]

DEFAULT_RULES: dict[str, str | tuple[str, ...]] = {
    "heads": "tp",
    "kv_heads": "tp",
    "vocab": "tp",
    "mlp": ("ep", "tp"),
}


class ShardingError(ValueError):
    """A mesh that does not fit the model (e.g. heads not divisible by tp)."""


# ---- mesh ---------------------------------------------------------------------------------------
def make_mesh(tp: int, ep: int = 1, devices=None) -> Mesh:
    """A ('ep', 'tp') mesh of ep*tp devices (all available devices when `devices` is None; the
    product must equal their number). tp is the inner (fastest-varying) axis."""
    if tp < 1 or ep < 1:
        raise ShardingError(f"mesh sizes must be >= 1, got tp={tp}, ep={ep}")
    given = devices is not None
    devices = list(jax.devices() if devices is None else devices)
    if tp * ep != len(devices):
        raise ShardingError(f"mesh tp={tp} x ep={ep} = {tp * ep} devices, but {len(devices)} "
                            f"device(s) {'given' if given else 'available'}; tp*ep must equal the device count")
    arr = np.array(devices, dtype=object).reshape(ep, tp)
    try:
        from jax.sharding import AxisType
        return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto))
    except (ImportError, TypeError):  # older jax: Auto is the only kind
        return Mesh(arr, MESH_AXES)


def parse_mesh(text: str) -> tuple[int, int]:
    """'tp=4', 'tp=2,ep=2', '4' (tp only) or '2x2' (ep x tp) -> (tp, ep). For a CLI --mesh flag."""
    text = text.strip()
    if "=" in text:
        sizes = {"tp": 1, "ep": 1}
        for part in text.split(","):
            name, _, val = part.partition("=")
            name = name.strip()
            if name not in sizes:
                raise ShardingError(f"unknown mesh axis {name!r} in {text!r} (tp, ep)")
            sizes[name] = int(val)
        return sizes["tp"], sizes["ep"]
    if "x" in text:
        ep, tp = (int(v) for v in text.split("x"))
        return tp, ep
    return int(text), 1


# ---- logical axes -> PartitionSpec --------------------------------------------------------------
def logical_to_spec(logical, rules: Rules | None = None) -> P:
    """PartitionSpec for a tuple of logical axis names (None / unknown names: replicated). A rule
    may name several mesh axes (a tuple): that dimension is split over their product."""
    rules = DEFAULT_RULES if rules is None else rules
    used: set[str] = set()
    out = []
    for name in logical:
        axis = rules.get(name) if name is not None else None
        axes = () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)
        axes = tuple(a for a in axes if a not in used)
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*out)


def _axis_size(mesh: Mesh, axis) -> int:
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    return int(np.prod([mesh.shape[a] for a in axes]))


def _axis_name(axis) -> str:
    return axis if isinstance(axis, str) else "*".join(axis)


def _fit_spec(spec: P, shape, mesh: Mesh, logical, where: str, strict: bool) -> P:
    """Check divisibility of each sharded dimension; raise (strict) or replicate that dimension."""
    out = list(spec) + [None] * (len(shape) - len(spec))
    for i, axis in enumerate(out):
        if axis is None:
            continue
        size = _axis_size(mesh, axis)
        if shape[i] % size:
            name = logical[i] if logical is not None else f"dim{i}"
            msg = f"{name}={shape[i]} not divisible by {_axis_name(axis)}={size} ({where})"
            if strict:
                raise ShardingError(msg)
            warnings.warn(msg + ": replicated", stacklevel=3)
            out[i] = None
    return P(*out)


def _path_str(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _flat_vars(model_or_state):
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
    return nnx.to_flat_state(state)


def variable_logical(var):
    """The `logical` axis names of an nnx Variable (None if it has none)."""
    try:
        meta = var.get_metadata()
    except AttributeError:
        meta = {}
    return meta.get("logical")


def param_shardings(model_or_abstract, mesh: Mesh, rules: Rules | None = None,
                    *, strict: bool = True) -> dict[tuple, NamedSharding]:
    """{state path: NamedSharding} for every variable of a module (or nnx.State / abstract state from
    nnx.eval_shape), from its `logical` metadata. Variables without it are replicated."""
    out = {}
    for path, var in _flat_vars(model_or_abstract):
        shape = tuple(var.shape) if hasattr(var, "shape") else tuple(np.shape(var.get_value()))
        logical = variable_logical(var)
        if logical is None:
            spec = P()
        else:
            if len(logical) != len(shape):
                raise ShardingError(f"{_path_str(path)}: logical axes {logical} do not match shape {shape}")
            spec = _fit_spec(logical_to_spec(logical, rules), shape, mesh, logical, _path_str(path), strict)
        out[tuple(path)] = NamedSharding(mesh, spec)
    return out


def shard_model(model, mesh: Mesh, rules: Rules | None = None, *, strict: bool = True):
    """device_put every variable of `model` (in place) with its sharding; returns `model`.

    All shardings are computed (and checked) before anything is moved, so an error leaves the model
    untouched. Shard before building a Decoder (it splits the params at construction)."""
    if model is None:
        return None
    shardings = param_shardings(model, mesh, rules, strict=strict)
    for path, var in _flat_vars(model):
        var.set_value(jax.device_put(var.get_value(), shardings[tuple(path)]))
    return model


# ---- caches ---------------------------------------------------------------------------------------
def _dim_axis(n: int, mesh: Mesh, axis: str = "tp") -> str | None:
    size = mesh.shape[axis]
    return axis if size > 1 and n % size == 0 else None


def cache_shardings(cache, cfg=None, mesh: Mesh | None = None, *, strict: bool = True):
    """A pytree of NamedSharding matching `cache`:

    LingCache: KDA state [B,H,K,V] and conv [B,ks-1,3,H,K] sharded on H over 'tp'; MLA latent and
    k_rope replicated (one latent shared by every head); pos replicated.
    DSparkCache: k/v [B,S,kv_heads,hd] sharded on kv_heads over 'tp' when divisible, else replicated;
    length replicated. `cfg` (LingConfig) is optional: when given, H is checked against it.
    Under strict=True a KDA head count not divisible by tp is a ShardingError (the matching params
    would have failed too); otherwise it is replicated."""
    from lingjax.cache import KDAState, LingCache, MLAState
    from lingjax.model.dspark import DSparkCache
    if mesh is None:
        raise TypeError("cache_shardings needs a mesh")
    rep = NamedSharding(mesh, P())

    def heads_axis(h, where):
        tp = mesh.shape["tp"]
        if tp > 1 and h % tp:
            if strict:
                raise ShardingError(f"heads={h} not divisible by tp={tp} ({where})")
            return None
        return "tp" if tp > 1 else None

    if isinstance(cache, LingCache):
        layers = []
        for i, layer in enumerate(cache.layers):
            if isinstance(layer, KDAState):
                h = layer.state.shape[1]
                if cfg is not None and h != cfg.num_attention_heads:
                    raise ShardingError(f"cache layer {i}: {h} heads, config has {cfg.num_attention_heads}")
                ax = heads_axis(h, f"cache.layers.{i}")
                layers.append(KDAState(NamedSharding(mesh, P(None, ax)),
                                       NamedSharding(mesh, P(None, None, None, ax))))
            elif isinstance(layer, MLAState):
                layers.append(MLAState(rep, rep))
            else:
                layers.append(jax.tree.map(lambda _: rep, layer))
        mtp = None if cache.mtp is None else MLAState(rep, rep)
        return LingCache(tuple(layers), mtp, rep)
    if isinstance(cache, DSparkCache):
        def kv(x):
            return NamedSharding(mesh, P(None, None, _dim_axis(x.shape[2], mesh)))
        return DSparkCache(tuple(kv(x) for x in cache.k), tuple(kv(x) for x in cache.v), rep)
    if cache is None:
        return None
    raise TypeError(f"cache_shardings: unknown cache type {type(cache).__name__}")


def shard_cache(cache, cfg=None, mesh: Mesh | None = None, *, strict: bool = True):
    """device_put a LingCache / DSparkCache with `cache_shardings`."""
    if cache is None:
        return None
    return jax.device_put(cache, cache_shardings(cache, cfg, mesh, strict=strict))


def state_shardings(state, mesh: Mesh, cfg=None, *, strict: bool = True):
    """Shardings for a pytree holding caches (e.g. spec_decode.DecodeState): every LingCache /
    DSparkCache subtree as `cache_shardings`, every other array replicated."""
    from lingjax.cache import LingCache
    from lingjax.model.dspark import DSparkCache

    def is_cache(x):
        return isinstance(x, (LingCache, DSparkCache))
    rep = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: cache_shardings(x, cfg, mesh, strict=strict) if is_cache(x) else rep,
                        state, is_leaf=is_cache)


def constrain_state(state, mesh: Mesh, cfg=None):
    """`state` with its shardings pinned to `state_shardings` (inside jit: a sharding constraint,
    so GSPMD cannot pick another layout for loop carries or outputs). Head counts tp does not
    divide are replicated, as `shard_model(strict=False)` leaves their params."""
    return jax.lax.with_sharding_constraint(state, state_shardings(state, mesh, cfg, strict=False))


def params_mesh(params) -> Mesh | None:
    """The mesh of a pytree of arrays sharded over more than one device (None if all sit on one
    device). Arrays on different meshes are an error."""
    meshes = {a.sharding.mesh for a in jax.tree.leaves(params)
              if isinstance(getattr(a, "sharding", None), NamedSharding) and a.sharding.mesh.size > 1}
    if len(meshes) > 1:
        raise ShardingError(f"parameters are sharded over {len(meshes)} different meshes; shard the target "
                            "and the draft with one mesh")
    return meshes.pop() if meshes else None


def describe(model, mesh: Mesh, rules=None) -> list[tuple[str, tuple, P]]:
    """(path, global shape, spec) of every variable: for logging / --mesh dry runs."""
    sh = param_shardings(model, mesh, rules)
    return [(_path_str(p), tuple(v.shape), sh[tuple(p)].spec) for p, v in _flat_vars(model)]


def random_init_sharded(build, mesh: Mesh, rules: Rules | None = None, *, seed: int = 0):
    """Build `build()` (a module constructor) with random weights created directly in their shards:
    no device ever holds a whole parameter, so models larger than one GPU can be benchmarked.

    Values are for benchmarks only (not the modules' own init): 1-D norm weights are ones,
    A_log / dt_bias / expert_bias zeros, other parameters normal with std fan_in^-1/2; block-fp8
    weights (lingjax.quant) get N(0, 1) values and a constant scale fan_in^-1/2.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    abstract = nnx.eval_shape(build)
    shardings = param_shardings(abstract, mesh, rules)
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    fns = {}
    for i, (path, var) in enumerate(sorted(flat.items(), key=lambda kv: _path_str(kv[0]))):
        shape, dtype, name = tuple(var.shape), jnp.dtype(var.dtype), str(path[-1])
        kind = ("zeros" if name in ("A_log", "dt_bias", "expert_bias")
                else "fp8_scale" if name == "scale_inv"
                else "ones" if len(shape) == 1 else "normal")
        key = (shape, dtype, kind, shardings[tuple(path)])
        if key not in fns:
            std = float(shape[0]) ** -0.5 if len(shape) > 1 else 1.0
            if kind == "fp8_scale":     # block-fp8 weight: values ~ N(0, 1), scale = fan_in^-1/2
                std = float(shape[-2] * 128) ** -0.5
            elif dtype.itemsize == 1:
                std = 1.0

            def make(k, shape=shape, dtype=dtype, kind=kind, std=std):
                if kind == "zeros":
                    return jnp.zeros(shape, dtype)
                if kind == "ones":
                    return jnp.ones(shape, dtype)
                if kind == "fp8_scale":
                    return jnp.full(shape, std, dtype)
                # bf16 randoms for 1-byte and 2-byte weights: halves the temporary of the largest
                # tensors (full-size experts: 4 GB, not 8), which matters when the model fills the GPU
                rnd_dtype = jnp.float32 if dtype.itemsize > 2 else jnp.bfloat16
                return (std * jax.random.normal(k, shape, rnd_dtype)).astype(dtype)
            fns[key] = jax.jit(make, out_shardings=shardings[tuple(path)])
        var.set_value(fns[key](jax.random.key(seed * 100003 + i)))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# ---- what a compiled program communicates -----------------------------------------------------------
COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_COLLECTIVE_RE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+(" + "|".join(COLLECTIVE_OPS)
                            + r")(?:-start)?\(")
_SHAPE_RE = re.compile(r"\b(pred|[a-z]+\d+(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')


class Collective(NamedTuple):
    kind: str       # one of COLLECTIVE_OPS (an async '-start' counts as its op; '-done' is not counted)
    op_name: str    # the op's jax name stack, e.g. 'jit(_run)/while/body/moe/dot_general'
    shape: str      # result shape(s) as printed, e.g. 'f32[1,1,128]{2,1,0}' or a tuple
    nbytes: int     # bytes of the printed result(s): an all-gather's gathered size; an async
    #                 '-start' may print its operand buffers in the result tuple too

    def scope(self, scopes) -> str | None:
        """The innermost component of op_name that is one of `scopes` (jax.named_scope names)."""
        hits = [p for p in self.op_name.split("/") if p in scopes]
        return hits[-1] if hits else None


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective op in an HLO module's text, e.g. `jitted.lower(*args).compile().as_text()`
    (after XLA's combiners: several reductions merged into one tuple all-reduce count once). An op
    inside a loop body is listed once, however many times the loop runs."""
    out = []
    for line in hlo_text.splitlines():
        m = _COLLECTIVE_RE.match(line)
        if m is None:
            continue
        shape, kind = m.group(1), m.group(2)
        nbytes = 0
        for dtype, dims in _SHAPE_RE.findall(shape):
            n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
            nbytes += n * _dtype_bytes(dtype)
        name = _OP_NAME_RE.search(line)
        out.append(Collective(kind, name.group(1) if name else "", shape, nbytes))
    return out


def _dtype_bytes(hlo_dtype: str) -> int:
    if hlo_dtype == "pred":
        return 1
    bits = re.match(r"[a-z]+(\d+)", hlo_dtype)
    return max(1, int(bits.group(1)) // 8) if bits else 0
