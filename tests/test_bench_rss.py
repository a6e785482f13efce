"""Peak RSS for the benchmarks: a child's own peak (not the largest child's so far), its output and exit
status kept, and a timeout that kills it."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from minivllm.bench.rss import own_peak_rss_bytes, run_with_peak_rss, split_line
from minivllm.events.types import MemorySplit

MIB = 2**20


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_child_peak_is_its_own():
    big, big_rss = run_with_peak_rss(
        python(
            "import sys, time; b = bytearray(300 * 2**20); time.sleep(0.2); "
            "print('out'); print('err', file=sys.stderr); sys.exit(3)"
        )
    )
    small, small_rss = run_with_peak_rss(python("import time; time.sleep(0.2)"))
    assert big.returncode == 3 and big.stdout == "out\n" and big.stderr == "err\n"
    assert small.returncode == 0
    assert big_rss >= 300 * MIB
    assert 0 < small_rss < 100 * MIB  # neither the earlier, larger child nor this process counts


def test_a_child_past_its_timeout_is_killed():
    start = time.perf_counter()
    with pytest.raises(subprocess.TimeoutExpired):
        run_with_peak_rss(python("import time; time.sleep(30)"), timeout_s=0.5)
    assert time.perf_counter() - start < 10


def test_own_peak_grows_with_what_this_process_holds():
    before = own_peak_rss_bytes()
    held = bytearray(64 * MIB)
    held[::4096] = b"x" * len(held[::4096])  # touch every page
    assert own_peak_rss_bytes() >= before and own_peak_rss_bytes() >= 64 * MIB


def test_the_split_line_names_every_part_and_what_is_unknown():
    split = MemorySplit(
        rss=400 * MIB, weights=100 * MIB, kv_cache=8 * MIB, compiled=1 * MIB, torch=80 * MIB, libraries=40 * MIB,
        other=171 * MIB, kv_reserved=64 * MIB,
    )  # fmt: skip
    assert split_line(split) == (
        "RSS split (MiB): 400 = weights 100, kv_cache 8, compiled 1, torch 80, libraries 40, other 171 "
        "(KV pool reserved 64)"
    )
    assert "weights ?" in split_line(MemorySplit(rss=MIB)) and split_line(None) == "RSS split: not measured"
