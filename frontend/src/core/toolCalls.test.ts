import { describe, expect, it } from "vitest";
import { applyToolCallDeltas, prettyArguments, type ToolCallView } from "./toolCalls";

describe("applyToolCallDeltas", () => {
  it("concatenates each call's argument fragments by index; id, type and name come first", () => {
    const calls: ToolCallView[] = [];
    applyToolCallDeltas(calls, [{ index: 0, id: "call_1", type: "function", function: { name: "get_weather", arguments: "" } }]);
    applyToolCallDeltas(calls, [{ index: 0, function: { arguments: '{"ci' } }]);
    applyToolCallDeltas(calls, [{ index: 1, id: "call_2", type: "function", function: { name: "get_time", arguments: "{}" } }]);
    applyToolCallDeltas(calls, [{ index: 0, function: { arguments: 'ty": "Paris"}' } }]);
    expect(calls).toEqual([
      { index: 0, id: "call_1", type: "function", name: "get_weather", arguments: '{"city": "Paris"}' },
      { index: 1, id: "call_2", type: "function", name: "get_time", arguments: "{}" },
    ]);
  });

  it("keeps index order when a later index arrives first; tolerates junk and a missing index", () => {
    const calls: ToolCallView[] = [];
    applyToolCallDeltas(calls, [{ index: 2, function: { name: "b" } }]);
    applyToolCallDeltas(calls, [null, 7, { function: { name: "a" } }]); // no index: its position (2 -> same as b)
    applyToolCallDeltas(calls, [{ index: 0, function: { name: "z", arguments: 5 } }]);
    applyToolCallDeltas(calls, undefined);
    applyToolCallDeltas(calls, "nope");
    expect(calls.map((c) => [c.index, c.name, c.arguments, c.id])).toEqual([[0, "z", "", null], [2, "ba", "", null]]);
  });
});

describe("prettyArguments", () => {
  it("indents valid JSON; leaves partial text as it is", () => {
    expect(prettyArguments('{"city":"Paris","days":[1,2]}')).toEqual({ text: '{\n  "city": "Paris",\n  "days": [\n    1,\n    2\n  ]\n}', valid: true });
    expect(prettyArguments('{"city": "Par')).toEqual({ text: '{"city": "Par', valid: false });
    expect(prettyArguments(" ")).toEqual({ text: "", valid: false });
  });
});
