// @vitest-environment jsdom
// The timeline's verify marks: the tooltip over one, the legend entry and the DOM mirror. jsdom has no
// layout and no canvas, so the plot maps x = clientX straight to engine time (its initial view is
// [0, 1] s over a 1 px width) and rows start at the 22 px axis.
import { act, cleanup, fireEvent, render, screen } from "@testing-library/react";
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { fromSnapshot, reduce } from "../../core/dashboard";
import { DashboardStore } from "../../live/store";
import { Stream, config, seqIdOf, snapshot } from "../../test/events";
import { DashboardContext } from "../context";
import { TimelinePanel } from "./TimelinePanel";

const frame = () => new Promise((r) => setTimeout(r, 120));

function session(): Stream {
  const a = seqIdOf("a");
  const s = new Stream();
  s.arrive("a", 4); // ts 0.1 .. 0.3
  s.state("a", "PREFILL", "WAITING", "admitted"); // 0.4
  s.add({ type: "step_scheduled", step: 1, prefill: [{ request_id: "a", seq_id: a, start: 0, num_tokens: 4 }], decode: [], budget_used: 4, budget: 32, num_running: 1, num_waiting: 0, preempted: [], queue_head: null, queue_head_reason: null });
  s.state("a", "DECODE", "PREFILL", "prefilled"); // 0.6
  s.add({ type: "step_scheduled", step: 2, prefill: [], decode: [{ request_id: "a", seq_id: a, start: 4, num_tokens: 1 }], budget_used: 1, budget: 32, num_running: 1, num_waiting: 0, preempted: [], queue_head: null, queue_head_reason: null }); // 0.7: plain decode
  s.add({ type: "step_scheduled", step: 3, prefill: [], decode: [{ request_id: "a", seq_id: a, start: 5, num_tokens: 4, num_draft: 3 }], budget_used: 4, budget: 32, num_running: 1, num_waiting: 0, preempted: [], queue_head: null, queue_head_reason: null }); // 0.8: verify
  s.add({ type: "spec_verified", request_id: "a", seq_id: a, step: 3, method: "ngram", proposed: [7, 8, 9], accepted: 2, token_id: 10 }); // 0.9
  return s;
}

function renderTimeline(withSpec: boolean) {
  const events = session().events.filter((e) => withSpec || (e.type !== "spec_verified" && e.type !== "step_scheduled") || e.step < 3);
  const base = fromSnapshot({ ...snapshot(), config: { ...config(), speculative: withSpec ? "ngram: k=3" : null } });
  const store = new DashboardStore();
  store.setState(reduce(base, events), 1.2);
  store.publish();
  render(
    <DashboardContext.Provider value={{ store, mode: "replay", selected: null, select: () => undefined }}>
      <TimelinePanel />
    </DashboardContext.Provider>,
  );
}

describe("TimelinePanel verify steps", () => {
  beforeEach(() => {
    HTMLCanvasElement.prototype.getContext = (() => null) as never;
  });
  afterEach(() => {
    cleanup();
    vi.unstubAllGlobals();
  });

  it("hovering a verify step says how many drafts it checked and kept", () => {
    renderTimeline(true);
    const canvas = screen.getByTestId("timeline-canvas");
    fireEvent.mouseMove(canvas, { clientX: 0.8, clientY: 22 + 9 });
    expect(screen.getByTestId("timeline-tooltip-verify").textContent).toBe("verify: 3 drafted, 2 accepted step 3");
    expect(screen.getByTestId("timeline-tooltip").textContent).toContain("1 verify step");
    // away from the mark (the hit slack is 3 px, here 3 s): the row's tooltip without a verify line
    fireEvent.mouseMove(canvas, { clientX: -3, clientY: 22 + 9 });
    expect(screen.getByTestId("timeline-tooltip")).toBeTruthy();
    expect(screen.queryByTestId("timeline-tooltip-verify")).toBeNull();
  });

  it("has a legend entry and a DOM mirror of the verify marks", async () => {
    renderTimeline(true);
    expect(screen.getByTestId("timeline-legend-verify").textContent).toContain("Verify step");
    await act(frame);
    // two decode steps, one of them a verify step
    expect(screen.getByTestId("timeline-verify-summary").textContent).toBe("a verifies=1 drafted=3 accepted=2");
  });

  it("without speculative decoding: no legend entry, no marks", async () => {
    renderTimeline(false);
    expect(screen.queryByTestId("timeline-legend-verify")).toBeNull();
    fireEvent.mouseMove(screen.getByTestId("timeline-canvas"), { clientX: 0.8, clientY: 22 + 9 });
    expect(screen.getByTestId("timeline-tooltip")).toBeTruthy();
    expect(screen.queryByTestId("timeline-tooltip-verify")).toBeNull();
    await act(frame);
    expect(screen.getByTestId("timeline-verify-summary").textContent).toBe("");
  });
});
