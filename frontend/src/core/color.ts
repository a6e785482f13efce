// Deterministic colours: every view paints a request the same colour, derived from its id alone.

/** FNV-1a, 32 bits. */
export function hashString(s: string): number {
  let h = 0x811c9dc5;
  for (let i = 0; i < s.length; i++) {
    h ^= s.charCodeAt(i);
    h = Math.imul(h, 0x01000193);
  }
  return h >>> 0;
}

/** Hue in [0, 360) spread by the golden angle, so similar ids still get distinct hues. */
export function requestHue(id: string): number {
  return (hashString(id) * 137.508) % 360;
}

const cache = new Map<string, string>();

/** The request's colour for the given theme, as an `hsl()` string (cached). */
export function requestColor(id: string, dark: boolean): string {
  const key = (dark ? "d:" : "l:") + id;
  let c = cache.get(key);
  if (c === undefined) {
    const h = hashString(id);
    const hue = requestHue(id);
    const sat = 55 + ((h >>> 8) % 25);
    const light = dark ? 52 + ((h >>> 16) % 14) : 42 + ((h >>> 16) % 14);
    c = `hsl(${hue.toFixed(1)} ${sat}% ${light}%)`;
    if (cache.size > 4096) cache.clear();
    cache.set(key, c);
  }
  return c;
}

/** Colour for a token probability in [0, 1]: red (unlikely) through amber to green (likely). */
export function probabilityColor(p: number, dark: boolean): string {
  const clamped = Math.max(0, Math.min(1, p));
  const hue = Math.round(clamped * 130);
  return dark ? `hsl(${hue} 70% 30% / 0.85)` : `hsl(${hue} 85% 82%)`;
}
