// Recordings (JSONL): line 1 a header {type: "header", version, created, snapshot}, then one event per
// line, and — when the recording was stopped cleanly — a footer {type: "footer", snapshot}.
import type { AnyEvent, RecordingFooter, RecordingHeader, RecordingInfo } from "./wire";
import { EVENT_TYPES } from "./wire";

export interface Recording {
  readonly header: RecordingHeader;
  readonly events: readonly AnyEvent[];
  readonly footer: RecordingFooter | null;
  /** A name to show: the server's id or the file name. */
  readonly name: string;
}

export class RecordingFormatError extends Error {
  constructor(
    readonly line: number,
    message: string,
  ) {
    super(`line ${line}: ${message}`);
    this.name = "RecordingFormatError";
  }
}

const eventTypes = new Set<string>(EVENT_TYPES);

function isObject(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

/** Parses a recording; errors name the 1-based line, like the server's validation. */
export function parseRecording(text: string, name = "recording"): Recording {
  let header: RecordingHeader | null = null;
  let footer: RecordingFooter | null = null;
  const events: AnyEvent[] = [];
  const lines = text.split("\n");
  for (let i = 0; i < lines.length; i++) {
    const raw = lines[i]!.trim();
    if (raw === "") continue;
    const number = i + 1;
    if (footer !== null) throw new RecordingFormatError(number, "content after the footer line");
    let item: unknown;
    try {
      item = JSON.parse(raw);
    } catch (err) {
      throw new RecordingFormatError(number, `not JSON (${(err as Error).message})`);
    }
    if (!isObject(item) || typeof item.type !== "string") {
      throw new RecordingFormatError(number, "expected an object with a `type` field");
    }
    if (header === null) {
      if (item.type !== "header" || !isObject(item.snapshot)) {
        throw new RecordingFormatError(number, "not a recording header");
      }
      header = item as unknown as RecordingHeader;
    } else if (item.type === "footer") {
      if (!isObject(item.snapshot)) throw new RecordingFormatError(number, "footer without a snapshot");
      footer = item as unknown as RecordingFooter;
    } else if (eventTypes.has(item.type)) {
      events.push(item as unknown as AnyEvent);
    } else {
      throw new RecordingFormatError(number, `unknown event type ${JSON.stringify(item.type)}`);
    }
  }
  if (header === null) throw new RecordingFormatError(1, "empty recording: expected a header line");
  return { header, events, footer, name };
}

/** Whose recording it is, for the list: servers run from one checkout share its `./recordings`. */
export function recordingOwner(info: Pick<RecordingInfo, "mine" | "server">): string {
  if (info.mine === true) return "this server";
  if (info.server === "upload") return "uploaded";
  return info.server ? `from ${info.server}` : "unknown server";
}
