// Conversations as JSON: what local storage keeps across reloads and what Export writes, and the
// checks an imported file goes through (each problem named by where it is, such as
// "conversations[0].turns[1].content: expected a string, got a number").
import { isObject } from "../../core/checked";
import { defaultParams, type ChoiceResult, type DecodingParams, type StreamResult, type TokenView } from "../../core/openai";
import { NO_STRUCTURE, STRUCTURED_MODES } from "../../core/structured";
import type { ToolCallView } from "../../core/toolCalls";
import { NO_TOOLS } from "../../core/tools";
import type { RequestTimings } from "../../core/wire";
import { assistantTurn, newReply, type Reply, type SpecCounts, type Turn, type TurnStatus } from "./chatState";
import { uniqueId, type ChatsState, type Conversation } from "./conversations";

export const FILE_FORMAT = "minivllm-chats";
export const FILE_VERSION = 1;
export const STORAGE_KEY = "minivllm.chats.v1";

/** A turn as written: an assistant message as its versions (its flat fields repeat the shown one). */
type TurnJson = Turn | { id: string; role: "assistant"; shown: number; versions: readonly Reply[] };

export interface ChatsFile {
  readonly format: typeof FILE_FORMAT;
  readonly version: typeof FILE_VERSION;
  readonly activeId?: string;
  readonly conversations: readonly (Omit<Conversation, "turns"> & { turns: readonly TurnJson[] })[];
}

/** The file Export writes (and local storage keeps): every conversation. */
export function chatsFile(state: ChatsState): ChatsFile {
  return {
    format: FILE_FORMAT,
    version: FILE_VERSION,
    activeId: state.activeId,
    conversations: state.conversations.map((c) => ({
      ...c,
      turns: c.turns.map((t): TurnJson => (t.role === "user" ? t : { id: t.id, role: "assistant", shown: t.shown, versions: t.versions })),
    })),
  };
}

export type Parsed = { ok: true; conversations: Conversation[]; activeId: string | null } | { ok: false; error: string };

class ShapeError extends Error {}

function kind(v: unknown): string {
  if (v === null) return "null";
  if (Array.isArray(v)) return "an array";
  return typeof v === "object" ? "an object" : `a ${typeof v}`;
}

function fail(path: string, expected: string, v: unknown): never {
  throw new ShapeError(`${path}: expected ${expected}, got ${kind(v)}`);
}

function str(v: unknown, path: string): string {
  return typeof v === "string" ? v : fail(path, "a string", v);
}

function optStr(v: unknown, path: string, fallback: string): string {
  return v === undefined ? fallback : str(v, path);
}

function num(v: unknown, path: string): number {
  return typeof v === "number" && Number.isFinite(v) ? v : fail(path, "a number", v);
}

function numOrNull(v: unknown, path: string): number | null {
  return v === null || v === undefined ? null : num(v, path);
}

function strOrNull(v: unknown, path: string): string | null {
  return v === null || v === undefined ? null : str(v, path);
}

function obj(v: unknown, path: string): Record<string, unknown> {
  return isObject(v) ? v : fail(path, "an object", v);
}

function list(v: unknown, path: string): unknown[] {
  return Array.isArray(v) ? v : fail(path, "an array", v);
}

function token(v: unknown, path: string): TokenView {
  const t = obj(v, path);
  const top = t.top === undefined ? [] : list(t.top, `${path}.top`).map((a, i) => {
    const o = obj(a, `${path}.top[${i}]`);
    return { token: str(o.token, `${path}.top[${i}].token`), logprob: num(o.logprob, `${path}.top[${i}].logprob`) };
  });
  return { text: str(t.text, `${path}.text`), logprob: numOrNull(t.logprob, `${path}.logprob`), top };
}

function toolCall(v: unknown, path: string, index: number): ToolCallView {
  const c = obj(v, path);
  return {
    index: c.index === undefined ? index : num(c.index, `${path}.index`),
    id: strOrNull(c.id, `${path}.id`),
    type: optStr(c.type, `${path}.type`, "function"),
    name: str(c.name, `${path}.name`),
    arguments: optStr(c.arguments, `${path}.arguments`, ""),
  };
}

function choice(v: unknown, path: string, index: number): ChoiceResult {
  const c = obj(v, path);
  return {
    index: c.index === undefined ? index : num(c.index, `${path}.index`),
    text: str(c.text, `${path}.text`),
    tokens: c.tokens === undefined ? [] : list(c.tokens, `${path}.tokens`).map((t, i) => token(t, `${path}.tokens[${i}]`)),
    tool_calls: c.tool_calls === undefined ? [] : list(c.tool_calls, `${path}.tool_calls`).map((t, i) => toolCall(t, `${path}.tool_calls[${i}]`, i)),
    finish_reason: strOrNull(c.finish_reason, `${path}.finish_reason`),
  };
}

