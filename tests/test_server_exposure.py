"""A local server refuses what another site's page could make a browser do: a foreign Host (DNS
rebinding), a foreign Origin on a WebSocket or a state-changing request, and a request body that
is not JSON (a cross-site form POST). Clients without an Origin (curl, SDKs) are unaffected."""

from __future__ import annotations

import logging

import pytest
from litestar.exceptions import WebSocketDisconnect
from litestar.testing import TestClient
from test_server_support import tiny_app

from minivllm.server.exposure import allowed_hosts_for, redact_api_keys

BODY = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
SELF = "http://testserver.local"  # TestClient's own origin


@pytest.fixture
def client(tmp_path):
    with TestClient(tiny_app(tmp_path, allowed_hosts=["testserver.local"], cors_origins=["https://ok.example"])) as c:
        yield c


def error(r) -> dict:
    return r.json()["error"]


def test_host_header_must_name_this_server(client):
    for host in ("127.0.0.1:8000", "localhost", "[::1]:8000", "testserver.local"):
        assert client.get("/v1/models", headers={"host": host}).status_code == 200, host
    r = client.get("/v1/models", headers={"host": "rebound.evil.example"})
    assert r.status_code == 400 and error(r)["code"] == "host_not_allowed"
    assert "--allowed-host" in error(r)["message"]


def test_a_star_allows_every_host_name(tmp_path):
    with TestClient(tiny_app(tmp_path, allowed_hosts=["*"])) as c:
        assert c.get("/v1/models", headers={"host": "anything.example"}).status_code == 200


def test_foreign_origin_cannot_generate_or_change_the_engine(client):
    evil = {"origin": "https://evil.example"}
    for method, path, kwargs in (
        ("POST", "/v1/completions", {"json": BODY}),
        ("PUT", "/api/config", {"json": {"num_blocks": 8}}),
        ("POST", "/api/recordings/start", {}),
    ):
        r = client.request(method, path, headers=evil, **kwargs)
        assert r.status_code == 403 and error(r)["code"] == "origin_not_allowed", (path, r.text)
    assert client.get("/api/config").json()["num_blocks"] == 64
    assert client.post("/v1/completions", json=BODY, headers={"origin": SELF}).status_code == 200
    assert client.post("/v1/completions", json=BODY, headers={"origin": "https://ok.example"}).status_code == 200
    assert client.post("/v1/completions", json=BODY).status_code == 200  # no Origin: not a browser


def test_foreign_origin_cannot_open_the_event_stream(client):
    with pytest.raises(WebSocketDisconnect):
        with client.websocket_connect("/ws/events", headers={"origin": "https://evil.example"}) as ws:
            ws.receive_text()
    for headers in ({}, {"origin": SELF}, {"origin": "https://ok.example"}):
        with client.websocket_connect("/ws/events", headers=headers) as ws:
            assert ws.receive_json()["type"] == "snapshot"


def test_request_bodies_must_be_json(client):
    r = client.post(
        "/v1/completions", content=b'{"prompt": "Hello", "max_tokens": 2}', headers={"content-type": "text/plain"}
    )
    assert r.status_code == 415 and error(r)["code"] == "unsupported_media_type" and "text/plain" in error(r)["message"]
    r = client.post("/v1/completions", content=b'{"prompt": "Hello", "max_tokens": 2}')
    assert r.status_code == 415 and "no Content-Type" in error(r)["message"]
    ok = client.post(
        "/v1/completions",
        content=b'{"prompt": "Hello", "max_tokens": 2}',
        headers={"content-type": "application/json; charset=utf-8"},
    )
    assert ok.status_code == 200, ok.text
    assert client.post("/api/recordings/start").status_code == 201  # no body, no type needed


def test_loopback_binding_turns_the_host_check_on():
    assert allowed_hosts_for("127.0.0.1", []) == [] and allowed_hosts_for("localhost", ["box.lan"]) == ["box.lan"]
    assert allowed_hosts_for("0.0.0.0", []) is None  # a container: its port mapping decides
    assert allowed_hosts_for("0.0.0.0", ["box.lan"]) == ["box.lan"]


def test_api_keys_never_reach_the_access_log():
    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        "",
        0,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5000", "GET", "/ws/events?format=json&api_key=sesame", "1.1", 101),
        None,
    )
    assert redact_api_keys(record) and "sesame" not in record.getMessage()
    assert "api_key=***" in record.getMessage()
