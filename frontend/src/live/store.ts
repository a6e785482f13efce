// A store holding one DashboardState. Sources (the WebSocket, the replay controller, the stress
// simulator) only buffer into it; the frame loop folds the buffer once per animation frame with the
// one reducer, draws the canvases, and tells React at a lower rate (UI_INTERVAL_MS).
import { emptySnapshot, fromSnapshot, reduce, type DashboardState } from "../core/dashboard";
import type { AnyEvent, Snapshot } from "../core/wire";

/** Beyond this many buffered events (a hidden tab, say), the store asks its source for a snapshot. */
export const MAX_PENDING = 200_000;

export class DashboardStore {
  private current: DashboardState;
  private ui: DashboardState;
  private pending: AnyEvent[] = [];
  private pendingSnapshot: Snapshot | null = null;
  private readonly listeners = new Set<() => void>();
  private anchorWall = performance.now();
  private anchorTs = 0;
  private fixedClock: number | null = null;
  /** Bumped on every state change (the frame loop compares it to decide what to redraw). */
  version = 0;
  private uiVersion = 0;
  /** Highest event sequence number received (buffered or folded): what `?since=` resumes from. */
  lastSeq = 0;
  /** Called when the buffer overflows; the source should resync. */
  onOverflow: (() => void) | null = null;
  hasSnapshot = false;

  constructor(initial?: DashboardState) {
    this.current = initial ?? fromSnapshot(emptySnapshot());
    this.ui = this.current;
    this.hasSnapshot = initial !== undefined;
  }

  get state(): DashboardState {
    return this.current;
  }

  push(events: readonly AnyEvent[]): void {
    if (events.length === 0) return;
    for (const e of events) {
      const seq = e.seq ?? 0;
      if (seq > this.lastSeq) this.lastSeq = seq;
    }
    const last = events[events.length - 1]!;
    this.anchorTs = last.ts ?? this.anchorTs;
    this.anchorWall = performance.now();
    for (const e of events) this.pending.push(e);
    if (this.pending.length > MAX_PENDING) {
      this.pending = [];
      this.onOverflow?.();
    }
  }

  /** A snapshot from the server: replaces the state at the next frame, keeping history when it can. */
  applySnapshot(snapshot: Snapshot): void {
    this.pendingSnapshot = snapshot;
    this.pending = this.pending.filter((e) => (e.seq ?? 0) > snapshot.seq);
    let last = snapshot.seq;
    for (const e of this.pending) last = Math.max(last, e.seq ?? 0);
    this.lastSeq = last;
    this.anchorTs = snapshot.ts;
    this.anchorWall = performance.now();
    this.hasSnapshot = true;
  }

  /** Replaces the state outright (replay), with the clock fixed at `clockTs`. */
  setState(state: DashboardState, clockTs: number): void {
    this.pending = [];
    this.pendingSnapshot = null;
    if (state !== this.current) {
      this.current = state;
      this.version++;
    }
    if (clockTs !== this.fixedClock) {
      this.fixedClock = clockTs;
      this.version++;
    }
    this.hasSnapshot = true;
  }

  /** Engine time "now": the replay position, or the live engine time extrapolated since the last event. */
  now(): number {
    if (this.fixedClock !== null) return this.fixedClock;
    return this.anchorTs + (performance.now() - this.anchorWall) / 1000;
  }

  get live(): boolean {
    return this.fixedClock === null;
  }

  /** Folds what is buffered; true when the state changed. Called once per frame. */
  flush(): boolean {
    if (this.pendingSnapshot === null && this.pending.length === 0) return false;
    let next = this.current;
    if (this.pendingSnapshot !== null) {
      const snap = this.pendingSnapshot;
      this.pendingSnapshot = null;
      // A snapshot older than our state means the server restarted: start over.
      const restarted = snap.seq < next.engine.seq || next.engine.config.model === "";
      next = fromSnapshot(snap, restarted ? undefined : next);
    }
    if (this.pending.length > 0) {
      const batch = this.pending;
      this.pending = [];
      next = reduce(next, batch);
    }
    if (next === this.current) return false;
    this.current = next;
    this.version++;
    return true;
  }

  /** Publishes the current state to React subscribers if it changed since the last publish. */
  publish(): void {
    if (this.uiVersion === this.version) return;
    this.uiVersion = this.version;
    this.ui = this.current;
    for (const fn of this.listeners) fn();
  }

  subscribe = (fn: () => void): (() => void) => {
    this.listeners.add(fn);
    return () => this.listeners.delete(fn);
  };

  getUiState = (): DashboardState => this.ui;

  /** Drops everything (back to the empty state). */
  reset(): void {
    this.current = fromSnapshot(emptySnapshot());
    this.pending = [];
    this.pendingSnapshot = null;
    this.lastSeq = 0;
    this.hasSnapshot = false;
    this.fixedClock = null;
    this.version++;
  }
}
