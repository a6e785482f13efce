// Folding engine events onto a snapshot: a port of backend/minivllm/events/fold.py, handler by handler.
//
// The fold is pure: `foldEvents(state, events)` never mutates `state`. A batch is applied to a
// copy-on-write draft, so each object (the request map, the block array, one request, one sequence)
// is copied at most once per batch, however many events touch it. Old states stay valid: the
// replay viewer keeps them as checkpoints.
import type { AnyEvent, EngineInfo, FinishReason, RequestStateName, Snapshot } from "./wire";

export interface SeqView {
  readonly seq_id: number;
  readonly parent_seq_id: number | null;
  readonly num_tokens: number;
  readonly num_prompt_tokens: number;
  readonly num_computed: number;
  readonly block_table: readonly number[];
  readonly finished: boolean;
}

export interface RequestView {
  readonly request_id: string;
  readonly state: RequestStateName;
  readonly prompt_tokens: number;
  readonly max_tokens: number;
  readonly n: number;
  readonly priority: number;
  readonly arrival_ts: number;
  readonly sampling: Readonly<Record<string, unknown>>;
  readonly prompt_preview: string;
  readonly output_tokens: number;
  readonly first_token_ts: number | null;
  readonly finish_ts: number | null;
  readonly finish_reason: FinishReason | null;
  readonly num_preemptions: number;
  readonly seqs: readonly SeqView[];
}

export interface BlockView {
  readonly block_id: number;
  readonly ref_count: number;
  readonly block_hash: string | null;
}

/** The engine as the event stream describes it: the same fields as a Snapshot. */
export interface EngineState {
  /** Sequence number of the last event folded in; events at or below it are ignored. */
  readonly seq: number;
  readonly ts: number;
  readonly step: number;
  readonly config: EngineInfo;
  /** Insertion-ordered, like the Python dict. */
  readonly requests: ReadonlyMap<string, RequestView>;
  readonly blocks: readonly BlockView[];
}

type Mutable<T> = { -readonly [K in keyof T]: T[K] };
type MSeq = Mutable<SeqView>;
type MRequest = Omit<Mutable<RequestView>, "seqs"> & { seqs: SeqView[] };
type MBlock = Mutable<BlockView>;

// ---- snapshot <-> state ---------------------------------------------------------------------------

/** A Snapshot as state, with every field that the wire may omit (defaults) filled in. */
export function stateFromSnapshot(snapshot: Snapshot): EngineState {
  const requests = new Map<string, RequestView>();
  for (const r of snapshot.requests) {
    requests.set(r.request_id, {
      request_id: r.request_id,
      state: r.state,
      prompt_tokens: r.prompt_tokens,
      max_tokens: r.max_tokens,
      n: r.n,
      priority: r.priority,
      arrival_ts: r.arrival_ts,
      sampling: { ...r.sampling },
      prompt_preview: r.prompt_preview,
      output_tokens: r.output_tokens ?? 0,
      first_token_ts: r.first_token_ts ?? null,
      finish_ts: r.finish_ts ?? null,
      finish_reason: r.finish_reason ?? null,
      num_preemptions: r.num_preemptions ?? 0,
      seqs: (r.seqs ?? []).map((s) => ({
        seq_id: s.seq_id,
        parent_seq_id: s.parent_seq_id,
        num_tokens: s.num_tokens,
        num_prompt_tokens: s.num_prompt_tokens,
        num_computed: s.num_computed,
        block_table: [...s.block_table],
        finished: s.finished ?? false,
      })),
    });
  }
  return {
    seq: snapshot.seq,
    ts: snapshot.ts,
    step: snapshot.step,
    config: { ...snapshot.config },
    requests,
    blocks: snapshot.blocks.map((b) => ({ block_id: b.block_id, ref_count: b.ref_count, block_hash: b.block_hash })),
  };
}

export function stateToSnapshot(state: EngineState): Snapshot {
  return {
    type: "snapshot",
    seq: state.seq,
    ts: state.ts,
    step: state.step,
    config: { ...state.config },
    requests: [...state.requests.values()].map((r) => ({
      ...r,
      sampling: { ...r.sampling },
      seqs: r.seqs.map((s) => ({ ...s, block_table: [...s.block_table] })),
    })),
    blocks: state.blocks.map((b) => ({ ...b })),
  };
}

export function emptyBlocks(numBlocks: number): BlockView[] {
  return Array.from({ length: numBlocks }, (_, i) => ({ block_id: i, ref_count: 0, block_hash: null }));
}

// ---- the copy-on-write draft ------------------------------------------------------------------------

/**
 * A batch in progress. Reads see the batch's changes; `result()` returns the new state. Objects
 * created by this draft are tracked in `fresh` and mutated in place; anything else is copied first.
 */
export class EngineDraft {
  seq: number;
  ts: number;
  step: number;
  config: EngineInfo;
  private requests: Map<string, RequestView>;
  private blocks: BlockView[];
  private readonly fresh = new WeakSet<object>();
  private readonly base: EngineState;

