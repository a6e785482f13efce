"""The page layout: Compare in the main area at the desktop size, and the phone layout at 390x844
(the header wraps with the Live/Replay switch readable, one page scroll, Chat / Dashboard tabs).
Screenshots of the Compare view and of both phone tabs are kept under artifacts/e2e/."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import VIEWPORT
from playwright.sync_api import Browser, Page, expect

from e2e_support import INIT_SCRIPT, send_chat, set_decoding, shot

PHONE = {"width": 390, "height": 844}

# For each <select>: its width and the widest option label's, measured in the select's own font. A
# select never reports overflow (its scrollWidth is its clientWidth even when the label is cut), so
# the labels are measured in a span; 24 px are left for the padding and the drop-down arrow.
_SELECT_FIT = """(ids) => ids.map((id) => {
  const sel = document.querySelector(`[data-testid="${id}"]`);
  const cs = getComputedStyle(sel);
  const probe = document.createElement('span');
  probe.style.cssText = 'position:absolute;visibility:hidden;white-space:pre';
  probe.style.font = cs.font;
  probe.style.letterSpacing = cs.letterSpacing;
  document.body.append(probe);
  let widest = 0;
  for (const o of sel.options) {
    probe.textContent = o.text;
    widest = Math.max(widest, probe.getBoundingClientRect().width);
  }
  probe.remove();
  const pad = parseFloat(cs.paddingLeft) + parseFloat(cs.paddingRight);
  return { id, width: sel.clientWidth, room: sel.clientWidth - pad - 24, widest,
           overflow: sel.scrollWidth > sel.clientWidth };
})"""

# Every element wider than the viewport or reaching past its right edge (what makes a phone scroll
# sideways), as "tag.class#testid right=N".
_OVERFLOWING = """(w) => [...document.querySelectorAll('body *')].filter((el) => {
  const r = el.getBoundingClientRect();
  if (r.width === 0 || r.height === 0) return false;
  // skip what sits inside a box that clips it (scrolling tables, ellipsis text)
  for (let p = el.parentElement; p && p !== document.body; p = p.parentElement) {
    const o = getComputedStyle(p);
    if (o.overflowX !== 'visible' && p.getBoundingClientRect().right <= w + 0.5) return false;
  }
  return r.right > w + 0.5;
}).slice(0, 10).map((el) => {
  const right = Math.round(el.getBoundingClientRect().right);
  return `${el.tagName.toLowerCase()}.${el.className}#${el.dataset.testid ?? ''} right=${right}`;
})"""

# Three animation frames: the canvases are redrawn after a resize.
_FRAMES = "() => new Promise((done) => { let n = 3; const f = () => (n-- ? requestAnimationFrame(f) : done()); f(); })"


def _box(page: Page, test_id: str) -> dict:
    box = page.get_by_test_id(test_id).bounding_box()
    assert box is not None, f"{test_id} is not rendered"
    return box


def _watch(page: Page) -> list[str]:
    """Console errors and failed requests (a successful stream cancelled by the client included)."""
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console: {m.text}") if m.type == "error" else None)
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.method} {r.url} {r.failure}"))
    return problems


def test_compare_has_the_main_area_with_readable_menus(page: Page) -> None:
    problems = _watch(page)
    assert page.viewport_size == VIEWPORT
    # The dashboard is the main area's first view; Compare is its second, not a sidebar tab.
    expect(page.get_by_test_id("tab-dashboard")).to_have_attribute("aria-selected", "true")
    expect(page.get_by_role("tablist", name="Playground tools")).not_to_contain_text("Compare")
    page.get_by_test_id("tab-compare").click()
    panel = page.get_by_test_id("compare-panel")
    expect(panel).to_be_visible()
    expect(page.get_by_test_id("timeline-panel")).to_be_hidden()
    expect(page.get_by_test_id("chat-input")).to_be_visible()  # the chat stays beside it
    assert page.locator("main").get_by_test_id("compare-panel").count() == 1
    assert _box(page, "compare-panel")["width"] > 900, _box(page, "compare-panel")

    page.get_by_test_id("compare-count").select_option("4")
    expect(page.get_by_test_id("compare-column-3")).to_be_visible()
    selects = [f"compare-{name}-{col}" for col in range(4) for name in ("preset", "structured-mode")]
    fits = page.evaluate(_SELECT_FIT, selects)
    for f in fits:
        assert not f["overflow"], f
        assert f["widest"] <= f["room"], f"a menu's label is cut: {f}"
    columns = [_box(page, f"compare-column-{col}") for col in range(4)]
    assert all(c["width"] > 200 for c in columns), columns
    assert len({round(c["y"]) for c in columns}) == 1, f"the 4 columns are not side by side: {columns}"

    # One short run of all four at once (the 4th is beam search), to see the outputs in their columns.
    page.get_by_test_id("compare-input").fill("Name a colour.")
    page.get_by_test_id("compare-max-tokens").fill("8")
    page.get_by_test_id("compare-run").click()
    expect(page.get_by_test_id("compare-run")).to_be_visible(timeout=120_000)
    for col in range(4):
        expect(page.get_by_test_id(f"compare-column-{col}").get_by_role("alert")).to_have_count(0)
        expect(page.get_by_test_id(f"compare-stats-{col}")).to_be_visible()
        assert (page.get_by_test_id(f"compare-output-{col}").text_content() or "").strip(), col
    shot(page, "layout-compare.png")

    # Show in timeline goes back to the dashboard, on that request; the comparison is kept.
    page.get_by_test_id("compare-column-0").get_by_role("button", name="Show in timeline").click()
    expect(page.get_by_test_id("tab-dashboard")).to_have_attribute("aria-selected", "true")
    expect(page.get_by_test_id("timeline-panel")).to_be_visible()
    expect(panel).to_be_hidden()
    expect(page.get_by_test_id("request-detail-id")).not_to_be_empty()
    page.get_by_test_id("tab-compare").click()
    assert (page.get_by_test_id("compare-output-0").text_content() or "").strip()
    assert not problems, problems


@pytest.fixture
def phone(browser: Browser, server: str, engine: dict) -> Iterator[Page]:
    """The dashboard in a phone-sized, touch, high-density context, live and with the engine snapshot."""
    ctx = browser.new_context(base_url=server, viewport=PHONE, device_scale_factor=2, is_mobile=True, has_touch=True)
    ctx.add_init_script(INIT_SCRIPT)
    pg = ctx.new_page()
    problems = _watch(pg)
    pg.on("pageerror", lambda e: problems.append(f"uncaught: {e}"))
    pg.goto("/")
    expect(pg.get_by_test_id("connection-badge")).to_have_attribute("data-status", "live")
    expect(pg.get_by_test_id("heatmap-summary")).to_contain_text(f"blocks={engine['num_blocks']} ")
    yield pg
    ctx.close()
    assert not problems, problems


def _whole_page_shot(page: Page, name: str, max_height: int = 6000) -> None:
    """A screenshot of the whole scrolling page. Offscreen panels are not painted (content-visibility,
    and canvases drawn only in view), so the viewport is made as tall as the page for the shot."""
    size = page.viewport_size
    assert size is not None
    height = page.evaluate("() => document.documentElement.scrollHeight")
    page.set_viewport_size({"width": size["width"], "height": min(max_height, height)})
    page.evaluate(_FRAMES)
    try:
        shot(page, name)
    finally:
        page.set_viewport_size(size)


def _no_sideways_scroll(page: Page) -> None:
    width = page.evaluate("() => document.documentElement.scrollWidth")
    culprits = [] if width <= PHONE["width"] else page.evaluate(_OVERFLOWING, PHONE["width"])
    assert width <= PHONE["width"], f"the page scrolls sideways ({width} px): {culprits}"


def test_phone_layout(phone: Page) -> None:
    page = phone
    # The header wraps: the Live/Replay switch keeps its words, inside the screen. (Squeezed, the
    # switch clipped its buttons away and showed an empty pill: the buttons' own boxes stayed whole.)
    switch = page.get_by_role("group", name="View")
    sw = switch.bounding_box()
    assert sw is not None and sw["x"] >= 0 and sw["x"] + sw["width"] <= PHONE["width"], sw
    assert switch.evaluate("(g) => g.scrollWidth <= g.clientWidth"), f"the switch clips its buttons: {sw}"
    for tid, label in (("mode-live", "Live"), ("mode-replay", "Replay")):
        button = page.get_by_test_id(tid)
        expect(button).to_be_visible()
        expect(button).to_have_text(label)
        box = _box(page, tid)
        assert sw["x"] <= box["x"] and box["x"] + box["width"] <= sw["x"] + sw["width"] + 0.5, (tid, box, sw)
        assert button.evaluate("(b) => b.scrollWidth <= b.clientWidth && b.clientWidth > 20"), f"{tid} is squeezed"
    for tid in ("connection-badge", "theme-toggle", "record-start"):
        box = _box(page, tid)
        assert 0 <= box["x"] and box["x"] + box["width"] <= PHONE["width"], (tid, box)

    # Chat tab: the chat at the full width, no dashboard under it.
    expect(page.get_by_test_id("pane-chat")).to_have_attribute("aria-selected", "true")
    expect(page.get_by_test_id("chat-input")).to_be_visible()
    expect(page.get_by_test_id("timeline-panel")).to_be_hidden()
    assert _box(page, "chat-input")["width"] >= PHONE["width"] - 40, _box(page, "chat-input")
    chat = _box(page, "chat-panel")
    assert chat["height"] >= 0.6 * PHONE["height"] and chat["y"] + chat["height"] <= PHONE["height"] + 1, (
        f"the chat does not fill the screen under the tabs: {chat}"
    )
    # one scroll for the page: neither half is a scroll box of its own
    overflow = page.evaluate("""() => ['aside.sidebar', 'main.main', '[data-testid="chat-messages"]']
        .map((s) => getComputedStyle(document.querySelector(s)).overflowY)""")
    assert overflow == ["visible"] * 3, overflow
    set_decoding(page, preset="greedy", max_tokens=12)
    page.locator("details.decoding-details > summary").click()  # fold the settings again
    send_chat(page, "Say hello in French.")
    expect(page.get_by_test_id("message-assistant").last).to_have_attribute("data-status", "done", timeout=90_000)
    expect(page.get_by_test_id("chat-send")).to_be_in_viewport()  # the composer stays in reach
    _no_sideways_scroll(page)
    shot(page, "layout-phone-chat.png")

    # Dashboard tab: the panels at the full width, the chat gone; the page itself scrolls to the end.
    page.get_by_test_id("pane-dashboard").click()
    expect(page.get_by_test_id("pane-dashboard")).to_have_attribute("aria-selected", "true")
    expect(page.get_by_test_id("timeline-panel")).to_be_visible()
    expect(page.get_by_test_id("chat-input")).to_be_hidden()
    assert _box(page, "timeline-panel")["width"] >= PHONE["width"] - 30, _box(page, "timeline-panel")
    _no_sideways_scroll(page)
    scroll = page.evaluate("() => ({ height: document.documentElement.scrollHeight, view: innerHeight })")
    assert scroll["height"] > 2 * scroll["view"], f"the panels do not scroll with the page: {scroll}"
    expect(page.get_by_test_id("pane-dashboard")).to_be_in_viewport()
    _whole_page_shot(page, "layout-phone-dashboard.png")
    page.evaluate("() => window.scrollTo(0, document.documentElement.scrollHeight)")
    expect(page.get_by_test_id("pane-dashboard")).to_be_in_viewport()  # the tabs stay at the top
    page.get_by_test_id("pane-chat").click()
    expect(page.get_by_test_id("chat-input")).to_be_visible()
    expect(page.get_by_test_id("message-assistant")).to_have_count(1)  # the conversation was kept
