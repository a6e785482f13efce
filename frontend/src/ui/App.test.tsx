// @vitest-environment jsdom
// Smoke test of the whole shell in jsdom: the live socket (faked) feeds the recorded session and the
// panels' DOM (lists, tables, text mirrors of the canvases, test ids) shows it.
import { act, cleanup, fireEvent, render, screen } from "@testing-library/react";
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { App, findRequest } from "./App";
import { loadSession, loadSpecSession, specSessionRaw } from "../test/fixture";
import { fakeMedia } from "../test/matchMedia";
import { NARROW_QUERY } from "./useMediaQuery";

class FakeWebSocket {
  static last: FakeWebSocket | null = null;
  onopen: ((ev: unknown) => void) | null = null;
  onmessage: ((ev: { data: unknown }) => void) | null = null;
  onclose: ((ev: unknown) => void) | null = null;
  onerror: ((ev: unknown) => void) | null = null;
  constructor(readonly url: string) {
    FakeWebSocket.last = this;
  }
  close(): void {}
  deliver(msg: unknown): void {
    this.onmessage?.({ data: JSON.stringify(msg) });
  }
}

const frame = () => new Promise((r) => setTimeout(r, 120));
const nativeScrollIntoView = Element.prototype.scrollIntoView;

/** A one-chunk streamed reply from engine request `requestId`. */
function sse(text: string, requestId: string): Response {
  const chunk = { id: `chatcmpl-${requestId}`, choices: [{ index: 0, delta: { content: text }, logprobs: null, finish_reason: "stop" }] };
  return new Response(`data: ${JSON.stringify(chunk)}\n\ndata: [DONE]\n\n`, {
    headers: { "Content-Type": "text/event-stream", "X-Request-Id": requestId },
  });
}

// hidden itself or inside a hidden ancestor (jsdom applies no stylesheet, so the attribute is what counts)
const isHidden = (el: HTMLElement | null): boolean => el !== null && (el.hidden !== false || isHidden(el.parentElement));

