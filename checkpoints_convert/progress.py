"""Progress bar (tqdm: bytes/s and ETA by bytes read, tensors and tensors/s as postfix) and the
closing summary line."""
from __future__ import annotations

import resource
import sys
import time

from tqdm import tqdm


def peak_rss_bytes() -> int:
    """This process's peak resident memory: VmHWM on Linux (ru_maxrss would include the memory of
    a parent that spawned us with vfork), else ru_maxrss."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


class Progress:
    def __init__(self, total_bytes: int, total_tensors: int, *, enabled: bool, done_bytes=0, done_tensors=0):
        self.t0 = time.monotonic()
        self.total_tensors = total_tensors
        self.tensors = self.start_tensors = done_tensors
        self.bytes = self.start_bytes = done_bytes
        self.bar = tqdm(total=total_bytes, initial=done_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                        desc="converting", file=sys.stderr, disable=not enabled, dynamic_ncols=True)

    def advance(self, nbytes: int, ntensors: int) -> None:
        self.bytes += nbytes
        self.tensors += ntensors
        rate = (self.tensors - self.start_tensors) / max(time.monotonic() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{self.tensors}/{self.total_tensors} tensors, {rate:.0f} tensors/s", refresh=False)
        self.bar.update(nbytes)

    def close(self) -> None:
        self.bar.close()

    def summary(self, written_bytes: int, out) -> str:
        dt = time.monotonic() - self.t0
        new = self.bytes - self.start_bytes
        return (f"converted {self.tensors} tensors ({human_bytes(self.bytes)} read, {human_bytes(written_bytes)} "
                f"written) in {dt:.1f} s ({human_bytes(new / max(dt, 1e-9))}/s, "
                f"{(self.tensors - self.start_tensors) / max(dt, 1e-9):.0f} tensors/s"
                + (f"; {self.start_tensors} tensors resumed" if self.start_tensors else "")
                + f"); peak RSS {human_bytes(peak_rss_bytes())} -> {out}")
