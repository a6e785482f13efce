// Tools as the playground sets them: the `tools` array as JSON text, checked, and a tool_choice
// ("auto", "none", "required", or one tool by name). `toolFields` turns them into the request fields.
import { fail, isObject, ok, parseJson, type Checked } from "./checked";

export interface ToolFunction {
  readonly name: string;
  readonly description?: string;
  /** A JSON schema for the arguments. */
  readonly parameters?: Record<string, unknown>;
}

export interface Tool {
  readonly type: "function";
  readonly function: ToolFunction;
}

/** "auto" | "none" | "required", or `function:<name>` for one tool. */
export type ToolChoiceValue = "auto" | "none" | "required" | `function:${string}`;

export interface ToolsSetting {
  /** The `tools` array as JSON; blank: no tools. */
  readonly text: string;
  readonly choice: ToolChoiceValue;
}

export const NO_TOOLS: ToolsSetting = { text: "", choice: "auto" };

export const EXAMPLE_TOOLS = JSON.stringify(
  [
    {
      type: "function",
      function: {
        name: "get_weather",
        description: "The current weather in a city",
        parameters: { type: "object", properties: { city: { type: "string" }, unit: { type: "string", enum: ["celsius", "fahrenheit"] } }, required: ["city"] },
      },
    },
  ],
  null,
  2,
);

const NAME = /^[A-Za-z0-9_-]{1,64}$/;

function checkTool(raw: unknown, i: number): Checked<Tool> {
  const at = `tools[${i}]`;
  if (!isObject(raw)) return fail(`${at} must be an object`);
  if (raw.type !== "function") return fail(`${at}.type must be "function"`);
  const fn = raw.function;
  if (!isObject(fn)) return fail(`${at}.function must be an object`);
  if (typeof fn.name !== "string" || !NAME.test(fn.name)) return fail(`${at}.function.name must be 1-64 letters, digits, _ or -`);
  if (fn.description !== undefined && typeof fn.description !== "string") return fail(`${at}.function.description must be a string`);
  if (fn.parameters !== undefined && !isObject(fn.parameters)) return fail(`${at}.function.parameters must be a JSON schema (an object)`);
  return ok(raw as unknown as Tool);
}

/** The tools array checked ([] when the text is blank). */
export function parseTools(text: string): Checked<Tool[]> {
  if (text.trim() === "") return ok([]);
  const parsed = parseJson(text);
  if (!parsed.ok) return parsed;
  if (!Array.isArray(parsed.value)) return fail("tools must be a JSON array of {type: \"function\", function: {name, parameters}}");
  const tools: Tool[] = [];
  for (const [i, raw] of parsed.value.entries()) {
    const tool = checkTool(raw, i);
    if (!tool.ok) return tool;
    if (tools.some((t) => t.function.name === tool.value.function.name)) return fail(`two tools are named "${tool.value.function.name}"`);
    tools.push(tool.value);
  }
  return ok(tools);
}

/** The tool_choice select's options for these tools. */
export function toolChoiceOptions(tools: readonly Tool[]): { value: ToolChoiceValue; label: string }[] {
  return [
    { value: "auto", label: "auto" },
    { value: "none", label: "none" },
    { value: "required", label: "required" },
    ...tools.map((t) => ({ value: `function:${t.function.name}` as const, label: t.function.name })),
  ];
}

/** The tool_choice field: a string, or {type: "function", function: {name}} for one tool. */
export function toolChoiceField(choice: ToolChoiceValue): string | { type: "function"; function: { name: string } } {
  return choice.startsWith("function:") ? { type: "function", function: { name: choice.slice("function:".length) } } : choice;
}

/** The request fields ({} without tools), or what is wrong. */
export function toolFields(s: ToolsSetting): Checked<Record<string, unknown>> {
  const tools = parseTools(s.text);
  if (!tools.ok) return tools;
  if (tools.value.length === 0) return ok({});
  if (s.choice.startsWith("function:") && !toolChoiceOptions(tools.value).some((o) => o.value === s.choice)) {
    return fail(`tool_choice names ${s.choice.slice("function:".length)}, which is not among the tools`);
  }
  return ok({ tools: tools.value, tool_choice: toolChoiceField(s.choice) });
}

/** A few words for summaries ("tools: get_weather"), or null without tools. */
export function describeTools(s: ToolsSetting): string | null {
  const tools = parseTools(s.text);
  if (!tools.ok) return "tools (invalid)";
  if (tools.value.length === 0) return null;
  const names = tools.value.map((t) => t.function.name).join(", ");
  return `tools: ${names.length <= 40 ? names : `${tools.value.length}`}${s.choice === "auto" ? "" : ` (${s.choice.replace("function:", "")})`}`;
}
