"""The conversion: read config + headers, validate, then stream parameter by parameter into parts
under OUT_DIR.partial, write the manifest and publish OUT_DIR atomically."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import orbax.checkpoint

from checkpoints_convert import chunks
from checkpoints_convert.build import build_param, plan_param, stored_chunks, stored_nbytes
from checkpoints_convert.outdir import OutDir, sizes, write_json
from checkpoints_convert.parts import plan_parts, save_part
from checkpoints_convert.progress import Progress, human_bytes
from checkpoints_convert.source import SourceReader
from checkpoints_convert.specs import draft_specs, ling_specs
from checkpoints_convert.validate import validate
from lingjax.checkpoint import FORMAT, FORMAT_VERSION, MANIFEST, PARAMS_DIR, hash_dir, hash_file
from lingjax.config import LING3_ARCHITECTURE, ConfigError, LingConfig
from lingjax.dspark_config import DSparkConfig

COPIED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                "generation_config.json", "special_tokens_map.json")
DRAFT_IGNORED = ("embed_tokens.weight", "lm_head.weight", "word_embeddings.weight")


class ConversionError(ValueError):
    """Bad input or unusable output; `details` lists individual problems."""

    def __init__(self, message: str, details: list[str] | None = None):
        super().__init__(message)
        self.details = details or []


@dataclasses.dataclass
class Options:
    hf_dir: Path
    out_dir: Path
    dtype: str = "bfloat16"                 # float32 | bfloat16 | fp8 | keep
    fp8_block: tuple[int, int] | None = None   # None: config quantization_config.weight_block_size, else 128
    draft: bool = False
    mtp: bool = True
    force: bool = False
    verify: bool = False
    part_bytes: int = 1 << 30
    chunk_bytes: int = 64 << 20
    progress: bool = True
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr)


@dataclasses.dataclass
class Input:
    kind: str
    config: dict
    reader: SourceReader
    specs: list
    with_mtp: bool
    ignore: Callable[[str], bool]
    fp8_block: tuple[int, int]


def open_source(opts: Options) -> Input:
    hf = Path(opts.hf_dir)
    if not hf.is_dir():
        raise ConversionError(f"{hf} is not a directory")
    if not (hf / "config.json").is_file():
        raise ConversionError(f"{hf} has no config.json")
    try:
        raw = json.loads((hf / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ConversionError(f"{hf / 'config.json'} is not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ConversionError(f"{hf / 'config.json'} is not a JSON object")
    block = opts.fp8_block or fp8_block_of(raw)
    if opts.draft:
        if LING3_ARCHITECTURE in (raw.get("architectures") or []):
            raise ConversionError(f"{hf} is a Ling-3.0 target checkpoint, not a DSpark draft: drop --draft")
        cfg = DSparkConfig.from_dict(raw)
        reader = SourceReader(hf, model_prefix_optional=True)
        return Input("dspark", raw, reader, draft_specs(cfg), False, lambda n: n.endswith(DRAFT_IGNORED),
                     block)
    try:
        cfg = LingConfig.from_dict(raw)
    except ConfigError as e:
        if "block_size" in raw or "dspark_config" in raw or "target_layer_ids" in raw:
            raise ConfigError(f"{e} (this looks like a DSpark draft: pass --draft)") from e
        raise
    reader = SourceReader(hf)
    n = cfg.num_hidden_layers
    with_mtp = opts.mtp and cfg.num_nextn_predict_layers > 0 and f"model.layers.{n}.eh_proj.weight" in reader
    if opts.mtp and cfg.num_nextn_predict_layers > 0 and not with_mtp:
        opts.log(f"note: config declares an MTP layer but model.layers.{n}.eh_proj.weight is absent; "
                 "converting without the MTP layer")
    mtp_prefix = f"model.layers.{n}."
    ignore = (lambda name: False) if with_mtp else (lambda name: name.startswith(mtp_prefix))
    return Input("ling", raw, reader, ling_specs(cfg, with_mtp), with_mtp, ignore, block)


def fp8_block_of(config: dict) -> tuple[int, int]:
    """The published fp8 block size: `quantization_config.weight_block_size`, default 128x128."""
    block = (config.get("quantization_config") or {}).get("weight_block_size") or (128, 128)
    return int(block[0]), int(block[1])


def _fingerprint(opts: Options, src: Input) -> tuple[str, dict]:
    info = {"path": str(Path(opts.hf_dir).absolute()),
            "config_sha256": hashlib.sha256((Path(opts.hf_dir) / "config.json").read_bytes()).hexdigest(),
            "files": {n: (src.reader.dir / n).stat().st_size for n in src.reader.shard_files()}}
    key = {"format_version": FORMAT_VERSION, "kind": src.kind, "dtype": opts.dtype, "fp8_block": list(src.fp8_block),
           "with_mtp": src.with_mtp, "part_bytes": opts.part_bytes, "chunk_bytes": opts.chunk_bytes,
           "config_sha256": info["config_sha256"], "files": info["files"]}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest(), info


def convert(opts: Options) -> str:
    """Run one conversion. Returns 'converted' or 'up-to-date'; raises on failure."""
    src = open_source(opts)
    try:
        return _convert(opts, src)
    finally:
        src.reader.close()


def _convert(opts: Options, src: Input) -> str:
    check = validate(src.reader, src.specs, src.fp8_block, src.ignore)
    if check.problems:
        raise ConversionError(f"{opts.hf_dir}: {len(check.problems)} problem(s) with the checkpoint's tensors",
                              check.problems)
    if check.unexpected:
        shown = ", ".join(check.unexpected[:20]) + (" ..." if len(check.unexpected) > 20 else "")
        opts.log(f"warning: {len(check.unexpected)} unexpected tensor(s) not converted: {shown}")
    metas = {s.path: plan_param(s, [src.reader.dtype(x.name) for x in check.sources[s.path]], opts.dtype,
                                src.fp8_block) for s in src.specs}
    parts = plan_parts(src.specs, {p: stored_nbytes(m) for p, m in metas.items()}, opts.part_bytes)
    fingerprint, source_info = _fingerprint(opts, src)

    out = OutDir(opts.out_dir)
    if _already_done(opts, out, fingerprint):
        return "up-to-date"
    done = out.open_partial(fingerprint, opts.log)
    progress = _write_parts(opts, src, check, metas, parts, out, fingerprint, done)

    files = {}
    for name in COPIED_FILES:
        if (Path(opts.hf_dir) / name).is_file():
            shutil.copyfile(Path(opts.hf_dir) / name, out.partial / name)
            files[name] = hash_file(out.partial / name)[0]
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kind": src.kind, "dtype": opts.dtype,
        "default_dtype": _default_dtype(opts.dtype, src.specs, metas), "fp8_block": list(src.fp8_block),
        "with_mtp": src.with_mtp, "fingerprint": fingerprint, "source": source_info,
        "converter": {"orbax_checkpoint": orbax.checkpoint.__version__, "part_bytes": opts.part_bytes,
                      "chunk_bytes": opts.chunk_bytes, "chunk_rule": chunks.RULE},
        "params": {s.key: {**metas[s.path], "part": p.name} for p in parts for s in p.specs},
        "parts": {p.name: done[p.name] for p in parts}, "files": files,
    }
    _verify_partial(out, manifest, full=opts.verify)
    write_json(out.partial / MANIFEST, manifest)
    out.publish(replace_existing=opts.force)
    opts.log(progress.summary(sum(r["bytes"] for r in manifest["parts"].values()), out.out))
    return "converted"


def _already_done(opts: Options, out: OutDir, fingerprint: str) -> bool:
    """True when OUT_DIR already holds this conversion intact; raises when OUT_DIR may not be used."""
    hf = Path(opts.hf_dir).absolute()
    if out.out == hf or hf.is_relative_to(out.out) or out.out.is_relative_to(hf):
        raise ConversionError(f"OUT_DIR {out.out} must lie outside the source checkpoint {hf} (and vice versa)")
    existing = out.existing()
    if existing is None:
        return False
    if existing.get("fingerprint") == fingerprint:
        problems = out.check_complete(existing, full=opts.verify)
        if not problems:
            opts.log(f"{out.out} already holds this conversion, complete"
                     + (" (checksums verified)" if opts.verify else "") + "; nothing to do")
            return True
        if not opts.force:
            raise ConversionError(f"{out.out} holds this conversion but it is damaged; pass --force to rewrite it",
                                  problems)
    elif not opts.force:
        raise ConversionError(f"{out.out} already holds a different converted checkpoint (from "
                              f"{existing.get('source', {}).get('path')}, dtype {existing.get('dtype')}); "
                              "choose another OUT_DIR or pass --force to replace it")
    return False


def _write_parts(opts, src: Input, check, metas, parts, out: OutDir, fingerprint: str, done: dict) -> Progress:
    """Build and save every part not already done, one parameter at a time; records each in `done`."""
    todo = [p for p in parts if p.name not in done]
    need, free = sum(p.nbytes for p in todo), shutil.disk_usage(out.partial).free
    if need > free:
        raise ConversionError(f"not enough free space for {out.partial}: about {human_bytes(need)} needed, "
                              f"{human_bytes(free)} free")
    n_src = {s.path: sum(1 + (x.scale is not None) for x in check.sources[s.path]) for s in src.specs}
    b_src = {s.path: sum(x.nbytes for x in check.sources[s.path]) for s in src.specs}
    skipped = [s.path for p in parts if p.name in done for s in p.specs]
    progress = Progress(sum(b_src.values()), sum(n_src.values()), enabled=opts.progress,
                        done_bytes=sum(b_src[p] for p in skipped), done_tensors=sum(n_src[p] for p in skipped))
    try:
        for part in todo:
            arrays, chunk_shapes = {}, {}
            for spec in part.specs:
                arrays.update(build_param(spec, check.sources[spec.path], src.reader, metas[spec.path],
                                          src.fp8_block))
                chunk_shapes.update(stored_chunks(spec, metas[spec.path], opts.chunk_bytes))
                progress.advance(b_src[spec.path], n_src[spec.path])
            done[part.name] = save_part(out.params / part.name, arrays, chunk_shapes)
            del arrays
            out.save_progress(fingerprint, done)
    finally:
        progress.close()
    return progress


def _default_dtype(mode: str, specs, metas) -> str:
    if mode == "float32":
        return "float32"
    narrow = {metas[s.path]["dtype"] for s in specs if not s.wide}
    return "float32" if mode == "keep" and narrow <= {"float32", "float64"} else "bfloat16"


def _verify_partial(out: OutDir, manifest: dict, full: bool) -> None:
    """Every part listed and on disk with the file count and size it was checksummed with (full:
    re-hashed), and nothing else under params/."""
    bad = []
    for name, rec in manifest["parts"].items():
        d = out.params / name
        if not d.is_dir():
            bad.append(f"part {name} is missing from {out.partial}")
            continue
        got = hash_dir(d) if full else sizes(d)
        if any(got[k] != rec[k] for k in got):
            bad.append(f"part {name} in {out.partial} does not match its checksum record")
    extra = {d.name for d in out.params.iterdir()} - set(manifest["parts"])
    bad += [f"stray entry {PARAMS_DIR}/{name} in {out.partial}" for name in sorted(extra)]
    if bad:
        raise ConversionError(f"verification of {out.partial} failed", bad)
