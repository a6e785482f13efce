"""A client that goes away aborts its request within one engine step, and its blocks are freed.

The app is driven through raw ASGI calls (the lifespan runs in AsyncTestClient), so the test
decides exactly when the client disconnects: after a few streamed chunks, while a non-streaming
request generates, and while a request still waits in the queue (no output yet).
"""

from __future__ import annotations

import asyncio
import json
import time

from litestar.testing import AsyncTestClient
from test_server_support import server_of, tiny_app, tiny_engine

from minivllm.events import types as ev
from minivllm.sampling.params import SamplingParams

TIMEOUT = 30


def _scope(path: str, body: bytes, request_id: str) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-request-id", request_id.encode()),
            (b"host", b"testserver"),
        ],
        "client": ("127.0.0.1", 5000),
        "server": ("testserver", 80),
    }


async def _call_and_disconnect(app, path: str, payload: dict, request_id: str, disconnect_when) -> list[bytes]:
    """Run one request; `disconnect_when(chunks)` decides when the client goes away."""
    body = json.dumps(payload).encode()
    gone = asyncio.Event()
    sent_body = False
    chunks: list[bytes] = []

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        while not disconnect_when(chunks):  # the app listens for a disconnect: decide when it comes
            await asyncio.sleep(0.002)
        gone.set()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            if gone.is_set():
                return  # what uvicorn does with a write to a closed connection: drops it (raising made a race)
            chunks.append(message["body"])

    await asyncio.wait_for(app(_scope(path, body, request_id), receive, send), TIMEOUT)
    return chunks


def _run_scenario(tmp_path, payload: dict, path: str, disconnect_when, occupy: bool = False):
    engine = tiny_engine(max_num_seqs=1 if occupy else 8)
    app = tiny_app(tmp_path, engine=engine)
    log: list[ev.Event] = []
    marks: dict[str, int] = {}

    async def scenario():
        async with AsyncTestClient(app):
            ae = server_of(app).async_engine
            ae.submit(lambda e: e.bus.subscribe(log.append)).result()
            if occupy:  # one long request holds the only running slot: ours must wait in the queue
                ae.submit(
                    lambda e: e.add_request("occupier", "Hello", SamplingParams(max_tokens=300, ignore_eos=True))
                ).result()

            def when(chunks):
                if disconnect_when(chunks, log) and "at" not in marks:
                    marks["at"] = log[-1].seq if log else 0
                    return True
                return "at" in marks

            chunks = await _call_and_disconnect(app, path, payload, "leaver", when)
            deadline = time.monotonic() + TIMEOUT
            while not any(
                isinstance(e, ev.RequestStateChanged) and e.request_id == "leaver" and e.state == "FINISHED"
                for e in list(log)
            ):
                assert time.monotonic() < deadline, "the request was never aborted"
                await asyncio.sleep(0.005)
            if occupy:
                ae.abort("occupier")
            while await ae.call(lambda e: e.has_unfinished_requests()):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.005)
            free = await ae.call(lambda e: (e.block_manager.num_free_blocks, e.block_manager.num_blocks))
            return chunks, free

    chunks, (free, total) = asyncio.run(scenario())
    finish = next(
        e for e in log if isinstance(e, ev.RequestStateChanged) and e.request_id == "leaver" and e.state == "FINISHED"
    )
    assert finish.finish_reason == "abort"
    steps_after = [e for e in log if isinstance(e, ev.StepFinished) and marks["at"] < e.seq < finish.seq]
    assert len(steps_after) <= 1, f"aborted only after {len(steps_after)} more steps"
    assert free == total, "every block is free again"
    return chunks, log


def _tokens(log, request_id="leaver"):
    return sum(1 for e in log if isinstance(e, ev.TokenGenerated) and e.request_id == request_id)


def test_streaming_client_disconnect_aborts_and_frees_blocks(tmp_path):
    payload = {"prompt": "A long story about caches", "max_tokens": 400, "ignore_eos": True, "stream": True}
    chunks, log = _run_scenario(tmp_path, payload, "/v1/completions", lambda chunks, log: len(chunks) >= 5)
    assert 5 <= len(chunks) and b"[DONE]" not in b"".join(chunks)
    assert _tokens(log) < 400


def test_streaming_chat_disconnect(tmp_path):
    payload = {
        "messages": [{"role": "user", "content": "Talk forever"}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
        "n": 2,
    }
    _, log = _run_scenario(tmp_path, payload, "/v1/chat/completions", lambda chunks, log: len(chunks) >= 6)
    assert _tokens(log) < 800


def test_non_streaming_client_disconnect(tmp_path):
    payload = {"prompt": "A long story", "max_tokens": 400, "ignore_eos": True}

    def after_some_tokens(chunks, log):
        return _tokens(list(log)) >= 5

    chunks, log = _run_scenario(tmp_path, payload, "/v1/completions", after_some_tokens)
    assert _tokens(log) < 400


def test_disconnect_while_waiting_in_the_queue(tmp_path):
    payload = {"prompt": "Me next", "max_tokens": 20, "stream": True}

    def once_queued(chunks, log):
        return any(isinstance(e, ev.RequestArrived) and e.request_id == "leaver" for e in list(log))

    chunks, log = _run_scenario(tmp_path, payload, "/v1/completions", once_queued, occupy=True)
    assert chunks == [] or b"data:" not in b"".join(chunks)
    assert _tokens(log) == 0
