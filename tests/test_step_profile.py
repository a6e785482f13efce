"""The step profile on StepFinished (engine/step_profile.py): on the embedded model's native decode step
its parts come from the call's own clocks, elsewhere the coarse phases; the floors are bytes over the
measured bandwidth and FLOPs over the peak; nothing is collected (and the native clocks stay off) while
no dashboard client watches; the WebSocket switch turns it on and off."""

from __future__ import annotations

import itertools
import json
import time

import pytest
import torch
from litestar.testing import TestClient
from test_server_support import server_of, tiny_app, wait_for
from test_server_ws import TIMEOUT, finished, receive, receive_until

from engine_utils import EventLog, make_engine
from minivllm.engine import roofline
from minivllm.events import types as ev
from minivllm.kernels.cpu import native
from minivllm.loader.install_quantized import streamed_bytes
from minivllm.model.native_step import NativeDecodeStep
from minivllm.sampling.params import SamplingParams

NATIVE_PARTS = {"schedule", "products", "attention", "kv_store", "norms_act", "layers_other", "outside_layers"}


@pytest.fixture(scope="module")
def native_engine(embedded_model_q4):
    loaded = embedded_model_q4
    step = NativeDecodeStep.for_model(loaded.model)
    if step is None:
        pytest.fail(f"no native decode step for the embedded model (native kernels: {native.available()})")
    loaded.model.native_step = step
    try:
        yield make_engine(loaded, max_num_seqs=4)
    finally:
        loaded.model.native_step = None


_ids = itertools.count()


