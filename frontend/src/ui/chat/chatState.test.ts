import { describe, expect, it } from "vitest";
import { defaultParams, emptyResult } from "../../core/openai";
import { chatReducer, choiceText, historyBefore, initialChat, isStreaming, turnStats, type AssistantTurn } from "./chatState";

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

  it("regenerate keeps the earlier reply as a version; edit truncates and resends", () => {
    let s = chatReducer(initialChat, { type: "send", userId: "u1", assistantId: "a1", content: "one", params: p, at: 0 });
    s = chatReducer(s, { type: "finish", id: "a1", status: "done", at: 1 });
    s = chatReducer(s, { type: "send", userId: "u2", assistantId: "a2", content: "two", params: p, at: 2 });
    s = chatReducer(s, { type: "update", id: "a2", result: reply("first"), requestId: "r2", firstTokenAt: 2 });
    s = chatReducer(s, { type: "finish", id: "a2", status: "done", at: 3 });
    s = chatReducer(s, { type: "regenerate", assistantId: "a3", params: p, at: 4 });
    // one message, two versions, the new one shown and streaming
    expect(s.turns.map((t) => t.id)).toEqual(["u1", "a1", "u2", "a2"]);
    let a = s.turns[3] as AssistantTurn;
    expect([a.versions.length, a.shown, a.status, a.key]).toEqual([2, 1, "streaming", "a3"]);
    expect(isStreaming(s)).toBe(true);
    // switching versions waits for the stream to end
    expect(chatReducer(s, { type: "version", id: "a2", index: 0 })).toBe(s);
    s = chatReducer(s, { type: "update", id: "a3", result: reply("second"), requestId: "r3", firstTokenAt: 5 });
    s = chatReducer(s, { type: "finish", id: "a3", status: "done", at: 6 });
    expect(choiceText(s.turns[3] as AssistantTurn)).toBe("second");
    s = chatReducer(s, { type: "version", id: "a2", index: 0 });
    a = s.turns[3] as AssistantTurn;
    expect([a.shown, choiceText(a), a.requestId]).toEqual([0, "first", "r2"]);
    // the history sent next carries the version on screen
    expect(historyBefore(s.turns, 4).at(-1)).toEqual({ role: "assistant", content: "first" });
    s = chatReducer(s, { type: "edit", userId: "u1", content: "uno", assistantId: "a4", params: p, at: 5 });
    expect(s.turns.map((t) => t.id)).toEqual(["u1", "a4"]);
    expect(s.turns[0]).toMatchObject({ content: "uno" });
  });

  it("continue extends the shown reply's text and tokens with the new stream's", () => {
    const tokens = (texts: string[]) => texts.map((text) => ({ text, logprob: -0.1, top: [] }));
    let s = chatReducer(initialChat, { type: "send", userId: "u1", assistantId: "a1", content: "count", params: p, at: 0 });
    s = chatReducer(s, { type: "update", id: "a1", result: { ...emptyResult(), choices: [{ index: 0, text: "1 2", tokens: tokens(["1", " 2"]), tool_calls: [], finish_reason: "length" }] }, requestId: "r1", firstTokenAt: 1 });
    s = chatReducer(s, { type: "finish", id: "a1", status: "done", at: 2 });
    s = chatReducer(s, { type: "continue", key: "k2", at: 3 });
    expect(isStreaming(s)).toBe(true);
    expect(choiceText(s.turns[1] as AssistantTurn)).toBe("1 2"); // the text so far stays on screen
    s = chatReducer(s, { type: "update", id: "k2", result: { ...emptyResult(), choices: [{ index: 0, text: " 3", tokens: tokens([" 3"]), tool_calls: [], finish_reason: "stop" }] }, requestId: "r2", firstTokenAt: 4, at: 5 });
    s = chatReducer(s, { type: "finish", id: "k2", status: "done", at: 6 });
    const a = s.turns[1] as AssistantTurn;
    expect(choiceText(a)).toBe("1 2 3");
    expect(a.result.choices[0]!.tokens.map((t) => t.text)).toEqual(["1", " 2", " 3"]);
    expect([a.versions.length, a.requestId, a.result.choices[0]!.finish_reason]).toEqual([1, "r2", "stop"]);
    // the stats count what the continuation generated, not the text it started from
    expect(turnStats(a).generated).toBe(1);
  });

  it("measures tokens/s live while streaming; keeps the speculative counts", () => {
    const tokens = Array.from({ length: 11 }, (_, i) => ({ text: `t${i}`, logprob: null, top: [] }));
    let s = chatReducer(initialChat, { type: "send", userId: "u1", assistantId: "a1", content: "go", params: p, at: 0 });
    s = chatReducer(s, { type: "update", id: "a1", result: { ...emptyResult(), choices: [{ index: 0, text: "", tokens, tool_calls: [], finish_reason: null }] }, requestId: "r1", firstTokenAt: 100, at: 600 });
    const live = turnStats(s.turns[1] as AssistantTurn);
    expect(live.live).toBe(true);
    expect(live.tokensPerS).toBeCloseTo(20); // 10 tokens after the first in 0.5 s
    s = chatReducer(s, { type: "spec", id: "a1", spec: { drafted: 12, accepted: 9 } });
    const same = chatReducer(s, { type: "spec", id: "a1", spec: { drafted: 12, accepted: 9 } });
    expect(same).toBe(s); // unchanged counts do not re-render
    s = chatReducer(s, { type: "finish", id: "a1", status: "done", at: 1100 });
    const done = turnStats(s.turns[1] as AssistantTurn);
    expect([done.live, done.drafted, done.accepted]).toEqual([false, 12, 9]);
    expect(done.tokensPerS).toBeCloseTo(10); // 10 tokens in 1 s once finished
  });
});
