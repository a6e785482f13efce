"""One WebSocket client's view of the event bus: a bounded buffer between two threads.

The bus calls the feed on the engine thread, so `__call__` only appends to a bounded deque and,
at the end of a step, wakes the client's sender on the event loop with `call_soon_threadsafe`.
A client that does not keep up overflows its buffer: the feed then drops events (cheaply) until
the sender notices, sends a `resync`, and replaces the buffer with a fresh snapshot, which
`reset` takes on the engine thread so that no event falls between the two.
"""

from __future__ import annotations

import asyncio
from collections import deque

from minivllm.events import types as ev

_FLUSH_NOW = (ev.StepFinished, ev.ConfigChanged)
MAX_HOLD_TICKS = 20  # a step that never finishes (it failed) is released after this many flushes


class ClientFeed:
    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int):
        self.limit = limit
        self.overflowed = False
        self._buffer: deque[ev.AnyEvent] = deque()  # engine thread appends, loop thread pops
        self._pending: list[ev.AnyEvent] = []  # loop thread only: popped, not sent yet
        self._loop = loop
        self._wake = asyncio.Event()
        self._wake_scheduled = False
        self._held: tuple[int, int] = (0, 0)  # (seq of the StepScheduled held back, flushes so far)

    # ---- engine thread ------------------------------------------------------------------------

    def __call__(self, event: ev.AnyEvent) -> None:
        if self.overflowed:
            return
        if len(self._buffer) >= self.limit:
            self.overflowed = True
            self._notify()
            return
        self._buffer.append(event)
        if isinstance(event, _FLUSH_NOW):
            self._notify()

    def reset(self) -> None:
        """Run on the engine thread, just before a fresh snapshot: forget the buffer."""
        self._buffer.clear()
        self.overflowed = False

    def _notify(self) -> None:
        if self._wake_scheduled:
            return
        self._wake_scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._wake_up)
        except RuntimeError:  # the client's loop is closed
            pass

    # ---- event loop thread --------------------------------------------------------------------

    def _wake_up(self) -> None:
        self._wake_scheduled = False
        self._wake.set()

    async def wait(self, timeout: float) -> None:
        """Until the end of a step (or an overflow), at most `timeout` seconds."""
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except TimeoutError:
            pass
        self._wake.clear()

    def take(self) -> list[ev.AnyEvent]:
        """The events ready to send: everything except the events of a step still running, which
        go out together with its StepFinished (so a client gets at most one message per step)."""
        for _ in range(len(self._buffer)):
            self._pending.append(self._buffer.popleft())
        cut = len(self._pending)
        for i in range(len(self._pending) - 1, -1, -1):
            event = self._pending[i]
            if isinstance(event, ev.StepFinished):
                break
            if isinstance(event, ev.StepScheduled):
                held, ticks = self._held
                self._held = (event.seq, ticks + 1 if held == event.seq else 1)
                if self._held[1] <= MAX_HOLD_TICKS:
                    cut = i
                break
        ready, self._pending = self._pending[:cut], self._pending[cut:]
        return ready

    def drop_pending(self) -> None:
        self._pending.clear()
