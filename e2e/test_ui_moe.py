"""A mixture-of-experts model in the dashboard, against a server of its own.

The server loads a tiny random Qwen3-MoE GGUF (2 layers, 4 experts, top 2; F16, written with gguf-py by
`bench/random_gguf.py`) with every fp32 product on our kernel, so its decode steps run the native step, whose
C++ call routes the rows and counts the experts it ran. The scheduler's step rows then say how many experts
each step touched: a lone sequence's decode step exactly top-k per MoE layer.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import ENGINE, running_server
from playwright.sync_api import Page, expect

from e2e_support import reply_text, send_chat, set_decoding, shot
from minivllm.bench import random_gguf

MOE_LAYERS, EXPERTS, TOP_K = 2, 4, 2  # random_gguf's "tiny-qwen3moe"
MAX_TOKENS = 12
STEPS = MAX_TOKENS  # the prefill's step (its first token), then one decode step a token
CATCH_UP_S = 10.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = random_gguf.write_random_gguf("tiny-qwen3moe", tmp_path_factory.mktemp("moe") / "tiny-qwen3moe-F16.gguf")
    before = os.environ.get("MINIVLLM_FP32_KERNEL")
    os.environ["MINIVLLM_FP32_KERNEL"] = "native"  # experts included: what the native step needs (not a timing)
    try:
        with running_server(["--model", str(path)], "server-moe.log") as base:
            yield base
    finally:
        if before is None:
            os.environ.pop("MINIVLLM_FP32_KERNEL", None)
        else:
            os.environ["MINIVLLM_FP32_KERNEL"] = before


@pytest.fixture
def engine(server: str) -> dict:
    """This module's server is fresh and used by one test: nothing to reset."""
    return ENGINE


def test_the_scheduler_says_how_many_experts_each_step_ran(page: Page, server: str) -> None:
    config = httpx.get(f"{server}/api/config", timeout=10).json()
    assert config["compilation"].startswith("native decode step"), config["compilation"]

    set_decoding(page, preset="greedy", max_tokens=MAX_TOKENS)
    send_chat(page, "Hello")
    reply_text(page)

    panel = page.get_by_test_id("scheduler-panel")
    panel.scroll_into_view_if_needed()
    counts = panel.get_by_test_id("scheduler-experts")
    expect(counts.first).to_be_visible()
    # the reply's stream can finish before the event socket's last batches land (seen: only the prefill's row,
    # the decode steps' 0.1-0.2 s later): read once every step of the reply is in
    deadline = time.monotonic() + CATCH_UP_S
    while True:
        touched = [
            int(re.fullmatch(r"· (\d+) experts", (text or "").strip()).group(1)) for text in counts.all_text_contents()
        ]  # type: ignore[union-attr]
        if len(touched) >= STEPS or time.monotonic() > deadline:
            break
        page.wait_for_timeout(50)  # lets Playwright take the socket's events in between
    assert all(MOE_LAYERS * TOP_K <= n <= MOE_LAYERS * EXPERTS for n in touched), touched
    # one sequence decoding: each layer ran exactly its row's top-k experts
    assert touched.count(MOE_LAYERS * TOP_K) >= 5, touched
    shot(panel, "panel-scheduler-moe.png")
