// The result of checking what a user typed: the value to send, or the problem to show next to it.

export type Checked<T> = { readonly ok: true; readonly value: T } | { readonly ok: false; readonly error: string };

export const ok = <T>(value: T): Checked<T> => ({ ok: true, value });
export const fail = <T = never>(error: string): Checked<T> => ({ ok: false, error });

/** A JSON text parsed, or JSON.parse's message (which names the position of the problem). */
export function parseJson(text: string): Checked<unknown> {
  try {
    return ok(JSON.parse(text) as unknown);
  } catch (err) {
    return fail(`not valid JSON: ${(err as Error).message}`);
  }
}

export function isObject(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}
