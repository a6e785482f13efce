import { describe, expect, it } from "vitest";
import { applyChunk, applyData, chatRequestBody, describeRequest, emptyResult, loadRequestBody, matchingPreset, presetParams, requestProblem, SseParser } from "./openai";
import { NO_STRUCTURE } from "./structured";
import { EXAMPLE_TOOLS } from "./tools";

describe("SseParser", () => {
  it("handles events split anywhere, CRLF, comments and multi-line data", () => {
    const p = new SseParser();
    const text = ': keep-alive\r\ndata: {"a":1}\r\n\r\ndata: line1\ndata: line2\n\ndata: [DONE]\n\n';
    const out: string[] = [];
    for (let i = 0; i < text.length; i += 3) out.push(...p.feed(text.slice(i, i + 3)));
    out.push(...p.end());
    expect(out).toEqual(['{"a":1}', "line1\nline2", "[DONE]"]);
  });

  it("flushes a last event without its blank line at the end", () => {
    const p = new SseParser();
    expect(p.feed("data: x")).toEqual([]);
    expect(p.end()).toEqual(["x"]);
  });
});

// Shapes as the server sends them (backend/minivllm/server/openai_protocol.py).
const chunk = (content: string, logprob: number, top: [string, number][], finish: string | null = null, index = 0) => ({
  id: "chatcmpl-abc", object: "chat.completion.chunk", created: 1, model: "m",
  choices: [{ index, delta: { content }, logprobs: { content: [{ token: content.trim() || content, logprob, bytes: null, top_logprobs: top.map(([token, lp]) => ({ token, logprob: lp, bytes: null })) }] }, finish_reason: finish }],
  usage: null, timings: null,
});

describe("applyChunk", () => {
  it("accumulates text, tokens with the delta's spacing, alternatives, usage and timings", () => {
    const r = emptyResult();
    applyChunk(r, { id: "chatcmpl-abc", choices: [{ index: 0, delta: { role: "assistant", content: "" }, logprobs: null, finish_reason: null }] });
    applyChunk(r, chunk("Hello", -0.1, [["Hello", -0.1], ["Hi", -2.5]]));
    applyChunk(r, chunk(" world", -0.7, [[" world", -0.7]], "stop"));
    applyChunk(r, {
      id: "chatcmpl-abc", choices: [],
      usage: { prompt_tokens: 12, completion_tokens: 2, total_tokens: 14, prompt_tokens_details: { cached_tokens: 8 } },
      timings: { ttft_s: 0.05, queue_s: 0.01, e2e_s: 0.2, tokens_per_s: 40, prompt_tokens: 12, cached_prompt_tokens: 8, generated_tokens: 2, num_preemptions: 0 },
    });
    expect(r.id).toBe("chatcmpl-abc");
    expect(r.choices).toHaveLength(1);
    const c = r.choices[0]!;
    expect(c.text).toBe("Hello world");
    expect(c.tokens.map((t) => t.text)).toEqual(["Hello", " world"]);
    expect(c.tokens[0]!.top).toEqual([{ token: "Hello", logprob: -0.1 }, { token: "Hi", logprob: -2.5 }]);
    expect(c.finish_reason).toBe("stop");
    expect(r.usage).toEqual({ prompt_tokens: 12, completion_tokens: 2, total_tokens: 14, cached_tokens: 8 });
    expect(r.timings?.tokens_per_s).toBe(40);
  });

  it("keeps n choices apart; text without logprobs still forms tokens", () => {
    const r = emptyResult();
    applyChunk(r, { choices: [{ index: 1, delta: { content: "b" }, finish_reason: null }] });
    applyChunk(r, { choices: [{ index: 0, delta: { content: "a" }, finish_reason: "length" }] });
    expect(r.choices.map((c) => [c.index, c.text, c.tokens.length, c.finish_reason])).toEqual([[0, "a", 1, "length"], [1, "b", 1, null]]);
    expect(r.choices[0]!.tokens[0]!.logprob).toBeNull();
  });

  it("reads /v1/completions logprobs and error payloads; [DONE] ends", () => {
    const r = emptyResult();
    applyChunk(r, { choices: [{ index: 0, text: "ab", logprobs: { tokens: ["a", "b"], token_logprobs: [-1, -2], top_logprobs: [{ a: -1, c: -3 }, null], text_offset: [0, 1] } }] });
    expect(r.choices[0]!.tokens.map((t) => [t.text, t.logprob, t.top.length])).toEqual([["a", -1, 2], ["b", -2, 0]]);
    expect(applyData(r, JSON.stringify({ error: { message: "boom", type: "x" } }))).toBe(true);
    expect(r.error).toBe("boom");
    expect(applyData(r, "[DONE]")).toBe(false);
    expect(r.done).toBe(true);
  });
});

