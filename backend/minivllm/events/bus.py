"""A synchronous, non-blocking event bus: stamps events and hands them to subscribers.

Subscribers run on the engine thread, so they must only append to a buffer (the server's
WebSocket hub, the recorder) and return. A subscriber that raises is dropped, never the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from minivllm.events.types import AnyEvent

Subscriber = Callable[[AnyEvent], None]
log = logging.getLogger("minivllm.events")


class EventBus:
    def __init__(self, history: int = 50_000):
        self._subscribers: list[Subscriber] = []
        self._lock = threading.Lock()
        self._next_seq = 1
        self.started = time.monotonic()
        self.history: deque[AnyEvent] = deque(maxlen=history)  # ring buffer for resume (?since=)

    @property
    def last_seq(self) -> int:
        return self._next_seq - 1

    def now(self) -> float:
        return time.monotonic() - self.started

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        with self._lock:
            self._subscribers.append(fn)
        return lambda: self.unsubscribe(fn)

    def unsubscribe(self, fn: Subscriber) -> None:
        with self._lock:
            if fn in self._subscribers:
                self._subscribers.remove(fn)

    def emit(self, event: AnyEvent) -> AnyEvent:
        with self._lock:
            event.seq = self._next_seq
            self._next_seq += 1
            event.ts = self.now()
            self.history.append(event)
            subscribers = list(self._subscribers)
        for fn in subscribers:
            try:
                fn(event)
            except Exception:  # a broken subscriber must not take the engine down
                log.exception("event subscriber failed; unsubscribing it")
                self.unsubscribe(fn)
        return event

    def since(self, seq: int) -> list[AnyEvent] | None:
        """Events with sequence number > seq, or None when some of them already left the ring."""
        with self._lock:
            if seq >= self._next_seq - 1:
                return []
            if not self.history or self.history[0].seq > seq + 1:
                return None
            return [e for e in self.history if e.seq > seq]

    def replay_after(self, since: int | None) -> tuple[list[AnyEvent] | None, str | None]:
        """(events after `since`, None) for a subscriber resuming there, or (None, why not) when a
        resume is impossible; (None, None) for one starting from scratch."""
        if since is None:
            return None, None
        last = self.last_seq
        if since > last:
            return None, f"seq {since} is ahead of this server (last seq {last})"
        replay = self.since(since)
        return (replay, None) if replay is not None else (None, f"events after seq {since} are no longer buffered")
