"""The app in-process (Starlette TestClient, scripted engine): health states, the OpenAPI document."""
import asyncio
import threading
import time

from fastapi.testclient import TestClient

from serve.app import create_app
from serve.testing import ScriptedEngine
from serve.worker import EngineWorker, Job


def wait_for(pred, timeout=10.0):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if pred():
            return True
        time.sleep(0.01)
    return False


def test_health_loading_ready_shutting_down():
    gate = threading.Event()

    def factory():
        gate.wait(10)
        return ScriptedEngine()
    worker = EngineWorker(factory, warmup=True)
    app = create_app(worker, model_name="m", shutdown_grace_s=0)
    with TestClient(app) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading" and r.headers["retry-after"]
        r = c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading" and r.headers["retry-after"]
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] is None
        gate.set()
        assert wait_for(lambda: c.get("/health").status_code == 200)
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] == 512
        assert c.post("/v1/completions", json={"prompt": "<<<ok>>>"}).json()["choices"][0]["text"] == "ok"
        app.state.serve.begin_shutdown()            # what SIGTERM does first
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        r = c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert worker.state == "stopped" and not worker.alive


def test_failed_load_is_reported():
    fatal = []

    def factory():
        raise FileNotFoundError("no such checkpoint")
    worker = EngineWorker(factory, on_fatal=fatal.append)
    with TestClient(create_app(worker)) as c:
        assert wait_for(lambda: worker.state == "failed")
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "failed"
        assert c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}).status_code == 503
    assert isinstance(fatal[0], FileNotFoundError)


def test_openapi_has_no_422_and_documents_errors():
    app = create_app(EngineWorker(ScriptedEngine))
    doc = app.openapi()
    assert "422" not in str(doc["paths"]) and "HTTPValidationError" not in doc["components"]["schemas"]
    post = doc["paths"]["/v1/chat/completions"]["post"]
    assert {"200", "400", "401", "404", "503"} <= set(post["responses"])
    assert set(post["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}


def test_cancelled_while_queued_never_runs():
    engine = ScriptedEngine(chunk_delay_s=0.05)
    worker = EngineWorker(lambda: engine, warmup=False, max_queue=2)
    app = create_app(worker)
    with TestClient(app) as c:
        assert wait_for(lambda: worker.ready)
        results = {}

        def long():
            results["long"] = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 40})
        t = threading.Thread(target=long)
        t.start()
        assert wait_for(lambda: worker.running)
        m = worker.metrics
        before = m.prompt_tokens._value.get()
        loop = asyncio.new_event_loop()
        job = Job([1, 2, 3], sampling=None, max_tokens=4, loop=loop)
        worker.submit(job)
        job.cancel("client")
        t.join(10)
        assert wait_for(lambda: not worker.running and worker.waiting == 0)
        assert results["long"].status_code == 200
        assert m.prompt_tokens._value.get() == before   # the cancelled job never reached the engine
        loop.close()
