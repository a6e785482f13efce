// Grammar-mask shading for the token view: a token chosen under structured outputs carries the share
// of the vocabulary the grammar allowed at that step (TokenGenerated.allowed_fraction). The shade is
// on a log scale, since the interesting range runs from "almost anything" (inside a JSON string) down
// to one or two tokens (a brace, a key the schema requires).

/** Decades of allowed fraction the scale spans: 1 (no shade) down to 1e-5 (full shade), about one
 * token of a 50k vocabulary. */
const DECADES = 5;

/** 0 (the grammar allowed everything) to 1 (it allowed about one token in 100,000), log scale. */
export function maskLevel(fraction: number): number {
  if (!(fraction > 0)) return 1;
  return Math.max(0, Math.min(1, -Math.log10(Math.min(1, fraction)) / DECADES));
}

/** The most ink a hatching line gets: light enough that the text over it (a JSON reply is almost
 * all constrained tokens) stays readable. */
export const MAX_MASK_ALPHA = 0.22;

/** The hatching drawn over a token's background: denser ink where the grammar allowed fewer tokens
 * (dark ink on the light theme, light ink on the dark one); null for level 0. */
export function maskShade(fraction: number, dark: boolean): string | null {
  const level = maskLevel(fraction);
  if (level === 0) return null;
  const alpha = (0.05 + (MAX_MASK_ALPHA - 0.05) * level).toFixed(2);
  const ink = dark ? `rgb(255 255 255 / ${alpha})` : `rgb(0 0 0 / ${alpha})`;
  return `repeating-linear-gradient(135deg, ${ink} 0 1px, transparent 1px 5px)`;
}

/** A percentage with two significant digits for small shares ("0.02%", "3.5%", "100%"). */
export function fmtShare(fraction: number): string {
  const pct = fraction * 100;
  if (pct >= 10) return `${Math.round(pct)}%`;
  if (pct >= 1) return `${pct.toFixed(1).replace(/\.0$/, "")}%`;
  return `${pct.toLocaleString("en-US", { maximumSignificantDigits: 2 })}%`;
}

/** "grammar allowed 0.02% of the vocabulary" (with "(≈10 tokens)" when the vocabulary size is known). */
export function maskTitle(fraction: number, vocabSize?: number): string {
  const count = vocabSize !== undefined && vocabSize > 0 ? Math.max(1, Math.round(fraction * vocabSize)) : null;
  return `grammar allowed ${fmtShare(fraction)} of the vocabulary${count === null ? "" : ` (≈${count} token${count === 1 ? "" : "s"})`}`;
}

/** The fraction for a data attribute: four significant digits. */
export function allowedAttr(fraction: number): string {
  return String(Number(fraction.toPrecision(4)));
}
