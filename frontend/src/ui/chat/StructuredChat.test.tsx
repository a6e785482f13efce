// @vitest-environment jsdom
// The chat with structured output and tools: the settings' editors check what is typed and hold Send
// back while it is wrong; the request carries the constraint; tool calls and grammar-constrained
// tokens (from the live engine's TokenGenerated.allowed_fraction) show in the reply.
import { act, cleanup, fireEvent, render, screen, within } from "@testing-library/react";
import { useState } from "react";
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { fromSnapshot, reduce } from "../../core/dashboard";
import { defaultParams, type DecodingParams } from "../../core/openai";
import { EXAMPLE_TOOLS } from "../../core/tools";
import { DashboardStore } from "../../live/store";
import { Stream, snapshot } from "../../test/events";
import { ChatPanel } from "./ChatPanel";

const frame = () => new Promise((r) => setTimeout(r, 60));
const SCHEMA = '{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}';

function sse(chunks: unknown[]): Response {
  const body = [...chunks.map((c) => `data: ${JSON.stringify(c)}\n\n`), "data: [DONE]\n\n"].join("");
  return new Response(body, { headers: { "Content-Type": "text/event-stream", "X-Request-Id": "q1" } });
}

const content = (t: string, finish: string | null = null) => ({ id: "chatcmpl-q1", choices: [{ index: 0, delta: { content: t }, logprobs: null, finish_reason: finish }] });
const toolDelta = (d: Record<string, unknown>, finish: string | null = null) => ({ id: "chatcmpl-q1", choices: [{ index: 0, delta: { tool_calls: [{ index: 0, ...d }] }, logprobs: null, finish_reason: finish }] });

/** ChatPanel with its settings held in state, as App does. */
function Harness(props: { engine?: DashboardStore; initial?: DecodingParams }) {
  const [params, setParams] = useState(props.initial ?? defaultParams());
  return <ChatPanel model="tiny" params={params} setParams={setParams} onShowRequest={() => true} engine={props.engine} />;
}

async function send(text: string) {
  fireEvent.change(screen.getByTestId("chat-input"), { target: { value: text } });
  await act(async () => {
    fireEvent.click(screen.getByTestId("chat-send"));
    await frame();
    await frame();
  });
}

/** Render the chat with `fetch` answering every request with these SSE chunks; returns the mock. */
function renderReplying(chunks: unknown[]): ReturnType<typeof vi.fn> {
  const fetchMock = vi.fn(async () => sse(chunks));
  vi.stubGlobal("fetch", fetchMock);
  render(<Harness />);
  return fetchMock;
}

function lastBody(fetchMock: ReturnType<typeof vi.fn>): Record<string, unknown> {
  const init = fetchMock.mock.calls.at(-1)![1] as RequestInit;
  return JSON.parse(init.body as string) as Record<string, unknown>;
}

