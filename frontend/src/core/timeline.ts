// Timeline (Gantt) geometry and text, independent of any canvas.
import type { DashboardState, RequestTimeline, Segment, SegmentState } from "./dashboard";

export function timelineEnd(t: RequestTimeline): number {
  const last = t.segments[t.segments.length - 1];
  if (last === undefined) return Infinity;
  return last.end ?? Infinity;
}

/** Timelines that overlap [t0, t1], in arrival order. */
export function visibleTimelines(state: DashboardState, t0: number, t1: number): RequestTimeline[] {
  const rows: RequestTimeline[] = [];
  for (const t of state.timelines.values()) {
    if (t.arrival_ts <= t1 && timelineEnd(t) >= t0) rows.push(t);
  }
  return rows;
}

export function currentSegmentState(t: RequestTimeline): SegmentState | null {
  return t.segments[t.segments.length - 1]?.state ?? null;
}

/** The segment under time `ts` (terminal marks win within `slack` seconds). */
export function segmentAt(t: RequestTimeline, ts: number, now: number, slack = 0): Segment | undefined {
  for (let i = t.segments.length - 1; i >= 0; i--) {
    const s = t.segments[i]!;
    const end = s.end ?? now;
    if (s.start === end) {
      if (Math.abs(ts - s.start) <= slack) return s;
    } else if (ts >= s.start && ts <= end) {
      return s;
    }
  }
  return undefined;
}

/** One line per request: id, current state and its segment states, for the DOM mirror. */
export function timelineSummaryText(rows: readonly RequestTimeline[]): string {
  return rows
    .map((t) => `${t.request_id} ${currentSegmentState(t) ?? "-"} [${t.segments.map((s) => s.state).join(",")}] ticks=${t.ticks.length}`)
    .join("\n");
}

/** Maps engine time to x over [t0, t1] -> [x0, x1]. */
export function timeScale(t0: number, t1: number, x0: number, x1: number): (t: number) => number {
  const k = (x1 - x0) / Math.max(1e-9, t1 - t0);
  return (t) => x0 + (t - t0) * k;
}
