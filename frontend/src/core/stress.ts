// A synthetic engine for the stress page and tests: continuous batching over a paged KV pool, with
// chunked prefill, a shared system-prompt prefix served from the prefix cache, preemption when the
// pool runs out, and LRU eviction of cached free blocks. It emits the same events as the real
// engine, consistently, so the real reducer and panels can be driven at a realistic rate without
// a server. Deterministic for a given seed.
import type { AnyEvent, Snapshot, StepScheduled, ScheduledChunk } from "./wire";
import { hashString } from "./color";

export interface SimOptions {
  numBlocks: number;
  blockSize: number;
  concurrency: number;
  budget: number;
  maxSeqs: number;
  stepsPerSecond: number;
  seed: number;
  promptTokens: [number, number];
  outputTokens: [number, number];
  /** Share of requests that start with the shared system prompt. */
  prefixShare: number;
  prefixBlocks: number;
}

export const DEFAULT_SIM: SimOptions = {
  numBlocks: 2000,
  blockSize: 16,
  concurrency: 64,
  budget: 2048,
  maxSeqs: 64,
  stepsPerSecond: 40,
  seed: 7,
  promptTokens: [48, 700],
  outputTokens: [24, 480],
  prefixShare: 0.35,
  prefixBlocks: 8,
};

