// @vitest-environment jsdom
import { cleanup, render, screen } from "@testing-library/react";
import { afterEach, describe, expect, it } from "vitest";
import { config } from "../../test/events";
import { SpeculativeSection } from "./SpeculativeSection";

describe("SpeculativeSection", () => {
  afterEach(cleanup);

  it("shows the server's speculative setup, read-only", () => {
    render(<SpeculativeSection config={{ ...config(), speculative: "ngram: k=4, n-gram 2-4, off at >= 4 requests" }} />);
    expect(screen.getByTestId("settings-speculative").textContent).toBe("ngram: k=4, n-gram 2-4, off at >= 4 requests");
    expect(screen.getByTestId("settings-speculative").dataset.state).toBe("on");
    const section = screen.getByRole("region", { name: /speculative decoding/i });
    expect(section.textContent).toContain("--speculative-config");
    expect(section.querySelector("input, select, button")).toBeNull();
  });

  it("says off when the engine has none (null, or a recording from before the field)", () => {
    render(<SpeculativeSection config={{ ...config(), speculative: null }} />);
    expect(screen.getByTestId("settings-speculative").textContent).toBe("off");
    cleanup();
    render(<SpeculativeSection config={config()} />);
    expect(screen.getByTestId("settings-speculative").textContent).toBe("off");
    expect(screen.getByTestId("settings-speculative").dataset.state).toBe("off");
  });
});
