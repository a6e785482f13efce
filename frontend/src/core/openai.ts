// The OpenAI-compatible API as the playground uses it: decoding settings and presets, request
// bodies, a Server-Sent-Events parser, and an accumulator for streamed chunks. No I/O here.
import { describeStructured, NO_STRUCTURE, structuredFields, type StructuredSetting } from "./structured";
import { applyToolCallDeltas, type ToolCallView } from "./toolCalls";
import { describeTools, NO_TOOLS, toolFields, type ToolsSetting } from "./tools";
import type { RequestTimings } from "./wire";

export interface DecodingParams {
  temperature: number;
  top_k: number; // 0: off
  top_p: number;
  min_p: number;
  repetition_penalty: number;
  max_tokens: number;
  seed: number | null;
  n: number;
  /** Beam search width; 1 = off (sampling). The server's beam width is `n` with use_beam_search. */
  beam_width: number;
  logprobs: boolean;
  top_logprobs: number;
  /** Constrained decoding (response_format / structured_outputs); mode "none": free. */
  structured: StructuredSetting;
  /** Tools the model may call, and tool_choice. */
  tools: ToolsSetting;
}

export type PresetName = "greedy" | "balanced" | "creative";

const base: DecodingParams = {
  temperature: 0.7,
  top_k: 0,
  top_p: 1,
  min_p: 0,
  repetition_penalty: 1,
  max_tokens: 128,
  seed: null,
  n: 1,
  beam_width: 1,
  logprobs: true,
  top_logprobs: 5,
  structured: NO_STRUCTURE,
  tools: NO_TOOLS,
};

export const PRESETS: Record<PresetName, Partial<DecodingParams>> = {
  greedy: { temperature: 0, top_k: 0, top_p: 1, min_p: 0, repetition_penalty: 1, beam_width: 1 },
  balanced: { temperature: 0.7, top_k: 40, top_p: 0.9, min_p: 0.05, repetition_penalty: 1.05, beam_width: 1 },
  creative: { temperature: 1.1, top_k: 0, top_p: 0.95, min_p: 0.02, repetition_penalty: 1.1, beam_width: 1 },
};

export const PRESET_NAMES: readonly PresetName[] = ["greedy", "balanced", "creative"];

export function presetParams(name: PresetName, over: Partial<DecodingParams> = {}): DecodingParams {
  return { ...base, ...PRESETS[name], ...over };
}

export function defaultParams(): DecodingParams {
  return presetParams("balanced");
}

/** The preset these settings equal, if any. */
export function matchingPreset(p: DecodingParams): PresetName | null {
  for (const name of PRESET_NAMES) {
    const preset = PRESETS[name];
    if ((Object.keys(preset) as (keyof DecodingParams)[]).every((k) => preset[k] === p[k])) return name;
  }
  return null;
}

export function describeParams(p: DecodingParams): string {
  if (p.beam_width > 1) return `beam ${p.beam_width}`;
  if (p.temperature === 0) return "greedy";
  const parts = [`T=${p.temperature}`];
  if (p.top_k > 0) parts.push(`k=${p.top_k}`);
  if (p.top_p < 1) parts.push(`p=${p.top_p}`);
  if (p.min_p > 0) parts.push(`min_p=${p.min_p}`);
  if (p.repetition_penalty !== 1) parts.push(`rep=${p.repetition_penalty}`);
  if (p.seed !== null) parts.push(`seed=${p.seed}`);
  return parts.join(" ");
}

/** describeParams plus the output constraints ("greedy · JSON schema · tools: get_weather"). */
export function describeRequest(p: DecodingParams): string {
  return [describeParams(p), describeStructured(p.structured), describeTools(p.tools)].filter((x) => x !== null).join(" · ");
}

/** Why these settings cannot be sent (an invalid schema, tools that do not parse...), or null. */
export function requestProblem(p: DecodingParams): string | null {
  const structured = structuredFields(p.structured);
  if (!structured.ok) return `Structured output: ${structured.error}`;
  if (p.structured.mode !== "none" && p.beam_width > 1) return "Structured output cannot be combined with beam search: set the beam width to 1";
  const tools = toolFields(p.tools);
  if (!tools.ok) return `Tools: ${tools.error}`;
  return null;
}

export interface ChatTurn {
  role: "system" | "user" | "assistant";
  content: string;
}

/** Body for POST /v1/chat/completions (streaming, with usage and timings at the end). Throws on
 * settings requestProblem refuses (the UI does not send those). */
