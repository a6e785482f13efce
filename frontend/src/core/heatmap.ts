// What the KV-cache heatmap shows for each block, derived from the engine state: owners (from the
// sequences' block tables), fill (tokens in the block), and its kind (free / used / shared / cached).
import type { EngineState } from "./fold";

export const KIND_FREE = 0;
export const KIND_USED = 1;
export const KIND_SHARED = 2;
export const KIND_CACHED = 3;

export interface BlockOwner {
  readonly request_id: string;
  readonly seq_id: number;
  /** Index of the block in the sequence's block table (logical block number). */
  readonly logical: number;
}

export interface BlockModel {
  readonly numBlocks: number;
  readonly blockSize: number;
  /** The request that colours the block: its first owner (null: no owner). */
  readonly primary: readonly (string | null)[];
  /** Tokens held, as a fraction of the block size (0..1). */
  readonly fill: Float32Array;
  readonly kind: Uint8Array;
  readonly counts: { used: number; shared: number; cached: number; free: number };
  /** Distinct blocks referenced per request. */
  readonly perRequest: ReadonlyMap<string, number>;
}

const memo = new WeakMap<EngineState, BlockModel>();

/** The per-block view of the pool; memoised per engine state (computed at most once per frame). */
export function blockModel(engine: EngineState): BlockModel {
  const cached = memo.get(engine);
  if (cached !== undefined) return cached;
  const n = engine.blocks.length;
  const bs = Math.max(1, engine.config.block_size);
  const primary: (string | null)[] = new Array<string | null>(n).fill(null);
  const fill = new Float32Array(n);
  const kind = new Uint8Array(n);
  const perRequest = new Map<string, number>();
  const stamp = new Int32Array(n); // which request last counted each block (distinct counts without Sets)
  let requestNo = 0;
  for (const r of engine.requests.values()) {
    requestNo++;
    let distinct = 0;
    for (const s of r.seqs) {
      const table = s.block_table;
      for (let i = 0; i < table.length; i++) {
        const b = table[i]!;
        if (b < 0 || b >= n) continue;
        if (primary[b] === null) primary[b] = r.request_id;
        const tokens = Math.max(0, Math.min(bs, s.num_tokens - i * bs));
        if (tokens / bs > fill[b]!) fill[b] = tokens / bs;
        if (stamp[b] !== requestNo) {
          stamp[b] = requestNo;
          distinct++;
        }
      }
    }
    if (distinct > 0) perRequest.set(r.request_id, distinct);
  }
  const counts = { used: 0, shared: 0, cached: 0, free: 0 };
  for (let b = 0; b < n; b++) {
    const block = engine.blocks[b]!;
    if (block.ref_count > 0) {
      counts.used++;
      if (block.ref_count > 1) {
        counts.shared++;
        kind[b] = KIND_SHARED;
      } else {
        kind[b] = KIND_USED;
      }
      if (primary[b] === null) fill[b] = 1; // referenced by a sequence we do not know: show it full
    } else if (block.block_hash !== null) {
      counts.cached++;
      kind[b] = KIND_CACHED;
      fill[b] = 1; // only full blocks are registered in the prefix cache
    } else {
      counts.free++;
      kind[b] = KIND_FREE;
      fill[b] = 0;
    }
  }
  const model: BlockModel = { numBlocks: n, blockSize: bs, primary, fill, kind, counts, perRequest };
  memo.set(engine, model);
  return model;
}

/** Who holds block `b`: every (request, sequence, logical index) whose table points at it. */
export function blockOwners(engine: EngineState, b: number): BlockOwner[] {
  const out: BlockOwner[] = [];
  for (const r of engine.requests.values()) {
    for (const s of r.seqs) {
      s.block_table.forEach((x, i) => {
        if (x === b) out.push({ request_id: r.request_id, seq_id: s.seq_id, logical: i });
      });
    }
  }
  return out;
}

/** The physical blocks a request's sequences reference. */
export function requestBlocks(engine: EngineState, requestId: string): Set<number> {
  const out = new Set<number>();
  for (const s of engine.requests.get(requestId)?.seqs ?? []) for (const b of s.block_table) out.add(b);
  return out;
}

/** A one-line text of the heatmap for the DOM (tests and screen readers). */
export function heatmapSummaryText(m: BlockModel): string {
  const per = [...m.perRequest.entries()].map(([id, k]) => `${id}:${k}`).join(" ");
  return `blocks=${m.numBlocks} used=${m.counts.used} shared=${m.counts.shared} cached=${m.counts.cached} free=${m.counts.free}` +
    (per ? `; per-request ${per}` : "");
}

/** Grid geometry: the largest square cell (with a 1 px gap) that fits `n` cells into width x maxHeight. */
export function gridLayout(n: number, width: number, maxHeight: number): { cell: number; cols: number; rows: number; height: number } {
  if (n <= 0 || width <= 0) return { cell: 0, cols: 0, rows: 0, height: 0 };
  let cell = Math.floor(Math.sqrt((width * maxHeight) / n));
  cell = Math.max(4, Math.min(28, cell));
  for (; cell > 4; cell--) {
    const cols = Math.max(1, Math.floor((width + 1) / (cell + 1)));
    if (Math.ceil(n / cols) * (cell + 1) <= maxHeight) break;
  }
  const cols = Math.max(1, Math.floor((width + 1) / (cell + 1)));
  const rows = Math.ceil(n / cols);
  return { cell, cols, rows, height: rows * (cell + 1) };
}
