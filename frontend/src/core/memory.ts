// The server's resident memory split by part (MetricsSample.memory, engine/memory_view.py): the rows
// of the Metrics panel's stacked bar and table, in a fixed order so colors and rows stay put.
import type { MemorySplit } from "./wire";

export type MemoryPartKey = "weights" | "kv_cache" | "compiled" | "torch" | "libraries" | "other";

export interface MemoryPart {
  key: MemoryPartKey;
  label: string;
  title: string; // what the part counts (a tooltip)
  bytes: number;
  fraction: number; // of the RSS, 0..1
}

export interface MemoryView {
  rss: number;
  parts: MemoryPart[]; // the parts the server could measure, in MEMORY_PARTS order
  unknown: string[]; // labels of the parts it could not (not Linux)
  kvReserved: number;
  clamped: boolean;
}

export const MEMORY_PARTS: readonly { key: MemoryPartKey; label: string; title: string }[] = [
  { key: "weights", label: "Weights", title: "The model's weight tensors' resident pages" },
  { key: "kv_cache", label: "KV cache", title: "The KV pool's resident pages: the blocks ever written" },
  { key: "compiled", label: "Compiled", title: "Kernels compiled by inductor and the native extension (.so)" },
  { key: "torch", label: "Torch", title: "torch's own shared libraries" },
  { key: "libraries", label: "Libraries", title: "Every other shared library" },
  { key: "other", label: "Other", title: "The rest: Python heap, server, tokenizer, temporaries" },
];

/** The split's rows, or null where the sample carries none (an older server or recording). */
export function memoryView(split: MemorySplit | null | undefined): MemoryView | null {
  if (!split || split.rss <= 0) return null;
  const parts: MemoryPart[] = [];
  const unknown: string[] = [];
  for (const p of MEMORY_PARTS) {
    const bytes = split[p.key];
    if (bytes === null || bytes === undefined) unknown.push(p.label);
    else parts.push({ ...p, bytes, fraction: bytes / split.rss });
  }
  return { rss: split.rss, parts, unknown, kvReserved: split.kv_reserved ?? 0, clamped: split.clamped ?? false };
}