function result(v: unknown, path: string): StreamResult {
  const r = obj(v, path);
  const usage = r.usage === null || r.usage === undefined ? null : obj(r.usage, `${path}.usage`);
  const timings = r.timings === null || r.timings === undefined ? null : obj(r.timings, `${path}.timings`);
  return {
    id: strOrNull(r.id, `${path}.id`),
    model: strOrNull(r.model, `${path}.model`),
    choices: list(r.choices, `${path}.choices`).map((c, i) => choice(c, `${path}.choices[${i}]`, i)),
    usage: usage === null ? null : {
      prompt_tokens: num(usage.prompt_tokens, `${path}.usage.prompt_tokens`),
      completion_tokens: num(usage.completion_tokens, `${path}.usage.completion_tokens`),
      total_tokens: num(usage.total_tokens, `${path}.usage.total_tokens`),
      cached_tokens: numOrNull(usage.cached_tokens, `${path}.usage.cached_tokens`),
    },
    // the server's own object, shown as numbers where they are numbers
    timings: timings as RequestTimings | null,
    done: r.done === true,
    error: strOrNull(r.error, `${path}.error`),
  };
}

/** Settings over the defaults: an older file (or a hand-written one) may lack some. */
function params(v: unknown, path: string): DecodingParams {
  if (v === undefined) return defaultParams();
  const p = obj(v, path);
  const base = defaultParams();
  const out: Record<string, unknown> = { ...base };
  for (const [k, d] of Object.entries(base)) {
    const x = p[k];
    if (x === undefined) continue;
    if (k === "structured") {
      const s = obj(x, `${path}.structured`);
      const mode = str(s.mode, `${path}.structured.mode`);
      if (!STRUCTURED_MODES.some((m) => m.value === mode)) throw new ShapeError(`${path}.structured.mode: "${mode}" is not one of ${STRUCTURED_MODES.map((m) => m.value).join(", ")}`);
      out.structured = { ...NO_STRUCTURE, ...s };
    } else if (k === "tools") {
      const t = obj(x, `${path}.tools`);
      out.tools = { ...NO_TOOLS, text: optStr(t.text, `${path}.tools.text`, ""), choice: optStr(t.choice, `${path}.tools.choice`, "auto") };
    } else if (d === null || typeof d === "number") out[k] = numOrNull(x, `${path}.${k}`);
    else if (typeof d === "boolean") out[k] = typeof x === "boolean" ? x : fail(`${path}.${k}`, "true or false", x);
  }
  return out as unknown as DecodingParams;
}

const STATUSES: readonly TurnStatus[] = ["done", "stopped", "error", "streaming"];

function spec(v: unknown, path: string): SpecCounts | null {
  if (v === null || v === undefined) return null;
  const s = obj(v, path);
  return { drafted: num(s.drafted, `${path}.drafted`), accepted: num(s.accepted, `${path}.accepted`) };
}

function reply(v: unknown, path: string): Reply {
  const r = obj(v, path);
  const status = optStr(r.status, `${path}.status`, "done") as TurnStatus;
  if (!STATUSES.includes(status)) throw new ShapeError(`${path}.status: "${status}" is not one of done, stopped, error`);
  const startedAt = r.startedAt === undefined ? 0 : num(r.startedAt, `${path}.startedAt`);
  return {
    key: r.key === undefined ? uniqueId("a") : str(r.key, `${path}.key`),
    params: params(r.params, `${path}.params`),
    result: result(r.result, `${path}.result`),
    // a reply still streaming when the page went away was cut off there
    status: status === "streaming" ? "stopped" : status,
    error: strOrNull(r.error, `${path}.error`),
    requestId: strOrNull(r.requestId, `${path}.requestId`),
    startedAt,
    firstTokenAt: numOrNull(r.firstTokenAt, `${path}.firstTokenAt`),
    endedAt: r.endedAt === undefined && status === "streaming" ? null : numOrNull(r.endedAt, `${path}.endedAt`),
    updatedAt: numOrNull(r.updatedAt, `${path}.updatedAt`),
    activeChoice: r.activeChoice === undefined ? 0 : num(r.activeChoice, `${path}.activeChoice`),
    spec: spec(r.spec, `${path}.spec`),
    base: r.base === null || r.base === undefined ? null : choice(r.base, `${path}.base`, 0),
  };
}

function turn(v: unknown, path: string): Turn {
  const t = obj(v, path);
  const role = t.role;
  if (role === "user") return { id: t.id === undefined ? uniqueId("u") : str(t.id, `${path}.id`), role, content: str(t.content, `${path}.content`) };
  if (role !== "assistant") throw new ShapeError(`${path}.role: expected "user" or "assistant", got ${typeof role === "string" ? `"${role}"` : kind(role)}`);
  const id = t.id === undefined ? uniqueId("a") : str(t.id, `${path}.id`);
  if (t.versions === undefined) {
    // the short form: { "role": "assistant", "content": "..." }
    const content = str(t.content, `${path}.content`);
    const r = newReply(id, defaultParams(), 0);
    return assistantTurn(id, [{ ...r, status: "done", endedAt: 0, result: { ...r.result, done: true, choices: [{ index: 0, text: content, tokens: [], tool_calls: [], finish_reason: null }] } }], 0);
  }
  const versions = list(t.versions, `${path}.versions`).map((x, i) => reply(x, `${path}.versions[${i}]`));
  if (versions.length === 0) throw new ShapeError(`${path}.versions: expected at least one version, got an empty array`);
  const shown = t.shown === undefined ? versions.length - 1 : num(t.shown, `${path}.shown`);
  return assistantTurn(id, versions, shown);
}

