"""Peak host memory and throughput of `python -m checkpoints_convert` on a synthetic checkpoint.

Builds a multi-shard bf16 checkpoint with Ling-3.0-flash's real widths (hidden 2560, vocab 157184,
KDA 32x128, MLA, 768-wide experts) but few layers and experts (default 8 layers, 32 experts:
~5 GB), written shard by shard with random data; converts it in a subprocess and prints one JSON
line: checkpoint size, peak RSS of the converter (and of a bare interpreter that only imports it),
the largest parameter / layer, wall time and throughput. Not part of the tests.

    python bench/convert_memory.py [--layers 8] [--experts 32] [--dtype bf16] [--workdir DIR] [--keep]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from checkpoints_convert.specs import ling_specs  # noqa: E402
from lingjax.config import PRESETS, LingConfig  # noqa: E402
from lingjax.safetensors_io import write_safetensors  # noqa: E402


def synthetic_config(layers: int, experts: int) -> dict:
    return dict(PRESETS["ling3-flash"], num_hidden_layers=layers, layer_group_size=4, num_experts=experts,
                n_group=4, topk_group=2, num_experts_per_tok=8, first_k_dense_replace=1,
                num_nextn_predict_layers=0)


def source_shapes(cfg: LingConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    """Published tensor name -> shape, and stored bytes per layer group (bf16)."""
    shapes, groups = {}, {}
    for spec in ling_specs(cfg, with_mtp=False):
        for name in spec.sources:
            shapes[name] = spec.layout.source_shape(spec.shape)
        groups[spec.group] = groups.get(spec.group, 0) + 2 * math.prod(spec.shape)
    return shapes, groups


def write_checkpoint(d: Path, config: dict, shapes: dict, shard_bytes: int, seed: int = 0) -> int:
    """Random bf16 tensors (|x| in [2^-7, 2^-6)) in shards of about shard_bytes; returns total bytes."""
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config))
    shards, cur, size = [], {}, 0
    for name, shape in shapes.items():
        bits = rng.integers(0, 1 << 16, math.prod(shape), dtype=np.uint16)
        cur[name] = ((bits & 0x807F) | 0x3C00).view(ml_dtypes.bfloat16).reshape(shape)
        size += cur[name].nbytes
        if size >= shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
    if cur:
        shards.append(cur)
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(d / fname, tensors)
        weight_map.update({k: fname for k in tensors})
        total += sum(t.nbytes for t in tensors.values())
        shards[i] = None                                      # free as we go
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                "weight_map": weight_map}))
    return total


def child_peak_rss(cmd: list[str]) -> tuple[int, float, int, str]:
    """Run cmd; (its peak RSS in bytes, wall seconds, exit code, stderr). The peak is the child's
    VmHWM, polled from /proc (ru_maxrss of a child would include this parent's memory, which a
    vfork-ed child inherits as its high-water mark until exec)."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"})
        peak = 0
        while proc.poll() is None:
            peak = max(peak, _vm_hwm(proc.pid))
            time.sleep(0.05)
        wall = time.monotonic() - t0
        err.seek(0)
        return peak, wall, proc.returncode, err.read()


def _vm_hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--shard-mb", type=int, default=512)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the synthetic and converted checkpoints")
    args = ap.parse_args()

    config = synthetic_config(args.layers, args.experts)
    shapes, groups = source_shapes(LingConfig.from_dict(config))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="lingjax-convert-bench-"))
    src, out = work / "hf", work / "converted"
    try:
        t0 = time.monotonic()
        total = write_checkpoint(src, config, shapes, args.shard_mb << 20)
        gen_s = time.monotonic() - t0
        base_rss, _, _, _ = child_peak_rss([sys.executable, "-c", "import checkpoints_convert.convert"])
        rss, wall, rc, stderr = child_peak_rss([sys.executable, "-m", "checkpoints_convert", str(src), str(out),
                                                "--dtype", args.dtype, "-q"])
        if rc != 0:
            raise SystemExit(f"conversion failed ({rc}): {stderr.strip()}")
        written = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        largest = max(2 * math.prod(s) for s in shapes.values())
        print(json.dumps({
            "checkpoint_bytes": total, "tensors": len(shapes),
            "shards": len(list(src.glob("*.safetensors"))), "layers": args.layers, "experts": args.experts,
            "dtype": args.dtype, "largest_tensor_bytes": largest,
            "largest_layer_bytes": max(v for k, v in groups.items() if k.startswith("layers")),
            "top_level_bytes": groups.get("top", 0),
            "peak_rss_bytes": rss, "import_only_rss_bytes": base_rss,
            "peak_rss_over_checkpoint": round(rss / total, 3),
            "convert_seconds": round(wall, 2), "throughput_mib_s": round(total / wall / 2**20, 1),
            "output_bytes": written, "generate_seconds": round(gen_s, 1),
            "converter_summary": stderr.strip().splitlines()[-1] if stderr.strip() else "",
        }))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
