"""Helpers for the e2e tests: reading the dashboard's DOM mirrors, driving the chat, and the
init script every page gets (summary parsers for in-page waits, and a WebSocket wrapper that lets
a test drop the live connection and hold it down)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import httpx
from playwright.sync_api import Locator, Page, expect

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "artifacts" / "e2e"

CHAT_PATH = "/v1/chat/completions"

INIT_SCRIPT = r"""
(() => {
  // Every WebSocket the app opens, and a switch that makes new ones fail (the connection drops
  // and stays down until the test lets it back).
  const Native = window.WebSocket;
  const hook = { sockets: [], blocked: false };
  class TestWebSocket extends Native {
    constructor(url, protocols) {
      if (hook.blocked) throw new Error("WebSocket blocked by the e2e test");
      super(url, protocols);
      hook.sockets.push(this);
    }
  }
  window.WebSocket = TestWebSocket;

  const text = (id) => document.querySelector(`[data-testid="${id}"]`)?.textContent ?? "";
  window.__e2e = {
    ws: hook,
    dropSocket() {
      const s = hook.sockets[hook.sockets.length - 1];
      if (s) s.close();
      return hook.sockets.length;
    },
    // "id STATE [SEG,SEG,...] ticks=N" per line
    timeline() {
      const out = {};
      for (const line of text("timeline-summary").split("\n")) {
        const m = /^(\S+) (\S+) \[([^\]]*)\] ticks=(\d+)$/.exec(line.trim());
        if (m) out[m[1]] = { state: m[2], segments: m[3] ? m[3].split(",") : [], ticks: Number(m[4]) };
      }
      return out;
    },
    // "blocks=N used=U shared=S cached=C free=F; per-request id:k id:k"
    heatmap() {
      const t = text("heatmap-summary");
      const m = /blocks=(\d+) used=(\d+) shared=(\d+) cached=(\d+) free=(\d+)/.exec(t);
      if (!m) return null;
      const per = {};
      const i = t.indexOf("; per-request ");
      if (i >= 0) {
        for (const kv of t.slice(i + "; per-request ".length).trim().split(/\s+/)) {
          const j = kv.lastIndexOf(":");
          if (j > 0) per[kv.slice(0, j)] = Number(kv.slice(j + 1));
        }
      }
      return { blocks: +m[1], used: +m[2], shared: +m[3], cached: +m[4], free: +m[5], per };
    },
  };
})();
"""

_LINE = re.compile(r"^(\S+) (\S+) \[([^\]]*)\] ticks=(\d+)$")
_HEAT = re.compile(r"blocks=(\d+) used=(\d+) shared=(\d+) cached=(\d+) free=(\d+)")


@dataclass(frozen=True)
class Row:
    state: str
    segments: tuple[str, ...]
    ticks: int


def timeline(page: Page) -> dict[str, Row]:
    """The timeline summary: request id -> current state, segment states, prefill chunk ticks."""
    out: dict[str, Row] = {}
    for line in (page.get_by_test_id("timeline-summary").text_content() or "").splitlines():
        m = _LINE.match(line.strip())
        if m:
            out[m[1]] = Row(m[2], tuple(m[3].split(",")) if m[3] else (), int(m[4]))
    return out


def heatmap(page: Page) -> dict:
    text = page.get_by_test_id("heatmap-summary").text_content() or ""
    m = _HEAT.search(text)
    assert m, f"unexpected heatmap summary: {text!r}"
    per: dict[str, int] = {}
    if "; per-request " in text:
        for kv in text.split("; per-request ", 1)[1].split():
            rid, _, k = kv.rpartition(":")
            per[rid] = int(k)
    keys = ("blocks", "used", "shared", "cached", "free")
    return {**dict(zip(keys, map(int, m.groups()))), "per": per}


def wait_js(page: Page, predicate: str, arg: object = None, timeout_ms: float = 60_000) -> object:
    """Waits (checked every animation frame) until `predicate(arg)` is truthy in the page; returns it.
    For states that last only a moment (a request's blocks while it runs), which a polling
    assertion could step over."""
    return page.wait_for_function(predicate, arg=arg, polling="raf", timeout=timeout_ms).json_value()


def wait_owns_blocks(page: Page, rid: str, timeout_ms: float = 60_000) -> dict:
    """Waits until the heatmap shows blocks held by request `rid`; returns the heatmap summary then."""
    return wait_js(
        page, "(id) => { const h = window.__e2e.heatmap(); return h && h.per[id] > 0 ? h : false; }", rid, timeout_ms
    )


def wait_idle(page: Page, rid: str = "", timeout_ms: float = 60_000) -> dict:
    """Waits until no block is in use (and `rid` holds none); returns the heatmap summary then."""
    return wait_js(
        page,
        "(id) => { const h = window.__e2e.heatmap(); return h && h.used === 0 && !(id in h.per) ? h : false; }",
        rid,
        timeout_ms,
    )


def wait_finished(page: Page, rid: str, state: str | tuple[str, ...] = "FINISHED", timeout_ms: float = 90_000) -> Row:
    """Waits until request `rid` is in `state` (or any of several: the caller then checks which)."""
    states = [state] if isinstance(state, str) else list(state)
    wait_js(page, "([id, s]) => s.includes(window.__e2e.timeline()[id]?.state)", [rid, states], timeout_ms)
    return timeline(page)[rid]


def open_decoding(page: Page) -> Locator:
    controls = page.get_by_test_id("decoding-controls")
    if not controls.is_visible():
        page.locator("details.decoding-details > summary").click()
    expect(controls).to_be_visible()
    return controls


def set_decoding(
    page: Page, preset: str | None = None, max_tokens: int | None = None, seed: int | None | str = "keep"
) -> None:
    open_decoding(page)
    if preset is not None:
        page.get_by_test_id(f"preset-{preset}").click()
        expect(page.get_by_test_id(f"preset-{preset}")).to_have_attribute("aria-pressed", "true")
    if max_tokens is not None:
        page.get_by_test_id("decoding-max-tokens").fill(str(max_tokens))
        expect(page.get_by_test_id("decoding-max-tokens")).to_have_value(str(max_tokens))
    if seed != "keep":
        page.get_by_test_id("decoding-seed").fill("" if seed is None else str(seed))


def set_structured(page: Page, mode: str, text: str | None = None) -> None:
    """Picks a structured-output mode in the decoding settings (none, json_object, json_schema, regex,
    choice, grammar) and, when given, types that mode's text (the schema, the regex, the choices)."""
    open_decoding(page)
    page.get_by_test_id("structured-mode").select_option(mode)
    expect(page.get_by_test_id("structured-controls")).to_have_attribute("data-mode", mode)
    editor = {
        "json_schema": "structured-schema",
        "regex": "structured-regex",
        "choice": "structured-choices",
        "grammar": "structured-grammar",
    }.get(mode)
    if text is not None:
        assert editor is not None, f"structured mode {mode} has no text"
        page.get_by_test_id(editor).fill(text)


def set_token_view(page: Page, on: bool) -> None:
    """Turns the chat's token view on or off (through its label, as a user would)."""
    box = page.get_by_test_id("chat-token-view")
    if box.is_checked() != on:
        page.locator("label.toggle", has=box).click()
    expect(box).to_be_checked(checked=on)


def _is_chat(response) -> bool:
    return response.url.endswith(CHAT_PATH) and response.request.method == "POST"


def send_chat(page: Page, text: str) -> str:
    """Types a message, sends it, and returns the engine's request id (the X-Request-Id header,
    which arrives with the streaming response's headers)."""
    page.get_by_test_id("chat-input").fill(text)
    with page.expect_response(_is_chat) as info:
        page.get_by_test_id("chat-send").click()
    rid = info.value.header_value("x-request-id")
    assert rid, "the chat response has no X-Request-Id"
    return rid


def regenerate(page: Page) -> str:
    with page.expect_response(_is_chat) as info:
        page.get_by_test_id("message-regenerate").click()
    rid = info.value.header_value("x-request-id")
    assert rid
    return rid


def last_reply(page: Page) -> Locator:
    return page.get_by_test_id("message-assistant").last


def reply_text(page: Page, timeout_ms: float = 90_000) -> str:
    """Waits for the last assistant message to finish and returns its text."""
    msg = last_reply(page)
    expect(msg).to_have_attribute("data-status", "done", timeout=timeout_ms)
    return msg.get_by_test_id("message-content").text_content() or ""


def api_chat(api: httpx.Client, body: dict) -> tuple[str, dict]:
    """A non-streaming chat completion with `body`; returns (engine request id, response JSON)."""
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    r = api.post(CHAT_PATH, json=body)
    assert r.status_code == 200, r.text
    return r.headers["x-request-id"], r.json()


def shot(target: Page | Locator, name: str, **kw) -> Path:
    """Saves a screenshot under artifacts/e2e/."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    target.screenshot(path=str(path), **kw)
    return path


def _frames(page: Page, n: int = 3) -> None:
    """Waits for `n` animation frames (the frame loop redraws the canvases after a resize)."""
    page.evaluate(
        "(n) => new Promise((done) => {"
        " const f = (k) => (k ? requestAnimationFrame(() => f(k - 1)) : done()); f(n); })",
        n,
    )


def dashboard_shot(page: Page, name: str, max_height: int = 3200) -> Path:
    """The whole dashboard in one picture: the panels scroll inside `main`, so the viewport is made
    tall enough to hold them all for the screenshot, then put back."""
    size = page.viewport_size
    assert size is not None
    page.evaluate("() => document.querySelector('main.main')?.scrollTo(0, 0)")
    extra = page.evaluate(
        "() => { const m = document.querySelector('main.main'); return m ? m.scrollHeight - m.clientHeight : 0; }"
    )
    page.set_viewport_size({"width": size["width"], "height": min(max_height, size["height"] + max(0, int(extra)))})
    _frames(page)
    try:
        return shot(page, name)
    finally:
        page.set_viewport_size(size)
        _frames(page)
