// The SSE reader against a body that tells whether the client cancelled it: a reply that ends with
// [DONE] is read to its close (not cancelled, which the browser reports as an aborted request).
import { afterEach, describe, expect, it, vi } from "vitest";
import { streamCompletion } from "./stream";

function body(parts: string[], onCancel: () => void): ReadableStream<Uint8Array> {
  const enc = new TextEncoder();
  let i = 0;
  return new ReadableStream<Uint8Array>({
    pull(ctrl) {
      if (i < parts.length) ctrl.enqueue(enc.encode(parts[i++]!));
      else ctrl.close();
    },
    cancel: onCancel,
  });
}

const chunk = (t: string) => `data: ${JSON.stringify({ id: "c1", choices: [{ index: 0, delta: { content: t }, finish_reason: null }] })}\n\n`;

describe("streamCompletion", () => {
  afterEach(() => vi.unstubAllGlobals());

  it("reads a successful stream to its end without cancelling it, and ignores data after [DONE]", async () => {
    const cancel = vi.fn();
    const parts = [chunk("Hel"), chunk("lo"), "data: [DONE]\n\n", chunk(" late")];
    vi.stubGlobal("fetch", vi.fn(async () => new Response(body(parts, cancel), { headers: { "X-Request-Id": "r1" } })));
    const { result, handle } = await streamCompletion("/v1/chat/completions", {}, new AbortController().signal, () => undefined);
    expect(result.done).toBe(true);
    expect(result.choices[0]!.text).toBe("Hello");
    expect(handle.requestId).toBe("r1");
    expect(handle.endedAt).not.toBeNull();
    expect(cancel).not.toHaveBeenCalled();
  });

  it("rejects with the error event's message, still reading the body to its end", async () => {
    const cancel = vi.fn();
    const parts = [chunk("a"), `data: ${JSON.stringify({ error: { message: "grammar failed" } })}\n\n`, "data: [DONE]\n\n"];
    vi.stubGlobal("fetch", vi.fn(async () => new Response(body(parts, cancel))));
    await expect(streamCompletion("/v1/chat/completions", {}, new AbortController().signal, () => undefined)).rejects.toThrow("grammar failed");
    expect(cancel).not.toHaveBeenCalled();
  });
});
