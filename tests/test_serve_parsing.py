"""Server pieces without a server: tool-call / reasoning parsing, stop hold-back, chat prompts."""
import json
import random

import pytest

from serve.chat import build_chat_prompt, chat_message
from serve.errors import APIError
from serve.output import CompletionText
from serve.protocol import ChatCompletionRequest
from serve.testing import byte_level_tokenizer
from serve.tool_calls import ChatOutputParser, aggregate, parse_tool_call, parse_tool_calls

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["location"]}}}
CALL = "<tool_call>get_weather<arg_key>location</arg_key><arg_value>Paris</arg_value></tool_call>"


def stream_parse(parser: ChatOutputParser, text: str, pieces: list[int]):
    """Feed `text` cut at `pieces` and return (deltas, aggregate)."""
    out, last = [], 0
    for cut in [*pieces, len(text)]:
        out += parser.feed(text[last:cut])
        last = cut
    out += parser.finish()
    return out


# ---- tool calls ---------------------------------------------------------------------------------
def test_well_formed_call():
    content, calls = parse_tool_calls(CALL, [WEATHER_TOOL])
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"location": "Paris"})]
    assert json.loads(calls[0].to_openai()["function"]["arguments"]) == {"location": "Paris"}
    assert calls[0].id.startswith("call_")


def test_values_follow_the_schema():
    text = ("<tool_call>get_weather\n<arg_key>location</arg_key>\n<arg_value>42</arg_value>\n"
            "<arg_key>days</arg_key><arg_value>3</arg_value>\n</tool_call>")
    _, [call] = parse_tool_calls(text, [WEATHER_TOOL])
    assert call.arguments == {"location": "42", "days": 3}     # string param stays a string
    _, [call] = parse_tool_calls("<tool_call>f<arg_key>a</arg_key><arg_value>{\"x\": [1, true]}</arg_value>"
                                 "<arg_key>b</arg_key><arg_value>not json</arg_value>"
                                 "<arg_key>c</arg_key><arg_value>NaN</arg_value></tool_call>")
    assert call.arguments == {"a": {"x": [1, True]}, "b": "not json", "c": "NaN"}
    assert json.loads(call.arguments_json) == call.arguments


def test_multiple_calls_and_content():
    text = f"Let me check.\n{CALL}\n" + CALL.replace("Paris", "Oslo") + "\n"
    content, calls = parse_tool_calls(text, [WEATHER_TOOL])
    assert content == "Let me check."
    assert [c.arguments["location"] for c in calls] == ["Paris", "Oslo"]
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("bad", [
    "<tool_call>get_weather<arg_key>location</arg_key><arg_value>Paris</arg_value>",          # unclosed
    "<tool_call><arg_key>location</arg_key><arg_value>Paris</arg_value></tool_call>",         # no name
    "<tool_call>get_weather<arg_key>location</arg_key>Paris</tool_call>",                     # no value
    "<tool_call>get_weather junk<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",    # bad name
    "<tool_call>get_weather<arg_key>a</arg_key><arg_value>1</arg_value>x</tool_call>",        # stray text
    "<tool_call>get_weather<arg_key>a</arg_key><arg_value>1</arg_value>"
    "<arg_key>a</arg_key><arg_value>2</arg_value></tool_call>",                               # repeated key
    "<tool_call>unknown_fn<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",          # undeclared
    "<tool_call></tool_call>",
])
def test_malformed_calls_are_content(bad):
    content, calls = parse_tool_calls("before " + bad, [WEATHER_TOOL])
    assert calls == []
    assert content == "before " + bad
    if bad.endswith("</tool_call>"):
        assert parse_tool_call(bad, [WEATHER_TOOL]) is None


def test_malformed_block_next_to_good_one():
    bad = "<tool_call>get_weather<arg_key>x</arg_key></tool_call>"
    content, calls = parse_tool_calls(bad + CALL, [WEATHER_TOOL])
    assert content == bad and [c.name for c in calls] == ["get_weather"]


