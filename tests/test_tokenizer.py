"""Tests for lingjax.tokenizer: encode/decode, streaming, chat templates, stop ids, loading."""
from __future__ import annotations

import json

import pytest
import tokenizers

from lingjax.tokenizer import (
    DEMO_SPECIAL_TOKENS,
    ChatTemplateError,
    StreamDecoder,
    Tokenizer,
    build_byte_level_tokenizer,
    load_tokenizer,
)

TEXTS = [
    "hello world",
    "  leading spaces and trailing  ",
    "line one\nline two\r\n\ttabbed\n\n",
    "héllo wörld — naïve café",
    "emoji 🎉👩‍👩‍👧 and CJK 你好，世界 and Hangul 안녕",
    "<role>HUMAN</role>hi<|role_end|><role>ASSISTANT</role>\n<think>",
    "",
]

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Ling is a mixture of experts language model with linear attention.",
    "def f(x):\n    return x * 2\n",
    "héllo wörld, 你好世界, emoji 🎉 and tabs\tand newlines\n",
]


@pytest.fixture(scope="module")
def byte_tok() -> Tokenizer:
    return Tokenizer(build_byte_level_tokenizer())


@pytest.fixture(scope="module")
def bpe_hf() -> tokenizers.Tokenizer:
    """A small byte-level BPE trained on a few lines, with the Ling special tokens."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=list(DEMO_SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 5, trainer=trainer)
    return tok


def _ling_dir(tmp_path, hf: tokenizers.Tokenizer, files=None):
    """Write a checkpoint dir with tokenizer.json and the given {name: json-or-text} files."""
    hf.save(str(tmp_path / "tokenizer.json"))
    for name, content in (files or {}).items():
        text = content if isinstance(content, str) else json.dumps(content)
        (tmp_path / name).write_text(text, encoding="utf-8")
    return tmp_path


# --- encode / decode ---------------------------------------------------------------------------

def test_byte_level_layout():
    hf = build_byte_level_tokenizer()
    assert hf.get_vocab_size() == 256 + len(DEMO_SPECIAL_TOKENS)
    assert set(hf.get_vocab()) == set(tokenizers.pre_tokenizers.ByteLevel.alphabet()) | set(
        DEMO_SPECIAL_TOKENS)
    for i, t in enumerate(DEMO_SPECIAL_TOKENS):
        assert hf.token_to_id(t) == 256 + i
    data = "a\n é🎉".encode()
    assert hf.encode("a\n é🎉").ids == list(data)  # byte b has id b


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_round_trip(byte_tok, text):
    ids = byte_tok.encode(text)
    assert byte_tok.decode(ids) == text
    assert all(0 <= i < byte_tok.vocab_size for i in ids)


def test_byte_level_special_tokens_are_single_ids(byte_tok):
    ids = byte_tok.encode("a<|role_end|>b<think></think>")
    assert ids == [ord("a"), 257, ord("b"), 260, 261]
    assert byte_tok.decode(ids, skip_special_tokens=True) == "ab"


def test_byte_level_saved_and_loaded(tmp_path):
    tok = load_tokenizer(_ling_dir(tmp_path, build_byte_level_tokenizer()))
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.token_to_id("<|mask|>") == 256 + len(DEMO_SPECIAL_TOKENS) - 1


@pytest.mark.parametrize("text", TEXTS)
def test_bpe_round_trip(bpe_hf, text):
    tok = Tokenizer(bpe_hf)
    ids = tok.encode(text)
    assert tok.decode(ids) == text


def test_bpe_merges_and_specials(bpe_hf):
    tok = Tokenizer(bpe_hf)
    assert len(tok.encode("The quick brown fox")) < len("The quick brown fox")  # merges used
    ids = tok.encode("hi<|role_end|>")
    assert ids[-1] == tok.token_to_id("<|role_end|>")
    assert tok.token_to_id("not-a-token") is None


# --- streaming ---------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["byte", "bpe"])
def test_stream_decoder_matches_decode(byte_tok, bpe_hf, which):
    tok = byte_tok if which == "byte" else Tokenizer(bpe_hf)
    for text in TEXTS:
        ids = tok.encode(text)
        dec = StreamDecoder(tok)
        pieces = [dec.feed(i) for i in ids]
        pieces.append(dec.flush())
        assert "".join(pieces) == tok.decode(ids) == text
        assert not any("\ufffd" in p for p in pieces)


def test_stream_decoder_holds_partial_utf8(byte_tok):
    dec = byte_tok.stream_decoder()
    out = [dec.feed(b) for b in "🎉é".encode()]  # 4 + 2 bytes, one token each
    assert out == ["", "", "", "🎉", "", "é"]


def test_stream_decoder_skip_special(byte_tok):
    ids = byte_tok.encode("a<|role_end|>b")
    dec = byte_tok.stream_decoder(skip_special_tokens=True)
    assert "".join(dec.feed(i) for i in ids) + dec.flush() == "ab"


def test_stream_decoder_flush_incomplete(byte_tok):
    dec = byte_tok.stream_decoder()
    assert dec.feed(ord("x")) == "x"
    assert dec.feed(0xF0) == ""  # stream ends mid-character
    assert dec.flush() == "\ufffd"
    assert dec.flush() == ""


# --- chat template: built-in Ling fallback -----------------------------------------------------

def test_chat_default_system_thinking_on(byte_tok):
    got = byte_tok.render_chat([{"role": "user", "content": "Hi"}])
    assert got == ("<role>SYSTEM</role>detailed thinking on<|role_end|>"
                   "<role>HUMAN</role>Hi<|role_end|><role>ASSISTANT</role>\n<think>")


def test_chat_multi_turn_thinking_off(byte_tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "Bye"}]},
    ]
    got = byte_tok.render_chat(messages, thinking=False)
    assert got == ("<role>SYSTEM</role>Be brief.<|role_end|><role>HUMAN</role>Hi<|role_end|>"
                   "<role>ASSISTANT</role>Hello!<|role_end|><role>HUMAN</role>Bye<|role_end|>"
                   "<role>ASSISTANT</role>\n<think></think>")


def test_chat_without_generation_prompt(byte_tok):
    got = byte_tok.render_chat([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert got.endswith("<role>HUMAN</role>Hi<|role_end|>")


def test_chat_tool_calls_and_observation(byte_tok):
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {
                "name": "weather", "arguments": '{"city": "Rome", "days": 2, "units": ["C"]}'}},
            {"name": "time", "arguments": {}},  # flat form, no arguments
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    got = byte_tok.render_chat(messages, tools=tools)
    assert got.startswith("<role>SYSTEM</role>detailed thinking on\n\n# Tools\n")
    assert "\n<tools>\n" + json.dumps(tools[0], ensure_ascii=False) + "\n</tools>\n" in got
    assert ("<role>ASSISTANT</role><tool_call>weather<arg_key>city</arg_key><arg_value>Rome"
            "</arg_value><arg_key>days</arg_key><arg_value>2</arg_value><arg_key>units</arg_key>"
            '<arg_value>["C"]</arg_value></tool_call><tool_call>time</tool_call><|role_end|>'
            "<role>OBSERVATION</role>sunny<|role_end|><role>ASSISTANT</role>\n<think>") in got
    # The rendered prompt encodes the protocol tags as single special ids.
    ids = byte_tok.encode(got)
    assert byte_tok.token_to_id("<tool_call>") in ids and byte_tok.decode(ids) == got


def test_chat_does_not_mutate_messages(byte_tok):
    call = {"function": {"name": "f", "arguments": '{"a": 1}'}}
    messages = [{"role": "assistant", "content": "x", "tool_calls": [call]}]
    byte_tok.render_chat(messages)
    assert call["function"]["arguments"] == '{"a": 1}'


def test_chat_errors(byte_tok):
    with pytest.raises(ChatTemplateError, match="unknown chat role: robot"):
        byte_tok.render_chat([{"role": "robot", "content": "beep"}])
    bad = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]
    with pytest.raises(ChatTemplateError, match="not valid JSON"):
        byte_tok.render_chat(bad)


# --- chat template: from the checkpoint --------------------------------------------------------

TEST_TEMPLATE = """\
{% for m in messages %}
[{{ m.role }}]{{ m.content }}{{ eos_token }}
{% endfor %}
{% if tools %}tools={{ tools | tojson }}
{% endif %}
{% if add_generation_prompt %}[assistant]{{ 'think' if enable_thinking else 'nothink' }}|{{ extra }}
{% endif %}"""


def test_checkpoint_jinja_template_is_used(tmp_path, byte_tok):
    d = _ling_dir(tmp_path, byte_tok.hf, {
        "chat_template.jinja": TEST_TEMPLATE,
        "tokenizer_config.json": {"eos_token": {"content": "<|endoftext|>"},
                                  "chat_template": "ignored: the .jinja file wins"}})
    tok = load_tokenizer(d)
    msgs = [{"role": "user", "content": "héllo"}]
    # trim_blocks/lstrip_blocks: block tags leave no blank lines or indentation.
    assert tok.render_chat(msgs, thinking=False, extra=7) == (
        "[user]héllo<|endoftext|>\n[assistant]nothink|7\n")
    got = tok.render_chat(msgs, tools=[{"name": "é"}], extra="x")
    assert 'tools=[{"name": "é"}]\n' in got and got.endswith("[assistant]think|x\n")


def test_template_from_tokenizer_config(tmp_path, byte_tok):
    d = _ling_dir(tmp_path, byte_tok.hf, {"tokenizer_config.json": {
        "bos_token": "<B>", "chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}"}]}})
    assert load_tokenizer(d).render_chat([{"role": "user", "content": "x"}]) == "<B>x"


@pytest.mark.parametrize("source", [
    "{{ ''.__class__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.append(1) }}",
    "{{ cycler.__init__.__globals__ }}",
])
def test_sandbox_blocks_unsafe_access(source, byte_tok):
    tok = Tokenizer(byte_tok.hf, chat_template=source)
    with pytest.raises(ChatTemplateError, match="sandbox"):
        tok.render_chat([{"role": "user", "content": "x"}])


def test_template_raise_exception(byte_tok):
    tok = Tokenizer(byte_tok.hf, chat_template="{{ raise_exception('no system role allowed') }}")
    with pytest.raises(ChatTemplateError, match="no system role allowed"):
        tok.render_chat([])


# --- loading and stop ids ----------------------------------------------------------------------

def test_stop_ids_from_configs(tmp_path, byte_tok):
    d = _ling_dir(tmp_path, byte_tok.hf, {"config.json": {"eos_token_id": 5},
                                          "generation_config.json": {"eos_token_id": [5, 7, 257]}})
    tok = load_tokenizer(d)
    assert tok.stop_token_ids == (5, 7, 256, 257)
    assert tok.chat_template is None  # no template shipped: the Ling fallback is used


def test_stop_ids_without_configs(bpe_hf):
    tok = Tokenizer(bpe_hf)
    assert tok.stop_token_ids == tuple(sorted(
        [tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|role_end|>")]))
    plain = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, "[UNK]"))
    assert Tokenizer(plain, eos_token_ids=[1]).stop_token_ids == (1,)


def test_missing_tokenizer_json(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in .*tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path / "does-not-exist")