function conversation(v: unknown, path: string, now: number): Conversation {
  const c = obj(v, path);
  return {
    id: c.id === undefined ? uniqueId("c") : str(c.id, `${path}.id`),
    title: optStr(c.title, `${path}.title`, ""),
    systemPrompt: optStr(c.systemPrompt, `${path}.systemPrompt`, ""),
    createdAt: c.createdAt === undefined ? now : num(c.createdAt, `${path}.createdAt`),
    updatedAt: c.updatedAt === undefined ? now : num(c.updatedAt, `${path}.updatedAt`),
    turns: list(c.turns, `${path}.turns`).map((t, i) => turn(t, `${path}.turns[${i}]`)),
  };
}

/**
 * Reads conversations from JSON text: a file Export wrote ({format, version, conversations}), a list
 * of conversations, or one conversation. Returns what is wrong, where, when the shape is not right.
 */
export function parseChats(text: string, now: number): Parsed {
  let data: unknown;
  try {
    data = JSON.parse(text);
  } catch (err) {
    return { ok: false, error: `Not valid JSON: ${(err as Error).message}` };
  }
  try {
    if (Array.isArray(data)) return { ok: true, conversations: data.map((c, i) => conversation(c, `[${i}]`, now)), activeId: null };
    const top = obj(data, "the file");
    if (top.turns !== undefined) return { ok: true, conversations: [conversation(top, "the conversation", now)], activeId: null };
    if (top.format !== FILE_FORMAT) {
      throw new ShapeError(top.format === undefined
        ? `Not a chats file: expected "format": "${FILE_FORMAT}" with "conversations" (or a conversation with "turns")`
        : `format: expected "${FILE_FORMAT}", got ${JSON.stringify(top.format)}`);
    }
    if (top.version !== FILE_VERSION) throw new ShapeError(`version: this dashboard reads version ${FILE_VERSION}, the file has ${JSON.stringify(top.version)}`);
    const conversations = list(top.conversations, "conversations").map((c, i) => conversation(c, `conversations[${i}]`, now));
    return { ok: true, conversations, activeId: typeof top.activeId === "string" ? top.activeId : null };
  } catch (err) {
    if (err instanceof ShapeError) return { ok: false, error: err.message };
    throw err;
  }
}

/** The kept conversations, or null when there are none (or they cannot be read: a fresh start). */
export function loadChats(storage: Pick<Storage, "getItem"> | null, now: number): ChatsState | null {
  let text: string | null;
  try {
    text = storage?.getItem(STORAGE_KEY) ?? null;
  } catch {
    return null;
  }
  if (text === null) return null;
  const parsed = parseChats(text, now);
  if (!parsed.ok || parsed.conversations.length === 0) return null;
  const active = parsed.conversations.find((c) => c.id === parsed.activeId) ?? parsed.conversations[0]!;
  return { conversations: parsed.conversations, activeId: active.id };
}

/** The conversations without the tokens' top alternatives, which take most of the room. */
function withoutAlternatives(state: ChatsState): ChatsState {
  const slim = (c: ChoiceResult): ChoiceResult => ({ ...c, tokens: c.tokens.map((t) => (t.top.length === 0 ? t : { ...t, top: [] })) });
  return {
    ...state,
    conversations: state.conversations.map((c) => ({
      ...c,
      turns: c.turns.map((t) => (t.role === "user" ? t : assistantTurn(t.id, t.versions.map((v) => ({ ...v, base: null, result: { ...v.result, choices: v.result.choices.map(slim) } })), t.shown))),
    })),
  };
}

/** Keeps the conversations; on a full storage, again without the top alternatives. Returns a problem
 * to show, or null. */
export function saveChats(storage: Pick<Storage, "setItem"> | null, state: ChatsState): string | null {
  if (storage === null) return "local storage is not available: chats are not kept across reloads";
  try {
    storage.setItem(STORAGE_KEY, JSON.stringify(chatsFile(state)));
    return null;
  } catch {
    try {
      storage.setItem(STORAGE_KEY, JSON.stringify(chatsFile(withoutAlternatives(state))));
      return "local storage is full: the tokens' top alternatives were not kept";
    } catch {
      return "local storage is full: the latest changes are not kept (export the chats, then delete some)";
    }
  }
}
