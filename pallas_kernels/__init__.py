"""Pallas Mosaic GPU kernels (one file per kernel family, each tested against its XLA reference in
`lingjax/ops/` in interpret mode and cross-lowered for CUDA in CI).

So far: `kda_decode` (fused KDA recurrence for decode / verify blocks), not yet run on the H200 and
opt-in in the model through kda_kernel="pallas"; the model runs on the pure-XLA references until the kernels land.
"""