def test_parsing_never_raises_on_noise():
    rng = random.Random(0)
    alphabet = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
                "<think>", "</think>", "get_weather", "location", "Paris", " ", "\n", "{", "}", "<", ">", "1"]
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        for reasoning in (False, True):
            whole = ChatOutputParser(reasoning=reasoning, tools=[WEATHER_TOOL]).parse(text)
            cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
            pieces = stream_parse(ChatOutputParser(reasoning=reasoning, tools=[WEATHER_TOOL]), text, cuts)
            a, b = aggregate(whole, reasoning), aggregate(pieces, reasoning)
            for m in (a, b):
                for c in m.get("tool_calls", []):
                    c.pop("id")
            assert a == b, text
            # nothing is lost: all text is accounted for in some field
            joined = (a.get("reasoning_content") or "") + (a.get("content") or "")
            assert len(joined) <= len(text)


def test_streamed_call_split_anywhere():
    text = "Sure." + CALL + CALL.replace("Paris", "Rome")
    for cut in range(len(text) + 1):
        p = ChatOutputParser(tools=[WEATHER_TOOL])
        deltas = stream_parse(p, text, [cut])
        calls = [d for d in deltas if d.kind == "tool_call"]
        assert [d.call.arguments["location"] for d in calls] == ["Paris", "Rome"]
        assert [d.index for d in calls] == [0, 1]
        assert "".join(d.text for d in deltas if d.kind == "content") == "Sure."


def test_partial_tag_is_held_back_then_released():
    p = ChatOutputParser(tools=[WEATHER_TOOL])
    assert [d.text for d in p.feed("Hi <tool_")] == ["Hi"]
    assert p.feed("cal") == []
    assert [d.text for d in p.feed("l is not a tag")] == [" <tool_call is not a tag"]


def test_reasoning_split_streamed():
    text = "The user greets me.</think>\n\nHello!"
    for cut in range(len(text) + 1):
        deltas = stream_parse(ChatOutputParser(reasoning=True), text, [cut])
        msg = aggregate(deltas, True)
        assert msg["reasoning_content"] == "The user greets me."
        assert msg["content"] == "\n\nHello!"


def test_reasoning_unfinished_and_model_opened_think():
    msg = aggregate(ChatOutputParser(reasoning=True).parse("still thinking"), True)
    assert msg == {"role": "assistant", "content": "", "reasoning_content": "still thinking"}
    msg = aggregate(ChatOutputParser(reasoning=False).parse("<think>hm</think>Hi"), False)
    assert msg["reasoning_content"] == "hm" and msg["content"] == "Hi"
    msg = aggregate(ChatOutputParser(reasoning=False).parse("Hi <think>x</think>"), False)
    assert msg["content"] == "Hi <think>x</think>" and "reasoning_content" not in msg


def test_reasoning_then_tool_call():
    msg, finish = chat_message("I need the weather.</think>" + CALL, _prompt([WEATHER_TOOL], thinking=True), "stop")
    assert finish == "tool_calls"
    assert msg["reasoning_content"] == "I need the weather."
    assert msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"location": "Paris"}'}


def test_without_tools_tool_text_is_content():
    msg, finish = chat_message(CALL, _prompt(None, thinking=False), "stop")
    assert finish == "stop" and msg["content"] == CALL and "tool_calls" not in msg


# ---- stop strings -------------------------------------------------------------------------------
def test_stop_holdback_never_sends_cut_text():
    t = CompletionText(["END"])
    sent = t.feed("abc E") + t.feed("N") + t.feed("x EN")
    assert sent == "abc ENx "            # "E", "EN" held while they could start "END"
    assert t.finish("abc ENx ", [1, 2], "stop") == ""
    t = CompletionText(["END"])
    assert t.feed("ab") + t.feed("cE") == "abc"
    assert t.finish("abc", [1], "stop") == ""    # engine cut at "END" spanning chunks


def test_stop_token_text_is_dropped():
    t = CompletionText([], stop_token_text=lambda i: "<|role_end|>" if i == 257 else None)
    assert t.feed("Hi") == "Hi"
    assert t.finish("Hi there<|role_end|>", [1, 2, 257], "stop") == " there"
    t = CompletionText([], stop_token_text=lambda i: "<|role_end|>" if i == 257 else None)
    assert t.finish("x<|role_end|>", [1, 2], "length") == "x<|role_end|>"


# ---- chat prompts: the tool round trip ---------------------------------------------------------
def _prompt(tools, thinking=True, messages=None, **kw):
    req = ChatCompletionRequest.model_validate({
        "messages": messages or [{"role": "user", "content": "What's the weather in Paris?"}],
        **({"tools": tools} if tools else {}),
        "chat_template_kwargs": {"enable_thinking": thinking}, **kw})
    return build_chat_prompt(byte_level_tokenizer(), req)


