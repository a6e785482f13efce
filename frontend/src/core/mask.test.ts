import { describe, expect, it } from "vitest";
import { allowedAttr, fmtShare, maskLevel, maskShade, maskTitle } from "./mask";

describe("grammar-mask shading", () => {
  it("is 0 when everything was allowed and grows (log scale) as fewer tokens were", () => {
    expect(maskLevel(1)).toBe(0);
    expect(maskLevel(0.1)).toBeCloseTo(0.2);
    expect(maskLevel(1e-3)).toBeCloseTo(0.6);
    expect(maskLevel(1e-5)).toBe(1);
    expect(maskLevel(1e-9)).toBe(1); // clamped
    expect(maskLevel(0)).toBe(1);
    expect(maskLevel(1.5)).toBe(0);
    const levels = [1, 0.5, 0.1, 0.01, 1e-3, 1e-4, 2e-5].map(maskLevel);
    expect(levels).toEqual([...levels].sort((a, b) => a - b));
  });

  it("draws no hatching at level 0, denser ink for fewer allowed tokens, per theme", () => {
    expect(maskShade(1, false)).toBeNull();
    const alpha = (s: string | null) => Number(/\/ ([\d.]+)\)/.exec(s ?? "")?.[1]);
    expect(alpha(maskShade(1e-4, false))).toBeGreaterThan(alpha(maskShade(0.1, false)));
    expect(maskShade(0.01, false)).toContain("rgb(0 0 0 /");
    expect(maskShade(0.01, true)).toContain("rgb(255 255 255 /");
    // light, even where the grammar allowed a single token, so that constrained text stays readable
    expect(alpha(maskShade(1e-9, false))).toBeLessThanOrEqual(0.22);
    expect(alpha(maskShade(0.5, true))).toBeGreaterThan(0);
  });

  it("says the share of the vocabulary, with a token count when the vocabulary size is known", () => {
    expect(fmtShare(1)).toBe("100%");
    expect(fmtShare(0.035)).toBe("3.5%");
    expect(fmtShare(0.01)).toBe("1%");
    expect(fmtShare(0.0002)).toBe("0.02%");
    expect(fmtShare(2.0345e-5)).toBe("0.002%");
    expect(maskTitle(0.0002)).toBe("grammar allowed 0.02% of the vocabulary");
    expect(maskTitle(0.0002, 49152)).toBe("grammar allowed 0.02% of the vocabulary (≈10 tokens)");
    expect(maskTitle(1e-9, 49152)).toBe("grammar allowed 0.0000001% of the vocabulary (≈1 token)");
    expect(allowedAttr(0.000203451)).toBe("0.0002035");
  });
});
