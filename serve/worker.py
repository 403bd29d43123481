"""The engine worker: one thread owns the device and runs requests one at a time (batch 1).

Requests wait in a bounded FIFO queue (`max_queue` waiting requests, plus the one running); a
full queue is answered 503 by the app. The thread loads the engine, runs a warm-up generation
(so the first compile happens before /health says 200), then serves the queue. A request is
cancelled by setting its cancel flag: the worker checks it each time `Engine.stream` hands back a
device chunk and stops iterating, so a client that disconnects frees the device within one chunk.
Results travel back to the request's asyncio task through an asyncio.Queue of events:
("chunk", StreamChunk), ("final", StreamChunk with .result), ("error", APIError), ("aborted", reason).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from serve.errors import APIError
from serve.metrics import Metrics

log = logging.getLogger("serve.worker")

#: The warm-up request: a one-turn chat with thinking off, 16 new tokens, greedy and sampled.
WARMUP_MESSAGES = ({"role": "user", "content": "Hello"},)
WARMUP_MAX_TOKENS = 16


class QueueFull(Exception):
    pass


class NotReady(Exception):
    def __init__(self, state: str):
        super().__init__(state)
        self.state = state


class Job:
    """One generation request, shared between its asyncio task and the worker thread."""

    def __init__(self, prompt_ids: Sequence[int], *, sampling, max_tokens: int, stop: Sequence[str] = (),
                 loop: asyncio.AbstractEventLoop | None = None):
        self.id = uuid.uuid4().hex
        self.prompt_ids = list(prompt_ids)
        self.sampling = sampling
        self.max_tokens = max_tokens
        self.stop = list(stop)
        self.loop = loop or asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.t_arrival = time.perf_counter()
        self.cancel_reason: str | None = None
        self.done = False
        self._cancel = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self, reason: str = "client"):
        if not self.done and not self._cancel.is_set():
            self.cancel_reason = reason
            self._cancel.set()

    def push(self, kind: str, payload=None):
        if kind != "chunk":
            self.done = True
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is gone (server exiting)
            pass


def warmup(engine):
    """Compile and run the common path once: greedy and sampled decoding of a short chat prompt."""
    from lingjax.sampling import SamplingParams
    if engine.tokenizer is not None:
        prompt = engine.tokenizer.render_chat(list(WARMUP_MESSAGES), thinking=False)
    else:
        prompt = [i % engine.cfg.vocab_size for i in range(1, 9)]
    ids = engine.encode_prompt(prompt)
    room = engine.max_context - engine.spec.drafts - 2
    if room < 2:
        return
    if len(ids) >= room:      # a tiny context: warm up a shorter prompt
        ids = ids[-(room // 2):]
    n = min(WARMUP_MAX_TOKENS, room - len(ids))
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0, seed=0)):
        engine.generate(ids, sampling=sampling, max_tokens=n)


class EngineWorker:
    def __init__(self, engine_factory: Callable[[], object], *, max_queue: int = 8, warmup: bool = True,
                 metrics: Metrics | None = None, on_fatal: Callable[[BaseException], None] | None = None):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self._factory = engine_factory
        self._warmup = warmup
        self.max_queue = max_queue
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self.metrics = metrics or Metrics()
        self.on_fatal = on_fatal
        self.engine = None
        self.state = "loading"          # loading | ready | shutting_down | stopped | failed
        self.error: BaseException | None = None
        self._running: Job | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="engine-worker", daemon=True)
        self.metrics.waiting.set_function(lambda: self._queue.qsize())
        self.metrics.running.set_function(lambda: 1 if self._running is not None else 0)

    # ---- control (event-loop side) -----------------------------------------------------------
    def start(self):
        if not self._thread.is_alive() and self.state == "loading":
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def ready(self) -> bool:
        return self.state == "ready" and self.alive

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    @property
    def running(self) -> bool:
        return self._running is not None

    def submit(self, job: Job):
        """Queue a job; raises NotReady (loading / shutting down) or QueueFull."""
        if not self.ready:
            raise NotReady(self.state if self.state != "ready" else "stopped")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull from None

    def begin_shutdown(self, grace_s: float = 30.0):
        """Refuse new work, answer queued requests 503, and abort the running one after grace_s."""
        with self._lock:
            if self.state in ("shutting_down", "stopped"):
                return
            if self.state != "failed":
                self.state = "shutting_down"
            running = self._running
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            self._reject(job)
        if running is not None:
            if grace_s <= 0:
                running.cancel("shutdown")
            else:
                t = threading.Timer(grace_s, running.cancel, args=("shutdown",))
                t.daemon = True
                t.start()

    def stop(self, timeout: float = 10.0):
        self.begin_shutdown(0)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.state != "failed":
            self.state = "stopped"

    # ---- the thread ----------------------------------------------------------------------------
    def _reject(self, job: Job):
        self.metrics.request_rejected.labels(reason="shutdown").inc()
        job.push("error", APIError(503, "the server is shutting down", code="shutting_down",
                                   headers={"Retry-After": "5"}))

    def _main(self):
        try:
            t0 = time.perf_counter()
            engine = self._factory()
            self.engine = engine
            if self._warmup:
                t1 = time.perf_counter()
                warmup(engine)
                log.info("warm-up generation done in %.1fs", time.perf_counter() - t1)
            log.info("engine ready in %.1fs", time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - reported through /health and on_fatal
            if isinstance(e, (ValueError, OSError, ImportError)):   # bad path / config: no traceback
                log.error("engine failed to load: %s", e)
            else:
                log.exception("engine failed to load")
            self.error = e
            self.state = "failed"
            if self.on_fatal is not None:
                self.on_fatal(e)
            return
        with self._lock:
            if self.state == "loading":
                self.state = "ready"
        while not self._stop.is_set():
            try:
                job = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            with self._lock:
                if self.state != "ready":
                    self._reject(job)
                    continue
                self._running = job
            try:
                if job.cancelled:
                    self.metrics.request_aborted.labels(reason=job.cancel_reason or "client").inc()
                    job.push("aborted", job.cancel_reason)
                else:
                    self._run(engine, job)
            finally:
                self._running = None

    def _run(self, engine, job: Job):
        from lingjax.engine import RequestError
        m = self.metrics
        t_start = time.perf_counter()
        m.queue_time.observe(t_start - job.t_arrival)
        m.prompt_tokens.inc(len(job.prompt_ids))
        gen = engine.stream(job.prompt_ids, sampling=job.sampling, max_tokens=job.max_tokens, stop=job.stop)
        t_last = None
        try:
            for chunk in gen:
                now = time.perf_counter()
                n = len(chunk.token_ids)
                if n:
                    m.generation_tokens.inc(n)
                    if t_last is None:
                        m.ttft.observe(now - job.t_arrival)
                    else:
                        per = (now - t_last) / n
                        for _ in range(n):
                            m.itl.observe(per)
                    t_last = now
                if chunk.result is not None:
                    r = chunk.result
                    m.e2e.observe(now - job.t_arrival)
                    m.request_success.labels(finished_reason=r.finish_reason or "stop").inc()
                    m.observe_stats(r.stats, speculative=getattr(engine.spec, "drafts", 0) > 0)
                    job.push("final", chunk)
                    return
                if job.cancelled:
                    m.request_aborted.labels(reason=job.cancel_reason or "client").inc()
                    job.push("aborted", job.cancel_reason)
                    return
                job.push("chunk", chunk)
            raise RuntimeError("the engine stream ended without a result")
        except RequestError as e:
            m.request_errors.inc()
            job.push("error", APIError(400, str(e), code="invalid_request"))
        except Exception as e:  # noqa: BLE001 - reported to the client as a 500 / error event
            log.exception("generation failed")
            m.request_errors.inc()
            job.push("error", APIError(500, f"internal error during generation: {type(e).__name__}",
                                       code="internal_error"))
        finally:
            gen.close()
