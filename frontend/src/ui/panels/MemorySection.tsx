// The Metrics panel's memory section: the server's RSS split by part (weights, KV cache, compiled
// kernels, torch, other libraries, the rest) as a stacked bar and a table, from the latest sample.
import { useId } from "react";
import { fmtBytes, fmtPct } from "../../core/format";
import { memoryView, type MemoryPartKey } from "../../core/memory";
import type { MemorySplit } from "../../core/wire";

const COLORS: Record<MemoryPartKey, string> = {
  weights: "var(--series-1)",
  kv_cache: "var(--series-2)",
  compiled: "var(--series-3)",
  torch: "var(--series-4)",
  libraries: "var(--muted)",
  other: "var(--border)",
};

export function MemorySection(props: { split: MemorySplit | null | undefined }) {
  const titleId = useId();
  const view = memoryView(props.split);
  if (view === null) return null;
  return (
    <section className="memory-split" aria-labelledby={titleId} data-testid="metrics-memory">
      <div className="memory-title" id={titleId}>
        Server memory: {fmtBytes(view.rss)} resident{view.clamped && " (parts overlap: other clamped to 0)"}
      </div>
      <div className="memory-bar" role="img" aria-label="Resident memory by part">
        {view.parts.map((p) => (
          <span key={p.key} style={{ width: `${p.fraction * 100}%`, background: COLORS[p.key] }} title={`${p.label}: ${fmtBytes(p.bytes)}`} />
        ))}
      </div>
      <table className="table memory-table">
        <tbody>
          {view.parts.map((p) => (
            <tr key={p.key} data-testid={`memory-part-${p.key}`} title={p.title}>
              <td><i style={{ background: COLORS[p.key] }} />{p.label}</td>
              <td className="num" data-testid="memory-bytes">{fmtBytes(p.bytes)}</td>
              <td className="num">{fmtPct(p.fraction)}</td>
            </tr>
          ))}
        </tbody>
      </table>
      <p className="muted small">
        KV pool reserved: {fmtBytes(view.kvReserved)}
        {view.unknown.length > 0 && ` · not measurable on this platform: ${view.unknown.join(", ")}`}
      </p>
    </section>
  );
}
