import { describe, expect, it } from "vitest";
import { fromSnapshot, reduce, type TokenEntry } from "./dashboard";
import { describeChunks, describeEvent } from "./describe";
import { foldEvents, foldSnapshot, stateFromSnapshot, stateToSnapshot } from "./fold";
import { ringItems } from "./ring";
import { ReplayIndex, verifyRecording } from "./replay";
import {
  alignEngineTokens,
  draftView,
  specInterval,
  specSummary,
  speculativeName,
  speculativeShort,
  tokenLabel,
  tokenTexts,
  verifyMarkAt,
  verifySummaryText,
  verifyTitle,
} from "./spec";
import type { AnyEvent, MetricsSample, Snapshot, SpecVerified } from "./wire";
import { deepFreeze, loadSpecSession, loadSpecSnapshots } from "../test/fixture";
import { Stream, seqIdOf, snapshot } from "../test/events";

/** Requests by id (with every field, block tables and num_computed included) and blocks exactly. */
function expectSameEngine(folded: Snapshot, expected: Snapshot, where: string): void {
  expect(folded.seq, where).toBe(expected.seq);
  expect(folded.step, where).toBe(expected.step);
  const byId = new Map(folded.requests.map((r) => [r.request_id, r]));
  for (const want of expected.requests) {
    const normalised = stateToSnapshot(stateFromSnapshot({ ...expected, requests: [want] })).requests[0];
    expect(byId.get(want.request_id), `${where}: request ${want.request_id}`).toEqual(normalised);
  }
  expect(folded.blocks, where).toEqual(expected.blocks);
}

describe("fold of a recorded speculative-decoding session", () => {
  const session = loadSpecSession();
  const snapshots = loadSpecSnapshots();
  const upTo = (seq: number) => session.events.filter((e) => (e.seq ?? 0) <= seq);

  it("has verify steps with rejected drafts, rolled-back tails and drafted tokens", () => {
    const verifies = session.events.filter((e): e is SpecVerified & AnyEvent => e.type === "spec_verified");
    expect(verifies.some((v) => v.accepted < v.proposed.length)).toBe(true);
    expect(verifies.some((v) => v.accepted === v.proposed.length)).toBe(true);
    expect(session.events.some((e) => e.type === "blocks_freed" && !e.whole_table && Array.isArray(e.table))).toBe(true);
    const drafted = session.events.filter((e) => e.type === "token" && e.drafted).length;
    expect(drafted).toBe(verifies.reduce((n, v) => n + v.accepted, 0));
    expect(snapshots.length).toBe(session.events.filter((e) => e.type === "step_scheduled").length);
  });

  it("folding the events up to each step gives the engine's own snapshot after that step", () => {
    // num_computed after a verify step only matches once SpecVerified rolled back the rejected
    // drafts; a block table only matches once BlocksFreed.table trimmed the rejected tail
    for (const want of snapshots) {
      expectSameEngine(foldSnapshot(session.header.snapshot, upTo(want.seq)), want, `after step ${want.step}`);
    }
    expectSameEngine(foldSnapshot(session.header.snapshot, session.events), session.footer!.snapshot, "footer");
  });

  it("the dashboard reducer and the replay index agree with the snapshots, whatever the batching", () => {
    for (const batch of [1, 7, 1000]) {
      let state = fromSnapshot(session.header.snapshot);
      let i = 0;
      for (const want of snapshots) {
        const end = session.events.findIndex((e) => (e.seq ?? 0) > want.seq);
        const stop = end < 0 ? session.events.length : end;
        while (i < stop) {
          const next = Math.min(stop, i + batch);
          state = reduce(state, session.events.slice(i, next));
          i = next;
        }
        expectSameEngine(stateToSnapshot(state.engine), want, `batch ${batch}, step ${want.step}`);
      }
    }
    const index = new ReplayIndex(session, 32);
    const last = snapshots[snapshots.length - 1]!;
    expectSameEngine(stateToSnapshot(index.stateAt(upTo(last.seq).length).engine), last, "replay");
    expect(verifyRecording(index)?.ok).toBe(true);
  });

  it("keeps each token's verification, the timeline's verify marks and per-request totals", () => {
    const state = reduce(fromSnapshot(session.header.snapshot), session.events);
    const verifies = session.events.filter((e): e is SpecVerified & AnyEvent => e.type === "spec_verified");
    // a step that rejected its last draft: two accepted drafts, then the target's correction
    const partial = verifies.find((v) => v.accepted === 2 && v.proposed.length === 3)!;
    const tokens = ringItems(state.tokens.get(partial.request_id)!);
    const fromStep = tokens.filter((t) => t.verify === partial);
    expect(fromStep.map((t) => t.drafted)).toEqual([true, true, false]);
    expect(fromStep.map((t) => t.token_id)).toEqual([...partial.proposed.slice(0, 2), partial.token_id]);
    // every drafted token points at a verification that accepted it
    for (const [id, ring] of state.tokens) {
      for (const t of ringItems(ring)) if (t.drafted) expect(t.verify?.request_id, id).toBe(id);
    }
    let marks = 0;
    for (const [id, timeline] of state.timelines) {
      const own = verifies.filter((v) => v.request_id === id);
      expect(timeline.verifies.map((m) => [m.step, m.num_draft, m.accepted]), id).toEqual(own.map((v) => [v.step, v.proposed.length, v.accepted]));
      marks += timeline.verifies.length;
      const spec = state.spec.get(id);
      if (own.length === 0) continue;
      expect(spec).toMatchObject({ drafts: own.length, draftTokens: own.reduce((n, v) => n + v.proposed.length, 0), accepted: own.reduce((n, v) => n + v.accepted, 0) });
    }
    expect(marks).toBe(verifies.length);
    // the last metrics sample's counters add up to the same
    const last = specSummary(ringItems(state.metrics).at(-1))!;
    expect(last.drafts).toBe(verifies.length);
    expect(last.accepted).toBe(verifies.reduce((n, v) => n + v.accepted, 0));
  });
});

