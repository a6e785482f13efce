import { describe, expect, it } from "vitest";
import { defaultParams } from "../../core/openai";
import { activeConversation, chatsReducer, conversationTitle, initialChats, requestMessages, type ChatsState } from "./conversations";

const p = defaultParams();

function withMessage(s: ChatsState, n: number): ChatsState {
  return chatsReducer(s, { type: "chat", action: { type: "send", userId: `u${n}`, assistantId: `a${n}`, content: `message ${n}`, params: p, at: 0 }, now: n });
}

describe("conversations", () => {
  it("new, switch and delete; an untouched new chat is reused", () => {
    let s = withMessage(initialChats("c1", 0), 1);
    s = chatsReducer(s, { type: "new", id: "c2", now: 2 });
    expect(s.activeId).toBe("c2");
    expect(chatsReducer(s, { type: "new", id: "c3", now: 3 })).toBe(s); // c2 is still empty
    s = withMessage(s, 2);
    expect(s.conversations.map((c) => c.id)).toEqual(["c2", "c1"]);
    s = chatsReducer(s, { type: "switch", id: "c1" });
    expect(activeConversation(s).turns.map((t) => t.id)).toEqual(["u1", "a1"]);
    s = chatsReducer(s, { type: "delete", id: "c1", freshId: "x", now: 4 });
    expect([s.activeId, s.conversations.length]).toEqual(["c2", 1]);
    // deleting the last one leaves a fresh, empty conversation
    s = chatsReducer(s, { type: "delete", id: "c2", freshId: "c9", now: 5 });
    expect(s.conversations.map((c) => [c.id, c.turns.length])).toEqual([["c9", 0]]);
  });

  it("a stream's updates land in its own conversation, even when another is on screen", () => {
    let s = withMessage(initialChats("c1", 0), 1);
    s = chatsReducer(s, { type: "new", id: "c2", now: 2 });
    s = chatsReducer(s, { type: "chat", action: { type: "finish", id: "a1", status: "done", at: 9 }, now: 9 });
    const c1 = s.conversations.find((c) => c.id === "c1")!;
    expect(c1.turns[1]).toMatchObject({ status: "done" });
    expect(activeConversation(s).turns).toEqual([]);
    // what the user does applies to the conversation on screen only
    s = chatsReducer(s, { type: "chat", action: { type: "clear" }, now: 10 });
    expect(s.conversations.find((c) => c.id === "c1")!.turns.length).toBe(2);
  });

  it("the system prompt is per conversation and goes first in the request", () => {
    let s = withMessage(initialChats("c1", 0), 1);
    s = chatsReducer(s, { type: "system", text: "You are terse.", now: 1 });
    const c = activeConversation(s);
    expect(requestMessages(c.systemPrompt, c.turns, 1)).toEqual([{ role: "system", content: "You are terse." }, { role: "user", content: "message 1" }]);
    expect(requestMessages("  ", c.turns, 1)).toEqual([{ role: "user", content: "message 1" }]);
    s = chatsReducer(s, { type: "new", id: "c2", now: 2 });
    expect(activeConversation(s).systemPrompt).toBe("");
  });

  it("imports beside the others, renaming clashing ids and dropping an empty chat on screen", () => {
    let s = withMessage(initialChats("c1", 0), 1);
    s = chatsReducer(s, { type: "new", id: "c2", now: 2 });
    const imported = [{ ...activeConversation(withMessage(initialChats("c1", 0), 7)), title: "from file" }];
    s = chatsReducer(s, { type: "import", conversations: imported });
    expect(s.conversations.map((c) => c.id)).toEqual(["c1-2", "c1"]);
    expect(s.activeId).toBe("c1-2");
  });

  it("names a conversation after its first message", () => {
    const s = withMessage(initialChats("c1", 0), 1);
    expect(conversationTitle(activeConversation(s))).toBe("message 1");
    expect(conversationTitle(activeConversation(initialChats("c", 0)))).toBe("New chat");
    expect(conversationTitle({ ...activeConversation(s), title: " Mine " })).toBe("Mine");
  });
});
