"""The model's kernel switches, and the draft's weight format, as command-line flags (no jax
import: the CLIs add these before lingjax.xla_env has set XLA's flags and jax starts).
lingjax.model.kernels runs the switches."""
from __future__ import annotations

from lingjax.dspark_config import DRAFT_DTYPES


# The model's kernel switches: (flag / attribute name, what the Pallas kernel covers, splits over a mesh).
SWITCHES = (
    ("kda_kernel", "KDA recurrence of decode / verify / commit and (bf16 models) prefill: XLA, or the "
                   "Pallas kernels", True),
    ("moe_kernel", "routed experts of decode / verify calls (<= 16 tokens): XLA, or the Pallas expert "
                   "kernel (bf16 or fp8 expert weights)", False),
    ("dense_kernel", "dense projections and lm_head of decode / verify calls (<= 16 tokens): XLA, or the "
                     "Pallas skinny GEMM (bf16 or fp8 weights)", False),
    ("mla_kernel", "absorbed MLA attention of decode / verify calls (<= 16 tokens) over the latent cache: "
                   "XLA, or the Pallas flash-decoding kernel (bf16 latent cache: no fp8_mla_cache)", False),
)


def add_kernel_args(ap) -> None:
    """--kda-kernel / --moe-kernel / --dense-kernel / --mla-kernel on an argparse parser (CLI, server, benchmark)."""
    for name, what, on_mesh in SWITCHES:
        ap.add_argument("--" + name.replace("_", "-"), choices=["xla", "pallas"], default="xla",
                        help=f"{what}; 'pallas' needs an NVIDIA Hopper GPU"
                             + ("" if on_mesh else " and no --mesh"))


def add_draft_dtype_arg(ap) -> None:
    """--draft-dtype on an argparse parser (CLI, server, benchmark): lingjax.model.dspark.quantize_draft."""
    ap.add_argument("--draft-dtype", choices=DRAFT_DTYPES, default="bf16",
                    help="the DSpark draft's projections: bf16 as loaded, or fp8 = block fp8 (half their bytes "
                         "per step; the output stays the target's, which verifies every draft; only the "
                         "acceptance can change)")
