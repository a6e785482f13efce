import { describe, expect, it } from "vitest";
import { defaultParams, emptyResult } from "../../core/openai";
import { chatsFile, loadChats, parseChats, saveChats, STORAGE_KEY } from "./chatFile";
import { chatReducer, initialChat, type AssistantTurn } from "./chatState";
import { type ChatsState } from "./conversations";

const file = (conversations: unknown) => JSON.stringify({ format: "minivllm-chats", version: 1, conversations });
const reply = (over: Record<string, unknown>) => ({ result: { choices: [{ index: 0, text: "x", finish_reason: "stop" }] }, ...over });

/** Files an import must refuse, with the message it must give. */
const chatFileProblemExamples: [string, string, string][] = [
  ["not JSON", "{", "Not valid JSON: " + (() => { try { JSON.parse("{"); } catch (e) { return (e as Error).message; } return ""; })()],
  ["another file", JSON.stringify({ name: "x" }), 'Not a chats file: expected "format": "minivllm-chats" with "conversations" (or a conversation with "turns")'],
  ["another format", JSON.stringify({ format: "openwebui", conversations: [] }), 'format: expected "minivllm-chats", got "openwebui"'],
  ["a newer version", JSON.stringify({ format: "minivllm-chats", version: 2, conversations: [] }), "version: this dashboard reads version 1, the file has 2"],
  ["a number", "3", "the file: expected an object, got a number"],
  ["conversations not a list", file({}), "conversations: expected an array, got an object"],
  ["a turn's role", file([{ turns: [{ role: "bot", content: "x" }] }]), 'conversations[0].turns[0].role: expected "user" or "assistant", got "bot"'],
  ["a user's content", file([{ turns: [{ role: "user", content: 5 }] }]), "conversations[0].turns[0].content: expected a string, got a number"],
  ["no versions", file([{ turns: [{ role: "assistant", versions: [] }] }]), "conversations[0].turns[0].versions: expected at least one version, got an empty array"],
  ["a choice's text", file([{ turns: [{ role: "assistant", versions: [{ result: { choices: [{ text: null }] } }] }] }]), "conversations[0].turns[0].versions[0].result.choices[0].text: expected a string, got null"],
  ["a token's logprob", file([{ turns: [{ role: "assistant", versions: [reply({ result: { choices: [{ text: "x", tokens: [{ text: "x", logprob: "low" }] }] } })] }] }]),
    "conversations[0].turns[0].versions[0].result.choices[0].tokens[0].logprob: expected a number, got a string"],
  ["a status", file([{ turns: [{ role: "assistant", versions: [reply({ status: "lost" })] }] }]), 'conversations[0].turns[0].versions[0].status: "lost" is not one of done, stopped, error'],
  ["a setting", file([{ turns: [{ role: "assistant", versions: [reply({ params: { temperature: "hot" } })] }] }]), "conversations[0].turns[0].versions[0].params.temperature: expected a number, got a string"],
  ["a structured mode", file([{ turns: [{ role: "assistant", versions: [reply({ params: { structured: { mode: "xml" } } })] }] }]),
    'conversations[0].turns[0].versions[0].params.structured.mode: "xml" is not one of none, json_object, json_schema, regex, choice, grammar'],
  ["a system prompt", file([{ systemPrompt: ["a"], turns: [] }]), "conversations[0].systemPrompt: expected a string, got an array"],
];

function sampleState(): ChatsState {
  const p = defaultParams();
  let s = chatReducer(initialChat, { type: "send", userId: "u1", assistantId: "a1", content: "hi", params: p, at: 0 });
  const result = { ...emptyResult(), id: "chatcmpl-1", choices: [{ index: 0, text: "Hello!", tokens: [{ text: "Hello", logprob: -0.1, top: [{ token: "Hello", logprob: -0.1 }, { token: "Hi", logprob: -2.5 }] }, { text: "!", logprob: -0.3, top: [] }], tool_calls: [], finish_reason: "stop" }] };
  s = chatReducer(s, { type: "update", id: "a1", result, requestId: "r1", firstTokenAt: 5, at: 9 });
  s = chatReducer(s, { type: "finish", id: "a1", status: "done", at: 10 });
  s = chatReducer(s, { type: "regenerate", assistantId: "a2", params: { ...p, temperature: 0 }, at: 11 });
  s = chatReducer(s, { type: "update", id: "a2", result: { ...result, choices: [{ ...result.choices[0]!, text: "Hi." }] }, requestId: "r2", firstTokenAt: 12 });
  return { conversations: [{ id: "c1", title: "", systemPrompt: "Be brief.", createdAt: 1, updatedAt: 2, turns: s.turns }], activeId: "c1" };
}