describe("fold handlers for speculative decoding", () => {
  const a = seqIdOf("a");
  const verifyStep = (s: Stream, step: number, start: number, numDraft: number) =>
    s.add({ type: "step_scheduled", step, prefill: [], decode: [{ request_id: "a", seq_id: a, start, num_tokens: 1 + numDraft, num_draft: numDraft }], budget_used: 1 + numDraft, budget: 32, num_running: 1, num_waiting: 0, preempted: [], queue_head: null, queue_head_reason: null });

  function setup(): Stream {
    const s = new Stream();
    s.arrive("a", 6);
    s.state("a", "PREFILL", "WAITING", "admitted");
    s.add({ type: "blocks_allocated", request_id: "a", seq_id: a, block_ids: [0, 1], table: [0, 1] });
    s.add({ type: "step_scheduled", step: 1, prefill: [{ request_id: "a", seq_id: a, start: 0, num_tokens: 6 }], decode: [], budget_used: 6, budget: 32, num_running: 1, num_waiting: 0, preempted: [], queue_head: null, queue_head_reason: null });
    s.add({ type: "token", request_id: "a", seq_id: a, token_id: 50, text: " the", logprob: null });
    s.state("a", "DECODE", "PREFILL", "prefilled");
    // step 2 verifies 3 drafts (positions 6..9, block 2 holds the last ones)
    s.add({ type: "blocks_allocated", request_id: "a", seq_id: a, block_ids: [2], table: [0, 1, 2] });
    verifyStep(s, 2, 6, 3);
    return s;
  }

  it("StepScheduled counts the drafts as computed; SpecVerified rolls the rejected ones back", () => {
    const s = setup();
    const scheduled = foldEvents(stateFromSnapshot(snapshot()), s.events);
    expect(scheduled.requests.get("a")!.seqs[0]!.num_computed).toBe(10); // start + num_tokens
    s.add({ type: "spec_verified", request_id: "a", seq_id: a, step: 2, method: "ngram", proposed: [51, 52, 53], accepted: 1, token_id: 60 });
    const verified = foldEvents(scheduled, s.events);
    expect(verified.requests.get("a")!.seqs[0]!.num_computed).toBe(8); // 10 - (3 - 1)
    expect(scheduled.requests.get("a")!.seqs[0]!.num_computed).toBe(10); // pure: the old state is kept
    // all accepted: nothing rolls back
    verifyStep(s, 3, 8, 2);
    s.add({ type: "spec_verified", request_id: "a", seq_id: a, step: 3, method: "ngram", proposed: [54, 55], accepted: 2, token_id: 61 });
    expect(foldEvents(verified, s.events).requests.get("a")!.seqs[0]!.num_computed).toBe(11);
  });

  it("BlocksFreed with a table sets the sequence's table (rollback); without one it leaves it", () => {
    const s = setup();
    s.add({ type: "spec_verified", request_id: "a", seq_id: a, step: 2, method: "ngram", proposed: [51, 52, 53], accepted: 0, token_id: 60 });
    s.add({ type: "blocks_freed", request_id: "a", seq_id: a, block_ids: [2], ref_counts: [0], whole_table: false, table: [0, 1] });
    const state = foldEvents(stateFromSnapshot(snapshot()), s.events);
    expect(state.requests.get("a")!.seqs[0]!.block_table).toEqual([0, 1]);
    expect(state.blocks[2]!.ref_count).toBe(0);
    // an older event (copy-on-write before this field existed): refs change, the table does not
    const t = new Stream(s.events.length);
    t.add({ type: "blocks_freed", request_id: "a", seq_id: a, block_ids: [1], ref_counts: [3], whole_table: false });
    t.add({ type: "blocks_freed", request_id: "a", seq_id: a, block_ids: [0], ref_counts: [2], whole_table: false, table: null });
    const after = foldEvents(state, t.events);
    expect(after.requests.get("a")!.seqs[0]!.block_table).toEqual([0, 1]);
    expect(after.blocks.slice(0, 2).map((b) => b.ref_count)).toEqual([2, 3]);
    // whole_table still wins
    t.add({ type: "blocks_freed", request_id: "a", seq_id: a, block_ids: [0, 1], ref_counts: [0, 0], whole_table: true, table: [0, 1] });
    expect(foldEvents(after, t.events).requests.get("a")!.seqs[0]!.block_table).toEqual([]);
  });

  it("tokens carry `drafted` and their step's verification; the timeline marks the verify step", () => {
    const s = setup();
    const scheduled = reduce(fromSnapshot(snapshot()), s.events);
    expect(scheduled.timelines.get("a")!.verifies).toEqual([{ ts: 1, step: 2, seq_id: a, num_draft: 3, accepted: null }]);
    const verify = s.add({ type: "spec_verified", request_id: "a", seq_id: a, step: 2, method: "ngram", proposed: [51, 52, 53], accepted: 2, token_id: 60 });
    s.add({ type: "token", request_id: "a", seq_id: a, token_id: 51, text: " cat", logprob: -0.1, drafted: true });
    s.add({ type: "token", request_id: "a", seq_id: a, token_id: 52, text: " sat", logprob: -0.2, drafted: true });
    s.add({ type: "token", request_id: "a", seq_id: a, token_id: 60, text: " down", logprob: -0.3, drafted: false });
    // folded in one go and event by event (a frame may split a step anywhere): the same
    for (const state of [reduce(scheduled, s.events), s.events.reduce((st, e) => reduce(st, [e]), scheduled)]) {
      const tokens = ringItems(state.tokens.get("a")!);
      expect(tokens.map((t: TokenEntry) => [t.text, t.drafted, t.verify])).toEqual([
        [" the", false, null], // a plain decode step
        [" cat", true, verify],
        [" sat", true, verify],
        [" down", false, verify],
      ]);
      expect(state.timelines.get("a")!.verifies).toEqual([{ ts: 1, step: 2, seq_id: a, num_draft: 3, accepted: 2 }]);
      expect(state.spec.get("a")).toMatchObject({ drafts: 1, draftTokens: 3, accepted: 2 });
      expect(state.engine.requests.get("a")!.output_tokens).toBe(4);
    }
    expect(scheduled.timelines.get("a")!.verifies[0]!.accepted).toBeNull(); // the earlier state is untouched
  });

  it("a token of the next, plain step does not inherit the previous step's verification", () => {
    const s = setup();
    s.add({ type: "spec_verified", request_id: "a", seq_id: a, step: 2, method: "ngram", proposed: [51, 52, 53], accepted: 0, token_id: 60 });
    s.add({ type: "token", request_id: "a", seq_id: a, token_id: 60, text: " x", logprob: null });
    s.add({ type: "step_scheduled", step: 3, prefill: [], decode: [{ request_id: "a", seq_id: a, start: 7, num_tokens: 1 }], budget_used: 1, budget: 32, num_running: 1, num_waiting: 0, preempted: [], queue_head: null, queue_head_reason: null });
    s.add({ type: "token", request_id: "a", seq_id: a, token_id: 61, text: " y", logprob: null });
    const state = reduce(fromSnapshot(snapshot()), s.events);
    const tokens = ringItems(state.tokens.get("a")!);
    expect(tokens.map((t) => [t.text, t.drafted, t.verify?.step ?? null])).toEqual([[" the", false, null], [" x", false, 2], [" y", false, null]]);
    expect(state.timelines.get("a")!.verifies.map((m) => m.accepted)).toEqual([0]);
  });

  it("never mutates a frozen state; a rebuilt engine or a re-used id drops the verifications", () => {
    const s = setup();
    s.add({ type: "spec_verified", request_id: "a", seq_id: a, step: 2, method: "ngram", proposed: [51], accepted: 1, token_id: 60 });
    const base = deepFreeze(reduce(fromSnapshot(snapshot()), s.events));
    verifyStep(s, 3, 8, 2);
    s.add({ type: "spec_verified", request_id: "a", seq_id: a, step: 3, method: "ngram", proposed: [54, 55], accepted: 1, token_id: 61 });
    const next = reduce(base, s.events);
    expect(next.timelines.get("a")!.verifies.map((m) => m.accepted)).toEqual([1, 1]);
    expect(base.timelines.get("a")!.verifies.map((m) => m.accepted)).toEqual([1]);
    expect(next.spec.get("a")).toMatchObject({ drafts: 2, draftTokens: 3, accepted: 2 });
    s.add({ type: "request_arrived", request_id: "a", prompt_tokens: 2, max_tokens: 4, n: 1, priority: 0, sampling: {}, prompt_preview: "" });
    expect(reduce(next, s.events).spec.has("a")).toBe(false);
    s.add({ type: "config_changed", config: { ...next.engine.config, num_blocks: 4 } });
    expect(reduce(next, s.events).spec.size).toBe(0);
  });
});

