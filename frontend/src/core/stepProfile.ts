// The step-profile panel's logic: each StepFinished as a stacked bar of its parts, its roofline floors,
// and which wall the latest steps are at. Steps recorded without a profile (the panel was closed, or
// an older recording) still show their four coarse phases, without floors.
import { ringTail, type Ring } from "./ring";
import type { StepFinished } from "./wire";

export interface ProfilePart {
  key: string;
  ms: number;
}

export interface ProfileBar {
  step: number;
  durationMs: number;
  /** "native" (the native decode step's own clocks), "coarse" (phases only), "phases" (no profile sent). */
  source: string;
  parts: ProfilePart[];
  /** 0 where the step carries no floor. */
  memoryFloorMs: number;
  computeFloorMs: number;
}

export type Wall = "memory-bound" | "compute-bound" | "overhead-bound";

export interface WallSummary {
  wall: Wall;
  steps: number;
  stepMs: number;
  floorMs: number;
  /** floor / actual: 1 would be a step at its wall. */
  efficiency: number;
  source: string;
}

/** A step whose bigger floor is at least this share of its time is at that wall; below, the time goes
 * to what no floor counts (dispatch, Python, scheduling, sync): overhead-bound. */
export const WALL_SHARE = 0.5;

/** Part keys in drawing order (bottom first), with their legend names and colours (readable on both themes). */
export const PARTS: readonly { key: string; label: string; color: string }[] = [
  { key: "products", label: "weight reads (products)", color: "#7c5cff" },
  { key: "attention", label: "attention", color: "#2da44e" },
  { key: "kv_store", label: "rotary + K/V store", color: "#1f9bb8" },
  { key: "norms_act", label: "norms + activations", color: "#d4a72c" },
  { key: "all_reduce", label: "all-reduce (tensor parallel)", color: "#bf4b8a" },
  { key: "layers_other", label: "rest of the native call", color: "#a371f7" },
  { key: "outside_layers", label: "embedding, LM head, Python", color: "#e16f24" },
  { key: "forward", label: "forward (not split)", color: "#f778ba" },
  { key: "schedule", label: "scheduling", color: "#768390" },
  { key: "sample", label: "sampling", color: "#e5534b" },
  { key: "postprocess", label: "outputs + events", color: "#b0a48a" },
];
const ORDER = new Map(PARTS.map((p, i) => [p.key, i]));
export const OTHER_COLOR = "#57606a";

export function partColor(key: string): string {
  return PARTS[ORDER.get(key) ?? -1]?.color ?? OTHER_COLOR;
}

export function partLabel(key: string): string {
  return PARTS[ORDER.get(key) ?? -1]?.label ?? key;
}

function nonNegative(v: number | undefined): number {
  return v !== undefined && Number.isFinite(v) && v > 0 ? v : 0;
}

export function profileBar(s: StepFinished): ProfileBar {
  const sent = s.profile_parts_ms ?? {};
  const keys = Object.keys(sent);
  const source = s.profile_source && keys.length > 0 ? s.profile_source : "phases";
  const raw: Record<string, number | undefined> =
    source === "phases" ? { schedule: s.schedule_ms, forward: s.forward_ms, sample: s.sample_ms, postprocess: s.postprocess_ms } : sent;
  const parts = Object.keys(raw)
    .map((key) => ({ key, ms: nonNegative(raw[key]) }))
    .sort((a, b) => (ORDER.get(a.key) ?? PARTS.length) - (ORDER.get(b.key) ?? PARTS.length));
  return {
    step: s.step,
    durationMs: nonNegative(s.duration_ms),
    source,
    parts,
    memoryFloorMs: source === "phases" ? 0 : nonNegative(s.memory_floor_ms),
    computeFloorMs: source === "phases" ? 0 : nonNegative(s.compute_floor_ms),
  };
}

/** The newest `max` steps as bars, oldest first. */
export function profileBars(stepTimes: Ring<StepFinished>, max: number): ProfileBar[] {
  return ringTail(stepTimes, max).map(profileBar);
}

export function wallOf(bar: ProfileBar): Wall {
  const floor = Math.max(bar.memoryFloorMs, bar.computeFloorMs);
  if (bar.durationMs <= 0 || floor < WALL_SHARE * bar.durationMs) return "overhead-bound";
  return bar.memoryFloorMs >= bar.computeFloorMs ? "memory-bound" : "compute-bound";
}

function median(values: number[]): number {
  const v = [...values].sort((a, b) => a - b);
  const m = v.length >> 1;
  return v.length % 2 ? v[m]! : (v[m - 1]! + v[m]!) / 2;
}

/** The wall most of the latest `n` steps with floors are at, with their median time, floor and
 * efficiency (median of floor / actual); null when none of them carries a floor. */
export function wallSummary(bars: readonly ProfileBar[], n = 8): WallSummary | null {
  const withFloors = bars.filter((b) => b.durationMs > 0 && Math.max(b.memoryFloorMs, b.computeFloorMs) > 0).slice(-n);
  if (withFloors.length === 0) return null;
  const counts = new Map<Wall, number>();
  for (const b of withFloors) counts.set(wallOf(b), (counts.get(wallOf(b)) ?? 0) + 1);
  let wall: Wall = "overhead-bound";
  let best = -1;
  for (const [w, c] of counts) if (c > best) [wall, best] = [w, c];
  const floors = withFloors.map((b) => Math.max(b.memoryFloorMs, b.computeFloorMs));
  const latest = withFloors[withFloors.length - 1]!;
  return {
    wall,
    steps: withFloors.length,
    stepMs: median(withFloors.map((b) => b.durationMs)),
    floorMs: median(floors),
    efficiency: median(withFloors.map((b, i) => floors[i]! / b.durationMs)),
    source: latest.source,
  };
}

export function wallLine(s: WallSummary | null): string {
  if (s === null) return "No floors yet: steps carry them while this panel is open on a live engine.";
  const how = s.source === "native" ? "native part clocks" : "coarse phases";
  return (
    `Latest ${s.steps} step${s.steps === 1 ? "" : "s"}: ${s.wall}, ${(s.efficiency * 100).toFixed(0)}% efficient ` +
    `(floor ${s.floorMs.toFixed(2)} ms / step ${s.stepMs.toFixed(2)} ms; ${how})`
  );
}

/** The y range a chart of these bars needs: the tallest bar or floor, with headroom. */
export function chartTopMs(bars: readonly ProfileBar[]): number {
  let top = 0;
  for (const b of bars) {
    const stacked = b.parts.reduce((acc, p) => acc + p.ms, 0);
    top = Math.max(top, stacked, b.durationMs, b.memoryFloorMs, b.computeFloorMs);
  }
  return top > 0 ? top * 1.1 : 1;
}

/** Part keys present in these bars, in drawing order (the legend's entries). */
export function legendKeys(bars: readonly ProfileBar[]): string[] {
  const seen = new Set<string>();
  for (const b of bars) for (const p of b.parts) seen.add(p.key);
  return [...seen].sort((a, b) => (ORDER.get(a) ?? PARTS.length) - (ORDER.get(b) ?? PARTS.length));
}
