import { describe, expect, it } from "vitest";
import { toolCallSpans, tokensOutsideToolCalls } from "./toolCallText";

const toks = (...texts: string[]) => texts.map((text) => ({ text }));

describe("a tool call's markup in the token view", () => {
  it("finds closed blocks (with the whitespace after them) and, while streaming, an open last one", () => {
    const text = 'Sure. <tool_call>{"a": 1}</tool_call>\n<tool_call>{"b"';
    expect(toolCallSpans(text, false)).toEqual([[6, 38]]);
    expect(toolCallSpans(text, true)).toEqual([[6, 38], [38, text.length]]);
    expect(toolCallSpans("no calls", true)).toEqual([]);
  });

  it("keeps the tokens outside the blocks, however the tags were split into tokens", () => {
    const tokens = toks("Sure", ".", " ", "<", "tool", "_call", ">", '{"name"', ': "f"}', "</", "tool_call", ">", "\n", "Done");
    expect(tokensOutsideToolCalls(tokens, false).map((i) => tokens[i]!.text)).toEqual(["Sure", ".", " ", "Done"]);
  });

  it("hides an unclosed block only while the reply streams", () => {
    const tokens = toks("Hi", "<tool_call>", '{"na');
    expect(tokensOutsideToolCalls(tokens, true)).toEqual([0]);
    expect(tokensOutsideToolCalls(tokens, false)).toEqual([0, 1, 2]);
  });
});
