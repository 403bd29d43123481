"""HTTP behaviour of the real server process (uvicorn) with the scripted engine (`--fake-engine`):
tool calls and reasoning through the openai client, queueing, disconnects, API keys, SIGTERM,
and the load-test script. The scripted engine "generates" the text between <<< and >>> in the
prompt (else the prompt's tail, repeated), in chunks of --chunk-steps tokens every
--fake-chunk-delay seconds, so timing-sensitive behaviour is deterministic and fast.
"""
import contextlib
import io
import json
import signal
import threading
import time

import httpx
import openai
import pytest

from bench import load_test
from serve.testing import ServerProcess

CHUNK_DELAY = 0.02
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}
CALL = "<tool_call>get_weather<arg_key>location</arg_key><arg_value>Paris</arg_value></tool_call>"


def fake_server(*extra: str) -> ServerProcess:
    return ServerProcess(["--fake-engine", "--fake-chunk-delay", str(CHUNK_DELAY), "--chunk-steps", "4",
                          "--max-context", "1024", "--log-level", "warning", *extra])


@pytest.fixture(scope="module")
def fake():
    with fake_server("--max-queue", "8") as s:
        yield s


@pytest.fixture(scope="module")
def client(fake):
    return openai.OpenAI(base_url=fake.url + "/v1", api_key="unused", max_retries=0, timeout=60)


# ---- tool calls and reasoning through the openai client ------------------------------------------
def test_tool_call_round_trip(client):
    messages = [{"role": "user", "content": f"Weather in Paris? <<<I should call the tool.</think>{CALL}>>>"}]
    r = client.chat.completions.create(model="lingjax-fake", messages=messages, tools=[WEATHER_TOOL])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.reasoning_content == "I should call the tool."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"location": "Paris"}

    # the same, streamed: tool-call deltas
    stream = client.chat.completions.create(model="lingjax-fake", messages=messages, tools=[WEATHER_TOOL], stream=True)
    calls, finish, reasoning = {}, None, ""
    for chunk in stream:
        d = chunk.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        for tc in d.tool_calls or ():
            slot = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            slot["name"] += tc.function.name or ""
            slot["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and reasoning == "I should call the tool."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"location": "Paris"})]

    # turn 2: the assistant message as returned, the tool result, then the final answer
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C <<<Done.</think>It is sunny.>>>"}]
    r2 = client.chat.completions.create(model="lingjax-fake", messages=messages, tools=[WEATHER_TOOL])
    assert r2.choices[0].message.content == "It is sunny." and r2.choices[0].finish_reason == "stop"
    assert r2.choices[0].message.tool_calls is None


def test_malformed_tool_call_is_plain_content(client):
    bad = "<tool_call>get_weather<arg_key>location</arg_key>Paris</tool_call>"
    r = client.chat.completions.create(model="lingjax-fake", tools=[WEATHER_TOOL],
                                       messages=[{"role": "user", "content": f"<<<{bad}>>>"}],
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == bad and r.choices[0].finish_reason == "stop"
    assert not r.choices[0].message.tool_calls


def test_tool_choice_named_is_enforced(client):
    r = client.chat.completions.create(
        model="lingjax-fake", tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        messages=[{"role": "user", "content": "<<<<arg_key>location</arg_key><arg_value>Oslo</arg_value></tool_call>>>>"}])
    [call] = r.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"location": "Oslo"} and r.choices[0].finish_reason == "tool_calls"


def test_reasoning_streamed_separately(client):
    msgs = [{"role": "user", "content": "<<<Greeting back is polite.</think>Hello there!>>>"}]
    parts = {"reasoning": "", "content": ""}
    for chunk in client.chat.completions.create(model="lingjax-fake", messages=msgs, stream=True):
        if chunk.choices:
            d = chunk.choices[0].delta
            parts["reasoning"] += getattr(d, "reasoning_content", None) or ""
            parts["content"] += d.content or ""
    assert parts == {"reasoning": "Greeting back is polite.", "content": "Hello there!"}


def test_stop_string_split_across_chunks_is_not_streamed(client):
    # chunks of 4 tokens: "abcdEN" | "Dxyz": the stop "END" spans two chunks
    r = client.completions.create(model="lingjax-fake", prompt="<<<abcdENDxyz>>>", stop=["END"], stream=True)
    assert "".join(c.choices[0].text for c in r) == "abcd"


# ---- queueing and cancellation ---------------------------------------------------------------------
def test_16_concurrent_clients_with_queue_of_8(fake):
    before = fake.metrics()
    results: list = [None] * 16

    def one(i):
        body = {"messages": [{"role": "user", "content": f"<<<reply number {i} " + "x" * 40 + ">>>"}],
                "chat_template_kwargs": {"enable_thinking": False}, "stream": i % 2 == 0}
        with httpx.Client(timeout=60) as c:
            r = c.post(fake.url + "/v1/chat/completions", json=body)
            if r.status_code == 200 and body["stream"]:
                text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                               for line in r.text.splitlines()
                               if line.startswith("data: {") and json.loads(line[6:])["choices"])
            elif r.status_code == 200:
                text = r.json()["choices"][0]["message"]["content"]
            else:
                text = r.json()
            results[i] = (r.status_code, text, r.headers.get("retry-after"))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(r is not None for r in results), "a request hung"
    ok = [i for i, r in enumerate(results) if r[0] == 200]
    busy = [i for i, r in enumerate(results) if r[0] == 503]
    assert len(ok) + len(busy) == 16
    assert len(ok) >= 8 and busy, (len(ok), len(busy))
    for i in ok:           # every answer is complete and its own: nothing lost, mixed or duplicated
        assert results[i][1] == f"reply number {i} " + "x" * 40
    for i in busy:
        assert results[i][2] is not None and results[i][1]["error"]["code"] == "queue_full"
    after = fake.metrics()
    done = sum(after[k] - before.get(k, 0) for k in after if k.startswith("lingjax:request_success_total"))
    assert done == len(ok)
    assert after['lingjax:request_rejected_total{reason="queue_full"}'] - \
        before.get('lingjax:request_rejected_total{reason="queue_full"}', 0) == len(busy)


