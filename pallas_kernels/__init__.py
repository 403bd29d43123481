"""Pallas Mosaic GPU kernels (one file per kernel family, each tested against its XLA reference in
`lingjax/ops/` in interpret mode and cross-lowered for CUDA in CI, then run on the H200). All are
opt-in in the model (XLA stays the default) and run on the H200 (jax 0.11.2); docs/PERFORMANCE.md
has their measured times.

- `kda_step_fused`: a KDA layer's decode / verify / commit step for T <= 16 tokens in one launch
  (short conv, SiLU, L2 norms, gate, the recurrence); `kda_kernel="pallas"`.
- `kda_prefill`: chunked KDA prefill for bf16 / fp8 models with the safe gate; `kda_kernel="pallas"`.
- `moe_experts`: routed (+ shared) experts for M = 1..16 tokens, fp8 weights dequantised on chip or
  bf16, each chosen expert read once; `moe_kernel="pallas"`.
- `skinny_gemm`: dense projections and lm_head for M = 1..16 tokens, bf16 or fp8; `dense_kernel="pallas"`.
"""
