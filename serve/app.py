"""The FastAPI app: OpenAI-compatible routes over one EngineWorker.

Routes: POST /v1/completions, POST /v1/chat/completions (JSON or SSE), GET /v1/models,
GET /v1/models/{id}, GET /health, GET /metrics. With an API key, /v1/* needs
`Authorization: Bearer KEY` (/health and /metrics stay open for probes and scrapers).
Every error is an OpenAI envelope; validation errors are 400 (never 422).
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve import protocol as P
from serve.chat import ChatPrompt, build_chat_prompt, chat_message
from serve.errors import APIError, bad_request, error_body, not_supported, service_unavailable
from serve.metrics import CONTENT_TYPE_LATEST
from serve.output import CompletionText
from serve.tool_calls import Delta
from serve.worker import EngineWorker, Job, NotReady, QueueFull

log = logging.getLogger("serve.app")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_ERR = {"model": P.ErrorResponse}
_GEN_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {**_ERR, "description": "invalid request (malformed JSON, wrong types, context exceeded, unsupported)"},
    401: {**_ERR, "description": "missing or wrong API key"},
    404: {**_ERR, "description": "unknown model"},
    503: {**_ERR, "description": "loading, overloaded (queue full: see Retry-After) or shutting down"},
}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class _Gone(Exception):
    """The client disconnected before the response was ready."""


class ServerState:
    def __init__(self, worker: EngineWorker, model_name: str, api_key: str | None, shutdown_grace_s: float):
        self.worker = worker
        self.model_name = model_name
        self.api_key = api_key
        self.shutdown_grace_s = shutdown_grace_s
        self.created = int(time.time())

    @property
    def metrics(self):
        return self.worker.metrics

    def begin_shutdown(self):
        self.worker.begin_shutdown(self.shutdown_grace_s)

    # ---- request preparation ---------------------------------------------------------------
    def engine(self):
        w = self.worker
        if w.ready:
            return w.engine
        state = w.state if w.state != "ready" else "stopped"
        self.metrics.request_rejected.labels(reason=state).inc()
        if state == "loading":
            raise service_unavailable("the model is loading", retry_after=5, code="loading")
        if state == "failed":
            raise service_unavailable("the engine failed to load; see the server log", retry_after=60,
                                      code="engine_failed")
        raise service_unavailable("the server is shutting down", retry_after=5, code="shutting_down")

    def check_model(self, model: str | None):
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def stop_token_text(self, engine) -> Callable[[int], str | None]:
        stops = set(engine.stop_ids)
        tok = engine.tokenizer

        def text(token_id: int) -> str | None:
            return tok.decode([token_id]) if tok is not None and token_id in stops else None
        return text

    def submit(self, engine, ids: list[int], body: P._SamplingRequest, max_tokens: int | None,
               prompt_param: str) -> tuple[Job, list[str]]:
        from lingjax.sampling import SamplingParams
        if body.n not in (None, 1):
            raise bad_request("n > 1 is not supported: this server generates one completion per request "
                              "(batch 1); send n separate requests", param="n", code="unsupported_parameter")
        if body.presence_penalty:
            raise not_supported("presence_penalty", "presence_penalty other than 0")
        if body.frequency_penalty:
            raise not_supported("frequency_penalty", "frequency_penalty other than 0")
        if body.logit_bias:
            raise not_supported("logit_bias")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        stop = [s for s in stop if s]
        temperature = 1.0 if body.temperature is None else body.temperature
        top_p = 1.0 if body.top_p is None else body.top_p
        top_k = 0 if body.top_k in (None, -1) else min(body.top_k, engine.cfg.vocab_size)
        seed = secrets.randbits(31) if body.seed is None else body.seed
        try:
            sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        except ValueError as e:
            raise bad_request(str(e), code="invalid_sampling") from None
        n_ctx = engine.max_context
        room = n_ctx - len(ids) - engine.spec.drafts - 2
        if room < 1:
            raise bad_request(f"the prompt has {len(ids)} tokens, which leaves no room in the context of "
                              f"{n_ctx} tokens", param=prompt_param, code="context_length_exceeded",
                              n_prompt_tokens=len(ids), n_ctx=n_ctx)
        if max_tokens is not None and max_tokens > room:
            raise bad_request(f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds the context "
                              f"of {n_ctx} tokens: at most {room} new tokens fit", param="max_tokens",
                              code="context_length_exceeded", n_prompt_tokens=len(ids), n_ctx=n_ctx)
        from lingjax.engine import RequestError
        try:
            max_new = engine.resolve_max_tokens(len(ids), max_tokens, engine.spec)
        except RequestError as e:
            raise bad_request(str(e), param="max_tokens", n_prompt_tokens=len(ids), n_ctx=n_ctx) from None
        job = Job(ids, sampling=sampling, max_tokens=max_new, stop=stop)
        try:
            self.worker.submit(job)
        except QueueFull:
            self.metrics.request_rejected.labels(reason="queue_full").inc()
            raise service_unavailable(f"the server is busy: {self.worker.max_queue} requests are already "
                                      "waiting; retry later", retry_after=1, code="queue_full") from None
        except NotReady as e:
            self.metrics.request_rejected.labels(reason=e.state).inc()
            raise service_unavailable(f"the server is not ready ({e.state})", retry_after=5, code=e.state) from None
        return job, stop


DISCONNECT_POLL_S = 0.1


async def _events(job: Job, request: Request | None = None) -> AsyncIterator[tuple[str, Any]]:
    """The job's events until the last one; with `request`, poll for a client disconnect every
    DISCONNECT_POLL_S (streaming responses learn it from Starlette, which cancels the stream)."""
    next_poll = time.monotonic() + DISCONNECT_POLL_S
    while True:
        if request is None:
            kind, payload = await job.events.get()
        else:
            try:
                kind, payload = await asyncio.wait_for(job.events.get(), timeout=DISCONNECT_POLL_S)
            except TimeoutError:
                kind = None
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    job.cancel("client")
                    raise _Gone
            if kind is None:
                continue
        yield kind, payload
        if kind != "chunk":
            return


def _shutdown_error() -> APIError:
    return APIError(503, "the request was aborted: the server is shutting down", code="shutting_down")


async def _final(job: Job, request: Request):
    """Wait for the job's result (non-streaming). Raises APIError / _Gone."""
    try:
        async for kind, payload in _events(job, request):
            if kind == "final":
                return payload.result
            if kind == "error":
                raise payload
            if kind == "aborted":
                if payload == "shutdown":
                    raise _shutdown_error()
                raise _Gone
    finally:
        job.cancel("client")   # no-op once finished
    raise _Gone


