// The live event stream: GET /ws/events. The first message is a snapshot, then batches of events;
// `resync` announces a fresh snapshot. On a drop it reconnects with backoff and resumes with
// `?since=<last seq>`; the server replays what was missed or sends a snapshot.
import type { AnyEvent, WsMessage } from "../core/wire";
import { getApiKey } from "../api/client";
import type { DashboardStore } from "./store";

export type ConnectionStatus = "connecting" | "live" | "reconnecting" | "offline";

export interface ConnectionInfo {
  status: ConnectionStatus;
  attempts: number;
  /** Why the last resync or disconnect happened, for the badge's tooltip. */
  detail: string;
}

export interface SocketLike {
  onopen: ((ev: unknown) => void) | null;
  onmessage: ((ev: { data: unknown }) => void) | null;
  onclose: ((ev: unknown) => void) | null;
  onerror: ((ev: unknown) => void) | null;
  close(): void;
  send?(data: string): void;
}

export type SocketFactory = (url: string) => SocketLike;

let followedReplica: number | null = null;

/** With engine replicas (`--data-parallel-size`) the stream carries one replica's events: which
 *  one (null: the server's default, replica 0). A change takes effect on the next connect. */
export function followReplica(replica: number | null): void {
  followedReplica = replica;
}

export function eventsUrl(since: number | null, base: string = location.href): string {
  const url = new URL("/ws/events", base);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  if (since !== null && since > 0) url.searchParams.set("since", String(since));
  if (followedReplica !== null) url.searchParams.set("replica", String(followedReplica));
  const key = getApiKey();
  if (key) url.searchParams.set("api_key", key); // browsers cannot set headers on a WebSocket
  return url.toString();
}

/** What a close tells the user: the server's own reason (a missing key, too many clients) when it
 *  gave one, with its code. */
export function closeDetail(ev: unknown): string {
  const { code, reason } = (ev ?? {}) as { code?: number; reason?: string };
  return reason ? `closed by the server (${code ?? "?"}): ${reason}` : "connection closed";
}

/** Reconnect delay: 0.5 s doubling to 8 s, with jitter. */
export function backoffMs(attempt: number, random: () => number = Math.random): number {
  const base = Math.min(8000, 500 * Math.pow(2, Math.max(0, attempt - 1)));
  return Math.round(base * (0.75 + random() * 0.5));
}

export class LiveConnection {
  private socket: SocketLike | null = null;
  private timer: ReturnType<typeof setTimeout> | null = null;
  private stopped = true;
  private resumable = false;
  private lastTs = 0;
  private open = false;
  private stepProfile = false;
  info: ConnectionInfo = { status: "offline", attempts: 0, detail: "" };
  private readonly listeners = new Set<() => void>();

  constructor(
    private readonly store: DashboardStore,
    private readonly factory: SocketFactory = (url) => new WebSocket(url) as unknown as SocketLike,
    private readonly urlFor: (since: number | null) => string = (since) => eventsUrl(since),
  ) {
    store.onOverflow = () => this.restart("client fell behind");
  }

  subscribe = (fn: () => void): (() => void) => {
    this.listeners.add(fn);
    return () => this.listeners.delete(fn);
  };

  getInfo = (): ConnectionInfo => this.info;

  private set(patch: Partial<ConnectionInfo>): void {
    this.info = { ...this.info, ...patch };
    for (const fn of this.listeners) fn();
  }

  start(): void {
    if (!this.stopped) return;
    this.stopped = false;
    this.connect();
  }

  stop(): void {
    this.stopped = true;
    if (this.timer !== null) clearTimeout(this.timer);
    this.timer = null;
    const s = this.socket;
    this.socket = null;
    s?.close();
    this.set({ status: "offline", detail: "stopped" });
  }

  /** Drops the connection and reconnects without resuming (a fresh snapshot). */
  restart(reason: string): void {
    this.resumable = false;
    const s = this.socket;
    this.socket = null;
    s?.close();
    this.set({ detail: reason });
    if (!this.stopped) this.connect();
  }

  /** The step-profile panel opened (on) or closed: the server sends step profiles while it is on
   *  (`{"type": "step_profile"}`, server/events_ws.py); said again after each reconnect. */
  watchStepProfile = (on: boolean): void => {
    if (on === this.stepProfile) return;
    this.stepProfile = on;
    this.sendStepProfile();
  };

  private sendStepProfile(): void {
    if (!this.open) return; // said on open
    try {
      this.socket?.send?.(JSON.stringify({ type: "step_profile", on: this.stepProfile }));
    } catch {
      /* closing: the next connection says it again */
    }
  }

  private connect(): void {
    this.timer = null;
    this.open = false;
    const since = this.resumable && this.store.hasSnapshot ? this.store.lastSeq : null;
    this.set({ status: this.info.attempts > 0 ? "reconnecting" : "connecting" });
    let socket: SocketLike;
    try {
      socket = this.factory(this.urlFor(since));
    } catch (err) {
      this.scheduleReconnect(String(err));
      return;
    }
    this.socket = socket;
    socket.onopen = () => {
      if (this.socket !== socket) return;
      this.open = true;
      if (this.stepProfile) this.sendStepProfile();
      this.set({ status: "live", attempts: 0 });
    };
    socket.onmessage = (ev) => {
      if (this.socket !== socket) return;
      this.handle(ev.data);
    };
    socket.onerror = () => {
      /* onclose follows */
    };
    socket.onclose = (ev) => {
      if (this.socket !== socket) return;
      this.socket = null;
      this.open = false;
      this.scheduleReconnect(closeDetail(ev));
    };
  }

  private scheduleReconnect(detail: string): void {
    if (this.stopped) return;
    const attempts = this.info.attempts + 1;
    this.set({ status: attempts > 3 ? "offline" : "reconnecting", attempts, detail });
    this.timer = setTimeout(() => this.connect(), backoffMs(attempts));
  }

  /** Handles one message (exposed for tests). */
  handle(data: unknown): void {
    if (typeof data !== "string") return; // JSON only (msgpack is for other clients)
    let msg: WsMessage;
    try {
      msg = JSON.parse(data) as WsMessage;
    } catch {
      return;
    }
    switch (msg.type) {
      case "snapshot":
        this.store.applySnapshot(msg);
        this.resumable = true;
        this.lastTs = msg.ts;
        if (this.info.status !== "live") this.set({ status: "live", attempts: 0 });
        break;
      case "events":
        this.onEvents(msg.events);
        break;
      case "resync":
        this.set({ detail: `resync: ${msg.reason}` });
        break;
    }
  }

  private onEvents(events: AnyEvent[]): void {
    if (events.length === 0) return;
    const last = events[events.length - 1]!;
    const lastSeq = last.seq ?? 0;
    const lastTs = last.ts ?? 0;
    // Sequence numbers went back and engine time too: a restarted server. Start over.
    if (lastSeq <= this.store.lastSeq && lastTs + 0.5 < this.lastTs) {
      this.restart("server restarted");
      return;
    }
    this.lastTs = Math.max(this.lastTs, lastTs);
    this.store.push(events);
  }
}