export function chatRequestBody(model: string | null, messages: readonly ChatTurn[], p: DecodingParams): Record<string, unknown> {
  const problem = requestProblem(p);
  if (problem !== null) throw new Error(problem);
  const beam = p.beam_width > 1;
  const body: Record<string, unknown> = {
    messages: messages.map((m) => ({ role: m.role, content: m.content })),
    max_tokens: p.max_tokens,
    n: beam ? p.beam_width : p.n,
    stream: true,
    stream_options: { include_usage: true },
  };
  if (model) body.model = model;
  if (beam) {
    body.use_beam_search = true;
    body.temperature = 0;
  } else {
    body.temperature = p.temperature;
    body.top_p = p.top_p;
    if (p.top_k > 0) body.top_k = p.top_k;
    if (p.min_p > 0) body.min_p = p.min_p;
  }
  if (p.repetition_penalty !== 1) body.repetition_penalty = p.repetition_penalty;
  if (p.seed !== null) body.seed = p.seed;
  if (p.logprobs) {
    body.logprobs = true;
    body.top_logprobs = Math.max(0, Math.min(20, p.top_logprobs));
  }
  const structured = structuredFields(p.structured);
  const tools = toolFields(p.tools);
  return { ...body, ...(structured.ok ? structured.value : {}), ...(tools.ok ? tools.value : {}) };
}

/** Body for one load-generator request: plain sampling at `temperature` (no hidden top-k/top-p/min-p
 *  or penalty), so temperature 0 is true greedy and a request can be replayed alone to compare. */
export function loadRequestBody(prompt: string, temperature: number, maxTokens: number, n: number): Record<string, unknown> {
  const p = presetParams("greedy", { temperature, max_tokens: maxTokens, n, logprobs: false });
  return chatRequestBody(null, [{ role: "user", content: prompt }], p);
}

// ---- Server-Sent Events -------------------------------------------------------------------------------

/** Incremental SSE parser: feed text as it arrives, get each complete event's `data` back. */
export class SseParser {
  private buffer = "";
  private data: string[] = [];

  feed(text: string): string[] {
    this.buffer += text;
    const out: string[] = [];
    for (;;) {
      const nl = this.buffer.search(/\r\n|\r|\n/);
      if (nl < 0) break;
      const line = this.buffer.slice(0, nl);
      const width = this.buffer.startsWith("\r\n", nl) ? 2 : 1;
      // a lone "\r" at the very end may be the first half of "\r\n": wait for more
      if (width === 1 && this.buffer[nl] === "\r" && nl === this.buffer.length - 1) break;
      this.buffer = this.buffer.slice(nl + width);
      if (line === "") {
        if (this.data.length > 0) out.push(this.data.join("\n"));
        this.data = [];
      } else if (line.startsWith(":")) {
        continue; // comment / keep-alive
      } else {
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let value = colon < 0 ? "" : line.slice(colon + 1);
        if (value.startsWith(" ")) value = value.slice(1);
        if (field === "data") this.data.push(value);
      }
    }
    return out;
  }

  /** Whatever is left when the stream ends (a last event without its blank line). */
  end(): string[] {
    const out = this.feed("\n\n");
    this.buffer = "";
    return out;
  }
}

// ---- streamed chunks -------------------------------------------------------------------------------------

export interface TopAlternative {
  token: string;
  logprob: number;
}

export interface TokenView {
  text: string;
  logprob: number | null;
  top: TopAlternative[];
}

export interface ChoiceResult {
  index: number;
  text: string;
  tokens: TokenView[];
  /** Tool calls, as their deltas arrived (arguments concatenated). */
  tool_calls: ToolCallView[];
  finish_reason: string | null;
}

export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
  cached_tokens: number | null;
}

export interface StreamResult {
  id: string | null;
  model: string | null;
  choices: ChoiceResult[];
  usage: Usage | null;
  timings: RequestTimings | null;
  done: boolean;
  error: string | null;
}

export function emptyResult(): StreamResult {
  return { id: null, model: null, choices: [], usage: null, timings: null, done: false, error: null };
}

interface RawLogprob {
  token?: unknown;
  logprob?: unknown;
  top_logprobs?: unknown;
}

function toNumber(v: unknown): number | null {
  return typeof v === "number" && Number.isFinite(v) ? v : null;
}

function parseTop(raw: unknown): TopAlternative[] {
  if (!Array.isArray(raw)) return [];
  const out: TopAlternative[] = [];
  for (const t of raw as RawLogprob[]) {
    const lp = toNumber(t?.logprob);
    if (typeof t?.token === "string" && lp !== null) out.push({ token: t.token, logprob: lp });
  }
  return out;
}

