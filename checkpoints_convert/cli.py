"""Command line: `python -m checkpoints_convert HF_DIR OUT_DIR [options]`.

Exit codes: 0 done (or already complete), 1 bad input / failed conversion, 2 bad usage,
130 interrupted (rerun the same command to resume). Errors are one `error: ...` line on stderr
(followed by one indented line per problem when there are several); no tracebacks unless --debug.
"""
from __future__ import annotations

import argparse
import errno
import sys
from pathlib import Path

DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp8": "fp8", "keep": "keep",
                 "float32": "float32", "fp32": "float32"}


def _block(text: str) -> tuple[int, int]:
    try:
        parts = [int(x) for x in text.replace("x", ",").split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid block size {text!r} (use N or NxM)") from None
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"invalid block size {text!r} (use N or NxM, positive)")
    return parts[0], parts[1]


def _mib(text: str) -> int:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (MiB)") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return int(v * (1 << 20))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m checkpoints_convert",
        description="Convert a Hugging Face Ling-3.0 checkpoint (or, with --draft, a DSpark draft) into "
                    "lingjax's sharded orbax format, streaming one parameter at a time. Output appears "
                    "atomically; an interrupted run resumes where it stopped.")
    p.add_argument("hf_dir", metavar="HF_DIR", type=Path, help="directory with config.json and "
                   "model.safetensors.index.json + shards (or one model.safetensors)")
    p.add_argument("out_dir", metavar="OUT_DIR", type=Path, help="output directory (written via OUT_DIR.partial)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_ALIASES), help="storage dtype: bf16 "
                   "(default), fp8 (block fp8 linear weights + float32 scales), keep (source dtypes; fp8 "
                   "sources stay fp8), float32")
    p.add_argument("--fp8-block", type=_block, default=None, metavar="N[xM]",
                   help="fp8 block size [out x in] of the source scales and of quantisation (default: the "
                   "config's quantization_config.weight_block_size, else 128)")
    p.add_argument("--draft", action="store_true", help="the source is a DSpark draft checkpoint")
    p.add_argument("--no-mtp", dest="mtp", action="store_false", help="leave out the MTP (NEXTN) layer")
    p.add_argument("--force", action="store_true", help="replace an OUT_DIR holding a different conversion")
    p.add_argument("--verify", action="store_true", help="re-hash every written part against its checksum "
                   "before publishing (and every file when OUT_DIR already holds this conversion)")
    p.add_argument("--part-size", type=_mib, default=1 << 30, metavar="MIB",
                   help="max MiB per part (a unit of writing and resuming; default 1024)")
    p.add_argument("--chunk-size", type=_mib, default=64 << 20, metavar="MIB",
                   help="max MiB per stored chunk (default 64). Sharded reads fetch whole chunks; axes the "
                   "partition rules may shard are also cut into up to 8 equal slabs so that each device reads "
                   "only its shard (checkpoints_convert/chunks.py)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:              # argparse: --help (0) or bad usage (2)
        return int(e.code or 0)
    from checkpoints_convert.convert import ConversionError, Options, convert
    opts = Options(args.hf_dir, args.out_dir, dtype=DTYPE_ALIASES[args.dtype], fp8_block=args.fp8_block,
                   draft=args.draft, mtp=args.mtp, force=args.force, verify=args.verify,
                   part_bytes=args.part_size, chunk_bytes=args.chunk_size, progress=not args.quiet)
    try:
        convert(opts)
        return 0
    except KeyboardInterrupt:
        _err(f"interrupted; rerun the same command to resume from {args.out_dir}.partial", prefix="")
        return 130
    except Exception as e:
        if args.debug:
            raise
        _err(_message(e), getattr(e, "details", None) if isinstance(e, ConversionError) else None)
        return 1


def _message(e: Exception) -> str:
    from lingjax.checkpoint import ConvertedCheckpointError
    from lingjax.config import ConfigError
    from lingjax.dspark_config import DSparkConfigError
    from lingjax.safetensors_io import CheckpointError
    if isinstance(e, OSError):
        where = f" ({e.filename})" if e.filename else ""
        if e.errno == errno.ENOSPC:
            return (f"no space left on device{where}; free some space and rerun the same command "
                    "(finished parts are kept)")
        return f"{e.strerror or e}{where}"
    if isinstance(e, (ValueError, ConfigError, DSparkConfigError, CheckpointError, ConvertedCheckpointError)):
        return str(e)                     # ConversionError / OutputError and the config errors are ValueErrors
    return f"internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)"


def _err(msg: str, details=None, prefix: str = "error: ") -> None:
    print(prefix + msg, file=sys.stderr)
    for d in details or []:
        print(f"  - {d}", file=sys.stderr)
