// Plays a recording into a store: play / pause / step / speed / seek. Sequential playback folds
// forward with the same reducer as the live view; jumps go through the ReplayIndex checkpoints.
import { reduce } from "../core/dashboard";
import type { Recording } from "../core/recording";
import { ReplayIndex } from "../core/replay";
import { frameLoop } from "./frameLoop";
import type { DashboardStore } from "./store";

export type ReplaySource = { kind: "server"; id: string } | { kind: "file"; name: string };

export interface ReplayInfo {
  loaded: boolean;
  name: string;
  source: ReplaySource | null;
  playing: boolean;
  speed: number;
  position: number;
  length: number;
  clockTs: number;
  startTs: number;
  endTs: number;
  step: number;
}

export const SPEEDS = [0.1, 0.25, 0.5, 1, 2, 4, 8, 16] as const;

const EMPTY: ReplayInfo = {
  loaded: false, name: "", source: null, playing: false, speed: 1, position: 0, length: 0,
  clockTs: 0, startTs: 0, endTs: 0, step: 0,
};

/** The controller playing into each store: lets a panel seek (a click on the timeline) without the
 * app threading the controller through every component. */
const controllers = new WeakMap<DashboardStore, ReplayController>();

/** The replay controller that feeds `store`, if it is a replay store. */
export function replayControllerOf(store: DashboardStore): ReplayController | undefined {
  return controllers.get(store);
}

export class ReplayController {
  private index: ReplayIndex | null = null;
  private position = 0;
  private clockTs = 0;
  private playing = false;
  private speed = 1;
  private source: ReplaySource | null = null;
  private lastFrame = 0;
  private lastNotify = 0;
  private info: ReplayInfo = EMPTY;
  private readonly listeners = new Set<() => void>();
  private detach: (() => void) | null = null;

  constructor(private readonly store: DashboardStore) {
    controllers.set(store, this);
  }

  subscribe = (fn: () => void): (() => void) => {
    this.listeners.add(fn);
    return () => this.listeners.delete(fn);
  };

  getInfo = (): ReplayInfo => this.info;

  get replayIndex(): ReplayIndex | null {
    return this.index;
  }

  load(recording: Recording, source: ReplaySource): void {
    this.index = new ReplayIndex(recording);
    this.source = source;
    this.playing = false;
    this.position = 0;
    this.clockTs = this.index.startTs;
    this.store.setState(this.index.stateAt(0), this.clockTs);
    this.detach ??= frameLoop.addTask(this.task);
    this.notify(true);
  }

  play(): void {
    if (this.index === null) return;
    if (this.position >= this.index.length) this.seekPosition(0);
    this.playing = true;
    this.lastFrame = 0;
    this.notify(true);
  }

  pause(): void {
    this.playing = false;
    this.notify(true);
  }

  toggle(): void {
    if (this.playing) this.pause();
    else this.play();
  }

  setSpeed(speed: number): void {
    this.speed = speed;
    this.notify(true);
  }

  /** Shows the state at engine time `ts` (every event up to it applied). */
  seekTs(ts: number): void {
    if (this.index === null) return;
    const clamped = Math.max(this.index.startTs, Math.min(this.index.endTs, ts));
    this.apply(this.index.positionAt(clamped), clamped);
    this.notify(true);
  }

  seekPosition(position: number): void {
    if (this.index === null) return;
    const p = Math.max(0, Math.min(this.index.length, position));
    this.apply(p, this.index.tsAt(p));
    this.notify(true);
  }

  /** Moves to the next / previous engine step boundary. */
  step(direction: 1 | -1): void {
    if (this.index === null) return;
    this.playing = false;
    this.seekPosition(this.index.stepFrom(this.position, direction));
  }

  private apply(position: number, clockTs: number): void {
    const index = this.index!;
    let state;
    if (position === this.position) {
      state = this.store.state;
    } else if (position > this.position && position - this.position <= index.interval * 4) {
      state = reduce(this.store.state, index.recording.events.slice(this.position, position));
    } else {
      state = index.stateAt(position);
    }
    this.position = position;
    this.clockTs = clockTs;
    this.store.setState(state, clockTs);
  }

  private readonly task = (now: number): void => {
    if (!this.playing || this.index === null) {
      this.lastFrame = now;
      return;
    }
    const dt = this.lastFrame === 0 ? 0 : Math.min(0.25, (now - this.lastFrame) / 1000);
    this.lastFrame = now;
    const ts = this.clockTs + dt * this.speed;
    if (ts >= this.index.endTs) {
      this.apply(this.index.length, this.index.endTs);
      this.playing = false;
      this.notify(true);
      return;
    }
    this.apply(this.index.positionAt(ts), ts);
    this.notify(false);
  };

  private notify(force: boolean): void {
    const now = performance.now();
    if (!force && now - this.lastNotify < 100) return;
    this.lastNotify = now;
    const index = this.index;
    this.info = index === null ? EMPTY : {
      loaded: true,
      name: index.recording.name,
      source: this.source,
      playing: this.playing,
      speed: this.speed,
      position: this.position,
      length: index.length,
      clockTs: this.clockTs,
      startTs: index.startTs,
      endTs: index.endTs,
      step: this.store.state.engine.step,
    };
    for (const fn of this.listeners) fn();
  }
}
