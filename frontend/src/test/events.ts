// Small builders for hand-written event streams in tests.
import type { AnyEvent, EngineInfo, Snapshot } from "../core/wire";

export function config(numBlocks = 8, blockSize = 4): EngineInfo {
  return {
    model: "test",
    max_model_len: 256,
    num_blocks: numBlocks,
    block_size: blockSize,
    max_num_batched_tokens: 32,
    max_num_seqs: 8,
    enable_prefix_caching: true,
    dtype: "float32",
    device: "cpu",
  };
}

export function snapshot(numBlocks = 8, blockSize = 4): Snapshot {
  return {
    type: "snapshot",
    seq: 0,
    ts: 0,
    step: 0,
    config: config(numBlocks, blockSize),
    requests: [],
    blocks: Array.from({ length: numBlocks }, (_, i) => ({ block_id: i, ref_count: 0, block_hash: null })),
  };
}

/** Numbers events (seq 1, 2, ...; ts = seq / 10) in order. */
export class Stream {
  private n = 0;
  readonly events: AnyEvent[] = [];

  constructor(start = 0) {
    this.n = start;
  }

  add(e: DistributiveOmit<AnyEvent, "seq" | "ts">): AnyEvent {
    this.n += 1;
    const full = { ...e, seq: this.n, ts: this.n / 10 } as AnyEvent;
    this.events.push(full);
    return full;
  }

  arrive(id: string, promptTokens: number, n = 1): void {
    this.add({ type: "request_arrived", request_id: id, prompt_tokens: promptTokens, max_tokens: 8, n, priority: 0, sampling: {}, prompt_preview: id });
    this.add({ type: "seq_added", request_id: id, seq_id: seqIdOf(id), parent_seq_id: null, num_tokens: promptTokens, num_prompt_tokens: promptTokens });
    this.state(id, "WAITING", null, "arrived");
  }

  state(id: string, state: "WAITING" | "PREFILL" | "DECODE" | "PREEMPTED" | "FINISHED", previous: string | null, reason: string, finish: "stop" | "length" | "abort" | null = null): void {
    this.add({ type: "request_state", request_id: id, state, previous: previous as never, reason, finish_reason: finish });
  }
}

type DistributiveOmit<T, K extends PropertyKey> = T extends unknown ? Omit<T, K> : never;

export function seqIdOf(id: string): number {
  return id.charCodeAt(0) * 10;
}