def _aborted(m):
    return m.get('lingjax:request_aborted_total{reason="client"}', 0)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_the_device_within_a_chunk(fake, stream):
    """An 800-token request takes 200 chunks x 20 ms = 4 s; hanging up after its first chunk must let
    the next request (3 chunks) start within about a chunk instead of after the rest of those 4 s."""
    before = fake.metrics()
    body = {"prompt": "long one", "max_tokens": 800, "stream": stream}
    with httpx.Client(timeout=httpx.Timeout(60, read=0.3 if not stream else 60)) as c:
        if stream:
            with c.stream("POST", fake.url + "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: {"))
        else:
            with pytest.raises(httpx.ReadTimeout):
                c.post(fake.url + "/v1/completions", json=body)
    t0 = time.monotonic()
    r = httpx.post(fake.url + "/v1/completions", json={"prompt": "<<<next>>>", "max_tokens": 8}, timeout=60)
    elapsed = time.monotonic() - t0
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "next"
    assert elapsed < 2.0, elapsed        # typically ~0.1 s; without cancellation it would be > 3.5 s
    after = fake.metrics()
    assert _aborted(after) - _aborted(before) == 1
    generated = after["lingjax:generation_tokens_total"] - before["lingjax:generation_tokens_total"]
    assert generated < 400, generated