describe("structured output in the chat", () => {
  beforeEach(() => localStorage.clear()); // the chat keeps conversations there
  afterEach(() => {
    cleanup();
    vi.unstubAllGlobals();
  });

  it("checks the JSON schema as it is typed: the error shows and Send is disabled until it parses", async () => {
    const fetchMock = renderReplying([content('{"city": "Paris"}', "stop")]);
    fireEvent.change(screen.getByTestId("structured-mode"), { target: { value: "json_schema" } });
    fireEvent.change(screen.getByTestId("structured-schema"), { target: { value: '{"type": "object",' } });
    fireEvent.change(screen.getByTestId("chat-input"), { target: { value: "a city" } });
    expect(screen.getByTestId("structured-error").textContent).toMatch(/not valid JSON/);
    expect(screen.getByTestId("structured-schema").getAttribute("aria-invalid")).toBe("true");
    expect((screen.getByTestId("chat-send") as HTMLButtonElement).disabled).toBe(true);
    expect(screen.getByTestId("chat-problem").textContent).toMatch(/^Structured output: /);

    fireEvent.change(screen.getByTestId("structured-schema"), { target: { value: "[]" } });
    expect(screen.getByTestId("structured-error").textContent).toBe("a JSON schema must be an object, got an array");

    fireEvent.change(screen.getByTestId("structured-schema"), { target: { value: SCHEMA } });
    expect(screen.queryByTestId("structured-error")).toBeNull();
    expect(screen.queryByTestId("chat-problem")).toBeNull();
    await send("a city");
    expect(lastBody(fetchMock).response_format).toEqual({ type: "json_schema", json_schema: { name: "response", schema: JSON.parse(SCHEMA), strict: true } });
    expect(screen.getByTestId("message-assistant").dataset.finish).toBe("stop");
  });

  it("choices need at least one line; they go out as structured_outputs.choice", async () => {
    const fetchMock = renderReplying([content("yes", "stop")]);
    fireEvent.change(screen.getByTestId("structured-mode"), { target: { value: "choice" } });
    fireEvent.change(screen.getByTestId("structured-choices"), { target: { value: "\n \n" } });
    expect(screen.getByTestId("structured-error").textContent).toMatch(/at least one choice/);
    fireEvent.change(screen.getByTestId("structured-choices"), { target: { value: "yes\nno\n" } });
    await send("yes or no?");
    expect(lastBody(fetchMock).structured_outputs).toEqual({ choice: ["yes", "no"] });
    expect(screen.getByTestId("message-assistant").querySelector(".message-meta")!.textContent).toContain("choices: yes | no");
  });

  it("the tools editor checks the array; tool_choice offers each tool; a streamed call shows pretty-printed", async () => {
    const fetchMock = renderReplying([
      toolDelta({ id: "call_0", type: "function", function: { name: "get_weather", arguments: "" } }),
      toolDelta({ function: { arguments: '{"city":' } }),
      toolDelta({ function: { arguments: '"Paris"}' } }),
      { id: "chatcmpl-q1", choices: [{ index: 0, delta: {}, logprobs: null, finish_reason: "tool_calls" }] },
    ]);
    fireEvent.change(screen.getByTestId("tools-editor"), { target: { value: '[{"type": "function"}]' } });
    expect(screen.getByTestId("tools-error").textContent).toBe("tools[0].function must be an object");
    fireEvent.change(screen.getByTestId("chat-input"), { target: { value: "weather?" } });
    expect((screen.getByTestId("chat-send") as HTMLButtonElement).disabled).toBe(true);
    fireEvent.click(screen.getByTestId("tools-example"));
    expect(screen.queryByTestId("tools-error")).toBeNull();
    const options = within(screen.getByTestId("tool-choice")).getAllByRole("option").map((o) => o.textContent);
    expect(options).toEqual(["auto", "none", "required", "get_weather"]);
    fireEvent.change(screen.getByTestId("tool-choice"), { target: { value: "function:get_weather" } });
    await send("weather in Paris?");
    const body = lastBody(fetchMock);
    expect(body.tools).toEqual(JSON.parse(EXAMPLE_TOOLS));
    expect(body.tool_choice).toEqual({ type: "function", function: { name: "get_weather" } });
    const call = screen.getByTestId("tool-call");
    expect(within(call).getByTestId("tool-call-name").textContent).toBe("get_weather");
    expect(within(call).getByTestId("tool-call-arguments").textContent).toBe('{\n  "city": "Paris"\n}');
    expect(screen.getByTestId("tool-calls-finish").textContent).toBe("tool_calls");
    expect(within(screen.getByTestId("message-stats")).getByText("tool_calls")).toBeTruthy();
  });

  it("shades grammar-constrained tokens by the live engine's allowed_fraction, with a legend", async () => {
    vi.stubGlobal("fetch", vi.fn(async () => sse([content("{"), content('"'), content("city"), content("\"}", "stop")])));
    const s = new Stream();
    s.add({ type: "request_arrived", request_id: "chatcmpl-q1", prompt_tokens: 3, max_tokens: 8, n: 1, priority: 0, sampling: {}, prompt_preview: "hi" });
    s.add({ type: "seq_added", request_id: "chatcmpl-q1", seq_id: 4, parent_seq_id: null, num_tokens: 3, num_prompt_tokens: 3 });
    const fractions = [2e-5, 0.5, 0.9, null];
    ["{", '"', "city", '"}'].forEach((text, i) => {
      s.add({ type: "token", request_id: "chatcmpl-q1", seq_id: 4, token_id: 100 + i, text, logprob: null, allowed_fraction: fractions[i] });
    });
    const store = new DashboardStore();
    store.setState(reduce(fromSnapshot(snapshot()), s.events), 1);
    store.publish();
    render(<Harness engine={store} initial={{ ...defaultParams(), logprobs: false }} />);
    await send("a city");
    // no logprobs, yet the token view shows tokens: some were constrained
    const tokens = within(screen.getByTestId("message-assistant")).getAllByTestId("token");
    expect(tokens.map((t) => t.dataset.allowed ?? "")).toEqual(["0.00002", "0.5", "0.9", ""]);
    expect(tokens[0]!.classList.contains("token-masked")).toBe(true);
    expect(tokens[0]!.style.backgroundImage).toContain("repeating-linear-gradient");
    expect(tokens[3]!.style.backgroundImage).toBe("");
    expect(tokens[0]!.getAttribute("aria-label")).toContain("grammar allowed 0.002% of the vocabulary");
    expect(screen.getByTestId("legend-mask").textContent).toContain("Grammar mask");
    expect(screen.queryByTestId("legend-drafted")).toBeNull();
    fireEvent.mouseEnter(tokens[1]!, { clientX: 5, clientY: 5 });
    expect(screen.getByTestId("token-mask").textContent).toBe("grammar allowed 50% of the vocabulary");
    // the token view off: plain text
    fireEvent.click(screen.getByTestId("chat-token-view"));
    expect(screen.getByTestId("message-content").textContent).toBe('{"city"}');
  });
});
