"""A real `minivllm serve` (uvicorn, the embedded model, a small KV pool) driven by the official
openai client: concurrent streaming equals one-at-a-time greedy output, errors map onto the
client's exception types, a dropped stream frees its blocks, and a WebSocket client that never
reads does not slow generation."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import openai  # these tests must run, never skip: both come with `make setup`
import pytest
import websockets.sync.client as websockets_sync
from test_server_support import wait_for

from engine_utils import NEAR_TIE_NATS
from minivllm.events import types as ev

pytestmark = pytest.mark.slow  # a server, a subprocess or the real model in every test

API_KEY = "test-key"
PROMPTS = [
    "What is a KV cache?",
    "Name three colors.",
    "Write a haiku about the sea.",
    "Count to five.",
    "Why is the sky blue?",
    "Say hello in French.",
    "What is 2 + 2?",
    "Describe a cat in one sentence.",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(tmp_path_factory, *model_args: str):
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "minivllm.cli",
        "serve",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--num-blocks",
        "160",
        *model_args,
        "--max-num-seqs",
        "16",
        "--max-model-len",
        "1024",
        "--api-key",
        API_KEY,
        "--recordings-dir",
        str(tmp_path_factory.mktemp("recordings")),
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "MINIVLLM_API_KEY": ""}
    log = tmp_path_factory.mktemp("server") / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    statuses: list[int] = []

    def ready() -> bool:
        assert proc.poll() is None, f"the server exited: {log.read_text()[-3000:]}"
        try:
            statuses.append(httpx.get(f"{base}/health", timeout=2).status_code)
        except httpx.TransportError:
            return False
        return statuses[-1] == 200

    try:
        wait_for(ready, timeout=180, interval=0.1, what="the server to load its model")
        yield {"base": base, "port": port, "health_statuses": statuses, "proc": proc}
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The embedded SmolLM2 model (the default)."""
    yield from _start_server(tmp_path_factory)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server['base']}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """random:tiny: steps are short, so events come fast and a stuck client's cost would show. Its
    many (one-token) blocks make every snapshot ~4 MB, more than the kernel buffers (~3 MB on
    loopback) of a client that never reads, so that the server's sends to it really block."""
    yield from _start_server(
        tmp_path_factory,
        "--model",
        "random:tiny",
        "--block-size",
        "1",
        "--num-blocks",
        "80000",
        "--ws-queue-limit",
        "256",
    )


def _chat_stream(client, prompt: str, max_tokens: int = 10) -> list[tuple[str, dict[str, float]]]:
    """The streamed answer as (token, {top-5 token: logprob}) pairs."""
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        stream=True,
        temperature=0,
        max_tokens=max_tokens,
        messages=[{"role": "user", "content": prompt}],
        logprobs=True,
        top_logprobs=5,
    )
    return [
        (t.token, {alt.token: alt.logprob for alt in t.top_logprobs})
        for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for t in chunk.choices[0].logprobs.content
    ]


def _assert_parts_only_at_a_near_tie(alone, batched) -> None:
    """Batched and alone greedy runs sum attention in different orders, and the default's int8
    activations turn a last-bit difference into a rounding step; where the batched run parts from
    the alone one, it must take a token the alone run rated within NEAR_TIE_NATS of its pick (a flat
    distribution can hold three such; then the texts may differ)."""
    j = next((i for i, (a, b) in enumerate(zip(alone, batched)) if a[0] != b[0]), None)
    if j is None:
        assert len(alone) == len(batched)
        return
    chosen, top = alone[j]
    taken = batched[j][0]
    assert taken in top, f"parted at token {j}: {taken!r} is not among the alone run's top 5 ({top})"
    assert top[chosen] - top[taken] <= NEAR_TIE_NATS, f"parted at token {j} by {top[chosen] - top[taken]:.3f} nats"


def test_health_was_503_while_loading_then_200(server):
    assert server["health_statuses"][-1] == 200
    assert 503 in server["health_statuses"], "the server answered before the model had loaded"