function mulberry32(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function hex16(key: string): string {
  const a = hashString(key);
  const b = hashString(key + "#");
  return a.toString(16).padStart(8, "0") + b.toString(16).padStart(8, "0");
}

type DistributiveOmit<T, K extends PropertyKey> = T extends unknown ? Omit<T, K> : never;

type SimState = "WAITING" | "PREFILL" | "DECODE" | "PREEMPTED";

interface SimRequest {
  id: string;
  seqId: number;
  prompt: number;
  maxOut: number;
  out: number;
  tokens: number;
  computed: number;
  table: number[];
  state: SimState;
  prefixed: boolean;
}

const WORDS = ["the", " cache", " block", " token", " batch", " queue", " step", " page", " prefix", " model", ",", ".", " and", " of", " to", " a"];

export class EngineSimulator {
  readonly opts: SimOptions;
  private readonly rand: () => number;
  private seq = 0;
  private ts = 0;
  private stepNo = 0;
  private nextId = 0;
  private nextSeqId = 0;
  private lastMetricsTs = 0;
  private lastGen = 0;
  private lastPrompt = 0;
  readonly refs: Int32Array;
  readonly hashes: (string | null)[];
  /** Free blocks in LRU order (Map keeps insertion order): the front is evicted / reused first. */
  private readonly free = new Map<number, true>();
  private readonly hashToBlock = new Map<string, number>();
  private readonly waiting: SimRequest[] = [];
  private readonly running: SimRequest[] = [];
  private counters = { preemptions: 0, prompt: 0, generated: 0, queries: 0, hits: 0 };
  private out: AnyEvent[] = [];

  constructor(opts: Partial<SimOptions> = {}) {
    this.opts = { ...DEFAULT_SIM, ...opts };
    this.rand = mulberry32(this.opts.seed);
    this.refs = new Int32Array(this.opts.numBlocks);
    this.hashes = new Array<string | null>(this.opts.numBlocks).fill(null);
    for (let b = 0; b < this.opts.numBlocks; b++) this.free.set(b, true);
  }

  snapshot(): Snapshot {
    const o = this.opts;
    return {
      type: "snapshot",
      seq: this.seq,
      ts: this.ts,
      step: this.stepNo,
      config: {
        model: "synthetic (stress)",
        max_model_len: 4096,
        num_blocks: o.numBlocks,
        block_size: o.blockSize,
        max_num_batched_tokens: o.budget,
        max_num_seqs: o.maxSeqs,
        enable_prefix_caching: true,
        dtype: "none",
        device: "simulated",
      },
      requests: [],
      blocks: Array.from({ length: o.numBlocks }, (_, i) => ({ block_id: i, ref_count: this.refs[i]!, block_hash: this.hashes[i]! })),
    };
  }

  get time(): number {
    return this.ts;
  }

  get live(): number {
    return this.waiting.length + this.running.length;
  }

  private emit(e: DistributiveOmit<AnyEvent, "seq" | "ts">): void {
    this.seq += 1;
    this.out.push({ ...e, seq: this.seq, ts: this.ts } as AnyEvent);
  }

  private between([lo, hi]: [number, number]): number {
    return lo + Math.floor(this.rand() * (hi - lo + 1));
  }

  private arrive(): void {
    const prefixed = this.rand() < this.opts.prefixShare;
    const prefixTokens = this.opts.prefixBlocks * this.opts.blockSize;
    const prompt = Math.max(prefixed ? prefixTokens + 8 : 1, this.between(this.opts.promptTokens));
    const r: SimRequest = {
      id: `req-${(this.nextId++).toString().padStart(4, "0")}`,
      seqId: this.nextSeqId++,
      prompt,
      maxOut: this.between(this.opts.outputTokens),
      out: 0,
      tokens: prompt,
      computed: 0,
      table: [],
      state: "WAITING",
      prefixed,
    };
    this.emit({ type: "request_arrived", request_id: r.id, prompt_tokens: prompt, max_tokens: r.maxOut, n: 1, priority: 0, sampling: { temperature: 0.7 }, prompt_preview: prefixed ? "[system prompt] …" : "synthetic prompt …" });
    this.emit({ type: "seq_added", request_id: r.id, seq_id: r.seqId, parent_seq_id: null, num_tokens: prompt, num_prompt_tokens: prompt });
    this.emit({ type: "request_state", request_id: r.id, state: "WAITING", previous: null, reason: "arrived", finish_reason: null });
    this.waiting.push(r);
  }

  private capacity(r: SimRequest): number {
    return r.table.length * this.opts.blockSize;
  }

  /** Grows r's table to hold `tokens`; false (and no change) when the pool is short. */
  private ensure(r: SimRequest, tokens: number): boolean {
    const need = Math.ceil(tokens / this.opts.blockSize) - r.table.length;
    if (need <= 0) return true;
    if (need > this.free.size) return false;
    const got: number[] = [];
    const evicted: number[] = [];
    const evictedHashes: string[] = [];
    const it = this.free.keys();
    for (let i = 0; i < need; i++) {
      const b = it.next().value as number;
      got.push(b);
    }
    for (const b of got) {
      this.free.delete(b);
      const h = this.hashes[b];
      if (h !== null && h !== undefined) {
        evicted.push(b);
        evictedHashes.push(h);
        this.hashes[b] = null;
        this.hashToBlock.delete(h);
      }
      this.refs[b] = 1;
      r.table.push(b);
    }
    if (evicted.length > 0) this.emit({ type: "blocks_evicted", block_ids: evicted, hashes: evictedHashes });
    this.emit({ type: "blocks_allocated", request_id: r.id, seq_id: r.seqId, block_ids: got, table: [...r.table] });
    return true;
  }

  private release(r: SimRequest): void {
    if (r.table.length === 0) return;
    const ids = [...r.table];
    const counts: number[] = [];
    for (const b of ids) {
      this.refs[b] = this.refs[b]! - 1;
      counts.push(this.refs[b]!);
      if (this.refs[b] === 0) this.free.set(b, true);
    }
    r.table = [];
    this.emit({ type: "blocks_freed", request_id: r.id, seq_id: r.seqId, block_ids: ids, ref_counts: counts, whole_table: true });
  }

  private setState(r: SimRequest, state: SimState | "FINISHED", reason: string, finish: "length" | null = null): void {
    const previous = r.state;
    if (state !== "FINISHED") r.state = state;
    this.emit({ type: "request_state", request_id: r.id, state, previous, reason, finish_reason: finish });
  }

  private preempt(victim: SimRequest, forId: string): void {
    this.running.splice(this.running.indexOf(victim), 1);
    this.setState(victim, "PREEMPTED", `preempted: out of KV blocks (needed by ${forId})`);
    this.release(victim);
    victim.computed = 0;
    this.counters.preemptions++;
    this.waiting.unshift(victim);
  }

  /** Prefix-cache lookup at admission: share the cached blocks of the system prompt. */
  private sharePrefix(r: SimRequest): void {
    if (!r.prefixed || r.table.length > 0) return;
    const shared: number[] = [];
    for (let i = 0; i < this.opts.prefixBlocks; i++) {
      const b = this.hashToBlock.get(hex16(`prefix:${i}`));
      if (b === undefined) break;
      shared.push(b);
    }
    if (shared.length === 0) return;
    for (const b of shared) {
      if (this.refs[b] === 0) this.free.delete(b);
      this.refs[b] = this.refs[b]! + 1;
      r.table.push(b);
    }
    r.computed = shared.length * this.opts.blockSize;
    this.counters.hits += r.computed;
    this.emit({ type: "blocks_shared", request_id: r.id, seq_id: r.seqId, block_ids: shared, ref_counts: shared.map((b) => this.refs[b]!), prefix_hit: true, table: [...r.table] });
  }

  /** Registers the full prompt blocks in the prefix cache once the prompt is computed. */
  private cachePrompt(r: SimRequest): void {
    const full = Math.min(r.table.length, Math.floor(r.prompt / this.opts.blockSize));
    const ids: number[] = [];
    const hs: string[] = [];
    for (let i = 0; i < full; i++) {
      const b = r.table[i]!;
      if (this.hashes[b] !== null) continue;
      const h = r.prefixed && i < this.opts.prefixBlocks ? hex16(`prefix:${i}`) : hex16(`${r.id}:${i}`);
      if (this.hashToBlock.has(h)) continue;
      this.hashes[b] = h;
      this.hashToBlock.set(h, b);
      ids.push(b);
      hs.push(h);
    }
    if (ids.length > 0) this.emit({ type: "blocks_cached", request_id: r.id, seq_id: r.seqId, block_ids: ids, hashes: hs });
  }

  private token(r: SimRequest): void {
    const text = WORDS[Math.floor(this.rand() * WORDS.length)]!;
    const logprob = -Math.pow(this.rand(), 2) * 4;
    r.tokens += 1;
    r.out += 1;
    this.counters.generated++;
    this.emit({ type: "token", request_id: r.id, seq_id: r.seqId, token_id: 1000 + Math.floor(this.rand() * 30000), text, logprob });
  }

  /** One engine step; returns its events. */
  step(): AnyEvent[] {
    this.out = [];
    this.ts += 1 / this.opts.stepsPerSecond;
    this.stepNo += 1;
    while (this.live < this.opts.concurrency) this.arrive();

    let budget = this.opts.budget;
    const decode: ScheduledChunk[] = [];
    const prefill: ScheduledChunk[] = [];
    const preempted: string[] = [];
    let queueHead: string | null = null;
    let queueHeadReason: string | null = null;

    // 1. decode: every running sequence past its prompt gets one token
    for (let i = 0; i < this.running.length && budget > 0; ) {
      const r = this.running[i]!;
      if (r.state !== "DECODE") {
        i++;
        continue;
      }
      if (this.capacity(r) < r.tokens && !this.ensure(r, r.tokens)) {
        const victim = this.running[this.running.length - 1]!;
        preempted.push(victim.id);
        this.preempt(victim, r.id);
        if (victim === r) continue;
        continue; // retry r with the freed blocks
      }
      decode.push({ request_id: r.id, seq_id: r.seqId, start: r.tokens - 1, num_tokens: 1 });
      budget -= 1;
      i++;
    }
    // 2. chunked prefill of running requests, then 3. admissions from the queue
    const prefilling = this.running.filter((r) => r.state === "PREFILL");
    for (const r of prefilling) {
      if (budget <= 0) break;
      const chunk = Math.min(r.tokens - r.computed, budget);
      if (!this.ensure(r, r.computed + chunk)) continue;
      prefill.push({ request_id: r.id, seq_id: r.seqId, start: r.computed, num_tokens: chunk });
      budget -= chunk;
    }
    while (this.waiting.length > 0) {
      const r = this.waiting[0]!;
      if (budget <= 0) {
        queueHead = r.id;
        queueHeadReason = "token budget exhausted";
        break;
      }
      if (this.running.length >= this.opts.maxSeqs) {
        queueHead = r.id;
        queueHeadReason = "max running sequences reached";
        break;
      }
      this.sharePrefix(r);
      const chunk = Math.min(r.tokens - r.computed, budget);
      if (!this.ensure(r, r.computed + chunk)) {
        queueHead = r.id;
        queueHeadReason = "out of KV blocks";
        break;
      }
      this.waiting.shift();
      this.counters.queries += r.tokens;
      if (r.state === "PREEMPTED") this.setState(r, "WAITING", "resuming after preemption: blocks available");
      this.setState(r, "PREFILL", `admitted: ${r.tokens - r.computed} tokens to compute, ${r.computed} from prefix cache`);
      this.running.push(r);
      prefill.push({ request_id: r.id, seq_id: r.seqId, start: r.computed, num_tokens: chunk });
      budget -= chunk;
    }
    const scheduled: Omit<StepScheduled, "seq" | "ts"> = {
      type: "step_scheduled",
      step: this.stepNo,
      prefill,
      decode,
      budget_used: this.opts.budget - budget,
      budget: this.opts.budget,
      num_running: this.running.length,
      num_waiting: this.waiting.length,
      preempted,
      queue_head: queueHead,
      queue_head_reason: queueHeadReason,
    };
    this.emit(scheduled);

    // the model ran: advance computed tokens, sample
    const byId = new Map(this.running.map((r) => [r.id, r]));
    let numTokens = 0;
    let numGenerated = 0;
    for (const c of prefill) {
      const r = byId.get(c.request_id)!;
      r.computed = c.start + c.num_tokens;
      numTokens += c.num_tokens;
      this.counters.prompt += c.num_tokens;
      if (r.computed >= r.tokens) {
        this.cachePrompt(r);
        this.token(r);
        numGenerated++;
        this.setState(r, "DECODE", "prompt computed, first token sampled");
      }
    }
    for (const c of decode) {
      const r = byId.get(c.request_id)!;
      r.computed = r.tokens;
      numTokens += 1;
      this.token(r);
      numGenerated++;
    }
    for (const r of [...this.running]) {
      if (r.state === "DECODE" && r.out >= r.maxOut) {
        this.running.splice(this.running.indexOf(r), 1);
        this.setState(r, "FINISHED", "finished: length limit reached", "length");
        this.release(r);
        this.emit({ type: "seq_removed", request_id: r.id, seq_id: r.seqId, reason: "finished" });
      }
    }
    const forward = 8 + numTokens * 0.004;
    this.emit({ type: "step_finished", step: this.stepNo, duration_ms: forward + 1.2, num_tokens: numTokens, num_generated: numGenerated, schedule_ms: 0.4, forward_ms: forward, sample_ms: 0.6, postprocess_ms: 0.2 });
    if (this.ts - this.lastMetricsTs >= 0.5) this.metrics();
    return this.out;
  }

  private metrics(): void {
    const dt = Math.max(1e-9, this.ts - this.lastMetricsTs);
    let used = 0;
    let cachedFree = 0;
    for (let b = 0; b < this.opts.numBlocks; b++) {
      if (this.refs[b]! > 0) used++;
      else if (this.hashes[b] !== null) cachedFree++;
    }
    const c = this.counters;
    this.emit({
      type: "metrics",
      num_running: this.running.length,
      num_waiting: this.waiting.length,
      kv_usage: used / this.opts.numBlocks,
      num_cached_free_blocks: cachedFree,
      prefix_cache_queries: c.queries,
      prefix_cache_hits: c.hits,
      num_preemptions: c.preemptions,
      prompt_tokens: c.prompt,
      generation_tokens: c.generated,
      generation_throughput: (c.generated - this.lastGen) / dt,
      prompt_throughput: (c.prompt - this.lastPrompt) / dt,
    });
    this.lastMetricsTs = this.ts;
    this.lastGen = c.generated;
    this.lastPrompt = c.prompt;
  }
}
