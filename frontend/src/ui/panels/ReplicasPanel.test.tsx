// @vitest-environment jsdom
import { act, cleanup, fireEvent, render, screen } from "@testing-library/react";
import { afterEach, describe, expect, it, vi } from "vitest";
import type { ReplicasState } from "../../core/wire";
import { eventsUrl, followReplica } from "../../live/socket";
import { ReplicasPanel } from "./ReplicasPanel";

function serve(state: ReplicasState) {
  vi.stubGlobal("fetch", vi.fn(async (url: string) =>
    url === "/v1/replicas" ? new Response(JSON.stringify(state)) : new Response("{}", { status: 404 })));
}

const flush = () => act(async () => { await new Promise((r) => setTimeout(r, 0)); });

describe("ReplicasPanel", () => {
  afterEach(() => {
    cleanup();
    vi.unstubAllGlobals();
    followReplica(null);
  });

  it("is hidden when one engine serves", async () => {
    serve({ policy: "", replicas: [], decisions: [] });
    render(<ReplicasPanel onFollow={() => {}} />);
    await flush();
    expect(screen.queryByTestId("replicas-panel")).toBeNull();
  });

  it("lists the replicas and the routing decisions, newest first, and switches the followed replica", async () => {
    serve({
      policy: "prefix",
      replicas: [
        { id: 0, node: "a:1", alive: true, running: 2, waiting: 0, routed: 5, prefix_hit_rate: 0.8 },
        { id: 1, node: "b:2", alive: false, routed: 1, dead_reason: "replica 1 died" },
      ],
      decisions: [
        { request_id: "r1", replica: 0, matched_blocks: 0, prompt_blocks: 4, reason: "least_loaded" },
        { request_id: "r2", replica: 0, matched_blocks: 4, prompt_blocks: 5, reason: "prefix" },
      ],
    });
    const onFollow = vi.fn();
    render(<ReplicasPanel onFollow={onFollow} />);
    await flush();
    expect(screen.getByTestId("replica-row-0").textContent).toContain("80%");
    expect(screen.getByTestId("replica-row-1").textContent).toContain("dead");
    const rows = screen.getByTestId("routing-decisions").querySelectorAll("tbody tr");
    expect([...rows].map((r) => r.textContent)).toEqual(["r204 / 5prefix", "r100 / 4least_loaded"]);
    expect(eventsUrl(null, "http://h/")).not.toContain("replica=");
    fireEvent.change(screen.getByTestId("replica-switcher"), { target: { value: "1" } });
    expect(onFollow).toHaveBeenCalledWith(1);
    expect(eventsUrl(null, "http://h/")).toBe("ws://h/ws/events?replica=1");
  });
});