function choiceAt(result: StreamResult, index: number): ChoiceResult {
  let c = result.choices.find((x) => x.index === index);
  if (c === undefined) {
    c = { index, text: "", tokens: [], tool_calls: [], finish_reason: null };
    result.choices.push(c);
    result.choices.sort((a, b) => a.index - b.index);
  }
  return c;
}

/**
 * Folds one streamed chunk (chat or completion) into `result` (mutated; the caller owns it).
 * Token text comes from the delta when a chunk carries one token (it is the detokenized text, with
 * its spaces); from the logprob entries' own strings when a chunk carries several.
 */
export function applyChunk(result: StreamResult, chunk: unknown): void {
  if (typeof chunk !== "object" || chunk === null) return;
  const c = chunk as Record<string, unknown>;
  if (typeof c.error === "object" && c.error !== null) {
    const message = (c.error as { message?: unknown }).message;
    result.error = typeof message === "string" ? message : "server error";
    return;
  }
  if (typeof c.id === "string" && result.id === null) result.id = c.id;
  if (typeof c.model === "string") result.model = c.model;
  if (Array.isArray(c.choices)) {
    for (const raw of c.choices as Record<string, unknown>[]) {
      const index = typeof raw.index === "number" ? raw.index : 0;
      const choice = choiceAt(result, index);
      const delta = raw.delta as { content?: unknown; tool_calls?: unknown } | undefined;
      const piece = typeof delta?.content === "string" ? delta.content : typeof raw.text === "string" ? raw.text : "";
      choice.text += piece;
      applyToolCallDeltas(choice.tool_calls, delta?.tool_calls);
      const logprobs = raw.logprobs as { content?: unknown; tokens?: unknown; token_logprobs?: unknown; top_logprobs?: unknown } | null | undefined;
      const entries: TokenView[] = [];
      if (logprobs && Array.isArray(logprobs.content)) {
        for (const e of logprobs.content as RawLogprob[]) {
          entries.push({ text: typeof e.token === "string" ? e.token : "", logprob: toNumber(e.logprob), top: parseTop(e.top_logprobs) });
        }
      } else if (logprobs && Array.isArray(logprobs.tokens)) {
        // /v1/completions shape: parallel lists, top_logprobs as {token: logprob} maps
        const tokens = logprobs.tokens as unknown[];
        const lps = Array.isArray(logprobs.token_logprobs) ? (logprobs.token_logprobs as unknown[]) : [];
        const tops = Array.isArray(logprobs.top_logprobs) ? (logprobs.top_logprobs as unknown[]) : [];
        tokens.forEach((t, i) => {
          const top = tops[i];
          entries.push({
            text: typeof t === "string" ? t : "",
            logprob: toNumber(lps[i]),
            top: top && typeof top === "object" ? Object.entries(top as Record<string, number>).map(([token, logprob]) => ({ token, logprob })) : [],
          });
        });
      }
      if (entries.length === 1) {
        entries[0]!.text = piece || entries[0]!.text;
        choice.tokens.push(entries[0]!);
      } else if (entries.length > 1) {
        choice.tokens.push(...entries);
      } else if (piece) {
        choice.tokens.push({ text: piece, logprob: null, top: [] });
      }
      if (typeof raw.finish_reason === "string") choice.finish_reason = raw.finish_reason;
    }
  }
  const usage = c.usage as Record<string, unknown> | null | undefined;
  if (usage && typeof usage === "object") {
    const details = usage.prompt_tokens_details as { cached_tokens?: unknown } | null | undefined;
    result.usage = {
      prompt_tokens: toNumber(usage.prompt_tokens) ?? 0,
      completion_tokens: toNumber(usage.completion_tokens) ?? 0,
      total_tokens: toNumber(usage.total_tokens) ?? 0,
      cached_tokens: toNumber(details?.cached_tokens),
    };
  }
  if (c.timings && typeof c.timings === "object") result.timings = c.timings as RequestTimings;
}

/** Handles one SSE data payload; returns false on `[DONE]`. */
export function applyData(result: StreamResult, data: string): boolean {
  if (data.trim() === "[DONE]") {
    result.done = true;
    return false;
  }
  try {
    applyChunk(result, JSON.parse(data));
  } catch {
    result.error = `unreadable chunk: ${data.slice(0, 80)}`;
  }
  return true;
}
