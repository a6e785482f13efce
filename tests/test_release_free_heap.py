"""Free heap pages go back to the OS after start-up: what `ps` shows as RSS drops."""

from __future__ import annotations

import pytest

from minivllm import malloc_tuning
from minivllm.engine import llm_engine
from minivllm.engine.memory_budget import process_rss_bytes

MIB = 2**20


@pytest.mark.skipif(
    malloc_tuning._libc_function("malloc_trim") is None, reason="this C library has no malloc_trim (not glibc)"
)
def test_freed_heap_pages_are_handed_back():
    # 64 KiB blocks come from the heap (below glibc's mmap threshold); 1 KiB objects kept between them
    # (past pymalloc's 512 bytes, so from the heap too) pin its top: freeing the blocks alone leaves
    # their pages resident.
    blocks, pins = [], []
    for _ in range(3000):
        blocks.append(bytearray(b"x" * (64 * 1024)))
        pins.append(bytearray(b"y" * 1024))
    del blocks
    before = process_rss_bytes()  # measured: ~545 MiB here, ~365 after the release
    assert malloc_tuning.release_free_heap()
    assert before - process_rss_bytes() > 100 * MIB
    assert len(pins) == 3000


def test_every_engine_build_releases_the_heap(monkeypatch):
    """Start-up and every rebuild (the dashboard's engine settings) end with the release."""
    from engine_utils import make_engine
    from minivllm.loader import load_model

    calls = []
    monkeypatch.setattr(llm_engine, "release_free_heap", lambda: calls.append(1) or True)
    engine = make_engine(load_model("random:tiny", quantization="none", max_model_len=128), num_blocks=16)
    assert len(calls) == 1
    engine.reconfigure(num_blocks=24)
    assert len(calls) == 2
