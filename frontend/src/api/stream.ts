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
  const consume = (datas: string[]): void => {
    for (const data of datas) {
      // after [DONE] nothing more belongs to the reply
      if (result.done) break;
      applyData(result, data);
      if (result.done && handle.endedAt === null) handle.endedAt = performance.now();
      if (handle.firstTokenAt === null && result.choices.some((c) => c.text.length > 0 || c.tokens.length > 0 || c.tool_calls.length > 0)) {
        handle.firstTokenAt = performance.now();
      }
    }
    if (datas.length > 0) onUpdate(result, handle);
  };
  // Read to the end of the body: the server closes it right after [DONE] (or an error event and
  // [DONE]). Cancelling on [DONE] instead would abort a request that succeeded (net::ERR_ABORTED).
  let ended = false;
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) {
        ended = true;
        break;
      }
      consume(parser.feed(value));
    }
    consume(parser.end());
  } finally {
    handle.endedAt ??= performance.now();
    // only a stream left early (an exception, such as the abort) is cancelled
    if (!ended) reader.cancel().catch(() => undefined);
  }
  if (result.error !== null) throw new Error(result.error);
  return { result, handle };
}
