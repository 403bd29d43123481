"""Tokenizer and chat template: HF `tokenizers` for ids <-> text, sandboxed jinja2 for chat prompts.

`load_tokenizer(dir)` reads a checkpoint's tokenizer files; `Tokenizer.render_chat` renders the
checkpoint's chat template the way HF transformers does, or a built-in Ling-format fallback;
`StreamDecoder` turns a stream of ids into text without splitting multi-byte characters;
`build_byte_level_tokenizer` makes the 256-byte tokenizer of the small embedded demo model.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

ENDOFTEXT = "<|endoftext|>"
ROLE_END = "<|role_end|>"
DEFAULT_SYSTEM = "detailed thinking on"

#: Special tokens of the byte-level demo tokenizer, in id order (ids 256, 257, ...).
DEMO_SPECIAL_TOKENS: tuple[str, ...] = (
    ENDOFTEXT, ROLE_END, "<role>", "</role>", "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<|mask|>",
)

# Names HF passes to chat templates from tokenizer_config.json when they are defined there.
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")

# The fallback Ling chat template. Our own convention for tools (the published template may
# differ): the tool specs are listed one JSON object per line inside <tools></tools>, appended to
# the system text; assistant tool calls are GLM-4.7-style XML
#   <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>
# with string values verbatim and other values as JSON; tool results are
#   <role>OBSERVATION</role>{content}<|role_end|>.
LING_FALLBACK_TEMPLATE = (
    "{%- set ns = namespace(system=none, start=0) -%}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{%- set ns.system = messages[0].content -%}{%- set ns.start = 1 -%}"
    "{%- endif -%}"
    "<role>SYSTEM</role>{{ ns.system if ns.system is not none else '" + DEFAULT_SYSTEM + "' }}"
    "{%- if tools -%}"
    "{{ '\\n\\n# Tools\\nYou may call the functions below; each line is one JSON function spec.\\n"
    "<tools>\\n' }}"
    "{%- for tool in tools -%}{{ tool | tojson }}{{ '\\n' }}{%- endfor -%}"
    "{{ '</tools>\\nTo call a function, write <tool_call>NAME<arg_key>ARG</arg_key>"
    "<arg_value>VALUE</arg_value></tool_call> with one arg_key/arg_value pair per argument; "
    "non-string values are written as JSON.' }}"
    "{%- endif -%}"
    "<|role_end|>"
    "{%- for m in messages[ns.start:] -%}"
    "{%- if m.role == 'user' -%}<role>HUMAN</role>{{ m.content }}<|role_end|>"
    "{%- elif m.role == 'system' -%}<role>SYSTEM</role>{{ m.content }}<|role_end|>"
    "{%- elif m.role == 'tool' -%}<role>OBSERVATION</role>{{ m.content }}<|role_end|>"
    "{%- elif m.role == 'assistant' -%}<role>ASSISTANT</role>{{ m.content }}"
    "{%- for tc in m.tool_calls or [] -%}"
    "<tool_call>{{ tc.function.name }}"
    "{%- for k, v in (tc.function.arguments or {}).items() -%}"
    "<arg_key>{{ k }}</arg_key><arg_value>{{ v if v is string else v | tojson }}</arg_value>"
    "{%- endfor -%}"
    "</tool_call>"
    "{%- endfor -%}"
    "<|role_end|>"
    "{%- else -%}{{ raise_exception('unknown chat role: ' ~ m.role) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "<role>ASSISTANT</role>{{ '\\n<think>' if enable_thinking else '\\n<think></think>' }}"
    "{%- endif -%}"
)


class ChatTemplateError(ValueError):
    """The chat template raised an error, or tried something the sandbox forbids."""


class _Sandbox(ImmutableSandboxedEnvironment):
    """HF's sandbox, except that unsafe attribute access raises instead of rendering as ''."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """`tojson` as HF chat templates expect it: no HTML escaping, unicode kept as is."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _normalize_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Copy a message for a template: None/text-part content becomes a string; each tool call
    gets a `function` dict (flat {name, arguments} calls too) with JSON-string arguments parsed."""
    m = dict(message)
    content = m.get("content")
    if content is None:
        m["content"] = ""
    elif isinstance(content, list):
        m["content"] = "".join(p.get("text", "") for p in content
                               if isinstance(p, Mapping) and p.get("type", "text") == "text")
    calls = []
    for call in m.get("tool_calls") or ():
        call = dict(call)
        fn = call["function"] = dict(call.get("function", call))
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
            except json.JSONDecodeError as e:
                raise ChatTemplateError(f"tool call arguments are not valid JSON: {e}") from e
        calls.append(call)
    if calls:
        m["tool_calls"] = calls
    return m


class Tokenizer:
    """HF `tokenizers.Tokenizer` plus stop ids and a chat template."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, chat_template: str | None = None,
                 special_tokens: Mapping[str, str] | None = None,
                 eos_token_ids: Iterable[int] = ()):
        """`special_tokens`: e.g. {"bos_token": ..., "eos_token": ...} for the template;
        `eos_token_ids`: ids from config.json / generation_config.json."""
        self.hf = tokenizer
        self.chat_template = chat_template  # None: the built-in Ling fallback is used
        self.special_tokens = dict(special_tokens or {})
        stops = set(int(i) for i in eos_token_ids)
        stops.update(i for t in (ENDOFTEXT, ROLE_END) if (i := self.token_to_id(t)) is not None)
        self._stop_token_ids = tuple(sorted(stops))
        self._template = _compile_template(chat_template or LING_FALLBACK_TEMPLATE)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        return load_tokenizer(path)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added/special tokens included."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Sorted ids that end generation: config eos ids plus <|endoftext|> and <|role_end|>."""
        return self._stop_token_ids

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special-token strings in `text` become their single ids; `add_special_tokens` only
        controls the post-processor (e.g. a BOS token)."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True, thinking: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """Render OpenAI-style messages to a prompt string.

        Template variables follow HF: messages, tools, add_generation_prompt, the special tokens
        of tokenizer_config.json, `enable_thinking=thinking`, then `kwargs` (which win).
        """
        variables = {**self.special_tokens, "messages": [_normalize_message(m) for m in messages],
                     "tools": list(tools) if tools else None,
                     "add_generation_prompt": add_generation_prompt,
                     "enable_thinking": thinking, **kwargs}
        try:
            return self._template.render(**variables)
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(f"chat template blocked by the sandbox: {e}") from e
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[int]:
        """`encode(render_chat(messages, **kwargs))`."""
        return self.encode(self.render_chat(messages, **kwargs))


class StreamDecoder:
    """Incremental detokenizer: `feed(id)` returns the text completed by that token.

    Text is held back while the decoded tail ends in U+FFFD (an incomplete UTF-8 sequence from
    byte-level tokens). A small window of previous tokens is re-decoded with the new ones, so
    decoders that depend on context (leading spaces) stay right. `flush()` returns what is held.
    """

    def __init__(self, tokenizer: Tokenizer | tokenizers.Tokenizer,
                 skip_special_tokens: bool = False):
        self._hf = tokenizer.hf if isinstance(tokenizer, Tokenizer) else tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # tokens before this have been emitted

    def _decode(self, start: int, end: int) -> str:
        return self._hf.decode(self.ids[start:end], skip_special_tokens=self._skip)

    def feed(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        """Emit whatever is held back (possibly with U+FFFD if the stream ended mid-character)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        seen = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix, len(self.ids))
        if len(text) > len(seen) and (final or not text.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self.ids)
            return text[len(seen):]
        if final:
            self._prefix = self._read = len(self.ids)
        return ""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: printable Latin-1 bytes map to themselves, the other bytes to
    chr(256), chr(257), ... in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in keep}
    extra = (b for b in range(256) if b not in mapping)
    mapping.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return dict(sorted(mapping.items()))


