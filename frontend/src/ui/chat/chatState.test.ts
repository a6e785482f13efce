import { describe, expect, it } from "vitest";
import { defaultParams, emptyResult } from "../../core/openai";
import { chatReducer, historyBefore, initialChat, isStreaming, turnStats, type AssistantTurn } from "./chatState";

const p = defaultParams();
const reply = (text: string) => ({ ...emptyResult(), choices: [{ index: 0, text, tokens: [], tool_calls: [], finish_reason: "stop" }] });

describe("chat conversation", () => {
  it("sends, streams, finishes; history carries the reply", () => {
    let s = chatReducer(initialChat, { type: "send", userId: "u1", assistantId: "a1", content: "hi", params: p, at: 0 });
    expect(isStreaming(s)).toBe(true);
    s = chatReducer(s, { type: "update", id: "a1", result: reply("hello"), requestId: "r1", firstTokenAt: 50 });
    s = chatReducer(s, { type: "finish", id: "a1", status: "done", at: 250 });
    expect(isStreaming(s)).toBe(false);
    expect(historyBefore(s.turns, s.turns.length)).toEqual([{ role: "user", content: "hi" }, { role: "assistant", content: "hello" }]);
    const a = s.turns[1] as AssistantTurn;
    expect(a.requestId).toBe("r1");
    expect(turnStats(a).ttft).toBeCloseTo(0.05);
  });

  it("stop keeps the partial text; finish after stop does not override", () => {
    let s = chatReducer(initialChat, { type: "send", userId: "u1", assistantId: "a1", content: "hi", params: p, at: 0 });
    s = chatReducer(s, { type: "update", id: "a1", result: reply("par"), requestId: null, firstTokenAt: 10 });
    s = chatReducer(s, { type: "finish", id: "a1", status: "stopped", at: 20 });
    s = chatReducer(s, { type: "finish", id: "a1", status: "error", error: "x", at: 30 });
    const a = s.turns[1] as AssistantTurn;
    expect(a.status).toBe("stopped");
    expect(turnStats(a).finish).toBe("stop");
  });

  it("regenerate replaces the last reply; edit truncates and resends", () => {
    let s = chatReducer(initialChat, { type: "send", userId: "u1", assistantId: "a1", content: "one", params: p, at: 0 });
    s = chatReducer(s, { type: "finish", id: "a1", status: "done", at: 1 });
    s = chatReducer(s, { type: "send", userId: "u2", assistantId: "a2", content: "two", params: p, at: 2 });
    s = chatReducer(s, { type: "finish", id: "a2", status: "done", at: 3 });
    s = chatReducer(s, { type: "regenerate", assistantId: "a3", params: p, at: 4 });
    expect(s.turns.map((t) => t.id)).toEqual(["u1", "a1", "u2", "a3"]);
    s = chatReducer(s, { type: "edit", userId: "u1", content: "uno", assistantId: "a4", params: p, at: 5 });
    expect(s.turns.map((t) => t.id)).toEqual(["u1", "a4"]);
    expect(s.turns[0]).toMatchObject({ content: "uno" });
  });
});
