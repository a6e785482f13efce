// The recorded engine session (tests/fixtures/make_recording.py), bundled as text by Vite.
import sessionText from "../__fixtures__/session.jsonl?raw";
import { parseRecording, type Recording } from "../core/recording";

export function loadSession(): Recording {
  return parseRecording(sessionText, "session.jsonl");
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
