"""Pallas Mosaic GPU kernels (one file per kernel family, each tested against its XLA reference in
`lingjax/ops/` in interpret mode and cross-lowered for CUDA in CI, then run on the H200).

- `kda_decode`: fused KDA recurrence for decode / verify blocks (T <= 16) and the commit replay;
  verified on the H200, opt-in in the model through `kda_kernel="pallas"` (XLA stays the default).
- `kda_prefill`: chunked KDA prefill; fails 2 of its 4 H200 tests, not wired into the model.
- `moe_experts`: routed experts for M = 1..16 tokens, fp8 weights dequantised on chip, each chosen
  expert read once; interpret / cross-lowering tested only (not yet run on the H200), not wired in.
"""
