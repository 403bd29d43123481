"""Optional approximate speed modes (issue 11), all off by default.

`ApproxModes` is a frozen, hashable settings record given to `LingModel(..., approx=...)` (or set
on a loaded model with `lingjax.model.ling.set_approx`); with every mode off the model runs the
exact code path. Each mode trades accuracy for fewer bytes / cheaper ops; bench/approx_quality.py
measures the accuracy cost of each, bench/batch1.py --approx the speed.

  expert_keep=X      per token keep only the routed experts carrying the top X (0 < X < 1) of the
                     combine weight (heaviest first, at least one), renormalised like the router
                     (norm_topk_prob, then routed_scaling_factor); the shared expert always runs.
                     Shapes stay static: a dropped slot gets weight 0 and points at the token's
                     heaviest expert, so it reads no new expert (see lingjax/ops/moe.py).
  bf16_router_head   router logits + sigmoid and lm_head logits computed in bfloat16 (not fp32).
  bf16_kda_state     the KDA recurrent state is stored in bfloat16 between forwards (updated in
                     fp32, rounded when stored: per token in plain decoding, per committed block
                     in speculative decoding).
  fp8_mla_cache      the MLA latent cache is float8_e4m3fn with one float32 scale per token
                     (amax / 448); the rope key stays in the activation dtype.

Sampling shortcuts are not offered: only exact ones would be acceptable, and those need no flag.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

FP8_MAX = 448.0                   # largest finite float8_e4m3fn
FP8_DTYPE = jnp.float8_e4m3fn
_FLAGS = ("bf16_router_head", "bf16_kda_state", "fp8_mla_cache")


@dataclasses.dataclass(frozen=True)
class ApproxModes:
    expert_keep: float | None = None
    bf16_router_head: bool = False
    bf16_kda_state: bool = False
    fp8_mla_cache: bool = False

    def __post_init__(self):
        k = self.expert_keep
        if k is not None:
            if isinstance(k, bool) or not isinstance(k, (int, float)) or not 0.0 < float(k) < 1.0:
                raise ValueError(f"expert_keep must be a fraction 0 < X < 1 of the combine weight (e.g. 0.75), "
                                 f"got {k!r}; leave it None to run every routed expert")
            object.__setattr__(self, "expert_keep", float(k))
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def any(self) -> bool:
        """True when at least one mode is on."""
        return self != ApproxModes()

    @classmethod
    def parse(cls, text: str | None) -> ApproxModes:
        """'expert_keep=0.75,bf16_router_head,bf16_kda_state,fp8_mla_cache' (any subset, any order);
        '', 'none' or 'off' = every mode off."""
        if text is None or text.strip().lower() in ("", "none", "off"):
            return cls()
        kw: dict = {}
        for item in (t.strip() for t in text.split(",")):
            if not item:
                continue
            name, eq, value = item.partition("=")
            name = name.strip()
            if name in kw:
                raise ValueError(f"approx mode {name!r} given twice in {text!r}")
            if name == "expert_keep":
                try:
                    kw[name] = float(value)
                except ValueError:
                    raise ValueError(f"expert_keep needs a number, e.g. expert_keep=0.75; got {item!r}") from None
            elif name in _FLAGS and not eq:
                kw[name] = True
            else:
                raise ValueError(f"unknown approx mode {item!r}; expected a comma list of expert_keep=X, "
                                 f"{', '.join(_FLAGS)} (or 'none')")
        return cls(**kw)

    def describe(self) -> str:
        """The canonical text form (`parse(describe())` gives the same modes); 'none' when all off."""
        parts = [] if self.expert_keep is None else [f"expert_keep={self.expert_keep:g}"]
        parts += [n for n in _FLAGS if getattr(self, n)]
        return ",".join(parts) or "none"

    def kda_state_dtype(self, acc):
        """Storage dtype of the KDA recurrent state, given the accumulation dtype."""
        return jnp.bfloat16 if self.bf16_kda_state else acc


def quantize_fp8_per_token(x):
    """x [..., L] -> (float8_e4m3fn [..., L], float32 scale [...]) with x ~= q * scale (amax / 448)."""
    xf = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.abs(xf).max(-1) / FP8_MAX, jnp.finfo(jnp.float32).tiny)
    return (xf / scale[..., None]).astype(FP8_DTYPE), scale
