// A bounded, append-only list with value semantics and amortised O(1) appends.
//
// A Ring is a window [start, end) over a shared buffer. Appending to the newest Ring writes into the
// buffer in place; appending to an older Ring (one whose end is no longer the buffer's end, e.g. a
// replay checkpoint being folded forward again) copies its window first. Either way the Ring you
// appended to still reads exactly what it read before, so states holding Rings stay immutable.

export interface Ring<T> {
  readonly buf: readonly T[];
  readonly start: number;
  readonly end: number;
  readonly cap: number;
}

export function ring<T>(cap: number, items: readonly T[] = []): Ring<T> {
  const kept = items.slice(Math.max(0, items.length - cap));
  return { buf: kept, start: 0, end: kept.length, cap };
}

export function ringLength<T>(r: Ring<T>): number {
  return r.end - r.start;
}

/** Appends `items`; keeps the last `cap`. */
export function ringPush<T>(r: Ring<T>, items: readonly T[]): Ring<T> {
  if (items.length === 0) return r;
  let buf = r.buf as T[];
  let start = r.start;
  let end = r.end;
  if (end !== buf.length || start > r.cap || Object.isFrozen(buf)) {
    // Someone else appended past our end (or the dead prefix got long, or the buffer was frozen):
    // take a private copy.
    buf = buf.slice(start, end);
    end -= start;
    start = 0;
  }
  for (const item of items) buf.push(item);
  end += items.length;
  if (end - start > r.cap) start = end - r.cap;
  return { buf, start, end, cap: r.cap };
}

export function ringItems<T>(r: Ring<T>): T[] {
  return r.buf.slice(r.start, r.end) as T[];
}

/** The newest `n` items, oldest first. */
export function ringTail<T>(r: Ring<T>, n: number): T[] {
  return r.buf.slice(Math.max(r.start, r.end - n), r.end) as T[];
}

export function ringLast<T>(r: Ring<T>): T | undefined {
  return r.end > r.start ? r.buf[r.end - 1] : undefined;
}

