"""The Litestar server through TestClient: OpenAI routes, errors, ops, dashboard API, static files."""

from __future__ import annotations

import gc
import re
import resource
import threading
import time

import msgspec
import pytest
import torch
from litestar.testing import TestClient
from test_server_support import server_of, sse_events, tiny_app, tiny_engine, wait_for

from minivllm.events import types as ev
from minivllm.events.fold import fold
from minivllm.events.recording import parse_lines, read_recording
from minivllm.server.app import create_app
from minivllm.server.config import ServerConfig
from minivllm.server.recordings import RecordingLimits

GREEDY = {"temperature": 0, "max_tokens": 6}


@pytest.fixture
def client(tmp_path):
    with TestClient(tiny_app(tmp_path)) as c:
        yield c


def chat_body(**extra):
    return {"messages": [{"role": "user", "content": "Tell me about KV caches."}], **GREEDY, **extra}


def error_of(response):
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_a_serving_server_keeps_its_loaded_heap_out_of_full_collections(tmp_path):
    """What lives once the model is loaded (torch, transformers, the tokenizer, the model) stays out of the
    collector while the server runs: full collections walked all of it holding the GIL, a pause in every stream.
    It goes back to the collector when the server stops."""
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    with TestClient(tiny_app(tmp_path)) as client:
        assert client.get("/health").status_code == 200
        assert gc.get_freeze_count() > 50_000, gc.get_freeze_count()
        assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200  # serves as before
    assert gc.get_freeze_count() == 0


# ---- OpenAI API ------------------------------------------------------------------------------


def test_models_lists_the_served_model(client):
    r = client.get("/v1/models")
    assert r.status_code == 200
    (card,) = r.json()["data"]
    assert card["id"] == "random:tiny" and card["max_model_len"] == 512 and card["object"] == "model"


def test_completion_with_logprobs_usage_and_timings(client):
    r = client.post(
        "/v1/completions", json={"prompt": "Hello there", "logprobs": 2, **GREEDY}, headers={"X-Request-Id": "my-id-1"}
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "my-id-1"
    body = r.json()
    assert body["id"] == "cmpl-my-id-1" and body["object"] == "text_completion"
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    for token, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[token] == chosen and 1 <= len(top) <= 3
    usage = body["usage"]
    assert usage["completion_tokens"] == 6 and usage["total_tokens"] == usage["prompt_tokens"] + 6
    t = body["timings"]
    assert t["generated_tokens"] == 6 and t["prompt_tokens"] == usage["prompt_tokens"]
    assert 0 <= t["queue_s"] <= t["ttft_s"] <= t["e2e_s"] and t["tokens_per_s"] > 0


def test_a_request_admitted_at_once_reports_no_queue_time_whatever_its_prefill_costs(tmp_path):
    """`timings.queue_s` is arrival to first scheduling, stamped before the forward pass: a prompt
    whose prefill takes 0.4 s on an idle engine has waited ~0 s in the queue, not 0.4 s."""
    engine = tiny_engine()
    execute = engine.runner.execute

    def slow_execute(single, chunks, *args, **kwargs):
        if chunks:  # prefill chunks only: this prompt's one long pass
            time.sleep(0.4)
        return execute(single, chunks, *args, **kwargs)

    engine.runner.execute = slow_execute
    with TestClient(tiny_app(tmp_path, engine)) as c:
        r = c.post("/v1/completions", json={"prompt": "word " * 300, "max_tokens": 2, **GREEDY})
    assert r.status_code == 200, r.text
    t = r.json()["timings"]
    assert t["ttft_s"] >= 0.4, t
    assert t["queue_s"] < 0.1, t


def test_request_ids_are_generated_when_absent_or_unusable(client):
    a = client.post("/v1/completions", json={"prompt": "hi", **GREEDY})
    b = client.post("/v1/completions", json={"prompt": "hi", **GREEDY}, headers={"X-Request-Id": "bad id with spaces"})
    ids = {a.headers["x-request-id"], b.headers["x-request-id"]}
    assert len(ids) == 2 and "bad id with spaces" not in ids
    assert a.json()["id"] == "cmpl-" + a.headers["x-request-id"]


def test_chat_non_streaming_uses_the_chat_template(client):
    r = client.post("/v1/chat/completions", json=chat_body(max_completion_tokens=4, max_tokens=50))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["logprobs"] is None
    assert body["usage"]["completion_tokens"] == 4  # max_completion_tokens wins over max_tokens
    tokenizer = server_of(client.app).async_engine.engine.tokenizer
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about KV caches."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert body["usage"]["prompt_tokens"] == len(templated)


def test_chat_streaming_matches_non_streaming_and_follows_openai_framing(client):
    full = client.post("/v1/chat/completions", json=chat_body(n=2, logprobs=True, top_logprobs=2)).json()
    r = client.post(
        "/v1/chat/completions",
        json=chat_body(n=2, logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True}),
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert len({c["id"] for c in events[:-1]}) == 1
    assert usage_chunk["choices"] == []
    same = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [usage_chunk["usage"][k] for k in same] == [full["usage"][k] for k in same]
    assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the same prompt ran just before
    assert usage_chunk["timings"]["generated_tokens"] == 12
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in c["delta"] for c in mine[1:])
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["length"]
        assert mine[-1]["delta"].get("content")  # the finish reason rides on the last content chunk
        text = "".join(c["delta"].get("content", "") for c in mine)
        assert text == full["choices"][index]["message"]["content"]
        streamed_lp = [t for c in mine[1:] for t in c["logprobs"]["content"]]
        assert streamed_lp == full["choices"][index]["logprobs"]["content"]
        assert all(len(t["top_logprobs"]) == 2 for t in streamed_lp)
        assert all(t["bytes"] == list(t["token"].encode()) for t in streamed_lp)


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats (GuideLLM sends it): each chunk's usage counts
    the tokens generated so far, ending at the closing usage chunk's totals."""
    body = chat_body(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    events = sse_events(client.post("/v1/chat/completions", json=body).text)
    chunks, closing = events[:-2], events[-2]
    assert all(c["usage"] is not None for c in chunks)
    prompt = closing["usage"]["prompt_tokens"]
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {prompt}
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == closing["usage"]["completion_tokens"] == 6
    assert all(c["usage"]["total_tokens"] == prompt + c["usage"]["completion_tokens"] for c in chunks)
    plain = sse_events(client.post("/v1/chat/completions", json=chat_body(stream=True)).text)
    assert all(c.get("usage") is None for c in plain[:-1])


def test_completion_streaming_without_usage(client):
    full = client.post("/v1/completions", json={"prompt": "Once upon", **GREEDY}).json()
    events = sse_events(client.post("/v1/completions", json={"prompt": "Once upon", "stream": True, **GREEDY}).text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_token_id_prompt_stop_strings_and_extra_fields(client):
    tokenizer = server_of(client.app).async_engine.engine.tokenizer
    ids = tokenizer.encode("Hello there")
    by_text = client.post("/v1/completions", json={"prompt": "Hello there", **GREEDY}).json()
    by_ids = client.post("/v1/completions", json={"prompt": ids, **GREEDY}).json()
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    unknown = client.post("/v1/completions", json={"prompt": ids, "some_unknown_field": {"x": 1}, **GREEDY})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "some_unknown_field"
    assert unknown.json()["error"]["message"] == "Unrecognized request argument supplied: some_unknown_field"
    text = by_text["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    stopped = client.post("/v1/completions", json={"prompt": "Hello there", "stop": [stop], **GREEDY}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["text"] == text[: text.index(stop)]
    extras = {
        "top_k": 5,
        "min_p": 0.05,
        "repetition_penalty": 1.2,
        "min_tokens": 2,
        "ignore_eos": True,
        "stop_token_ids": [2],
        "priority": 1,
        "seed": 7,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "user": "someone",
        "temperature": 0.8,
        "top_p": 0.9,
    }
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, **extras})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    again = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, **extras})
    assert again.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]  # seeded


