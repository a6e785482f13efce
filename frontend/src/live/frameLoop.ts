// The one requestAnimationFrame loop: fold buffered events, run frame tasks (replay playback),
// draw canvases, and publish to React at most every UI_INTERVAL_MS.
import type { DashboardStore } from "./store";

export const UI_INTERVAL_MS = 100;

export type FrameCallback = (now: number) => void;

export interface FrameStats {
  /** Frame-to-frame intervals (ms), newest last. */
  intervals: number[];
  /** Time spent inside the loop per frame (fold + draw), ms. */
  work: number[];
}

class FrameLoop {
  private readonly stores = new Set<DashboardStore>();
  private readonly tasks = new Set<FrameCallback>();
  private readonly drawers = new Set<FrameCallback>();
  private handle = 0;
  private lastUi = 0;
  private lastFrame = 0;
  readonly stats: FrameStats = { intervals: [], work: [] };
  recordStats = false;

  addStore(store: DashboardStore): () => void {
    this.stores.add(store);
    this.ensure();
    return () => this.stores.delete(store);
  }

  /** Runs before the fold (e.g. replay playback advancing its position). */
  addTask(fn: FrameCallback): () => void {
    this.tasks.add(fn);
    this.ensure();
    return () => this.tasks.delete(fn);
  }

  addDrawer(fn: FrameCallback): () => void {
    this.drawers.add(fn);
    this.ensure();
    return () => this.drawers.delete(fn);
  }

  private ensure(): void {
    if (this.handle === 0 && typeof requestAnimationFrame === "function") {
      this.handle = requestAnimationFrame(this.tick);
    }
  }

  private readonly tick = (now: number): void => {
    this.handle = 0;
    const t0 = performance.now();
    for (const fn of this.tasks) fn(now);
    for (const store of this.stores) store.flush();
    for (const fn of this.drawers) fn(now);
    if (now - this.lastUi >= UI_INTERVAL_MS) {
      this.lastUi = now;
      for (const store of this.stores) store.publish();
    }
    if (this.recordStats) {
      if (this.lastFrame > 0) push(this.stats.intervals, now - this.lastFrame);
      push(this.stats.work, performance.now() - t0);
    }
    this.lastFrame = now;
    if (this.stores.size + this.tasks.size + this.drawers.size > 0) this.ensure();
  };
}

function push(list: number[], v: number): void {
  list.push(v);
  if (list.length > 600) list.splice(0, list.length - 600);
}

export const frameLoop = new FrameLoop();
