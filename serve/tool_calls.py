"""Ling tool-call output -> OpenAI `tool_calls`, and the streaming split of a chat completion
into reasoning, content and tool calls.

Ling-3.0 writes tool calls as GLM-4.7-style XML (spec/ling3.md):

    <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>

String values are written verbatim, other values as JSON. A value is read back as a string when
the tool's JSON schema declares the parameter a string, else as JSON when it parses (falling back
to the verbatim string). Whitespace between the tags is allowed. A block that does not follow the
format (unclosed, stray text between the tags, an empty or undeclared function name, a repeated
key) is returned as plain content; parsing never raises.

Thinking: with thinking on, the generation prompt ends with `<think>`, so the completion starts
inside the think block: everything up to `</think>` is `reasoning_content`. A completion that
opens `<think>` itself at its very start is treated the same way.
"""
from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
THINK_START, THINK_END = "<think>", "</think>"
ARG_KEY, ARG_KEY_END = "<arg_key>", "</arg_key>"
ARG_VALUE, ARG_VALUE_END = "<arg_value>", "</arg_value>"

_NAME = re.compile(r"[^\s<>]{1,256}")
_ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.S)


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments_json}}
        return d if index is None else {"index": index, **d}


def _tool_schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]] | None:
    """{function name: {param name: JSON schema}}; None when no tools were declared."""
    if tools is None:
        return None
    out: dict[str, dict[str, Any]] = {}
    for t in tools:
        fn = t.get("function", t) if isinstance(t, Mapping) else {}
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        out[fn["name"]] = dict(props) if isinstance(props, Mapping) else {}
    return out


def _reject_constant(name: str):
    raise ValueError(name)


def _is_string_schema(schema: Any) -> bool:
    if not isinstance(schema, Mapping):
        return False
    t = schema.get("type")
    return t == "string" or (isinstance(t, list) and "string" in t)


def _value(raw: str, schema: Any) -> Any:
    if _is_string_schema(schema):
        return raw
    try:  # NaN / Infinity are not JSON: keep such values as strings
        return json.loads(raw, parse_constant=_reject_constant)
    except ValueError:
        return raw


def parse_tool_call(block: str, tools: Sequence[Mapping[str, Any]] | None = None, *,
                    _schemas: dict | None = None) -> ToolCall | None:
    """One `<tool_call>...</tool_call>` block -> ToolCall, or None if it is malformed (or names a
    function that is not among `tools`, when tools are given)."""
    if not (block.startswith(TOOL_START) and block.endswith(TOOL_END)) or len(block) < len(TOOL_START + TOOL_END):
        return None
    schemas = _schemas if _schemas is not None else _tool_schemas(tools)
    body = block[len(TOOL_START):-len(TOOL_END)]
    k = body.find(ARG_KEY)
    name = (body if k < 0 else body[:k]).strip()
    if not _NAME.fullmatch(name) or (schemas is not None and name not in schemas):
        return None
    params = schemas.get(name, {}) if schemas else {}
    args: dict[str, Any] = {}
    rest, pos = ("" if k < 0 else body[k:]), 0
    while pos < len(rest):
        m = _ARG.match(rest, pos)
        if m is None:
            return None
        key = m.group(1).strip()
        if not key or key in args or "<" in key:
            return None
        args[key] = _value(m.group(2), params.get(key))
        pos = m.end()
    return ToolCall(name, args)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclasses.dataclass
class Delta:
    kind: str                 # "reasoning" | "content" | "tool_call"
    text: str = ""
    call: ToolCall | None = None
    index: int = 0            # tool call index