def test_eight_concurrent_streaming_chats_match_sequential_greedy_up_to_near_ties(client):
    sequential = [_chat_stream(client, p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        concurrent = list(pool.map(lambda p: _chat_stream(client, p), PROMPTS))
    assert all(sequential)
    for alone, batched in zip(sequential, concurrent):
        _assert_parts_only_at_a_near_tie(alone, batched)


def test_client_sees_usage_logprobs_and_errors(client):
    model = client.models.list().data[0]
    assert model.id == "SmolLM2-135M-Instruct" or model.id
    out = client.completions.create(
        model=model.id, prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2
    )
    assert out.usage.completion_tokens == 5 and len(out.choices[0].logprobs.tokens) == 5
    stream = client.chat.completions.create(
        model=model.id,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model.id, prompt="x", max_tokens=0)
    assert bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0).models.list()


def _metric(server, name: str) -> float:
    text = httpx.get(f"{server['base']}/metrics").text
    line = next(line for line in text.splitlines() if line.startswith(f"minivllm:{name}{{"))
    return float(line.rsplit(" ", 1)[1])


def test_dropped_stream_is_aborted_and_its_blocks_freed(server, client):
    stream = client.completions.create(
        model=client.models.list().data[0].id,
        prompt="Tell a very long story",
        max_tokens=900,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 1:
            break
    assert _metric(server, "num_requests_running") == 1
    stream.close()
    wait_for(
        lambda: _metric(server, "num_requests_running") == 0 and _metric(server, "kv_cache_usage_perc") == 0,
        timeout=30,
        interval=0.05,
        what="the abort",
    )


class StuckWebSocket:
    """Completes the WebSocket handshake, then never reads again (a tiny receive buffer fills fast)."""

    def __init__(self, port: int):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect(("127.0.0.1", port))
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (
                f"GET /ws/events?api_key={API_KEY} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.sock.recv(1)
        assert head.startswith(b"HTTP/1.1 101"), head

    def drain(self, until, timeout: float = 30.0) -> list:
        """Start reading at last: decode frames until `until(messages)` holds."""
        self.sock.settimeout(timeout)
        buf, messages, deadline = b"", [], time.monotonic() + timeout
        while not until(messages):
            assert time.monotonic() < deadline, f"gave up after {len(messages)} messages"
            buf += self.sock.recv(1 << 16)
            while len(buf) >= 2:
                length, start = buf[1] & 0x7F, 2
                if length == 126:
                    length, start = int.from_bytes(buf[2:4], "big"), 4
                elif length == 127:
                    length, start = int.from_bytes(buf[2:10], "big"), 10
                if len(buf) < start + length:
                    break
                if buf[0] & 0x0F == 1:  # a text frame (the server does not fragment)
                    messages.append(msgspec.json.decode(buf[start : start + length], type=ev.WsMessage))
                buf = buf[start + length :]
        return messages

    def close(self):
        self.sock.close()


def _throughput(client, n: int = 4, max_tokens: int = 100) -> float:
    def one(i: int) -> int:
        out = client.completions.create(
            model=client.models.list().data[0].id,
            prompt=f"Story number {i}:",
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return out.usage.completion_tokens

    start = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        tokens = sum(pool.map(one, range(n)))
    return tokens / (time.perf_counter() - start)


def test_a_stuck_websocket_client_does_not_slow_generation(tiny_server):
    server = tiny_server
    client = openai.OpenAI(base_url=f"{server['base']}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    _throughput(client, n=2, max_tokens=8)  # warm up
    baseline = _throughput(client)
    stuck = StuckWebSocket(server["port"])
    received: list[ev.EventBatch | ev.Snapshot | ev.Resync] = []
    stop = threading.Event()
    url = f"ws://127.0.0.1:{server['port']}/ws/events?api_key={API_KEY}"
    with websockets_sync.connect(url, max_size=None) as healthy:

        def read_healthy():
            while not stop.is_set():
                try:
                    received.append(msgspec.json.decode(healthy.recv(timeout=0.2), type=ev.WsMessage))
                except TimeoutError:
                    continue
                except Exception:  # noqa: BLE001 - closed at the end of the test
                    return

        reader = threading.Thread(target=read_healthy, daemon=True)
        reader.start()
        try:
            wait_for(lambda: received, timeout=30, what="the healthy client's snapshot")
            _throughput(client, n=4, max_tokens=50)  # > 256 events: the stuck client's feed overflows
            with_stuck = _throughput(client)
            # read the stuck client at last: it fell behind, so it got a resync and a fresh snapshot
            drained = stuck.drain(lambda ms: any(isinstance(m, ev.Resync) for m in ms[:-1]))
            after = drained[[isinstance(m, ev.Resync) for m in drained].index(True) + 1]
            assert isinstance(drained[0], ev.Snapshot) and isinstance(after, ev.Snapshot)
        finally:
            stop.set()
            reader.join(5)
            stuck.close()
    print(f"throughput: {baseline:.1f} tok/s without, {with_stuck:.1f} tok/s with a stuck WebSocket client")
    assert with_stuck >= 0.5 * baseline, f"{with_stuck:.1f} tok/s with a stuck client vs {baseline:.1f} without"
    assert isinstance(received[0], ev.Snapshot) and not any(isinstance(m, ev.Resync) for m in received)
    tokens = sum(isinstance(e, ev.TokenGenerated) for m in received if isinstance(m, ev.EventBatch) for e in m.events)
    assert tokens == 4 * 50 + 4 * 100, "the healthy client got every event"
    assert client.models.list().data  # the server is fine afterwards


# ---- structured outputs and tools through the official client (the embedded model) -------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
WEATHER_QUESTION = [{"role": "user", "content": "What's the weather like in Paris today?"}]


def test_parse_returns_a_pydantic_object(client):
    import pydantic

    class City(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=40)
        country: str = pydantic.Field(max_length=40)
        population: int = pydantic.Field(ge=0, le=100_000_000)
        is_capital: bool

    model = client.models.list().data[0].id
    out = client.chat.completions.parse(
        model=model,
        response_format=City,
        max_tokens=120,
        temperature=0,
        messages=[{"role": "user", "content": "Give me facts about Paris as JSON."}],
    )
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, City) and out.choices[0].finish_reason == "stop"
    assert parsed.city  # the model's own words, in the schema's shape


def _stream_tool_calls(stream) -> tuple[list[dict], str | None, str]:
    """Accumulate streamed tool-call deltas by index, as OpenAI's clients do."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish, content


def test_a_tool_call_round_trip_streaming_and_not(client):
    import jsonschema

    model = client.models.list().data[0].id
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(
        model=model, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL], tool_choice=named, max_tokens=80, temperature=0
    )
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.content is None
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])

    streamed, finish, content = _stream_tool_calls(
        client.chat.completions.create(
            model=model,
            messages=WEATHER_QUESTION,
            tools=[WEATHER_TOOL],
            tool_choice=named,
            max_tokens=80,
            temperature=0,
            stream=True,
        )
    )
    assert finish == "tool_calls" and not content.strip()
    assert [(c["name"], c["arguments"]) for c in streamed] == [(call.function.name, call.function.arguments)]

    answer = client.chat.completions.create(
        model=model,
        tools=[WEATHER_TOOL],
        max_tokens=60,
        temperature=0,
        messages=[
            *WEATHER_QUESTION,
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "sunny"})},
        ],
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
