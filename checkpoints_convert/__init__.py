"""Hugging Face Ling-3.0 / DSpark checkpoints -> lingjax's converted format (see lingjax/checkpoint.py
for the layout on disk and the loader).

Modules: cli (arguments, exit codes), convert (orchestration), source (reading tensors), specs
(what each parameter is made of, with lingjax.param_layout), validate (pre-flight checks), build + fp8 (one parameter
in its stored dtype), chunks (chunk shapes: what a sharded restore reads), parts (orbax writes +
checksums), outdir (atomic publish, resume), progress.
"""
from checkpoints_convert.cli import main

__all__ = ["main"]
