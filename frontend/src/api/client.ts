// The dashboard API (issue 4): config, recordings, models. Errors carry the server's message.
import type { ConfigUpdate, EngineInfo, RecordingInfo, RecordingStatus, ReplicasState } from "../core/wire";

export class ApiError extends Error {
  constructor(
    readonly status: number,
    message: string,
  ) {
    super(message);
    this.name = "ApiError";
  }
}

let apiKey: string | null = null;
try {
  apiKey = localStorage.getItem("minivllm.apiKey");
} catch {
  apiKey = null;
}

export function setApiKey(key: string | null): void {
  apiKey = key && key.trim() ? key.trim() : null;
  try {
    if (apiKey) localStorage.setItem("minivllm.apiKey", apiKey);
    else localStorage.removeItem("minivllm.apiKey");
  } catch {
    /* storage unavailable */
  }
}

export function getApiKey(): string | null {
  return apiKey;
}

export function authHeaders(): Record<string, string> {
  return apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
}

/** The error message in an OpenAI-shaped error body, or the status text. */
export async function errorFrom(res: Response): Promise<ApiError> {
  let message = `${res.status} ${res.statusText}`.trim();
  try {
    const text = await res.text();
    try {
      const body = JSON.parse(text) as { error?: { message?: string; param?: string | null }; detail?: string };
      message = body.error?.message ?? body.detail ?? (text || message);
      const param = body.error?.param;
      if (typeof param === "string" && param !== "" && !message.includes(param)) message += ` (${param})`;
    } catch {
      if (text) message = text.slice(0, 300);
    }
  } catch {
    /* no body */
  }
  return new ApiError(res.status, message);
}

async function json<T>(path: string, init: RequestInit = {}): Promise<T> {
  const res = await fetch(path, { ...init, headers: { ...authHeaders(), ...(init.headers ?? {}) } });
  if (!res.ok) throw await errorFrom(res);
  const text = await res.text();
  return (text ? JSON.parse(text) : null) as T;
}

export interface ModelInfo {
  id: string;
  max_model_len?: number;
}

export async function listModels(): Promise<ModelInfo[]> {
  const body = await json<{ data?: ModelInfo[] }>("/v1/models");
  return body?.data ?? [];
}

/** GET /v1/replicas: the engine replicas and the router's latest decisions (none with one engine). */
export function getReplicas(): Promise<ReplicasState> {
  return json<ReplicasState>("/v1/replicas");
}

export function getConfig(): Promise<EngineInfo> {
  return json<EngineInfo>("/api/config");
}

export function putConfig(update: ConfigUpdate): Promise<EngineInfo> {
  return json<EngineInfo>("/api/config", {
    method: "PUT",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(update),
  });
}

/** POST /api/recordings/start: the new recording. */
export function startRecording(): Promise<RecordingInfo> {
  return json<RecordingInfo>("/api/recordings/start", { method: "POST" });
}

/** POST /api/recordings/stop: the finished recording. */
export function stopRecording(): Promise<RecordingInfo> {
  return json<RecordingInfo>("/api/recordings/stop", { method: "POST" });
}

/** GET /api/recordings/status: the running recording, if any. */
export function recordingStatus(): Promise<RecordingStatus> {
  return json<RecordingStatus>("/api/recordings/status");
}

/** GET /api/recordings: a list (accepted bare or wrapped in `recordings` / `data`). */
export async function listRecordings(): Promise<RecordingInfo[]> {
  const body = await json<RecordingInfo[] | { recordings?: RecordingInfo[]; data?: RecordingInfo[] }>("/api/recordings");
  if (Array.isArray(body)) return body;
  return body?.recordings ?? body?.data ?? [];
}

export async function downloadRecording(id: string): Promise<string> {
  const res = await fetch(recordingUrl(id), { headers: authHeaders() });
  if (!res.ok) throw await errorFrom(res);
  return res.text();
}

export function uploadRecording(text: string): Promise<RecordingInfo> {
  return json<RecordingInfo>("/api/recordings", {
    method: "POST",
    headers: { "Content-Type": "application/x-ndjson" },
    body: text,
  });
}

export function recordingUrl(id: string): string {
  return `/api/recordings/${encodeURIComponent(id)}`;
}

export function traceUrl(id: string): string {
  return `/api/recordings/${encodeURIComponent(id)}/trace`;
}