def build_byte_level_tokenizer(
        special_tokens: Sequence[str] = DEMO_SPECIAL_TOKENS) -> tokenizers.Tokenizer:
    """A byte-level tokenizer without merges: byte b has id b (0..255), then `special_tokens`
    get ids 256, 257, ... . Any UTF-8 text round-trips exactly."""
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                            use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                            for t in special_tokens])
    for i, t in enumerate(special_tokens):
        if tok.token_to_id(t) != 256 + i:
            raise ValueError(f"special token {t!r} did not get id {256 + i} (duplicate?)")
    return tok


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _eos_ids(config: Mapping[str, Any]) -> list[int]:
    eos = config.get("eos_token_id")
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or {"content": ...} objects."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _config_template(value: Any) -> str | None:
    """`chat_template` may be a string or a list of {"name", "template"}; take "default"."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        return named.get("default")
    return value if isinstance(value, str) else None


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load tokenizer.json, plus tokenizer_config.json, chat_template.jinja, config.json and
    generation_config.json when present, from a checkpoint directory."""
    root = Path(path)
    if root.is_file() and root.name == "tokenizer.json":
        root = root.parent
    tok_file = root / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(
            f"no tokenizer.json in {str(root)!r}: expected a Hugging Face checkpoint directory "
            "holding tokenizer.json (the HF `tokenizers` format); pass the directory that has it")
    hf = tokenizers.Tokenizer.from_file(str(tok_file))
    tok_config = _read_json(root / "tokenizer_config.json")
    template_file = root / "chat_template.jinja"
    if template_file.is_file():
        template = template_file.read_text(encoding="utf-8")
    else:
        template = _config_template(tok_config.get("chat_template"))
    special = {k: t for k in _SPECIAL_TOKEN_KEYS if (t := _token_text(tok_config.get(k)))}
    eos = _eos_ids(_read_json(root / "config.json"))
    eos += _eos_ids(_read_json(root / "generation_config.json"))
    return Tokenizer(hf, chat_template=template, special_tokens=special, eos_token_ids=eos)
