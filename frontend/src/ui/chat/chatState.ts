// The chat playground's conversation as a pure reducer (streaming updates, stop, regenerate, edit
// and resend), so its rules can be tested without a browser.
import type { ChatTurn, DecodingParams, StreamResult } from "../../core/openai";
import { emptyResult } from "../../core/openai";

export interface UserTurn {
  readonly id: string;
  readonly role: "user";
  readonly content: string;
}

export type TurnStatus = "streaming" | "done" | "stopped" | "error";

export interface AssistantTurn {
  readonly id: string;
  readonly role: "assistant";
  readonly params: DecodingParams;
  readonly result: StreamResult;
  readonly status: TurnStatus;
  readonly error: string | null;
  /** The server's X-Request-Id, when it sent one. */
  readonly requestId: string | null;
  readonly startedAt: number;
  readonly firstTokenAt: number | null;
  readonly endedAt: number | null;
  readonly activeChoice: number;
}

export type Turn = UserTurn | AssistantTurn;

export interface ChatState {
  readonly turns: readonly Turn[];
}

export type ChatAction =
  | { type: "send"; userId: string; assistantId: string; content: string; params: DecodingParams; at: number }
  | { type: "edit"; userId: string; content: string; assistantId: string; params: DecodingParams; at: number }
  | { type: "regenerate"; assistantId: string; params: DecodingParams; at: number }
  | { type: "update"; id: string; result: StreamResult; requestId: string | null; firstTokenAt: number | null }
  | { type: "finish"; id: string; status: Exclude<TurnStatus, "streaming">; error?: string; at: number }
  | { type: "choose"; id: string; index: number }
  | { type: "clear" };

export const initialChat: ChatState = { turns: [] };

function assistant(id: string, params: DecodingParams, at: number): AssistantTurn {
  return { id, role: "assistant", params, result: emptyResult(), status: "streaming", error: null, requestId: null, startedAt: at, firstTokenAt: null, endedAt: null, activeChoice: 0 };
}

export function chatReducer(state: ChatState, action: ChatAction): ChatState {
  switch (action.type) {
    case "send":
      return { turns: [...state.turns, { id: action.userId, role: "user", content: action.content }, assistant(action.assistantId, action.params, action.at)] };
    case "edit": {
      const i = state.turns.findIndex((t) => t.id === action.userId && t.role === "user");
      if (i < 0) return state;
      return { turns: [...state.turns.slice(0, i), { id: action.userId, role: "user", content: action.content }, assistant(action.assistantId, action.params, action.at)] };
    }
    case "regenerate": {
      let i = state.turns.length - 1;
      while (i >= 0 && state.turns[i]!.role === "assistant") i--;
      if (i < 0) return state;
      return { turns: [...state.turns.slice(0, i + 1), assistant(action.assistantId, action.params, action.at)] };
    }
    case "update":
      return mapTurn(state, action.id, (t) => ({ ...t, result: action.result, requestId: action.requestId ?? t.requestId, firstTokenAt: t.firstTokenAt ?? action.firstTokenAt }));
    case "finish":
      return mapTurn(state, action.id, (t) => (t.status === "streaming" ? { ...t, status: action.status, error: action.error ?? null, endedAt: action.at } : t));
    case "choose":
      return mapTurn(state, action.id, (t) => ({ ...t, activeChoice: action.index }));
    case "clear":
      return initialChat;
  }
}

function mapTurn(state: ChatState, id: string, fn: (t: AssistantTurn) => AssistantTurn): ChatState {
  let changed = false;
  const turns = state.turns.map((t) => {
    if (t.id !== id || t.role !== "assistant") return t;
    changed = true;
    return fn(t);
  });
  return changed ? { turns } : state;
}

/** The choice on screen: the selected one, or the first while the selected one has not arrived. */
export function activeChoice(t: AssistantTurn) {
  return t.result.choices.find((c) => c.index === t.activeChoice) ?? t.result.choices[0];
}

export function choiceText(t: AssistantTurn): string {
  return activeChoice(t)?.text ?? "";
}

/** The ids the turn's request may have in the engine: the client's, then the server's. */
export function requestCandidates(t: AssistantTurn): string[] {
  return [t.requestId, t.result.id].filter((x): x is string => x !== null);
}

/** Engine request ids matching what the chat knows (X-Request-Id, completion id), exact or as a prefix. */
export function findRequest(ids: Iterable<string>, candidates: readonly string[]): string | null {
  const all = [...ids];
  for (const c of candidates) if (all.includes(c)) return c;
  for (const c of candidates) {
    const hit = all.find((id) => id.startsWith(c) || c.startsWith(id) || id.endsWith(c));
    if (hit !== undefined) return hit;
  }
  return null;
}

/** The messages to send for the assistant turn at `index` (everything before it). */
export function historyBefore(turns: readonly Turn[], index: number): ChatTurn[] {
  const out: ChatTurn[] = [];
  for (const t of turns.slice(0, index)) {
    if (t.role === "user") out.push({ role: "user", content: t.content });
    else if (t.status !== "error") {
      const text = choiceText(t);
      if (text) out.push({ role: "assistant", content: text });
    }
  }
  return out;
}

export function isStreaming(state: ChatState): boolean {
  return state.turns.some((t) => t.role === "assistant" && t.status === "streaming");
}

/** A copy of a StreamResult that React can hold while the stream keeps mutating the original. */
export function cloneResult(r: StreamResult): StreamResult {
  return { ...r, choices: r.choices.map((c) => ({ ...c, tokens: c.tokens.slice(), tool_calls: c.tool_calls.map((t) => ({ ...t })) })) };
}

export interface TurnStats {
  ttft: number | null;
  tokensPerS: number | null;
  promptTokens: number | null;
  cachedTokens: number | null;
  generated: number | null;
  finish: string | null;
  preemptions: number | null;
  e2e: number | null;
  queue: number | null;
}

/** Per-message numbers: the server's timings when present, else measured by the client. */
export function turnStats(t: AssistantTurn): TurnStats {
  const timings = t.result.timings;
  const usage = t.result.usage;
  const choice = activeChoice(t);
  const clientTtft = t.firstTokenAt !== null ? (t.firstTokenAt - t.startedAt) / 1000 : null;
  const generated = usage?.completion_tokens ?? timings?.generated_tokens ?? (t.result.choices.reduce((n, c) => n + c.tokens.length, 0) || null);
  const decodeS = t.endedAt !== null && t.firstTokenAt !== null ? (t.endedAt - t.firstTokenAt) / 1000 : null;
  const clientRate = generated !== null && decodeS !== null && decodeS > 0 && generated > 1 ? (generated - 1) / decodeS : null;
  return {
    ttft: timings?.ttft_s ?? clientTtft,
    tokensPerS: timings?.tokens_per_s ?? clientRate,
    promptTokens: usage?.prompt_tokens ?? timings?.prompt_tokens ?? null,
    cachedTokens: timings?.cached_prompt_tokens ?? usage?.cached_tokens ?? null,
    generated,
    finish: choice?.finish_reason ?? (t.status === "stopped" ? "abort" : null),
    preemptions: timings?.num_preemptions ?? null,
    e2e: timings?.e2e_s ?? (t.endedAt !== null ? (t.endedAt - t.startedAt) / 1000 : null),
    queue: timings?.queue_s ?? null,
  };
}

/** Wall-clock milliseconds for turn timings (event handlers only). */
export function clockMs(): number {
  return performance.now();
}
