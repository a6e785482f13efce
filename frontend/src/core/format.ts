// Number and time formatting shared by panels.

export function fmtSeconds(s: number | null | undefined, digits = 2): string {
  if (s === null || s === undefined || !Number.isFinite(s)) return "–";
  if (Math.abs(s) < 1) return `${(s * 1000).toFixed(s < 0.01 ? 1 : 0)} ms`;
  return `${s.toFixed(digits)} s`;
}

export function fmtMs(ms: number | null | undefined): string {
  if (ms === null || ms === undefined || !Number.isFinite(ms)) return "–";
  return ms >= 100 ? `${ms.toFixed(0)} ms` : `${ms.toFixed(1)} ms`;
}

export function fmtRate(x: number | null | undefined, unit = "tok/s"): string {
  if (x === null || x === undefined || !Number.isFinite(x)) return "–";
  return `${x >= 100 ? x.toFixed(0) : x.toFixed(1)} ${unit}`;
}

export function fmtPct(x: number | null | undefined): string {
  if (x === null || x === undefined || !Number.isFinite(x)) return "–";
  return `${(x * 100).toFixed(x < 0.1 ? 1 : 0)}%`;
}

export function fmtInt(x: number | null | undefined): string {
  if (x === null || x === undefined || !Number.isFinite(x)) return "–";
  return Math.round(x).toLocaleString("en-US");
}

export function fmtBytes(n: number): string {
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KiB`;
  if (n < 1024 * 1024 * 1024) return `${(n / 1024 / 1024).toFixed(1)} MiB`;
  return `${(n / 1024 / 1024 / 1024).toFixed(2)} GiB`;
}

/** "Nice" axis ticks covering [lo, hi] with about `count` steps. */
export function niceTicks(lo: number, hi: number, count = 5): number[] {
  if (!Number.isFinite(lo) || !Number.isFinite(hi) || hi <= lo) return [lo];
  const raw = (hi - lo) / Math.max(1, count);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const norm = raw / mag;
  const step = (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag;
  const ticks: number[] = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(Number(t.toPrecision(12)));
  return ticks;
}

export function fmtTick(x: number): string {
  const a = Math.abs(x);
  if (a >= 1e6) return `${(x / 1e6).toFixed(1)}M`;
  if (a >= 1e4) return `${(x / 1e3).toFixed(0)}k`;
  if (a >= 1e3) return `${(x / 1e3).toFixed(1)}k`;
  if (a === 0 || a >= 10) return x.toFixed(0);
  if (a >= 1) return x.toFixed(1).replace(/\.0$/, "");
  return x.toPrecision(2);
}

/** A request id cut to its first `n` characters, as git shortens hashes (the full id goes in a title). */
export function shortId(id: string, n = 8): string {
  return id.length <= n ? id : id.slice(0, n);
}