def _run(engine, prompt: str = "The capital of France is", max_tokens: int = 6) -> list[ev.StepFinished]:
    """One greedy request run to the end; its steps' StepFinished events."""
    log = EventLog(engine)
    engine.add_request(f"r{next(_ids)}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    while engine.has_work():
        engine.step()
    engine.bus.unsubscribe(log.events.append)
    return log.of(ev.StepFinished)


def _assert_consistent(step: ev.StepFinished) -> None:
    parts = step.profile_parts_ms
    assert parts and all(v >= 0 for v in parts.values()), parts
    assert sum(parts.values()) <= step.duration_ms * 1.01 + 0.05, (sum(parts.values()), step.duration_ms)
    assert step.bandwidth_gbs > 0 and step.peak_gflops > 0
    assert step.weight_bytes_read > 0 and step.kv_bytes_read > 0 and step.flops > 0
    floor = (step.weight_bytes_read + step.kv_bytes_read) / (step.bandwidth_gbs * 1e6)
    assert step.memory_floor_ms == pytest.approx(floor, rel=1e-9)
    assert step.compute_floor_ms == pytest.approx(step.flops / (step.peak_gflops * 1e6), rel=1e-9)


@pytest.mark.slow
def test_decode_steps_carry_the_native_parts_and_floors_while_watched(native_engine):
    engine = native_engine
    engine.telemetry.profiler.watch("panel", True)
    try:
        steps = _run(engine)
    finally:
        engine.telemetry.profiler.watch("panel", False)
    prefill, decodes = steps[0], steps[1:]
    assert prefill.profile_source == "coarse"  # a prefill does not run the native step
    assert set(prefill.profile_parts_ms) == {"schedule", "forward", "sample", "postprocess"}
    assert len(decodes) >= 4 and all(s.profile_source == "native" for s in decodes)
    for step in steps:
        _assert_consistent(step)
    for step in decodes:
        assert NATIVE_PARTS < set(step.profile_parts_ms)
        assert step.profile_parts_ms["products"] > 0 and step.profile_parts_ms["attention"] > 0
        assert step.weight_bytes_read == streamed_bytes(engine.loaded.model, 1)
        # the native parts split the forward phase: they add up to it
        forward_parts = sum(
            v for k, v in step.profile_parts_ms.items() if k not in ("schedule", "sample", "postprocess")
        )
        assert forward_parts == pytest.approx(step.forward_ms, rel=0.02, abs=0.05)
    kv_reads = [s.kv_bytes_read for s in decodes]
    assert kv_reads == sorted(kv_reads) and kv_reads[0] < kv_reads[-1]  # the context grows each step


@pytest.mark.slow
def test_no_profile_and_no_native_clocks_while_nobody_watches(native_engine):
    engine = native_engine
    native.decode_part_times()  # from zero
    steps = _run(engine)
    assert len(steps) >= 4
    for step in steps:
        assert step.profile_source == "" and step.profile_parts_ms == {} and step.memory_floor_ms == 0
    _, _, timed_calls = native.decode_part_times()
    assert timed_calls == 0  # the clocks stayed off


@pytest.mark.slow
def test_closing_the_panel_turns_the_native_clocks_off(native_engine):
    engine, profiler = native_engine, native_engine.telemetry.profiler
    profiler.watch("a", True)
    profiler.watch("b", True)
    profiler.watch("a", False)
    assert all(s.profile_source for s in _run(engine, max_tokens=3))  # "b" still watches
    profiler.watch("b", False)
    native.decode_part_times()
    assert all(s.profile_source == "" for s in _run(engine, max_tokens=3))
    assert native.decode_part_times()[2] == 0


def test_the_eager_path_gives_the_coarse_phases(tiny_model):
    engine = make_engine(tiny_model, max_num_seqs=2)
    assert getattr(tiny_model.model, "native_step", None) is None
    engine.telemetry.profiler.watch("panel", True)
    steps = _run(engine, "Hello", max_tokens=4)
    assert steps and all(s.profile_source == "coarse" for s in steps)
    for step in steps:
        _assert_consistent(step)
        assert step.profile_parts_ms == pytest.approx(
            {
                "schedule": step.schedule_ms,
                "forward": step.forward_ms,
                "sample": step.sample_ms,
                "postprocess": step.postprocess_ms,
            },
            abs=1e-3,
        )


def test_machine_rates_are_the_best_of_a_machines_first_readings(tmp_path, monkeypatch):
    """A busy moment's reading (here 10 GB/s) must not stand for good, and measuring at every start would cost
    every start a 128 MiB peak: the first READINGS starts measure, each keeping each rate's best, later ones read."""
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(roofline.REMEASURE_ENV, raising=False)
    readings = [
        roofline.MachineRates(10.0, 100.0),
        roofline.MachineRates(30.0, 90.0),
        roofline.MachineRates(12.0, 40.0),
    ]
    assert len(readings) == roofline.READINGS
    measured = []

    def fake_measure(device):
        measured.append(device)
        return readings[len(measured) - 1]

    monkeypatch.setattr(roofline, "measure", fake_measure)
    kept = []
    for _ in range(roofline.READINGS + 2):
        monkeypatch.setattr(roofline, "_in_process", {})  # a new process
        kept.append(roofline.machine_rates("cpu"))
        assert roofline.machine_rates("cpu") == kept[-1]  # measured at most once in a process
    assert len(measured) == roofline.READINGS
    best = roofline.MachineRates(30.0, 100.0)
    assert kept == [roofline.MachineRates(10.0, 100.0), best, best, best, best]
    entry = json.loads((tmp_path / "machine-rates.json").read_text())[roofline._machine_key(torch.device("cpu"))]
    assert entry == {"bandwidth_gbs": 30.0, "peak_gflops": 100.0, "readings": roofline.READINGS}


def test_a_real_measurement_is_short_and_positive():
    start = time.perf_counter()
    rates = roofline.measure(torch.device("cpu"))
    assert rates.bandwidth_gbs > 0 and rates.peak_gflops > 0
    assert time.perf_counter() - start < 1.5  # ~0.2 s; generous for a shared, busy box


def test_the_websocket_switch_turns_profiles_on_and_a_bad_message_closes(tmp_path):
    from litestar.exceptions import WebSocketDisconnect

    from minivllm.server.events_ws import CLOSE_BAD_MESSAGE

    with TestClient(tiny_app(tmp_path)) as c:
        profiler = server_of(c.app).engine().engine.telemetry.profiler
        with c.websocket_connect("/ws/events") as ws:
            assert isinstance(receive(ws), ev.Snapshot)
            ws.send_text('{"type": "step_profile", "on": true}')
            wait_for(lambda: profiler.wanted, timeout=TIMEOUT, what="the switch")
            r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, headers={"X-Request-Id": "p-1"})
            assert r.status_code == 200
            events = [e for m in receive_until(ws, finished("p-1")) for e in m.events]
            steps = [e for e in events if isinstance(e, ev.StepFinished)]
            assert steps and all(s.profile_source == "coarse" and s.memory_floor_ms > 0 for s in steps)
            ws.send_text('{"type": "step_profile", "on": false}')
            wait_for(lambda: not profiler.wanted, timeout=TIMEOUT, what="the switch off")
            ws.send_text('{"type": "step_profile", "on": true}')
            wait_for(lambda: profiler.wanted, timeout=TIMEOUT, what="the switch")
        wait_for(lambda: not profiler.wanted, timeout=TIMEOUT, what="a closed client to stop watching")
        with c.websocket_connect("/ws/events") as ws:
            assert isinstance(receive(ws), ev.Snapshot)
            ws.send_text('{"type": "step_profile", "on": "yes"}')
            with pytest.raises(WebSocketDisconnect) as closed:
                while True:
                    ws.receive_text(timeout=TIMEOUT)
            assert closed.value.code == CLOSE_BAD_MESSAGE and "bad client message" in closed.value.detail