def test_beam_search(client):
    r = client.post(
        "/v1/completions",
        json={
            "prompt": "The cache",
            "n": 2,
            "use_beam_search": True,
            "length_penalty": 1.0,
            "max_tokens": 4,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert all(c["text"] for c in choices) and choices[0]["text"] != choices[1]["text"]
    events = sse_events(
        client.post(
            "/v1/completions",
            json={"prompt": "The cache", "n": 2, "use_beam_search": True, "max_tokens": 4, "stream": True},
        ).text
    )
    streamed = {c["choices"][0]["index"]: c["choices"][0]["text"] for c in events[:-1]}
    assert streamed == {c["index"]: c["text"] for c in choices}


BAD_INPUT = [
    # (route, body, param, words in the message)
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 4', None, "malformed JSON"),
    ("/v1/completions", b"", None, "empty"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "four"}, "max_tokens", "Expected `int"),
    ("/v1/completions", {"max_tokens": 4}, None, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", ">= 1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, "max_tokens", ">= 1"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, "temperature", ">= 0"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p", "(0, 1]"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p", "(0, 1]"),
    ("/v1/completions", {"prompt": "x", "n": 9, "max_tokens": 2}, "n", "max_num_seqs is 8"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n", ">= 1"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", "[0, 20]"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop", "empty"),
    ("/v1/completions", {"prompt": "x", "n": 8, "stop": [f"stop {i}" for i in range(20_000)]}, "stop", "at most 64"),
    # each of these once aborted every running request from inside a step
    (
        "/v1/completions",
        {"prompt": "x", "seed": 2**64 - 1, "n": 2, "temperature": 1},
        "seed",
        "[0, 9223372036854775806]",
    ),
    ("/v1/completions", {"prompt": "x", "seed": -5}, "seed", "[0, 9223372036854775807]"),
    ("/v1/completions", {"prompt": "x", "top_k": 2**70}, "top_k", "vocabulary size"),
    ("/v1/completions", {"prompt": "x", "top_k": 10**6}, "top_k", "vocabulary size"),
    (
        "/v1/completions",
        {"prompt": "x", "use_beam_search": True, "n": 2, "length_penalty": 1e308},
        "length_penalty",
        "[-10, 10]",
    ),
    ("/v1/completions", b'{"prompt": "x", "temperature": 1e999}', "temperature", "out of range"),
    ("/v1/completions", {"prompt": ["a"] * 9}, "prompt", "at most 8 per request"),
    ("/v1/completions", {"prompt": [1, 99999999]}, "prompt", "out of range"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 2, "stream": True}, "prompt_logprobs", "stream=True"),
    ("/v1/completions", {"prompt": "word " * 600, "max_tokens": 4}, "prompt", "512 tokens"),
    ("/v1/completions", {"prompt": "x" * 40_000}, "prompt", "cannot hold more than about 32768 characters"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "y" * 20_000}] * 2},
        "messages",
        "cannot hold more than about 32768 characters",
    ),
    ("/v1/completions", {"prompt": "word " * 300, "max_tokens": 400}, "max_tokens", "512"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        "top_logprobs",
        "requires logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30},
        "top_logprobs",
        "[0, 20]",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
        "max_completion_tokens",
        ">= 1",
    ),
    ("/v1/chat/completions", {"messages": []}, "messages", "at least one"),
    ("/v1/chat/completions", {"messages": "hello"}, "messages", "Expected `array"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages",
        "only text",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages", "role must be one of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, "n", ">= 1"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
        "temperature",
        "Expected `float",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_k": -7}, "top_k", ">= 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "min_p": 2}, "min_p", "[0, 1]"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": -9},
        "frequency_penalty",
        "[-2, 2]",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0},
        "repetition_penalty",
        "> 0",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "seed": 2**63},
        "seed",
        "[0, 9223372036854775807]",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "stop": "x" * 5000},
        "stop",
        "at most 4096",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "stop_token_ids": [-1]},
        "stop_token_ids",
        "non-negative",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "min_tokens": 9, "max_tokens": 3},
        "min_tokens",
        "<= max_tokens",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "use_beam_search": True, "n": 9},
        "n",
        "max_num_seqs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9},
        "max_tokens",
        "maximum context length",
    ),
    ("/v1/chat/completions", [1, 2, 3], None, "Expected `object"),
    ("/v1/chat/completions", b"\xff\xfe", None, "malformed JSON"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs", "[0, 20]"),
    ("/v1/completions", {"prompt": "x", "min_tokens": -1}, "min_tokens", ">= 0"),
    (
        "/v1/completions",
        {"prompt": "x", "length_penalty": float("1e308"), "use_beam_search": True},
        "length_penalty",
        "[-10, 10]",
    ),
    ("/v1/completions", {"prompt": []}, "prompt", "empty"),
    ("/v1/completions", {"prompt": [[1, 2], "x", 3]}, "prompt", "list of strings or of token-id lists"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", "[0, 20]"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix", "not supported"),
    ("/v1/completions", {"prompt": "x", "n": 3, "use_beam_search": True, "max_tokens": 400}, "max_tokens", "KV blocks"),
    ("PUT /api/config", {"num_blocks": 0}, "num_blocks", ">= 1"),
    ("PUT /api/config", {"num_blocks": 10**12}, "num_blocks", "GiB"),
    ("PUT /api/config", {"block_size": "big"}, "block_size", "Expected `int"),
    ("PUT /api/config", {"max_num_seqs": -1}, "max_num_seqs", ">= 1"),
    ("PUT /api/config", {"max_num_batched_tokens": 0}, "max_num_batched_tokens", ">= 1"),
    ("PUT /api/config", {"enable_prefix_caching": "yes"}, "enable_prefix_caching", "Expected `bool"),
    ("PUT /api/config", {"kv_cache_dtype": "int3"}, "kv_cache_dtype", "'float32'"),
    ("PUT /api/config", b"{", None, "malformed JSON"),
    ("/api/recordings", b'{"type": "nonsense"}', "line", "not a valid recording"),
]


