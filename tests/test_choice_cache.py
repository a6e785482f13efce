"""Kernel choices are timed once per machine and kept: a later load takes the same kernels without
timing, MINIVLLM_RETIME_KERNELS=1 or another machine times again, and a stale or damaged entry is
never used."""

from __future__ import annotations

import json

import pytest
import torch

from minivllm.quant import choice_cache, chooser
from minivllm.quant.chooser import choose_kernels
from minivllm.quant.formats import quantize_int4
from minivllm.quant.linear import QuantLinear

CPU = torch.device("cpu")
BUCKETS = (1, 8)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(choice_cache.RETIME_ENV, raising=False)
    return tmp_path


def layers(seed: int = 0) -> list[QuantLinear]:
    torch.manual_seed(seed)
    return [QuantLinear(f"l{i}", quantize_int4("w", torch.randn(96, 64), 32), CPU, torch.float32) for i in range(2)]


def count_timings(monkeypatch) -> list[int]:
    calls = []
    timed = chooser._time_group

    def counting(members, buckets):
        calls.append(1)
        return timed(members, buckets)

    monkeypatch.setattr(chooser, "_time_group", counting)
    return calls


def plan_names(choice) -> list[tuple[int, str]]:
    return [(rows, name) for rows, name in choice.plan]


def test_a_second_load_takes_the_stored_choice_without_timing(monkeypatch):
    calls = count_timings(monkeypatch)
    (first,) = choose_kernels(layers(), buckets=BUCKETS)
    assert not first.cached and len(calls) == 1 and choice_cache.path().is_file()
    (second,) = choose_kernels(layers(seed=1), buckets=BUCKETS)
    assert second.cached and len(calls) == 1
    assert plan_names(second) == plan_names(first) and second.timings_ms == first.timings_ms


def test_the_stored_choice_is_used_even_where_a_new_timing_would_differ(monkeypatch):
    """The point of keeping it: two near-equal kernels do not swap between starts."""
    (first,) = choose_kernels(layers(), buckets=BUCKETS)
    entries = json.loads(choice_cache.path().read_text())
    (key,) = entries
    other = next(n for n in entries[key]["timings_ms"]["1"] if n != first.plan[0][1])
    entries[key]["plan"] = [[BUCKETS[-1], other]]
    choice_cache.path().write_text(json.dumps(entries))
    fresh = layers()
    (second,) = choose_kernels(fresh, buckets=BUCKETS)
    assert second.cached and second.plan == [(BUCKETS[-1], other)]
    assert all(layer.plan[0][1].name == other for layer in fresh)


def test_retime_env_and_another_machine_time_again(monkeypatch):
    calls = count_timings(monkeypatch)
    choose_kernels(layers(), buckets=BUCKETS)
    monkeypatch.setenv(choice_cache.RETIME_ENV, "1")
    (again,) = choose_kernels(layers(), buckets=BUCKETS)
    assert not again.cached and len(calls) == 2
    monkeypatch.delenv(choice_cache.RETIME_ENV)
    monkeypatch.setattr(choice_cache, "cpu_model", lambda: "another CPU")
    (elsewhere,) = choose_kernels(layers(), buckets=BUCKETS)
    assert not elsewhere.cached and len(calls) == 3
    assert len(json.loads(choice_cache.path().read_text())) == 2  # one entry per machine


def test_a_plan_naming_an_unknown_kernel_or_a_damaged_file_is_ignored(monkeypatch, caplog):
    calls = count_timings(monkeypatch)
    choose_kernels(layers(), buckets=BUCKETS)
    entries = json.loads(choice_cache.path().read_text())
    (key,) = entries
    entries[key]["plan"] = [[BUCKETS[-1], "int4gone/int2"]]
    choice_cache.path().write_text(json.dumps(entries))
    (choice,) = choose_kernels(layers(), buckets=BUCKETS)
    assert not choice.cached and len(calls) == 2 and choice.plan[0][1] != "int4gone/int2"

    choice_cache.path().write_text('{"truncated": ')
    (choice,) = choose_kernels(layers(), buckets=BUCKETS)
    assert not choice.cached and len(calls) == 3 and "ignoring" in caplog.text
    assert json.loads(choice_cache.path().read_text())  # rewritten whole


def test_forced_kernels_are_neither_timed_nor_stored(monkeypatch):
    calls = count_timings(monkeypatch)
    (choice,) = choose_kernels(layers(), forced="fp32", buckets=BUCKETS)
    assert not calls and not choice.cached and not choice_cache.path().exists()


def test_a_malformed_entry_is_timed_again(monkeypatch, caplog):
    calls = count_timings(monkeypatch)
    choose_kernels(layers(), buckets=BUCKETS)
    entries = json.loads(choice_cache.path().read_text())
    (key,) = entries
    entries[key] = {"plan": "not a plan"}
    choice_cache.path().write_text(json.dumps(entries))
    (choice,) = choose_kernels(layers(), buckets=BUCKETS)
    assert not choice.cached and len(calls) == 2 and "malformed" in caplog.text
    assert choice_cache.lookup(key) is not None  # replaced by the new timing
