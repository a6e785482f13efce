// Load generator: N requests from a prompt set, to watch continuous batching live. Browsers open at
// most ~6 HTTP/1.1 connections per server, so at most that many requests stream at once from one
// tab; "choices per request" (n) multiplies the sequences the engine batches.
import { useEffect, useRef, useState } from "react";
import { streamCompletion } from "../../api/stream";
import { loadRequestBody } from "../../core/openai";
import { fmtRate } from "../../core/format";
import { NumberField } from "../components/fields";

export const DEFAULT_PROMPTS = [
  "Explain continuous batching in one paragraph.",
  "Write a haiku about a cache miss.",
  "List three uses of a paged KV cache.",
  "What is the capital of France? Answer briefly.",
  "Summarise the plot of Hamlet in two sentences.",
  "Give me a short recipe for pancakes.",
  "Why is the sky blue?",
  "Translate 'good morning' into five languages.",
  "Describe a transformer decoder layer.",
  "Tell a one-sentence story about a robot.",
  "What does prefix caching save?",
  "Count from one to twenty in words.",
];

/** Chrome and Firefox allow 6 connections per host over HTTP/1.1. */
export const BROWSER_CONNECTIONS = 6;

interface Progress {
  sent: number;
  done: number;
  failed: number;
  chars: number;
  started: number;
  ended: number | null;
  error: string | null;
}

export function LoadGenPanel() {
  const [count, setCount] = useState(16);
  const [maxTokens, setMaxTokens] = useState(64);
  const [temperature, setTemperature] = useState(0.8);
  const [concurrency, setConcurrency] = useState(BROWSER_CONNECTIONS - 2); // leave room for the chat
  const [choices, setChoices] = useState(1);
  const [prompts, setPrompts] = useState(DEFAULT_PROMPTS.join("\n"));
  const [progress, setProgress] = useState<Progress | null>(null);
  const abortRef = useRef<AbortController | null>(null);
  const live = useRef<Progress | null>(null);
  const [now, setNow] = useState(0);

  useEffect(() => {
    const t = setInterval(() => {
      if (live.current) {
        setProgress({ ...live.current });
        setNow(performance.now());
      }
    }, 200);
    return () => {
      clearInterval(t);
      abortRef.current?.abort();
    };
  }, []);

  const running = progress !== null && progress.ended === null;

  const start = async () => {
    const set = prompts.split("\n").map((p) => p.trim()).filter(Boolean);
    if (set.length === 0 || count < 1) return;
    const list = Array.from({ length: count }, (_, i) => set[i % set.length]!);
    const ctrl = new AbortController();
    abortRef.current = ctrl;
    const p: Progress = { sent: 0, done: 0, failed: 0, chars: 0, started: performance.now(), ended: null, error: null };
    live.current = p;
    setProgress({ ...p });
    const runChat = async (prompt: string) => {
      p.sent++;
      let seen = 0;
      try {
        const body = loadRequestBody(prompt, temperature, maxTokens, choices);
        await streamCompletion("/v1/chat/completions", body, ctrl.signal, (r) => {
          const len = r.choices.reduce((n, c) => n + c.text.length, 0);
          p.chars += len - seen;
          seen = len;
        });
        p.done++;
      } catch (err) {
        if (!ctrl.signal.aborted) {
          p.failed++;
          p.error = (err as Error).message;
        }
      }
    };
    try {
      let next = 0;
      await Promise.all(Array.from({ length: Math.min(concurrency, list.length) }, async () => {
        while (next < list.length && !ctrl.signal.aborted) await runChat(list[next++]!);
      }));
    } finally {
      p.ended = performance.now();
      live.current = null;
      setProgress({ ...p });
    }
  };

  const elapsed = progress ? Math.max(0, (progress.ended ?? now) - progress.started) / 1000 : 0;
  return (
    <form className="loadgen" data-testid="loadgen-panel" onSubmit={(e) => { e.preventDefault(); if (!running) void start(); }}>
      <div className="form-grid">
        <NumberField label="Requests" value={count} min={1} max={512} onChange={(v) => v !== null && setCount(Math.max(1, Math.min(512, Math.round(v))))} testId="loadgen-count" />
        <NumberField label="Max tokens each" value={maxTokens} min={1} max={4096} onChange={(v) => v !== null && setMaxTokens(Math.max(1, Math.round(v)))} testId="loadgen-max-tokens" />
        <NumberField label="Temperature" value={temperature} min={0} max={2} step={0.1} onChange={(v) => v !== null && setTemperature(Math.max(0, v))} testId="loadgen-temperature" />
        <NumberField label="At once" value={concurrency} min={1} max={32} onChange={(v) => v !== null && setConcurrency(Math.max(1, Math.min(32, Math.round(v))))} testId="loadgen-concurrency" hint="Requests streaming at the same time (a browser tab gets about 6 connections per server)" />
        <NumberField label="Choices per request (n)" value={choices} min={1} max={8} onChange={(v) => v !== null && setChoices(Math.max(1, Math.min(8, Math.round(v))))} testId="loadgen-n" hint="Sequences per request: forks share the prompt's blocks" />
      </div>
      <label className="field">
        <span className="field-label">Prompt set (one per line, used round-robin)</span>
        <textarea data-testid="loadgen-prompts" rows={6} value={prompts} onChange={(e) => setPrompts(e.currentTarget.value)} />
      </label>
      <p className="muted small">
        Up to {Math.min(concurrency, BROWSER_CONNECTIONS)} requests stream at once from this tab (browsers allow about {BROWSER_CONNECTIONS} connections per
        server); with n = {choices} that is up to {Math.min(concurrency, BROWSER_CONNECTIONS) * choices} sequences in the batch.
      </p>
      <div className="row gap">
        <button type="submit" className="btn btn-primary" data-testid="loadgen-start" disabled={running}>Start {count} requests</button>
        <button type="button" className="btn" data-testid="loadgen-stop" disabled={!running} onClick={() => abortRef.current?.abort()}>Stop</button>
      </div>
      {progress && (
        <p className="small" data-testid="loadgen-progress" role="status" data-done={progress.done} data-sent={progress.sent} data-failed={progress.failed}>
          {running ? "Running" : "Finished"}: {progress.sent} sent · {progress.done} done{progress.failed ? ` · ${progress.failed} failed` : ""} · {elapsed.toFixed(1)} s · {fmtRate(progress.chars / Math.max(0.001, elapsed), "chars/s")}
          {progress.error && <span className="error-text"> — {progress.error}</span>}
        </p>
      )}
    </form>
  );
}
