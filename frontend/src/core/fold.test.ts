import { describe, expect, it } from "vitest";
import { foldEvents, foldSnapshot, stateFromSnapshot, stateToSnapshot } from "./fold";
import { fromSnapshot, reduce } from "./dashboard";
import { ReplayIndex } from "./replay";
import type { AnyEvent, Snapshot } from "./wire";
import { deepFreeze, loadSession } from "../test/fixture";
import { Stream, seqIdOf, snapshot } from "../test/events";

/** Compares like the Python test: requests by id (the engine may have aged finished ones out), blocks exactly. */
function expectSameEngine(folded: Snapshot, expected: Snapshot): void {
  expect(folded.seq).toBe(expected.seq);
  expect(folded.step).toBe(expected.step);
  expect(folded.config).toEqual(expected.config);
  const byId = new Map(folded.requests.map((r) => [r.request_id, r]));
  for (const want of expected.requests) {
    expect(byId.get(want.request_id), `request ${want.request_id}`).toEqual(stateToSnapshot(stateFromSnapshot({ ...expected, requests: [want] })).requests[0]);
  }
  expect(folded.blocks).toEqual(expected.blocks);
}

describe("fold of the recorded session", () => {
  const session = loadSession();

  it("has a header, events and a footer", () => {
    expect(session.events.length).toBeGreaterThan(100);
    expect(session.footer).not.toBeNull();
    const types = new Set(session.events.map((e) => e.type));
    for (const t of ["blocks_copied", "blocks_evicted", "blocks_shared", "request_state", "step_scheduled"]) {
      expect(types.has(t as AnyEvent["type"]), t).toBe(true);
    }
  });

  it("folding every event onto the header snapshot gives the footer snapshot", () => {
    const folded = foldSnapshot(session.header.snapshot, session.events);
    expectSameEngine(folded, session.footer!.snapshot);
    expect(folded.requests.map((r) => r.request_id).sort()).toEqual(session.footer!.snapshot.requests.map((r) => r.request_id).sort());
  });

  it("the dashboard reducer gives the same engine state, whatever the batching", () => {
    for (const batch of [1, 3, 17, 1000]) {
      let state = fromSnapshot(session.header.snapshot);
      for (let i = 0; i < session.events.length; i += batch) state = reduce(state, session.events.slice(i, i + batch));
      expectSameEngine(stateToSnapshot(state.engine), session.footer!.snapshot);
    }
  });

  it("never mutates its input (frozen states fold fine and read the same afterwards)", () => {
    const half = Math.floor(session.events.length / 2);
    const base = deepFreeze(reduce(fromSnapshot(session.header.snapshot), session.events.slice(0, half)));
    const before = JSON.stringify(stateToSnapshot(base.engine));
    const after = reduce(base, session.events.slice(half));
    expect(JSON.stringify(stateToSnapshot(base.engine))).toBe(before);
    expectSameEngine(stateToSnapshot(after.engine), session.footer!.snapshot);
    // folding the same base again (as replay does from a checkpoint) gives the same result
    const again = reduce(base, session.events.slice(half));
    expect(stateToSnapshot(again.engine)).toEqual(stateToSnapshot(after.engine));
    expect(again.log.end - again.log.start).toBe(after.log.end - after.log.start);
  });

  it("ignores events already folded (resume overlaps)", () => {
    const events = session.events;
    const a = reduce(fromSnapshot(session.header.snapshot), events.slice(0, 120));
    const overlapped = reduce(a, events.slice(80)); // 40 events sent twice
    expectSameEngine(stateToSnapshot(overlapped.engine), session.footer!.snapshot);
    expect(overlapped.log.end - overlapped.log.start).toBe(events.length);
    const tokens = [...overlapped.tokens.values()].reduce((n, r) => n + (r.end - r.start), 0);
    expect(tokens).toBe(events.filter((e) => e.type === "token").length);
    expect(reduce(overlapped, events)).toBe(overlapped);
  });

  it("builds timelines: preemption, abort and prefill chunk ticks", () => {
    const state = reduce(fromSnapshot(session.header.snapshot), session.events);
    const states = (id: string) => state.timelines.get(id)!.segments.map((s) => s.state);
    expect(states("e")).toEqual(["WAITING", "ABORTED"]);
    expect(states("c")).toEqual(["WAITING", "PREFILL", "DECODE", "PREEMPTED", "WAITING", "PREFILL", "DECODE", "FINISHED"]);
    expect(states("a")).toEqual(["WAITING", "PREFILL", "DECODE", "FINISHED"]);
    for (const timeline of state.timelines.values()) {
      const segs = timeline.segments;
      segs.forEach((s, i) => {
        expect(s.end, `${timeline.request_id} segment ${i} closed`).not.toBeNull();
        if (i > 0) expect(s.start).toBe(segs[i - 1]!.end);
      });
    }
    // prefill chunk ticks add up to the prompt for a request that was never preempted
    const a = state.timelines.get("a")!;
    expect(a.ticks.reduce((n, t) => n + t.num_tokens, 0)).toBe(state.engine.requests.get("a")!.prompt_tokens);
    expect(state.latencies.end - state.latencies.start).toBe(6);
    expect(state.steps.end - state.steps.start).toBe(session.footer!.snapshot.step);
  });

  it("replay: the state at every position equals a straight fold, checkpoints or not", () => {
    const index = new ReplayIndex(session, 16);
    const straight = (p: number) => stateToSnapshot(reduce(fromSnapshot(session.header.snapshot), session.events.slice(0, p)).engine);
    for (const p of [session.events.length, 0, 1, 15, 16, 17, 100, 57, 180, 3]) {
      expect(stateToSnapshot(index.stateAt(p).engine), `position ${p}`).toEqual(straight(p));
    }
    expectSameEngine(stateToSnapshot(index.stateAt(index.length).engine), session.footer!.snapshot);
    expect(index.checkpointCount).toBe(Math.floor(session.events.length / 16) + 1);
  });

  it("replay: time and step navigation", () => {
    const index = new ReplayIndex(session);
    expect(index.positionAt(index.startTs - 1)).toBe(0);
    expect(index.positionAt(index.endTs)).toBe(index.length);
    const mid = index.positionAt((index.startTs + index.endTs) / 2);
    expect(index.tsAt(mid)).toBeLessThanOrEqual((index.startTs + index.endTs) / 2);
    let p = 0;
    const boundaries: number[] = [];
    while (p < index.length) {
      p = index.stepFrom(p, 1);
      boundaries.push(p);
    }
    expect(boundaries.length).toBe(index.stepPositions.length + 1); // every step, then the end
    for (const b of boundaries.slice(0, -1)) expect(session.events[b]!.type).toBe("step_scheduled");
    expect(index.stepFrom(boundaries[2]!, -1)).toBe(boundaries[1]);
    expect(index.stepFrom(boundaries[0]!, -1)).toBe(0);
  });
});

