// Speculative decoding as the dashboard shows it: the setup in words, acceptance from the metrics'
// cumulative counters, verify marks on the timeline, and a verification's draft token by token.
import type { RequestTimeline, TokenEntry, VerifyMark } from "./dashboard";
import type { EngineInfo, MetricsSample, SpecVerified } from "./wire";

// ---- the setup (EngineInfo.speculative) -------------------------------------------------------------

/** The setup in words ("ngram: k=4, n-gram 2-4, off at >= 4 requests"), or "off". */
export function speculativeName(c: Pick<EngineInfo, "speculative">): string {
  const s = c.speculative?.trim() ?? "";
  return s === "" ? "off" : s;
}

/** The setup's first clause ("ngram: k=4"), for tight places such as the header. */
export function speculativeShort(c: Pick<EngineInfo, "speculative">): string {
  const name = speculativeName(c);
  return name.split(",")[0]!.trim() || name;
}

// ---- acceptance from MetricsSample's cumulative counters --------------------------------------------

export interface SpecSummary {
  /** Verifications of at least one drafted token. */
  readonly drafts: number;
  readonly draftTokens: number;
  readonly accepted: number;
  /** accepted / draft tokens. */
  readonly acceptanceRate: number;
  /** Accepted drafts per verification (accepted / drafts). */
  readonly meanAccepted: number;
  /** Tokens a verify step yields: the accepted drafts plus the target's own token. */
  readonly tokensPerStep: number;
  /** [i]: the share of verifications whose draft at position i was accepted. */
  readonly perPosition: readonly number[];
}

/** Totals so far, or null while no draft was ever verified (speculative decoding off, or idle). */
export function specSummary(m: MetricsSample | undefined): SpecSummary | null {
  const drafts = m?.spec_num_drafts ?? 0;
  const draftTokens = m?.spec_num_draft_tokens ?? 0;
  if (!(drafts > 0 && draftTokens > 0)) return null;
  const accepted = m?.spec_num_accepted_tokens ?? 0;
  const meanAccepted = accepted / drafts;
  return {
    drafts,
    draftTokens,
    accepted,
    acceptanceRate: accepted / draftTokens,
    meanAccepted,
    tokensPerStep: meanAccepted + 1,
    perPosition: (m?.spec_accepted_per_position ?? []).map((n) => n / drafts),
  };
}

/** Acceptance over the interval since `prev` (the whole history for the first sample); NaN where no
 * draft was verified in it (or the counters went back: a restarted engine), so charts lift the pen. */
export function specInterval(m: MetricsSample, prev: MetricsSample | undefined): { acceptanceRate: number; meanAccepted: number } {
  const drafts = (m.spec_num_drafts ?? 0) - (prev?.spec_num_drafts ?? 0);
  const tokens = (m.spec_num_draft_tokens ?? 0) - (prev?.spec_num_draft_tokens ?? 0);
  const accepted = (m.spec_num_accepted_tokens ?? 0) - (prev?.spec_num_accepted_tokens ?? 0);
  if (drafts <= 0 || tokens <= 0 || accepted < 0) return { acceptanceRate: NaN, meanAccepted: NaN };
  return { acceptanceRate: accepted / tokens, meanAccepted: accepted / drafts };
}

// ---- verify steps on the timeline -------------------------------------------------------------------

/** "verify: 3 drafted, 2 accepted" (or "…, checking" before the step's result arrived). */
export function verifyTitle(mark: Pick<VerifyMark, "num_draft" | "accepted">): string {
  return `verify: ${mark.num_draft} drafted, ${mark.accepted === null ? "checking" : `${mark.accepted} accepted`}`;
}

/** The verify mark nearest to `ts` within `slack` seconds, if any. */
export function verifyMarkAt(t: RequestTimeline, ts: number, slack: number): VerifyMark | undefined {
  let best: VerifyMark | undefined;
  let bestDistance = Infinity;
  for (const mark of t.verifies) {
    const d = Math.abs(mark.ts - ts);
    if (d <= slack && d < bestDistance) {
      best = mark;
      bestDistance = d;
    }
  }
  return best;
}

