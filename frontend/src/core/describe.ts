// Short human text for events (the event log) and scheduler steps.
import { fmtShare } from "./mask";
import type { AnyEvent, ScheduledChunk, StepScheduled } from "./wire";

function ids(list: readonly number[], max = 6): string {
  return list.length <= max ? list.join(",") : `${list.slice(0, max).join(",")}…(+${list.length - max})`;
}

export function describeEvent(e: AnyEvent): string {
  switch (e.type) {
    case "request_arrived":
      return `${e.request_id}: ${e.prompt_tokens} prompt tokens, max ${e.max_tokens}${e.n > 1 ? `, n=${e.n}` : ""}`;
    case "request_state":
      return `${e.request_id}: ${e.previous ?? "∅"} → ${e.state}${e.finish_reason ? ` (${e.finish_reason})` : ""} — ${e.reason}`;
    case "seq_added":
      return `${e.request_id}: seq ${e.seq_id}${e.parent_seq_id !== null ? ` forked from ${e.parent_seq_id}` : ""}`;
    case "seq_removed":
      return `${e.request_id}: seq ${e.seq_id} removed (${e.reason})`;
    case "token":
      return `${e.request_id}/${e.seq_id}: ${JSON.stringify(e.text)}${e.logprob !== null ? ` p=${Math.exp(e.logprob).toFixed(2)}` : ""}${e.drafted ? " (accepted draft)" : ""}${typeof e.allowed_fraction === "number" ? ` (grammar allowed ${fmtShare(e.allowed_fraction)})` : ""}`;
    case "step_scheduled":
      return `step ${e.step}: ${e.prefill.length} prefill, ${e.decode.length} decode, budget ${e.budget_used}/${e.budget}` +
        (e.preempted.length ? `, preempted ${e.preempted.join(",")}` : "") +
        (e.queue_head ? `, ${e.queue_head} waits: ${e.queue_head_reason ?? "?"}` : "");
    case "spec_verified":
      return `${e.request_id}/${e.seq_id}: verify (${e.method}) step ${e.step}: ${e.accepted}/${e.proposed.length} drafts accepted [${ids(e.proposed)}] → ${e.token_id}`;
    case "step_finished":
      return `step ${e.step}: ${e.duration_ms.toFixed(1)} ms, ${e.num_tokens} tokens in, ${e.num_generated} out`;
    case "metrics":
      return `running ${e.num_running}, waiting ${e.num_waiting}, KV ${(e.kv_usage * 100).toFixed(0)}%, ${e.generation_throughput.toFixed(1)} tok/s`;
    case "blocks_allocated":
      return `${e.request_id}/${e.seq_id}: +[${ids(e.block_ids)}] → table of ${e.table.length}`;
    case "blocks_shared":
      return `${e.request_id}/${e.seq_id}: ${e.prefix_hit ? "prefix hit" : "fork"} [${ids(e.block_ids)}]`;
    case "blocks_freed":
      if (e.dropped === true) return `${e.request_id}/${e.seq_id}: dropped [${ids(e.block_ids)}] (left the window)`;
      return `${e.request_id}/${e.seq_id}: freed [${ids(e.block_ids)}]${e.whole_table ? " (whole table)" : e.table ? ` → table of ${e.table.length}` : ""}`;
    case "blocks_cached":
      return e.from_disk === true ? `restored from disk [${ids(e.block_ids)}]` : `${e.request_id}/${e.seq_id}: cached [${ids(e.block_ids)}]`;
    case "blocks_evicted":
      return `evicted [${ids(e.block_ids)}]${e.to_disk === true ? " → disk tier" : ""}`;
    case "blocks_copied":
      return `${e.request_id}/${e.seq_id}: copy-on-write [${ids(e.src_block_ids)}] → [${ids(e.block_ids)}]`;
    case "config_changed":
      return `engine rebuilt: ${e.config.num_blocks} blocks × ${e.config.block_size}, budget ${e.config.max_num_batched_tokens}`;
  }
}

/** `name` shortens the request ids (the scheduler table shows 8 characters). */
export function describeChunks(chunks: readonly ScheduledChunk[], max = 4, name: (id: string) => string = (id) => id): string {
  if (chunks.length === 0) return "–";
  const text = chunks.slice(0, max).map((c) => `${name(c.request_id)}[${c.start}+${c.num_tokens}${c.num_draft ? `, ${c.num_draft} draft` : ""}]`).join(" ");
  return chunks.length > max ? `${text} +${chunks.length - max}` : text;
}

export function prefillTokens(step: StepScheduled): number {
  return step.prefill.reduce((n, c) => n + c.num_tokens, 0);
}