def send(client, route: str, body):
    """POST (or the method written before the path) `body` as JSON, or raw bytes sent as JSON."""
    method, _, path = route.rpartition(" ")
    kwargs = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    return client.request(method or "POST", path, **kwargs)


@pytest.mark.parametrize(
    "route,body,param,words", BAD_INPUT, ids=[f"{i}-{c[0].rpartition('/')[2]}-{c[2]}" for i, c in enumerate(BAD_INPUT)]
)
def test_bad_input_gets_a_400_in_openai_shape(client, route, body, param, words):
    r = send(client, route, body)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert words in err["message"], err["message"]


@pytest.mark.slow
def test_bad_input_never_disturbs_a_streaming_request(client):
    """Every bad-input case above is sent while a greedy stream runs; the stream must finish as it
    does alone (same text, its finish_reason)."""
    victim = {"prompt": "The victim request", "temperature": 0, "max_tokens": 400, "ignore_eos": True}
    streamed: list[str] = []

    def stream() -> None:
        with client.stream("POST", "/v1/completions", json={**victim, "stream": True}) as r:
            streamed.append("".join(r.iter_text()))

    thread = threading.Thread(target=stream)
    thread.start()
    wait_for(lambda: server_of(client.app).async_engine.engine.requests, timeout=30)
    for route, body, param, _ in BAD_INPUT:
        r = send(client, route, body)
        assert r.status_code == 400 and error_of(r)["param"] == param, r.text
    overlapped = not streamed  # the victim was still streaming when the last case was answered
    thread.join(60)
    chunks = [e for e in sse_events(streamed[0]) if e != "[DONE]"]
    assert [c["finish_reason"] for e in chunks for c in e["choices"] if c["finish_reason"]] == ["length"]
    alone = client.post("/v1/completions", json=victim).json()["choices"][0]
    assert "".join(c["text"] for e in chunks for c in e["choices"]) == alone["text"]
    assert overlapped


