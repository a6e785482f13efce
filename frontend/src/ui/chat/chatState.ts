// The chat playground's conversation as a pure reducer (streaming updates, stop, regenerate keeping
// the earlier replies as versions, Continue, edit and resend), so its rules can be tested without a
// browser.
import type { ChatTurn, ChoiceResult, DecodingParams, StreamResult } from "../../core/openai";
import { emptyResult } from "../../core/openai";

export interface UserTurn {
  readonly id: string;
  readonly role: "user";
  readonly content: string;
}

export type TurnStatus = "streaming" | "done" | "stopped" | "error";

/** Speculative decoding's counts for a reply's request, from the live engine's events. */
export interface SpecCounts {
  /** Drafted tokens the target model verified. */
  readonly drafted: number;
  /** Drafted tokens it accepted. */
  readonly accepted: number;
}

/** One version of an assistant reply (regenerate adds versions; the message shows one at a time). */
export interface Reply {
  /** The stream that writes this version (its updates and finish carry it as `id`). */
  readonly key: string;
  readonly params: DecodingParams;
  readonly result: StreamResult;
  readonly status: TurnStatus;
  readonly error: string | null;
  /** The server's X-Request-Id, when it sent one. */
  readonly requestId: string | null;
  readonly startedAt: number;
  readonly firstTokenAt: number | null;
  readonly endedAt: number | null;
  /** When the last update arrived (live tokens/s while streaming). */
  readonly updatedAt: number | null;
  readonly activeChoice: number;
  readonly spec: SpecCounts | null;
  /** Continue: the choice as it was before the continuation, which the streamed text extends. */
  readonly base: ChoiceResult | null;
}

/** An assistant message: the fields of the version on screen, plus every version. Invariant: the
 * flat Reply fields equal versions[shown] (assistantTurn() keeps them so). */
export interface AssistantTurn extends Reply {
  readonly id: string;
  readonly role: "assistant";
  readonly versions: readonly Reply[];
  readonly shown: number;
}

export type Turn = UserTurn | AssistantTurn;

export interface ChatState {
  readonly turns: readonly Turn[];
}

export type ChatAction =
  | { type: "send"; userId: string; assistantId: string; content: string; params: DecodingParams; at: number }
  | { type: "edit"; userId: string; content: string; assistantId: string; params: DecodingParams; at: number }
  /** A new version of the last reply, shown (streamed by `assistantId`). */
  | { type: "regenerate"; assistantId: string; params: DecodingParams; at: number }
  /** The last reply's shown version goes on streaming (by `key`). */
  | { type: "continue"; key: string; at: number }
  | { type: "update"; id: string; result: StreamResult; requestId: string | null; firstTokenAt: number | null; at?: number }
  | { type: "finish"; id: string; status: Exclude<TurnStatus, "streaming">; error?: string; at: number }
  | { type: "choose"; id: string; index: number }
  /** Show version `index` of message `id`. */
  | { type: "version"; id: string; index: number }
  | { type: "spec"; id: string; spec: SpecCounts }
  | { type: "clear" };

export const initialChat: ChatState = { turns: [] };

export function newReply(key: string, params: DecodingParams, at: number): Reply {
  return { key, params, result: emptyResult(), status: "streaming", error: null, requestId: null, startedAt: at, firstTokenAt: null, endedAt: null, updatedAt: null, activeChoice: 0, spec: null, base: null };
}

/** The message with these versions, `shown` on screen. */
export function assistantTurn(id: string, versions: readonly Reply[], shown: number): AssistantTurn {
  const i = Math.max(0, Math.min(versions.length - 1, shown));
  return { ...versions[i]!, id, role: "assistant", versions, shown: i };
}

function assistant(id: string, params: DecodingParams, at: number): AssistantTurn {
  return assistantTurn(id, [newReply(id, params, at)], 0);
}

function lastAssistantIndex(turns: readonly Turn[]): number {
  for (let i = turns.length - 1; i >= 0; i--) if (turns[i]!.role === "assistant") return i;
  return -1;
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
      const last = state.turns[i + 1];
      const reply = newReply(action.assistantId, action.params, action.at);
      // the new version joins the earlier ones (one message, ‹n/m›)
      const turn = last?.role === "assistant" ? assistantTurn(last.id, [...last.versions, reply], last.versions.length) : assistant(action.assistantId, action.params, action.at);
      return { turns: [...state.turns.slice(0, i + 1), turn] };
    }
    case "continue": {
      const i = lastAssistantIndex(state.turns);
      const t = state.turns[i] as AssistantTurn | undefined;
      if (t === undefined || t.status === "streaming") return state;
      const choice = activeChoice(t);
      const base: ChoiceResult = choice === undefined ? { index: 0, text: "", tokens: [], tool_calls: [], finish_reason: null } : { ...choice, index: 0 };
      const reply: Reply = { ...t, key: action.key, status: "streaming", error: null, base, activeChoice: 0, result: { ...emptyResult(), choices: [base] }, startedAt: action.at, firstTokenAt: null, endedAt: null, updatedAt: null };
      return { turns: state.turns.map((x, k) => (k === i ? replaceShown(t, reply) : x)) };
    }
    case "update":
      return mapReply(state, action.id, (r) => ({
        ...r,
        result: r.base === null ? action.result : extendChoice(r.base, action.result),
        requestId: action.requestId ?? r.requestId,
        firstTokenAt: r.firstTokenAt ?? action.firstTokenAt,
        updatedAt: action.at ?? r.updatedAt,
      }));
    case "finish":
      return mapReply(state, action.id, (r) => (r.status === "streaming" ? { ...r, status: action.status, error: action.error ?? null, endedAt: action.at } : r));
    case "choose":
      return mapTurn(state, action.id, (t) => replaceShown(t, { ...t, activeChoice: action.index }));
    case "version":
      return mapTurn(state, action.id, (t) => (t.status === "streaming" ? t : assistantTurn(t.id, t.versions, action.index)));
    case "spec":
      return mapReply(state, action.id, (r) => (r.spec?.drafted === action.spec.drafted && r.spec.accepted === action.spec.accepted ? r : { ...r, spec: action.spec }));
    case "clear":
      return initialChat;
  }
}

