// Several conversations, one on screen: each with its own turns and system prompt. Pure, so the
// rules (new, switch, delete, import, stream updates that land in a conversation not on screen)
// are testable without a browser.
import type { ChatTurn } from "../../core/openai";
import { chatReducer, historyBefore, type ChatAction, type Turn } from "./chatState";

export interface Conversation {
  readonly id: string;
  /** Empty: named after its first message (conversationTitle). */
  readonly title: string;
  /** Sent as the system message; empty: none (the model's template may add its own default). */
  readonly systemPrompt: string;
  /** Epoch milliseconds. */
  readonly createdAt: number;
  readonly updatedAt: number;
  readonly turns: readonly Turn[];
}

export interface ChatsState {
  /** Most recently used first. */
  readonly conversations: readonly Conversation[];
  readonly activeId: string;
}

export type ChatsAction =
  /** A chat action for the conversation on screen; updates and finishes find their own (by stream key). */
  | { type: "chat"; action: ChatAction; now: number }
  | { type: "new"; id: string; now: number }
  | { type: "switch"; id: string }
  /** Deletes `id`; `freshId` names the empty conversation that replaces the last one. */
  | { type: "delete"; id: string; freshId: string; now: number }
  | { type: "system"; text: string; now: number }
  /** Adds imported conversations (given fresh ids where they clash) and shows the first. */
  | { type: "import"; conversations: readonly Conversation[] };

export function emptyConversation(id: string, now: number): Conversation {
  return { id, title: "", systemPrompt: "", createdAt: now, updatedAt: now, turns: [] };
}

export function initialChats(id: string, now: number): ChatsState {
  return { conversations: [emptyConversation(id, now)], activeId: id };
}

export function activeConversation(s: ChatsState): Conversation {
  return s.conversations.find((c) => c.id === s.activeId) ?? s.conversations[0]!;
}

/** The stream actions (update, finish, spec) carry a stream key that names one reply anywhere. */
const STREAM_ACTIONS: ReadonlySet<ChatAction["type"]> = new Set(["update", "finish", "spec"]);

export function chatsReducer(state: ChatsState, action: ChatsAction): ChatsState {
  switch (action.type) {
    case "chat": {
      const everywhere = STREAM_ACTIONS.has(action.action.type);
      let changed = false;
      const conversations = state.conversations.map((c) => {
        if (!everywhere && c.id !== state.activeId) return c;
        const next = chatReducer({ turns: c.turns }, action.action);
        if (next.turns === c.turns) return c;
        changed = true;
        // streamed tokens do not make a conversation "recently used"; what the user does does
        return { ...c, turns: next.turns, updatedAt: everywhere ? c.updatedAt : action.now };
      });
      return changed ? { ...state, conversations } : state;
    }
    case "new": {
      const current = activeConversation(state);
      // an untouched empty conversation is reused rather than piling up
      if (current.turns.length === 0 && current.systemPrompt === "") return state;
      return { conversations: [emptyConversation(action.id, action.now), ...state.conversations], activeId: action.id };
    }
    case "switch":
      return state.conversations.some((c) => c.id === action.id) ? { ...state, activeId: action.id } : state;
    case "delete": {
      const rest = state.conversations.filter((c) => c.id !== action.id);
      if (rest.length === state.conversations.length) return state;
      if (rest.length === 0) return initialChats(action.freshId, action.now);
      return { conversations: rest, activeId: state.activeId === action.id ? rest[0]!.id : state.activeId };
    }
    case "system":
      return {
        ...state,
        conversations: state.conversations.map((c) => (c.id === state.activeId ? { ...c, systemPrompt: action.text, updatedAt: action.now } : c)),
      };
    case "import": {
      if (action.conversations.length === 0) return state;
      const taken = new Set(state.conversations.map((c) => c.id));
      const added = action.conversations.map((c) => {
        let id = c.id;
        for (let k = 2; taken.has(id); k++) id = `${c.id}-${k}`;
        taken.add(id);
        return id === c.id ? c : { ...c, id };
      });
      // an empty conversation on screen makes way for the imported ones
      const keep = state.conversations.filter((c) => c.turns.length > 0 || c.systemPrompt !== "");
      return { conversations: [...added, ...keep], activeId: added[0]!.id };
    }
  }
}

/** The conversation's name in the list: its title, else its first message's start. */
export function conversationTitle(c: Conversation): string {
  if (c.title.trim()) return c.title.trim();
  const first = c.turns.find((t) => t.role === "user");
  if (first === undefined || first.role !== "user") return "New chat";
  const line = first.content.trim().split("\n")[0]!;
  return line.length > 48 ? `${line.slice(0, 47)}…` : line;
}

/** The messages for the request that writes the assistant turn at `index`: the system prompt, then
 * everything before the turn. */
export function requestMessages(systemPrompt: string, turns: readonly Turn[], index: number): ChatTurn[] {
  const history = historyBefore(turns, index);
  return systemPrompt.trim() ? [{ role: "system", content: systemPrompt }, ...history] : history;
}

let counter = 0;

/** Ids unique across reloads (the conversations are kept in local storage). */
export function uniqueId(prefix: string): string {
  counter += 1;
  return `${prefix}${Date.now().toString(36)}${counter.toString(36)}${Math.random().toString(36).slice(2, 6)}`;
}