def test_a_reused_request_id_runs_under_a_suffixed_id_and_both_finish(client):
    first: list = []

    def stream() -> None:
        with client.stream(
            "POST",
            "/v1/completions",
            headers={"X-Request-Id": "retry-me"},
            json={"prompt": "First", "max_tokens": 480, "ignore_eos": True, "stream": True},
        ) as r:
            first.append((r.headers["x-request-id"], "".join(r.iter_text())))

    thread = threading.Thread(target=stream)
    thread.start()
    ae = server_of(client.app).async_engine
    wait_for(lambda: ae.has_stream("retry-me"), timeout=30, what="the first request to run")
    second = client.post("/v1/completions", headers={"X-Request-Id": "retry-me"}, json={"prompt": "Second", **GREEDY})
    thread.join(60)
    assert second.status_code == 200, second.text
    rid = second.headers["x-request-id"]
    assert re.fullmatch(r"retry-me-[0-9a-f]{8}", rid) and second.json()["id"] == f"cmpl-{rid}"
    header, body = first[0]
    assert header == "retry-me" and sse_events(body)[-1] == "[DONE]"


def test_prompt_too_long_names_both_numbers(client):
    prompt = "word " * 600
    num_tokens = len(server_of(client.app).async_engine.engine.tokenizer.encode(prompt))
    err = error_of(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4}))
    assert f"{num_tokens} tokens" in err["message"] and "512 tokens" in err["message"]
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 4}
    assert "512 tokens" in error_of(client.post("/v1/chat/completions", json=chat))["message"]


def test_unknown_model_is_404_and_nothing_is_lost(client):
    r = client.post("/v1/chat/completions", json=chat_body(model="gpt-4"))
    assert r.status_code == 404 and error_of(r)["code"] == "model_not_found"
    assert client.post("/v1/chat/completions", json=chat_body(model="random:tiny")).status_code == 200
    assert error_of(client.get("/v1/nothing-here"))["type"] == "not_found_error"
    for method, path in (("POST", "/v1/nope"), ("PUT", "/v1/nope/deeper"), ("POST", "/api/nope")):
        r = client.request(method, path, json={})
        assert r.status_code == 404 and error_of(r)["message"] == f"no route for {method} {path}", r.text
    for method, path in (("DELETE", "/v1/completions"), ("POST", "/health"), ("POST", "/api/recordings/x/trace")):
        assert client.request(method, path).status_code == 405, path  # the route exists, not this method


def test_internal_error_is_500_and_the_server_keeps_serving(client):
    engine = server_of(client.app).async_engine.engine
    real = engine.runner.execute
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated device failure")
        return real(*args, **kwargs)

    engine.runner.execute = broken
    r = client.post("/v1/completions", json={"prompt": "hi", **GREEDY})
    assert r.status_code == 500
    assert "simulated device failure" in error_of(r)["message"]
    assert client.post("/v1/completions", json={"prompt": "hi", **GREEDY}).status_code == 200
    assert client.get("/health").status_code == 200
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_oversized_body_is_413(tmp_path):
    with TestClient(tiny_app(tmp_path, max_body_size=2048)) as c:
        r = c.post("/v1/completions", json={"prompt": "x" * 4000})
        assert r.status_code == 413 and error_of(r)["message"]
        assert c.post("/v1/completions", json={"prompt": "x", **GREEDY}).status_code == 200


def test_api_key_guards_v1_api_and_ws_but_not_health(tmp_path):
    with TestClient(tiny_app(tmp_path, api_key="sesame")) as c:
        assert c.get("/health").status_code == 200
        for path in ("/v1/models", "/api/state", "/api/config", "/api/recordings"):
            assert c.get(path).status_code == 401
            assert error_of(c.get(path, headers={"Authorization": "Bearer wrong"}))["code"] == "invalid_api_key"
            assert c.get(path, headers={"Authorization": "Bearer sesame"}).status_code == 200
            assert c.get(path, headers={"X-API-Key": "sesame"}).status_code == 200
            assert c.get(f"{path}?api_key=sesame").status_code == 401  # a key in a URL: the WebSocket only
        from litestar.exceptions import WebSocketDisconnect

        for query in ("", "?api_key=wrong"):
            with pytest.raises(WebSocketDisconnect) as closed:
                with c.websocket_connect(f"/ws/events{query}") as ws:
                    ws.receive_text()
            assert closed.value.code == 4401 and "API key" in closed.value.detail
        with c.websocket_connect("/ws/events?api_key=sesame") as ws:
            assert msgspec.json.decode(ws.receive_text(), type=ev.Snapshot).config.model == "random:tiny"


