"""The output directory's life cycle: refuse to clobber, resume from OUT_DIR.partial, publish atomically.

Everything is written into `OUT_DIR.partial` (beside OUT_DIR, same file system). A progress file
there records each finished part with its checksum; a rerun with the same fingerprint re-verifies
those parts and skips them. The manifest is written last, the progress file removed, and the
directory renamed to OUT_DIR in one step, so OUT_DIR exists only when complete.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from lingjax.checkpoint import FORMAT, MANIFEST, PARAMS_DIR, hash_dir, hash_file

PROGRESS = "progress.json"


class OutputError(ValueError):
    """OUT_DIR cannot be used as asked (holds something else, a different checkpoint, ...)."""


def write_json(path: Path, obj) -> None:
    """Deterministic JSON, written atomically (tmp + rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


class OutDir:
    def __init__(self, out: str | Path):
        self.out = Path(out).absolute()
        self.partial = self.out.with_name(self.out.name + ".partial")
        self.params = self.partial / PARAMS_DIR

    # ---- the final directory ----------------------------------------------------------------
    def existing(self) -> dict | None:
        """The manifest of a converted checkpoint (any format version) already at OUT_DIR, None when
        OUT_DIR is absent or empty; raises OutputError when it holds anything else."""
        if not self.out.exists():
            return None
        if not self.out.is_dir():
            raise OutputError(f"{self.out} exists and is not a directory")
        if not any(self.out.iterdir()):
            return None
        try:
            manifest = json.loads((self.out / MANIFEST).read_text())
            if manifest.get("format") == FORMAT:
                return manifest
        except (OSError, json.JSONDecodeError, AttributeError):
            pass
        raise OutputError(f"{self.out} exists and is not a lingjax converted checkpoint; refusing to "
                          "overwrite it: choose another OUT_DIR or remove it")

    def check_complete(self, manifest: dict, full: bool) -> list[str]:
        """Problems of the checkpoint at OUT_DIR: missing parts / files, sizes, or (full) checksums."""
        problems = []
        for name, rec in manifest["parts"].items():
            d = self.out / PARAMS_DIR / name
            if not d.is_dir():
                problems.append(f"part {name} is missing")
                continue
            got = hash_dir(d) if full else sizes(d)
            if any(got[k] != rec[k] for k in got):
                problems.append(f"part {name} does not match its manifest checksum")
        for name, sha in manifest.get("files", {}).items():
            if not (self.out / name).is_file():
                problems.append(f"{name} is missing")
            elif full and hash_file(self.out / name)[0] != sha:
                problems.append(f"{name} does not match its manifest checksum")
        return problems

    # ---- the partial directory --------------------------------------------------------------
    def open_partial(self, fingerprint: str, log) -> dict[str, dict]:
        """Create or resume OUT_DIR.partial; returns the verified finished parts {name: checksum}."""
        done: dict[str, dict] = {}
        if self.partial.exists():
            state = self._partial_state()
            if state is None:
                raise OutputError(f"{self.partial} exists but was not written by this converter; remove it")
            if state.get("fingerprint") != fingerprint:
                log(f"note: discarding {self.partial} (an interrupted conversion with other inputs or options)")
                shutil.rmtree(self.partial)
            else:
                done = self._verify(state.get("parts") or {}, log)
        self.params.mkdir(parents=True, exist_ok=True)
        self.save_progress(fingerprint, done)
        return done

    def _partial_state(self) -> dict | None:
        for name in (PROGRESS, MANIFEST):                 # manifest: stopped just before the rename
            p = self.partial / name
            if p.is_file():
                try:
                    return json.loads(p.read_text())
                except json.JSONDecodeError:
                    return None
        return None

    def _verify(self, parts: dict[str, dict], log) -> dict[str, dict]:
        good = {}
        for name, rec in parts.items():
            d = self.params / name
            if d.is_dir() and hash_dir(d) == rec:
                good[name] = rec
            else:
                log(f"note: part {name} in {self.partial} fails its checksum; it will be rewritten")
        if self.params.is_dir():
            for d in self.params.iterdir():                 # leftovers of the interrupted part
                if d.name not in good:
                    shutil.rmtree(d) if d.is_dir() else d.unlink()
        (self.partial / MANIFEST).unlink(missing_ok=True)
        if good:
            log(f"resuming: {len(good)} finished part(s) in {self.partial} verified by checksum")
        return good

    def save_progress(self, fingerprint: str, done: dict[str, dict]) -> None:
        write_json(self.partial / PROGRESS, {"fingerprint": fingerprint, "parts": done})

    def publish(self, replace_existing: bool) -> None:
        """Atomically move OUT_DIR.partial to OUT_DIR (replacing an old checkpoint when asked)."""
        (self.partial / PROGRESS).unlink(missing_ok=True)
        if replace_existing and self.out.exists() and any(self.out.iterdir()):
            old = Path(tempfile.mkdtemp(prefix=self.out.name + ".old-", dir=self.out.parent))
            self.out.rename(old)
            self.partial.rename(self.out)
            shutil.rmtree(old)
        else:
            self.partial.rename(self.out)                   # replaces an empty OUT_DIR, if any


def sizes(d: Path) -> dict:
    """{'bytes', 'files'} of a directory tree (the cheap half of a hash_dir record)."""
    files = [p for p in d.rglob("*") if p.is_file()]
    return {"bytes": sum(p.stat().st_size for p in files), "files": len(files)}
