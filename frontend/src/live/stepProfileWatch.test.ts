import { afterEach, describe, expect, it, vi } from "vitest";
import { DashboardStore } from "./store";
import { LiveConnection, type SocketLike } from "./socket";

class SendingSocket implements SocketLike {
  onopen: ((ev: unknown) => void) | null = null;
  onmessage: ((ev: { data: unknown }) => void) | null = null;
  onclose: ((ev: unknown) => void) | null = null;
  onerror: ((ev: unknown) => void) | null = null;
  readonly sent: unknown[] = [];
  close(): void {}
  send(data: string): void {
    this.sent.push(JSON.parse(data));
  }
}

describe("LiveConnection.watchStepProfile", () => {
  afterEach(() => vi.useRealTimers());

  it("tells the server when the panel opens and closes, and again after a reconnect", () => {
    vi.useFakeTimers();
    const sockets: SendingSocket[] = [];
    const conn = new LiveConnection(new DashboardStore(), () => {
      const s = new SendingSocket();
      sockets.push(s);
      return s;
    }, () => "ws://x/ws/events");
    conn.start();
    conn.watchStepProfile(true); // before the socket opened: said on open
    expect(sockets[0]!.sent).toEqual([]);
    sockets[0]!.onopen?.({});
    expect(sockets[0]!.sent).toEqual([{ type: "step_profile", on: true }]);
    conn.watchStepProfile(true); // no change: nothing sent
    conn.watchStepProfile(false);
    conn.watchStepProfile(true);
    expect(sockets[0]!.sent).toEqual([
      { type: "step_profile", on: true },
      { type: "step_profile", on: false },
      { type: "step_profile", on: true },
    ]);
    sockets[0]!.onclose?.({});
    vi.advanceTimersByTime(10_000);
    sockets[1]!.onopen?.({});
    expect(sockets[1]!.sent).toEqual([{ type: "step_profile", on: true }]);
    conn.stop();
  });

  it("says nothing on open while the panel is closed", () => {
    const sockets: SendingSocket[] = [];
    const conn = new LiveConnection(new DashboardStore(), () => {
      const s = new SendingSocket();
      sockets.push(s);
      return s;
    }, () => "ws://x/ws/events");
    conn.start();
    sockets[0]!.onopen?.({});
    expect(sockets[0]!.sent).toEqual([]);
    conn.stop();
  });
});
