"""OpenAI-compatible HTTP server for lingjax: `python -m serve --checkpoint DIR [--draft DIR]`.

FastAPI + uvicorn. Endpoints: POST /v1/completions, POST /v1/chat/completions (JSON or SSE
streaming, `stream_options.include_usage`), GET /v1/models, GET /health, GET /metrics.

Execution model: one engine worker thread owns the device and runs requests **one at a time, at
batch 1** (no continuous batching). Requests wait in a bounded FIFO queue (`--max-queue`, default
8); when it is full the server answers 503 with `Retry-After`. A client that disconnects cancels
its generation within one device chunk (`--chunk-steps` speculative steps). SIGTERM: /health turns
503, waiting requests get 503, the running request may finish within `--shutdown-timeout` seconds
and is aborted after that, then the process exits.

Modules: `app` (routes, errors, SSE), `protocol` (pydantic request/response models), `worker`
(the engine thread and its queue), `chat` (chat template rendering, tool_choice), `tool_calls`
(Ling tool-call and <think> parsing), `output` (stop-string hold-back), `metrics` (Prometheus),
`testing` (a tiny real engine and a scripted stand-in for tests).
"""