def test_cors(tmp_path):
    with TestClient(tiny_app(tmp_path, cors_origins=["http://dash.example"])) as c:
        r = c.options(
            "/v1/completions", headers={"Origin": "http://dash.example", "Access-Control-Request-Method": "POST"}
        )
        assert r.status_code in (200, 204)
        assert r.headers["access-control-allow-origin"] == "http://dash.example"
        assert (
            c.get("/v1/models", headers={"Origin": "http://other.example"}).headers.get("access-control-allow-origin")
            != "http://other.example"
        )


# ---- operations ------------------------------------------------------------------------------


def test_health_while_loading_then_ready(tmp_path):
    release = threading.Event()

    def slow_load():
        assert release.wait(30)
        return tiny_engine()

    app = create_app(ServerConfig(engine=slow_load, recordings_dir=tmp_path))
    with TestClient(app) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        assert error_of(c.get("/v1/models"))["code"] == "model_loading"
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 503
        release.set()
        wait_for(lambda: c.get("/health").status_code == 200, what="the model to load")
        assert c.post("/v1/completions", json={"prompt": "x", **GREEDY}).status_code == 200


def test_health_when_loading_failed(tmp_path):
    def bad_load():
        raise FileNotFoundError("no such model: nowhere")

    with TestClient(create_app(ServerConfig(engine=bad_load, recordings_dir=tmp_path))) as c:
        body = wait_for(lambda: c.get("/health").json() if c.get("/health").json()["status"] != "loading" else None)
        assert body["status"] == "failed" and "nowhere" in body["reason"]
        assert c.get("/health").status_code == 503


def test_health_when_the_engine_thread_died(client):
    server = server_of(client.app)
    engine = server.async_engine.engine

    class EngineCrash(BaseException):  # not an Exception: nothing on the engine thread contains it
        pass

    def die(*args, **kwargs):
        raise EngineCrash("simulated engine crash")

    engine.emit_metrics_if_due = die  # runs in the idle loop
    wait_for(lambda: not server.async_engine.is_alive, what="the engine thread to die")
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "dead" and "simulated engine crash" in r.json()["reason"]
    assert error_of(client.post("/v1/completions", json={"prompt": "x"}))["code"] == "engine_dead"


def test_metrics_prometheus_text(client):
    for _ in range(2):
        client.post("/v1/completions", json={"prompt": "Hello there, general Kenobi. " * 8, **GREEDY})
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    label = '{model_name="random:tiny"}'
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"minivllm:{name}{label} 0.0" in text
    for name in (
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "num_preemptions_total",
        "prompt_tokens_total",
        "generation_tokens_total",
    ):
        assert f"minivllm:{name}{label}" in text
    assert f"minivllm:generation_tokens_total{label} 12.0" in text
    rss = float(re.search(r"^process_resident_memory_bytes (\S+)$", text, re.M).group(1))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    assert 50 * 2**20 < rss <= peak * 1.01, (rss, peak)
    hits = float(text.split(f"minivllm:prefix_cache_hits_total{label} ")[1].split()[0])
    assert hits > 0  # the second identical prompt reused the first one's full blocks
    for name in (
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
    ):
        assert f"# TYPE minivllm:{name} histogram" in text
        assert f"minivllm:{name}_count{label} 2.0" in text


# ---- dashboard API ---------------------------------------------------------------------------


def test_state_and_config(client):
    client.post("/v1/completions", json={"prompt": "Hello", **GREEDY})
    snap = msgspec.json.decode(client.get("/api/state").content, type=ev.Snapshot)
    assert snap.config.num_blocks == 64 and len(snap.blocks) == 64
    assert [r.state for r in snap.requests] == ["FINISHED"]
    assert client.get("/api/config").json()["max_num_seqs"] == 8

    r = client.put("/api/config", json={"num_blocks": 32, "enable_prefix_caching": False, "block_size": 8})
    assert r.status_code == 200, r.text
    assert (r.json()["num_blocks"], r.json()["block_size"], r.json()["enable_prefix_caching"]) == (32, 8, False)
    assert client.get("/api/state").json()["requests"] == []
    assert client.post("/v1/completions", json={"prompt": "Hello", **GREEDY}).status_code == 200

    for bad, param in (
        ({"num_blocks": 0}, "num_blocks"),
        ({"max_num_seqs": "many"}, "max_num_seqs"),
        ({"block_size": -1}, "block_size"),
        ({"num_blocks": 10**12}, "num_blocks"),
        ({"num_blocks": 10**9, "block_size": 16}, "num_blocks"),
    ):
        r = client.put("/api/config", json=bad)
        assert r.status_code == 400 and error_of(r)["param"] == param, r.text
    assert "GiB" in error_of(client.put("/api/config", json={"num_blocks": 10**12}))["message"]
    after = client.get("/api/config").json()
    assert (after["num_blocks"], after["block_size"]) == (32, 8)
    assert client.post("/v1/completions", json={"prompt": "Hello", **GREEDY}).status_code == 200


