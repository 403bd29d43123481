"""Schemathesis against /openapi.json of the real server process (scripted engine): no 5xx, every
response documented and matching its schema, schema-violating requests rejected (400, never 422).

Each operation gets `MAX_EXAMPLES` schema-valid and `MAX_EXAMPLES` schema-violating requests
(schemathesis' pytest plugin loader does not work with this pytest version, so the strategies are
driven with hypothesis directly). The `positive_data_acceptance` check is off: a schema-valid
request can still be a 400 by design (a prompt longer than the context, n > 1, logprobs, a batch
of prompts, a chat template error)."""
import collections

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from serve.testing import ServerProcess

MAX_EXAMPLES = 30


@pytest.fixture(scope="module")
def fuzz_server():
    with ServerProcess(["--fake-engine", "--chunk-steps", "16", "--max-context", "256", "--max-queue", "8",
                        "--log-level", "warning"]) as s:
        yield s
        log = s.log_text()
    assert "Traceback" not in log, log[-4000:]


@pytest.fixture(scope="module")
def operations(fuzz_server):
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    return {op.label: op for op in (r.ok() for r in schema.get_all_operations())}


def test_schema_documents_every_route(operations):
    assert set(operations) == {"GET /health", "GET /metrics", "GET /v1/models", "GET /v1/models/{model_id}",
                               "POST /v1/completions", "POST /v1/chat/completions"}


POST = ["POST /v1/completions", "POST /v1/chat/completions"]
GET = ["GET /v1/models/{model_id}", "GET /v1/models", "GET /health", "GET /metrics"]


# GET routes take no body and accept any path string: there is no schema-violating input to send
@pytest.mark.parametrize("label,mode", [(op, GenerationMode.POSITIVE) for op in POST + GET]
                         + [(op, GenerationMode.NEGATIVE) for op in POST])
def test_openapi_fuzz(operations, label, mode):
    op = operations[label]
    seen = []

    @given(op.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=True, database=None)
    def check(case):
        response = case.call_and_validate(timeout=30, excluded_checks=[positive_data_acceptance])
        seen.append(response.status_code)

    check()
    assert seen and all(s < 500 or s == 503 for s in seen)
    if label in POST:       # positive data reaches the engine; negative data is always a 400
        assert (200 in seen) if mode == GenerationMode.POSITIVE else set(seen) == {400}, collections.Counter(seen)
