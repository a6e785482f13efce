"""The event stream tells the whole story: snapshot + fold, recordings, the replay CLI, sequence
numbers, `EventBus.since`, and subscribers that fail."""

from __future__ import annotations

import importlib.util
import resource
import subprocess
import sys
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from engine_utils import EventLog, compare, make_engine, run, step_engine
from minivllm.events import types as ev
from minivllm.events.bus import EventBus
from minivllm.events.fold import fold
from minivllm.events.recording import Recorder, read_recording
from minivllm.sampling.params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def load_make_recording():
    spec = importlib.util.spec_from_file_location("make_recording", ROOT / "tests" / "fixtures" / "make_recording.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def eventful_workload(engine, step: int) -> None:
    """Shared prefixes, n > 1 forks with copy-on-write, beams, preemption, aborts in several states."""
    shared = list(range(100, 112))
    plans = {
        0: [
            ("a", shared + [5, 6], SamplingParams(temperature=0, max_tokens=6)),
            ("b", shared + [7], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)),
            ("c", [9, 8, 7, 6, 5], SamplingParams(n=2, seed=3, max_tokens=5, ignore_eos=True)),
            ("d", [1, 2, 3], SamplingParams(use_beam_search=True, beam_width=2, max_tokens=4)),
            ("e", list(range(200, 218)), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)),
        ],
        3: [
            ("f", shared + [5, 6], SamplingParams(temperature=0, max_tokens=3)),
            ("g", list(range(300, 330)), SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True)),
        ],
        7: [("h", [4, 4, 4, 4, 4], SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=4, ignore_eos=True))],
    }
    for rid, ids, params in plans.get(step, []):
        engine.add_request(rid, prompt_token_ids=ids, params=params)
    aborts = {5: "e", 6: "g", 9: "h"}  # e decoding or preempted, g in prefill or waiting, h forked
    if step in aborts:
        engine.abort_request(aborts[step])


@pytest.mark.slow
def test_fold_from_any_snapshot_equals_later_snapshots(tiny_model):
    engine = make_engine(
        tiny_model, num_blocks=12, block_size=4, max_num_batched_tokens=24, max_num_seqs=8, metrics_interval_s=0.0
    )
    log = EventLog(engine)
    snapshots = [engine.snapshot()]
    step = 0
    while step == 0 or engine.has_work():
        eventful_workload(engine, step)
        step_engine(engine)
        step += 1
        snapshots.append(engine.snapshot())
        assert step < 500
    kinds = Counter(type(e).__name__ for e in log.events)
    for kind in ("BlocksCopied", "BlocksCached", "BlocksEvicted", "BlocksShared", "SeqRemoved", "MetricsSample"):
        assert kinds[kind], f"the workload produced no {kind}"
    preempted = [e for e in log.of(ev.RequestStateChanged) if e.state == "PREEMPTED"]
    assert preempted, "the workload produced no preemption"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    assert all(50 * 2**20 < m.rss_bytes <= peak * 1.01 for m in log.of(ev.MetricsSample))  # what `ps` shows
    events = engine.bus.history
    for i, early in enumerate(snapshots):
        for late in snapshots[i + 1 : i + 4] + snapshots[-1:]:
            between = [e for e in events if early.seq < e.seq <= late.seq]
            compare(fold(early, between), late)


def test_snapshot_and_fold_survive_json(tiny_model):
    engine = make_engine(tiny_model, num_blocks=12, block_size=4, max_num_batched_tokens=24)
    for step in range(4):
        eventful_workload(engine, step)
        step_engine(engine)
    mid = msgspec.json.decode(msgspec.json.encode(engine.snapshot()), type=ev.Snapshot)
    run(engine)
    events = [
        msgspec.json.decode(msgspec.json.encode(e), type=ev.AnyEvent) for e in engine.bus.history if e.seq > mid.seq
    ]
    compare(fold(mid, events), engine.snapshot())


@pytest.fixture(scope="module")
def recording(tiny_model, tmp_path_factory):
    module = load_make_recording()
    module.load_model = lambda *a, **k: tiny_model  # the session's tiny model, not a second load
    return module.record_session(tmp_path_factory.mktemp("rec") / "session.jsonl")


def test_recording_round_trip(recording):
    rec = read_recording(recording)
    assert rec.header.version == ev.RECORDING_VERSION
    assert rec.footer is not None
    folded = fold(rec.header.snapshot, rec.events)
    compare(folded, rec.footer.snapshot)
    seqs = [e.seq for e in rec.events]
    assert seqs == list(range(rec.header.snapshot.seq + 1, rec.header.snapshot.seq + 1 + len(seqs)))


@pytest.mark.slow
def test_recorder_attached_mid_run(tiny_model, tmp_path):
    """A recording started while requests run: its header snapshot + its events = its footer."""
    engine = make_engine(tiny_model, num_blocks=12, block_size=4, max_num_batched_tokens=24)
    for step in range(5):
        eventful_workload(engine, step)
        step_engine(engine)
    recorder = Recorder(tmp_path / "mid.jsonl")
    engine.subscribe(recorder, on_snapshot=recorder.begin)
    step = 5
    while engine.has_work():
        eventful_workload(engine, step)
        step_engine(engine)
        step += 1
    recorder.close(engine.snapshot())
    rec = read_recording(tmp_path / "mid.jsonl")
    assert rec.header.snapshot.requests, "the recording should start with requests in flight"
    compare(fold(rec.header.snapshot, rec.events), rec.footer.snapshot)


