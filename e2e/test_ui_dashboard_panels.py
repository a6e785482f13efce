"""The dashboard panels under a load that preempts: the scheduler table fits its panel and filters
preemptions, the timeline's colours, arrows, search, zoom and click-to-seek, the selected-request
card, and the replay view before anything is loaded."""

from __future__ import annotations

import json
import math
import re
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
from playwright.sync_api import Locator, Page, expect

from e2e_support import shot, wait_finished, wait_idle

# Five ~40-token chats of 48 new tokens need ~6 blocks each: 16 blocks hold three at most, so the
# scheduler has to preempt (see conftest.ENGINE).
PROMPTS = [
    "Explain what a KV cache is.",
    "Write a haiku about a cache miss.",
    "List three uses of a paged KV cache.",
    "Why is the sky blue?",
    "Describe a transformer decoder layer.",
]


def _send(server: str, rid: str, prompt: str, chat: bool, priority: int) -> None:
    # A chat goes to the engine as token ids (no prompt text on the wire); a completion keeps its
    # text, which the timeline labels its row with. A completion's prompt is short: more new tokens.
    body = (
        {"messages": [{"role": "user", "content": prompt}], "max_tokens": 48}
        if chat
        else {"prompt": prompt, "max_tokens": 80}
    )
    with httpx.Client(base_url=server, timeout=240) as client:
        r = client.post(
            "/v1/chat/completions" if chat else "/v1/completions",
            headers={"X-Request-Id": rid},
            json={**body, "temperature": 0, "priority": priority},
        )
    assert r.status_code == 200, r.text


def _run_load(page: Page, server: str, chat: bool = True) -> list[str]:
    """Sends the five prompts at once with 32-character ids; returns the ids once all finished.
    The first has a lower priority: the scheduler preempts it for the others (a request can also be
    preempted for itself, the newest running one that needs a block; that draws no arrow)."""
    ids = [uuid.uuid4().hex for _ in PROMPTS]
    with ThreadPoolExecutor(len(ids)) as pool:
        for f in [
            pool.submit(_send, server, rid, p, chat, int(i == 0)) for i, (rid, p) in enumerate(zip(ids, PROMPTS))
        ]:
            f.result()
    for rid in ids:
        wait_finished(page, rid)
    wait_idle(page)
    return ids


def _inside(inner: Locator, outer: Locator) -> None:
    box, frame = inner.bounding_box(), outer.bounding_box()
    assert box is not None and frame is not None, "not rendered"
    assert box["width"] > 0 and box["height"] > 0, f"{inner} has no size: {box}"
    assert box["x"] >= frame["x"] - 0.5 and box["x"] + box["width"] <= frame["x"] + frame["width"] + 0.5, (
        f"{inner} ({box}) runs out of {frame}"
    )


def _preempted_rows(page: Page) -> Locator:
    return page.locator('[data-testid="scheduler-step-row"].row-alert')


def _console_errors(page: Page) -> list[str]:
    """Collects the page's console errors from now on (the page fixture only fails on uncaught ones)."""
    errors: list[str] = []
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    return errors