/** Per request with verify steps: "id verifies=N drafted=D accepted=A", for the timeline's DOM mirror. */
export function verifySummaryText(rows: Iterable<RequestTimeline>): string {
  const lines: string[] = [];
  for (const t of rows) {
    if (t.verifies.length === 0) continue;
    const drafted = t.verifies.reduce((n, v) => n + v.num_draft, 0);
    const accepted = t.verifies.reduce((n, v) => n + (v.accepted ?? 0), 0);
    lines.push(`${t.request_id} verifies=${t.verifies.length} drafted=${drafted} accepted=${accepted}`);
  }
  return lines.join("\n");
}

// ---- one verification, token by token ---------------------------------------------------------------

export type DraftStatus = "accepted" | "rejected" | "unchecked";

export interface DraftToken {
  readonly id: number;
  /** The token's text where it appears in the output; null where it does not (shown as its id). */
  readonly text: string | null;
  /** accepted: kept; rejected: the first draft the target disagreed with; unchecked: after that. */
  readonly status: DraftStatus;
}

export interface DraftView {
  readonly method: string;
  readonly step: number;
  readonly proposed: readonly DraftToken[];
  readonly accepted: number;
  /** What the target model produced after the accepted drafts: a correction at the first rejected
   * draft, or a bonus token when every draft was accepted. */
  readonly target: { readonly id: number; readonly text: string | null; readonly kind: "correction" | "bonus" };
}

/** Token id -> text, from a request's generated tokens (the text of ids seen in the output). */
export function tokenTexts(entries: Iterable<TokenEntry>): Map<number, string> {
  const texts = new Map<number, string>();
  for (const t of entries) if (t.text !== "" && !texts.has(t.token_id)) texts.set(t.token_id, t.text);
  return texts;
}

export function draftView(v: SpecVerified, texts: ReadonlyMap<number, string>): DraftView {
  const text = (id: number) => texts.get(id) ?? null;
  return {
    method: v.method,
    step: v.step,
    accepted: v.accepted,
    proposed: v.proposed.map((id, i) => ({
      id,
      text: text(id),
      status: i < v.accepted ? "accepted" : i === v.accepted ? "rejected" : "unchecked",
    })),
    target: { id: v.token_id, text: text(v.token_id), kind: v.accepted >= v.proposed.length ? "bonus" : "correction" },
  };
}

/** A token as the draft view shows it: its text quoted, or "#id" where the text is unknown. */
export function tokenLabel(t: { id: number; text: string | null }): string {
  return t.text === null ? `#${t.id}` : JSON.stringify(t.text);
}

// ---- the chat's streamed tokens against the engine's ----------------------------------------------

/**
 * The engine's token entries for a streamed choice, position by position: the sequence whose tokens
 * agree with the choice's text at the most positions (choice `index`'s sequence on a tie). Undefined
 * everywhere when none agrees on at least half of the positions (beam search, say, whose beams are
 * sequences that come and go).
 */
export function alignEngineTokens(
  choice: readonly { readonly text: string }[],
  entries: Iterable<TokenEntry>,
  index = 0,
): (TokenEntry | undefined)[] {
  const bySeq = new Map<number, TokenEntry[]>();
  for (const e of entries) {
    const list = bySeq.get(e.seq_id);
    if (list === undefined) bySeq.set(e.seq_id, [e]);
    else list.push(e);
  }
  const groups = [...bySeq.values()];
  let best: TokenEntry[] | undefined;
  let bestScore = -1;
  groups.forEach((g, k) => {
    let score = 0;
    const n = Math.min(g.length, choice.length);
    for (let i = 0; i < n; i++) if (g[i]!.text === choice[i]!.text) score++;
    if (score > bestScore || (score === bestScore && k === index)) {
      best = g;
      bestScore = score;
    }
  });
  const n = best === undefined ? 0 : Math.min(best.length, choice.length);
  if (best === undefined || n === 0 || bestScore * 2 < n) return choice.map(() => undefined);
  const chosen = best;
  return choice.map((_, i) => chosen[i]);
}
