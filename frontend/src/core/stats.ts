// Small statistics for the metrics panel.

export function percentile(sorted: readonly number[], q: number): number | null {
  if (sorted.length === 0) return null;
  const pos = (sorted.length - 1) * q;
  const lo = Math.floor(pos);
  const hi = Math.ceil(pos);
  return sorted[lo]! + (sorted[hi]! - sorted[lo]!) * (pos - lo);
}

export interface Histogram {
  readonly edges: number[];
  readonly counts: number[];
  readonly max: number;
}

/** Histogram of `values` over [0, a high percentile], `bins` equal bins (outliers land in the last). */
export function histogram(values: readonly number[], bins = 24): Histogram {
  const finite = values.filter((v) => Number.isFinite(v) && v >= 0);
  if (finite.length === 0) return { edges: [], counts: [], max: 0 };
  const sorted = [...finite].sort((a, b) => a - b);
  const top = Math.max(percentile(sorted, 0.99) ?? 0, 1e-6);
  const width = top / bins;
  const counts = new Array<number>(bins).fill(0);
  for (const v of finite) counts[Math.min(bins - 1, Math.floor(v / width))]! += 1;
  const edges = Array.from({ length: bins + 1 }, (_, i) => i * width);
  return { edges, counts, max: Math.max(...counts) };
}

export function summary(values: readonly number[]): { p50: number | null; p90: number | null; p99: number | null; n: number } {
  const sorted = values.filter((v) => Number.isFinite(v)).sort((a, b) => a - b);
  return { p50: percentile(sorted, 0.5), p90: percentile(sorted, 0.9), p99: percentile(sorted, 0.99), n: sorted.length };
}
