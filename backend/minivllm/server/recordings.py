"""Recordings on disk: start/stop a Recorder on the live bus, list, download and upload JSONL files.

Starting subscribes the Recorder and takes its header snapshot in one call on the engine thread,
and stopping unsubscribes it and writes the footer snapshot in one call, so the file holds
exactly the events between the two snapshots.
"""

from __future__ import annotations

import datetime as dt
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

import msgspec

from minivllm.engine.api import AsyncEngine
from minivllm.events import types as ev
from minivllm.events.recording import Recorder, Recording, RecordingFormatError, parse_lines, read_recording
from minivllm.server.api_types import RecordingInfo
from minivllm.server.errors import APIError

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")
# rec-<server>-<UTC date>-<time>-<random>: several servers may share one folder (the default ./recordings)
_RECORDED_BY = re.compile(r"rec-(?P<server>[A-Za-z0-9_.\-]+)-\d{8}-\d{6}-[0-9a-f]{6}")
SUFFIX = ".jsonl"
GiB = 1 << 30


@dataclass(frozen=True)
class RecordingLimits:
    """The folder's quota (the oldest finished recordings are deleted to make room) and the cap on
    one live recording (past it, events are dropped and counted; the footer snapshot still lands)."""

    max_total_bytes: int = 2 * GiB
    max_count: int = 200
    max_active_bytes: int = 256 << 20


class _Stamp(msgspec.Struct):
    ts: float = 0.0


class _Active:
    def __init__(self, rid: str, recorder: Recorder):
        self.id, self.recorder = rid, recorder


class RecordingStore:
    def __init__(self, directory: Path, limits: RecordingLimits | None = None, server: str = ""):
        """`server`: this server's name (host-port), put into its recordings' ids."""
        self.directory = Path(directory)
        self.server = re.sub(r"[^A-Za-z0-9_.\-]", "-", server)[:64]
        self.limits = limits or RecordingLimits()
        self.active: _Active | None = None
        self._info_cache: dict[str, tuple[tuple[float, int], RecordingInfo]] = {}

    # ---- live recording -----------------------------------------------------------------------

    async def start(self, ae: AsyncEngine) -> RecordingInfo:
        if self.active is not None:
            raise APIError(409, f"recording {self.active.id} is already running; stop it first")
        self.directory.mkdir(parents=True, exist_ok=True)
        self._make_room(self.limits.max_active_bytes)
        rid = _new_id(f"rec-{self.server}" if self.server else "rec")
        path = self._path(rid)

        recorder = Recorder(path, self.limits.max_active_bytes)
        await ae.subscribe(recorder, on_snapshot=recorder.begin)
        self.active = _Active(rid, recorder)
        return self.info(rid)

    async def stop(self, ae: AsyncEngine) -> RecordingInfo:
        active = self.active
        if active is None:
            raise APIError(409, "no recording is running")

        self.active = None
        active.recorder.close(await ae.unsubscribe(active.recorder))
        return self.info(active.id)

    # ---- files --------------------------------------------------------------------------------

    def list(self) -> list[RecordingInfo]:
        if not self.directory.is_dir():
            return []
        infos = [self.info(p.stem) for p in self._files()]
        return sorted(infos, key=lambda i: (i.created, i.id), reverse=True)

    def path(self, rid: str) -> Path:
        """The file of an existing recording; 404 for anything else (including path tricks)."""
        path = self._path(rid) if _ID.fullmatch(rid) else None
        if path is None or not path.is_file() or path.is_symlink():  # a link could point anywhere
            raise APIError(404, f"no recording with id {rid!r}", code="recording_not_found")
        return path

    def load(self, rid: str) -> Recording:
        path = self.path(rid)
        if self.active is not None and self.active.id == rid:
            raise APIError(409, f"recording {rid} is still running; stop it first")
        try:
            return read_recording(path)
        except RecordingFormatError as exc:
            raise APIError(400, f"recording {rid} is malformed: {exc}") from None

    def save_upload(self, body: bytes) -> RecordingInfo:
        if len(body) > self.limits.max_total_bytes:
            raise APIError(
                413,
                f"the recording is {len(body)} bytes; the recordings folder holds at most "
                f"{self.limits.max_total_bytes}",
            )
        try:
            parse_lines(body.splitlines())
        except RecordingFormatError as exc:
            raise APIError(400, f"not a valid recording: {exc}", param="line") from None
        self.directory.mkdir(parents=True, exist_ok=True)
        self._make_room(len(body))
        rid = _new_id("upload")
        self._path(rid).write_bytes(body)
        return self.info(rid)

    def _files(self) -> list[Path]:
        """The recordings in the folder (regular files only: links are never listed or served)."""
        if not self.directory.is_dir():
            return []
        return [
            p for p in self.directory.glob(f"*{SUFFIX}") if _ID.fullmatch(p.stem) and p.is_file() and not p.is_symlink()
        ]

    def _make_room(self, incoming: int) -> None:
        """Delete the oldest finished recordings until one more of `incoming` bytes fits the quota."""
        active = self._path(self.active.id) if self.active is not None else None
        stats = sorted(((p.stat(), p) for p in self._files() if p != active), key=lambda sp: sp[0].st_mtime)
        total = sum(st.st_size for st, _ in stats) + (_size(active) if active else 0)
        count = len(stats) + (active is not None)
        while stats and (count + 1 > self.limits.max_count or total + incoming > self.limits.max_total_bytes):
            st, oldest = stats.pop(0)
            total -= st.st_size
            count -= 1
            oldest.unlink()
            self._info_cache.pop(oldest.stem, None)

    def info(self, rid: str) -> RecordingInfo:
        path = self._path(rid)
        active = self.active if self.active is not None and self.active.id == rid else None
        if active is not None:
            r = active.recorder
            return RecordingInfo(
                id=rid,
                created=r.created,
                num_events=r.num_events,
                duration_s=r.last_ts - r.first_ts,
                size_bytes=_size(path),
                active=True,
                server=self.server,
                mine=True,
            )
        stat = path.stat()
        key = (stat.st_mtime, stat.st_size)
        cached = self._info_cache.get(rid)
        if cached is not None and cached[0] == key:
            return cached[1]
        info = _file_info(rid, path, stat.st_size)
        info.server = recorded_by(rid)
        info.mine = bool(self.server) and info.server == self.server
        self._info_cache[rid] = (key, info)
        return info

    def _path(self, rid: str) -> Path:
        return self.directory / f"{rid}{SUFFIX}"