def expected_summary_numbers(recording) -> dict[str, int]:
    rec = read_recording(recording)
    final = {r.request_id: r for r in rec.footer.snapshot.requests}
    return {
        "arrived": sum(isinstance(e, ev.RequestArrived) for e in rec.events),
        "events": len(rec.events),
        "tokens": sum(isinstance(e, ev.TokenGenerated) for e in rec.events),
        "preemptions": sum(len(e.preempted) for e in rec.events if isinstance(e, ev.StepScheduled)),
        "aborted": sum(r.finish_reason == "abort" for r in final.values()),
        "steps": sum(isinstance(e, ev.StepFinished) for e in rec.events),
    }


def check_summary(text: str, numbers: dict[str, int]) -> None:
    assert f"{numbers['events']} events" in text
    assert f"{numbers['arrived']} arrived" in text
    assert f"tokens generated: {numbers['tokens']}" in text
    assert f"preemptions: {numbers['preemptions']}" in text
    assert f"abort: {numbers['aborted']}" in text
    assert f"steps: {numbers['steps']}" in text


def test_replay_summary_in_process(recording, capsys):
    from minivllm.cli import main

    assert main(["replay", str(recording), "--summary"]) == 0
    check_summary(capsys.readouterr().out, expected_summary_numbers(recording))


@pytest.mark.slow
def test_replay_summary_cli(recording):
    exe = Path(sys.executable).parent / "minivllm"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "minivllm.cli"]
    proc = subprocess.run([*cmd, "replay", str(recording), "--summary"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    check_summary(proc.stdout, expected_summary_numbers(recording))


def test_replay_of_a_broken_file_is_a_clear_error(tmp_path, recording, capsys):
    from minivllm.cli import main

    lines = Path(recording).read_bytes().splitlines()
    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(b"\n".join(lines[:3] + [b'{"type": "token", "oops": 1}'] + lines[3:]))
    assert main(["replay", str(broken), "--summary"]) == 2
    assert "line 4" in capsys.readouterr().err


def test_event_seq_numbers_are_monotonic_and_timestamps_ordered(recording):
    rec = read_recording(recording)
    seqs = [e.seq for e in rec.events]
    assert all(b == a + 1 for a, b in zip(seqs, seqs[1:]))
    ts = [e.ts for e in rec.events]
    assert all(b >= a for a, b in zip(ts, ts[1:]))
    assert rec.header.snapshot.ts <= ts[0] and ts[-1] <= rec.footer.snapshot.ts


def test_every_transition_has_a_reason(recording):
    rec = read_recording(recording)
    changes = [e for e in rec.events if isinstance(e, ev.RequestStateChanged)]
    assert changes and all(e.reason for e in changes)
    finished = [e for e in changes if e.state == "FINISHED"]
    assert all(e.finish_reason in ("stop", "length", "abort") for e in finished)


# ---- the bus --------------------------------------------------------------------------------------


def token(i: int = 0) -> ev.TokenGenerated:
    return ev.TokenGenerated(request_id="r", seq_id=0, token_id=i, text="", logprob=None)


def test_event_bus_since():
    bus = EventBus(history=5)
    assert bus.since(0) == []  # nothing happened yet
    emitted = [bus.emit(token(i)) for i in range(3)]
    assert [e.seq for e in emitted] == [1, 2, 3]
    assert bus.since(0) == emitted
    assert bus.since(1) == emitted[1:]
    assert bus.since(3) == [] and bus.since(10) == []  # caught up (or ahead)
    more = [bus.emit(token(i)) for i in range(4)]  # 7 events, ring of 5 keeps seq 3..7
    assert [e.seq for e in bus.history] == [3, 4, 5, 6, 7]
    assert bus.since(2) == emitted[2:] + more  # seq 3 onwards still all there
    assert bus.since(1) is None  # seq 2 left the ring: the client must resync
    assert bus.since(0) is None
    assert bus.since(6) == more[-1:]
    assert bus.last_seq == 7


def test_raising_subscriber_is_dropped_and_the_engine_goes_on(tiny_model):
    engine = make_engine(tiny_model)
    calls = []

    def broken(event):
        calls.append(event)
        raise RuntimeError("subscriber bug")

    good = EventLog(engine)
    engine.bus.subscribe(broken)
    engine.add_request(
        "r", prompt_token_ids=[1, 2, 3], params=SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    )
    done = run(engine)
    assert len(done["r"].outputs[0].token_ids) == 5
    assert len(calls) == 1  # dropped after its first failure
    assert len(good.events) == engine.bus.last_seq  # the other subscriber saw everything
    assert sum(isinstance(e, ev.TokenGenerated) for e in good.events) == 5
