"""Pallas Mosaic GPU kernels (one file per kernel family, each beside its XLA reference in
`lingjax/ops/`, each runnable in interpret mode and cross-lowered for CUDA in CI).

Empty so far: the KDA kernels and the weights-streaming MoE / skinny-GEMM kernels are the next
issues; the model runs on the pure-XLA references in `lingjax/ops/` until they land.
"""
