import { describe, expect, it } from "vitest";
import { assignSlots, liveRequestColor, requestColor, requestHue, requestSlots, slotColor, UNADMITTED_COLOR, type LiveSpan } from "./color";
import type { RequestTimeline, Segment, SegmentState } from "./dashboard";

describe("request colours", () => {
  it("are deterministic and theme-specific", () => {
    expect(requestColor("req-1", false)).toBe(requestColor("req-1", false));
    expect(requestColor("req-1", true)).not.toBe(requestColor("req-1", false));
  });

  it("spread hues over the circle for similar ids (uuid-like and sequential)", () => {
    for (const ids of [
      Array.from({ length: 360 }, (_, i) => `req-${String(i).padStart(4, "0")}`),
      Array.from({ length: 360 }, (_, i) => ((i * 2654435761) >>> 0).toString(16).padStart(8, "0") + "b3e94147b17bf864711be15b"),
    ]) {
      const buckets = new Array<number>(12).fill(0);
      for (const id of ids) buckets[Math.floor(requestHue(id) / 30)]! += 1;
      // 30 expected per bucket; no bucket empty or hugely overfull
      for (const b of buckets) {
        expect(b).toBeGreaterThan(10);
        expect(b).toBeLessThan(60);
      }
    }
  });
});

describe("palette slots", () => {
  const span = (id: string, admit: number | null, release = Infinity, arrival = admit ?? 0): LiveSpan => ({ request_id: id, arrival_ts: arrival, admit, release });

  /** Every pair of overlapping spans with a slot has different slots. */
  function expectDistinctWhileLive(spans: LiveSpan[], slots: Map<string, number>) {
    for (const a of spans) {
      for (const b of spans) {
        if (a === b || a.admit === null || b.admit === null) continue;
        const overlap = a.admit < b.release && b.admit < a.release;
        const sa = slots.get(a.request_id)!;
        const sb = slots.get(b.request_id)!;
        if (overlap && sa >= 0 && sb >= 0) expect(sa, `${a.request_id} vs ${b.request_id}`).not.toBe(sb);
      }
    }
  }

  it("gives the lowest free slot at admission and reuses it once the holder finished", () => {
    const slots = assignSlots([span("a", 0, 5), span("b", 1, 3), span("c", 3.5), span("d", 6)]);
    expect(slots.get("a")).toBe(0);
    expect(slots.get("b")).toBe(1);
    expect(slots.get("c")).toBe(1); // b finished at 3
    expect(slots.get("d")).toBe(0); // a finished at 5
  });

  it("keeps a preempted request's slot: the request that took its blocks gets another", () => {
    // a is admitted, preempted at 2 by b (admitted at 1), re-admitted later: a is live throughout
    const timelines = new Map<string, RequestTimeline>([
      ["a", tl("a", 0, [["WAITING", 0], ["PREFILL", 0.1], ["DECODE", 0.5], ["PREEMPTED", 2], ["WAITING", 2], ["PREFILL", 4], ["DECODE", 4.2], ["FINISHED", 6]])],
      ["b", tl("b", 0.9, [["WAITING", 0.9], ["PREFILL", 1], ["DECODE", 1.5], ["FINISHED", 3]])],
      ["c", tl("c", 3.1, [["WAITING", 3.1], ["PREFILL", 3.2]])],
      ["w", tl("w", 3.3, [["WAITING", 3.3]])],
    ]);
    const slots = requestSlots(timelines);
    expect(slots.get("a")).toBe(0);
    expect(slots.get("b")).toBe(1);
    expect(slots.get("c")).toBe(1); // b gave its slot back at 3; a still holds 0
    expect(slots.has("w")).toBe(false);
    expect(liveRequestColor(timelines, "a", true)).toBe(slotColor(0, true));
    expect(liveRequestColor(timelines, "b", true)).not.toBe(liveRequestColor(timelines, "a", true));
    expect(liveRequestColor(timelines, "w", true)).toBe(UNADMITTED_COLOR);
    expect(liveRequestColor(timelines, "unknown-id", true)).toBe(requestColor("unknown-id", true));
  });

  it("never shares a slot between overlapping requests, on random loads", () => {
    let seed = 7;
    const rnd = () => ((seed = (Math.imul(seed, 1103515245) + 12345) >>> 0) / 4294967296);
    for (let trial = 0; trial < 50; trial++) {
      const spans: LiveSpan[] = [];
      for (let i = 0; i < 40; i++) {
        const admit = rnd() < 0.1 ? null : rnd() * 20;
        spans.push(span(`r${i}`, admit, admit === null ? Infinity : rnd() < 0.2 ? Infinity : admit + rnd() * 4));
      }
      const slots = assignSlots(spans, 6);
      expectDistinctWhileLive(spans, slots);
      // an overflow (-1) only when every slot was held at its admission
      for (const s of spans) {
        if (slots.get(s.request_id) !== -1) continue;
        const holders = spans.filter((o) => o !== s && slots.get(o.request_id)! >= 0 && o.admit !== null && o.admit <= s.admit! && o.release > s.admit!);
        expect(holders.length).toBeGreaterThanOrEqual(6);
      }
    }
  });

  it("falls back deterministically when more are live than there are slots", () => {
    const spans = Array.from({ length: 5 }, (_, i) => span(`r${i}`, i));
    const slots = assignSlots(spans, 3);
    expect([...slots.values()]).toEqual([0, 1, 2, -1, -1]);
    expect(assignSlots([...spans].reverse(), 3)).toEqual(slots); // input order does not matter
  });

  it("has distinct slot colours in both themes, past the palette too", () => {
    for (const dark of [false, true]) {
      const colors = new Set(Array.from({ length: 256 }, (_, i) => slotColor(i, dark)));
      expect(colors.size).toBe(256);
    }
  });

  it("gives every request live at once its own slot in the dashboard, however many (the stress page runs 64)", () => {
    const timelines = new Map(
      Array.from({ length: 64 }, (_, i) => [`r${i}`, tl(`r${i}`, 0, [["WAITING", 0], ["PREFILL", i / 100]])] as const),
    );
    const slots = requestSlots(timelines);
    expect(new Set(slots.values()).size).toBe(64);
    const colors = new Set([...timelines.keys()].map((id) => liveRequestColor(timelines, id, false)));
    expect(colors.size).toBe(64);
  });
});

function tl(id: string, arrival: number, states: [SegmentState, number][]): RequestTimeline {
  const segments: Segment[] = states.map(([state, start], i) => {
    const terminal = state === "FINISHED" || state === "ABORTED";
    return { state, start, end: terminal ? start : (states[i + 1]?.[1] ?? null), reason: "" };
  });
  return { request_id: id, arrival_ts: arrival, segments, ticks: [], verifies: [] };
}