def test_scheduler_table_fits_its_panel_and_filters_preemptions(page: Page, server: str) -> None:
    errors = _console_errors(page)
    ids = _run_load(page, server)
    panel = page.get_by_test_id("scheduler-panel")
    panel.scroll_into_view_if_needed()
    expect(_preempted_rows(page).first).to_be_attached()

    # every column header is on screen inside the panel, the reason first: at the session's width
    # and at a 1280 px laptop's, where the panel is a half of the main area (~400 px)
    headers = panel.locator("thead th")
    expect(headers).to_have_count(8)
    expect(headers.first).to_have_text("Queue head waits because")
    expect(headers.nth(6)).to_have_text("Preempted")
    table_scroll = panel.locator(".table-scroll")
    size = page.viewport_size
    assert size is not None
    for width in (size["width"], 1280):
        page.set_viewport_size({"width": width, "height": size["height"]})
        panel.scroll_into_view_if_needed()
        for i in range(8):
            expect(headers.nth(i)).to_be_visible()
            _inside(headers.nth(i), panel)
        assert table_scroll.evaluate("(el) => el.scrollWidth <= el.clientWidth + 1"), (
            f"the table scrolls sideways at {width} px"
        )
        # headers wrap between words, never inside one
        for i in range(8):
            assert headers.nth(i).evaluate("(el) => el.scrollWidth <= el.clientWidth + 1"), (
                width,
                headers.nth(i).text_content(),
            )
    shot(panel, "panel-scheduler-1280.png")
    page.set_viewport_size(size)

    # request ids: 8 characters, the full id on hover
    links = _preempted_rows(page).first.get_by_test_id("scheduler-preempted-cell").get_by_test_id("scheduler-id")
    expect(links.first).to_be_visible()
    for k in range(links.count()):
        full = links.nth(k).get_attribute("title") or ""
        assert full in ids, (full, ids)
        expect(links.nth(k)).to_have_text(full[:8])
    _inside(links.first, panel)

    # the filter leaves only the steps that preempted
    all_rows = page.get_by_test_id("scheduler-step-row")
    assert page.locator('[data-testid="scheduler-step-row"]:not(.row-alert)').count() > 0
    page.get_by_test_id("scheduler-preempted-only").check()
    expect(page.locator('[data-testid="scheduler-step-row"]:not(.row-alert)')).to_have_count(0)
    assert all_rows.count() > 0
    for k in range(all_rows.count()):
        expect(
            all_rows.nth(k).get_by_test_id("scheduler-preempted-cell").get_by_test_id("scheduler-id").first
        ).to_be_visible()
    shot(panel, "panel-scheduler-preemptions-only.png")
    page.get_by_test_id("scheduler-preempted-only").uncheck()
    expect(page.locator('[data-testid="scheduler-step-row"]:not(.row-alert)').first).to_be_attached()
    assert not errors, errors


def _live_spans(recording: str, ids: list[str]) -> dict[str, tuple[float, float]]:
    """Each request's (admission, finish) times from a recording's request_state events."""
    spans: dict[str, list[float]] = {}
    for line in recording.splitlines():
        e = json.loads(line)
        if e.get("type") != "request_state" or e["request_id"] not in ids:
            continue
        span = spans.setdefault(e["request_id"], [math.inf, math.inf])
        if e["state"] != "WAITING" and span[0] == math.inf:
            span[0] = e["ts"]
        if e["state"] == "FINISHED":
            span[1] = e["ts"]
    assert set(spans) == set(ids), spans.keys()
    return {rid: (a, b) for rid, (a, b) in spans.items()}


def _swatch(page: Page, rid: str) -> str:
    return (
        page.get_by_test_id(f"request-row-{rid}")
        .locator(".swatch")
        .evaluate("(el) => getComputedStyle(el).backgroundColor")
    )