def test_the_kv_cache_dtype_is_a_setting(tmp_path):
    """--kv-cache-dtype through PUT /api/config: a pool sized by memory holds twice the blocks in
    float16; one sized by a block count keeps the count in half the bytes. Either serves requests."""
    engine = tiny_engine(num_blocks=None, kv_cache_memory="1MiB")
    fp32_blocks, fp32_bytes = engine.block_manager.num_blocks, engine.kv_cache.num_bytes
    with TestClient(tiny_app(tmp_path, engine=engine)) as c:
        assert c.get("/api/config").json()["kv_cache_dtype"] == "float32"
        r = c.put("/api/config", json={"kv_cache_dtype": "float16"})
        assert r.status_code == 200, r.text
        assert (r.json()["kv_cache_dtype"], r.json()["num_blocks"]) == ("float16", 2 * fp32_blocks)
        assert engine.kv_cache.k[0].dtype == torch.float16 and engine.kv_cache.num_bytes == fp32_bytes
        assert c.post("/v1/completions", json={"prompt": "Hello", **GREEDY}).status_code == 200
        r = c.put("/api/config", json={"kv_cache_dtype": "bfloat16", "num_blocks": 40})
        assert (r.json()["kv_cache_dtype"], r.json()["num_blocks"]) == ("bfloat16", 40)
        assert engine.kv_cache.num_bytes == fp32_bytes * 40 // (2 * fp32_blocks)
        assert c.post("/v1/completions", json={"prompt": "Hello", **GREEDY}).status_code == 200
        assert c.put("/api/config", json={"kv_cache_dtype": "auto"}).json()["kv_cache_dtype"] == "float32"


def test_the_kv_pool_cap_bounds_what_the_settings_may_ask_for(tmp_path):
    engine = tiny_engine(max_kv_cache_memory="1MiB")
    per_block = engine.kv_cache.num_bytes // engine.block_manager.num_blocks
    with TestClient(tiny_app(tmp_path, engine=engine)) as c:
        fits = 2**20 // per_block
        assert c.put("/api/config", json={"num_blocks": fits}).json()["num_blocks"] == fits
        r = c.put("/api/config", json={"num_blocks": fits + 1})
        assert (
            r.status_code == 400
            and error_of(r)["param"] == "num_blocks"
            and "--max-kv-cache-memory" in error_of(r)["message"]
        )
        assert c.get("/api/config").json()["num_blocks"] == fits


def test_a_rebuild_that_fails_puts_the_old_configuration_back(client):
    engine = server_of(client.app).async_engine.engine
    before = client.get("/api/config").json()
    real_build = engine._build

    def build_that_fails_once(config):
        engine._build = real_build
        raise RuntimeError("simulated allocator failure")

    engine._build = build_that_fails_once
    r = client.put("/api/config", json={"num_blocks": 48})
    err = error_of(r)  # an unexpected exception: its text goes to the log, not to the client
    assert r.status_code == 500 and err["code"] == "internal_error" and "RuntimeError" in err["message"]
    assert "simulated allocator failure" not in err["message"]
    assert client.get("/api/config").json() == before
    engine.block_manager.check_invariants()
    assert client.post("/v1/completions", json={"prompt": "Hello", **GREEDY}).status_code == 200
    assert client.put("/api/config", json={"num_blocks": 48}).json()["num_blocks"] == 48


def test_config_change_is_409_while_a_request_runs(client):
    ae = server_of(client.app).async_engine
    from minivllm.sampling.params import SamplingParams

    ae.submit(lambda e: e.add_request("busy", "Hello", SamplingParams(max_tokens=400, ignore_eos=True))).result()
    r = client.put("/api/config", json={"num_blocks": 16})
    assert r.status_code == 409 and error_of(r)["code"] == "engine_busy"
    ae.abort("busy")
    wait_for(lambda: ae.submit(lambda e: not e.has_unfinished_requests()).result(), what="the abort")
    assert client.put("/api/config", json={"num_blocks": 16}).json()["num_blocks"] == 16


