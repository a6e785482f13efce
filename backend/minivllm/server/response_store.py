"""Finished responses kept in memory for `previous_response_id`, `GET` and `DELETE /v1/responses/{id}`.

Bounded two ways: at most `max_count` responses (the least recently used goes first) and each for
`ttl_s` seconds after it was stored. Nothing survives a restart. All calls come from the server's
event loop; the lock only guards against a caller on another thread."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_COUNT = 1000
DEFAULT_TTL_S = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    response: Any  # responses_protocol.Response: the object GET returns
    conversation: list[dict[str, Any]]  # the chat turns through this response's output, instructions excluded


class ResponseStore:
    def __init__(
        self,
        max_count: int = DEFAULT_MAX_COUNT,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_count < 1 or ttl_s <= 0:
            raise ValueError(f"a response store needs max_count >= 1 and ttl_s > 0, got {max_count}, {ttl_s}")
        self.max_count, self.ttl_s, self._clock = max_count, ttl_s, clock
        self._entries: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()  # id -> (expiry, entry)
        self._lock = threading.Lock()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        with self._lock:
            self._drop_expired()
            self._entries[response_id] = (self._clock() + self.ttl_s, entry)
            self._entries.move_to_end(response_id)
            while len(self._entries) > self.max_count:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry (now the most recently used), or None when unknown or expired."""
        with self._lock:
            self._drop_expired()
            found = self._entries.get(response_id)
            if found is None:
                return None
            self._entries.move_to_end(response_id)
            return found[1]

    def delete(self, response_id: str) -> bool:
        with self._lock:
            self._drop_expired()
            return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            self._drop_expired()
            return len(self._entries)

    def _drop_expired(self) -> None:
        now = self._clock()
        for response_id in [rid for rid, (expiry, _) in self._entries.items() if expiry <= now]:
            del self._entries[response_id]