describe("request bodies and presets", () => {
  it("streams with usage; sends only what differs from defaults", () => {
    const body = chatRequestBody("m", [{ role: "user", content: "hi" }], presetParams("greedy", { max_tokens: 7 }));
    expect(body).toMatchObject({ model: "m", max_tokens: 7, n: 1, stream: true, stream_options: { include_usage: true }, temperature: 0, logprobs: true, top_logprobs: 5 });
    expect(body).not.toHaveProperty("top_k");
    expect(body).not.toHaveProperty("seed");
    const balanced = chatRequestBody(null, [], presetParams("balanced", { seed: 3 }));
    expect(balanced).toMatchObject({ top_k: 40, top_p: 0.9, min_p: 0.05, repetition_penalty: 1.05, seed: 3 });
    expect(balanced).not.toHaveProperty("model");
  });

  it("load-generator requests sample at the chosen temperature and nothing else", () => {
    const body = loadRequestBody("hello", 0, 32, 2);
    expect(body).toEqual({ messages: [{ role: "user", content: "hello" }], max_tokens: 32, n: 2, stream: true,
      stream_options: { include_usage: true }, temperature: 0, top_p: 1 });
    expect(loadRequestBody("x", 0.8, 16, 1)).toMatchObject({ temperature: 0.8, max_tokens: 16, n: 1 });
  });

  it("beam search sends use_beam_search with n = width", () => {
    const body = chatRequestBody(null, [], presetParams("greedy", { beam_width: 4, n: 2 }));
    expect(body).toMatchObject({ use_beam_search: true, n: 4, temperature: 0 });
  });

  it("recognises presets", () => {
    expect(matchingPreset(presetParams("creative"))).toBe("creative");
    expect(matchingPreset(presetParams("creative", { temperature: 0.3 }))).toBeNull();
  });
});

describe("structured output and tools in the request", () => {
  const schema = '{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}';
  const json = presetParams("greedy", { structured: { ...NO_STRUCTURE, mode: "json_schema", schema } });

  it("adds response_format / structured_outputs and tools next to the sampling fields", () => {
    expect(chatRequestBody(null, [], json)).toMatchObject({
      temperature: 0, stream: true,
      response_format: { type: "json_schema", json_schema: { name: "response", schema: JSON.parse(schema), strict: true } },
    });
    const choice = presetParams("balanced", { structured: { ...NO_STRUCTURE, mode: "choice", choices: "yes\nno" } });
    expect(chatRequestBody(null, [], choice)).toMatchObject({ top_k: 40, structured_outputs: { choice: ["yes", "no"] } });
    const tools = presetParams("greedy", { tools: { text: EXAMPLE_TOOLS, choice: "function:get_weather" } });
    const body = chatRequestBody(null, [], tools);
    expect(body.tools).toEqual(JSON.parse(EXAMPLE_TOOLS));
    expect(body.tool_choice).toEqual({ type: "function", function: { name: "get_weather" } });
    const plain = chatRequestBody(null, [], presetParams("greedy"));
    for (const k of ["response_format", "structured_outputs", "tools", "tool_choice"]) expect(plain).not.toHaveProperty(k);
  });

  it("refuses settings it cannot send: a broken schema, beam search under a grammar, invalid tools", () => {
    expect(requestProblem(json)).toBeNull();
    const broken = { ...json, structured: { ...json.structured, schema: '{"type": ' } };
    expect(requestProblem(broken)).toMatch(/^Structured output: not valid JSON/);
    expect(() => chatRequestBody(null, [], broken)).toThrow(/Structured output/);
    expect(requestProblem({ ...json, beam_width: 3 })).toMatch(/beam search/);
    expect(requestProblem(presetParams("greedy", { beam_width: 3 }))).toBeNull();
    expect(requestProblem(presetParams("greedy", { tools: { text: "{}", choice: "auto" } }))).toMatch(/^Tools: tools must be a JSON array/);
  });

  it("describes the constraints after the sampling settings", () => {
    expect(describeRequest(json)).toBe("greedy · JSON schema");
    expect(describeRequest(presetParams("greedy", { tools: { text: EXAMPLE_TOOLS, choice: "required" } }))).toBe("greedy · tools: get_weather (required)");
    expect(describeRequest(presetParams("greedy"))).toBe("greedy");
  });

  it("accumulates streamed tool calls per choice, with finish_reason tool_calls", () => {
    const r = emptyResult();
    const delta = (d: Record<string, unknown>, finish: string | null = null) => ({ id: "chatcmpl-t", choices: [{ index: 0, delta: d, logprobs: null, finish_reason: finish }] });
    applyChunk(r, delta({ role: "assistant", content: null }));
    applyChunk(r, delta({ tool_calls: [{ index: 0, id: "call_0", type: "function", function: { name: "get_weather", arguments: "" } }] }));
    applyChunk(r, delta({ tool_calls: [{ index: 0, function: { arguments: '{"city": ' } }] }));
    applyChunk(r, delta({ tool_calls: [{ index: 0, function: { arguments: '"Paris"}' } }] }));
    applyChunk(r, delta({}, "tool_calls"));
    const c = r.choices[0]!;
    expect(c.text).toBe("");
    expect(c.tool_calls).toEqual([{ index: 0, id: "call_0", type: "function", name: "get_weather", arguments: '{"city": "Paris"}' }]);
    expect(c.finish_reason).toBe("tool_calls");
  });
});
