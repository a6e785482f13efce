"""The step-profile panel: opened on a live engine it draws each step's parts against its floors and
names the wall; a recording of those steps replays the same bars."""

from __future__ import annotations

import re
import uuid

import httpx
from playwright.sync_api import Page, expect

from e2e_support import shot, wait_finished, wait_idle


def _complete(api: httpx.Client, rid: str) -> None:
    r = api.post(
        "/v1/completions",
        headers={"X-Request-Id": rid},
        json={
            "prompt": "The three largest cities of France are",
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text


def _expect_profiled_bars(page: Page, source: str) -> None:
    canvas = page.get_by_test_id("step-profile-canvas")
    expect(canvas).to_have_attribute("data-source", source)
    assert int(canvas.get_attribute("data-bars") or 0) > 0
    assert float(canvas.get_attribute("data-memory-floor") or 0) > 0
    wall = page.get_by_test_id("step-profile-wall")
    expect(wall).to_have_attribute("data-wall", re.compile(r"^(memory|compute|overhead)-bound$"))
    expect(wall).to_contain_text("% efficient")
    expect(page.get_by_test_id("step-profile-legend")).to_contain_text("memory floor")


def test_step_profile_live_then_replayed(page: Page, api: httpx.Client) -> None:
    panel = page.get_by_test_id("step-profile-panel")
    expect(panel).to_contain_text("closed")
    page.get_by_test_id("step-profile-toggle").click()
    expect(page.get_by_test_id("step-profile-empty")).to_be_visible()

    page.get_by_test_id("record-start").click()
    expect(page.get_by_test_id("record-stop")).to_be_visible()
    recording_id = api.get("/api/recordings/status").json()["recording"]["id"]
    rid = f"profile-{uuid.uuid4().hex[:8]}"
    _complete(api, rid)
    wait_finished(page, rid)
    wait_idle(page)
    page.get_by_test_id("record-stop").click()
    expect(page.get_by_test_id("record-start")).to_be_visible()

    # the e2e server decodes through the native step: its part clocks split the forward pass
    _expect_profiled_bars(page, "native")
    expect(page.get_by_test_id("step-profile-legend")).to_contain_text("weight reads (products)")
    shot(panel, "panel-step-profile.png")

    page.get_by_test_id("mode-replay").click()
    select = page.get_by_test_id("replay-recording-select")
    expect(select.locator(f'option[value="{recording_id}"]')).to_be_attached()
    select.select_option(recording_id)
    page.get_by_test_id("replay-load").click()
    expect(page.get_by_test_id("replay-name")).to_be_visible()
    scrub = page.get_by_test_id("replay-scrub")
    scrub.focus()
    scrub.press("End")
    toggle = page.get_by_test_id("step-profile-toggle")
    if toggle.get_attribute("aria-expanded") != "true":  # the replay view may mount its panels afresh
        toggle.click()
    _expect_profiled_bars(page, "native")

    # closing the panel hides the chart
    page.get_by_test_id("mode-live").click()
    toggle = page.get_by_test_id("step-profile-toggle")
    if toggle.get_attribute("aria-expanded") == "true":
        toggle.click()
    expect(toggle).to_have_attribute("aria-expanded", "false")
    expect(page.get_by_test_id("step-profile-canvas")).to_have_count(0)
