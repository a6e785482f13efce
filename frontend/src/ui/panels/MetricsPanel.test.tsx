// @vitest-environment jsdom
import { cleanup, render, screen } from "@testing-library/react";
import { afterEach, beforeEach, describe, expect, it } from "vitest";
import { fromSnapshot, reduce } from "../../core/dashboard";
import type { MetricsSample } from "../../core/wire";
import { DashboardStore } from "../../live/store";
import { Stream, config, snapshot } from "../../test/events";
import { DashboardContext } from "../context";
import { MetricsPanel } from "./MetricsPanel";

const metrics = (over: Partial<MetricsSample>) => ({
  type: "metrics" as const, num_running: 1, num_waiting: 0, kv_usage: 0.25, num_cached_free_blocks: 0, prefix_cache_queries: 0, prefix_cache_hits: 0,
  num_preemptions: 0, prompt_tokens: 0, generation_tokens: 0, generation_throughput: 12, prompt_throughput: 0, ...over,
});

function renderMetrics(samples: Partial<MetricsSample>[], speculative: string | null) {
  const s = new Stream();
  for (const m of samples) s.add(metrics(m));
  const store = new DashboardStore();
  store.setState(reduce(fromSnapshot({ ...snapshot(), config: { ...config(), speculative } }), s.events), 1);
  store.publish();
  render(
    <DashboardContext.Provider value={{ store, mode: "live", selected: null, select: () => undefined }}>
      <MetricsPanel />
    </DashboardContext.Provider>,
  );
}

describe("MetricsPanel: speculative decoding", () => {
  beforeEach(() => {
    HTMLCanvasElement.prototype.getContext = (() => null) as never;
  });
  afterEach(cleanup);

  it("shows acceptance, accepted drafts and tokens per verify from the latest counters, with charts", () => {
    renderMetrics([
      { spec_num_drafts: 2, spec_num_draft_tokens: 8, spec_num_accepted_tokens: 2, spec_accepted_per_position: [1, 1, 0, 0] },
      { spec_num_drafts: 10, spec_num_draft_tokens: 40, spec_num_accepted_tokens: 25, spec_accepted_per_position: [9, 8, 5, 3] },
    ], "ngram: k=4, n-gram 2-4");
    expect(screen.getByTestId("metrics-spec").dataset.state).toBe("on");
    expect(screen.getByTestId("metric-spec-acceptance").textContent).toBe("63%");
    expect(screen.getByTestId("metric-spec-mean-accepted").textContent).toBe("2.50");
    expect(screen.getByTestId("metric-spec-tokens-per-step").textContent).toBe("3.50");
    expect(screen.getByTestId("metric-spec-drafts").textContent).toBe("10");
    expect(screen.getByTestId("metric-spec-per-position").textContent).toBe("Acceptance by draft position: 1: 90% · 2: 80% · 3: 50% · 4: 30%");
    expect(screen.getByTestId("chart-spec-acceptance")).toBeTruthy();
    expect(screen.getByTestId("chart-spec-accepted-length")).toBeTruthy();
  });

  it("says speculative decoding is off rather than showing NaN, and draws no spec charts", () => {
    renderMetrics([{ spec_num_drafts: 0, spec_num_draft_tokens: 0, spec_num_accepted_tokens: 0, spec_accepted_per_position: [] }, {}], null);
    const line = screen.getByTestId("metrics-spec");
    expect(line.textContent).toBe("Speculative decoding off");
    expect(line.dataset.state).toBe("off");
    expect(screen.getByTestId("metrics-panel").textContent).not.toMatch(/NaN|Infinity/);
    expect(screen.queryByTestId("metric-spec-acceptance")).toBeNull();
    expect(screen.queryByTestId("chart-spec-acceptance")).toBeNull();
    expect(screen.getByTestId("chart-throughput")).toBeTruthy();
  });

  it("on but nothing verified yet: says so, no numbers", () => {
    renderMetrics([{}], "early_exit: k=3, exit after layer 1");
    expect(screen.getByTestId("metrics-spec").textContent).toBe("Speculative decoding (early_exit: k=3, exit after layer 1): no drafts verified yet");
    expect(screen.getByTestId("metrics-panel").textContent).not.toMatch(/NaN/);
    expect(screen.getByTestId("chart-spec-acceptance")).toBeTruthy();
  });
});

describe("MetricsPanel: memory split", () => {
  beforeEach(() => {
    HTMLCanvasElement.prototype.getContext = (() => null) as never;
  });
  afterEach(cleanup);

  it("shows the latest sample's parts with their sizes, and nothing for a sample without a split", () => {
    const MiB = 2 ** 20;
    const memory = { rss: 200 * MiB, weights: 100 * MiB, kv_cache: 10 * MiB, compiled: 0, torch: 50 * MiB, libraries: 20 * MiB, other: 20 * MiB, kv_reserved: 64 * MiB };
    renderMetrics([{ memory: { ...memory, weights: 1 } }, { memory }], null);
    expect(screen.getByTestId("memory-part-weights").textContent).toBe("Weights100.0 MiB50%");
    expect(screen.getByTestId("memory-part-other").textContent).toBe("Other20.0 MiB10%");
    expect(screen.getByTestId("metrics-memory").textContent).toContain("KV pool reserved: 64.0 MiB");
    cleanup();
    renderMetrics([{ rss_bytes: 200 * MiB }], null);
    expect(screen.queryByTestId("metrics-memory")).toBeNull();
  });
});
