// Request colours. Every view paints a request the same colour: a slot held from admission to finish,
// distinct for requests live together (the hand-picked palette first, then generated colours).
import type { RequestTimeline } from "./dashboard";

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

// ---- distinct colours for requests that are live together ---------------------------------------

/** Palette slots: as many clearly different colours as the eye tells apart on a small swatch. */
export const PALETTE_SLOTS = 12;
/** The palette, [hue, lightness (light theme), chroma] in OKLCH. Hand-ordered: each slot differs from
 * the ones before it in hue and often in lightness too, so the few requests of a light load get very
 * different colours and later slots still stand apart from their neighbours. */
const SLOTS: readonly (readonly [number, number, number])[] = [
  [255, 0.58, 0.16], // blue
  [60, 0.72, 0.16], // orange
  [150, 0.64, 0.15], // green
  [335, 0.6, 0.17], // magenta
  [200, 0.74, 0.11], // teal
  [100, 0.82, 0.15], // yellow
  [25, 0.52, 0.15], // brick
  [295, 0.68, 0.14], // violet
  [130, 0.5, 0.12], // olive
  [0, 0.78, 0.1], // pink
  [225, 0.46, 0.12], // navy
  [50, 0.48, 0.09], // brown
];

const slotCss = [false, true].map((dark) =>
  SLOTS.map(([hue, light, chroma]) => `oklch(${((dark ? Math.min(0.86, light + 0.1) : light) * 100).toFixed(1)}% ${chroma} ${hue})`),
);

/** Hue step between generated slots: the golden angle, so no two slots' hues ever coincide. */
const GOLDEN_ANGLE = 137.508;

/** The colour of slot `slot`: the palette's, then (more requests live than it holds) a hue per slot
 * by the golden angle at one of three lightnesses; a little lighter on dark panels. */
export function slotColor(slot: number, dark: boolean): string {
  if (slot < PALETTE_SLOTS) return slotCss[dark ? 1 : 0]![slot]!;
  const hue = (slot * GOLDEN_ANGLE) % 360;
  const light = [0.56, 0.68, 0.78][slot % 3]! + (dark ? 0.08 : 0);
  return `oklch(${(light * 100).toFixed(1)}% 0.14 ${hue.toFixed(2)})`;
}

/** When a request held a slot: from its admission (first state after WAITING) to its end. */
export interface LiveSpan {
  readonly request_id: string;
  readonly arrival_ts: number;
  /** null: never admitted (still waiting). */
  readonly admit: number | null;
  /** Infinity: still live. */
  readonly release: number;
}

/** A request's live span from its timeline. History from before the dashboard joined (UNKNOWN)
 * counts as admitted at arrival: the request may have held blocks then. */
export function liveSpan(t: RequestTimeline): LiveSpan {
  let admit: number | null = null;
  let release = Infinity;
  for (const s of t.segments) {
    if (admit === null && s.state !== "WAITING") admit = s.state === "UNKNOWN" ? t.arrival_ts : s.start;
    if (s.state === "FINISHED" || s.state === "ABORTED") release = s.start;
  }
  return { request_id: t.request_id, arrival_ts: t.arrival_ts, admit, release };
}

/**
 * Palette slots: each request takes the lowest slot free at its admission and gives it back when it
 * finishes (a preempted request keeps its slot: it is still live). Greedy in admission order never
 * gives two overlapping spans the same slot. When more than `numSlots` are live at once, the extra
 * ones get -1 (the caller falls back to the id's hash colour) rather than sharing a slot.
 * Never-admitted requests are absent. Ties are broken by arrival and id, so live view and replay agree.
 */
export function assignSlots(spans: Iterable<LiveSpan>, numSlots = PALETTE_SLOTS): Map<string, number> {
  const admitted = [...spans].filter((s) => s.admit !== null);
  admitted.sort((a, b) => a.admit! - b.admit! || a.arrival_ts - b.arrival_ts || (a.request_id < b.request_id ? -1 : a.request_id > b.request_id ? 1 : 0));
  const heldUntil: number[] = [];
  const out = new Map<string, number>();
  for (const s of admitted) {
    // a slot released at the very moment of this admission is free: the two never overlap
    let slot = heldUntil.findIndex((until) => until <= s.admit!);
    if (slot < 0 && heldUntil.length < numSlots) slot = heldUntil.push(-Infinity) - 1;
    if (slot >= 0) heldUntil[slot] = s.release;
    out.set(s.request_id, slot);
  }
  return out;
}

const slotMemo = new WeakMap<ReadonlyMap<string, RequestTimeline>, Map<string, number>>();

/** Slots for every request of the state (memoised per timelines map: once per state change). */
export function requestSlots(timelines: ReadonlyMap<string, RequestTimeline>): ReadonlyMap<string, number> {
  let slots = slotMemo.get(timelines);
  if (slots === undefined) {
    slots = assignSlots([...timelines.values()].map(liveSpan), Infinity);
    slotMemo.set(timelines, slots);
  }
  return slots;
}

/** Neutral grey for requests not admitted yet: they hold no blocks and draw as a grey line. */
export const UNADMITTED_COLOR = "oklch(62% 0 0)";

/** The colour every view paints request `id` in: its slot's (slots are unbounded here, so requests
 * live together never share one), the hash colour for a request the timelines do not know, grey while
 * it waits for admission. */
export function liveRequestColor(timelines: ReadonlyMap<string, RequestTimeline>, id: string, dark: boolean): string {
  const slot = requestSlots(timelines).get(id);
  if (slot === undefined) return timelines.has(id) ? UNADMITTED_COLOR : requestColor(id, dark);
  return slot >= 0 ? slotColor(slot, dark) : requestColor(id, dark);
}
