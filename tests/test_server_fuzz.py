"""Schema-driven fuzzing of the server: schemathesis generates requests (valid and invalid)
from the app's own OpenAPI schema and checks that none gets a 5xx.

CI runs 12 derandomized examples per operation; ``MEMRA_FUZZ_EXAMPLES=N`` runs N random
ones per operation (a longer hunt).

The server runs on the real engine with a 40-token context, so most generated
``max_tokens`` are rejected (400) and those accepted generate a few tokens only; a
request still running after a few seconds (e.g. n=128) is abandoned by the client,
which also exercises the disconnect -> abort path. After the run the engine must be
idle with every KV block free, and the server must still answer.
"""

from __future__ import annotations

import os

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from test_server import ServerThread, wait_idle

from memra.engine.async_engine import AsyncLLMEngine
from memra.engine.engine import EngineConfig, LLMEngine
from memra.server import create_app


@pytest.fixture(scope="module")
def fuzz_engine():
    eng = AsyncLLMEngine(LLMEngine(EngineConfig(model="smollm2-135m", max_model_len=40, max_num_seqs=16,
                                                kv_cache_blocks=48)), max_queue=4)
    eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def fuzz_server(fuzz_engine):
    srv = ServerThread(create_app(fuzz_engine))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=int(os.environ.get("MEMRA_FUZZ_EXAMPLES", "12")), deadline=None,
          derandomize=os.environ.get("MEMRA_FUZZ_EXAMPLES") is None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
def test_no_server_errors(case, fuzz_server):
    try:
        response = case.call(timeout=2)
    except requests.exceptions.Timeout:
        return  # a long generation; the client gave up (the server aborts it; checked below)
    case.validate_response(response, checks=[not_a_server_error])


def test_after_fuzzing_engine_idle_and_server_alive(fuzz_server, fuzz_engine):
    wait_idle(fuzz_engine, timeout=30)
    r = requests.post(fuzz_server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
