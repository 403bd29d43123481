"""Chat requests -> prompt text (through the chat template) and model text -> assistant message.

- `chat_template_kwargs` become template variables; `enable_thinking` (or `thinking`) switches the
  generation prompt between `<think>` (thinking on, the default) and `<think></think>`.
- `tools` are rendered by the template (`tokenizer.render_chat(..., tools=...)`) unless
  `tool_choice` is "none". `tool_choice` "required" or a named function is enforced by appending
  `<tool_call>` (plus the name) to the prompt, closing an open think block first; the parser then
  reads that prefix as if the model had written it.
- `role: "tool"` messages and assistant `tool_calls` (JSON-string arguments) go to the template as
  is; `developer` messages are rendered as `system`.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from serve.errors import bad_request, not_supported
from serve.protocol import ChatCompletionRequest, ChatMessageIn
from serve.tool_calls import THINK_END, THINK_START, TOOL_START, ChatOutputParser, aggregate

_RESERVED_KWARGS = ("messages", "tools", "self")


@dataclasses.dataclass
class ChatPrompt:
    text: str
    reasoning: bool = False                       # the completion starts inside <think>
    prefix: str = ""                              # forced text at the end of `text` (tool_choice)
    tools: list[dict[str, Any]] | None = None     # tool specs for the parser; None: no tool parsing

    def parser(self) -> ChatOutputParser:
        return ChatOutputParser(reasoning=self.reasoning, tools=self.tools, prefix=self.prefix)


def _content_text(m: ChatMessageIn, i: int) -> str | None:
    if m.content is None or isinstance(m.content, str):
        return m.content
    parts = []
    for j, p in enumerate(m.content):
        if p.type != "text":
            raise not_supported(f"messages.{i}.content.{j}.type", f"content part type {p.type!r} (only 'text')")
        if p.text is None:
            raise bad_request("a text content part needs 'text'", param=f"messages.{i}.content.{j}.text")
        parts.append(p.text)
    return "".join(parts)


def message_dict(m: ChatMessageIn, i: int) -> dict[str, Any]:
    d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _content_text(m, i)}
    if m.name is not None:
        d["name"] = m.name
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        if m.role != "assistant":
            raise bad_request("only assistant messages can have tool_calls", param=f"messages.{i}.tool_calls")
        calls = []
        for j, tc in enumerate(m.tool_calls):
            args = tc.function.arguments
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    args = None
            if not isinstance(args, dict):
                raise bad_request("tool call arguments must be a JSON object (as a string)",
                                  param=f"messages.{i}.tool_calls.{j}.function.arguments")
            calls.append({"id": tc.id, "type": "function",
                          "function": {"name": tc.function.name, "arguments": json.dumps(args, ensure_ascii=False)}})
        d["tool_calls"] = calls
    return d


def build_chat_prompt(tokenizer, req: ChatCompletionRequest) -> ChatPrompt:
    """Render a chat request with the tokenizer's chat template (raises APIError 400)."""
    from lingjax.tokenizer import ChatTemplateError
    if tokenizer is None:
        raise bad_request("this model has no tokenizer/chat template: use /v1/completions with token ids",
                          param="messages")
    kwargs = dict(req.chat_template_kwargs or {})
    for k in _RESERVED_KWARGS:
        if k in kwargs:
            raise bad_request(f"chat_template_kwargs may not set {k!r}", param=f"chat_template_kwargs.{k}")
    thinking = True
    for k in ("thinking", "enable_thinking"):
        if k in kwargs:
            v = kwargs.pop(k)
            if not isinstance(v, bool):
                raise bad_request(f"chat_template_kwargs.{k} must be a boolean", param=f"chat_template_kwargs.{k}")
            thinking = v
    if "add_generation_prompt" in kwargs and not isinstance(kwargs["add_generation_prompt"], bool):
        raise bad_request("chat_template_kwargs.add_generation_prompt must be a boolean",
                          param="chat_template_kwargs.add_generation_prompt")

    choice = req.tool_choice
    named = choice.function.name if choice is not None and not isinstance(choice, str) else None
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    if choice is not None and choice not in ("none", "auto") and not tools:
        raise bad_request("tool_choice requires tools", param="tool_choice")
    if named is not None and named not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names {named!r}, which is not among the tools", param="tool_choice")
    if choice == "none":
        tools = None

    messages = [message_dict(m, i) for i, m in enumerate(req.messages)]
    try:
        text = tokenizer.render_chat(messages, thinking=thinking, tools=tools, **kwargs)
    except ChatTemplateError as e:
        raise bad_request(str(e), param="messages", code="chat_template_error") from None
    except (TypeError, ValueError) as e:  # e.g. an argument the template cannot render
        raise bad_request(f"cannot render the chat template: {e}", param="messages",
                          code="chat_template_error") from None

    reasoning = text.endswith(THINK_START)
    prefix = ""
    if tools and (choice == "required" or named is not None):
        if reasoning:
            text += THINK_END
            reasoning = False
        prefix = TOOL_START + (named or "")
        text += prefix
    return ChatPrompt(text, reasoning, prefix, tools)


def chat_message(text: str, prompt: ChatPrompt, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """Whole generated text -> (assistant message, finish_reason); tool calls -> "tool_calls"."""
    deltas = prompt.parser().parse(text)
    msg = aggregate(deltas, prompt.reasoning)
    if msg.get("tool_calls") and finish_reason == "stop":
        finish_reason = "tool_calls"
    return msg, finish_reason
