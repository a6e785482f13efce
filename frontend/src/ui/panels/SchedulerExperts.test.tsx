// @vitest-environment jsdom
// The scheduler's step rows show a MoE model's distinct experts a step ran (StepFinished.experts_touched),
// and nothing for a dense model's steps (null).
import { cleanup, render, screen } from "@testing-library/react";
import { afterEach, beforeEach, describe, expect, it } from "vitest";
import { fromSnapshot, reduce } from "../../core/dashboard";
import { DashboardStore } from "../../live/store";
import { Stream, config, seqIdOf, snapshot } from "../../test/events";
import { DashboardContext } from "../context";
import { SchedulerPanel } from "./SchedulerPanel";

function steps(experts: (number | null)[]): Stream {
  const s = new Stream();
  s.arrive("r1", 4);
  experts.forEach((touched, i) => {
    s.add({
      type: "step_scheduled", step: i + 1, prefill: [], decode: [{ request_id: "r1", seq_id: seqIdOf("r1"), start: 4 + i, num_tokens: 1 }],
      budget_used: 1, budget: 32, num_running: 1, num_waiting: 0, preempted: [], queue_head: null, queue_head_reason: null,
    });
    s.add({
      type: "step_finished", step: i + 1, duration_ms: 5, num_tokens: 1, num_generated: 1,
      schedule_ms: 1, forward_ms: 3, sample_ms: 0.5, postprocess_ms: 0.5, experts_touched: touched,
    });
  });
  return s;
}

function renderSteps(experts: (number | null)[]): void {
  const store = new DashboardStore();
  store.setState(reduce(fromSnapshot({ ...snapshot(), config: config() }), steps(experts).events), 2);
  store.publish();
  render(
    <DashboardContext.Provider value={{ store, mode: "live", selected: null, select: () => undefined }}>
      <SchedulerPanel />
    </DashboardContext.Provider>,
  );
}

describe("scheduler: experts touched", () => {
  beforeEach(() => {
    HTMLCanvasElement.prototype.getContext = (() => null) as never;
  });
  afterEach(cleanup);

  it("shows a MoE step's expert count beside its time", () => {
    renderSteps([24, 31]);
    const cells = screen.getAllByTestId("scheduler-experts").map((c) => c.textContent);
    expect(new Set(cells)).toEqual(new Set([" · 24 experts", " · 31 experts"]));
  });

  it("shows nothing for a dense model's steps", () => {
    renderSteps([null, null]);
    expect(screen.getAllByTestId("scheduler-step-row")).toHaveLength(2);
    expect(screen.queryByTestId("scheduler-experts")).toBeNull();
  });
});