def _usage(n_prompt: int, n_completion: int) -> dict[str, int]:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


def _chat_delta(d: Delta) -> dict[str, Any]:
    if d.kind == "reasoning":
        return {"reasoning_content": d.text}
    if d.kind == "content":
        return {"content": d.text}
    return {"tool_calls": [d.call.to_openai(d.index)]}


def _clean_openapi(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """FastAPI documents a 422 for every body; this server answers 400 instead."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = original()
            for item in schema.get("paths", {}).values():
                for op in item.values():
                    if isinstance(op, dict):
                        op.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema
    return openapi


class _AuthMiddleware:
    """Pure ASGI: /v1/* requires `Authorization: Bearer KEY` when a key is set."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if self.key is not None and scope["type"] == "http" and scope["path"].startswith("/v1"):
            auth = dict(scope.get("headers") or ()).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                resp = JSONResponse(error_body("missing or invalid API key: send 'Authorization: Bearer <key>'",
                                               "authentication_error", None, "invalid_api_key"),
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list", "bytes"}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        return f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg', ''))}", None
    # union members each report an error under a member tag ('str', 'list[int]', 'TextPart', ...):
    # the parameter is the path up to the first tag
    path = []
    for x in loc:
        if not (x.isdigit() or (re.fullmatch(r"[a-z_][a-z0-9_]*", x) and x not in _TYPE_TAGS)):
            break
        path.append(x)
    param = ".".join(path)
    if e.get("type") == "missing" and not loc:
        return "the request body must be a JSON object", None
    msg = e.get("msg", "invalid value")
    extra = f" ({len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return (f"invalid value for '{param}': {msg}{extra}" if param else f"invalid request body: {msg}{extra}"), param or None


def create_app(worker: EngineWorker, *, model_name: str = "lingjax", api_key: str | None = None,
               shutdown_grace_s: float = 30.0) -> FastAPI:
    state = ServerState(worker, model_name, api_key, shutdown_grace_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        yield
        await run_in_threadpool(worker.stop)

    app = FastAPI(title="lingjax", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server for Ling-3.0 + DSpark (lingjax). One engine worker, batch 1.")
    app.state.serve = state
    app.openapi = _clean_openapi(app)  # type: ignore[method-assign]
    app.add_middleware(_AuthMiddleware, api_key=api_key)

    # ---- errors ------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        msg, param = _validation_message(exc)
        return JSONResponse(error_body(msg, "invalid_request_error", param, "invalid_request"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            msg, typ = f"no route {request.method} {request.url.path}", "not_found_error"
        elif exc.status_code == 405:
            msg, typ = f"method {request.method} is not allowed on {request.url.path}", "invalid_request_error"
        else:
            msg, typ = str(exc.detail), "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(msg, typ, None, exc.status_code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal server error", "server_error", None, "internal_error"),
                            status_code=500)

    # ---- probes ------------------------------------------------------------------------------
    @app.get("/health", response_model=None, responses={
        200: {"model": P.HealthResponse, "description": "the engine can generate"},
        503: {**_ERR, "description": "loading, shutting down, or failed"}})
    async def health():
        if worker.ready:
            return JSONResponse({"status": "ok"})
        s = worker.state if worker.state != "ready" else "stopped"
        msg = {"loading": "the model is loading", "failed": "the engine failed to load"}.get(s, "the server is shutting down")
        return JSONResponse(error_body(msg, "service_unavailable_error", None, s), status_code=503,
                            headers={"Retry-After": "5"})

    @app.get("/metrics", response_class=Response, responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text format"}})
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict[str, Any]:
        eng = worker.engine
        return {"id": model_name, "object": "model", "created": state.created, "owned_by": "lingjax",
                "max_model_len": eng.max_context if eng is not None else None}

    @app.get("/v1/models", response_model=None, responses={200: {"model": P.ModelList}, 401: _GEN_RESPONSES[401]})
    async def list_models():
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}", response_model=None,
             responses={200: {"model": P.ModelCard}, 401: _GEN_RESPONSES[401], 404: _GEN_RESPONSES[404]})
    async def get_model(model_id: str):
        state.check_model(model_id)
        return JSONResponse(model_card())

    # ---- completions -------------------------------------------------------------------------
    @app.post("/v1/completions", response_model=None, responses={
        200: {"model": P.CompletionResponse, "description": "the completion; " + P.SSE_DESCRIPTION,
              "content": {"text/event-stream": {"schema": {"type": "string"}}}},
        **_GEN_RESPONSES})
    async def create_completion(body: P.CompletionRequest, request: Request):
        engine = state.engine()
        state.check_model(body.model)
        if body.logprobs is not None:
            raise not_supported("logprobs")
        if body.echo:
            raise not_supported("echo")
        if body.suffix is not None:
            raise not_supported("suffix")
        if body.best_of not in (None, 1):
            raise not_supported("best_of", "best_of > 1")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request("a list of several prompts (a batch) is not supported: send one prompt per "
                                  "request", param="prompt", code="unsupported_parameter")
            prompt = prompt[0]
        from lingjax.engine import RequestError
        try:
            ids = await run_in_threadpool(engine.encode_prompt, prompt)
        except RequestError as e:
            raise bad_request(str(e), param="prompt") from None
        job, stop = state.submit(engine, ids, body, body.max_tokens, "prompt")
        rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), model_name
        text = CompletionText(stop, state.stop_token_text(engine))

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def chunk(t: str, finish: str | None = None) -> str:
                return _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                             "choices": [{"index": 0, "text": t, "logprobs": None, "finish_reason": finish}]})

            async def stream():
                try:
                    async for kind, payload in _events(job):
                        if kind == "chunk":
                            if t := text.feed(payload.text):
                                yield chunk(t)
                        elif kind == "final":
                            r = payload.result
                            yield chunk(text.finish(r.text, r.token_ids, r.finish_reason), r.finish_reason)
                            if include_usage:
                                yield _sse({"id": rid, "object": "text_completion", "created": created,
                                            "model": model, "choices": [], "usage": _usage(len(ids), len(r.token_ids))})
                        elif kind == "error":
                            yield _sse(payload.body())
                        elif kind == "aborted":
                            yield _sse(_shutdown_error().body())
                    yield SSE_DONE
                except Exception:  # noqa: BLE001 - after the 200: report in the stream
                    log.exception("streaming completion failed")
                    yield _sse(error_body("internal server error", "server_error", None, "internal_error"))
                    yield SSE_DONE
                finally:
                    job.cancel("client")
            return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)

        try:
            r = await _final(job, request)
        except _Gone:
            return Response(status_code=499)
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text.finish(r.text, r.token_ids, r.finish_reason), "logprobs": None,
                         "finish_reason": r.finish_reason}],
            "usage": _usage(len(ids), len(r.token_ids))})

    # ---- chat --------------------------------------------------------------------------------
    @app.post("/v1/chat/completions", response_model=None, responses={
        200: {"model": P.ChatCompletionResponse, "description": "the chat completion; " + P.SSE_DESCRIPTION,
              "content": {"text/event-stream": {"schema": {"type": "string"}}}},
        **_GEN_RESPONSES})
    async def create_chat_completion(body: P.ChatCompletionRequest, request: Request):
        engine = state.engine()
        state.check_model(body.model)
        if body.logprobs:
            raise not_supported("logprobs")
        if body.top_logprobs:
            raise not_supported("top_logprobs")
        if body.response_format is not None and body.response_format.type != "text":
            raise not_supported("response_format", f"response_format {body.response_format.type!r}")
        from lingjax.engine import RequestError

        def prepare() -> tuple[ChatPrompt, list[int]]:
            cp = build_chat_prompt(engine.tokenizer, body)
            try:
                return cp, engine.encode_prompt(cp.text)
            except RequestError as e:
                raise bad_request(str(e), param="messages") from None
        cp, ids = await run_in_threadpool(prepare)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        job, stop = state.submit(engine, ids, body, max_tokens, "messages")
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model_name
        text = CompletionText(stop, state.stop_token_text(engine))

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            parser = cp.parser()

            def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
                return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                             "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})

            async def stream():
                try:
                    yield chunk({"role": "assistant", "content": ""})
                    async for kind, payload in _events(job):
                        if kind == "chunk":
                            for d in parser.feed(text.feed(payload.text)):
                                yield chunk(_chat_delta(d))
                        elif kind == "final":
                            r = payload.result
                            for d in parser.feed(text.finish(r.text, r.token_ids, r.finish_reason)) + parser.finish():
                                yield chunk(_chat_delta(d))
                            finish = "tool_calls" if parser.tool_calls and r.finish_reason == "stop" else r.finish_reason
                            yield chunk({}, finish)
                            if include_usage:
                                yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                            "model": model, "choices": [],
                                            "usage": _usage(len(ids), len(r.token_ids))})
                        elif kind == "error":
                            yield _sse(payload.body())
                        elif kind == "aborted":
                            yield _sse(_shutdown_error().body())
                    yield SSE_DONE
                except Exception:  # noqa: BLE001 - after the 200: report in the stream
                    log.exception("streaming chat completion failed")
                    yield _sse(error_body("internal server error", "server_error", None, "internal_error"))
                    yield SSE_DONE
                finally:
                    job.cancel("client")
            return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)

        try:
            r = await _final(job, request)
        except _Gone:
            return Response(status_code=499)
        msg, finish = chat_message(text.finish(r.text, r.token_ids, r.finish_reason), cp, r.finish_reason)
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": msg, "logprobs": None, "finish_reason": finish}],
            "usage": _usage(len(ids), len(r.token_ids))})

    return app
