// A window.matchMedia for jsdom (which has none) that understands (max-width: Npx) and
// (min-width: Npx) against a width the test sets, and fires "change" when a resize flips a query.
// Any other query (prefers-color-scheme, ...) never matches.

type Listener = (e: { matches: boolean; media: string }) => void;

export type FakeMedia = {
  matchMedia: (query: string) => MediaQueryList;
  resize: (width: number) => void;
  /** "change" listeners still attached, over all the lists handed out. */
  listeners: () => number;
};

function evaluate(query: string, width: number): boolean {
  const m = /^\((max|min)-width:\s*(\d+)px\)$/.exec(query.trim());
  if (m === null) return false;
  return m[1] === "max" ? width <= Number(m[2]) : width >= Number(m[2]);
}

export function fakeMedia(initialWidth: number): FakeMedia {
  let width = initialWidth;
  const lists: { media: string; listeners: Set<Listener>; last: boolean }[] = [];
  const matchMedia = (media: string): MediaQueryList => {
    const entry = { media, listeners: new Set<Listener>(), last: evaluate(media, width) };
    lists.push(entry);
    return {
      media,
      get matches() { return evaluate(media, width); },
      addEventListener: (type: string, l: Listener) => { if (type === "change") entry.listeners.add(l); },
      removeEventListener: (type: string, l: Listener) => { if (type === "change") entry.listeners.delete(l); },
    } as unknown as MediaQueryList;
  };
  return {
    matchMedia,
    resize(w) {
      width = w;
      for (const e of lists) {
        const now = evaluate(e.media, width);
        if (now === e.last) continue;
        e.last = now;
        e.listeners.forEach((l) => l({ matches: now, media: e.media }));
      }
    },
    listeners: () => lists.reduce((n, e) => n + e.listeners.size, 0),
  };
}
