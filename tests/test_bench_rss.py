"""Peak RSS for the benchmarks: a child's own peak (not the largest child's so far), its output and exit
status kept, and a timeout that kills it."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from minivllm.bench.rss import own_peak_rss_bytes, run_with_peak_rss

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
