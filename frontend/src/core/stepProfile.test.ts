import { describe, expect, it } from "vitest";
import { fromSnapshot, reduce } from "./dashboard";
import { ring } from "./ring";
import { chartTopMs, legendKeys, profileBar, profileBars, wallLine, wallOf, wallSummary, type ProfileBar } from "./stepProfile";
import type { StepFinished } from "./wire";
import { loadSession } from "../test/fixture";

function step(n: number, extra: Partial<StepFinished> = {}): StepFinished {
  return {
    type: "step_finished",
    step: n,
    duration_ms: 10,
    num_tokens: 1,
    num_generated: 1,
    schedule_ms: 0.5,
    forward_ms: 8,
    sample_ms: 1,
    postprocess_ms: 0.5,
    ...extra,
  };
}

const native = (n: number, memoryFloor: number, computeFloor = 0.2): StepFinished =>
  step(n, {
    profile_source: "native",
    profile_parts_ms: { schedule: 0.5, sample: 1, products: 5, attention: 1, kv_store: 0.5, norms_act: 0.5, layers_other: 0.2, outside_layers: 0.8, postprocess: 0.5 },
    memory_floor_ms: memoryFloor,
    compute_floor_ms: computeFloor,
  });

describe("profileBar", () => {
  it("stacks a native profile's parts in drawing order, with its floors", () => {
    const bar = profileBar(native(3, 6));
    expect(bar.source).toBe("native");
    expect(bar.parts.map((p) => p.key)).toEqual(["products", "attention", "kv_store", "norms_act", "layers_other", "outside_layers", "schedule", "sample", "postprocess"]);
    expect(bar.parts.reduce((a, p) => a + p.ms, 0)).toBeCloseTo(10, 9);
    expect([bar.memoryFloorMs, bar.computeFloorMs]).toEqual([6, 0.2]);
  });

  it("shows a step without a profile as its four phases and no floor", () => {
    const bar = profileBar(step(1, { memory_floor_ms: 3 }));
    expect(bar.source).toBe("phases");
    expect(bar.parts).toEqual([
      { key: "forward", ms: 8 },
      { key: "schedule", ms: 0.5 },
      { key: "sample", ms: 1 },
      { key: "postprocess", ms: 0.5 },
    ]);
    expect(bar.memoryFloorMs).toBe(0);
  });

  it("clamps bad numbers to zero and keeps unknown parts last", () => {
    const bar = profileBar(step(1, { profile_source: "coarse", profile_parts_ms: { mystery: 2, forward: -1, schedule: Number.NaN } }));
    expect(bar.parts).toEqual([
      { key: "forward", ms: 0 },
      { key: "schedule", ms: 0 },
      { key: "mystery", ms: 2 },
    ]);
  });
});

describe("walls", () => {
  const bar = (duration: number, memory: number, compute: number): ProfileBar => ({ step: 1, durationMs: duration, source: "native", parts: [], memoryFloorMs: memory, computeFloorMs: compute });

  it("names the wall by the bigger floor once it is at least half the step", () => {
    expect(wallOf(bar(10, 6, 1))).toBe("memory-bound");
    expect(wallOf(bar(10, 1, 7))).toBe("compute-bound");
    expect(wallOf(bar(10, 4, 3))).toBe("overhead-bound");
    expect(wallOf(bar(0, 0, 0))).toBe("overhead-bound");
  });

  it("summarises the latest steps by their majority wall and median efficiency", () => {
    const bars = [bar(10, 1, 0.1), bar(10, 6, 0.1), bar(8, 6, 0.1), bar(12, 6, 0.1)];
    const s = wallSummary(bars, 3)!;
    expect(s.wall).toBe("memory-bound");
    expect(s.steps).toBe(3);
    expect(s.stepMs).toBe(10);
    expect(s.efficiency).toBeCloseTo(0.6, 9);
    expect(wallLine(s)).toBe("Latest 3 steps: memory-bound, 60% efficient (floor 6.00 ms / step 10.00 ms; native part clocks)");
  });

  it("has no summary without floors", () => {
    expect(wallSummary([profileBar(step(1))])).toBeNull();
    expect(wallLine(null)).toMatch(/No floors yet/);
  });

  it("sizes the chart to the tallest bar or floor", () => {
    expect(chartTopMs([bar(10, 12, 0)])).toBeCloseTo(13.2, 9);
    expect(chartTopMs([])).toBe(1);
  });
});

describe("through the dashboard's reducer", () => {
  it("folds live profiled steps into bars", () => {
    const snap = loadSession().header.snapshot;
    const events = [native(1, 6), native(2, 7)].map((e, i) => ({ ...e, seq: snap.seq + 1 + i, ts: snap.ts + i }));
    const state = reduce(fromSnapshot(snap), events);
    const bars = profileBars(state.stepTimes, 60);
    expect(bars.map((b) => [b.step, b.source, b.memoryFloorMs])).toEqual([
      [1, "native", 6],
      [2, "native", 7],
    ]);
    expect(wallSummary(bars)!.wall).toBe("memory-bound");
  });

  it("replays a recording without profiles as phase bars", () => {
    const session = loadSession();
    const state = reduce(fromSnapshot(session.header.snapshot), session.events);
    const bars = profileBars(state.stepTimes, 60);
    expect(bars.length).toBeGreaterThan(5);
    expect(bars.every((b) => b.source === "phases" && b.parts.length === 4)).toBe(true);
    expect(legendKeys(bars)).toEqual(["forward", "schedule", "sample", "postprocess"]);
  });

  it("keeps only the newest bars", () => {
    const bars = profileBars(ring(100, [step(1), step(2), step(3)]), 2);
    expect(bars.map((b) => b.step)).toEqual([2, 3]);
  });
});
