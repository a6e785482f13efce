// @vitest-environment jsdom
import { cleanup, fireEvent, render, screen, within } from "@testing-library/react";
import { afterEach, describe, expect, it } from "vitest";
import type { TokenEntry } from "../../core/dashboard";
import type { TokenView } from "../../core/openai";
import type { SpecVerified } from "../../core/wire";
import { EngineTokenText, TokenText } from "./TokenText";

const verify: SpecVerified = { type: "spec_verified", request_id: "r", seq_id: 0, step: 5, method: "ngram", proposed: [11, 12, 13], accepted: 2, token_id: 20 };
const view = (text: string): TokenView => ({ text, logprob: -0.5, top: [] });
const entry = (token_id: number, text: string, drafted: boolean, v: SpecVerified | null): TokenEntry => ({ seq_id: 0, token_id, text, logprob: -0.5, ts: 0, drafted, allowed_fraction: null, verify: v });

// " Hi" from a plain step; " the", " cat" accepted drafts; " dog" the target's correction at draft 3
const streamed = [view(" Hi"), view(" the"), view(" cat"), view(" dog")];
const engine = [entry(10, " Hi", false, null), entry(11, " the", true, verify), entry(12, " cat", true, verify), entry(20, " dog", false, verify)];
const texts = new Map([[10, " Hi"], [11, " the"], [12, " cat"], [20, " dog"]]);

describe("TokenText with speculative decoding", () => {
  afterEach(cleanup);

  it("marks the tokens that came from an accepted draft, with a legend entry", () => {
    render(<TokenText tokens={streamed} text=" Hi the cat dog" tokenView streaming={false} engine={engine} texts={texts} />);
    const tokens = screen.getAllByTestId("token");
    expect(tokens.map((t) => t.dataset.drafted ?? "")).toEqual(["", "true", "true", ""]);
    expect(tokens.map((t) => t.classList.contains("token-drafted"))).toEqual([false, true, true, false]);
    expect(tokens[1]!.getAttribute("aria-label")).toContain("accepted draft");
    expect(screen.getByTestId("token-legend").textContent).toContain("Accepted draft");
  });

  it("hovering a drafted token shows the step's draft: accepted ones marked, the first rejected struck", () => {
    render(<TokenText tokens={streamed} text=" Hi the cat dog" tokenView streaming={false} engine={engine} texts={texts} />);
    fireEvent.mouseEnter(screen.getAllByTestId("token")[2]!, { clientX: 10, clientY: 10 });
    const tooltip = screen.getByTestId("token-tooltip");
    const detail = within(tooltip).getByTestId("draft-detail");
    expect(detail.textContent).toContain("Accepted draft");
    expect(detail.textContent).toContain("ngram · step 5 · 2 of 3 accepted");
    const drafts = within(detail).getAllByTestId("draft-token");
    expect(drafts.map((d) => d.dataset.status)).toEqual(["accepted", "accepted", "rejected"]);
    // accepted drafts appear in the output: shown as text; the rejected one never did: its id, struck
    expect(drafts[0]!.textContent).toContain('" the"');
    expect(drafts[0]!.textContent).toContain("✓");
    expect(drafts[2]!.querySelector("s")?.textContent).toBe("#13");
    expect(drafts[1]!.querySelector("s")).toBeNull();
    expect(within(detail).getByTestId("draft-target").textContent).toBe('target chose " dog"');
    fireEvent.mouseLeave(screen.getAllByTestId("token")[2]!);
    expect(screen.queryByTestId("token-tooltip")).toBeNull();
  });

  it("the target's own token after the drafts shows the same draft; a plain step's token none", () => {
    render(<TokenText tokens={streamed} text=" Hi the cat dog" tokenView streaming={false} engine={engine} texts={texts} />);
    fireEvent.mouseEnter(screen.getAllByTestId("token")[3]!, { clientX: 10, clientY: 10 });
    expect(screen.getByTestId("draft-detail").textContent).toContain("Correction after a rejected draft");
    fireEvent.mouseEnter(screen.getAllByTestId("token")[0]!, { clientX: 10, clientY: 10 });
    expect(screen.getByTestId("token-tooltip").textContent).toContain('" Hi"');
    expect(screen.queryByTestId("draft-detail")).toBeNull();
  });

  it("without the engine's tokens nothing is marked and there is no legend", () => {
    render(<TokenText tokens={streamed} text=" Hi the cat dog" tokenView streaming={false} />);
    expect(screen.getAllByTestId("token").some((t) => t.dataset.drafted === "true")).toBe(false);
    expect(screen.queryByTestId("token-legend")).toBeNull();
  });

  it("the request detail's engine tokens mark drafts too (replay has no chat)", () => {
    render(<EngineTokenText entries={engine} texts={texts} testId="detail" />);
    const spans = screen.getAllByTestId("engine-token");
    expect(screen.getByTestId("detail").textContent).toBe(" Hi the cat dog");
    expect(spans.map((s) => s.dataset.drafted ?? "")).toEqual(["", "true", "true", ""]);
    fireEvent.mouseEnter(spans[1]!, { clientX: 1, clientY: 1 });
    expect(within(screen.getByTestId("token-tooltip")).getAllByTestId("draft-token").map((d) => d.dataset.status)).toEqual(["accepted", "accepted", "rejected"]);
    expect(screen.getByTestId("token-legend")).toBeTruthy();
  });

  it("the request detail's engine tokens show the grammar mask too, hover for the share", () => {
    const masked = [{ ...engine[0]!, allowed_fraction: 1e-3 }, { ...engine[1]!, allowed_fraction: 1 }, engine[2]!];
    render(<EngineTokenText entries={masked} texts={texts} testId="detail" />);
    const spans = screen.getAllByTestId("engine-token");
    expect(spans.map((s) => s.dataset.allowed ?? "")).toEqual(["0.001", "1", ""]);
    expect(spans[1]!.style.backgroundImage).toBe(""); // everything allowed: no hatching
    fireEvent.mouseEnter(spans[0]!, { clientX: 1, clientY: 1 });
    expect(screen.getByTestId("token-mask").textContent).toBe("grammar allowed 0.1% of the vocabulary");
    expect(screen.getByTestId("legend-mask")).toBeTruthy();
    expect(screen.getByTestId("legend-drafted")).toBeTruthy();
  });
});