def recorded_by(rid: str) -> str:
    """The server named in a recording's id; "upload" for an uploaded file, "" when unknown."""
    if rid.startswith("upload-"):
        return "upload"
    match = _RECORDED_BY.fullmatch(rid)
    return match["server"] if match else ""


def _new_id(prefix: str) -> str:
    now = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    return f"{prefix}-{now}-{secrets.token_hex(3)}"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _file_info(rid: str, path: Path, size: int) -> RecordingInfo:
    """From the header, the line count and the last line's timestamp (no full parse)."""
    lines = [line for line in path.read_bytes().splitlines() if line.strip()]
    created, start_ts, end_ts, num_events = "", 0.0, 0.0, 0
    try:
        header = msgspec.json.decode(lines[0], type=ev.RecordingHeader)
        created, start_ts = header.created, header.snapshot.ts
        body = lines[1:]
        footer = _footer(body[-1]) if body else None
        if footer is not None:
            body = body[:-1]
        num_events = len(body)
        end_ts = footer.snapshot.ts if footer else (msgspec.json.decode(body[-1], type=_Stamp).ts if body else start_ts)
    except (IndexError, msgspec.DecodeError, msgspec.ValidationError):
        pass  # a damaged file still shows up in the list; downloading it tells what is wrong
    return RecordingInfo(
        id=rid,
        created=created,
        num_events=num_events,
        duration_s=max(end_ts - start_ts, 0.0),
        size_bytes=size,
        active=False,
    )


def _footer(line: bytes) -> ev.RecordingFooter | None:
    try:
        return msgspec.json.decode(line, type=ev.RecordingFooter)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
