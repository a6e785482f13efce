// Tool calls as they stream (OpenAI's shape): `delta.tool_calls` entries carry an `index`; the first
// entry of a call brings its id, type and function name, later ones fragments of its arguments (JSON
// text) to append. No I/O here.
import { isObject } from "./checked";

export interface ToolCallView {
  readonly index: number;
  id: string | null;
  type: string;
  name: string;
  /** The arguments' JSON text so far. */
  arguments: string;
}

/** Folds one delta's `tool_calls` into `calls` (mutated, kept in index order). */
export function applyToolCallDeltas(calls: ToolCallView[], deltas: unknown): void {
  if (!Array.isArray(deltas)) return;
  for (const [position, raw] of deltas.entries()) {
    if (!isObject(raw)) continue;
    const index = typeof raw.index === "number" ? raw.index : position;
    let call = calls.find((c) => c.index === index);
    if (call === undefined) {
      call = { index, id: null, type: "function", name: "", arguments: "" };
      calls.push(call);
      calls.sort((a, b) => a.index - b.index);
    }
    if (typeof raw.id === "string") call.id = raw.id;
    if (typeof raw.type === "string") call.type = raw.type;
    const fn = raw.function;
    if (isObject(fn)) {
      if (typeof fn.name === "string") call.name += fn.name;
      if (typeof fn.arguments === "string") call.arguments += fn.arguments;
    }
  }
}

/** The arguments indented for reading, when they parse; as they came (valid: false) when not, such as
 * while they are still streaming. */
export function prettyArguments(text: string): { text: string; valid: boolean } {
  if (text.trim() === "") return { text: "", valid: false };
  try {
    return { text: JSON.stringify(JSON.parse(text), null, 2), valid: true };
  } catch {
    return { text, valid: false };
  }
}
