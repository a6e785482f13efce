// Replay: the state at any position of a recording, by folding from the nearest checkpoint.
// Position p means "the first p events applied". Checkpoints are taken every `interval` events as
// they are first needed, so seeking anywhere costs at most `interval` event applications after the
// first pass.
import { fromSnapshot, reduce, type DashboardState } from "./dashboard";
import type { Recording } from "./recording";

export class ReplayIndex {
  readonly length: number;
  readonly startTs: number;
  readonly endTs: number;
  private readonly checkpoints: DashboardState[];
  /** Indexes of the StepScheduled events, for stepping by engine step. */
  readonly stepPositions: readonly number[];

  constructor(
    readonly recording: Recording,
    readonly interval = 256,
  ) {
    const events = recording.events;
    this.length = events.length;
    this.checkpoints = [fromSnapshot(recording.header.snapshot)];
    this.startTs = recording.header.snapshot.ts;
    this.endTs = events.length > 0 ? Math.max(this.startTs, events[events.length - 1]!.ts ?? 0) : this.startTs;
    const steps: number[] = [];
    events.forEach((e, i) => {
      if (e.type === "step_scheduled") steps.push(i);
    });
    this.stepPositions = steps;
  }

  /** Engine time after the first `position` events. */
  tsAt(position: number): number {
    if (position <= 0) return this.startTs;
    return this.recording.events[Math.min(position, this.length) - 1]!.ts ?? this.startTs;
  }

  /** The largest position whose time is <= ts (every event at or before ts applied). */
  positionAt(ts: number): number {
    const events = this.recording.events;
    let lo = 0;
    let hi = events.length; // answer in [0, length]
    while (lo < hi) {
      const mid = (lo + hi + 1) >> 1;
      if ((events[mid - 1]!.ts ?? 0) <= ts) lo = mid;
      else hi = mid - 1;
    }
    return lo;
  }

  /** The next (+1) or previous (-1) step boundary: a position just before a StepScheduled event,
   * i.e. with the previous engine step complete. The ends of the recording are boundaries too. */
  stepFrom(position: number, direction: 1 | -1): number {
    if (direction > 0) {
      const next = this.stepPositions.find((i) => i > position);
      return next ?? this.length;
    }
    let previous = 0;
    for (const i of this.stepPositions) {
      if (i >= position) break;
      previous = i;
    }
    return previous;
  }

  stateAt(position: number): DashboardState {
    const p = Math.max(0, Math.min(this.length, Math.floor(position)));
    const k = Math.floor(p / this.interval);
    const events = this.recording.events;
    while (this.checkpoints.length <= k) {
      const i = this.checkpoints.length;
      const prev = this.checkpoints[i - 1]!;
      this.checkpoints.push(reduce(prev, events.slice((i - 1) * this.interval, i * this.interval)));
    }
    const base = this.checkpoints[k]!;
    return reduce(base, events.slice(k * this.interval, p));
  }

  get checkpointCount(): number {
    return this.checkpoints.length;
  }
}

/** Whether folding the recording gives its footer (the engine's own final snapshot): requests by id
 * (finished ones may have aged out of the engine's history) and blocks exactly. */
export function verifyRecording(index: ReplayIndex): { ok: boolean; detail: string } | null {
  const footer = index.recording.footer;
  if (footer === null) return null;
  const folded = index.stateAt(index.length).engine;
  const want = footer.snapshot;
  if (folded.seq !== want.seq) return { ok: false, detail: `sequence ${folded.seq} ≠ ${want.seq}` };
  for (const r of want.requests) {
    const got = folded.requests.get(r.request_id);
    if (got === undefined) return { ok: false, detail: `request ${r.request_id} missing` };
    if (got.state !== r.state || got.output_tokens !== (r.output_tokens ?? 0) || got.seqs.length !== (r.seqs ?? []).length) {
      return { ok: false, detail: `request ${r.request_id} differs` };
    }
  }
  if (folded.blocks.length !== want.blocks.length) return { ok: false, detail: "block count differs" };
  for (let i = 0; i < want.blocks.length; i++) {
    const a = folded.blocks[i]!;
    const b = want.blocks[i]!;
    if (a.ref_count !== b.ref_count || a.block_hash !== b.block_hash) return { ok: false, detail: `block ${i} differs` };
  }
  return { ok: true, detail: "folding every event gives the engine's final snapshot" };
}
