"""Schemathesis over the served OpenAPI document: requests generated from every route's schema
(valid and invalid ones) never get a 5xx, and the server still serves afterwards.

A real uvicorn server in a thread (the same stack as `minivllm serve`) on the tiny model with a
64-token context, so generated completions stay short. CI runs FUZZ_EXAMPLES per route (bounded,
about a minute); `make fuzz` runs many more."""

from __future__ import annotations

import os
import socket
import threading

import httpx
import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, given, settings, strategies
from schemathesis import GenerationMode
from test_server_support import tiny_app, tiny_engine, wait_for

pytestmark = pytest.mark.slow  # a server, a subprocess or the real model in every test

FUZZ_EXAMPLES = int(os.environ.get("MINIVLLM_FUZZ_EXAMPLES", "40"))  # per operation, valid and invalid


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = tiny_app(
        tmp_path_factory.mktemp("fuzz"), engine=tiny_engine(max_model_len=64, num_blocks=128), allowed_hosts=[]
    )
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: _healthy(base), timeout=60, what="the server to start")
    yield base
    server.should_exit = True
    thread.join(10)


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def operations(base: str) -> list:
    """Every operation; the engine's configuration last (a fuzzed pool of 1 block would turn every
    later generation request into a 400 and hide what those routes do)."""
    schema = schemathesis.openapi.from_url(f"{base}/docs/openapi.json")
    found = [result.ok() for result in schema.get_all_operations()]
    return sorted(found, key=lambda op: op.path == "/api/config")


def test_generated_requests_never_get_a_server_error(live_server):
    # Each operation runs its own Hypothesis search (schemathesis' pytest plugin does the same; it
    # is not used because its collection hook does not work with pytest 9).
    checked = []
    for operation in operations(live_server):

        @settings(
            max_examples=FUZZ_EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=strategies.one_of(*(operation.as_strategy(mode) for mode in GenerationMode)))
        def no_server_error(case):
            response = case.call()
            where = f"{case.method} {case.formatted_path}"
            assert response.status_code < 500, f"{where}: {response.status_code} {response.text[:500]}"
            content_type = (response.headers.get("content-type") or [""])[0]  # schemathesis: header -> list
            if response.status_code >= 400 and content_type.startswith("application/json"):
                assert set(response.json()) == {"error"}, f"{where}: {response.text[:500]}"  # OpenAI's shape

        no_server_error()
        checked.append(f"{operation.method.upper()} {operation.path}")
    assert {"POST /v1/completions", "POST /v1/chat/completions", "PUT /api/config"} <= set(checked), checked


def test_the_server_still_serves_after_the_fuzzing(live_server):
    # the fuzzed PUTs left some odd pool behind: put a usable one back first (it must accept it)
    restored = httpx.put(
        f"{live_server}/api/config",
        json={"num_blocks": 128, "block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 512},
        timeout=30,
    )
    assert restored.status_code == 200, restored.text
    r = httpx.post(f"{live_server}/v1/completions", json={"prompt": "Still here", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
