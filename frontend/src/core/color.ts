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

/** murmur3's finaliser: every input bit affects every output bit (FNV alone leaves low bits weak). */
export function mix32(h: number): number {
  h ^= h >>> 16;
  h = Math.imul(h, 0x85ebca6b);
  h ^= h >>> 13;
  h = Math.imul(h, 0xc2b2ae35);
  h ^= h >>> 16;
  return h >>> 0;
}

/** Hue in [0, 360) from the id's mixed hash. */
export function requestHue(id: string): number {
  return (mix32(hashString(id)) / 4294967296) * 360;
}

const cache = new Map<string, string>();

/**
 * The request's colour for the given theme (cached). OKLCH keeps equal hue steps equally distinct
 * to the eye (in HSL, a third of the circle looks "green"); lightness and chroma vary a little
 * with other bits of the hash so that close hues still differ.
 */
export function requestColor(id: string, dark: boolean): string {
  const key = (dark ? "d:" : "l:") + id;
  let c = cache.get(key);
  if (c === undefined) {
    const h = mix32(hashString(id) ^ 0x9e3779b9);
    const hue = requestHue(id);
    const chroma = 0.13 + ((h >>> 8) % 5) * 0.012;
    const light = (dark ? 0.7 : 0.6) + (((h >>> 16) % 5) - 2) * 0.035;
    c = `oklch(${(light * 100).toFixed(1)}% ${chroma.toFixed(3)} ${hue.toFixed(1)})`;
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
