"""The prefix cache's disk tier: KV blocks in files named by their chained hash, bounded by LRU.

One safetensors file per block under `<dir>/<namespace>/`, where the namespace is a digest of everything
that makes a block's numbers (model, weights, KV dtype, block size): a file can only ever be read back
by an engine that would have computed the same block. Each file carries the block's tokens and a
checksum of its tensors; a file that fails to parse, names other tokens or fails its checksum is a miss
(and is deleted), never wrong KV.

Writes run on one writer thread (the engine thread only copies the block out of the pool); a block
waiting to be written is served from memory. A full disk or any other write error costs the write, not
the engine: it is logged once and counted. The index is the directory itself, rebuilt at start-up
(file mtimes are the LRU order), so a restarted server reuses every prompt it kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

log = logging.getLogger("minivllm.kv_disk")

SUFFIX = ".kvblock"
MAX_PENDING_WRITES = 256  # blocks queued for the writer; past this a write is dropped, never the engine blocked


@dataclass
class DiskStoreStats:
    hits: int = 0
    misses: int = 0
    writes: int = 0
    write_errors: int = 0
    dropped_writes: int = 0  # the writer fell behind
    corrupt: int = 0
    evicted_files: int = 0
    bytes_on_disk: int = 0
    files: int = 0


@dataclass
class _Pending:
    tensors: dict[str, torch.Tensor]
    token_ids: tuple[int, ...]


@dataclass
class DiskKVStore:
    root: Path
    namespace: str
    max_bytes: int
    stats: DiskStoreStats = field(default_factory=DiskStoreStats)

    def __post_init__(self) -> None:
        self.dir = Path(self.root) / self.namespace
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._index: OrderedDict[int, int] = OrderedDict()  # hash -> file size, oldest use first
        self._pending: dict[int, _Pending] = {}
        self._queue: queue.Queue[int | None] = queue.Queue()
        self._flush_waiters: list[threading.Event] = []
        self._warned = False
        self._rebuild_index()
        self._writer = threading.Thread(target=self._write_loop, name="minivllm-kv-disk", daemon=True)
        self._writer.start()

    # ---- the engine thread's side --------------------------------------------------------------

    def __contains__(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._index or block_hash in self._pending

    def put(self, block_hash: int, token_ids: tuple[int, ...], tensors: dict[str, torch.Tensor]) -> None:
        """Queue a block (tensors the caller no longer touches) for writing; a no-op when it is kept."""
        with self._lock:
            if block_hash in self._index or block_hash in self._pending:
                return
            if len(self._pending) >= MAX_PENDING_WRITES:
                self.stats.dropped_writes += 1
                return
            self._pending[block_hash] = _Pending(tensors, tuple(token_ids))
        self._queue.put(block_hash)

    def get(self, block_hash: int, token_ids: tuple[int, ...]) -> dict[str, torch.Tensor] | None:
        """The block's tensors, if it is kept for exactly these tokens; None otherwise."""
        with self._lock:
            pending = self._pending.get(block_hash)
            if pending is None and block_hash in self._index:
                self._index.move_to_end(block_hash)
        if pending is not None:
            found = pending.tensors if pending.token_ids == tuple(token_ids) else None
        else:
            found = self._read(block_hash, tuple(token_ids))
        if found is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
        return found

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued block is on disk (or failed)."""
        done = threading.Event()
        with self._lock:
            self._flush_waiters.append(done)
        self._queue.put(None)
        done.wait(timeout)

    def close(self) -> None:
        self.flush()

    # ---- files ------------------------------------------------------------------------------------

    def _path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash:016x}{SUFFIX}"

    def _rebuild_index(self) -> None:
        files = []
        for path in self.dir.glob(f"*{SUFFIX}"):
            try:
                st = path.stat()
                files.append((st.st_mtime, int(path.stem, 16), st.st_size))
            except (OSError, ValueError):
                continue
        for _, block_hash, size in sorted(files):
            self._index[block_hash] = size
        self._update_size_stats()
        for tmp in self.dir.glob("*.tmp"):  # a write cut off by a crash
            tmp.unlink(missing_ok=True)

    def _read(self, block_hash: int, token_ids: tuple[int, ...]) -> dict[str, torch.Tensor] | None:
        path = self._path(block_hash)
        try:
            data = path.read_bytes()
            tensors = load_tensors(data)
            meta = _metadata(data)
        except (OSError, SafetensorError, ValueError, json.JSONDecodeError):
            return self._discard(block_hash, "unreadable")
        if meta.get("namespace") != self.namespace or json.loads(meta.get("tokens", "null")) != list(token_ids):
            return self._discard(block_hash, "another block's file")
        if meta.get("checksum") != _checksum(tensors):
            return self._discard(block_hash, "checksum mismatch")
        os.utime(path)  # LRU order survives a restart
        return tensors

    def _discard(self, block_hash: int, why: str) -> None:
        log.warning("kv disk tier: dropping block file %016x (%s): a miss, recomputed", block_hash, why)
        self.stats.corrupt += 1
        with self._lock:
            self._index.pop(block_hash, None)
            self._update_size_stats()
        self._path(block_hash).unlink(missing_ok=True)
        return None

    # ---- the writer thread ------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            block_hash = self._queue.get()
            if block_hash is None:
                self._wake_flushers()
                continue
            with self._lock:
                pending = self._pending.get(block_hash)
            if pending is not None:
                self._write(block_hash, pending)
            with self._lock:
                self._pending.pop(block_hash, None)

    def _wake_flushers(self) -> None:
        with self._lock:
            waiters, self._flush_waiters = self._flush_waiters, []
        for done in waiters:
            done.set()

    def _write(self, block_hash: int, pending: _Pending) -> None:
        meta = {
            "namespace": self.namespace,
            "tokens": json.dumps(list(pending.token_ids)),
            "checksum": _checksum(pending.tensors),
        }
        path = self._path(block_hash)
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_bytes(save_tensors(pending.tensors, metadata=meta))
            os.replace(tmp, path)
        except OSError as e:  # a full disk, a read-only directory: this write is lost, nothing else
            tmp.unlink(missing_ok=True)
            self.stats.write_errors += 1
            if not self._warned:
                self._warned = True
                log.warning("kv disk tier: cannot write %s (%s); blocks stay RAM-only until writes succeed", path, e)
            return
        with self._lock:
            self._index[block_hash] = path.stat().st_size
            self.stats.writes += 1
            self._evict_over_budget()
            self._update_size_stats()

    def _evict_over_budget(self) -> None:
        total = sum(self._index.values())
        while total > self.max_bytes and self._index:
            victim, size = self._index.popitem(last=False)
            self._path(victim).unlink(missing_ok=True)
            self.stats.evicted_files += 1
            total -= size

    def _update_size_stats(self) -> None:
        self.stats.files = len(self._index)
        self.stats.bytes_on_disk = sum(self._index.values())


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _metadata(data: bytes) -> dict[str, str]:
    """The safetensors header's `__metadata__` (8-byte little-endian length, then JSON)."""
    length = int.from_bytes(data[:8], "little")
    if length > len(data) - 8:
        raise ValueError("truncated header")
    return json.loads(data[8 : 8 + length]).get("__metadata__") or {}
