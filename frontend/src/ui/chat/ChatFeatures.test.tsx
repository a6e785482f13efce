// @vitest-environment jsdom
// The chat's conversation features against a mocked server: kept across a remount (a reload), the
// system prompt sent first, regenerate keeping versions (‹1/2›), Continue, a tool call's markup left
// out of the token view, an import that says what is wrong, and speculative counts in the stats.
import { act, cleanup, fireEvent, render, screen, within } from "@testing-library/react";
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { fromSnapshot, reduce } from "../../core/dashboard";
import { defaultParams, presetParams, type DecodingParams } from "../../core/openai";
import { EXAMPLE_TOOLS } from "../../core/tools";
import { DashboardStore } from "../../live/store";
import { Stream, snapshot } from "../../test/events";
import { ChatPanel } from "./ChatPanel";

const frame = () => new Promise((r) => setTimeout(r, 60));

type Chunk = Record<string, unknown>;
const token = (t: string, finish: string | null = null, content = true): Chunk => ({
  id: "chatcmpl-q1",
  choices: [{ index: 0, delta: content ? { content: t } : {}, logprobs: { content: [{ token: t, logprob: -0.2, top_logprobs: [] }] }, finish_reason: finish }],
});

function sse(chunks: Chunk[]): Response {
  const body = [...chunks.map((c) => `data: ${JSON.stringify(c)}\n\n`), "data: [DONE]\n\n"].join("");
  return new Response(body, { headers: { "Content-Type": "text/event-stream", "X-Request-Id": "q1" } });
}

/** fetch answering each request with the next reply in `replies` (the last one again after that). */
function serve(...replies: Chunk[][]): ReturnType<typeof vi.fn> {
  let k = 0;
  const mock = vi.fn(async () => sse(replies[Math.min(k++, replies.length - 1)]!));
  vi.stubGlobal("fetch", mock);
  return mock;
}

function bodyOf(mock: ReturnType<typeof vi.fn>, call = -1): Record<string, unknown> {
  const init = mock.mock.calls.at(call)![1] as RequestInit;
  return JSON.parse(init.body as string) as Record<string, unknown>;
}

function Chat(props: { params?: DecodingParams; engine?: DashboardStore }) {
  return <ChatPanel model="tiny" params={props.params ?? presetParams("greedy")} setParams={() => undefined} onShowRequest={() => true} engine={props.engine} />;
}

async function settle(): Promise<void> {
  await act(async () => {
    await frame();
    await frame();
  });
}

async function send(text: string): Promise<void> {
  fireEvent.change(screen.getByTestId("chat-input"), { target: { value: text } });
  fireEvent.click(screen.getByTestId("chat-send"));
  await settle();
}

const reply = () => screen.getAllByTestId("message-assistant").at(-1)!;
const text = () => within(reply()).getByTestId("message-content").textContent;