  constructor(base: EngineState) {
    this.base = base;
    this.seq = base.seq;
    this.ts = base.ts;
    this.step = base.step;
    this.config = base.config;
    this.requests = base.requests as Map<string, RequestView>;
    this.blocks = base.blocks as BlockView[];
  }

  result(): EngineState {
    const b = this.base;
    if (
      this.seq === b.seq && this.ts === b.ts && this.step === b.step && this.config === b.config &&
      this.requests === b.requests && this.blocks === b.blocks
    ) {
      return b;
    }
    return { seq: this.seq, ts: this.ts, step: this.step, config: this.config, requests: this.requests, blocks: this.blocks };
  }

  request(id: string): RequestView | undefined {
    return this.requests.get(id);
  }

  requestMap(): ReadonlyMap<string, RequestView> {
    return this.requests;
  }

  private ownRequests(): Map<string, RequestView> {
    if (!this.fresh.has(this.requests)) {
      this.requests = new Map(this.requests);
      this.fresh.add(this.requests);
    }
    return this.requests;
  }

  private ownBlocks(): BlockView[] {
    if (!this.fresh.has(this.blocks)) {
      this.blocks = this.blocks.slice();
      this.fresh.add(this.blocks);
    }
    return this.blocks;
  }

  putRequest(request: RequestView): void {
    this.fresh.add(request);
    this.fresh.add(request.seqs);
    this.ownRequests().set(request.request_id, request);
  }

  deleteRequest(id: string): void {
    if (this.requests.has(id)) this.ownRequests().delete(id);
  }

  /** The request, writable (copied once per batch). */
  mutRequest(id: string): MRequest | undefined {
    const current = this.requests.get(id);
    if (current === undefined) return undefined;
    if (this.fresh.has(current)) return current as MRequest;
    const copy = { ...current } as MRequest;
    this.fresh.add(copy);
    this.ownRequests().set(id, copy);
    return copy;
  }

  /** The request's seqs array, writable. */
  mutSeqs(id: string): SeqView[] | undefined {
    const request = this.mutRequest(id);
    if (request === undefined) return undefined;
    if (!this.fresh.has(request.seqs)) {
      request.seqs = request.seqs.slice();
      this.fresh.add(request.seqs);
    }
    return request.seqs;
  }

  findSeq(requestId: string, seqId: number): SeqView | undefined {
    return this.requests.get(requestId)?.seqs.find((s) => s.seq_id === seqId);
  }

  /** One sequence, writable; undefined when the request or sequence is unknown (as `_seq` in Python). */
  mutSeq(requestId: string, seqId: number): MSeq | undefined {
    const request = this.requests.get(requestId);
    if (request === undefined) return undefined;
    const index = request.seqs.findIndex((s) => s.seq_id === seqId);
    if (index < 0) return undefined;
    const seqs = this.mutSeqs(requestId)!;
    const current = seqs[index]!;
    if (this.fresh.has(current)) return current as MSeq;
    const copy: MSeq = { ...current };
    this.fresh.add(copy);
    seqs[index] = copy;
    return copy;
  }

  /** One block, writable; undefined for an id outside the pool (the Python fold would raise). */
  mutBlock(blockId: number): MBlock | undefined {
    const current = this.blocks[blockId];
    if (current === undefined) return undefined;
    if (this.fresh.has(current)) return current;
    const copy = { ...current };
    this.fresh.add(copy);
    this.ownBlocks()[blockId] = copy;
    return copy;
  }

  replaceAll(config: EngineInfo): void {
    this.config = config;
    this.requests = new Map();
    this.fresh.add(this.requests);
    this.blocks = emptyBlocks(config.num_blocks);
    this.fresh.add(this.blocks);
    for (const b of this.blocks) this.fresh.add(b);
  }

  // ---- helpers, as in events/fold.py --------------------------------------------------------------

  setRefs(blockIds: readonly number[], refCounts: readonly number[]): void {
    const n = Math.min(blockIds.length, refCounts.length);
    for (let i = 0; i < n; i++) {
      const block = this.mutBlock(blockIds[i]!);
      if (block !== undefined) block.ref_count = refCounts[i]!;
    }
  }

  setTable(requestId: string, seqId: number, table: readonly number[]): void {
    const seq = this.mutSeq(requestId, seqId);
    if (seq !== undefined) seq.block_table = [...table];
  }

  // ---- the fold ------------------------------------------------------------------------------------