def test_errors_are_envelopes(fake):
    with httpx.Client(timeout=30) as c:
        cases = [
            (c.post(fake.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400),
            (c.post(fake.url + "/v1/completions", json={"prompt": "x", "max_tokens": "9"}), 400),
            (c.post(fake.url + "/v1/completions", json={"prompt": "x", "stream": "yes"}), 400),
            (c.post(fake.url + "/v1/completions", json={"prompt": ["a", "b"]}), 400),
            (c.post(fake.url + "/v1/completions", json={"prompt": "x", "n": 3}), 400),
            (c.post(fake.url + "/v1/completions", json={"prompt": "x", "logprobs": 2}), 400),
            (c.post(fake.url + "/v1/completions", json={"prompt": "x", "top_p": 1.5}), 400),
            (c.post(fake.url + "/v1/completions", json={"prompt": "x", "temperature": -0.5}), 400),
            (c.post(fake.url + "/v1/completions", json={"prompt": "x", "model": "nope"}), 404),
            (c.post(fake.url + "/v1/chat/completions", json={"messages": "hi"}), 400),
            (c.post(fake.url + "/v1/chat/completions", json={"messages": []}), 400),
            (c.get(fake.url + "/v2/anything"), 404),
            (c.delete(fake.url + "/v1/models"), 405),
        ]
        for r, status in cases:
            assert r.status_code == status, (r.request.url, r.text)
            body = r.json()
            assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
            assert "Traceback" not in r.text
        r = c.post(fake.url + "/v1/completions", json={"prompt": "x", "temperature": -0.5})
        assert r.json()["error"]["param"] == "temperature"


# ---- API key -----------------------------------------------------------------------------------------
def test_api_key():
    with fake_server("--api-key", "s3cret") as s:
        assert httpx.get(s.url + "/health").status_code == 200          # probes stay open
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "<<<x>>>"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0)
        assert ok.completions.create(model="lingjax-fake", prompt="<<<hi>>>").choices[0].text == "hi"


# ---- SIGTERM -----------------------------------------------------------------------------------------
def _start_stream(url, body, lines: list, started: threading.Event):
    def run():
        with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    started.set()
    t = threading.Thread(target=run)
    t.start()
    return t


def _post_later(url, body, out: list):
    def run():
        try:
            out.append(httpx.post(url + "/v1/completions", json=body, timeout=60))
        except httpx.HTTPError as e:
            out.append(e)
    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.parametrize("grace,finishes", [(10.0, True), (0.5, False)])
def test_sigterm_graceful_shutdown(grace, finishes):
    """SIGTERM: waiting requests get 503, the running one finishes within the grace period (or is
    aborted with an error event after it), and the process exits 0."""
    s = fake_server("--shutdown-timeout", str(grace), "--max-queue", "2").start().wait_ready()
    try:
        lines, started, queued = [], threading.Event(), []
        t1 = _start_stream(s.url, {"prompt": "abc", "max_tokens": 160, "stream": True}, lines, started)  # ~0.8 s
        assert started.wait(10)
        t2 = _post_later(s.url, {"prompt": "<<<queued>>>"}, queued)
        deadline = time.monotonic() + 5
        while s.metrics()["lingjax:num_requests_waiting"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        t1.join(30)
        t2.join(30)
        assert s.proc.wait(30) == 0, s.log_text()[-3000:]
        assert time.monotonic() - t0 < grace + 5
        assert isinstance(queued[0], httpx.Response) and queued[0].status_code == 503
        assert queued[0].json()["error"]["code"] == "shutting_down"
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(x[6:]) for x in lines[:-1]]
        if finishes:
            assert events[-1]["choices"][0]["finish_reason"] == "length"
            assert sum(len(e["choices"][0]["text"]) for e in events) == 160
        else:
            assert events[-1]["error"]["code"] == "shutting_down"
    finally:
        s.stop(signal.SIGKILL)


# ---- the load-test script ------------------------------------------------------------------------
def test_load_test_script(fake):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = load_test.main(["--url", fake.url, "--concurrency", "3", "--num-requests", "6", "--max-tokens", "12",
                               "--endpoint", "completions"])
    text = out.getvalue().splitlines()
    assert code == 0, text
    res = json.loads(text[-1])
    assert res["ok"] == 6 and res["errors"] == 0 and res["output_tokens"] == 72
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert res[key]["n"] == 6 and res[key]["p50"] <= res[key]["p90"] <= res[key]["p99"]
    assert any(line.startswith("TTFT") for line in text)