/** The continuation's streamed choice 0 appended to the choice it continues. */
function extendChoice(base: ChoiceResult, r: StreamResult): StreamResult {
  const more = r.choices.find((c) => c.index === 0);
  const choice: ChoiceResult = more === undefined ? base : { ...more, text: base.text + more.text, tokens: [...base.tokens, ...more.tokens], tool_calls: [...base.tool_calls, ...more.tool_calls] };
  return { ...r, choices: [choice] };
}

function replyOf(t: AssistantTurn): Reply {
  const { id: _id, role: _role, versions: _v, shown: _s, ...reply } = t;
  return reply;
}

/** The turn with its shown version replaced. */
function replaceShown(t: AssistantTurn, r: Reply): AssistantTurn {
  return assistantTurn(t.id, t.versions.map((v, k) => (k === t.shown ? replyOf({ ...t, ...r }) : v)), t.shown);
}

function mapTurn(state: ChatState, id: string, fn: (t: AssistantTurn) => AssistantTurn): ChatState {
  let changed = false;
  const turns = state.turns.map((t) => {
    if (t.id !== id || t.role !== "assistant") return t;
    const next = fn(t);
    if (next !== t) changed = true;
    return next;
  });
  return changed ? { turns } : state;
}

/** Applies `fn` to the version written by stream `key`, wherever it is. */
function mapReply(state: ChatState, key: string, fn: (r: Reply) => Reply): ChatState {
  let changed = false;
  const turns = state.turns.map((t) => {
    if (t.role !== "assistant") return t;
    const k = t.versions.findIndex((v) => v.key === key);
    if (k < 0) return t;
    const next = fn(t.versions[k]!);
    if (next === t.versions[k]) return t;
    changed = true;
    return assistantTurn(t.id, t.versions.map((v, j) => (j === k ? next : v)), t.shown);
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
  return state.turns.some((t) => t.role === "assistant" && t.versions.some((v) => v.status === "streaming"));
}

/** A copy of a StreamResult that React can hold while the stream keeps mutating the original. */
export function cloneResult(r: StreamResult): StreamResult {
  return { ...r, choices: r.choices.map((c) => ({ ...c, tokens: c.tokens.slice(), tool_calls: c.tool_calls.map((t) => ({ ...t })) })) };
}

export interface TurnStats {
  ttft: number | null;
  tokensPerS: number | null;
  /** tokensPerS is the client's running measure while the reply streams. */
  live: boolean;
  promptTokens: number | null;
  cachedTokens: number | null;
  generated: number | null;
  finish: string | null;
  preemptions: number | null;
  e2e: number | null;
  queue: number | null;
  drafted: number | null;
  accepted: number | null;
}

/** Per-message numbers: the server's timings when present, else measured by the client (while
 * streaming: tokens so far over the time since the first one). */
export function turnStats(t: Reply): TurnStats {
  const timings = t.result.timings;
  const usage = t.result.usage;
  const choice = t.result.choices.find((c) => c.index === t.activeChoice) ?? t.result.choices[0];
  const clientTtft = t.firstTokenAt !== null ? (t.firstTokenAt - t.startedAt) / 1000 : null;
  // a continuation's earlier tokens were not generated by this request
  const streamed = t.result.choices.reduce((n, c) => n + c.tokens.length, 0) - (t.base?.tokens.length ?? 0);
  const generated = usage?.completion_tokens ?? timings?.generated_tokens ?? (streamed > 0 ? streamed : null);
  const live = t.status === "streaming";
  const until = live ? t.updatedAt : t.endedAt;
  const decodeS = until !== null && t.firstTokenAt !== null ? (until - t.firstTokenAt) / 1000 : null;
  const clientRate = generated !== null && decodeS !== null && decodeS > 0 && generated > 1 ? (generated - 1) / decodeS : null;
  return {
    ttft: timings?.ttft_s ?? clientTtft,
    tokensPerS: timings?.tokens_per_s ?? clientRate,
    live: live && timings?.tokens_per_s == null,
    promptTokens: usage?.prompt_tokens ?? timings?.prompt_tokens ?? null,
    cachedTokens: timings?.cached_prompt_tokens ?? usage?.cached_tokens ?? null,
    generated,
    finish: choice?.finish_reason ?? (t.status === "stopped" ? "abort" : null),
    preemptions: timings?.num_preemptions ?? null,
    e2e: timings?.e2e_s ?? (t.endedAt !== null ? (t.endedAt - t.startedAt) / 1000 : null),
    queue: timings?.queue_s ?? null,
    drafted: t.spec?.drafted ?? null,
    accepted: t.spec?.accepted ?? null,
  };
}

/** Wall-clock milliseconds for turn timings (event handlers only). */
export function clockMs(): number {
  return performance.now();
}
