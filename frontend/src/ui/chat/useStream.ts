// Runs one streaming chat completion for an assistant turn, pushing updates at most once per frame.
import { useCallback, useEffect, useRef } from "react";
import { streamCompletion } from "../../api/stream";
import { chatRequestBody, type ChatTurn, type DecodingParams } from "../../core/openai";
import { cloneResult, type ChatAction } from "./chatState";

export function useStreams(dispatch: (a: ChatAction) => void, model: string | null) {
  const controllers = useRef(new Map<string, AbortController>());

  useEffect(() => {
    const map = controllers.current;
    return () => {
      for (const c of map.values()) c.abort();
    };
  }, []);

  /** `extra`: fields on top of the request body (Continue's continue_final_message). */
  const run = useCallback(async (id: string, messages: ChatTurn[], params: DecodingParams, extra: Record<string, unknown> = {}) => {
    const ctrl = new AbortController();
    controllers.current.set(id, ctrl);
    let frame = 0;
    let latest: { r: Parameters<typeof cloneResult>[0]; requestId: string | null; firstTokenAt: number | null } | null = null;
    try {
      const { result, handle } = await streamCompletion("/v1/chat/completions", { ...chatRequestBody(model, messages, params), ...extra }, ctrl.signal, (r, h) => {
        latest = { r, requestId: h.requestId, firstTokenAt: h.firstTokenAt };
        if (frame !== 0) return;
        frame = requestAnimationFrame(() => {
          frame = 0;
          dispatch({ type: "update", id, result: cloneResult(r), requestId: h.requestId, firstTokenAt: h.firstTokenAt, at: performance.now() });
        });
      });
      cancelAnimationFrame(frame);
      dispatch({ type: "update", id, result: cloneResult(result), requestId: handle.requestId, firstTokenAt: handle.firstTokenAt, at: handle.endedAt ?? performance.now() });
      dispatch({ type: "finish", id, status: "done", at: performance.now() });
    } catch (err) {
      cancelAnimationFrame(frame);
      const last = latest as { r: Parameters<typeof cloneResult>[0]; requestId: string | null; firstTokenAt: number | null } | null;
      if (last !== null) dispatch({ type: "update", id, result: cloneResult(last.r), requestId: last.requestId, firstTokenAt: last.firstTokenAt });
      if (ctrl.signal.aborted) dispatch({ type: "finish", id, status: "stopped", at: performance.now() });
      else dispatch({ type: "finish", id, status: "error", error: (err as Error).message, at: performance.now() });
    } finally {
      controllers.current.delete(id);
    }
  }, [dispatch, model]);

  const stop = useCallback((id?: string) => {
    if (id !== undefined) controllers.current.get(id)?.abort();
    else for (const c of controllers.current.values()) c.abort();
  }, []);

  return { run, stop };
}
