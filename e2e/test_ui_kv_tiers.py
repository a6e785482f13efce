"""The prefix cache's disk tier in the dashboard, against a server started with `--kv-offload-dir`.

Like test_speculative_ui.py, this module starts its own server (the shared one has no disk tier) and
overrides the `server` and `engine` fixtures. A long prompt runs once; rebuilding the engine (PUT
/api/config, which writes the prefix cache to the disk tier first) empties the RAM pool; the same prompt
again is served from disk: the heatmap flashes the restored blocks, its legend names the tier, the
event log says "restored from disk", and the Metrics panel and /metrics count the blocks read back.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest
from conftest import ENGINE, reset_engine, running_server
from playwright.sync_api import Page, expect

from e2e_support import shot

# ~120 prompt tokens: 7 full blocks of 16 that the disk tier can serve
PROMPT = "Count slowly: " + " ".join(f"{i} apples," for i in range(40))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    offload = tmp_path_factory.mktemp("kv-offload")
    with running_server(
        ["--kv-offload-dir", str(offload), "--kv-offload-size", "64MiB"], "server-kv-tiers.log"
    ) as base:
        yield base


@pytest.fixture
def engine(server: str) -> dict:
    """A fresh server used by this module alone: nothing to reset before the test."""
    return ENGINE


def _complete(server: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text


def test_blocks_evicted_to_disk_come_back_and_the_dashboard_shows_it(page: Page, server: str) -> None:
    expect(page.get_by_test_id("legend-restored")).to_have_text("Restored from disk")
    with httpx.Client(base_url=server, timeout=120) as api:
        reset_engine(api)  # the session's settings (a float32 pool: the disk tier keeps each layout apart)
        _complete(server)
        reset_engine(api)  # a rebuilt pool: what RAM cached is on disk now, and only there
    summary = page.get_by_test_id("heatmap-summary")
    expect(summary).to_have_attribute("data-restored", "0")
    _complete(server)
    expect(summary).to_have_attribute("data-restored", re.compile(r"^[1-9]\d*$"))
    restored = int(summary.get_attribute("data-restored") or 0)
    assert restored >= 6, restored  # every full block but the last token's
    expect(page.get_by_test_id("event-log-row").filter(has_text="restored from disk").first).to_be_visible()
    expect(page.get_by_test_id("metrics-disk-tier").get_by_test_id("disk-read")).to_have_text(re.compile(r"^[1-9]"))
    counters = httpx.get(f"{server}/metrics", timeout=10).text
    read = [line for line in counters.splitlines() if line.startswith("minivllm:kv_disk_blocks_read_total")]
    assert read and float(read[0].rsplit(" ", 1)[1]) >= restored, read
    shot(page.get_by_test_id("heatmap-panel"), "panel-heatmap-disk-tier.png")
