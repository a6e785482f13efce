"""GET /ws/events through TestClient: snapshot, live batches, msgpack, resume, resync on overflow;
and the ClientFeed's batching rule on its own."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from litestar.testing import TestClient
from test_server_support import server_of, tiny_app, tiny_model, wait_for

from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.events import types as ev
from minivllm.events.bus import EventBus
from minivllm.events.fold import StateFolder
from minivllm.sampling.params import SamplingParams
from minivllm.server.client_feed import MAX_HOLD_TICKS, ClientFeed

_decode = msgspec.json.Decoder(ev.WsMessage).decode
TIMEOUT = 20


def receive(ws, binary: bool = False):
    if binary:
        return msgspec.msgpack.decode(ws.receive_bytes(timeout=TIMEOUT), type=ev.WsMessage)
    return _decode(ws.receive_text(timeout=TIMEOUT))


def receive_until(ws, done, limit: int = 10_000):
    """Messages until `done(messages)` holds."""
    messages = []
    for _ in range(limit):
        messages.append(receive(ws))
        if done(messages):
            return messages
    raise AssertionError("the condition never held")


def finished(request_id: str):
    def check(messages) -> bool:
        return any(
            isinstance(e, ev.RequestStateChanged) and e.request_id == request_id and e.state == "FINISHED"
            for m in messages
            if isinstance(m, ev.EventBatch)
            for e in m.events
        )

    return check


@pytest.fixture
def client(tmp_path):
    with TestClient(tiny_app(tmp_path)) as c:
        yield c


def test_snapshot_then_live_batches_fold_to_the_engine_state(client):
    with client.websocket_connect("/ws/events") as ws:
        snapshot = receive(ws)
        assert isinstance(snapshot, ev.Snapshot) and snapshot.config.num_blocks == 64
        r = client.post(
            "/v1/completions",
            json={"prompt": "Hello there", "n": 2, "max_tokens": 6},
            headers={"X-Request-Id": "live-1"},
        )
        assert r.status_code == 200
        messages = receive_until(ws, finished("live-1"))
    assert all(isinstance(m, ev.EventBatch) for m in messages)
    events = [e for m in messages for e in m.events]
    assert [e.seq for e in events] == list(range(snapshot.seq + 1, snapshot.seq + 1 + len(events)))
    # How events are cut into messages depends on when the sender wakes (several steps in one message on a
    # busy machine; a slow first step released after MAX_HOLD_TICKS): the feed's rule is tested on its own
    # (test_feed_holds_a_running_step_until_it_finishes). Here: nothing lost or reordered, and it folds.
    steps = [e.step for e in events if isinstance(e, ev.StepFinished)]
    assert len(steps) >= 6
    tokens = [e for e in events if isinstance(e, ev.TokenGenerated) and e.request_id == "live-1"]
    assert len(tokens) == 12
    folded = StateFolder(snapshot).apply_all(events).snapshot()
    engine_state = msgspec.json.decode(client.get("/api/state").content, type=ev.Snapshot)
    assert msgspec.to_builtins(folded.requests) == msgspec.to_builtins(engine_state.requests)
    assert msgspec.to_builtins(folded.blocks) == msgspec.to_builtins(engine_state.blocks)


def test_msgpack_format(client):
    with client.websocket_connect("/ws/events?format=msgpack") as ws:
        snapshot = receive(ws, binary=True)
        assert isinstance(snapshot, ev.Snapshot)
        client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers={"X-Request-Id": "mp"})
        batch = receive(ws, binary=True)
        assert isinstance(batch, ev.EventBatch) and batch.events[0].seq == snapshot.seq + 1


def test_resume_with_since_replays_missed_events(client):
    with client.websocket_connect("/ws/events") as ws:
        seen = receive(ws).seq
    client.post(
        "/v1/completions", json={"prompt": "While you were away", "max_tokens": 3}, headers={"X-Request-Id": "missed"}
    )
    with client.websocket_connect(f"/ws/events?since={seen}") as ws:
        first = receive(ws)
        assert isinstance(first, ev.EventBatch), "a resumable client gets events, not a snapshot"
        assert first.events[0].seq == seen + 1
        assert any(isinstance(e, ev.RequestArrived) and e.request_id == "missed" for e in first.events)


def test_resume_when_the_events_are_gone_sends_resync_and_snapshot(tmp_path):
    engine = LLMEngine(tiny_model(), EngineConfig(num_blocks=64, max_model_len=512), bus=EventBus(history=5))
    with TestClient(tiny_app(tmp_path, engine=engine)) as c:
        c.post("/v1/completions", json={"prompt": "Fill the ring", "max_tokens": 4})
        for since in (1, 10**9):  # too old, and from another server's life
            with c.websocket_connect(f"/ws/events?since={since}") as ws:
                resync, snapshot = receive(ws), receive(ws)
                assert isinstance(resync, ev.Resync) and str(since) in resync.reason
                assert isinstance(snapshot, ev.Snapshot) and snapshot.requests[0].state == "FINISHED"
        with pytest.raises(Exception):  # noqa: B017 - a refused handshake: the client's class varies by version
            with c.websocket_connect("/ws/events?since=abc") as ws:
                ws.receive_text(timeout=TIMEOUT)


def test_overflowing_client_gets_resync_then_a_fresh_snapshot_and_recovers(tmp_path):
    with TestClient(tiny_app(tmp_path, ws_queue_limit=3)) as c:
        ae = server_of(c.app).async_engine
        with c.websocket_connect("/ws/events") as ws:
            assert isinstance(receive(ws), ev.Snapshot)
            ids = [f"burst-{i}" for i in range(5)]
            # 5 arrivals in one engine-thread call: 15+ events before the sender can run
            ae.submit(lambda e: [e.add_request(i, "Hello", SamplingParams(max_tokens=3)) for i in ids]).result()
            state, saw_resync = None, False
            for _ in range(1000):
                message = receive(ws)
                if isinstance(message, ev.Resync):
                    saw_resync = True
                    assert "fell behind" in message.reason
                    snapshot = receive(ws)
                    assert isinstance(snapshot, ev.Snapshot), "a resync is followed by a snapshot"
                    state = StateFolder(snapshot)
                elif isinstance(message, ev.EventBatch) and state is not None:
                    assert message.events[0].seq == state.seq + 1, "no gap after a snapshot"
                    state.apply_all(message.events)
                if state is not None and all(
                    state.requests.get(i) is not None and state.requests[i].state == "FINISHED" for i in ids
                ):
                    break
            else:
                raise AssertionError("the client never caught up")
            assert saw_resync


def test_config_change_is_followed_by_a_snapshot(client):
    with client.websocket_connect("/ws/events") as ws:
        receive(ws)
        assert client.put("/api/config", json={"num_blocks": 40}).status_code == 200
        batch = receive(ws)
        assert isinstance(batch, ev.EventBatch) and isinstance(batch.events[-1], ev.ConfigChanged)
        snapshot = receive(ws)
        assert isinstance(snapshot, ev.Snapshot) and len(snapshot.blocks) == 40


# ---- ClientFeed on its own -------------------------------------------------------------------


def _step_events(step: int, seq: int) -> list[ev.Event]:
    scheduled = ev.StepScheduled(
        step=step,
        prefill=[],
        decode=[],
        budget_used=1,
        budget=8,
        num_running=1,
        num_waiting=0,
        preempted=[],
        queue_head=None,
        queue_head_reason=None,
        seq=seq,
    )
    token = ev.TokenGenerated(request_id="r", seq_id=0, token_id=1, text="a", logprob=None, seq=seq + 1)
    done = ev.StepFinished(
        step=step,
        duration_ms=1,
        num_tokens=1,
        num_generated=1,
        schedule_ms=0,
        forward_ms=1,
        sample_ms=0,
        postprocess_ms=0,
        seq=seq + 2,
    )
    return [scheduled, token, done]


def test_feed_holds_a_running_step_until_it_finishes():
    loop = asyncio.new_event_loop()
    try:
        feed = ClientFeed(loop, limit=100)
        arrived = ev.RequestArrived(
            request_id="r", prompt_tokens=1, max_tokens=1, n=1, priority=0, sampling={}, prompt_preview="", seq=1
        )
        first, second = _step_events(1, 2), _step_events(2, 5)
        for e in [arrived, *first, *second[:2]]:
            feed(e)
        assert [e.seq for e in feed.take()] == [1, 2, 3, 4]  # step 2 is still running
        feed(second[2])
        assert [e.seq for e in feed.take()] == [5, 6, 7]
        assert feed.take() == []
        feed(_step_events(3, 8)[0])  # a step that never finishes is released eventually
        held = [feed.take() for _ in range(MAX_HOLD_TICKS)]
        assert held == [[]] * MAX_HOLD_TICKS and [e.seq for e in feed.take()] == [8]
    finally:
        loop.close()


def test_feed_overflow_drops_and_reset_restarts():
    loop = asyncio.new_event_loop()
    try:
        feed = ClientFeed(loop, limit=4)
        for e in _step_events(1, 1) + _step_events(2, 4):
            feed(e)
        assert feed.overflowed

        feed.reset()
        assert not feed.overflowed
        feed.drop_pending()
        assert feed.take() == []
    finally:
        loop.close()


def test_a_long_stop_list_is_summarised_in_events_and_snapshots():
    from minivllm.engine.wire import stop_summary

    assert stop_summary(["a", "b"]) == ["a", "b"]
    many = [f"stop-{i}-" + "x" * 60 for i in range(64)]
    shown = stop_summary(many)
    assert len(shown) == 5 and shown[-1] == "(+60 more)" and all(len(s) <= 40 for s in shown[:4])
    assert shown[0].startswith("stop-0-") and shown[0].endswith("…")


def test_clients_past_the_cap_are_closed_with_a_clear_code(tmp_path):
    from litestar.exceptions import WebSocketDisconnect

    from minivllm.server.events_ws import CLOSE_TOO_MANY_CLIENTS

    with TestClient(tiny_app(tmp_path, max_ws_clients=2)) as c:
        with c.websocket_connect("/ws/events") as first, c.websocket_connect("/ws/events") as second:
            assert isinstance(receive(first), ev.Snapshot) and isinstance(receive(second), ev.Snapshot)
            with c.websocket_connect("/ws/events") as third:
                with pytest.raises(WebSocketDisconnect) as closed:
                    third.receive_text(timeout=TIMEOUT)
                assert closed.value.code == CLOSE_TOO_MANY_CLIENTS and "too many" in closed.value.detail
        # the two left: their places are free again (once their handlers have finished)
        wait_for(lambda: server_of(c.app).ws_clients == 0, timeout=TIMEOUT, what="the clients to leave")
        with c.websocket_connect("/ws/events") as again:
            assert isinstance(receive(again), ev.Snapshot)
