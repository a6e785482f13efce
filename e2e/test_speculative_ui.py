"""Speculative decoding in the dashboard, against a second server started with n-gram drafting.

The shared server (conftest.py) runs without speculative decoding; this module starts its own with
`--speculative-config` (the same small engine otherwise) and overrides the `server` and `engine`
fixtures, so the browser, context and page fixtures of conftest.py drive it. It costs one server
start (~30 s: the embedded model loads and its kernels are measured) and one short greedy chat.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import pytest
from conftest import ENGINE, running_server
from playwright.sync_api import Page, expect

from e2e_support import last_reply, reply_text, send_chat, set_decoding, shot

SPEC = {"method": "ngram", "num_speculative_tokens": 4}
# n-gram lookup proposes what followed the last few tokens earlier in the context: a reply that
# copies the prompt's sentence gets its drafts accepted.
PROMPT = "Repeat this sentence three times: The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """A server like the shared one, plus n-gram speculative decoding."""
    with running_server(["--speculative-config", json.dumps(SPEC)], "server-speculative.log") as base:
        yield base


@pytest.fixture
def engine(server: str) -> dict:
    """This module's server is fresh and used by one test: nothing to reset (and the shared server,
    which conftest's `engine` resets, is not needed here)."""
    return ENGINE


def test_speculative_setup_drafted_tokens_verify_marks_and_acceptance(page: Page, server: str) -> None:
    # the setup, read-only: in the header and on the Engine tab
    expect(page.get_by_test_id("engine-speculative")).to_have_text("spec ngram: k=4")
    page.get_by_test_id("tab-settings").click()
    expect(page.get_by_test_id("settings-speculative")).to_contain_text("ngram: k=4")
    expect(page.get_by_test_id("settings-speculative")).to_have_attribute("data-state", "on")
    page.get_by_test_id("tab-chat").click()
    expect(page.get_by_test_id("metrics-spec")).to_have_attribute("data-state", "idle")

    set_decoding(page, preset="greedy", max_tokens=40)
    rid = send_chat(page, PROMPT)
    reply_text(page)
    msg = last_reply(page)

    # accepted drafts are marked in the chat's token view, with a legend; hover shows the draft
    drafted = msg.locator('[data-testid="token"][data-drafted="true"]')
    expect(drafted.first).to_be_visible()
    expect(msg.get_by_test_id("token-legend")).to_be_visible()
    drafted.first.hover()
    detail = page.get_by_test_id("token-tooltip").get_by_test_id("draft-detail")
    expect(detail).to_contain_text("ngram · step")
    expect(detail.locator('[data-status="accepted"]').first).to_be_visible()

    # the timeline marks the request's verify steps; the metrics show acceptance from the counters
    expect(page.get_by_test_id("timeline-verify-summary")).to_contain_text(f"{rid} verifies=")
    expect(page.get_by_test_id("timeline-legend-verify")).to_be_visible()
    expect(page.get_by_test_id("metrics-spec")).to_have_attribute("data-state", "on")
    expect(page.get_by_test_id("metric-spec-acceptance")).to_have_text(re.compile(r"^\d+(\.\d)?%$"))
    expect(page.get_by_test_id("metric-spec-mean-accepted")).to_have_text(re.compile(r"^\d\.\d\d$"))

    # the server's own counters agree with what the panel derived
    counters = httpx.get(f"{server}/metrics", timeout=10).text
    accepted = sum(
        float(line.rsplit(" ", 1)[1])
        for line in counters.splitlines()
        if line.startswith("minivllm:spec_decode_num_accepted_tokens_total")
    )
    assert accepted >= drafted.count() > 0, (accepted, drafted.count())
    shot(page.get_by_test_id("chat-panel"), "panel-chat-speculative.png")
    page.get_by_test_id(f"request-row-{rid}").click()
    expect(page.get_by_test_id("request-detail-spec")).to_contain_text("/ verify")
    shot(page.get_by_test_id("timeline-panel"), "panel-timeline-speculative.png")
    shot(page.get_by_test_id("metrics-panel"), "panel-metrics-speculative.png")
