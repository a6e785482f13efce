"""GET /ws/events: a snapshot, then batched live events (at most one message per engine step).

`?format=msgpack` switches from JSON text frames to msgpack binary frames. `?since=SEQ` resumes:
the missed events come from the bus's ring buffer, or, when they are gone, a `resync` and a
fresh snapshot. A client that cannot keep up overflows its bounded feed and gets a `resync` and
a fresh snapshot; the engine and the other clients never wait for it.

A client may send `{"type": "step_profile", "on": true|false}`: while any client has it on, every
StepFinished carries the step's profile (engine/step_profile.py); closing the socket turns it off.
Any other message closes the socket with 4400 and the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import msgspec
from litestar import Router, WebSocket, websocket
from litestar.exceptions import WebSocketDisconnect

from minivllm.engine.api import AsyncEngine, EngineDeadError, ReplicaSet
from minivllm.events import types as ev
from minivllm.server.auth import key_problem
from minivllm.server.client_feed import ClientFeed
from minivllm.server.errors import APIError
from minivllm.server.state import ServerState

REPLAY_BATCH = 2000  # events per message when replaying `since`
CLOSE_TOO_MANY_CLIENTS = 4429  # 4000-4999: application codes, named after the HTTP status they mirror
CLOSE_UNAUTHORIZED = 4401
CLOSE_BAD_MESSAGE = 4400


class StepProfileWatch(msgspec.Struct, tag="step_profile", tag_field="type", forbid_unknown_fields=True):
    """The client's step-profile panel opened (on) or closed."""

    on: bool


_decode_client_message = msgspec.json.Decoder(StepProfileWatch).decode


class _Client:
    def __init__(self, socket: WebSocket, ae: AsyncEngine, feed: ClientFeed, binary: bool):
        self.socket, self.ae, self.feed = socket, ae, feed
        self.encode: Callable[[object], bytes] = (
            msgspec.msgpack.Encoder() if binary else msgspec.json.Encoder()
        ).encode
        self.mode = "binary" if binary else "text"

    async def send(self, message: ev.Snapshot | ev.EventBatch | ev.Resync) -> None:
        data = self.encode(message)
        await self.socket.send_data(data if self.mode == "binary" else data.decode(), mode=self.mode)  # type: ignore[arg-type]

    async def resnapshot(self, reason: str | None) -> None:
        if reason is not None:
            await self.send(ev.Resync(reason=reason))
        snapshot = await self.ae.resync(self.feed.reset)
        self.feed.drop_pending()
        await self.send(snapshot)

    async def start(self, since: int | None) -> None:
        """Subscribe and read the starting point in one engine-thread call: no gap, no overlap."""
        snapshot, replay, resync = await self.ae.subscribe(self.feed, since)
        if resync is not None:
            await self.send(ev.Resync(reason=resync))
        if snapshot is not None:
            await self.send(snapshot)
        for i in range(0, len(replay or []), REPLAY_BATCH):
            await self.send(ev.EventBatch(events=replay[i : i + REPLAY_BATCH]))

    async def pump(self, flush_interval_s: float) -> None:
        while True:
            await self.feed.wait(flush_interval_s)
            if self.feed.overflowed:
                await self.resnapshot(f"the client fell behind: more than {self.feed.limit} events were queued")
                continue
            batch = self.feed.take()
            if batch:
                await self.send(ev.EventBatch(events=batch))
            if any(isinstance(e, ev.ConfigChanged) for e in batch):
                await self.resnapshot(None)  # the engine was rebuilt: a fresh snapshot follows


async def _receive(socket: WebSocket, client: _Client) -> None:
    """The client's messages until it closes; a malformed one closes the socket with the reason."""
    with contextlib.suppress(WebSocketDisconnect):
        while True:
            text = await socket.receive_data(mode="text")
            try:
                message = _decode_client_message(text)
            except msgspec.DecodeError as exc:  # ValidationError included
                await socket.close(code=CLOSE_BAD_MESSAGE, reason=f"bad client message: {exc}"[:120])
                return
            client.ae.watch_step_profile(client.feed, message.on)


def _integer(text: str | None, name: str) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        raise ValueError(f"{name} must be an integer") from None


@websocket("/events")
async def events_socket(socket: WebSocket) -> None:
    server: ServerState = socket.app.state.server
    unauthorized = key_problem(socket)
    if unauthorized is not None:  # accepted first, so a browser's onclose sees the code and the reason
        await socket.accept()
        await socket.close(code=CLOSE_UNAUTHORIZED, reason=unauthorized[:120])
        return
    params = socket.query_params
    binary = params.get("format", "json") == "msgpack"
    since_text = params.get("since")
    try:
        since = _integer(since_text, "since")
        ae = server.engine()
        if isinstance(ae, ReplicaSet):  # the dashboard follows one replica at a time (?replica=, default 0)
            ae = ae.events_of(_integer(params.get("replica"), "replica") or 0)
    except (ValueError, APIError) as exc:
        await socket.accept()
        await socket.close(
            code=4400 if isinstance(exc, ValueError) else 4503,
            reason=str(exc)[:120] if isinstance(exc, ValueError) else exc.message[:120],
        )
        return
    await socket.accept()
    if server.ws_clients >= server.config.max_ws_clients:
        await socket.close(
            code=CLOSE_TOO_MANY_CLIENTS, reason=f"too many dashboard clients ({server.ws_clients}); close another tab"
        )
        return
    server.ws_clients += 1
    feed = ClientFeed(asyncio.get_running_loop(), server.config.ws_queue_limit)
    client = _Client(socket, ae, feed, binary)
    tasks: list[asyncio.Task] = []
    try:
        await client.start(since)
        tasks = [
            asyncio.ensure_future(client.pump(server.config.ws_flush_interval_s)),
            asyncio.ensure_future(_receive(socket, client)),
        ]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    except (WebSocketDisconnect, EngineDeadError):
        pass
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        ae.detach(feed)
        server.ws_clients -= 1
        with contextlib.suppress(Exception):
            await socket.close()


def events_router() -> Router:
    return Router("/ws", route_handlers=[events_socket])  # the key is checked in the handler: a close code
