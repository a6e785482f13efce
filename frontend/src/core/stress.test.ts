import { describe, expect, it } from "vitest";
import { EngineSimulator } from "./stress";
import { fromSnapshot, reduce } from "./dashboard";
import { blockModel } from "./heatmap";

describe("the synthetic engine drives the real reducer consistently", () => {
  it("keeps ref counts equal to table references, through preemption, sharing and eviction", () => {
    const sim = new EngineSimulator({ numBlocks: 400, concurrency: 24, budget: 512, seed: 3 });
    let state = fromSnapshot(sim.snapshot());
    const seen = new Set<string>();
    let maxShared = 0;
    for (let i = 0; i < 1500; i++) {
      const events = sim.step();
      for (const e of events) seen.add(e.type);
      state = reduce(state, events);
      if (i % 50 === 0) {
        const refs = new Array<number>(400).fill(0);
        for (const r of state.engine.requests.values()) for (const s of r.seqs) for (const b of s.block_table) refs[b]!++;
        expect(state.engine.blocks.map((b) => b.ref_count)).toEqual(refs);
        expect(state.engine.blocks.map((b) => b.ref_count)).toEqual([...sim.refs]);
        expect(state.engine.blocks.map((b) => b.block_hash)).toEqual(sim.hashes);
        maxShared = Math.max(maxShared, blockModel(state.engine).counts.shared);
      }
    }
    for (const t of ["blocks_evicted", "blocks_shared", "blocks_cached", "metrics"]) expect(seen.has(t), t).toBe(true);
    expect(state.timelines.size).toBeGreaterThan(24);
    expect(maxShared).toBeGreaterThan(0);
    const preempted = [...state.timelines.values()].some((t) => t.segments.some((s) => s.state === "PREEMPTED"));
    expect(preempted).toBe(true);
  });

  it("the default stress load (64 requests, 2,000 blocks) folds well under a frame per second of events", () => {
    const sim = new EngineSimulator();
    let state = fromSnapshot(sim.snapshot());
    const batches: ReturnType<EngineSimulator["step"]>[] = [];
    for (let i = 0; i < 400; i++) batches.push(sim.step()); // 10 s of engine time at 40 steps/s
    const events = batches.reduce((n, b) => n + b.length, 0);
    const t0 = performance.now();
    for (const b of batches) state = reduce(state, b);
    const ms = performance.now() - t0;
    expect(state.engine.requests.size).toBeGreaterThanOrEqual(64);
    // generous: about 10 s of events must fold in well under 10 s of wall time
    expect(ms).toBeLessThan(3000);
    expect(events).toBeGreaterThan(20000);
  });
});
