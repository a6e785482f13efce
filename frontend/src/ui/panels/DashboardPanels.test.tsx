// @vitest-environment jsdom
// The panel fixes of issue 46 in the DOM: the scheduler's preemptions filter and short ids, the
// selected-request card of a finished request, the timeline's search, and the replay view before a
// recording is loaded. jsdom has no canvas and no layout: this checks what is rendered, not where.
import { cleanup, fireEvent, render, screen } from "@testing-library/react";
import type { ReactNode } from "react";
import { afterEach, beforeEach, describe, expect, it } from "vitest";
import { fromSnapshot, reduce } from "../../core/dashboard";
import { ring } from "../../core/ring";
import type { StepScheduled } from "../../core/wire";
import { DashboardStore } from "../../live/store";
import { Stream, config, seqIdOf, snapshot } from "../../test/events";
import { DashboardContext, type ViewMode } from "../context";
import { RequestDetail } from "./RequestDetail";
import { SchedulerPanel, stepRows } from "./SchedulerPanel";
import { TimelinePanel } from "./TimelinePanel";

const LONG_A = "0123456789abcdef0123456789abcdef";
const LONG_B = "fedcba9876543210fedcba9876543210";

/** Two requests; B is preempted for A in step 2 and then finishes. */
function session(): Stream {
  const s = new Stream();
  s.arrive(LONG_A, 4);
  s.arrive(LONG_B, 4);
  s.state(LONG_A, "PREFILL", "WAITING", "admitted");
  s.state(LONG_B, "PREFILL", "WAITING", "admitted");
  const step = (n: number, preempted: string[], head: string | null): void => {
    s.add({
      type: "step_scheduled", step: n, prefill: [], decode: [{ request_id: LONG_A, seq_id: seqIdOf(LONG_A), start: 4, num_tokens: 1 }],
      budget_used: 1, budget: 32, num_running: 1, num_waiting: head ? 1 : 0, preempted, queue_head: head, queue_head_reason: head ? "out of KV blocks" : null,
    });
  };
  step(1, [], null);
  s.state(LONG_B, "PREEMPTED", "PREFILL", `preempted: out of KV blocks (needed by ${LONG_A})`);
  step(2, [LONG_B], LONG_B);
  step(3, [], LONG_B);
  s.state(LONG_A, "FINISHED", "PREFILL", "finished: stop", "stop");
  s.add({ type: "seq_removed", request_id: LONG_A, seq_id: seqIdOf(LONG_A), reason: "finished" });
  return s;
}

function renderWith(ui: ReactNode, opts: { mode?: ViewMode; selected?: string | null; store?: DashboardStore } = {}) {
  const store = opts.store ?? new DashboardStore();
  if (opts.store === undefined) {
    store.setState(reduce(fromSnapshot({ ...snapshot(), config: config() }), session().events), 2);
    store.publish();
  }
  render(
    <DashboardContext.Provider value={{ store, mode: opts.mode ?? "live", selected: opts.selected ?? null, select: () => undefined }}>
      {ui}
    </DashboardContext.Provider>,
  );
}

describe("dashboard panels", () => {
  beforeEach(() => {
    HTMLCanvasElement.prototype.getContext = (() => null) as never;
  });
  afterEach(cleanup);

  it("scheduler: 8-character ids with the full id as the title, the reason first, and a preemptions filter", () => {
    renderWith(<SchedulerPanel />);
    const headers = screen.getAllByRole("columnheader").map((h) => h.textContent);
    expect(headers[0]).toBe("Queue head waits because");
    expect(headers).toContain("Preempted");
    expect(screen.getAllByTestId("scheduler-step-row")).toHaveLength(3);
    const cell = screen.getAllByTestId("scheduler-preempted-cell").find((c) => c.textContent !== "")!;
    const link = cell.querySelector("button")!;
    expect(link.textContent).toBe(LONG_B.slice(0, 8));
    expect(link.getAttribute("title")).toBe(LONG_B);
    fireEvent.click(screen.getByTestId("scheduler-preempted-only"));
    const rows = screen.getAllByTestId("scheduler-step-row");
    expect(rows.map((r) => r.dataset.step)).toEqual(["2"]);
  });

  it("stepRows finds preempting steps beyond the newest rows", () => {
    const step = (n: number, preempted: string[]) => ({ step: n, preempted } as unknown as StepScheduled);
    const steps = ring(100, [step(1, ["x"]), ...Array.from({ length: 70 }, (_, i) => step(i + 2, []))]);
    expect(stepRows(steps, 60, false)).toHaveLength(60);
    expect(stepRows(steps, 60, true).map((s) => s.step)).toEqual([1]);
  });

  it("request card: a finished request shows its total time, not 'Sequences 0'; the id keeps its full text as the title", () => {
    renderWith(<RequestDetail />, { selected: LONG_A });
    expect(screen.getByTestId("request-detail-id").getAttribute("title")).toBe(LONG_A);
    expect(screen.getByTestId("request-detail-finish").textContent).toBe("(stop)");
    expect(screen.queryByTestId("request-detail-seqs")).toBeNull();
    expect(screen.getByTestId("request-detail-total").textContent).not.toBe("–");
  });

  it("request card: a live request shows its sequences", () => {
    renderWith(<RequestDetail />, { selected: LONG_B });
    expect(screen.getByTestId("request-detail-seqs").textContent).toBe("1");
    expect(screen.queryByTestId("request-detail-total")).toBeNull();
  });

  it("timeline: the search marks the matching rows only", () => {
    renderWith(<TimelinePanel />, { mode: "replay" });
    fireEvent.change(screen.getByTestId("timeline-search"), { target: { value: "FEDCBA" } });
    expect(screen.getByTestId(`request-row-${LONG_B}`).dataset.match).toBe("true");
    expect(screen.getByTestId(`request-row-${LONG_A}`).dataset.match).toBeUndefined();
    expect(screen.getByTestId("timeline-search-count").textContent).toContain("1 match");
  });

  it("timeline: the zoom buttons zoom in and back out to the whole window", () => {
    renderWith(<TimelinePanel />);
    const canvas = screen.getByTestId("timeline-canvas");
    expect(canvas.dataset.view).toBe("auto");
    fireEvent.click(screen.getByTestId("timeline-zoom-in"));
    expect(canvas.dataset.view).toBe("20.000@5.000"); // [-28, 2] -> 20 s around its middle, -13: [-23, -3]
    expect(screen.getByTestId("timeline-zoom-reset")).toBeTruthy();
    fireEvent.click(screen.getByTestId("timeline-zoom-out"));
    expect(canvas.dataset.view).toBe("auto");
    expect(screen.queryByTestId("timeline-zoom-reset")).toBeNull();
  });

  it("timeline: replay with nothing loaded asks for a recording", () => {
    renderWith(<TimelinePanel />, { mode: "replay", store: new DashboardStore() });
    expect(screen.getByTestId("timeline-empty").textContent).toContain("Load a recording");
    expect(screen.getByTestId("timeline-empty").textContent).not.toContain("/ws/events");
  });

  it("timeline: live with no engine yet still waits for the event stream", () => {
    renderWith(<TimelinePanel />, { mode: "live", store: new DashboardStore() });
    expect(screen.getByTestId("timeline-empty").textContent).toContain("Waiting for the engine");
  });
});
