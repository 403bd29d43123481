"""Shared test setup: float64 available everywhere (tests pass explicit dtypes), golden paths."""
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
# float32 tests mean float32: no TF32 matmuls on GPU (the H200 default for f32 dots).
jax.config.update("jax_default_matmul_precision", "highest")

DATA = Path(__file__).parent / "data"
LING_TINY = DATA / "ling3-tiny"
DSPARK_TINY = DATA / "dspark-tiny"
