"""Shared test setup: float64 available everywhere (tests pass explicit dtypes), golden paths, and
compiled executables released after every test module."""
import gc
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's CPU thread pool: at least 8 threads (XLA reads NPROC; default one per core). Mosaic GPU
# interpret mode runs each warpgroup of a kernel that has several (kda_step_fused.PREP_WARPGROUPS)
# as a computation of its own that blocks in barrier-wait callbacks; on a 2-core host the third
# warpgroup never got a thread and the test hung (session 35).
os.environ.setdefault("NPROC", str(max(8, os.cpu_count() or 1)))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", True)
# float32 tests mean float32: no TF32 matmuls on GPU (the H200 default for f32 dots).
jax.config.update("jax_default_matmul_precision", "highest")

DATA = Path(__file__).parent / "data"
LING_TINY = DATA / "ling3-tiny"
DSPARK_TINY = DATA / "dspark-tiny"


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_executables():
    """XLA's CPU backend maps each compiled executable's code into memory regions of its own. One
    pytest process that keeps every executable of the suite alive (jit caches, cached models)
    gains hundreds of mappings per test (24,000 after the first 40 tests, measured) towards the
    kernel's limit of 65,530 (vm.max_map_count); CI's run segfaulted inside XLA's CPU compiler
    ~450 tests in, twice at the same test. Dropping jax's caches after each module keeps the
    count at what one module needs."""
    yield
    jax.clear_caches()
    gc.collect()
