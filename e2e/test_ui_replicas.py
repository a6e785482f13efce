"""Engine replicas in the dashboard, against a server started with `--data-parallel-size 2` (Ray).

This module starts its own server (the shared one runs one engine) on the random `tiny` model and
overrides the `server` and `engine` fixtures. Three requests share a long prefix: the Routing table
shows the first sent to the least loaded replica and the others to the same one by prefix; the
replica switcher moves the event stream to the other replica, and the connection comes back live.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from conftest import ENGINE, running_server
from playwright.sync_api import Page, expect

SHARED = "You are a careful assistant who answers in one short sentence. " * 4


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    args = ["--data-parallel-size", "2", "--model", "random:tiny", "--quantization", "none"]
    with running_server(args, "server-replicas.log") as base:
        yield base


@pytest.fixture
def engine(server: str) -> dict:
    """A fresh server used by this module alone: nothing to reset before the test."""
    return ENGINE


def test_the_dashboard_shows_routing_and_switches_replicas(page: Page, server: str) -> None:
    panel = page.get_by_test_id("replicas-panel")
    expect(panel).to_be_visible()
    expect(page.get_by_test_id("replica-row-0")).to_contain_text("alive")
    expect(page.get_by_test_id("replica-row-1")).to_contain_text("alive")
    with httpx.Client(base_url=server, timeout=120) as api:
        for i in range(3):
            body = {"prompt": f"{SHARED}Question {i}:", "max_tokens": 2, "temperature": 0, "request_id": f"shared-{i}"}
            r = api.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
        decisions = api.get("/v1/replicas").json()["decisions"]
    replica = decisions[0]["replica"]
    assert [(d["request_id"], d["replica"], d["reason"]) for d in decisions] == [
        ("shared-0", replica, "least_loaded"),
        ("shared-1", replica, "prefix"),
        ("shared-2", replica, "prefix"),
    ]
    rows = page.get_by_test_id("routing-decisions").locator("tbody tr")
    expect(rows).to_have_count(3)
    expect(rows.first).to_contain_text("shared-2")
    expect(rows.first).to_contain_text("prefix")
    expect(rows.last).to_contain_text("least_loaded")

    switcher = page.get_by_test_id("replica-switcher")
    switcher.select_option("1")
    expect(switcher).to_have_value("1")
    expect(page.get_by_test_id("connection-badge")).to_have_attribute("data-status", "live")
    expect(page.get_by_test_id("heatmap-summary")).to_contain_text(f"blocks={ENGINE['num_blocks']} ")
