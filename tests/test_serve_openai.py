"""The real server (`python -m serve` in a subprocess, uvicorn) on the golden tiny Ling-3.0 model with
the byte-level tokenizer, driven by the official `openai` client.

Expected outputs come from a separate process that runs the same Engine directly (no x64, like the
server). Every distinct prompt length and max_tokens bucket compiles once, so the tests reuse the
server's warm-up shape: a one-turn chat whose prompt is 56 tokens long ("Hello" with thinking off;
"Hello!" with thinking on has the same length) and at most 16 new tokens, which is also the rest
of the context (--max-context 74), so the default max_tokens needs no new compile either. The
reference process starts once the server is up and reads the server's compiled programs from a
shared JAX persistent compilation cache instead of compiling them again.
"""
import json
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from conftest import LING_TINY
from serve.testing import REPO, ServerProcess, byte_level_tokenizer

MAX_CONTEXT = 74             # 56 prompt tokens + 16 new + 2
MSG_OFF = [{"role": "user", "content": "Hello"}]
MSG_ON = [{"role": "user", "content": "Hello!"}]
SEED, TEMP = 123, 0.8

REFERENCE = f"""
import json, os
from serve.testing import tiny_engine
from lingjax.sampling import SamplingParams
eng = tiny_engine({str(LING_TINY)!r}, dtype="float32", max_context={MAX_CONTEXT})
tok = eng.tokenizer
def run(prompt, **kw):
    r = eng.generate(prompt, max_tokens=16, **kw)
    text = r.text
    if r.finish_reason == "stop" and r.token_ids and r.token_ids[-1] in eng.stop_ids:
        tail = tok.decode([r.token_ids[-1]])
        text = text[:-len(tail)] if text.endswith(tail) else text
    return {{"text": text, "n": len(r.token_ids), "finish": r.finish_reason}}
off = tok.render_chat({MSG_OFF!r}, thinking=False)
on = tok.render_chat({MSG_ON!r}, thinking=True)
print(json.dumps({{"prompt_off": off, "prompt_on": on, "n_prompt": len(tok.encode(off)),
                  "off": run(off), "on": run(on),
                  "sampled": run(off, sampling=SamplingParams(temperature={TEMP}, seed={SEED}))}}))
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax-cache")),
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    server = ServerProcess(["--checkpoint", str(LING_TINY), "--tokenizer-byte-level", "--dtype", "float32",
                            "--max-context", str(MAX_CONTEXT), "--log-level", "warning"], env=cache).start()
    ref = None
    try:
        server.wait_ready(timeout=300)
        ref = subprocess.Popen([sys.executable, "-c", REFERENCE], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=server.env, text=True)
        out, err = ref.communicate(timeout=300)
        assert ref.returncode == 0, err[-3000:]
        r = json.loads(out.strip().splitlines()[-1])
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        yield SimpleNamespace(server=server, ref=r, client=client, model=model)
    finally:
        if ref is not None:
            ref.kill()
        code = server.stop()
        assert code == 0, server.log_text()[-3000:]


def off_kwargs(**kw):
    return {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}, **kw}


def test_health_models_and_loading_state(tiny):
    statuses = [s for s, _ in tiny.server.health_seen]
    assert statuses[-1] == 200
    loading = [json.loads(b) for s, b in tiny.server.health_seen if s == 503]
    assert loading and loading[0]["error"]["code"] == "loading"      # 503 while loading / warming up
    models = tiny.client.models.list().data
    assert [m.id for m in models] == ["ling3-tiny"]
    assert tiny.client.models.retrieve("ling3-tiny").id == "ling3-tiny"


def test_completion_greedy_equals_engine(tiny):
    ref = tiny.ref["off"]
    r = tiny.client.completions.create(model=tiny.model, prompt=tiny.ref["prompt_off"], max_tokens=16, temperature=0)
    assert r.choices[0].text == ref["text"]
    assert r.choices[0].finish_reason == ref["finish"]
    assert r.usage.prompt_tokens == tiny.ref["n_prompt"] == 56
    assert r.usage.completion_tokens == ref["n"]
    assert r.usage.total_tokens == 56 + ref["n"]
    # the same prompt as token ids, and as a one-element list
    ids = byte_level_tokenizer().encode(tiny.ref["prompt_off"])
    r2 = tiny.client.completions.create(model=tiny.model, prompt=ids, max_tokens=16, temperature=0)
    r3 = tiny.client.completions.create(model=tiny.model, prompt=[tiny.ref["prompt_off"]], max_tokens=16, temperature=0)
    assert r2.choices[0].text == r3.choices[0].text == ref["text"]


def test_chat_greedy_equals_engine_thinking_off_and_on(tiny):
    off = tiny.client.chat.completions.create(model=tiny.model, messages=MSG_OFF, max_tokens=16, temperature=0,
                                              **off_kwargs())
    assert off.choices[0].message.content == tiny.ref["off"]["text"]
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    assert off.usage.completion_tokens == tiny.ref["off"]["n"]
    on = tiny.client.chat.completions.create(model=tiny.model, messages=MSG_ON, max_tokens=16, temperature=0)
    text = tiny.ref["on"]["text"]
    think, sep, answer = text.partition("</think>")
    msg = on.choices[0].message
    assert msg.reasoning_content == think            # the completion starts inside <think>
    assert (msg.content or "") == answer
    assert on.choices[0].finish_reason == tiny.ref["on"]["finish"]


def test_streaming_with_usage(tiny):
    ref = tiny.ref["off"]
    chunks = list(tiny.client.completions.create(model=tiny.model, prompt=tiny.ref["prompt_off"], max_tokens=16,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref["n"]
    assert chunks[-1].usage.prompt_tokens == 56
    assert "".join(c.choices[0].text for c in chunks[:-1]) == ref["text"]
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == ref["finish"]
    assert all(c.usage is None for c in chunks[:-1])

    chat = list(tiny.client.chat.completions.create(model=tiny.model, messages=MSG_OFF, max_tokens=16, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}, **off_kwargs()))
    assert chat[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == ref["text"]
    assert chat[-1].choices == [] and chat[-1].usage.total_tokens == 56 + ref["n"]
    assert chat[-2].choices[0].finish_reason == ref["finish"]
    # without include_usage: no usage chunk
    plain = list(tiny.client.completions.create(model=tiny.model, prompt=tiny.ref["prompt_off"], max_tokens=16,
                                                temperature=0, stream=True))
    assert all(c.choices for c in plain)


def _pick_stop(text: str) -> str:
    for k in range(1, len(text)):
        if text[k].isascii() and text[k].isprintable() and not text[k].isspace():
            return text[k]
    pytest.skip(f"no usable stop character in {text!r}")


def test_stop_strings_and_max_tokens(tiny):
    text = tiny.ref["off"]["text"]
    stop = _pick_stop(text)
    expected = text[:text.find(stop)]
    for stops in (stop, [stop, "never-appears"]):
        r = tiny.client.completions.create(model=tiny.model, prompt=tiny.ref["prompt_off"], max_tokens=16,
                                           temperature=0, stop=stops)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
        s = tiny.client.completions.create(model=tiny.model, prompt=tiny.ref["prompt_off"], max_tokens=16,
                                           temperature=0, stop=stops, stream=True)
        assert "".join(c.choices[0].text for c in s) == expected
    r = tiny.client.completions.create(model=tiny.model, prompt=tiny.ref["prompt_off"], max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == min(4, tiny.ref["off"]["n"])
    if tiny.ref["off"]["n"] > 4:
        assert r.choices[0].finish_reason == "length"


def test_seed_reproducible_and_equal_to_engine(tiny):
    kw = dict(model=tiny.model, prompt=tiny.ref["prompt_off"], max_tokens=16, temperature=TEMP, seed=SEED)
    a = tiny.client.completions.create(**kw).choices[0].text
    b = tiny.client.completions.create(**kw).choices[0].text
    assert a == b == tiny.ref["sampled"]["text"]
    others = {tiny.client.completions.create(**{**kw, "seed": s}).choices[0].text for s in (1, 2, 3)}
    assert len(others | {a}) > 1
    # a greedy rerun after sampled requests is unchanged (no state pollution)
    g = tiny.client.completions.create(model=tiny.model, prompt=tiny.ref["prompt_off"], max_tokens=16, temperature=0)
    assert g.choices[0].text == tiny.ref["off"]["text"]


@pytest.mark.parametrize("extra", [{"temperature": 1e30}, {"temperature": 1e-30}, {"top_p": 1e-9},
                                   {"top_k": 10 ** 12}, {"top_k": -1, "top_p": 0.5}, {"seed": -(2 ** 63)},
                                   {"seed": 2 ** 63 - 1}])
def test_extreme_sampling_values(tiny, extra):
    body = {"prompt": tiny.ref["prompt_off"], "max_tokens": 16, "temperature": 0.7, "seed": 5, **extra}
    r = httpx.post(tiny.server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 56
    if extra.get("top_p") == 1e-9 or extra.get("temperature") == 1e-30:   # only the argmax survives
        assert r.json()["choices"][0]["text"] == tiny.ref["off"]["text"]


def test_default_max_tokens_is_the_rest_of_the_context(tiny):
    r = tiny.client.completions.create(model=tiny.model, prompt=tiny.ref["prompt_off"], temperature=0)
    room = MAX_CONTEXT - 56 - 2
    assert r.choices[0].text == tiny.ref["off"]["text"]          # room == 16: the reference request
    assert r.usage.completion_tokens == min(room, tiny.ref["off"]["n"])
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == room


def _err(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


def test_context_errors(tiny):
    with pytest.raises(openai.BadRequestError) as e:
        tiny.client.completions.create(model=tiny.model, prompt="a" * 200, max_tokens=4)
    err = _err(e.value)
    assert err["n_prompt_tokens"] == 200 and err["n_ctx"] == MAX_CONTEXT
    assert err["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        tiny.client.completions.create(model=tiny.model, prompt=tiny.ref["prompt_off"], max_tokens=17)
    assert _err(e.value)["param"] == "max_tokens" and _err(e.value)["n_prompt_tokens"] == 56
    with pytest.raises(openai.NotFoundError):
        tiny.client.completions.create(model="gpt-4", prompt="x", max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        tiny.client.completions.create(model=tiny.model, prompt="x", max_tokens=4, n=2)
    with pytest.raises(openai.BadRequestError):
        tiny.client.chat.completions.create(model=tiny.model, messages=MSG_OFF, logprobs=True)
    with pytest.raises(openai.BadRequestError):
        tiny.client.completions.create(model=tiny.model, prompt="x", temperature=-1)


def test_concurrent_clients_all_answered(tiny):
    """16 clients at once, queue of 8: each gets its full greedy answer or a 503, none hangs."""
    ref = tiny.ref["off"]
    results = [None] * 16

    def one(i):
        with httpx.Client(timeout=120) as c:
            r = c.post(tiny.server.url + "/v1/completions",
                       json={"prompt": tiny.ref["prompt_off"], "max_tokens": 16, "temperature": 0})
            results[i] = (r.status_code, r.json(), r.headers.get("retry-after"))
    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert all(r is not None for r in results)
    for status, body, retry in results:
        assert status in (200, 503)
        if status == 200:
            assert body["choices"][0]["text"] == ref["text"]
        else:
            assert retry is not None and body["error"]["code"] == "queue_full"
    assert len({b["id"] for s, b, _ in results if s == 200}) == sum(s == 200 for s, _, _ in results) >= 8


def test_disconnect_then_next_request(tiny):
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", tiny.server.url + "/v1/chat/completions",
                      json={"messages": MSG_OFF, "stream": True, "temperature": 0,
                            "chat_template_kwargs": {"enable_thinking": False}}) as r:
            assert r.status_code == 200
            next(r.iter_lines())       # the role chunk, then hang up
    r = tiny.client.chat.completions.create(model=tiny.model, messages=MSG_OFF, max_tokens=16, temperature=0,
                                           **off_kwargs())
    assert r.choices[0].message.content == tiny.ref["off"]["text"]


def test_metrics(tiny):
    # the worker updates its gauges after the last response has been sent (and a disconnected
    # stream of an earlier test may still be finishing): wait until the server is idle
    deadline = time.monotonic() + 60
    m = tiny.server.metrics()
    while (m["lingjax:num_requests_running"] or m["lingjax:num_requests_waiting"]) and time.monotonic() < deadline:
        time.sleep(0.2)
        m = tiny.server.metrics()
    assert m["lingjax:prompt_tokens_total"] >= 56
    assert m["lingjax:generation_tokens_total"] > 0
    assert m["lingjax:time_to_first_token_seconds_count"] > 0
    assert m["lingjax:inter_token_latency_seconds_count"] > 0
    assert m["lingjax:e2e_request_latency_seconds_count"] > 0
    assert m['lingjax:request_success_total{finished_reason="length"}'] > 0 or \
        m.get('lingjax:request_success_total{finished_reason="stop"}', 0) > 0
    assert m["lingjax:num_requests_running"] == 0 and m["lingjax:num_requests_waiting"] == 0
    for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
        assert m[f"lingjax:{name}_total"] == 0          # spec 'none' on this server
