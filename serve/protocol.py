"""Request and response models of the OpenAI-compatible API (pydantic, strict).

Requests are validated strictly: a wrong JSON type (a string for `max_tokens`, a number for
`stream`) is a 400, never silently coerced. Unknown fields are ignored, as OpenAI clients send
fields this server has no use for (`user`, ...). Fields the server knows but cannot honour
(`logprobs`, `n > 1`, penalties, `echo`, ...) are accepted by the schema and rejected with a 400
that says "not supported" (see `serve.app`). The response models document the responses in
/openapi.json; the handlers build plain dicts of the same shape.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
PositiveInt = Annotated[int, Field(ge=1)]
Temperature = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=-1)]                  # -1 and 0 both mean "off"
NonEmptyStr = Annotated[str, Field(min_length=1)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---- shared request pieces ---------------------------------------------------------------------
class StreamOptions(_Request):
    include_usage: bool | None = False


class _SamplingRequest(_Request):
    model: str | None = Field(None, description="served model name (GET /v1/models); optional")
    max_tokens: PositiveInt | None = Field(None, description="new tokens at most; default: the rest of the context")
    temperature: Temperature | None = Field(None, description="0 = greedy; default 1.0")
    top_p: TopP | None = None
    top_k: TopK | None = Field(None, description="0 or -1 = off")
    seed: Int64 | None = Field(None, description="fixes the sampling; default: a random seed per request")
    stop: str | list[str] | None = Field(None, description="stop strings (not included in the output)")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: PositiveInt | None = Field(1, description="only 1 is supported")
    presence_penalty: Penalty | None = Field(0.0, description="only 0 is supported")
    frequency_penalty: Penalty | None = Field(0.0, description="only 0 is supported")
    logit_bias: dict[str, float] | None = Field(None, description="not supported")
    user: str | None = None


class CompletionRequest(_SamplingRequest):
    prompt: NonEmptyStr | Annotated[list[int], Field(min_length=1)] | Annotated[list[NonEmptyStr], Field(min_length=1)] \
        | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)] = Field(
        ..., description="text or token ids; a list with one prompt is accepted, batches (several) are not")
    logprobs: Annotated[int, Field(ge=0)] | None = Field(None, description="not supported")
    echo: bool | None = Field(False, description="not supported")
    suffix: str | None = Field(None, description="not supported")
    best_of: PositiveInt | None = Field(None, description="only 1 is supported")


class TextPart(_Request):
    type: str
    text: str | None = None


class FunctionCallIn(_Request):
    name: str
    arguments: str | dict[str, Any] = Field("{}", description="a JSON object, as a string (or an object)")


class ToolCallIn(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = Field(None, description="ignored (the template drops past reasoning)")


class FunctionDef(_Request):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ResponseFormat(_Request):
    type: str


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessageIn], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = Field(None, description="wins over max_tokens")
    logprobs: bool | None = Field(False, description="not supported")
    top_logprobs: Annotated[int, Field(ge=0)] | None = Field(None, description="not supported")
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="'required' and a named function are enforced by prefilling <tool_call>")
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='extra chat template variables, e.g. {"enable_thinking": false}')
    response_format: ResponseFormat | None = Field(None, description="only type 'text' is supported")


# ---- responses -----------------------------------------------------------------------------------
class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None
    n_prompt_tokens: int | None = None
    n_ctx: int | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length", "tool_calls"]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCallOut(_Response):
    name: str
    arguments: str


class ToolCallOut(_Response):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ChatMessageOut(_Response):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Response):
    index: int
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: FinishReason | None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(_Response):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"]
    data: list[ModelCard]


class HealthResponse(_Response):
    status: Literal["ok"]


SSE_DESCRIPTION = ("with `stream: true`: Server-Sent Events, `data: {chunk}` per delta, then `data: [DONE]`; "
                   "an error after the 200 arrives as `data: {\"error\": {...}}`")
