import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { DashboardStore } from "./store";
import { backoffMs, LiveConnection, type SocketLike } from "./socket";
import { loadSession } from "../test/fixture";
import { stateToSnapshot } from "../core/fold";
import type { AnyEvent } from "../core/wire";

class FakeSocket implements SocketLike {
  onopen: ((ev: unknown) => void) | null = null;
  onmessage: ((ev: { data: unknown }) => void) | null = null;
  onclose: ((ev: unknown) => void) | null = null;
  onerror: ((ev: unknown) => void) | null = null;
  closed = false;
  constructor(readonly url: string) {}
  close(): void {
    this.closed = true;
  }
  send(msg: unknown): void {
    this.onmessage?.({ data: JSON.stringify(msg) });
  }
  drop(ev: unknown = {}): void {
    this.onclose?.(ev);
  }
}

describe("LiveConnection", () => {
  const session = loadSession();
  const events = session.events as AnyEvent[];
  let sockets: FakeSocket[];
  let store: DashboardStore;
  let conn: LiveConnection;

  beforeEach(() => {
    vi.useFakeTimers();
    sockets = [];
    store = new DashboardStore();
    conn = new LiveConnection(store, (url) => {
      const s = new FakeSocket(url);
      sockets.push(s);
      return s;
    }, (since) => (since === null ? "ws://x/ws/events" : `ws://x/ws/events?since=${since}`));
  });
  afterEach(() => {
    conn.stop();
    vi.useRealTimers();
  });

  it("folds snapshot then batches; resumes with ?since= after a drop; overlaps are ignored", () => {
    conn.start();
    expect(sockets[0]!.url).toBe("ws://x/ws/events");
    sockets[0]!.onopen?.({});
    expect(conn.info.status).toBe("live");
    sockets[0]!.send(session.header.snapshot);
    sockets[0]!.send({ type: "events", events: events.slice(0, 100) });
    store.flush();
    expect(store.state.engine.seq).toBe(events[99]!.seq);
    sockets[0]!.drop();
    expect(conn.info.status).toBe("reconnecting");
    vi.advanceTimersByTime(backoffMs(1, () => 1) + 1);
    expect(sockets[1]!.url).toBe(`ws://x/ws/events?since=${events[99]!.seq}`);
    sockets[1]!.onopen?.({});
    sockets[1]!.send({ type: "events", events: events.slice(90) }); // the server may overlap: harmless
    store.flush();
    const folded = stateToSnapshot(store.state.engine);
    const footer = session.footer!.snapshot;
    expect(folded.seq).toBe(footer.seq);
    expect(folded.blocks).toEqual(footer.blocks);
    expect(store.state.log.end - store.state.log.start).toBe(events.length);
  });

  it("shows the server's reason when it closes the stream (a missing key, too many clients)", () => {
    conn.start();
    sockets[0]!.drop({ code: 4401, reason: "missing API key" });
    expect(conn.info.detail).toBe("closed by the server (4401): missing API key");
    vi.advanceTimersByTime(backoffMs(1, () => 1) + 1);
    sockets[1]!.drop({ code: 1006, reason: "" });
    expect(conn.info.detail).toBe("connection closed");
  });

  it("a resync and fresh snapshot replace the engine state but keep history", () => {
    conn.start();
    sockets[0]!.send(session.header.snapshot);
    sockets[0]!.send({ type: "events", events: events.slice(0, 150) });
    store.flush();
    const timelines = store.state.timelines.size;
    sockets[0]!.send({ type: "resync", reason: "the client fell behind" });
    expect(conn.info.detail).toMatch(/fell behind/);
    sockets[0]!.send(session.footer!.snapshot);
    store.flush();
    expect(store.state.engine.seq).toBe(session.footer!.snapshot.seq);
    expect(store.state.timelines.size).toBe(timelines);
    expect(store.state.timelines.get("a")!.segments.map((s) => s.state)).toContain("DECODE");
  });

  it("a server restart (sequence numbers and engine time go back) starts over without since", () => {
    conn.start();
    sockets[0]!.send(session.header.snapshot);
    sockets[0]!.send({ type: "events", events });
    store.flush();
    const fresh = { ...session.header.snapshot, ts: 0.001 };
    // the restarted server's first events: low seq, low ts
    sockets[0]!.send({ type: "events", events: [{ ...events[0]!, seq: 1, ts: 0.0001 }] });
    expect(sockets[0]!.closed).toBe(true);
    expect(sockets[1]!.url).toBe("ws://x/ws/events");
    sockets[1]!.send(fresh);
    store.flush();
    expect(store.state.engine.seq).toBe(0);
    expect(store.state.engine.requests.size).toBe(0);
  });

  it("backs off exponentially with a cap, and reports offline after a few attempts", () => {
    expect(backoffMs(1, () => 0.5)).toBe(500);
    expect(backoffMs(3, () => 0.5)).toBe(2000);
    expect(backoffMs(20, () => 0.5)).toBe(8000);
    conn.start();
    for (let i = 0; i < 5; i++) {
      sockets[sockets.length - 1]!.drop();
      vi.advanceTimersByTime(10_000);
    }
    expect(sockets.length).toBe(6);
    expect(["offline", "reconnecting"]).toContain(conn.info.status);
    expect(conn.info.attempts).toBe(5);
  });
});