describe("fold handlers", () => {
  it("preemption resets computed tokens and tables, counts the preemption", () => {
    const s = new Stream();
    s.arrive("a", 6);
    s.state("a", "PREFILL", "WAITING", "admitted");
    s.add({ type: "blocks_allocated", request_id: "a", seq_id: seqIdOf("a"), block_ids: [0, 1], table: [0, 1] });
    s.add({ type: "step_scheduled", step: 1, prefill: [{ request_id: "a", seq_id: seqIdOf("a"), start: 0, num_tokens: 6 }], decode: [], budget_used: 6, budget: 32, num_running: 1, num_waiting: 0, preempted: [], queue_head: null, queue_head_reason: null });
    let state = foldEvents(stateFromSnapshot(snapshot()), s.events);
    expect(state.requests.get("a")!.seqs[0]!.num_computed).toBe(6);
    expect(state.blocks[1]!.ref_count).toBe(1);
    s.state("a", "PREEMPTED", "PREFILL", "preempted: out of KV blocks");
    s.add({ type: "blocks_freed", request_id: "a", seq_id: seqIdOf("a"), block_ids: [0, 1], ref_counts: [0, 0], whole_table: true });
    state = foldEvents(state, s.events);
    const a = state.requests.get("a")!;
    expect(a.state).toBe("PREEMPTED");
    expect(a.num_preemptions).toBe(1);
    expect(a.seqs[0]).toMatchObject({ num_computed: 0, block_table: [] });
    expect(state.blocks.map((b) => b.ref_count)).toEqual([0, 0, 0, 0, 0, 0, 0, 0]);
    const dash = reduce(fromSnapshot(snapshot()), s.events);
    expect(dash.timelines.get("a")!.segments.map((x) => x.state)).toEqual(["WAITING", "PREFILL", "PREEMPTED"]);
    expect(dash.timelines.get("a")!.segments[2]!.end).toBeNull();
  });

  it("forks share blocks, then copy-on-write gives the child its own last block", () => {
    const s = new Stream();
    const parent = seqIdOf("c");
    s.arrive("c", 5, 2);
    s.add({ type: "blocks_allocated", request_id: "c", seq_id: parent, block_ids: [3, 4], table: [3, 4] });
    s.add({ type: "step_scheduled", step: 1, prefill: [{ request_id: "c", seq_id: parent, start: 0, num_tokens: 5 }], decode: [], budget_used: 5, budget: 32, num_running: 1, num_waiting: 0, preempted: [], queue_head: null, queue_head_reason: null });
    s.add({ type: "seq_added", request_id: "c", seq_id: 99, parent_seq_id: parent, num_tokens: 5, num_prompt_tokens: 5 });
    s.add({ type: "blocks_shared", request_id: "c", seq_id: 99, block_ids: [3, 4], ref_counts: [2, 2], prefix_hit: false, table: [3, 4] });
    let state = foldEvents(stateFromSnapshot(snapshot()), s.events);
    const child = state.requests.get("c")!.seqs.find((x) => x.seq_id === 99)!;
    expect(child.num_computed).toBe(5); // inherited from the parent
    expect(child.block_table).toEqual([3, 4]);
    expect(state.blocks[4]!.ref_count).toBe(2);
    s.add({ type: "blocks_copied", request_id: "c", seq_id: 99, src_block_ids: [4], block_ids: [6], ref_counts: [1], table: [3, 6] });
    s.add({ type: "blocks_freed", request_id: "c", seq_id: 99, block_ids: [4], ref_counts: [1], whole_table: false });
    state = foldEvents(state, s.events);
    expect(state.requests.get("c")!.seqs.find((x) => x.seq_id === 99)!.block_table).toEqual([3, 6]);
    expect(state.requests.get("c")!.seqs.find((x) => x.seq_id === parent)!.block_table).toEqual([3, 4]);
    expect(state.blocks.slice(3, 7).map((b) => b.ref_count)).toEqual([2, 1, 0, 1]);
    s.add({ type: "seq_removed", request_id: "c", seq_id: 99, reason: "pruned" });
    state = foldEvents(state, s.events);
    expect(state.requests.get("c")!.seqs.map((x) => x.seq_id)).toEqual([parent]);
  });

  it("tokens count per request and per sequence; first token time is kept", () => {
    const s = new Stream();
    s.arrive("t", 3);
    s.add({ type: "token", request_id: "t", seq_id: seqIdOf("t"), token_id: 5, text: "Hi", logprob: -0.1 });
    s.add({ type: "token", request_id: "t", seq_id: seqIdOf("t"), token_id: 6, text: " there", logprob: null });
    const state = reduce(fromSnapshot(snapshot()), s.events);
    const t = state.engine.requests.get("t")!;
    expect(t.output_tokens).toBe(2);
    expect(t.first_token_ts).toBeCloseTo(0.4);
    expect(t.seqs[0]!.num_tokens).toBe(5);
    const toks = state.tokens.get("t")!;
    expect(toks.buf.slice(toks.start, toks.end).map((x) => x.text).join("")).toBe("Hi there");
  });

  it("prefix-cache hashes come and go; evictions are timestamped for the flash", () => {
    const s = new Stream();
    s.add({ type: "blocks_cached", request_id: "x", seq_id: 1, block_ids: [2, 5], hashes: ["00000000000000aa", "00000000000000bb"] });
    const cached = reduce(fromSnapshot(snapshot()), s.events);
    expect(cached.engine.blocks[2]!.block_hash).toBe("00000000000000aa");
    s.add({ type: "blocks_evicted", block_ids: [5], hashes: ["00000000000000bb"] });
    const evicted = reduce(cached, s.events);
    expect(evicted.engine.blocks[5]!.block_hash).toBeNull();
    expect(evicted.engine.blocks[2]!.block_hash).toBe("00000000000000aa");
    expect(evicted.evictedAt[5]).toBeCloseTo(0.2);
    expect(Number.isNaN(evicted.evictedAt[2]!)).toBe(true);
    expect(Number.isNaN(cached.evictedAt[5]!)).toBe(true); // the earlier state is untouched
  });

  it("the disk tier: evictions to disk and blocks read back are timestamped, each for its own flash", () => {
    const s = new Stream();
    s.add({ type: "blocks_evicted", block_ids: [5], hashes: ["00000000000000bb"], to_disk: true });
    const evicted = reduce(fromSnapshot(snapshot()), s.events);
    s.add({ type: "blocks_cached", request_id: "", seq_id: -1, block_ids: [5], hashes: ["00000000000000cc"], from_disk: true });
    s.add({ type: "blocks_cached", request_id: "x", seq_id: 1, block_ids: [2], hashes: ["00000000000000aa"] });
    const restored = reduce(evicted, s.events.slice(1));
    expect(restored.engine.blocks[5]!.block_hash).toBe("00000000000000cc");
    expect(restored.engine.blocks[5]!.ref_count).toBe(0); // cached and free until a prefix hit takes it
    expect(restored.restoredAt[5]).toBeCloseTo(0.2);
    expect(Number.isNaN(restored.restoredAt[2]!)).toBe(true); // computed here, not read back
    expect(evicted.evictedAt[5]).toBeCloseTo(0.1);
    expect(Number.isNaN(evicted.restoredAt[5]!)).toBe(true); // the earlier state is untouched
  });

  it("blocks that left a sliding KV window are timestamped for their own flash", () => {
    const s = new Stream();
    s.arrive("a", 4);
    s.add({ type: "blocks_allocated", request_id: "a", seq_id: seqIdOf("a"), block_ids: [0, 1, 2], table: [0, 1, 2] });
    const before = reduce(fromSnapshot(snapshot()), s.events);
    s.add({ type: "blocks_freed", request_id: "a", seq_id: seqIdOf("a"), block_ids: [1], ref_counts: [0], whole_table: false, table: [0, 2], dropped: true });
    s.add({ type: "blocks_freed", request_id: "a", seq_id: seqIdOf("a"), block_ids: [2], ref_counts: [0], whole_table: false, table: [0] });
    const after = reduce(before, s.events.slice(-2));
    expect(after.engine.blocks[1]!.ref_count).toBe(0);
    expect(after.droppedAt[1]).toBeGreaterThan(0);
    expect(Number.isNaN(after.droppedAt[2]!)).toBe(true); // freed, not dropped
    expect(Number.isNaN(before.droppedAt[1]!)).toBe(true); // the earlier state is untouched
  });

  it("ConfigChanged resets requests, blocks and per-request history", () => {
    const s = new Stream();
    s.arrive("a", 4);
    s.add({ type: "blocks_allocated", request_id: "a", seq_id: seqIdOf("a"), block_ids: [0], table: [0] });
    const before = reduce(fromSnapshot(snapshot()), s.events);
    s.add({ type: "config_changed", config: { ...before.engine.config, num_blocks: 3, block_size: 8 } });
    const after = reduce(before, s.events);
    expect(after.engine.requests.size).toBe(0);
    expect(after.engine.blocks).toEqual([0, 1, 2].map((i) => ({ block_id: i, ref_count: 0, block_hash: null })));
    expect(after.engine.config.num_blocks).toBe(3);
    expect(after.timelines.size).toBe(0);
    expect(after.evictedAt.length).toBe(3);
    expect(after.restoredAt.length).toBe(3);
    expect(after.droppedAt.length).toBe(3);
    expect(after.epoch).toBe(before.epoch + 1);
    expect(before.engine.requests.size).toBe(1);
  });

  it("events for unknown requests or sequences are ignored, as in the Python fold", () => {
    const s = new Stream();
    s.state("ghost", "DECODE", "PREFILL", "x");
    s.add({ type: "token", request_id: "ghost", seq_id: 1, token_id: 1, text: "a", logprob: null });
    s.add({ type: "blocks_allocated", request_id: "ghost", seq_id: 1, block_ids: [1], table: [1] });
    const state = foldEvents(stateFromSnapshot(snapshot()), s.events);
    expect(state.requests.size).toBe(0);
    expect(state.blocks[1]!.ref_count).toBe(1); // the block change itself still applies
    expect(state.seq).toBe(3);
  });

  it("a snapshot after a reconnect keeps known history and joins the timeline", () => {
    const s = new Stream();
    s.arrive("a", 4);
    s.state("a", "PREFILL", "WAITING", "admitted");
    const live = reduce(fromSnapshot(snapshot()), s.events);
    const snap: Snapshot = { ...stateToSnapshot(live.engine), seq: 50, ts: 5 };
    snap.requests[0]!.state = "DECODE";
    const resynced = fromSnapshot(snap, live);
    expect(resynced.timelines.get("a")!.segments.map((x) => x.state)).toEqual(["WAITING", "PREFILL", "DECODE"]);
    expect(resynced.log.end - resynced.log.start).toBe(s.events.length);
    const fresh = fromSnapshot(snap);
    expect(fresh.timelines.get("a")!.segments.map((x) => x.state)).toEqual(["UNKNOWN", "DECODE"]);
  });

  it("keeps at most maxFinished finished requests", () => {
    const s = new Stream();
    for (let i = 0; i < 40; i++) {
      const id = `r${i}`;
      s.add({ type: "request_arrived", request_id: id, prompt_tokens: 1, max_tokens: 1, n: 1, priority: 0, sampling: {}, prompt_preview: "" });
      s.state(id, "FINISHED", "WAITING", "done", "stop");
    }
    const base = fromSnapshot(snapshot(), undefined, { ...fromSnapshot(snapshot()).limits, maxFinished: 10 });
    const state = reduce(base, s.events);
    expect(state.engine.requests.size).toBe(10);
    expect([...state.engine.requests.keys()][0]).toBe("r30");
    expect(state.timelines.size).toBe(10);
    expect(state.latencies.end - state.latencies.start).toBe(40);
  });
});
