"""Engines for tests and dry runs (hidden CLI flags of `python -m serve`).

- `tiny_engine(checkpoint)`: a real Engine on a small checkpoint with the byte-level demo
  tokenizer (e.g. the golden `tests/data/ling3-tiny`, vocab 512 >= the tokenizer's 269 ids).
- `ScriptedEngine`: no model at all. It has the Engine interface the server uses (tokenizer, cfg,
  max_context, spec, stop_ids, encode_prompt, resolve_max_tokens, stream) and "generates" a
  script: the text between `<<<` and `>>>` in the prompt (then a stop token), or else the prompt's
  last characters repeated until max_tokens. Chunks of `chunk_steps` tokens arrive every
  `chunk_delay_s` seconds, like device chunks. It makes HTTP-level tests (fuzzing, queueing,
  disconnects, tool calls, shutdown) fast and deterministic; it is not a model.
- `ServerProcess`: `python -m serve ...` in a subprocess on a free local port, with a readiness wait.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

from lingjax.engine import Engine, GenerationResult, GenerationStats, StreamChunk
from lingjax.sampling import SamplingParams
from lingjax.tokenizer import ROLE_END, Tokenizer, build_byte_level_tokenizer


def byte_level_tokenizer() -> Tokenizer:
    return Tokenizer(build_byte_level_tokenizer())


def tiny_engine(checkpoint: str, *, dtype: str = "float32", chunk_steps: int = 16,
                max_context: int | None = None, spec: str | None = None, block_size: int | None = None):
    from lingjax.loader import load_engine
    eng = load_engine(checkpoint, dtype=dtype, spec=spec, block_size=block_size, chunk_steps=chunk_steps,
                      max_context=max_context, quiet=True)
    return Engine(eng.target, byte_level_tokenizer(), eng.draft, spec=eng.spec, chunk_steps=chunk_steps,
                  max_context=max_context)


def _find_stop(text: str, stops, new_from: int) -> int | None:
    best = None
    for s in stops:
        if s:
            i = text.find(s, max(0, new_from - len(s) + 1))
            if i >= 0 and (best is None or i < best):
                best = i
    return best


class ScriptedEngine:
    encode_prompt = Engine.encode_prompt
    resolve_max_tokens = Engine.resolve_max_tokens

    def __init__(self, tokenizer: Tokenizer | None = None, *, max_context: int = 512, chunk_steps: int = 4,
                 chunk_delay_s: float = 0.0, vocab_size: int = 512, drafts: int = 2):
        self.tokenizer = tokenizer or byte_level_tokenizer()
        self.cfg = SimpleNamespace(vocab_size=vocab_size, max_position_embeddings=max_context, eos_token_ids=())
        self.max_context = max_context
        self.chunk_steps = chunk_steps
        self.chunk_delay_s = chunk_delay_s
        self.spec = SimpleNamespace(method="scripted", drafts=drafts)
        self.role_end = self.tokenizer.token_to_id(ROLE_END)
        self.stop_ids = tuple(self.tokenizer.stop_token_ids)

    def _script(self, ids: list[int], max_new: int) -> tuple[list[int], bool]:
        text = self.tokenizer.decode(ids)
        a, b = text.rfind("<<<"), text.rfind(">>>")
        while a > 0 and text[a - 1] == "<":    # "<<<<tool_call>": the script starts with "<"
            a -= 1
        if 0 <= a < b:
            out = self.tokenizer.encode(text[a + 3:b]) + [self.role_end]
            return out[:max_new], len(out) <= max_new
        tail = [t for t in ids if 32 <= t < 127][-24:] or [ord("x")]
        return [tail[i % len(tail)] for i in range(max_new)], False

    def stream(self, prompt, *, sampling: SamplingParams = SamplingParams(), max_tokens: int | None = None,
               stop=(), **_):
        t0 = time.perf_counter()
        ids = self.encode_prompt(prompt)
        max_new = self.resolve_max_tokens(len(ids), max_tokens, self.spec)
        tokens, stops = self._script(ids, max_new)
        detok = self.tokenizer.stream_decoder()
        text, pos, t_first, finish = "", 0, None, "length"
        sizes = [1] + [self.chunk_steps] * len(tokens)     # first token alone, then chunks
        cut = None
        for size in sizes:
            time.sleep(self.chunk_delay_s)
            new = tokens[pos:pos + size]
            pos += len(new)
            t_first = t_first or time.perf_counter()
            delta = "".join(detok.feed(t) for t in new)
            text += delta
            cut = _find_stop(text, stop, len(text) - len(delta))
            if cut is not None:
                delta = delta[:max(0, cut - (len(text) - len(delta)))]
                text = text[:cut]
                finish = "stop"
                break
            if pos >= len(tokens):
                finish = "stop" if stops else "length"
                break
            yield StreamChunk(new, delta)
        if cut is None:
            tail = detok.flush()
            delta, text = delta + tail, text + tail
        n = pos
        steps = max(1, -(-(n - 1) // (self.spec.drafts + 1))) if n > 1 else 0
        accepted = max(0, n - 1 - steps)
        stats = GenerationStats(
            ttft_s=(t_first or t0) - t0, total_s=time.perf_counter() - t0, steps=steps,
            drafted=steps * self.spec.drafts, accepted=accepted,
            accept_length=(accepted + steps) / steps if steps else 0.0,
            accepted_per_position=[min(steps, accepted // max(1, self.spec.drafts))] * self.spec.drafts,
            prompt_tokens=len(ids), completion_tokens=n)
        yield StreamChunk(new, delta, GenerationResult(tokens[:n], text, finish, stats))

    def generate(self, prompt, **kw) -> GenerationResult:
        for chunk in self.stream(prompt, **kw):
            if chunk.result is not None:
                return chunk.result
        raise AssertionError("no result")


REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, dict, bytes]:
    """(status, headers, body) of a GET; HTTP errors are returned, not raised."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


class ServerProcess:
    """`python -m serve ARGS --host 127.0.0.1 --port <free>` as a subprocess (output to a log file)."""

    def __init__(self, args: list[str], *, env: dict[str, str] | None = None, port: int | None = None):
        self.args = list(args)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                    **(env or {})}
        self.log = tempfile.NamedTemporaryFile("w+b", prefix="serve-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None
        self.health_seen: list[tuple[int, bytes]] = []   # distinct (status, body) seen while waiting

    def start(self) -> "ServerProcess":
        self.proc = subprocess.Popen([sys.executable, "-m", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                                      *self.args], cwd=REPO, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        return self

    def log_text(self) -> str:
        return Path(self.log.name).read_bytes().decode("utf-8", "replace")

    def wait_ready(self, timeout: float = 300.0) -> "ServerProcess":
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            try:
                status, _, body = http_get(self.url + "/health", timeout=2)
            except OSError:
                time.sleep(0.1)
                continue
            if not self.health_seen or self.health_seen[-1] != (status, body):
                self.health_seen.append((status, body))
            if status == 200:
                return self
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log_text()[-4000:]}")

    def metrics(self) -> dict[str, float]:
        """Prometheus samples as {'name{labels}': value}."""
        _, _, body = http_get(self.url + "/metrics")
        out = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self):
        return self.start().wait_ready()

    def __exit__(self, *exc):
        self.stop()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass
