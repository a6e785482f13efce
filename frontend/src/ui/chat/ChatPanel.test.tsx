// @vitest-environment jsdom
// The chat's token view joined with the live engine's events: a streamed reply whose request the
// engine reports with drafted tokens shows those tokens marked, and their draft on hover.
import { act, cleanup, fireEvent, render, screen, within } from "@testing-library/react";
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { fromSnapshot, reduce } from "../../core/dashboard";
import { DashboardStore } from "../../live/store";
import { Stream, snapshot } from "../../test/events";
import { defaultParams } from "../../core/openai";
import { ChatPanel } from "./ChatPanel";

const frame = () => new Promise((r) => setTimeout(r, 60));

function sse(tokens: string[]): string {
  const chunk = (t: string) => ({ id: "chatcmpl-q1", choices: [{ index: 0, delta: { content: t }, logprobs: { content: [{ token: t, logprob: -0.2, top_logprobs: [] }] }, finish_reason: null }] });
  return [...tokens.map((t) => `data: ${JSON.stringify(chunk(t))}\n\n`), "data: [DONE]\n\n"].join("");
}

function engineStore(): DashboardStore {
  const s = new Stream();
  s.add({ type: "request_arrived", request_id: "chatcmpl-q1", prompt_tokens: 3, max_tokens: 8, n: 1, priority: 0, sampling: {}, prompt_preview: "hi" });
  s.add({ type: "seq_added", request_id: "chatcmpl-q1", seq_id: 4, parent_seq_id: null, num_tokens: 3, num_prompt_tokens: 3 });
  s.add({ type: "token", request_id: "chatcmpl-q1", seq_id: 4, token_id: 100, text: " Hi", logprob: -0.2 });
  s.add({ type: "step_scheduled", step: 2, prefill: [], decode: [{ request_id: "chatcmpl-q1", seq_id: 4, start: 3, num_tokens: 3, num_draft: 2 }], budget_used: 3, budget: 32, num_running: 1, num_waiting: 0, preempted: [], queue_head: null, queue_head_reason: null });
  s.add({ type: "spec_verified", request_id: "chatcmpl-q1", seq_id: 4, step: 2, method: "ngram", proposed: [101, 102], accepted: 1, token_id: 103 });
  s.add({ type: "token", request_id: "chatcmpl-q1", seq_id: 4, token_id: 101, text: " there", logprob: -0.2, drafted: true });
  s.add({ type: "token", request_id: "chatcmpl-q1", seq_id: 4, token_id: 103, text: "!", logprob: -0.2 });
  const store = new DashboardStore();
  store.setState(reduce(fromSnapshot(snapshot()), s.events), 1);
  store.publish();
  return store;
}

describe("ChatPanel with the live engine's drafted tokens", () => {
  beforeEach(() => {
    localStorage.clear(); // the chat keeps conversations there
    vi.stubGlobal("fetch", vi.fn(async () => new Response(sse([" Hi", " there", "!"]), { headers: { "Content-Type": "text/event-stream", "X-Request-Id": "q1" } })));
  });
  afterEach(() => {
    cleanup();
    vi.unstubAllGlobals();
  });

  async function sendHi(): Promise<void> {
    fireEvent.change(screen.getByTestId("chat-input"), { target: { value: "hi" } });
    await act(async () => {
      fireEvent.click(screen.getByTestId("chat-send"));
      await frame();
      await frame();
    });
  }

  it("marks the reply's accepted drafts and shows the draft on hover", async () => {
    render(<ChatPanel model="tiny" params={defaultParams()} setParams={() => undefined} onShowRequest={() => true} engine={engineStore()} />);
    await sendHi();
    const tokens = within(screen.getByTestId("message-assistant")).getAllByTestId("token");
    expect(tokens.map((t) => t.textContent)).toEqual([" Hi", " there", "!"]);
    expect(tokens.map((t) => t.dataset.drafted ?? "")).toEqual(["", "true", ""]);
    expect(screen.getByTestId("token-legend")).toBeTruthy();
    fireEvent.mouseEnter(tokens[1]!, { clientX: 5, clientY: 5 });
    const drafts = within(screen.getByTestId("draft-detail")).getAllByTestId("draft-token");
    expect(drafts.map((d) => [d.textContent, d.dataset.status])).toEqual([['✓ " there" (accepted)', "accepted"], ["#102 (rejected)", "rejected"]]);
    expect(screen.getByTestId("draft-target").textContent).toBe('target chose "!"');
  });

  it("without the engine's state the same reply has no marks", async () => {
    render(<ChatPanel model="tiny" params={defaultParams()} setParams={() => undefined} onShowRequest={() => true} />);
    await sendHi();
    const tokens = within(screen.getByTestId("message-assistant")).getAllByTestId("token");
    expect(tokens.length).toBe(3);
    expect(tokens.some((t) => t.dataset.drafted === "true")).toBe(false);
    expect(screen.queryByTestId("token-legend")).toBeNull();
  });
});
