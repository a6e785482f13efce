import { describe, expect, it } from "vitest";
import { requestColor, requestHue } from "./color";

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