  /** Applies one event; false when it was already folded (seq at or below ours) and so ignored. */
  apply(e: AnyEvent): boolean {
    const seq = e.seq ?? 0;
    if (seq <= this.seq) return false; // already folded (resume overlaps are harmless)
    this.seq = seq;
    const ts = e.ts ?? 0;
    this.ts = ts;
    switch (e.type) {
      case "request_arrived":
        this.putRequest({
          request_id: e.request_id,
          state: "WAITING",
          prompt_tokens: e.prompt_tokens,
          max_tokens: e.max_tokens,
          n: e.n,
          priority: e.priority,
          arrival_ts: ts,
          sampling: e.sampling,
          prompt_preview: e.prompt_preview,
          output_tokens: 0,
          first_token_ts: null,
          finish_ts: null,
          finish_reason: null,
          num_preemptions: 0,
          seqs: [],
        });
        break;
      case "request_state": {
        const request = this.mutRequest(e.request_id);
        if (request === undefined) break;
        request.state = e.state;
        if (e.state === "PREEMPTED") {
          request.num_preemptions += 1;
          for (const s of request.seqs) {
            const seqView = this.mutSeq(e.request_id, s.seq_id)!;
            seqView.num_computed = 0;
            seqView.block_table = [];
          }
        }
        if (e.state === "FINISHED") {
          request.finish_ts = ts;
          request.finish_reason = e.finish_reason ?? null;
        }
        break;
      }
      case "seq_added": {
        if (this.requests.get(e.request_id) === undefined) break;
        const parent = e.parent_seq_id !== null ? this.findSeq(e.request_id, e.parent_seq_id) : undefined;
        const added: MSeq = {
          seq_id: e.seq_id,
          parent_seq_id: e.parent_seq_id,
          num_tokens: e.num_tokens,
          num_prompt_tokens: e.num_prompt_tokens,
          num_computed: parent ? parent.num_computed : 0,
          block_table: [],
          finished: false,
        };
        this.fresh.add(added);
        this.mutSeqs(e.request_id)!.push(added);
        break;
      }
      case "seq_removed": {
        const request = this.mutRequest(e.request_id);
        if (request !== undefined) {
          request.seqs = request.seqs.filter((s) => s.seq_id !== e.seq_id);
          this.fresh.add(request.seqs);
        }
        break;
      }
      case "token": {
        const request = this.mutRequest(e.request_id);
        if (request === undefined) break;
        request.output_tokens += 1;
        if (request.first_token_ts === null) request.first_token_ts = ts;
        const s = this.mutSeq(e.request_id, e.seq_id);
        if (s !== undefined) s.num_tokens += 1;
        break;
      }
      case "step_scheduled":
        this.step = e.step;
        for (const chunk of [...e.prefill, ...e.decode]) {
          const s = this.mutSeq(chunk.request_id, chunk.seq_id);
          if (s !== undefined) s.num_computed = chunk.start + chunk.num_tokens;
        }
        break;
      case "blocks_allocated":
        for (const b of e.block_ids) {
          const block = this.mutBlock(b);
          if (block !== undefined) block.ref_count = 1;
        }
        this.setTable(e.request_id, e.seq_id, e.table);
        break;
      case "blocks_shared":
        this.setRefs(e.block_ids, e.ref_counts);
        this.setTable(e.request_id, e.seq_id, e.table);
        break;
      case "spec_verified": {
        // the rejected drafts' positions roll back (StepScheduled counted them as computed)
        const s = this.mutSeq(e.request_id, e.seq_id);
        if (s !== undefined) s.num_computed -= e.proposed.length - e.accepted;
        break;
      }
      case "blocks_freed":
        this.setRefs(e.block_ids, e.ref_counts);
        if (e.whole_table) this.setTable(e.request_id, e.seq_id, []);
        else if (e.table !== undefined && e.table !== null) this.setTable(e.request_id, e.seq_id, e.table); // rollback / copy-on-write
        break;
      case "blocks_cached": {
        const n = Math.min(e.block_ids.length, e.hashes.length);
        for (let i = 0; i < n; i++) {
          const block = this.mutBlock(e.block_ids[i]!);
          if (block !== undefined) block.block_hash = e.hashes[i]!;
        }
        break;
      }
      case "blocks_evicted":
        for (const b of e.block_ids) {
          const block = this.mutBlock(b);
          if (block !== undefined) block.block_hash = null;
        }
        break;
      case "blocks_copied":
        // The sources' ref counts arrive in the BlocksFreed that follows (as events/fold.py relies on).
        for (const b of e.block_ids) {
          const block = this.mutBlock(b);
          if (block !== undefined) block.ref_count = 1;
        }
        this.setTable(e.request_id, e.seq_id, e.table);
        break;
      case "config_changed":
        this.replaceAll(e.config);
        break;
      case "step_finished":
      case "metrics":
        break;
    }
    return true;
  }
}

/** `fold(snapshot, events)` of events/fold.py, on states. Pure: `state` is left as it was. */
export function foldEvents(state: EngineState, events: Iterable<AnyEvent>): EngineState {
  const draft = new EngineDraft(state);
  for (const e of events) draft.apply(e);
  return draft.result();
}

export function foldSnapshot(snapshot: Snapshot, events: Iterable<AnyEvent>): Snapshot {
  return stateToSnapshot(foldEvents(stateFromSnapshot(snapshot), events));
}