class MemoryStorage {
  items = new Map<string, string>();
  quota = Infinity;
  getItem(k: string) { return this.items.get(k) ?? null; }
  setItem(k: string, v: string) {
    if (v.length > this.quota) throw new DOMException("full", "QuotaExceededError");
    this.items.set(k, v);
  }
}

describe("chats as JSON", () => {
  it("round-trips through storage; a reply cut off by the reload reads as stopped", () => {
    const store = new MemoryStorage();
    const state = sampleState();
    expect(saveChats(store, state)).toBeNull();
    const back = loadChats(store, 100)!;
    const c = back.conversations[0]!;
    expect([back.activeId, c.systemPrompt]).toEqual(["c1", "Be brief."]);
    const a = c.turns[1] as AssistantTurn;
    expect([a.versions.length, a.shown]).toEqual([2, 1]);
    expect(a.status).toBe("stopped"); // it was streaming when saved
    expect(a.versions[0]!.status).toBe("done");
    expect(a.versions[0]!.result.choices[0]!.tokens[0]!.top).toEqual([{ token: "Hello", logprob: -0.1 }, { token: "Hi", logprob: -2.5 }]);
    expect(a.result.choices[0]!.text).toBe("Hi.");
    expect(a.params.temperature).toBe(0);
  });

  it("writes each assistant message once (its versions), not its flat copy too", () => {
    const file = chatsFile(sampleState());
    const turn = file.conversations[0]!.turns[1] as unknown as Record<string, unknown>;
    expect(Object.keys(turn).sort()).toEqual(["id", "role", "shown", "versions"]);
  });

  it("on a full storage keeps the chats without the top alternatives, and says so", () => {
    const state = sampleState();
    const store = new MemoryStorage();
    store.quota = JSON.stringify(chatsFile(state)).length - 1;
    expect(saveChats(store, state)).toMatch(/top alternatives/);
    const a = loadChats(store, 0)!.conversations[0]!.turns[1] as AssistantTurn;
    expect(a.versions[0]!.result.choices[0]!.tokens[0]!.top).toEqual([]);
    store.quota = 10;
    expect(saveChats(store, state)).toMatch(/not kept/);
    expect(saveChats(null, state)).toMatch(/not available/);
  });

  it("imports an exported file, a list, one conversation, and the short assistant form", () => {
    const text = JSON.stringify(chatsFile(sampleState()));
    const parsed = parseChats(text, 0);
    expect(parsed.ok && parsed.conversations[0]!.turns.length).toBe(2);
    const one = parseChats(JSON.stringify({ turns: [{ role: "user", content: "q" }, { role: "assistant", content: "**a**" }] }), 7);
    expect(one.ok).toBe(true);
    if (one.ok) {
      const a = one.conversations[0]!.turns[1] as AssistantTurn;
      expect([a.status, a.result.choices[0]!.text, one.conversations[0]!.createdAt]).toEqual(["done", "**a**", 7]);
    }
    expect(parseChats("[]", 0)).toEqual({ ok: true, conversations: [], activeId: null });
  });

  it.each(chatFileProblemExamples)("says what is wrong and where: %s", (_name, text, message) => {
    const parsed = parseChats(text, 0);
    expect(parsed.ok).toBe(false);
    if (!parsed.ok) expect(parsed.error).toBe(message);
  });

  it("reads nothing from an empty or unreadable storage", () => {
    const store = new MemoryStorage();
    expect(loadChats(store, 0)).toBeNull();
    store.items.set(STORAGE_KEY, "{broken");
    expect(loadChats(store, 0)).toBeNull();
    expect(loadChats(null, 0)).toBeNull();
  });
});
