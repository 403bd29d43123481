"""Bytes one batch-1 decode / speculative step must read, from a `LingConfig` (any depth) and a dtype.

    python -m bench.roofline [--layers N] [--spec none|mtp|dspark] [--block-size 8] [--context 9216]
                             [--dtype bf16|fp8|f32] [--bw-tbps 4.3]

The model mirrors lingjax's own parameter layout (lingjax/model/*.py) so a depth-reduced config
gives the bytes of the depth-reduced model. Counted per step:

  weights   every weight the step's kernels need, read once per pass that needs it (a pass that
            must wait for an earlier one, like each link of the MTP chain or each Markov step of the
            DSpark chain, reads its weights again). Routed experts: only the distinct experts
            touched by the step's T tokens (`experts_per_layer`; default the uniform-routing
            expectation E * (1 - (1 - k/E)^T)). Embedding: only the T gathered rows.
  state     KDA recurrent state (acc dtype) and conv window: read + write for a plain decode
            step; read (verify, pending) + read + write (commit replay) for a speculative step.
  kv        MLA latent + rope key of the valid context (read) and the T new rows (write); the
            DSpark draft's context K/V likewise; the MTP layer's own MLA cache.

Not counted: activations (hidden states, logits: small at batch 1), the padded part of the
static-size caches past the valid context (the real kernels may read it; the roofline does not).
fp8 = weight-only fp8 (1 byte + one fp32 scale per 128x128 block) for the matrices that a
fp8 checkpoint quantises; embed, lm_head, router, norms and the draft stay in the activation dtype,
and so do the per-head gates w_beta / g_proj, which an fp8 model holds dequantised
(lingjax.param_layout.LING_DEQUANTISED_AT_LOAD). MLA's kv_b, held dequantised too since session
25, is counted at fp8 (4.2 MB a layer at the Ling shape): the bytes the step must read, which the
bf16 copy exceeds by choice.
"""
from __future__ import annotations

import argparse
import dataclasses

from lingjax.config import LingConfig
from lingjax.dspark_config import DRAFT_DTYPES

DTYPE_BYTES = {"bf16": 2.0, "bfloat16": 2.0, "f32": 4.0, "float32": 4.0, "f64": 8.0, "float64": 8.0,
               "fp8": 1.0 + 4.0 / (128 * 128)}


def expected_distinct(tokens: float, k: int, e: int) -> float:
    """Expected distinct experts hit by `tokens` tokens, each choosing k of e uniformly at random."""
    return e * (1.0 - (1.0 - k / e) ** tokens)


def _dtypes(dtype: str) -> tuple[float, float, float]:
    """(matrix weight bytes, activation/other bytes, acc bytes) for a dtype name."""
    name = str(dtype)
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    wb = DTYPE_BYTES[name]
    act = 2.0 if name == "fp8" else wb
    acc = max(4.0, act)
    return wb, act, acc


# ---- parameter element counts, mirroring lingjax/model ----------------------------------------
def kda_attn_params(cfg: LingConfig) -> tuple[int, int, int]:
    """(matrix elements, small elements in model dtype, elements in acc dtype) of one KDA block
    (w_beta counts as small: an fp8 model holds it dequantised, param_layout.LING_DEQUANTISED_AT_LOAD)."""
    d, h, k, ks = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.short_conv_kernel_size
    mats = d * 5 * h * k + h * k * d                      # w_in (q,k,v,f,g), w_out
    small = d * h + ks * 3 * h * k + k                    # w_beta, conv, o_norm
    acc = h + h * k                                       # A_log, dt_bias
    return mats, small, acc


