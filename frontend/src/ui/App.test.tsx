// @vitest-environment jsdom
// Smoke test of the whole shell in jsdom: the live socket (faked) feeds the recorded session and the
// panels' DOM (lists, tables, text mirrors of the canvases, test ids) shows it.
import { act, cleanup, fireEvent, render, screen } from "@testing-library/react";
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { App, findRequest } from "./App";
import { loadSession } from "../test/fixture";

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

  it("maps chat ids to engine requests", () => {
    expect(findRequest(["abc", "def"], ["def"])).toBe("def");
    expect(findRequest(["abc-0", "x"], ["chatcmpl-zzz", "abc"])).toBe("abc-0");
    expect(findRequest(["x"], ["y"])).toBeNull();
  });
});