describe("App", () => {
  beforeEach(() => {
    vi.stubGlobal("WebSocket", FakeWebSocket);
    vi.stubGlobal("fetch", vi.fn(async (url: string) => {
      if (url === "/v1/models") return new Response(JSON.stringify({ data: [{ id: "tiny", max_model_len: 2048 }] }));
      if (url === "/api/recordings/status") return new Response(JSON.stringify({ recording: null }));
      if (url === "/api/config") return new Response(JSON.stringify(loadSession().header.snapshot.config));
      return new Response("{}", { status: 404 });
    }));
    HTMLCanvasElement.prototype.getContext = (() => null) as never;
  });
  afterEach(() => {
    cleanup();
    vi.unstubAllGlobals();
    Element.prototype.scrollIntoView = nativeScrollIntoView;
  });

  it("shows the live session in every panel's DOM", async () => {
    const session = loadSession();
    render(<App />);
    for (const id of ["chat-input", "chat-send", "connection-badge", "timeline-canvas", "timeline-summary", "heatmap-summary", "record-start", "mode-replay", "theme-toggle"]) {
      expect(screen.getByTestId(id)).toBeTruthy();
    }
    expect(screen.getByTestId("timeline-empty")).toBeTruthy();
    const ws = FakeWebSocket.last!;
    expect(ws.url).toMatch(/\/ws\/events$/);
    await act(async () => {
      ws.onopen?.({});
      ws.deliver(session.header.snapshot);
      ws.deliver({ type: "events", events: session.events });
      await frame();
      await frame();
    });
    expect(screen.getByTestId("connection-badge").dataset.status).toBe("live");
    expect(screen.getByTestId("heatmap-canvas")).toBeTruthy();
    expect(screen.getByTestId("heatmap-summary").textContent).toMatch(/^blocks=12 used=0 shared=0 cached=\d+ free=\d+/);
    expect(screen.getByTestId("timeline-summary").textContent).toContain("e ABORTED [WAITING,ABORTED]");
    expect(screen.getAllByTestId("scheduler-step-row").length).toBe(11);
    expect(screen.getByTestId("engine-model").textContent).toContain("random:tiny");
    // a recording from before quantization: no weight sizes, so the header names just the precision
    expect(screen.getByTestId("engine-precision").textContent).toBe("float32");
    expect(screen.getByTestId("engine-speculative").textContent).toBe("spec off");
    // select a request from the accessible list mirror of the timeline
    await act(async () => {
      fireEvent.click(screen.getByTestId("request-row-c"));
      await frame();
    });
    expect(screen.getByTestId("request-detail-id").textContent).toBe("c");
    expect(screen.getByTestId("request-row-c").getAttribute("aria-pressed")).toBe("true");
    // the replay viewer's controls exist and start disabled
    await act(async () => {
      fireEvent.click(screen.getByTestId("mode-replay"));
      await frame();
    });
    expect((screen.getByTestId("replay-play") as HTMLButtonElement).disabled).toBe(true);
    expect(screen.getByTestId("replay-open")).toBeTruthy();
    expect(screen.getByTestId("connection-badge").textContent).toContain("viewing replay");
  });

  it("shows a speculative session live and in the replay viewer: header, timeline, metrics, scheduler, tokens", async () => {
    const spec = loadSpecSession();
    render(<App />);
    const ws = FakeWebSocket.last!;
    await act(async () => {
      ws.onopen?.({});
      ws.deliver(spec.header.snapshot);
      await frame();
    });
    expect(screen.getByTestId("engine-speculative").textContent).toBe("spec draft_model: k=3");
    expect(screen.getByTestId("engine-speculative").getAttribute("title")).toContain("draft_model: k=3, draft random:tiny (auto)");
    await act(async () => {
      fireEvent.click(screen.getByTestId("mode-replay"));
      await frame();
    });
    const file = new File([specSessionRaw()], "spec_session.jsonl", { type: "application/x-ndjson" });
    Object.defineProperty(file, "text", { value: async () => specSessionRaw() }); // jsdom's File has no text()
    await act(async () => {
      fireEvent.change(screen.getByTestId("replay-open"), { target: { files: [file] } });
      await frame();
    });
    await act(async () => {
      fireEvent.change(screen.getByTestId("replay-scrub"), { target: { value: "1000" } });
      await frame();
      await frame();
    });
    expect(screen.getByTestId("replay-position").dataset.position).toBe(String(spec.events.length));
    expect(screen.getByTestId("replay-verified").textContent).toBe(" ✓ consistent"); // folding it gives its footer
    const verifies = spec.events.filter((e) => e.type === "spec_verified");
    const summary = screen.getByTestId("timeline-verify-summary").textContent!.split("\n");
    expect(summary.reduce((n, line) => n + Number(/verifies=(\d+)/.exec(line)![1]), 0)).toBe(verifies.length);
    expect(screen.getByTestId("timeline-legend-verify")).toBeTruthy();
    expect(screen.getByTestId("metrics-spec").dataset.state).toBe("on");
    expect(screen.getByTestId("metric-spec-drafts").textContent).toBe(String(verifies.length));
    expect(screen.getAllByTestId("scheduler-verify-count").length).toBeGreaterThan(0);
    // the request detail marks the accepted drafts in its text
    await act(async () => {
      fireEvent.click(screen.getByTestId("request-row-r0"));
      await frame();
    });
    expect(screen.getByTestId("request-detail-spec").textContent).toMatch(/% · \d\.\d\d \/ verify$/);
    const drafted = screen.getAllByTestId("engine-token").filter((t) => t.dataset.drafted === "true");
    const accepted = verifies.reduce((n, e) => n + (e.type === "spec_verified" && e.request_id === "r0" ? e.accepted : 0), 0);
    expect(drafted.length).toBe(accepted);
  });

  it("shows Compare in the main area instead of the dashboard, and Show in timeline goes back", async () => {
    const session = loadSession();
    const answers = ["c", "d"]; // requests of the recorded session, so Show in timeline finds them
    const base = vi.mocked(fetch).getMockImplementation()!;
    vi.stubGlobal("fetch", vi.fn(async (url: string, init?: RequestInit) =>
      url === "/v1/chat/completions" ? sse("hello", answers.shift() ?? "none") : base(url, init)));
    const scrolled = vi.fn();
    Element.prototype.scrollIntoView = scrolled; // jsdom has none; the App calls it optionally
    render(<App />);
    const ws = FakeWebSocket.last!;
    await act(async () => {
      ws.onopen?.({});
      ws.deliver(session.header.snapshot);
      ws.deliver({ type: "events", events: session.events });
      await frame();
    });
    // the playground no longer holds Compare: the main area's view tabs do
    expect(screen.getByRole("tablist", { name: "Playground tools" }).textContent).not.toContain("Compare");
    expect(screen.getByTestId("compare-panel").closest("main")).toBeTruthy();
    expect(isHidden(screen.getByTestId("compare-panel"))).toBe(true);
    fireEvent.click(screen.getByTestId("tab-compare"));
    expect(isHidden(screen.getByTestId("compare-panel"))).toBe(false);
    expect(isHidden(screen.getByTestId("timeline-panel"))).toBe(true);
    expect(isHidden(screen.getByTestId("chat-panel"))).toBe(false); // the chat stays beside it
    fireEvent.change(screen.getByTestId("compare-count"), { target: { value: "2" } });
    await act(async () => {
      fireEvent.click(screen.getByTestId("compare-run"));
      await frame();
    });
    expect(screen.getByTestId("compare-output-1").textContent).toBe("hello");
    // back to the dashboard from a column, with its request selected and the timeline scrolled to
    await act(async () => {
      fireEvent.click(screen.getByTestId("compare-column-1").querySelector("button")!);
      await frame();
    });
    expect(screen.getByTestId("tab-dashboard").getAttribute("aria-selected")).toBe("true");
    expect(isHidden(screen.getByTestId("timeline-panel"))).toBe(false);
    expect(isHidden(screen.getByTestId("compare-panel"))).toBe(true);
    expect(screen.getByTestId("request-detail-id").textContent).toBe("d");
    expect(scrolled).toHaveBeenCalledTimes(1);
    // the comparison is still there when Compare is shown again
    fireEvent.keyDown(screen.getByTestId("tab-dashboard"), { key: "ArrowRight" });
    expect(screen.getByTestId("compare-output-0").textContent).toBe("hello");
    expect(isHidden(screen.getByTestId("compare-panel"))).toBe(false);
  });

  it("on a phone shows the chat or the dashboard, one at a time, and both again when wide", async () => {
    const media = fakeMedia(390);
    vi.stubGlobal("matchMedia", media.matchMedia);
    render(<App />);
    await act(frame);
    const pane = (id: string) => screen.getByTestId(`pane-${id}`);
    expect(pane("chat").getAttribute("aria-selected")).toBe("true");
    expect(isHidden(screen.getByTestId("chat-input"))).toBe(false);
    expect(isHidden(screen.getByTestId("timeline-panel"))).toBe(true);
    fireEvent.click(pane("dashboard"));
    expect(isHidden(screen.getByTestId("chat-input"))).toBe(true);
    expect(isHidden(screen.getByTestId("timeline-panel"))).toBe(false);
    expect(pane("dashboard").getAttribute("aria-controls")).toBe(screen.getByTestId("timeline-panel").closest("main")!.id);
    fireEvent.keyDown(pane("dashboard"), { key: "ArrowLeft" });
    expect(isHidden(screen.getByTestId("chat-input"))).toBe(false);
    expect(document.activeElement).toBe(pane("chat"));
    // turned to landscape / a wider window: no pane tabs, both halves shown
    act(() => media.resize(1024));
    expect(screen.queryByTestId("pane-chat")).toBeNull();
    expect(isHidden(screen.getByTestId("chat-input"))).toBe(false);
    expect(isHidden(screen.getByTestId("timeline-panel"))).toBe(false);
    expect(window.matchMedia(NARROW_QUERY).matches).toBe(false);
  });

  it("has no pane tabs at a desktop width", async () => {
    vi.stubGlobal("matchMedia", fakeMedia(1600).matchMedia);
    render(<App />);
    await act(frame);
    expect(screen.queryByTestId("pane-chat")).toBeNull();
    expect(isHidden(screen.getByTestId("chat-input"))).toBe(false);
    expect(isHidden(screen.getByTestId("timeline-panel"))).toBe(false);
  });

  it("maps chat ids to engine requests", () => {
    expect(findRequest(["abc", "def"], ["def"])).toBe("def");
    expect(findRequest(["abc-0", "x"], ["chatcmpl-zzz", "abc"])).toBe("abc-0");
    expect(findRequest(["x"], ["y"])).toBeNull();
  });
});
