// @vitest-environment jsdom
// Compare mode with a constrained and a free strategy side by side.
import { act, cleanup, fireEvent, render, screen } from "@testing-library/react";
import { afterEach, describe, expect, it, vi } from "vitest";
import { ComparePanel } from "./ComparePanel";

const frame = () => new Promise((r) => setTimeout(r, 60));

function sse(text: string): Response {
  const chunk = { id: "chatcmpl-c", choices: [{ index: 0, delta: { content: text }, logprobs: null, finish_reason: "stop" }] };
  return new Response(`data: ${JSON.stringify(chunk)}\n\ndata: [DONE]\n\n`, { headers: { "Content-Type": "text/event-stream" } });
}

describe("ComparePanel with structured output", () => {
  afterEach(() => {
    cleanup();
    vi.unstubAllGlobals();
  });

  it("each strategy has its own structured-output setting; only the constrained one sends it", async () => {
    const fetchMock = vi.fn(async (_path: string, init: RequestInit) => {
      const body = JSON.parse(init.body as string) as { structured_outputs?: unknown };
      return sse(body.structured_outputs ? "yes" : "free text");
    });
    vi.stubGlobal("fetch", fetchMock);
    render(<ComparePanel model="tiny" onShowRequest={() => true} />);
    fireEvent.change(screen.getByTestId("compare-count"), { target: { value: "2" } });
    fireEvent.change(screen.getByTestId("compare-structured-mode-0"), { target: { value: "choice" } });
    fireEvent.change(screen.getByTestId("compare-structured-choices-0"), { target: { value: "yes\nno" } });
    expect(screen.getByTestId("compare-column-0").textContent).toContain("greedy · choices: yes | no");
    await act(async () => {
      fireEvent.click(screen.getByTestId("compare-run"));
      await frame();
      await frame();
    });
    const bodies = fetchMock.mock.calls.map(([, init]) => JSON.parse(init.body as string) as Record<string, unknown>);
    expect(bodies).toHaveLength(2);
    expect(bodies[0]!.structured_outputs).toEqual({ choice: ["yes", "no"] });
    expect(bodies[1]).not.toHaveProperty("structured_outputs");
    expect(screen.getByTestId("compare-output-0").textContent).toBe("yes");
    expect(screen.getByTestId("compare-output-1").textContent).toBe("free text");
  });

  it("a preset change keeps the setting; an invalid one or one under beam search blocks the run", () => {
    vi.stubGlobal("fetch", vi.fn());
    render(<ComparePanel model="tiny" onShowRequest={() => true} />);
    fireEvent.change(screen.getByTestId("compare-structured-mode-1"), { target: { value: "json_schema" } });
    fireEvent.change(screen.getByTestId("compare-structured-schema-1"), { target: { value: "{" } });
    expect(screen.getByTestId("compare-structured-error-1").textContent).toMatch(/not valid JSON/);
    expect((screen.getByTestId("compare-run") as HTMLButtonElement).disabled).toBe(true);
    fireEvent.change(screen.getByTestId("compare-structured-schema-1"), { target: { value: "{}" } });
    expect((screen.getByTestId("compare-run") as HTMLButtonElement).disabled).toBe(false);
    fireEvent.change(screen.getByTestId("compare-preset-1"), { target: { value: "creative" } });
    expect((screen.getByTestId("compare-structured-mode-1") as HTMLSelectElement).value).toBe("json_schema");
    fireEvent.change(screen.getByTestId("compare-preset-1"), { target: { value: "beam" } });
    expect(screen.getByTestId("compare-structured-beam-1")).toBeTruthy();
    expect((screen.getByTestId("compare-run") as HTMLButtonElement).disabled).toBe(true);
  });

  it("hands the column count to the stylesheet for both grids (strategies and outputs)", () => {
    vi.stubGlobal("fetch", vi.fn());
    render(<ComparePanel model="tiny" onShowRequest={() => true} />);
    const grids = () => [screen.getByTestId("compare-strategy-0").parentElement!, screen.getByTestId("compare-columns")];
    expect(grids().map((g) => g.style.getPropertyValue("--compare-columns"))).toEqual(["3", "3"]);
    fireEvent.change(screen.getByTestId("compare-count"), { target: { value: "4" } });
    expect(grids().map((g) => g.style.getPropertyValue("--compare-columns"))).toEqual(["4", "4"]);
    expect(screen.getByTestId("compare-columns").children).toHaveLength(4);
    expect(screen.getByTestId("compare-preset-3")).toBeTruthy();
  });
});
