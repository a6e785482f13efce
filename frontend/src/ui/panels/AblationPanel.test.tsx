import { describe, expect, it } from "vitest";
import { ablationBars, progressLine, type AblationStatus } from "./AblationPanel";

const rows = [
  { config: "all on", tokens_per_s: 40, ratio_tokens_per_s: 1 },
  { config: "no KV cache", tokens_per_s: 10, ratio_tokens_per_s: 0.25 },
  { config: "+ n-gram speculation", tokens_per_s: 50, ratio_tokens_per_s: 1.25 },
];

describe("ablationBars", () => {
  it("gives each row its ratio to all on and its length against the longest", () => {
    const bars = ablationBars(rows);
    expect(bars.map((b) => b.label)).toEqual(["all on", "no KV cache", "+ n-gram speculation"]);
    expect(bars.map((b) => b.ratio)).toEqual([1, 0.25, 1.25]);
    expect(bars.map((b) => b.fraction)).toEqual([0.8, 0.2, 1]);
  });

  it("draws nothing for no rows and zero-length bars for a zero baseline", () => {
    expect(ablationBars([])).toEqual([]);
    const bars = ablationBars([{ config: "all on", tokens_per_s: 0, ratio_tokens_per_s: null }]);
    expect(bars[0]).toMatchObject({ ratio: 0, fraction: 0 });
  });
});

describe("progressLine", () => {
  const base: AblationStatus = { state: "running", done: 2, total: 8, current: "static batching", result: null, error: null };
  it("names the configuration running and its place", () => {
    expect(progressLine(base)).toBe("running 3/8: static batching");
    expect(progressLine({ ...base, total: 0 })).toBe("starting…");
  });
  it("says why a run failed", () => {
    expect(progressLine({ ...base, state: "failed", error: "boom" })).toBe("failed: boom");
  });
});
