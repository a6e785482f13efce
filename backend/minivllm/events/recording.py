"""Recordings: the event stream as JSONL (line 1: a header with config + snapshot; then one event
per line). The scheduler replay viewer and `minivllm replay` read them back."""

from __future__ import annotations

import datetime as dt
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import msgspec

from minivllm.events import types as ev
from minivllm.events.fold import fold

_encoder = msgspec.json.Encoder()
_header_decoder = msgspec.json.Decoder(ev.RecordingHeader)
_line_decoder = msgspec.json.Decoder(ev.AnyEvent | ev.RecordingFooter)


class RecordingFormatError(ValueError):
    def __init__(self, line: int, message: str):
        super().__init__(f"line {line}: {message}")
        self.line = line


class Recorder:
    """An event-bus subscriber appending to a JSONL file. Writes are buffered by the file object,
    so the engine thread only pays for an encode and a buffered write."""

    def __init__(self, path: Path, max_bytes: int | None = None):
        self.path = path
        self.max_bytes = max_bytes  # past this the recorder drops events (the footer still lands)
        self.num_bytes = 0
        self.num_dropped = 0
        self.created = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        self.first_ts = self.last_ts = 0.0
        self.num_events = 0
        self._lock = threading.Lock()
        self._file = path.open("wb")
        self._after = 0

    def begin(self, snapshot: ev.Snapshot) -> None:
        """Write the header: the state the recorded events start from (before the first event)."""
        self.first_ts = self.last_ts = snapshot.ts
        header = ev.RecordingHeader(version=ev.RECORDING_VERSION, created=self.created, snapshot=snapshot)
        self._write(_encoder.encode(header) + b"\n")
        self._after = snapshot.seq

    def __call__(self, event: ev.Event) -> None:
        if event.seq <= self._after:
            return
        with self._lock:
            if self._file.closed:
                return
            line = _encoder.encode(event) + b"\n"
            if self.max_bytes is not None and self.num_bytes + len(line) > self.max_bytes:
                self.num_dropped += 1
                return
            self._write(line)
            self.num_events += 1
            self.last_ts = event.ts

    def _write(self, line: bytes) -> None:
        self._file.write(line)
        self.num_bytes += len(line)

    def close(self, final: ev.Snapshot | None = None) -> None:
        """Stop; with `final` (taken on the engine thread after the last event) write the footer."""
        with self._lock:
            if self._file.closed:
                return
            if final is not None:
                self._file.write(_encoder.encode(ev.RecordingFooter(snapshot=final)) + b"\n")
            self._file.close()


class Recording(msgspec.Struct):
    header: ev.RecordingHeader
    events: list[ev.Event]
    footer: ev.RecordingFooter | None


def parse_lines(lines: Iterator[bytes] | list[bytes]) -> Recording:
    """Validates every line; errors name the 1-based line number."""
    header: ev.RecordingHeader | None = None
    footer: ev.RecordingFooter | None = None
    events: list[ev.Event] = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        if footer is not None:
            raise RecordingFormatError(number, "content after the footer line")
        try:
            if header is None:
                header = _header_decoder.decode(raw)
                continue
            item = _line_decoder.decode(raw)
        except msgspec.DecodeError as exc:
            what = "a recording header" if header is None else "an event"
            raise RecordingFormatError(number, f"not {what}: {exc}") from None
        if isinstance(item, ev.RecordingFooter):
            footer = item
        else:
            events.append(item)
    if header is None:
        raise RecordingFormatError(1, "empty recording: expected a header line")
    return Recording(header, events, footer)


def read_recording(path: str | Path) -> Recording:
    with Path(path).open("rb") as f:
        return parse_lines(f)


def summarize(header: ev.RecordingHeader, events: list[ev.Event]) -> str:
    counts = Counter(type(e).__name__ for e in events)
    final = fold(header.snapshot, events)
    steps = [e for e in events if isinstance(e, ev.StepFinished)]
    duration = (events[-1].ts - header.snapshot.ts) if events else 0.0
    reasons = Counter(r.finish_reason for r in final.requests if r.state == "FINISHED")
    generated = sum(1 for e in events if isinstance(e, ev.TokenGenerated))
    preempted = sum(len(e.preempted) for e in events if isinstance(e, ev.StepScheduled))
    hits = sum(len(e.block_ids) for e in events if isinstance(e, ev.BlocksShared) and e.prefix_hit)
    cfg = header.snapshot.config
    finished = ", ".join(f"{k}: {v}" for k, v in sorted(reasons.items(), key=str))
    lines = [
        f"recording of {cfg.model}: {len(events)} events over {duration:.2f}s, created {header.created}",
        f"engine: {cfg.num_blocks} blocks x {cfg.block_size} tokens, budget {cfg.max_num_batched_tokens} tokens/step, "
        f"max {cfg.max_num_seqs} seqs, prefix caching {'on' if cfg.enable_prefix_caching else 'off'}",
        f"requests: {sum(isinstance(e, ev.RequestArrived) for e in events)} arrived, "
        f"{sum(reasons.values())} finished ({finished or '-'})",
        f"steps: {len(steps)}, tokens generated: {generated}, preemptions: {preempted}, "
        f"prefix-cache block hits: {hits}",
    ]
    if steps:
        durations = sorted(s.duration_ms for s in steps)
        lines.append(f"step time: median {durations[len(durations) // 2]:.1f} ms, max {durations[-1]:.1f} ms")
    lines.append("events: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    return "\n".join(lines)


def print_summary(path: str) -> None:
    recording = read_recording(path)
    print(summarize(recording.header, recording.events))
