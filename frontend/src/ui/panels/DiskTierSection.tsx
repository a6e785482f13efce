// The Metrics panel's disk-tier figures (--kv-offload-dir): what the prefix cache keeps on disk, what it read
// back instead of recomputing, and what went wrong (a full disk, damaged files), from the latest sample.
import { fmtBytes, fmtInt } from "../../core/format";
import type { DiskTierStats } from "../../core/wire";

export function DiskTierSection(props: { stats: DiskTierStats | null | undefined }) {
  const s = props.stats;
  if (s === null || s === undefined) return null;
  const writeErrors = s.write_errors ?? 0;
  const corrupt = s.corrupt_files ?? 0;
  return (
    <dl className="kpis" data-testid="metrics-disk-tier" aria-label="KV disk tier">
      <div><dt>On disk</dt><dd data-testid="disk-bytes">{fmtBytes(s.bytes_on_disk ?? 0)} / {fmtBytes(s.max_bytes ?? 0)}</dd></div>
      <div><dt>Blocks read back</dt><dd data-testid="disk-read">{fmtInt(s.blocks_read ?? 0)}</dd></div>
      <div><dt>Blocks written</dt><dd data-testid="disk-written">{fmtInt(s.blocks_written ?? 0)}</dd></div>
      <div><dt>Recomputed instead</dt><dd data-testid="disk-recomputed">{fmtInt(s.blocks_recomputed ?? 0)}</dd></div>
      {writeErrors + corrupt > 0 && (
        <div><dt>Write errors / bad files</dt><dd data-testid="disk-problems">{fmtInt(writeErrors)} / {fmtInt(corrupt)}</dd></div>
      )}
    </dl>
  );
}