describe("speculative metrics from the cumulative counters", () => {
  const sample = (over: Partial<MetricsSample>): MetricsSample => ({
    type: "metrics", num_running: 1, num_waiting: 0, kv_usage: 0.1, num_cached_free_blocks: 0, prefix_cache_queries: 0, prefix_cache_hits: 0,
    num_preemptions: 0, prompt_tokens: 0, generation_tokens: 0, generation_throughput: 0, prompt_throughput: 0, ...over,
  });

  it("acceptance rate is accepted / drafted tokens; mean accepted length is accepted / verifies", () => {
    const s = specSummary(sample({ spec_num_drafts: 10, spec_num_draft_tokens: 40, spec_num_accepted_tokens: 25, spec_accepted_per_position: [9, 8, 5, 3] }))!;
    expect(s.acceptanceRate).toBeCloseTo(0.625);
    expect(s.meanAccepted).toBeCloseTo(2.5);
    expect(s.tokensPerStep).toBeCloseTo(3.5);
    expect(s.perPosition).toEqual([0.9, 0.8, 0.5, 0.3]);
    expect(s).toMatchObject({ drafts: 10, draftTokens: 40, accepted: 25 });
  });

  it("is null when speculative decoding is off (counters zero or absent), never NaN", () => {
    expect(specSummary(undefined)).toBeNull();
    expect(specSummary(sample({}))).toBeNull();
    expect(specSummary(sample({ spec_num_drafts: 0, spec_num_draft_tokens: 0, spec_num_accepted_tokens: 0, spec_accepted_per_position: [] }))).toBeNull();
  });

  it("per interval: the change since the previous sample; NaN where nothing was verified", () => {
    const a = sample({ spec_num_drafts: 4, spec_num_draft_tokens: 12, spec_num_accepted_tokens: 6 });
    const b = sample({ spec_num_drafts: 6, spec_num_draft_tokens: 18, spec_num_accepted_tokens: 12 });
    expect(specInterval(a, undefined)).toEqual({ acceptanceRate: 0.5, meanAccepted: 1.5 });
    expect(specInterval(b, a)).toEqual({ acceptanceRate: 1, meanAccepted: 3 });
    const idle = specInterval(b, b);
    expect(Number.isNaN(idle.acceptanceRate) && Number.isNaN(idle.meanAccepted)).toBe(true);
    expect(Number.isNaN(specInterval(a, b).acceptanceRate)).toBe(true); // counters went back: a new engine
  });

  it("names the setup, or off", () => {
    const setup = "ngram: k=4, n-gram 2-4, off at >= 4 requests";
    expect(speculativeName({ speculative: setup })).toBe(setup);
    expect(speculativeShort({ speculative: setup })).toBe("ngram: k=4");
    expect(speculativeName({ speculative: null })).toBe("off");
    expect(speculativeName({})).toBe("off");
    expect(speculativeShort({ speculative: "  " })).toBe("off");
  });
});

