"""Pallas Mosaic GPU kernels (one file per kernel family, each tested against its XLA reference in
`lingjax/ops/` in interpret mode and cross-lowered for CUDA in CI, then run on the H200).

- `kda_decode`: fused KDA recurrence for decode / verify blocks (T <= 16) and the commit replay;
  verified on the H200, opt-in in the model through `kda_kernel="pallas"` (XLA stays the default).
- `kda_prefill`: chunked KDA prefill; its first H200 run failed 2 of 4 checks (illegal
  instruction); the likely cause (a misaligned TMA start for beta) is fixed but not yet re-run on
  the H200 (bench/kda_prefill_debug.py); not wired into the model.
- `moe_experts`: routed experts for M = 1..16 tokens, fp8 weights dequantised on chip or bf16,
  each chosen expert read once; opt-in through `moe_kernel="pallas"`; not yet run on the H200.
- `skinny_gemm`: dense projections and lm_head for M = 1..16 tokens, bf16 or fp8; opt-in through
  `dense_kernel="pallas"`; not yet run on the H200.
"""
