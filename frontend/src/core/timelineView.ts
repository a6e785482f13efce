// The timeline's interaction logic, free of the DOM: zoom / pan of the time window, search by request
// id, which request a preemption was for (the arrows), and the words a row is labelled with.
import type { RequestTimeline } from "./dashboard";
import type { Ring } from "./ring";
import type { StepScheduled } from "./wire";

/** A user's zoom / pan, relative to the base window's right edge: with the live view's window
 * moving with "now", a zoomed view keeps moving with it. null everywhere below: no zoom (the base). */
export interface TimeView {
  /** Seconds shown. */
  readonly span: number;
  /** Seconds between the shown window's right edge and the base window's. */
  readonly endOffset: number;
}

export type Window = readonly [number, number];

/** Narrowest zoom: 20 ms across the plot (a few engine steps). */
export const MIN_SPAN_S = 0.02;

/** The window shown: the base, or the user's view of it. */
export function viewWindow(base: Window, view: TimeView | null): [number, number] {
  if (view === null) return [base[0], base[1]];
  const end = base[1] - view.endOffset;
  return [end - view.span, end];
}

/** Puts [t0, t0 + span] inside `bounds` (the data's extent, never narrower than the base window). */
function clampWindow(t0: number, span: number, bounds: Window): [number, number] {
  const lo = bounds[0];
  const hi = bounds[1];
  if (span >= hi - lo) return [lo, lo + span];
  const start = Math.min(Math.max(t0, lo), hi - span);
  return [start, start + span];
}

function toView(base: Window, w: [number, number]): TimeView | null {
  const view = { span: w[1] - w[0], endOffset: base[1] - w[1] };
  const baseSpan = base[1] - base[0];
  // back at the base window (within rounding): drop the view, so that it follows the base again
  return Math.abs(view.span - baseSpan) < 1e-9 * Math.max(1, baseSpan) && Math.abs(view.endOffset) < 1e-9 * Math.max(1, baseSpan) ? null : view;
}

/** The bounds a view may move in: the base window joined with the data's extent [dataStart, base end]. */
export function viewBounds(base: Window, dataStart: number): Window {
  return [Math.min(base[0], dataStart), base[1]];
}

/**
 * Zooms by `factor` (> 1: out, < 1: in) keeping time `anchor` under the pointer. The span stays
 * between MIN_SPAN_S and the bounds' width (or the base span, if wider).
 */
export function zoomView(base: Window, view: TimeView | null, bounds: Window, anchor: number, factor: number): TimeView | null {
  const [a, b] = viewWindow(base, view);
  const span = b - a;
  const maxSpan = Math.max(bounds[1] - bounds[0], base[1] - base[0]);
  const next = Math.min(maxSpan, Math.max(MIN_SPAN_S, span * factor));
  const k = span > 0 ? (anchor - a) / span : 0;
  return toView(base, clampWindow(anchor - k * next, next, bounds));
}

/** Pans by `dt` seconds (> 0: later), inside the bounds. */
export function panView(base: Window, view: TimeView | null, bounds: Window, dt: number): TimeView | null {
  const [a, b] = viewWindow(base, view);
  return toView(base, clampWindow(a + dt, b - a, bounds));
}

/** Engine time at pixel `px` of a plot `width` wide showing [t0, t1]. */
export function timeAt(px: number, width: number, w: Window): number {
  return w[0] + (px / Math.max(1, width)) * (w[1] - w[0]);
}

/** Indexes of the rows whose request id contains `query` (case-insensitive); none for an empty query. */
export function searchRows(ids: readonly string[], query: string): number[] {
  const q = query.trim().toLowerCase();
  if (q === "") return [];
  const out: number[] = [];
  ids.forEach((id, i) => {
    if (id.toLowerCase().includes(q)) out.push(i);
  });
  return out;
}

/** A preemption: `victim` lost its blocks at `ts` to `cause` (the request that needed them). */
export interface PreemptionArrow {
  readonly victim: string;
  readonly cause: string;
  readonly ts: number;
}

const NEEDED_BY = /needed by ([^\s)]+)\)?\s*$/;

/** The request a preemption was for, from the state change's reason ("preempted: out of KV blocks
 * (needed by <id>)", the scheduler's wording); null when the reason does not name one. */
export function preemptedFor(reason: string): string | null {
  return NEEDED_BY.exec(reason)?.[1] ?? null;
}

/**
 * When the reason names no request (other wording, older recordings): the step that preempted
 * `victim` at `ts` (the first StepScheduled listing it, at or after `ts`: the step is published after
 * its state changes). The request that needed the blocks was scheduled in that step; only when that
 * step scheduled exactly one other request is it known which one, otherwise null (no arrow rather
 * than a guess).
 */
export function preemptedForFromSteps(steps: Ring<StepScheduled>, victim: string, ts: number): string | null {
  for (let j = steps.start; j < steps.end; j++) {
    const s = steps.buf[j]!;
    if ((s.ts ?? 0) < ts || !s.preempted.includes(victim)) continue;
    const others = new Set([...s.prefill, ...s.decode].map((c) => c.request_id).filter((id) => id !== victim && !s.preempted.includes(id)));
    return others.size === 1 ? [...others][0]! : null;
  }
  return null;
}

/** Arrows for the preemptions of `rows` within [t0, t1] whose cause is another request among `rows`. */
export function preemptionArrows(rows: readonly RequestTimeline[], steps: Ring<StepScheduled>, t0: number, t1: number): PreemptionArrow[] {
  const shown = new Set(rows.map((r) => r.request_id));
  const out: PreemptionArrow[] = [];
  for (const r of rows) {
    for (const s of r.segments) {
      if (s.state !== "PREEMPTED" || s.start < t0 || s.start > t1) continue;
      const cause = preemptedFor(s.reason) ?? preemptedForFromSteps(steps, r.request_id, s.start);
      // a request preempted for itself (the last one running) has no other request to point at
      if (cause !== null && cause !== r.request_id && shown.has(cause)) out.push({ victim: r.request_id, cause, ts: s.start });
    }
  }
  return out;
}

/** The first words of a prompt for a row label: chat-template markup (<|im_start|>, [INST], <s>)
 * and role names at line starts dropped. */
export function promptWords(preview: string, maxWords = 6): string {
  const text = preview
    .replace(/<\|[^|]*\|>|<\/?s>|\[\/?INST\]|<<\/?SYS>>/g, "\n")
    .replace(/^\s*(system|user|assistant)\s*:?\s*$/gim, "")
    .replace(/^\s*(system|user|assistant)\s*(:|\n)/gim, "");
  const words = text.split(/\s+/).filter((w) => w !== "");
  return words.slice(0, maxWords).join(" ") + (words.length > maxWords ? "…" : "");
}