describe("verify marks and drafts, as shown", () => {
  const v: SpecVerified = { type: "spec_verified", request_id: "a", seq_id: 0, step: 7, method: "ngram", proposed: [11, 12, 13, 14], accepted: 2, token_id: 20 };

  it("draftView: accepted prefix, the first rejected draft, then unchecked; texts where the output has them", () => {
    const view = draftView(v, new Map([[11, " the"], [12, " cat"], [20, " dog"]]));
    expect(view.proposed.map((t) => [tokenLabel(t), t.status])).toEqual([
      ['" the"', "accepted"], ['" cat"', "accepted"], ["#13", "rejected"], ["#14", "unchecked"],
    ]);
    expect(view.target).toEqual({ id: 20, text: " dog", kind: "correction" });
    expect(draftView({ ...v, accepted: 4 }, new Map()).target.kind).toBe("bonus");
    expect(draftView({ ...v, accepted: 0 }, new Map()).proposed.map((t) => t.status)).toEqual(["rejected", "unchecked", "unchecked", "unchecked"]);
  });

  it("the event log and the scheduler describe verifications, drafted tokens and rollbacks", () => {
    expect(describeEvent(v)).toBe("a/0: verify (ngram) step 7: 2/4 drafts accepted [11,12,13,14] → 20");
    expect(describeEvent({ type: "token", request_id: "a", seq_id: 0, token_id: 11, text: " the", logprob: null, drafted: true })).toBe('a/0: " the" (accepted draft)');
    expect(describeEvent({ type: "blocks_freed", request_id: "a", seq_id: 0, block_ids: [5], ref_counts: [0], whole_table: false, table: [1, 2] })).toBe("a/0: freed [5] → table of 2");
    expect(describeEvent({ type: "blocks_freed", request_id: "a", seq_id: 0, block_ids: [3, 4], ref_counts: [0, 0], whole_table: false, table: [1, 5], dropped: true })).toBe("a/0: dropped [3,4] (left the window)");
    expect(describeChunks([{ request_id: "a", seq_id: 0, start: 9, num_tokens: 4, num_draft: 3 }, { request_id: "b", seq_id: 1, start: 5, num_tokens: 1 }])).toBe("a[9+4, 3 draft] b[5+1]");
  });

  it("tokenTexts keeps the first non-empty text per id", () => {
    const entry = (token_id: number, text: string): TokenEntry => ({ seq_id: 0, token_id, text, logprob: null, ts: 0, drafted: false, allowed_fraction: null, verify: null });
    expect([...tokenTexts([entry(1, ""), entry(1, "a"), entry(2, "b"), entry(1, "c")])]).toEqual([[1, "a"], [2, "b"]]);
  });

  it("verify titles, the mark under the pointer and the DOM summary", () => {
    expect(verifyTitle({ num_draft: 3, accepted: 2 })).toBe("verify: 3 drafted, 2 accepted");
    expect(verifyTitle({ num_draft: 3, accepted: 0 })).toBe("verify: 3 drafted, 0 accepted");
    expect(verifyTitle({ num_draft: 4, accepted: null })).toBe("verify: 4 drafted, checking");
    const timeline = {
      request_id: "a", arrival_ts: 0, segments: [], ticks: [],
      verifies: [
        { ts: 1, step: 1, seq_id: 0, num_draft: 3, accepted: 3 },
        { ts: 1.5, step: 2, seq_id: 0, num_draft: 3, accepted: 1 },
      ],
    };
    expect(verifyMarkAt(timeline, 1.4, 0.2)?.step).toBe(2);
    expect(verifyMarkAt(timeline, 1.2, 0.3)?.step).toBe(1);
    expect(verifyMarkAt(timeline, 3, 0.2)).toBeUndefined();
    expect(verifySummaryText([timeline, { ...timeline, request_id: "b", verifies: [] }])).toBe("a verifies=2 drafted=6 accepted=4");
  });

  it("aligns a streamed choice with the engine sequence whose text agrees", () => {
    const e = (seq_id: number, text: string, drafted = false): TokenEntry => ({ seq_id, token_id: text.length, text, logprob: null, ts: 0, drafted, allowed_fraction: null, verify: null });
    const entries = [e(1, "A"), e(2, "x"), e(1, "B", true), e(2, "y", true), e(1, "C"), e(2, "z")];
    const choice = [{ text: "x" }, { text: "y" }, { text: "z" }];
    expect(alignEngineTokens(choice, entries, 0).map((t) => t?.text)).toEqual(["x", "y", "z"]);
    expect(alignEngineTokens(choice, entries, 0).map((t) => t?.drafted)).toEqual([false, true, false]);
    // more streamed tokens than the engine has seen so far: the rest are unknown
    expect(alignEngineTokens([...choice, { text: "w" }], entries).map((t) => t?.text)).toEqual(["x", "y", "z", undefined]);
    // nothing agrees (another request): no entries at all
    expect(alignEngineTokens([{ text: "p" }, { text: "q" }], entries).every((t) => t === undefined)).toBe(true);
    expect(alignEngineTokens(choice, []).every((t) => t === undefined)).toBe(true);
  });
});
