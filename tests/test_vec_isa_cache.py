"""Inductor's vector-ISA probe is answered from the cache after a first start where every ISA passed;
a failed ISA, another machine or the user's own setting means the probes run."""

from __future__ import annotations

import pytest
from torch._inductor import config

from minivllm.model import vec_isa_cache


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    with config.patch({"cpp.vec_isa_ok": None}):  # put back after each test, whatever the test set
        yield


def probes(monkeypatch, result: bool) -> list[int]:
    calls = []
    monkeypatch.setattr(vec_isa_cache, "_every_isa_passes", lambda: calls.append(1) or result)
    return calls


def test_a_machine_whose_isas_all_passed_skips_the_probes_next_time(monkeypatch):
    calls = probes(monkeypatch, True)
    assert not vec_isa_cache.use_kept_probe() and config.cpp.vec_isa_ok is None
    assert vec_isa_cache.use_kept_probe() and config.cpp.vec_isa_ok is True
    assert len(calls) == 1


def test_a_failed_isa_is_not_kept(monkeypatch):
    calls = probes(monkeypatch, False)
    assert not vec_isa_cache.use_kept_probe()
    assert not vec_isa_cache.use_kept_probe()
    assert len(calls) == 2 and config.cpp.vec_isa_ok is None


def test_another_cpu_probes_again(monkeypatch):
    calls = probes(monkeypatch, True)
    vec_isa_cache.use_kept_probe()
    monkeypatch.setattr(vec_isa_cache, "cpu_model", lambda: "another CPU")
    assert not vec_isa_cache.use_kept_probe() and len(calls) == 2


def test_the_users_own_setting_wins(monkeypatch):
    calls = probes(monkeypatch, True)
    config.cpp.vec_isa_ok = False
    assert not vec_isa_cache.use_kept_probe()
    assert not calls and config.cpp.vec_isa_ok is False
