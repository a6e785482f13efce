import { describe, expect, it } from "vitest";
import { memoryView } from "./memory";

const MiB = 2 ** 20;

describe("memory split", () => {
  it("gives each measured part its bytes and share of the RSS, in a fixed order", () => {
    const view = memoryView({
      rss: 400 * MiB, weights: 100 * MiB, kv_cache: 20 * MiB, compiled: 0, torch: 80 * MiB, libraries: 40 * MiB,
      other: 160 * MiB, kv_reserved: 64 * MiB, clamped: false,
    });
    expect(view?.parts.map((p) => p.key)).toEqual(["weights", "kv_cache", "compiled", "torch", "libraries", "other"]);
    expect(view?.parts.map((p) => p.fraction)).toEqual([0.25, 0.05, 0, 0.2, 0.1, 0.4]);
    expect(view?.parts.reduce((s, p) => s + p.bytes, 0)).toBe(400 * MiB);
    expect(view?.kvReserved).toBe(64 * MiB);
    expect(view?.unknown).toEqual([]);
  });

  it("lists the parts a platform could not measure instead of showing zeros", () => {
    const view = memoryView({ rss: 300 * MiB, kv_reserved: 8 * MiB });
    expect(view?.parts).toEqual([]);
    expect(view?.unknown).toEqual(["Weights", "KV cache", "Compiled", "Torch", "Libraries", "Other"]);
  });

  it("carries the clamp flag, and has nothing to show without a split", () => {
    expect(memoryView({ rss: 10, weights: 12, other: 0, clamped: true })?.clamped).toBe(true);
    expect(memoryView(null)).toBeNull();
    expect(memoryView(undefined)).toBeNull();
    expect(memoryView({ rss: 0 })).toBeNull();
  });
});
