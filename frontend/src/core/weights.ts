// The weights' precision and memory, fixed when the model loads (EngineInfo's read-only fields).
// Recordings made before quantization lack them (or hold the defaults): then only the precision name shows.
import { fmtBytes, fmtPct } from "./format";
import type { EngineInfo } from "./wire";

type WeightsInfo = Pick<EngineInfo, "dtype" | "quantization" | "weight_bytes" | "weight_fp32_bytes">;

/** What the weights run in: the quantization (e.g. "int4 g32 (embedding and LM head: int8)"), or the dtype when unquantized. */
export function precisionName(c: WeightsInfo): string {
  const q = c.quantization?.trim() ?? "";
  if (q !== "" && q !== "none") return q;
  return c.dtype || "none";
}

/** The precision without its parenthesised detail ("int4 g32"), for tight places such as the header. */
export function shortPrecision(c: WeightsInfo): string {
  return precisionName(c).replace(/\s*\(.*\)\s*$/, "") || precisionName(c);
}

/** Stored weight bytes and their share of the same parameters in fp32 ("95.2 MiB weights (18% of fp32)"), or null when unknown. */
export function weightMemory(c: WeightsInfo): string | null {
  const bytes = c.weight_bytes ?? 0;
  if (!(bytes > 0)) return null;
  const fp32 = c.weight_fp32_bytes ?? 0;
  return fp32 > 0 ? `${fmtBytes(bytes)} weights (${fmtPct(bytes / fp32)} of fp32)` : `${fmtBytes(bytes)} weights`;
}

/** One line: "int4 g32 · 95.2 MiB weights (18% of fp32)", or just the precision for old recordings. */
export function weightsSummary(c: WeightsInfo, short = true): string {
  const name = short ? shortPrecision(c) : precisionName(c);
  const memory = weightMemory(c);
  return memory === null ? name : `${name} · ${memory}`;
}

/** The Engine tab's longer form: "95.2 MiB, 18% of the 513.0 MiB they take in fp32". */
export function weightMemoryDetail(c: WeightsInfo): string | null {
  const bytes = c.weight_bytes ?? 0;
  if (!(bytes > 0)) return null;
  const fp32 = c.weight_fp32_bytes ?? 0;
  return fp32 > 0 ? `${fmtBytes(bytes)}, ${fmtPct(bytes / fp32)} of the ${fmtBytes(fp32)} they take in fp32` : fmtBytes(bytes);
}
