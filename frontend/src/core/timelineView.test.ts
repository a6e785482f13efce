import { describe, expect, it } from "vitest";
import type { RequestTimeline, Segment } from "./dashboard";
import { ring } from "./ring";
import {
  MIN_SPAN_S, panView, preemptedFor, preemptedForFromSteps, preemptionArrows, promptWords, searchRows, timeAt, viewBounds,
  viewWindow, zoomView, type Window,
} from "./timelineView";
import type { StepScheduled } from "./wire";

const close = (got: readonly number[], want: readonly number[]) => got.forEach((g, i) => expect(g).toBeCloseTo(want[i]!, 9));

describe("zoom and pan", () => {
  const base: Window = [100, 130]; // a 30 s live window
  const bounds = viewBounds(base, 90); // data since t=90

  it("without a view shows the base window", () => {
    expect(viewWindow(base, null)).toEqual([100, 130]);
  });

  it("zooms in around the pointer's time, which stays under the pointer", () => {
    const v = zoomView(base, null, bounds, 106, 0.5);
    const w = viewWindow(base, v);
    close(w, [103, 118]);
    // the anchor keeps its relative position: 20% from the left before and after
    expect((106 - w[0]) / (w[1] - w[0])).toBeCloseTo(0.2, 9);
  });

  it("keeps following the base's right edge (live): the view is relative to it", () => {
    const v = zoomView(base, null, bounds, 130, 0.5);
    close(viewWindow(base, v), [115, 130]);
    close(viewWindow([101, 131], v), [116, 131]);
  });

  it("stops zooming in at MIN_SPAN_S and out at the data's extent, and comes back to the base", () => {
    let v = zoomView(base, null, bounds, 110, 1e-9);
    const [a, b] = viewWindow(base, v);
    expect(b - a).toBeCloseTo(MIN_SPAN_S, 9);
    v = zoomView(base, v, bounds, 110, 1e9);
    close(viewWindow(base, v), [90, 130]); // all the data, never beyond it
    // out from the base window on data no wider than it: back to no view at all
    expect(zoomView(base, null, viewBounds(base, 100), 110, 4)).toBeNull();
  });

  it("pans within the bounds", () => {
    const v = zoomView(base, null, bounds, 115, 0.5); // [107.5, 122.5]
    close(viewWindow(base, panView(base, v, bounds, -5)), [102.5, 117.5]);
    close(viewWindow(base, panView(base, v, bounds, -100)), [90, 105]); // stops at the data's start
    expect(panView(base, v, bounds, +100)).toEqual({ span: 15, endOffset: 0 }); // stops at the right edge, still zoomed
  });

  it("maps pixels to time", () => {
    expect(timeAt(0, 200, [10, 20])).toBe(10);
    expect(timeAt(50, 200, [10, 20])).toBe(12.5);
  });
});

describe("search", () => {
  it("finds rows by a part of their id, case-insensitively", () => {
    const ids = ["9f3a11cc", "load-1", "LOAD-2", "chat"];
    expect(searchRows(ids, "load")).toEqual([1, 2]);
    expect(searchRows(ids, " 9F3 ")).toEqual([0]);
    expect(searchRows(ids, "")).toEqual([]);
    expect(searchRows(ids, "zzz")).toEqual([]);
  });
});

function tl(id: string, segments: [Segment["state"], number, string?][]): RequestTimeline {
  return {
    request_id: id, arrival_ts: segments[0]![1], ticks: [], verifies: [],
    segments: segments.map(([state, start, reason], i) => ({ state, start, end: segments[i + 1]?.[1] ?? null, reason: reason ?? "" })),
  };
}

function step(ts: number, preempted: string[], scheduled: string[]): StepScheduled {
  return {
    type: "step_scheduled", ts, seq: 0, step: 1, prefill: [], decode: scheduled.map((id) => ({ request_id: id, seq_id: 0, start: 0, num_tokens: 1, num_draft: 0 })),
    budget_used: 0, budget: 0, num_running: 0, num_waiting: 0, preempted, queue_head: null, queue_head_reason: null,
  };
}

describe("preemption arrows", () => {
  it("reads the request a preemption was for from the scheduler's reason", () => {
    expect(preemptedFor("preempted: out of KV blocks (needed by 9f3a11cc0de)")).toBe("9f3a11cc0de");
    expect(preemptedFor("preempted: out of KV blocks")).toBeNull();
  });

  it("points from the preempted request to the one that needed its blocks", () => {
    const rows = [
      tl("a", [["DECODE", 1], ["PREEMPTED", 2, "preempted: out of KV blocks (needed by b)"], ["WAITING", 2]]),
      tl("b", [["DECODE", 1.5]]),
      tl("c", [["DECODE", 1], ["PREEMPTED", 3, "preempted: out of KV blocks (needed by c)"]]), // for itself: no arrow
      tl("d", [["DECODE", 1], ["PREEMPTED", 4, "preempted: out of KV blocks (needed by gone)"]]), // cause not shown
    ];
    expect(preemptionArrows(rows, ring(8), 0, 10)).toEqual([{ victim: "a", cause: "b", ts: 2 }]);
    expect(preemptionArrows(rows, ring(8), 2.5, 10)).toEqual([]); // outside the window
  });

  it("without a named cause, takes it from the step only when that step scheduled one other request", () => {
    const steps = ring(8, [step(1, [], ["a", "b"]), step(2.01, ["a"], ["b"]), step(3.01, ["x"], ["b", "c"])]);
    expect(preemptedForFromSteps(steps, "a", 2)).toBe("b");
    expect(preemptedForFromSteps(steps, "x", 3)).toBeNull(); // b or c: unknown, no guess
    const rows = [tl("a", [["DECODE", 1], ["PREEMPTED", 2, "preempted"]]), tl("b", [["DECODE", 1]])];
    expect(preemptionArrows(rows, steps, 0, 10)).toEqual([{ victim: "a", cause: "b", ts: 2 }]);
  });
});

describe("row labels", () => {
  it("take the prompt's first words without chat-template markup", () => {
    expect(promptWords("<|im_start|>user\nWhy is the sky blue?<|im_end|>")).toBe("Why is the sky blue?");
    expect(promptWords("<s>[INST] Write a haiku about a cache miss please [/INST]")).toBe("Write a haiku about a cache…");
    expect(promptWords("")).toBe("");
  });
});