def test_timeline_colours_arrows_search_zoom_and_replay_seek(page: Page, server: str, api: httpx.Client) -> None:
    errors = _console_errors(page)
    page.get_by_test_id("record-start").click()
    expect(page.get_by_test_id("record-stop")).to_be_visible()
    recording_id = api.get("/api/recordings/status").json()["recording"]["id"]
    arrows = page.get_by_test_id("timeline-arrows")
    # the workload arranges a preemption for another request; on a loaded box the five may arrive too far
    # apart for one (or the newest preempts itself: no arrow), so it runs again, at most three times
    for _ in range(3):
        ids = _run_load(page, server, chat=False)
        if any(line.split(" -> ")[0] in ids for line in (arrows.text_content() or "").splitlines() if " -> " in line):
            break
    page.get_by_test_id("record-stop").click()
    expect(page.get_by_test_id("record-start")).to_be_visible()

    # an arrow from each preempted request to the one that needed its blocks
    expect(arrows).to_contain_text(" -> ")
    pairs = [re.match(r"^(\S+) -> (\S+) @ ", line) for line in (arrows.text_content() or "").splitlines()]
    pairs = [(m[1], m[2]) for m in pairs if m and m[1] in ids]
    assert pairs, arrows.text_content()
    for victim, cause in pairs:
        assert cause in ids and cause != victim, (victim, cause)

    # requests live at the same time (admitted, not yet finished: from the recording) never share a
    # colour, so a preempted request and the one that took its blocks differ
    colours = {rid: _swatch(page, rid) for rid in ids}
    spans = _live_spans(api.get(f"/api/recordings/{recording_id}").text, ids)
    overlapping = [
        (a, b) for a in ids for b in ids if a < b and spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]
    ]
    assert len(overlapping) >= len(ids) - 1, spans
    for a, b in overlapping:
        assert colours[a] != colours[b], (a, b, colours)
    for victim, cause in pairs:
        assert colours[victim] != colours[cause]
    # rows are labelled with a short id and the prompt's first words
    victim = pairs[0][0]
    row = page.get_by_test_id(f"request-row-{victim}")
    expect(row.locator(".timeline-label-id")).to_have_text(victim[:8])
    expect(row.get_by_test_id("timeline-row-prompt")).to_have_text(
        re.compile("^" + re.escape(PROMPTS[ids.index(victim)].split()[0]) + " ")
    )

    # search by id: the row is marked, the others are not
    page.get_by_test_id("timeline-search").fill(victim[:6])
    expect(row).to_have_attribute("data-match", "true")
    expect(page.locator("[data-match=true]")).to_have_count(1)
    expect(page.get_by_test_id("timeline-search-count")).to_contain_text("1 match")
    page.get_by_test_id("timeline-search").press("Enter")
    expect(page.get_by_test_id("request-detail-id")).to_have_text(victim)

    # the selected (finished) request's card: no "Sequences 0", nothing past its edge
    card = page.get_by_test_id("request-detail")
    expect(card.get_by_test_id("request-detail-seqs")).to_have_count(0)
    expect(card.get_by_test_id("request-detail-total")).to_be_visible()
    expect(card.get_by_test_id("request-detail-id")).to_have_attribute("title", victim)
    for part in ("request-detail-id", "request-detail-state", "request-detail-finish"):
        _inside(card.get_by_test_id(part), card)
    shot(card, "panel-request-detail-finished.png")

    # wheel zooms, drag pans, reset goes back to the whole window
    canvas = page.get_by_test_id("timeline-canvas")
    canvas.scroll_into_view_if_needed()
    box = canvas.bounding_box()
    assert box is not None
    cx, cy = box["x"] + box["width"] * 0.6, box["y"] + 40
    expect(canvas).to_have_attribute("data-view", "auto")
    page.mouse.move(cx, cy)
    page.mouse.wheel(0, -400)
    expect(canvas).not_to_have_attribute("data-view", "auto")
    zoomed = canvas.get_attribute("data-view") or ""
    page.mouse.move(cx, cy)
    page.mouse.down()
    page.mouse.move(cx - 120, cy, steps=6)
    page.mouse.up()
    expect(canvas).not_to_have_attribute("data-view", zoomed)
    page.get_by_test_id("timeline-zoom-reset").click()
    expect(canvas).to_have_attribute("data-view", "auto")
    page.get_by_test_id("timeline-search").fill("")

    # replay: before loading, it asks for a recording; once loaded, a click jumps there
    page.get_by_test_id("mode-replay").click()
    expect(page.get_by_test_id("timeline-empty")).to_contain_text("Load a recording")
    expect(page.get_by_test_id("timeline-empty")).not_to_contain_text("/ws/events")
    select = page.get_by_test_id("replay-recording-select")
    expect(select.locator(f'option[value="{recording_id}"]')).to_be_attached()
    select.select_option(recording_id)
    page.get_by_test_id("replay-load").click()
    expect(page.get_by_test_id("replay-verified")).to_contain_text("consistent")
    position = page.get_by_test_id("replay-position")
    expect(position).to_have_attribute("data-position", "0")
    expect(position).not_to_have_attribute("data-length", "0")
    length = int(position.get_attribute("data-length") or "0")
    box = canvas.bounding_box()
    assert box is not None
    canvas.click(position={"x": box["width"] * 0.5, "y": 60})
    expect(position).not_to_have_attribute("data-position", "0")
    middle = int(position.get_attribute("data-position") or "0")
    assert 0 < middle < length, (middle, length)
    # further right is later in the recording
    canvas.click(position={"x": box["width"] * 0.9, "y": 60})
    expect(position).not_to_have_attribute("data-position", str(middle))
    assert int(position.get_attribute("data-position") or "0") > middle
    shot(page.get_by_test_id("timeline-panel"), "panel-timeline-replay-seek.png")
    assert not errors, errors