def test_recordings_lifecycle_download_trace_and_upload(client):
    assert client.get("/api/recordings").json() == []
    assert client.post("/api/recordings/stop").status_code == 409
    started = client.post("/api/recordings/start")
    assert started.status_code == 201 and started.json()["active"] is True
    assert client.post("/api/recordings/start").status_code == 409
    assert client.get("/api/recordings/status").json()["recording"]["id"] == started.json()["id"]
    client.post("/v1/completions", json={"prompt": "Record me", "n": 2, "temperature": 1.0, "max_tokens": 5})
    client.post("/v1/chat/completions", json=chat_body())
    stopped = client.post("/api/recordings/stop").json()
    rid = stopped["id"]
    assert stopped["active"] is False and stopped["num_events"] > 20 and stopped["duration_s"] > 0
    assert client.get("/api/recordings/status").json()["recording"] is None
    (listed,) = client.get("/api/recordings").json()
    assert listed == stopped

    download = client.get(f"/api/recordings/{rid}")
    assert download.status_code == 200
    recording = parse_lines(download.content.splitlines())
    assert recording.footer is not None and len(recording.events) == stopped["num_events"]
    folded = fold(recording.header.snapshot, recording.events)
    assert msgspec.to_builtins(folded.requests) == msgspec.to_builtins(recording.footer.snapshot.requests)
    assert msgspec.to_builtins(folded.blocks) == msgspec.to_builtins(recording.footer.snapshot.blocks)

    trace = client.get(f"/api/recordings/{rid}/trace").json()
    events = trace["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    request_ids = {e.request_id for e in recording.events if isinstance(e, ev.RequestArrived)}
    assert len(request_ids) == 2 and request_ids | {"steps"} == tracks
    states = {e["name"] for e in events if e["ph"] == "X" and e.get("cat") == "request"}
    assert {"WAITING", "PREFILL", "DECODE"} <= states
    steps = [e for e in events if e["ph"] == "X" and e["name"].startswith("step ")]
    assert len(steps) == sum(isinstance(e, ev.StepFinished) for e in recording.events)
    kv = [e for e in events if e["ph"] == "C" and e["name"] == "KV blocks"]
    assert max(e["args"]["used"] for e in kv) > 0 and kv[-1]["args"]["used"] == 0
    assert all(e["ts"] >= 0 for e in events if "ts" in e)

    uploaded = client.post(
        "/api/recordings", content=download.content, headers={"content-type": "application/x-ndjson"}
    )
    assert uploaded.status_code == 201 and uploaded.json()["num_events"] == stopped["num_events"]
    assert client.get(f"/api/recordings/{uploaded.json()['id']}").content == download.content
    assert len(client.get("/api/recordings").json()) == 2
    multipart = client.post("/api/recordings", files={"file": ("r.jsonl", download.content)})
    assert multipart.status_code == 201
    lines = download.content.splitlines()
    big = b"\n".join([*lines[:-1], *[lines[1]] * (5_000_000 // len(lines[1])), lines[-1]])
    assert len(big) > 4 * 2**20  # over the general body limit: uploads have their own
    ndjson = {"content-type": "application/x-ndjson"}
    assert client.post("/api/recordings", content=big, headers=ndjson).status_code == 201

    broken = b"\n".join([*lines[:2], b'{"type": "token", "request_id": 5}', *lines[3:]])
    r = client.post("/api/recordings", content=broken, headers=ndjson)
    assert r.status_code == 400 and "line 3" in error_of(r)["message"]
    assert error_of(client.post("/api/recordings", content=b"not json", headers=ndjson))["message"].count("line 1") == 1
    r = client.post("/api/recordings", content=download.content, headers={"content-type": "text/plain"})
    assert r.status_code == 415 and error_of(r)["code"] == "unsupported_media_type"
    assert client.get("/api/recordings/nope").status_code == 404
    assert client.get("/api/recordings/..%2F..%2Fetc%2Fpasswd").status_code == 404
    assert client.get("/api/recordings/nope/trace").status_code == 404


def _record(client) -> bytes:
    client.post("/api/recordings/start")
    client.post("/v1/completions", json={"prompt": "Record me", "max_tokens": 5, "temperature": 0})
    rid = client.post("/api/recordings/stop").json()["id"]
    return client.get(f"/api/recordings/{rid}").content


def test_recordings_folder_keeps_to_its_quota_oldest_first(tmp_path):
    limits = RecordingLimits(max_count=3)
    with TestClient(tiny_app(tmp_path, recording_limits=limits)) as c:
        content = _record(c)
        ndjson = {"content-type": "application/x-ndjson"}
        ids = [c.get("/api/recordings").json()[0]["id"]]
        for _ in range(4):
            time.sleep(0.01)  # distinct modification times
            ids.append(c.post("/api/recordings", content=content, headers=ndjson).json()["id"])
        assert {r["id"] for r in c.get("/api/recordings").json()} == set(ids[-3:])
        assert c.get(f"/api/recordings/{ids[0]}").status_code == 404
    limits = RecordingLimits(max_total_bytes=3 * len(content) + 10)
    with TestClient(tiny_app(tmp_path / "by-size", recording_limits=limits)) as c:
        for _ in range(5):
            c.post("/api/recordings", content=content, headers=ndjson)
        listed = c.get("/api/recordings").json()
        assert len(listed) == 3 and sum(r["size_bytes"] for r in listed) <= limits.max_total_bytes
        r = c.post("/api/recordings", content=content * 4, headers=ndjson)
        assert r.status_code == 413 and "at most" in error_of(r)["message"]


@pytest.mark.slow
def test_servers_sharing_a_recordings_folder_name_their_own_recordings(tmp_path):
    folder = tmp_path / "shared-recordings"
    with TestClient(tiny_app(tmp_path, recordings_dir=folder, server_name="127.0.0.1:8000")) as first:
        _record(first)
    with TestClient(tiny_app(tmp_path, recordings_dir=folder, server_name="127.0.0.1:8001")) as second:
        _record(second)
        upload = second.post(
            "/api/recordings", content=_record(second), headers={"content-type": "application/x-ndjson"}
        ).json()
        listed = second.get("/api/recordings").json()
    by_server = {r["id"]: (r["server"], r["mine"]) for r in listed}
    assert sorted(by_server.values()) == [
        ("127.0.0.1-8000", False),
        ("127.0.0.1-8001", True),
        ("127.0.0.1-8001", True),
        ("upload", False),
    ]
    assert by_server[upload["id"]] == ("upload", False)
    assert all(rid.startswith(f"rec-{server}-") for rid, (server, _) in by_server.items() if server != "upload")


def test_a_live_recording_stops_growing_at_its_cap_and_stays_readable(tmp_path):
    limits = RecordingLimits(max_active_bytes=6000)
    with TestClient(tiny_app(tmp_path, recording_limits=limits)) as c:
        c.post("/api/recordings/start")
        for _ in range(3):
            c.post("/v1/completions", json={"prompt": "Record me", "max_tokens": 20, "temperature": 0})
        stopped = c.post("/api/recordings/stop").json()
        recording = read_recording(tmp_path / "recordings" / f"{stopped['id']}.jsonl")
        size = (tmp_path / "recordings" / f"{stopped['id']}.jsonl").stat().st_size
        footer = len(msgspec.json.encode(recording.footer)) + 1
        assert size - footer <= limits.max_active_bytes < size and recording.footer is not None
        assert stopped["num_events"] == len(recording.events) > 0


def test_links_in_the_recordings_folder_are_never_listed_or_served(client, tmp_path):
    secret = tmp_path / "secret.jsonl"
    secret.write_bytes(_record(client))
    (tmp_path / "recordings" / "linked.jsonl").symlink_to(secret)
    assert "linked" not in {r["id"] for r in client.get("/api/recordings").json()}
    assert client.get("/api/recordings/linked").status_code == 404


# ---- static files and docs -------------------------------------------------------------------


def test_frontend_not_built_page_and_docs(client):
    r = client.get("/")
    assert r.status_code == 200 and "build" in r.text.lower() and r.headers["content-type"].startswith("text/html")
    assert client.get("/docs").status_code == 200
    document = client.get("/docs/openapi.json").json()
    paths = document["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/api/config", "/health", "/metrics"} <= set(paths)
    # request bodies, with the engine's limits on their fields
    body = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    chat = document["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]
    assert "messages" in chat["required"]
    number = lambda field: next(b for b in chat["properties"][field]["anyOf"] if b["type"] == "number")  # noqa: E731
    assert number("top_p") == {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
    assert number("temperature")["minimum"] == 0
    assert chat["properties"]["presence_penalty"] == {"type": "number", "default": 0.0, "minimum": -2, "maximum": 2}
    stop_array = next(b for b in chat["properties"]["stop"]["anyOf"] if b["type"] == "array")
    assert stop_array["maxItems"] == 64
    assert "requestBody" in paths["/v1/completions"]["post"] and "requestBody" in paths["/api/config"]["put"]


def test_frontend_dist_with_client_route_fallback(tmp_path):
    dist = tmp_path / "dist"
    (dist / "assets").mkdir(parents=True)
    (dist / "index.html").write_text("<html>dashboard</html>")
    (dist / "assets" / "app.js").write_text("console.log(1)")
    with TestClient(tiny_app(tmp_path, frontend_dist=dist)) as c:
        assert c.get("/").text == "<html>dashboard</html>"
        js = c.get("/assets/app.js")
        assert js.text == "console.log(1)" and "javascript" in js.headers["content-type"]
        assert c.get("/replay/some-recording").text == "<html>dashboard</html>"
        assert c.get("/assets/missing.js").status_code == 404
        assert c.get("/v1/unknown").status_code == 404
        assert c.get("/health").status_code == 200


def test_a_chat_request_is_labelled_with_its_last_user_message(client):
    """The chat route hands the engine token ids; the dashboard's label is the user's words, not the template's."""
    client.post("/api/recordings/start")
    body = {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour"}],
        "max_tokens": 2,
        **GREEDY,
    }
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    client.post("/v1/completions", json={"prompt": "Plain text prompt", "max_tokens": 2, **GREEDY})
    rid = client.post("/api/recordings/stop").json()["id"]
    recording = parse_lines(client.get(f"/api/recordings/{rid}").content.splitlines())
    previews = [e.prompt_preview for e in recording.events if isinstance(e, ev.RequestArrived)]
    assert previews == ["Name a colour", "Plain text prompt"]
