"""Prometheus metrics (vLLM-style names with a `lingjax:` prefix), served at GET /metrics.

Counters are exposed with a `_total` suffix (e.g. `lingjax:spec_decode_num_drafts_total`).
Speculative counters come from each finished request's GenerationStats: `num_drafts` = speculative
steps, `num_draft_tokens` = drafts verified, `num_accepted_tokens` = drafts accepted, and per draft
position the steps that accepted it; acceptance length = 1 + accepted / drafts. Tokens reach the
host in device chunks, so the inter-token latency of a chunk is its interval divided by its tokens.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)


class Metrics:
    def __init__(self, prefix: str = "lingjax:"):
        disable_created_metrics()  # no `_created` series next to every counter (process-wide)
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = prefix
        self.running = Gauge(p + "num_requests_running", "Requests generating on the device (0 or 1: batch 1).",
                             registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting in the queue.", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of requests that started.", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens.", registry=r)
        self.request_success = Counter(p + "request_success", "Finished requests.", ["finished_reason"], registry=r)
        self.request_aborted = Counter(p + "request_aborted", "Requests aborted (client gone, shutdown).",
                                       ["reason"], registry=r)
        self.request_rejected = Counter(p + "request_rejected", "Requests answered 503 (queue full, loading, "
                                        "shutting down).", ["reason"], registry=r)
        self.request_errors = Counter(p + "request_errors", "Requests that failed inside the engine.", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Latency between generated tokens.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(p + "request_queue_time_seconds", "Time waiting in the queue.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.spec_drafts = Counter(p + "spec_decode_num_drafts", "Speculative steps (drafts proposed).", registry=r)
        self.spec_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens verified.", registry=r)
        self.spec_accepted = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r)
        self.spec_accepted_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                             "Steps whose draft at this position was accepted.", ["position"],
                                             registry=r)

    def observe_stats(self, stats, speculative: bool):
        if not speculative:
            return
        self.spec_drafts.inc(stats.steps)
        self.spec_draft_tokens.inc(stats.drafted)
        self.spec_accepted.inc(stats.accepted)
        for pos, n in enumerate(stats.accepted_per_position or ()):
            self.spec_accepted_per_pos.labels(position=str(pos)).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