TOOLS_BLOCK = (
    "\n\n# Tools\nYou may call the functions below; each line is one JSON function spec.\n<tools>\n"
    + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n</tools>\nTo call a function, write <tool_call>NAME"
    "<arg_key>ARG</arg_key><arg_value>VALUE</arg_value></tool_call> with one arg_key/arg_value pair per "
    "argument; non-string values are written as JSON.")


def test_tool_round_trip_renders_per_template():
    # turn 1: the prompt lists the tool; the model's Ling tool call becomes an OpenAI tool call
    first = _prompt([WEATHER_TOOL], thinking=False)
    assert first.text == ("<role>SYSTEM</role>detailed thinking on" + TOOLS_BLOCK + "<|role_end|>"
                          "<role>HUMAN</role>What's the weather in Paris?<|role_end|>"
                          "<role>ASSISTANT</role>\n<think></think>")
    msg, finish = chat_message(CALL, first, "stop")
    assert finish == "tool_calls" and msg["content"] is None
    call = msg["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"location": "Paris"}
    # turn 2: the assistant message as the client sends it back, then the tool result
    history = [{"role": "user", "content": "What's the weather in Paris?"},
               {"role": "assistant", "content": msg["content"], "tool_calls": msg["tool_calls"]},
               {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature_c": 21, "sky": "clear"}'}]
    second = _prompt([WEATHER_TOOL], thinking=True, messages=history)
    assert second.text == (
        "<role>SYSTEM</role>detailed thinking on" + TOOLS_BLOCK + "<|role_end|>"
        "<role>HUMAN</role>What's the weather in Paris?<|role_end|>"
        "<role>ASSISTANT</role>" + CALL + "<|role_end|>"
        "<role>OBSERVATION</role>{\"temperature_c\": 21, \"sky\": \"clear\"}<|role_end|>"
        "<role>ASSISTANT</role>\n<think>")
    assert second.reasoning
    msg, finish = chat_message("It is clear.</think>It is 21 °C and clear in Paris.", second, "stop")
    assert finish == "stop" and msg["content"] == "It is 21 °C and clear in Paris."
    assert msg["reasoning_content"] == "It is clear." and "tool_calls" not in msg


def test_tool_choice():
    none = _prompt([WEATHER_TOOL], tool_choice="none")
    assert "<tools>" not in none.text and none.tools is None
    named = _prompt([WEATHER_TOOL], thinking=True,
                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.text.endswith("<think></think><tool_call>get_weather") and not named.reasoning
    msg, finish = chat_message("<arg_key>location</arg_key><arg_value>Oslo</arg_value></tool_call>", named, "stop")
    assert finish == "tool_calls" and json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"location": "Oslo"}
    required = _prompt([WEATHER_TOOL], thinking=False, tool_choice="required")
    assert required.text.endswith("<think></think><tool_call>")
    with pytest.raises(APIError) as e:
        _prompt([WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.status == 400
    with pytest.raises(APIError):
        _prompt(None, tool_choice="required")


@pytest.mark.parametrize("messages,kwargs", [
    ([{"role": "assistant", "content": None,
       "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}], {}),
    ([{"role": "user", "content": [{"type": "image_url"}]}], {}),
    ([{"role": "user", "content": "x"}], {"chat_template_kwargs": {"tools": []}}),
    ([{"role": "user", "content": "x"}], {"chat_template_kwargs": {"enable_thinking": "yes"}}),
    ([{"role": "user", "content": "{{ 1 }}"}], {"chat_template_kwargs": {"add_generation_prompt": 3}}),
])
def test_bad_chat_requests_are_400(messages, kwargs):
    req = ChatCompletionRequest.model_validate({"messages": messages, **kwargs})
    with pytest.raises(APIError) as e:
        build_chat_prompt(byte_level_tokenizer(), req)
    assert e.value.status == 400


def test_developer_role_and_text_parts():
    p = _prompt(None, thinking=False, messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}])
    assert p.text == ("<role>SYSTEM</role>Be brief.<|role_end|><role>HUMAN</role>Hi there<|role_end|>"
                      "<role>ASSISTANT</role>\n<think></think>")
