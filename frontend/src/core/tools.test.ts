import { describe, expect, it } from "vitest";
import { describeTools, EXAMPLE_TOOLS, NO_TOOLS, parseTools, toolChoiceOptions, toolFields } from "./tools";

const tool = (name: string, extra: Record<string, unknown> = {}) => ({ type: "function", function: { name, ...extra } });
const text = (v: unknown) => JSON.stringify(v);

describe("parseTools", () => {
  it("blank text is no tools; the example parses", () => {
    expect(parseTools("  ")).toEqual({ ok: true, value: [] });
    const example = parseTools(EXAMPLE_TOOLS);
    expect(example.ok && example.value.map((t) => t.function.name)).toEqual(["get_weather"]);
  });

  it("accepts functions with optional description and parameters", () => {
    const tools = [tool("a"), tool("b_2", { description: "d", parameters: { type: "object" } })];
    expect(parseTools(text(tools))).toEqual({ ok: true, value: tools });
  });

  it("names what is wrong", () => {
    const error = (v: unknown) => {
      const r = parseTools(typeof v === "string" ? v : text(v));
      return r.ok ? null : r.error;
    };
    expect(error("[")).toMatch(/^not valid JSON/);
    expect(error(tool("a"))).toMatch(/must be a JSON array/);
    expect(error([42])).toBe("tools[0] must be an object");
    expect(error([{ type: "code_interpreter" }])).toBe('tools[0].type must be "function"');
    expect(error([{ type: "function" }])).toBe("tools[0].function must be an object");
    expect(error([tool("a"), tool("has space")])).toBe("tools[1].function.name must be 1-64 letters, digits, _ or -");
    expect(error([tool("a", { parameters: [] })])).toBe("tools[0].function.parameters must be a JSON schema (an object)");
    expect(error([tool("a", { description: 3 })])).toBe("tools[0].function.description must be a string");
    expect(error([tool("a"), tool("a")])).toBe('two tools are named "a"');
  });
});

describe("toolFields", () => {
  const two = text([tool("a"), tool("b")]);

  it("no tools, no fields (tool_choice is not sent alone)", () => {
    expect(toolFields({ ...NO_TOOLS, choice: "required" })).toEqual({ ok: true, value: {} });
  });

  it("sends the tools with tool_choice as a string or a named function", () => {
    expect(toolFields({ text: two, choice: "auto" })).toEqual({ ok: true, value: { tools: JSON.parse(two), tool_choice: "auto" } });
    expect(toolFields({ text: two, choice: "required" }).ok && toolFields({ text: two, choice: "required" })).toMatchObject({ value: { tool_choice: "required" } });
    expect(toolFields({ text: two, choice: "function:b" })).toMatchObject({ ok: true, value: { tool_choice: { type: "function", function: { name: "b" } } } });
  });

  it("refuses a tool_choice naming a tool that is not there", () => {
    expect(toolFields({ text: two, choice: "function:c" })).toEqual({ ok: false, error: "tool_choice names c, which is not among the tools" });
  });

  it("offers auto, none, required and each tool; describes the setting", () => {
    const parsed = parseTools(two);
    expect(parsed.ok && toolChoiceOptions(parsed.value).map((o) => o.value)).toEqual(["auto", "none", "required", "function:a", "function:b"]);
    expect(describeTools(NO_TOOLS)).toBeNull();
    expect(describeTools({ text: two, choice: "auto" })).toBe("tools: a, b");
    expect(describeTools({ text: two, choice: "function:b" })).toBe("tools: a, b (b)");
    expect(describeTools({ text: "[", choice: "auto" })).toBe("tools (invalid)");
  });
});
