"""A recording as a Chrome trace (Trace Event Format JSON; opens in Perfetto and chrome://tracing).

Process "engine": one track of step slices (with the schedule / forward / sample / postprocess
phases nested inside) and counters for KV blocks in use, running / waiting requests and
throughput. Process "requests": one track per request with a slice per state segment
(WAITING, PREFILL, DECODE, PREEMPTED). Times are microseconds since the recording started.
"""

from __future__ import annotations

from typing import Any

from minivllm.events import types as ev
from minivllm.events.fold import StateFolder
from minivllm.events.recording import Recording

ENGINE_PID, REQUESTS_PID = 1, 2
STEPS_TID = 1
PHASES = ("schedule_ms", "forward_ms", "sample_ms", "postprocess_ms")


class _TraceBuilder:
    def __init__(self, recording: Recording):
        self.header = recording.header
        self.events = recording.events
        self.t0 = self.header.snapshot.ts
        self.out: list[dict[str, Any]] = []
        self.tids: dict[str, int] = {}
        self.open: dict[str, tuple[str, float, str]] = {}  # request id -> (state, since, reason)

    def us(self, ts: float) -> float:
        return round((ts - self.t0) * 1e6, 3)

    def build(self) -> dict[str, Any]:
        self._metadata()
        for r in self.header.snapshot.requests:
            if r.state != "FINISHED":
                self._open(r.request_id, r.state, self.t0, "in progress when the recording started")
        self._requests()
        self._steps()
        self._counters()
        end = self._end_ts()
        for rid, (state, since, reason) in list(self.open.items()):
            self._segment(rid, state, since, end, {"reason": reason, "note": "still open when the recording ended"})
        cfg = self.header.snapshot.config
        return {
            "traceEvents": self.out,
            "displayTimeUnit": "ms",
            "otherData": {
                "model": cfg.model,
                "recording_created": self.header.created,
                "num_blocks": cfg.num_blocks,
                "block_size": cfg.block_size,
                "max_num_batched_tokens": cfg.max_num_batched_tokens,
                "max_num_seqs": cfg.max_num_seqs,
            },
        }

    def _end_ts(self) -> float:
        return self.events[-1].ts if self.events else self.t0

    # ---- tracks -------------------------------------------------------------------------------

    def _metadata(self) -> None:
        for pid, name in ((ENGINE_PID, "engine"), (REQUESTS_PID, "requests")):
            self.out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
            self.out.append(
                {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
            )
        self.out.append(
            {"ph": "M", "name": "thread_name", "pid": ENGINE_PID, "tid": STEPS_TID, "args": {"name": "steps"}}
        )

    def _tid(self, rid: str) -> int:
        if rid not in self.tids:
            tid = self.tids[rid] = len(self.tids) + 1
            self.out.append({"ph": "M", "name": "thread_name", "pid": REQUESTS_PID, "tid": tid, "args": {"name": rid}})
            self.out.append(
                {"ph": "M", "name": "thread_sort_index", "pid": REQUESTS_PID, "tid": tid, "args": {"sort_index": tid}}
            )
        return self.tids[rid]

    def _segment(self, rid: str, state: str, start: float, end: float, args: dict[str, Any]) -> None:
        self.out.append(
            {
                "ph": "X",
                "name": state,
                "cat": "request",
                "pid": REQUESTS_PID,
                "tid": self._tid(rid),
                "ts": self.us(start),
                "dur": max(self.us(end) - self.us(start), 0.0),
                "args": args,
            }
        )

    def _open(self, rid: str, state: str, since: float, reason: str) -> None:
        self._tid(rid)
        self.open[rid] = (state, since, reason)

    def _requests(self) -> None:
        for e in self.events:
            if isinstance(e, ev.RequestArrived):
                self._tid(e.request_id)
                self.out.append(
                    {
                        "ph": "i",
                        "s": "t",
                        "name": "arrived",
                        "pid": REQUESTS_PID,
                        "tid": self._tid(e.request_id),
                        "ts": self.us(e.ts),
                        "args": {
                            "prompt_tokens": e.prompt_tokens,
                            "max_tokens": e.max_tokens,
                            "n": e.n,
                            "priority": e.priority,
                            "prompt": e.prompt_preview,
                        },
                    }
                )
            elif isinstance(e, ev.RequestStateChanged):
                current = self.open.pop(e.request_id, None)
                if current is not None:
                    state, since, reason = current
                    self._segment(e.request_id, state, since, e.ts, {"reason": reason, "ended_by": e.reason})
                if e.state == "FINISHED":
                    self.out.append(
                        {
                            "ph": "i",
                            "s": "t",
                            "name": f"finished: {e.finish_reason}",
                            "pid": REQUESTS_PID,
                            "tid": self._tid(e.request_id),
                            "ts": self.us(e.ts),
                            "args": {"reason": e.reason},
                        }
                    )
                else:
                    self._open(e.request_id, e.state, e.ts, e.reason)
            elif isinstance(e, ev.ConfigChanged):
                for rid, (state, since, reason) in list(self.open.items()):
                    self._segment(rid, state, since, e.ts, {"reason": reason, "ended_by": "engine reconfigured"})
                self.open.clear()

    def _steps(self) -> None:
        scheduled: dict[int, ev.StepScheduled] = {}
        for e in self.events:
            if isinstance(e, ev.StepScheduled):
                scheduled[e.step] = e
            elif isinstance(e, ev.StepFinished):
                s = scheduled.pop(e.step, None)
                start = e.ts - e.duration_ms / 1e3
                args: dict[str, Any] = {"num_tokens": e.num_tokens, "num_generated": e.num_generated}
                if s is not None:
                    args.update(
                        prefill_chunks=len(s.prefill),
                        decode_seqs=len(s.decode),
                        budget_used=s.budget_used,
                        budget=s.budget,
                        num_running=s.num_running,
                        num_waiting=s.num_waiting,
                        preempted=s.preempted,
                        queue_head=s.queue_head,
                        queue_head_reason=s.queue_head_reason,
                    )
                self._slice(f"step {e.step}", start, e.duration_ms, args)
                t = start
                for phase in PHASES:
                    ms = getattr(e, phase)
                    self._slice(phase.removesuffix("_ms"), t, ms, {})
                    t += ms / 1e3

    def _slice(self, name: str, start: float, ms: float, args: dict[str, Any]) -> None:
        self.out.append(
            {
                "ph": "X",
                "name": name,
                "cat": "step",
                "pid": ENGINE_PID,
                "tid": STEPS_TID,
                "ts": self.us(start),
                "dur": round(ms * 1e3, 3),
                "args": args,
            }
        )

    def _counter(self, name: str, ts: float, values: dict[str, float]) -> None:
        self.out.append({"ph": "C", "name": name, "pid": ENGINE_PID, "ts": self.us(ts), "args": values})

    def _counters(self) -> None:
        folder = StateFolder(self.header.snapshot)
        num_blocks = len(folder.blocks)
        used = sum(1 for b in folder.blocks if b.ref_count > 0)
        self._counter("KV blocks", self.t0, {"used": used, "free": num_blocks - used})
        for e in self.events:
            touched = [*getattr(e, "block_ids", []), *getattr(e, "src_block_ids", [])]
            before = sum(1 for b in set(touched) if b < num_blocks and folder.blocks[b].ref_count > 0)
            folder.apply(e)
            if isinstance(e, ev.ConfigChanged):
                num_blocks, used = len(folder.blocks), 0
                self._counter("KV blocks", e.ts, {"used": used, "free": num_blocks - used})
            elif touched and not isinstance(e, (ev.BlocksCached, ev.BlocksEvicted)):
                used += sum(1 for b in set(touched) if b < num_blocks and folder.blocks[b].ref_count > 0) - before
                self._counter("KV blocks", e.ts, {"used": used, "free": num_blocks - used})
            elif isinstance(e, ev.StepScheduled):
                self._counter("requests", e.ts, {"running": e.num_running, "waiting": e.num_waiting})
            elif isinstance(e, ev.MetricsSample):
                self._counter("KV usage", e.ts, {"fraction": e.kv_usage})
                self._counter(
                    "throughput (tokens/s)",
                    e.ts,
                    {"generation": e.generation_throughput, "prompt": e.prompt_throughput},
                )


def chrome_trace(recording: Recording) -> dict[str, Any]:
    return _TraceBuilder(recording).build()
