// @vitest-environment jsdom
// The heatmap legend names the window blocks leave: --kv-window's KV window, or the model's own
// sliding-window attention (Mistral), whose freed blocks arrive as blocks_freed with `dropped`.
import { cleanup, render, screen } from "@testing-library/react";
import { afterEach, beforeEach, describe, expect, it } from "vitest";
import { fromSnapshot } from "../../core/dashboard";
import type { EngineInfo } from "../../core/wire";
import { DashboardStore } from "../../live/store";
import { config, snapshot } from "../../test/events";
import { DashboardContext } from "../context";
import { HeatmapPanel } from "./HeatmapPanel";

function renderWith(extra: Partial<EngineInfo>): void {
  const store = new DashboardStore();
  store.setState(fromSnapshot({ ...snapshot(), config: { ...config(), ...extra } }), 0);
  store.publish();
  render(
    <DashboardContext.Provider value={{ store, mode: "live", selected: null, select: () => undefined }}>
      <HeatmapPanel />
    </DashboardContext.Provider>,
  );
}

describe("heatmap legend", () => {
  beforeEach(() => {
    HTMLCanvasElement.prototype.getContext = (() => null) as never;
  });
  afterEach(cleanup);

  it("names the model's attention window where blocks leave it", () => {
    renderWith({ attention_window: 16 });
    expect(screen.getByTestId("legend-dropped").textContent).toBe("Left the attention window");
  });

  it("names the KV window under --kv-window", () => {
    renderWith({ kv_window: 64 });
    expect(screen.getByTestId("legend-dropped").textContent).toBe("Left the KV window");
  });

  it("has no such entry without a window", () => {
    renderWith({});
    expect(screen.queryByTestId("legend-dropped")).toBeNull();
  });
});
