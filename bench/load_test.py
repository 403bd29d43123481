"""Load test for a running lingjax server (or any OpenAI-compatible server).

    python -m bench.load_test --url http://127.0.0.1:8000 --concurrency 4 --num-requests 32

N client threads send streaming requests (SSE, `stream_options.include_usage`) back to back until
`--num-requests` have been sent, then it prints a table of latency percentiles and one JSON line:
TTFT (time to the first generated text), TPOT ((end - first token) / (output tokens - 1)), ITL
(gaps between streamed deltas, which arrive per device chunk), end-to-end latency, throughput, and
how many requests were rejected with 503 (queue full) or failed (`--retry-503` resends them after
Retry-After instead). Standard library only.

The lingjax server runs one request at a time (batch 1): with concurrency > 1 the extra requests
wait in its queue, so TTFT includes queueing time, and more than `--max-queue` + 1 concurrent
clients get 503s. Every distinct prompt length compiles once on the server, so the default is
one fixed prompt, sent `--warmup` times before measuring.
"""
from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
import urllib.parse

DEFAULT_COMPLETION_PROMPT = "def fibonacci(n):\n    "
DEFAULT_CHAT_PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize(values: list[float]) -> dict[str, float | None]:
    ms = [x * 1000.0 for x in values]
    return {"mean": sum(ms) / len(ms) if ms else None, "p50": percentile(ms, 50), "p90": percentile(ms, 90),
            "p99": percentile(ms, 99), "n": len(ms)}


class Client:
    def __init__(self, url: str, api_key: str | None, timeout: float):
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https"):
            raise ValueError(f"--url must be http(s)://host:port, got {url!r}")
        self.https = u.scheme == "https"
        self.host, self.port = u.hostname, u.port or (443 if self.https else 80)
        self.base = u.path.rstrip("/")
        self.headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout

    def conn(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout)

    def get_json(self, path: str):
        c = self.conn()
        try:
            c.request("GET", self.base + path, headers=self.headers)
            r = c.getresponse()
            return r.status, json.loads(r.read() or b"null")
        finally:
            c.close()

    def run(self, path: str, body: dict, stream: bool, retry_503: bool = False) -> dict:
        """One request -> {ok, status, error, ttft, e2e, tokens, gaps, retries}; latencies include retries."""
        t0 = time.perf_counter()
        retries = 0
        while True:
            rec = self._once(path, body, stream, t0)
            if rec["status"] != 503 or not retry_503:
                rec["retries"] = retries
                return rec
            retries += 1
            time.sleep(min(max(rec["retry_after"], 0.05), 5.0))

    def _once(self, path: str, body: dict, stream: bool, t0: float) -> dict:
        rec = {"ok": False, "status": None, "error": None, "ttft": None, "e2e": None, "tokens": 0, "gaps": [],
               "retry_after": 1.0}
        c = self.conn()
        try:
            c.request("POST", self.base + path, body=json.dumps(body).encode(), headers=self.headers)
            r = c.getresponse()
            rec["status"] = r.status
            if r.status != 200:
                try:
                    rec["retry_after"] = float(r.getheader("Retry-After") or 1.0)
                except ValueError:
                    pass
                rec["error"] = f"HTTP {r.status}: {r.read()[:200].decode('utf-8', 'replace')}"
                return rec
            if not stream:
                data = json.loads(r.read())
                rec["e2e"] = time.perf_counter() - t0
                rec["tokens"] = (data.get("usage") or {}).get("completion_tokens", 0)
                rec["ok"] = True
                return rec
            last = None
            for raw in r:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                ev = json.loads(data)
                if "error" in ev:
                    rec["error"] = f"stream error: {ev['error'].get('message')}"
                    return rec
                if ev.get("usage"):
                    rec["tokens"] = ev["usage"].get("completion_tokens", 0)
                for ch in ev.get("choices") or ():
                    d = ch.get("delta") or {}
                    if ch.get("text") or d.get("content") or d.get("reasoning_content") or d.get("tool_calls"):
                        now = time.perf_counter()
                        if rec["ttft"] is None:
                            rec["ttft"] = now - t0
                        else:
                            rec["gaps"].append(now - last)
                        last = now
            rec["e2e"] = time.perf_counter() - t0
            rec["ok"] = True
            return rec
        except (OSError, http.client.HTTPException, ValueError) as e:
            rec["error"] = f"{type(e).__name__}: {e}"
            return rec
        finally:
            c.close()