def mla_attn_params(cfg: LingConfig) -> tuple[int, int, int]:
    """(matrix elements, g_proj's elements, small elements) of one gated-MLA block (g_proj apart: an
    fp8 model holds it dequantised, param_layout.LING_DEQUANTISED_AT_LOAD)."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    nope, rope, vd, lat = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank:
        q, small = d * cfg.q_lora_rank + cfg.q_lora_rank * h * (nope + rope), cfg.q_lora_rank
    else:
        q, small = d * h * (nope + rope), 0
    mats = q + d * (lat + rope) + lat * h * (nope + vd) + h * vd * d   # q, kv_a, kv_b, dense
    return mats, d * h, small + lat                       # g_proj; + kv_a_norm


def expert_params(cfg: LingConfig) -> int:
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size


def param_count(cfg: LingConfig, with_mtp: bool = False) -> int:
    """Total parameter elements of LingModel(cfg) (all experts, full embedding): a cross-check."""
    d = cfg.hidden_size
    n = 2 * cfg.vocab_size * d + d                        # embed, lm_head, final norm
    layers = list(range(cfg.num_hidden_layers)) + ([cfg.num_hidden_layers] if with_mtp else [])
    for i in layers:
        mla = i == cfg.num_hidden_layers or cfg.is_mla_layer(i)
        n += sum(mla_attn_params(cfg)) if mla else sum(kda_attn_params(cfg))
        n += 2 * d
        if cfg.is_moe_layer(i):
            n += d * cfg.num_experts + cfg.num_experts + cfg.num_experts * expert_params(cfg)
            n += 3 * d * cfg.shared_intermediate_size
        else:
            n += 3 * d * cfg.intermediate_size
    if with_mtp:
        n += 2 * d * d + 3 * d                            # eh_proj, enorm, hnorm, final_norm
    return n


# ---- passes -----------------------------------------------------------------------------------
@dataclasses.dataclass
class StepBytes:
    weights: float = 0.0
    state: float = 0.0
    kv: float = 0.0
    draft: float = 0.0          # DSpark draft weights + its context K/V (MTP is counted in weights/kv)
    experts_per_layer: float = 0.0
    tokens: int = 1             # verify width T (anchor + drafts)

    @property
    def total(self) -> float:
        return self.weights + self.state + self.kv + self.draft

    def as_dict(self) -> dict:
        return {"total": self.total, "weights": self.weights, "state": self.state, "kv": self.kv,
                "draft": self.draft, "experts_per_layer": self.experts_per_layer, "tokens": self.tokens}


def _moe_block(cfg: LingConfig, experts: float, wb: float, act: float, acc: float) -> float:
    d = cfg.hidden_size
    return (experts * expert_params(cfg) + 3 * d * cfg.shared_intermediate_size) * wb \
        + d * cfg.num_experts * act + cfg.num_experts * acc


def _layer_block(cfg: LingConfig, i: int, T: int, context: int, experts: float, wb, act, acc,
                 speculative: bool, mla: bool) -> tuple[float, float, float]:
    """(weights, state, kv) bytes of decoder layer i on T tokens at `context` cached positions."""
    d = cfg.hidden_size
    w = 2 * d * act                                       # input / post norms
    state = kv = 0.0
    if mla:
        mats, dequantised, small = mla_attn_params(cfg)
        w += mats * wb + (dequantised + small) * act
        row = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * act
        kv += context * row + T * row
    else:
        mats, small, accn = kda_attn_params(cfg)
        w += mats * wb + small * act + accn * acc
        h, k = cfg.num_attention_heads, cfg.head_dim
        s = h * k * k * acc
        conv = (cfg.short_conv_kernel_size - 1) * 3 * h * k * act
        state += (3 if speculative else 2) * (s + conv)
    if cfg.is_moe_layer(i):
        w += _moe_block(cfg, experts, wb, act, acc)
    else:
        w += 3 * d * cfg.intermediate_size * wb
    return w, state, kv


def target_pass(cfg: LingConfig, T: int, context: int, dtype: str = "bf16", *, logits_passes: int = 1,
                experts_per_layer: float | None = None, speculative: bool = False) -> StepBytes:
    """One target forward over T tokens after `context` committed positions."""
    wb, act, acc = _dtypes(dtype)
    ex = experts_per_layer if experts_per_layer is not None else \
        expected_distinct(T, cfg.num_experts_per_tok, cfg.num_experts)
    d = cfg.hidden_size
    out = StepBytes(experts_per_layer=ex, tokens=T)
    out.weights += T * d * act + d * act + logits_passes * d * cfg.vocab_size * act   # embed rows, norm, lm_head
    for i in range(cfg.num_hidden_layers):
        w, s, kv = _layer_block(cfg, i, T, context, ex, wb, act, acc, speculative, cfg.is_mla_layer(i))
        out.weights += w
        out.state += s
        out.kv += kv
    return out


def mtp_pass(cfg: LingConfig, T: int, context: int, dtype: str = "bf16",
             experts_per_layer: float | None = None) -> tuple[float, float]:
    """(weights, kv) of one MTP (NEXTN) layer pass over T tokens (no lm_head)."""
    wb, act, acc = _dtypes(dtype)
    ex = experts_per_layer if experts_per_layer is not None else \
        expected_distinct(T, cfg.num_experts_per_tok, cfg.num_experts)
    d = cfg.hidden_size
    w, _, kv = _layer_block(cfg, cfg.num_hidden_layers, T, context, ex, wb, act, acc, False, True)
    return w + (2 * d * d) * wb + 3 * d * act + T * d * act, kv


def dspark_draft_bytes(dcfg, block: int, context: int, append_rows: int, dtype: str = "bf16",
                       proj_dtype: str | None = None) -> float:
    """One DSpark draft step: forward_block on `block` positions over `context` cached positions,
    the greedy Markov chain (markov_w2 read once per chain link), the draft's lm_head pass (the
    target's lm_head) and append_context of `append_rows` committed rows (fc + k/v projections).
    proj_dtype: the dtype of the projections lingjax.model.dspark.quantize_draft can hold in fp8
    (fc, q / k / v / o, the MLP, markov_w2); default `dtype`. Everything else (norms, lm_head,
    embedding and markov_w1 rows, the context K/V) is in `dtype`."""
    _, act, _ = _dtypes(dtype)
    wp = act if proj_dtype in (None, dtype) else _dtypes(proj_dtype)[0]
    d, h, kvh, hd, f = (dcfg.hidden_size, dcfg.num_attention_heads, dcfg.num_key_value_heads,
                        dcfg.head_dim, dcfg.intermediate_size)
    L = dcfg.num_hidden_layers
    proj = L * (d * h * hd + 2 * d * kvh * hd + h * hd * d + 3 * d * f)  # q, k, v, o, gate / up / down
    other = L * (2 * hd + 2 * d) + d                                   # q/k norms, layer norms, final norm
    other += block * d + d * dcfg.vocab_size                           # embed rows, lm_head (base logits)
    if dcfg.markov_rank:
        other += block * dcfg.markov_rank
        proj += block * dcfg.markov_rank * dcfg.vocab_size
    if dcfg.enable_confidence_head:
        other += dcfg.confidence_in_dim + 1
    # append_context: fc, hidden_norm, per layer k/v projections + k_norm
    proj += dcfg.tap_dim * d + L * 2 * d * kvh * hd
    other += d + L * hd
    kv_row = 2 * kvh * hd                                              # K and V
    kv = L * kv_row * (context + append_rows)
    return proj * wp + (other + kv) * act


def step_bytes(cfg: LingConfig, dtype: str = "bf16", method: str = "none", block: int = 8, context: int = 0,
               dcfg=None, experts_per_layer: float | None = None, draft_dtype: str = "bf16") -> StepBytes:
    """Bytes of one step of lingjax's decode loop at batch 1 ('none': one token; 'mtp' / 'dspark':
    draft + verify of block+1 tokens + commit). draft_dtype 'fp8': the draft's projections in block
    fp8 (quantize_draft)."""
    if method == "none":
        return target_pass(cfg, 1, context, dtype, experts_per_layer=experts_per_layer)
    T = block + 1
    out = target_pass(cfg, T, context, dtype, experts_per_layer=experts_per_layer, speculative=True)
    if method == "mtp":
        # chain: first draft from the MTP hidden (lm_head), then block-1 links of (MTP layer T=1 + lm_head);
        # after verify: one MTP pass over the T committed-or-verified tokens.
        _, act, _ = _dtypes(dtype)
        lm = cfg.hidden_size * cfg.vocab_size * act
        w1, kv1 = mtp_pass(cfg, 1, context, dtype)
        wT, kvT = mtp_pass(cfg, T, context, dtype, experts_per_layer)
        out.weights += block * lm + (block - 1) * w1 + wT
        out.kv += (block - 1) * kv1 + kvT
    elif method == "dspark":
        if dcfg is None:
            raise ValueError("method 'dspark' needs the draft config (dcfg)")
        out.draft = dspark_draft_bytes(dcfg, block, context, T, dtype if dtype != "fp8" else "bf16",
                                       proj_dtype=None if draft_dtype == "bf16" else draft_dtype)
    else:
        raise ValueError(f"unknown method {method!r}")
    return out


def main(argv=None):
    from lingjax.config import preset
    from lingjax.dspark_config import dspark_for_ling3_flash
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--spec", choices=["none", "mtp", "dspark"], default="dspark")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--context", type=int, default=8192 + 512)
    ap.add_argument("--dtype", choices=["bf16", "fp8", "f32"], default="bf16")
    ap.add_argument("--draft-dtype", choices=DRAFT_DTYPES, default="bf16",
                    help="the DSpark draft's projections (fp8: lingjax.model.dspark.quantize_draft)")
    ap.add_argument("--bw-tbps", type=float, default=4.3)
    a = ap.parse_args(argv)
    cfg = preset("ling3-flash")
    if a.layers:
        cfg = cfg.replace(num_hidden_layers=a.layers)
    dcfg = dspark_for_ling3_flash().replace(block_size=a.block_size)
    for method in ("none", a.spec) if a.spec != "none" else ("none",):
        sb = step_bytes(cfg, a.dtype, method, a.block_size, a.context, dcfg, draft_dtype=a.draft_dtype)
        ms = sb.total / (a.bw_tbps * 1e12) * 1e3
        print(f"{method:6s} T={sb.tokens:2d}: weights {sb.weights/1e9:6.2f} GB  state {sb.state/1e6:6.1f} MB  "
              f"kv {sb.kv/1e6:6.1f} MB  draft {sb.draft/1e9:5.2f} GB  experts/layer {sb.experts_per_layer:5.1f}"
              f"  total {sb.total/1e9:6.2f} GB -> {ms:6.3f} ms/step at {a.bw_tbps:.1f} TB/s")


if __name__ == "__main__":
    main()
