// Structured outputs as the playground sets them: one mode (none, any JSON object, a JSON schema, a
// regular expression, a list of choices, a Lark grammar) and the text the user typed for each, kept
// while switching modes. `structuredFields` checks the text and turns it into the request fields:
// OpenAI's `response_format` for JSON, vLLM's `structured_outputs` for the rest.
import { fail, isObject, ok, parseJson, type Checked } from "./checked";

export type StructuredMode = "none" | "json_object" | "json_schema" | "regex" | "choice" | "grammar";

export interface StructuredSetting {
  readonly mode: StructuredMode;
  /** The JSON schema editor's text. */
  readonly schema: string;
  readonly regex: string;
  /** One choice per line. */
  readonly choices: string;
  /** A Lark grammar (llguidance's syntax). */
  readonly grammar: string;
}

export const STRUCTURED_MODES: readonly { value: StructuredMode; label: string }[] = [
  { value: "none", label: "none" },
  { value: "json_object", label: "JSON object" },
  { value: "json_schema", label: "JSON schema" },
  { value: "regex", label: "regex" },
  { value: "choice", label: "choices" },
  { value: "grammar", label: "Lark grammar" },
];

export const EXAMPLE_SCHEMA = JSON.stringify(
  { type: "object", properties: { answer: { type: "string" }, confidence: { type: "number" } }, required: ["answer", "confidence"] },
  null,
  2,
);

export const NO_STRUCTURE: StructuredSetting = {
  mode: "none",
  schema: EXAMPLE_SCHEMA,
  regex: "[0-9]{3}-[0-9]{4}",
  choices: "yes\nno",
  grammar: 'start: "yes" | "no"',
};

/** A JSON schema's text checked: it must parse and be an object. */
export function parseSchema(text: string): Checked<Record<string, unknown>> {
  if (text.trim() === "") return fail("the schema is empty");
  const parsed = parseJson(text);
  if (!parsed.ok) return parsed;
  if (!isObject(parsed.value)) return fail(`a JSON schema must be an object, got ${Array.isArray(parsed.value) ? "an array" : typeof parsed.value === "object" ? "null" : `a ${typeof parsed.value}`}`);
  return ok(parsed.value);
}

/** One choice per line, trimmed; blank lines are skipped. At least one, no repeats. */
export function parseChoices(text: string): Checked<string[]> {
  const choices = text.split(/\r?\n/).map((line) => line.trim()).filter((line) => line !== "");
  if (choices.length === 0) return fail("give at least one choice (one per line)");
  const repeated = choices.find((c, i) => choices.indexOf(c) !== i);
  if (repeated !== undefined) return fail(`"${repeated}" is listed twice`);
  return ok(choices);
}

function nonEmpty(text: string, what: string): Checked<string> {
  return text.trim() === "" ? fail(`the ${what} is empty`) : ok(text);
}

/** The schema's name for response_format.json_schema: its `title` when that is a valid name. */
export function schemaName(schema: Record<string, unknown>): string {
  const title = schema.title;
  return typeof title === "string" && /^[A-Za-z0-9_-]{1,64}$/.test(title) ? title : "response";
}

/** The request fields for the setting ({} for none), or what is wrong with the text. */
export function structuredFields(s: StructuredSetting): Checked<Record<string, unknown>> {
  switch (s.mode) {
    case "none":
      return ok({});
    case "json_object":
      return ok({ response_format: { type: "json_object" } });
    case "json_schema": {
      const schema = parseSchema(s.schema);
      if (!schema.ok) return schema;
      return ok({ response_format: { type: "json_schema", json_schema: { name: schemaName(schema.value), schema: schema.value, strict: true } } });
    }
    case "regex": {
      const regex = nonEmpty(s.regex, "regular expression");
      return regex.ok ? ok({ structured_outputs: { regex: regex.value } }) : regex;
    }
    case "choice": {
      const choices = parseChoices(s.choices);
      return choices.ok ? ok({ structured_outputs: { choice: choices.value } }) : choices;
    }
    case "grammar": {
      const grammar = nonEmpty(s.grammar, "grammar");
      return grammar.ok ? ok({ structured_outputs: { grammar: grammar.value } }) : grammar;
    }
  }
}

/** A few words for summaries ("JSON schema", "choices: yes | no"), or null for none. */
export function describeStructured(s: StructuredSetting): string | null {
  switch (s.mode) {
    case "none":
      return null;
    case "choice": {
      const choices = parseChoices(s.choices);
      if (!choices.ok) return "choices";
      const joined = choices.value.join(" | ");
      return joined.length <= 40 ? `choices: ${joined}` : `${choices.value.length} choices`;
    }
    default:
      return STRUCTURED_MODES.find((m) => m.value === s.mode)!.label;
  }
}
