"""Recording a session and replaying it, and the live connection dropping and resuming."""

from __future__ import annotations

import uuid

import httpx
from playwright.sync_api import Page, expect

from e2e_support import send_chat, set_decoding, shot, timeline, wait_finished, wait_idle, wait_js


def test_replay_of_a_recording_ends_in_the_live_final_state(page: Page, api: httpx.Client) -> None:
    page.get_by_test_id("record-start").click()
    expect(page.get_by_test_id("record-stop")).to_be_visible()
    status = api.get("/api/recordings/status").json()
    recording_id = status["recording"]["id"]

    # two overlapping requests: one from the chat, one through the API
    set_decoding(page, preset="greedy", max_tokens=32)
    chat_id = send_chat(page, "Give me three tips for baking bread.")
    wait_js(page, "(id) => window.__e2e.timeline()[id]?.state === 'DECODE'", chat_id)
    api_id = f"replay-{uuid.uuid4().hex[:8]}"
    r = api.post(
        "/v1/chat/completions",
        headers={"X-Request-Id": api_id},
        json={"messages": [{"role": "user", "content": "What is sourdough?"}], "max_tokens": 16, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    wait_finished(page, chat_id)
    wait_finished(page, api_id)
    wait_idle(page)
    page.get_by_test_id("record-stop").click()
    expect(page.get_by_test_id("record-start")).to_be_visible()

    live_timeline = page.get_by_test_id("timeline-summary").text_content() or ""
    live_heatmap = page.get_by_test_id("heatmap-summary").text_content() or ""
    assert chat_id in live_timeline and api_id in live_timeline, live_timeline

    page.get_by_test_id("mode-replay").click()
    expect(page.get_by_test_id("replay-bar")).to_be_visible()
    select = page.get_by_test_id("replay-recording-select")
    expect(select.locator(f'option[value="{recording_id}"]')).to_be_attached()
    select.select_option(recording_id)
    page.get_by_test_id("replay-load").click()
    expect(page.get_by_test_id("replay-name")).to_be_visible()
    expect(page.get_by_test_id("replay-verified")).to_contain_text("consistent")
    position = page.get_by_test_id("replay-position")
    expect(position).to_have_attribute("data-position", "0")
    length = position.get_attribute("data-length")
    assert length is not None and int(length) > 0
    # at the start of the recording nothing has arrived yet
    expect(page.get_by_test_id("timeline-summary")).to_have_text("")
    expect(page.get_by_test_id("connection-badge")).to_contain_text("viewing replay")

    # scrub to the end
    scrub = page.get_by_test_id("replay-scrub")
    scrub.focus()
    scrub.press("End")
    expect(position).to_have_attribute("data-position", length)
    expect(page.get_by_test_id("timeline-summary")).to_have_text(live_timeline)
    expect(page.get_by_test_id("heatmap-summary")).to_have_text(live_heatmap)
    shot(page.get_by_test_id("replay-bar"), "panel-replay-bar.png")
    shot(page, "dashboard-replay.png")

    # scrubbing back and forth lands on the same final state again
    scrub.press("Home")
    expect(position).to_have_attribute("data-position", "0")
    expect(page.get_by_test_id("timeline-summary")).to_have_text("")
    scrub.press("End")
    expect(page.get_by_test_id("timeline-summary")).to_have_text(live_timeline)

    # and the live view is still there, unchanged
    page.get_by_test_id("mode-live").click()
    expect(page.get_by_test_id("replay-bar")).to_have_count(0)
    expect(page.get_by_test_id("timeline-summary")).to_have_text(live_timeline)


def test_reconnect_resumes_without_losing_state(page: Page, api: httpx.Client, engine: dict) -> None:
    badge = page.get_by_test_id("connection-badge")
    summary = page.get_by_test_id("timeline-summary")
    set_decoding(page, preset="greedy", max_tokens=16)
    before_id = send_chat(page, "Say something nice about cats.")
    before_row = wait_finished(page, before_id)
    wait_idle(page)
    before_text = summary.text_content() or ""
    before_heatmap = page.get_by_test_id("heatmap-summary").text_content() or ""
    sockets = page.evaluate("() => window.__e2e.ws.sockets.length")

    # Drop the WebSocket and keep it down (new sockets fail to open).
    page.evaluate("() => { window.__e2e.ws.blocked = true; window.__e2e.dropSocket(); }")
    expect(badge).to_have_attribute("data-status", "reconnecting")

    # The engine keeps working while the dashboard is cut off...
    missed_id = f"missed-{uuid.uuid4().hex[:8]}"
    r = api.post(
        "/v1/chat/completions",
        headers={"X-Request-Id": missed_id},
        json={"messages": [{"role": "user", "content": "What is a cache?"}], "max_tokens": 12, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    # ...and the dashboard keeps what it had, without the missed request
    expect(badge).not_to_have_attribute("data-status", "live")
    expect(summary).to_have_text(before_text)
    assert missed_id not in (summary.text_content() or "")

    # Let it reconnect: it resumes from its last event and replays what it missed.
    page.evaluate("() => { window.__e2e.ws.blocked = false; }")
    expect(badge).to_have_attribute("data-status", "live", timeout=30_000)
    url = page.evaluate("() => window.__e2e.ws.sockets[window.__e2e.ws.sockets.length - 1].url")
    assert page.evaluate("() => window.__e2e.ws.sockets.length") == sockets + 1
    assert "since=" in url, url
    missed_row = wait_finished(page, missed_id)
    assert missed_row.segments == ("WAITING", "PREFILL", "DECODE", "FINISHED"), missed_row
    assert timeline(page)[before_id] == before_row
    for line in before_text.splitlines():
        assert line in (summary.text_content() or ""), f"lost after reconnecting: {line}"
    wait_idle(page)
    # the resumed heatmap is the engine's: the same as a dashboard that connects afresh
    fresh = page.context.new_page()
    fresh.goto("/")
    expect(fresh.get_by_test_id("connection-badge")).to_have_attribute("data-status", "live")
    expect(fresh.get_by_test_id("heatmap-summary")).to_contain_text(f"blocks={engine['num_blocks']} ")
    expect(page.get_by_test_id("heatmap-summary")).to_have_text(
        fresh.get_by_test_id("heatmap-summary").text_content() or "<empty>"
    )
    assert page.get_by_test_id("heatmap-summary").text_content() != before_heatmap  # the missed blocks are cached
    fresh.close()

    # and it keeps updating
    after_id = send_chat(page, "Say something nice about dogs.")
    after_row = wait_finished(page, after_id)
    assert after_row.segments[-1] == "FINISHED"
    assert set(timeline(page)) >= {before_id, missed_id, after_id}
    expect(badge).to_have_attribute("data-status", "live")
