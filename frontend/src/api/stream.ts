// Streaming POSTs to the OpenAI-compatible endpoints. Aborting the signal closes the connection,
// which makes the server abort the request.
import { applyData, emptyResult, SseParser, type StreamResult } from "../core/openai";
import { authHeaders, errorFrom } from "./client";

export interface StreamHandle {
  /** The server's request id (X-Request-Id), once the response headers arrived. */
  requestId: string | null;
  startedAt: number;
  firstTokenAt: number | null;
  endedAt: number | null;
}

/**
 * POSTs `body` and folds the SSE stream into a StreamResult, calling `onUpdate` (with the same,
 * mutated object) as chunks arrive. Resolves with the final result; rejects on HTTP errors, and
 * with an AbortError when `signal` aborts.
 */
export async function streamCompletion(
  path: "/v1/chat/completions" | "/v1/completions",
  body: Record<string, unknown>,
  signal: AbortSignal,
  onUpdate: (result: StreamResult, handle: StreamHandle) => void,
): Promise<{ result: StreamResult; handle: StreamHandle }> {
  const handle: StreamHandle = { requestId: null, startedAt: performance.now(), firstTokenAt: null, endedAt: null };
  const result = emptyResult();
  const res = await fetch(path, {
    method: "POST",
    headers: { "Content-Type": "application/json", Accept: "text/event-stream", ...authHeaders() },
    body: JSON.stringify(body),
    signal,
  });
  handle.requestId = res.headers.get("X-Request-Id");
  if (!res.ok) throw await errorFrom(res);
  if (res.body === null) throw new Error("empty response");
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  const parser = new SseParser();
  const consume = (datas: string[]): boolean => {
    let going = true;
    for (const data of datas) {
      going = applyData(result, data) && going;
      if (handle.firstTokenAt === null && result.choices.some((c) => c.text.length > 0 || c.tokens.length > 0 || c.tool_calls.length > 0)) {
        handle.firstTokenAt = performance.now();
      }
    }
    if (datas.length > 0) onUpdate(result, handle);
    return going;
  };
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      if (!consume(parser.feed(value))) break;
      if (result.error !== null) break;
    }
    consume(parser.end());
  } finally {
    handle.endedAt = performance.now();
    reader.cancel().catch(() => undefined);
  }
  if (result.error !== null) throw new Error(result.error);
  return { result, handle };
}
