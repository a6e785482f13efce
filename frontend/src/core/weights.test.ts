import { describe, expect, it } from "vitest";
import { fmtBytes } from "./format";
import { precisionName, shortPrecision, weightMemory, weightMemoryDetail, weightsSummary } from "./weights";

const MiB = 1024 * 1024;
const int4 = {
  dtype: "float32",
  quantization: "int4 g32 (embedding and LM head: int8)",
  weight_bytes: 97 * MiB,
  weight_fp32_bytes: 513 * MiB,
};

describe("weights formatting", () => {
  it("names the quantization, or the dtype when the weights are not quantized", () => {
    expect(precisionName(int4)).toBe("int4 g32 (embedding and LM head: int8)");
    expect(shortPrecision(int4)).toBe("int4 g32");
    expect(precisionName({ dtype: "bfloat16", quantization: "none" })).toBe("bfloat16");
    expect(shortPrecision({ dtype: "float32", quantization: "int8" })).toBe("int8");
    expect(precisionName({ dtype: "float32" })).toBe("float32"); // a recording from before quantization
    expect(precisionName({ dtype: "" })).toBe("none");
  });

  it("gives the weight memory with its ratio to fp32", () => {
    expect(weightMemory(int4)).toBe("97.0 MiB weights (19% of fp32)");
    expect(weightsSummary(int4)).toBe("int4 g32 · 97.0 MiB weights (19% of fp32)");
    expect(weightsSummary(int4, false)).toBe("int4 g32 (embedding and LM head: int8) · 97.0 MiB weights (19% of fp32)");
    expect(weightMemoryDetail(int4)).toBe("97.0 MiB, 19% of the 513.0 MiB they take in fp32");
    expect(weightsSummary({ dtype: "bfloat16", quantization: "none", weight_bytes: 256 * MiB, weight_fp32_bytes: 512 * MiB }))
      .toBe("bfloat16 · 256.0 MiB weights (50% of fp32)");
    expect(weightMemory({ dtype: "float32", weight_bytes: 2 * MiB })).toBe("2.0 MiB weights"); // no fp32 size: no ratio
  });

  it("shows just the precision name when the sizes are the defaults (old recordings)", () => {
    const old = { dtype: "float32", quantization: "none", weight_bytes: 0, weight_fp32_bytes: 0 };
    expect(weightMemory(old)).toBeNull();
    expect(weightMemoryDetail(old)).toBeNull();
    expect(weightsSummary(old)).toBe("float32");
    expect(weightsSummary({ dtype: "float32" })).toBe("float32");
  });

  it("formats bytes up to GiB", () => {
    expect(fmtBytes(512)).toBe("512 B");
    expect(fmtBytes(97 * MiB)).toBe("97.0 MiB");
    expect(fmtBytes(14.5 * 1024 * MiB)).toBe("14.50 GiB");
  });
});
