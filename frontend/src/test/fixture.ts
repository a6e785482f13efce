// The recorded engine sessions, bundled as text by Vite: tests/fixtures/make_recording.py's, and a
// speculative-decoding one with the engine's snapshot after every step (scripts/make_spec_recording.py).
import sessionText from "../__fixtures__/session.jsonl?raw";
import specSessionText from "../__fixtures__/spec_session.jsonl?raw";
import specSnapshotsText from "../__fixtures__/spec_session.snapshots.jsonl?raw";
import { parseRecording, type Recording } from "../core/recording";
import type { Snapshot } from "../core/wire";

export function loadSession(): Recording {
  return parseRecording(sessionText, "session.jsonl");
}

export function loadSpecSession(): Recording {
  return parseRecording(specSessionText, "spec_session.jsonl");
}

/** The raw text of the speculative recording (to load it the way a user does). */
export function specSessionRaw(): string {
  return specSessionText;
}

/** The engine's own snapshot after each step of the speculative session, in order. */
export function loadSpecSnapshots(): Snapshot[] {
  return specSnapshotsText.split("\n").filter((l) => l.trim() !== "").map((l) => JSON.parse(l) as Snapshot);
}

/** Freezes an object graph (typed arrays excepted: they cannot be frozen). */
export function deepFreeze<T>(value: T, seen = new Set<unknown>()): T {
  if (value === null || typeof value !== "object" || seen.has(value) || ArrayBuffer.isView(value)) return value;
  seen.add(value);
  if (value instanceof Map) {
    for (const [k, v] of value) {
      deepFreeze(k, seen);
      deepFreeze(v, seen);
    }
  } else {
    for (const v of Object.values(value as object)) deepFreeze(v, seen);
  }
  return Object.freeze(value);
}
