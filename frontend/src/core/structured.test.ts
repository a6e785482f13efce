import { describe, expect, it } from "vitest";
import { describeStructured, NO_STRUCTURE, parseChoices, parseSchema, schemaName, structuredFields, type StructuredSetting } from "./structured";

const setting = (over: Partial<StructuredSetting>): StructuredSetting => ({ ...NO_STRUCTURE, ...over });
const CITY = '{"type":"object","properties":{"city":{"type":"string"},"population":{"type":"integer"}},"required":["city","population"]}';

describe("parseSchema", () => {
  it("accepts a JSON object", () => {
    expect(parseSchema(CITY)).toEqual({ ok: true, value: JSON.parse(CITY) });
  });

  it("names the JSON error, and refuses arrays, scalars, null and blank text", () => {
    const bad = parseSchema('{"type": "object",}');
    expect(bad.ok).toBe(false);
    if (!bad.ok) expect(bad.error).toMatch(/^not valid JSON: /);
    expect(parseSchema("[1, 2]")).toEqual({ ok: false, error: "a JSON schema must be an object, got an array" });
    expect(parseSchema("42")).toEqual({ ok: false, error: "a JSON schema must be an object, got a number" });
    expect(parseSchema("null")).toEqual({ ok: false, error: "a JSON schema must be an object, got null" });
    expect(parseSchema("  ")).toEqual({ ok: false, error: "the schema is empty" });
  });
});

describe("parseChoices", () => {
  it("takes one choice per line, trimmed, skipping blank lines", () => {
    expect(parseChoices("yes\r\n no \n\n")).toEqual({ ok: true, value: ["yes", "no"] });
  });

  it("needs at least one choice and no repeats", () => {
    expect(parseChoices("\n  \n").ok).toBe(false);
    expect(parseChoices("a\nb\na")).toEqual({ ok: false, error: '"a" is listed twice' });
  });
});

describe("structuredFields", () => {
  it("none adds nothing; JSON object is response_format json_object", () => {
    expect(structuredFields(NO_STRUCTURE)).toEqual({ ok: true, value: {} });
    expect(structuredFields(setting({ mode: "json_object" }))).toEqual({ ok: true, value: { response_format: { type: "json_object" } } });
  });

  it("a JSON schema is response_format json_schema, strict, named after a usable title", () => {
    expect(structuredFields(setting({ mode: "json_schema", schema: CITY }))).toEqual({
      ok: true, value: { response_format: { type: "json_schema", json_schema: { name: "response", schema: JSON.parse(CITY), strict: true } } },
    });
    expect(schemaName({ title: "City_info" })).toBe("City_info");
    expect(schemaName({ title: "a city!" })).toBe("response");
  });

  it("regex, choices and grammar go in vLLM's structured_outputs", () => {
    expect(structuredFields(setting({ mode: "regex", regex: "\\d+" }))).toEqual({ ok: true, value: { structured_outputs: { regex: "\\d+" } } });
    expect(structuredFields(setting({ mode: "choice", choices: "yes\nno" }))).toEqual({ ok: true, value: { structured_outputs: { choice: ["yes", "no"] } } });
    expect(structuredFields(setting({ mode: "grammar", grammar: 'start: "a"' }))).toEqual({ ok: true, value: { structured_outputs: { grammar: 'start: "a"' } } });
  });

  it("reports the problem of the selected mode only", () => {
    const broken = setting({ schema: "{", regex: "", choices: "" });
    expect(structuredFields(broken).ok).toBe(true); // mode none: the editors' text is not used
    expect(structuredFields({ ...broken, mode: "json_schema" }).ok).toBe(false);
    expect(structuredFields({ ...broken, mode: "regex" })).toEqual({ ok: false, error: "the regular expression is empty" });
    expect(structuredFields({ ...broken, mode: "choice" }).ok).toBe(false);
  });

  it("describes the setting in a few words", () => {
    expect(describeStructured(NO_STRUCTURE)).toBeNull();
    expect(describeStructured(setting({ mode: "json_schema" }))).toBe("JSON schema");
    expect(describeStructured(setting({ mode: "choice", choices: "yes\nno" }))).toBe("choices: yes | no");
    expect(describeStructured(setting({ mode: "choice", choices: Array.from({ length: 20 }, (_, i) => `option ${i}`).join("\n") }))).toBe("20 choices");
  });
});