describe("chat features", () => {
  beforeEach(() => localStorage.clear());
  afterEach(() => {
    cleanup();
    vi.unstubAllGlobals();
  });

  it("keeps the conversation across a remount, with the system prompt sent first", async () => {
    const mock = serve([token("Hello"), token("!", "stop")]);
    const first = render(<Chat />);
    fireEvent.click(screen.getByTestId("system-prompt").querySelector("summary")!);
    fireEvent.change(screen.getByTestId("system-prompt-input"), { target: { value: "You are terse." } });
    await send("hi there");
    expect(bodyOf(mock).messages).toEqual([{ role: "system", content: "You are terse." }, { role: "user", content: "hi there" }]);
    expect(reply().dataset.status).toBe("done");
    first.unmount();

    render(<Chat />);
    expect(screen.getByTestId("message-user").textContent).toContain("hi there");
    expect(reply().dataset.status).toBe("done");
    expect(within(reply()).getAllByTestId("token").map((t) => t.textContent)).toEqual(["Hello", "!"]);
    expect((screen.getByTestId("system-prompt-input") as HTMLTextAreaElement).value).toBe("You are terse.");
    expect(screen.getByTestId("chat-title").textContent).toBe("hi there");
  });

  it("new chats, switching between them, and deleting one", async () => {
    serve([token("A", "stop")]);
    render(<Chat />);
    await send("first chat");
    fireEvent.click(screen.getByTestId("chat-new"));
    expect(screen.queryAllByTestId("message-user")).toEqual([]);
    await send("second chat");
    fireEvent.click(screen.getByTestId("chats-toggle"));
    const items = () => screen.getAllByTestId("conversation");
    expect(items().map((li) => li.querySelector(".conversation-open")!.firstChild!.textContent!.trim())).toEqual(["second chat", "first chat"]);
    fireEvent.click(within(items()[1]!).getByTestId("conversation-open"));
    expect(screen.getByTestId("message-user").textContent).toContain("first chat");
    expect(items()[1]!.getAttribute("aria-current")).toBe("true");
    // deleting the conversation on screen shows the next one
    fireEvent.click(within(items()[1]!).getByTestId("conversation-delete"));
    expect(items().length).toBe(1);
    expect(screen.getByTestId("message-user").textContent).toContain("second chat");
  });

  it("regenerate keeps the earlier reply, shown as ‹1/2›; Continue extends the reply shown", async () => {
    const mock = serve([token("One", "stop")], [token("Two", "length")], [token(" more", "stop")]);
    render(<Chat />);
    await send("count");
    fireEvent.click(screen.getByTestId("message-regenerate"));
    await settle();
    expect(screen.getAllByTestId("message-assistant").length).toBe(1);
    expect(screen.getByTestId("message-version").textContent).toBe("2/2");
    expect(text()).toBe("Two");
    fireEvent.click(screen.getByTestId("message-version-prev"));
    expect([screen.getByTestId("message-version").textContent, text()]).toEqual(["1/2", "One"]);
    fireEvent.click(screen.getByTestId("message-version-next"));
    expect(text()).toBe("Two");

    fireEvent.click(screen.getByTestId("message-continue"));
    await settle();
    const body = bodyOf(mock);
    expect(body.messages).toEqual([{ role: "user", content: "count" }, { role: "assistant", content: "Two" }]);
    expect([body.continue_final_message, body.add_generation_prompt, body.n]).toEqual([true, false, 1]);
    expect(text()).toBe("Two more");
    expect(screen.getByTestId("message-version").textContent).toBe("2/2");
  });

  it("leaves a tool call's markup out of the token view once it is a card", async () => {
    const call = { id: "chatcmpl-q1", choices: [{ index: 0, delta: { tool_calls: [{ index: 0, id: "call_0", type: "function", function: { name: "get_weather", arguments: '{"city": "Paris"}' } }] }, logprobs: null, finish_reason: null }] };
    serve([
      token("Let me check."),
      token("<tool_call>", null, false), token('{"name": "get_weather", "arguments": {"city": "Paris"}}', null, false), token("</tool_call>", null, false),
      call,
      { id: "chatcmpl-q1", choices: [{ index: 0, delta: {}, logprobs: null, finish_reason: "tool_calls" }] },
    ]);
    render(<Chat params={{ ...presetParams("greedy"), tools: { text: EXAMPLE_TOOLS, choice: "auto" } }} />);
    await send("weather?");
    expect(within(reply()).getAllByTestId("token").map((t) => t.textContent)).toEqual(["Let me check."]);
    expect(within(reply()).getByTestId("tool-call-name").textContent).toBe("get_weather");
  });

  it("the token view off renders the reply as Markdown with copyable code", async () => {
    serve([token("Use `ls`:\n\n```sh\nls -l\n```\n", "stop")]);
    render(<Chat />);
    await send("how?");
    fireEvent.click(screen.getByTestId("chat-token-view"));
    const content = within(reply()).getByTestId("message-content");
    expect(content.dataset.view).toBe("markdown");
    expect(content.querySelector("pre code")?.textContent).toBe("ls -l\n");
    expect(within(reply()).getAllByTestId("copy-code").length).toBe(1);
  });

  it("an import that is not a chats file says what is wrong and changes nothing", async () => {
    serve([token("A", "stop")]);
    render(<Chat />);
    await send("keep me");
    fireEvent.click(screen.getByTestId("chats-toggle"));
    const file = new File([JSON.stringify({ format: "minivllm-chats", version: 1, conversations: [{ turns: [{ role: "robot" }] }] })], "bad.json", { type: "application/json" });
    await act(async () => {
      fireEvent.change(screen.getByTestId("chats-import-file"), { target: { files: [file] } });
      await frame();
    });
    expect(screen.getByTestId("chats-import-error").textContent).toBe('bad.json: conversations[0].turns[0].role: expected "user" or "assistant", got "robot"');
    expect(screen.getAllByTestId("conversation").length).toBe(1);

    const good = new File([JSON.stringify({ turns: [{ role: "user", content: "imported q" }, { role: "assistant", content: "imported a" }] })], "one.json");
    await act(async () => {
      fireEvent.change(screen.getByTestId("chats-import-file"), { target: { files: [good] } });
      await frame();
    });
    expect(screen.queryByTestId("chats-import-error")).toBeNull();
    expect(screen.getAllByTestId("conversation").length).toBe(2);
    expect(screen.getByTestId("message-user").textContent).toContain("imported q");
    // its settings are unknown: the message says where it came from instead
    expect(reply().querySelector(".message-meta")!.textContent).toBe("imported");
  });

  it("shows the request's drafted and accepted tokens from the live engine", async () => {
    serve([token(" Hi"), token(" there"), token("!", "stop")]);
    const s = new Stream();
    s.add({ type: "request_arrived", request_id: "chatcmpl-q1", prompt_tokens: 3, max_tokens: 8, n: 1, priority: 0, sampling: {}, prompt_preview: "hi" });
    s.add({ type: "seq_added", request_id: "chatcmpl-q1", seq_id: 4, parent_seq_id: null, num_tokens: 3, num_prompt_tokens: 3 });
    s.add({ type: "spec_verified", request_id: "chatcmpl-q1", seq_id: 4, step: 2, method: "ngram", proposed: [101, 102, 105], accepted: 2, token_id: 103 });
    const store = new DashboardStore();
    store.setState(reduce(fromSnapshot(snapshot()), s.events), 1);
    store.publish();
    render(<Chat params={defaultParams()} engine={store} />);
    await send("hi");
    const stats = within(reply()).getByTestId("message-stats");
    expect(stats.querySelector('[data-stat="drafted"] dd')!.textContent).toBe("3");
    expect(stats.querySelector('[data-stat="accepted"] dd')!.textContent).toBe("2 (67%)");
  });
});