class ChatOutputParser:
    """Incremental split of generated chat text. `feed(text)` returns the deltas that are certain
    (held back: a possible partial tag at the end, an unfinished tool-call block, trailing
    whitespace of the content); `finish()` returns the rest. `parse(text)` does both at once.

    reasoning: the completion starts inside `<think>` (the prompt ended with it).
    tools: declared tools (None = do not look for tool calls).
    prefix: text the prompt already forced (e.g. `<tool_call>get_weather` for tool_choice), parsed
        as if the model had written it.
    parse_tools: look for tool calls (default: when `tools` is given; True without tools accepts
        any well-formed function name).
    """

    def __init__(self, *, reasoning: bool = False, tools: Sequence[Mapping[str, Any]] | None = None,
                 prefix: str = "", parse_tools: bool | None = None):
        self.mode = "reasoning" if reasoning else "content"
        self.parse_tools = tools is not None if parse_tools is None else parse_tools
        self._schemas = _tool_schemas(tools)
        self._buf = prefix
        self._may_open_think = not reasoning   # a leading <think> in the content opens reasoning
        self._seen_content = False
        self._pending_ws = ""          # whitespace-only content, emitted with the next content
        self.tool_calls: list[ToolCall] = []

    # ---- public ----------------------------------------------------------------------------
    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[Delta]:
        out = self._drain(final=True)
        if self._pending_ws and not self.tool_calls:
            out.append(Delta("content", self._pending_ws))
        self._pending_ws = ""
        return out

    def parse(self, text: str) -> list[Delta]:
        return self.feed(text) + self.finish()

    # ---- internals ---------------------------------------------------------------------------
    def _content(self, out: list[Delta], text: str):
        if not text:
            return
        self._seen_content = True
        body = text.rstrip()
        if body:   # trailing whitespace waits: it is dropped if a tool call follows
            out.append(Delta("content", self._pending_ws + body))
            self._pending_ws = ""
        self._pending_ws += text[len(body):]

    def _drain(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while self._buf:
            buf = self._buf
            if self.mode == "reasoning":
                i = buf.find(THINK_END)
                if i >= 0:
                    if i:
                        out.append(Delta("reasoning", buf[:i]))
                    self._buf = buf[i + len(THINK_END):]
                    self.mode = "content"
                    continue
                keep = 0 if final else _partial_suffix(buf, THINK_END)
                if len(buf) > keep:
                    out.append(Delta("reasoning", buf[:len(buf) - keep]))
                self._buf = buf[len(buf) - keep:]
                break
            # content mode
            if self._may_open_think and not self._seen_content and not self.tool_calls:
                stripped = buf.lstrip()
                if stripped.startswith(THINK_START):          # the model opened a think block itself
                    self._buf = stripped[len(THINK_START):]
                    self.mode = "reasoning"
                    self._may_open_think = False
                    continue
                if not final and (not stripped or THINK_START.startswith(stripped)):
                    break                                      # could still become "<think>"
            if not self.parse_tools:
                self._content(out, buf)
                self._buf = ""
                break
            i = buf.find(TOOL_START)
            if i < 0:
                keep = 0 if final else _partial_suffix(buf, TOOL_START)
                self._content(out, buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                break
            self._content(out, buf[:i])
            j = buf.find(TOOL_END, i)
            if j < 0:
                if final:                                      # unclosed block: plain content
                    self._content(out, buf[i:])
                    self._buf = ""
                else:
                    self._buf = buf[i:]
                break
            end = j + len(TOOL_END)
            block, self._buf = buf[i:end], buf[end:]
            call = parse_tool_call(block, _schemas=self._schemas)
            if call is None:
                self._content(out, block)
            else:
                self._seen_content = True
                self._pending_ws = ""                          # whitespace around calls is dropped
                out.append(Delta("tool_call", call=call, index=len(self.tool_calls)))
                self.tool_calls.append(call)
        return out


def parse_tool_calls(text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[str | None, list[ToolCall]]:
    """Whole model output -> (content or None, tool calls). Malformed blocks stay in the content."""
    deltas = ChatOutputParser(tools=tools, parse_tools=True).parse(text)
    content = "".join(d.text for d in deltas if d.kind == "content")
    calls = [d.call for d in deltas if d.kind == "tool_call"]
    return (content if content or not calls else None), calls


def aggregate(deltas: Sequence[Delta], reasoning: bool) -> dict[str, Any]:
    """Deltas of a whole completion -> the OpenAI assistant message fields."""
    content = "".join(d.text for d in deltas if d.kind == "content")
    think = "".join(d.text for d in deltas if d.kind == "reasoning")
    calls = [d.call.to_openai() for d in deltas if d.kind == "tool_call"]
    msg: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning or think:
        msg["reasoning_content"] = think
    if calls:
        msg["tool_calls"] = calls
    return msg
