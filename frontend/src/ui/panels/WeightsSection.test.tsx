// @vitest-environment jsdom
import { cleanup, render, screen } from "@testing-library/react";
import { afterEach, describe, expect, it } from "vitest";
import { config } from "../../test/events";
import { WeightsSection } from "./WeightsSection";

const KERNELS = [
  "int4 g32 [960x576] x30: rows <= 4: int4pack/fp32, more rows: int4pack/bf16",
  "int4 g32 [576x576] x30: all rows: int4pack/bf16",
  "int8 per-channel [49152x576] x1: all rows: int8pack/bf16",
];

describe("WeightsSection", () => {
  afterEach(cleanup);

  it("shows the precision, the memory against fp32 and one line per kernel choice", () => {
    render(<WeightsSection config={{
      ...config(),
      quantization: "int4 g32 (embedding and LM head: int8)",
      weight_bytes: 95 * 1024 * 1024,
      weight_fp32_bytes: 513 * 1024 * 1024,
      kernels: KERNELS,
      compilation: "compiled (inductor, decode steps; prefill chunks eager)",
    }} />);
    expect(screen.getByTestId("settings-precision").textContent).toBe("int4 g32 (embedding and LM head: int8)");
    expect(screen.getByTestId("settings-weight-memory").textContent).toBe("95.0 MiB, 19% of the 513.0 MiB they take in fp32");
    expect(screen.getByTestId("settings-compilation").textContent).toBe(
      "compiled (inductor, decode steps; prefill chunks eager)");
    expect(screen.getAllByTestId("settings-kernel").map((li) => li.textContent)).toEqual(KERNELS);
    expect(screen.getByRole("list", { name: /kernels chosen at load/i })).toBeTruthy();
    const section = screen.getByRole("region", { name: /weights/i });
    expect(section.textContent).toContain("fixed at load");
    expect(section.textContent).toContain("--quantization");
    expect(section.textContent).toContain("--enforce-eager");
    expect(section.querySelector("input, select, button")).toBeNull(); // read-only
  });

  it("shows just the precision for a recording made before quantization", () => {
    render(<WeightsSection config={config()} />);
    expect(screen.getByTestId("settings-precision").textContent).toBe("float32");
    expect(screen.queryByTestId("settings-weight-memory")).toBeNull();
    expect(screen.queryByTestId("settings-kernels")).toBeNull();
    expect(screen.queryByTestId("settings-compilation")).toBeNull();
  });
});