def build_request(args, model: str | None) -> tuple[str, dict]:
    body: dict = {"max_tokens": args.max_tokens, "temperature": args.temperature, "stream": not args.no_stream}
    if model:
        body["model"] = model
    if args.seed is not None:
        body["seed"] = args.seed
    if not args.no_stream:
        body["stream_options"] = {"include_usage": True}
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": args.prompt or DEFAULT_CHAT_PROMPT}]
        if args.thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": args.thinking == "on"}
        return "/v1/chat/completions", body
    body["prompt"] = args.prompt or DEFAULT_COMPLETION_PROMPT
    return "/v1/completions", body


def run_load(args) -> dict:
    client = Client(args.url, args.api_key, args.timeout)
    model = args.model
    if model is None:
        try:
            status, data = client.get_json("/v1/models")
            if status == 200 and data.get("data"):
                model = data["data"][0]["id"]
        except (OSError, ValueError, http.client.HTTPException):
            pass
    path, body = build_request(args, model)
    for _ in range(args.warmup):
        w = client.run(path, body, not args.no_stream)
        if not w["ok"]:
            raise RuntimeError(f"warm-up request failed: {w['error']}")

    records: list[dict] = []
    lock = threading.Lock()
    counter = iter(range(args.num_requests))

    def worker():
        while True:
            with lock:
                if next(counter, None) is None:
                    return
            rec = client.run(path, body, not args.no_stream, retry_503=args.retry_503)
            with lock:
                records.append(rec)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0

    ok = [r for r in records if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    tpot = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["ttft"] is not None and r["tokens"] > 1]
    errors = [r["error"] for r in records if not r["ok"] and r["status"] != 503]
    return {
        "url": args.url, "endpoint": args.endpoint, "model": model, "concurrency": args.concurrency,
        "num_requests": args.num_requests, "max_tokens": args.max_tokens, "stream": not args.no_stream,
        "ok": len(ok), "rejected_503": sum(1 for r in records if r["status"] == 503), "errors": len(errors),
        "retries_503": sum(r["retries"] for r in records),
        "error_samples": errors[:3], "wall_s": wall, "requests_per_s": len(ok) / wall if wall else None,
        "output_tokens": tokens, "output_tokens_per_s": tokens / wall if wall else None,
        "ttft_ms": summarize([r["ttft"] for r in ok if r["ttft"] is not None]),
        "tpot_ms": summarize(tpot),
        "itl_ms": summarize([g for r in ok for g in r["gaps"]]),
        "e2e_ms": summarize([r["e2e"] for r in ok]),
    }


def print_table(res: dict, out=None):
    out = out or sys.stdout
    def f(x):
        return "-" if x is None else f"{x:.1f}"
    print(f"load test: {res['url']} {res['endpoint']} model={res['model']} concurrency={res['concurrency']} "
          f"requests={res['num_requests']} max_tokens={res['max_tokens']} stream={res['stream']}", file=out)
    print(f"ok {res['ok']}  rejected(503) {res['rejected_503']}  retried 503s {res['retries_503']}  "
          f"errors {res['errors']}  wall {res['wall_s']:.2f}s  "
          f"req/s {f(res['requests_per_s'])}  output tok/s {f(res['output_tokens_per_s'])}", file=out)
    print(f"{'latency (ms)':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'n':>7}", file=out)
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL (chunk)"), ("e2e_ms", "total")):
        s = res[key]
        print(f"{label:<14}{f(s['mean']):>10}{f(s['p50']):>10}{f(s['p90']):>10}{f(s['p99']):>10}{s['n']:>7}", file=out)
    for e in res["error_samples"]:
        print(f"error: {e}", file=out)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.load_test", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    ap.add_argument("--concurrency", "-c", type=int, default=4, help="concurrent clients")
    ap.add_argument("--num-requests", "-n", type=int, default=None, help="requests in all (default 4 x concurrency)")
    ap.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    ap.add_argument("--prompt", default=None, help="prompt text (completions) or user message (chat)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--thinking", choices=["on", "off"], default=None, help="chat_template_kwargs.enable_thinking")
    ap.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--no-stream", action="store_true", help="non-streaming requests (no TTFT / ITL)")
    ap.add_argument("--retry-503", action="store_true",
                    help="on 503 (queue full) wait Retry-After and resend; latency includes the waits")
    ap.add_argument("--warmup", type=int, default=1, help="sequential requests before measuring")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request socket timeout, seconds")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.concurrency < 1:
        ap.error("--concurrency must be >= 1")
    if args.num_requests is None:
        args.num_requests = 4 * args.concurrency
    if args.num_requests < 1 or args.max_tokens < 1 or args.warmup < 0:
        ap.error("--num-requests and --max-tokens must be >= 1, --warmup >= 0")
    try:
        res = run_load(args)
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print_table(res)
    print(json.dumps(res))
    return 0 if res["errors"] == 0 and res["ok"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
