"""Training text of the embedded model: the Python standard library's own *.py sources.

They are on every machine that runs Python and carry the PSF license. Files are read in sorted
order of their path relative to `sysconfig.get_paths()["stdlib"]`; test suites and third-party
packages (site-packages) are left out because distributions ship them inconsistently. A file is
held out for evaluation when a hash of its relative path falls below `heldout_frac`, so the split
does not depend on which other files exist. Documents are joined with <|endoftext|>.

Tokens are bytes: the byte-level tokenizer (`lingjax.tokenizer.build_byte_level_tokenizer`) maps
byte b to id b, so ids are read straight from the file bytes (`encode_bytes`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import sysconfig
from pathlib import Path

import numpy as np

from lingjax.embedded.config import EOT_ID

EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
HELDOUT_FRAC = 0.05


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path | None = None) -> list[str]:
    """Sorted POSIX paths (relative to root) of the stdlib *.py files we use."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if not EXCLUDED_DIRS.intersection(rel.parts[:-1]) and p.is_file():
            out.append(rel.as_posix())
    return sorted(out)


def is_heldout(rel_path: str, frac: float = HELDOUT_FRAC) -> bool:
    h = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "big")
    return h < frac * 2.0 ** 64


def encode_bytes(data: bytes) -> np.ndarray:
    """Byte-level token ids of raw bytes (id == byte value), uint16."""
    return np.frombuffer(data, np.uint8).astype(np.uint16)


@dataclasses.dataclass
class Corpus:
    train: np.ndarray            # uint16 ids: train files joined by EOT (and ending with EOT)
    heldout: np.ndarray          # same for the held-out files
    heldout_docs: list[np.ndarray]
    train_files: list[str]
    heldout_files: list[str]
    fingerprint: str             # sha256 over (path, bytes) of every file used

    def summary(self) -> dict:
        return {"train_files": len(self.train_files), "heldout_files": len(self.heldout_files),
                "train_tokens": int(self.train.size), "heldout_tokens": int(self.heldout.size),
                "fingerprint": self.fingerprint}


def _join(docs: list[np.ndarray]) -> np.ndarray:
    eot = np.array([EOT_ID], np.uint16)
    parts = [x for d in docs for x in (d, eot)]
    return np.concatenate(parts) if parts else np.zeros((0,), np.uint16)


def load_corpus(root: Path | None = None, heldout_frac: float = HELDOUT_FRAC,
                max_files: int | None = None) -> Corpus:
    """Read the corpus. max_files (smoke tests) keeps only the first files of each split."""
    root = Path(root) if root is not None else stdlib_root()
    files = list_sources(root)
    if not files:
        raise FileNotFoundError(f"no *.py files under the stdlib directory {root}")
    digest = hashlib.sha256()
    split: dict[bool, tuple[list[str], list[np.ndarray]]] = {False: ([], []), True: ([], [])}
    for rel in files:
        held = is_heldout(rel, heldout_frac)
        names, docs = split[held]
        if max_files is not None and len(names) >= max_files:
            continue
        data = (root / rel).read_bytes()
        digest.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
        names.append(rel)
        docs.append(encode_bytes(data))
    (tr_names, tr_docs), (ho_names, ho_docs) = split[False], split[True]
    if not ho_docs or not tr_docs:
        raise ValueError(f"empty split ({len(tr_docs)} train / {len(ho_docs)} held-out files) under {root}")
    return Corpus(_join(tr_docs), _join(ho_docs), ho_docs, tr_names, ho_names, digest.hexdigest())


class WindowSampler:
    """Seeded random windows: `next()` -> int32 [batch, length] slices of `tokens`."""

    def __init__(self, tokens: np.ndarray, batch: int, length: int, seed: int):
        if tokens.size < length + 1:
            raise ValueError(f"corpus of {tokens.size} tokens is shorter than one window ({length})")
        self.tokens, self.batch, self.length = tokens, batch, length
        self.rng = np.random.default_rng(seed)

    def next(self) -> np.ndarray:
        starts = self.rng.integers(0, self.tokens.size - self.length + 1, size=self.batch)
        return np.stack([self.tokens[s:s + self.length] for s in starts]).astype(np.int32)


def unigram_bits_per_byte(train: np.ndarray, heldout: np.ndarray) -> float:
    """Bits per byte of a byte-unigram model fit on `train` (add-one smoothing), on `heldout` bytes."""
    counts = np.bincount(train[train < 256], minlength=256).astype(np.float64) + 1.0
    logp = np.log2(counts / counts.sum())
    h = heldout[heldout < 256]
    return float(-logp[h].mean())
