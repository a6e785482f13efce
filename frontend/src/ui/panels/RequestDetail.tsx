// The selected request: its state, timings, decoding settings and the text it generated so far.
import { requestColor } from "../../core/color";
import { fmtSeconds } from "../../core/format";
import { currentSegmentState } from "../../core/timeline";
import { ringItems } from "../../core/ring";
import { Card, EmptyState } from "../components/Card";
import { useDashboard } from "../context";
import { useDashboardState } from "../hooks";
import { getPalette } from "../theme";
import { STATE_LABEL } from "./TimelinePanel";

export function RequestDetail() {
  const { store, selected, select } = useDashboard();
  const state = useDashboardState(store);
  const r = selected !== null ? state.engine.requests.get(selected) : undefined;
  const timeline = selected !== null ? state.timelines.get(selected) : undefined;
  const tokens = selected !== null ? state.tokens.get(selected) : undefined;
  if (selected === null || r === undefined) {
    return (
      <Card title="Selected request" testId="request-detail">
        <EmptyState title={selected === null ? "No request selected" : `${selected} is no longer in the engine's history`} testId="request-detail-empty">
          Click a row in the timeline, a block in the heatmap, or “Show in timeline” on a chat message.
        </EmptyState>
      </Card>
    );
  }
  const bySeq = new Map<number, string>();
  if (tokens !== undefined) for (const t of ringItems(tokens)) bySeq.set(t.seq_id, (bySeq.get(t.seq_id) ?? "") + t.text);
  const shownState = (timeline && currentSegmentState(timeline)) ?? r.state;
  const ttft = r.first_token_ts !== null ? r.first_token_ts - r.arrival_ts : null;
  const sampling = Object.entries(r.sampling).map(([k, v]) => `${k}=${JSON.stringify(v)}`).join(" ");
  return (
    <Card
      title="Selected request"
      testId="request-detail"
      actions={<button type="button" className="btn btn-ghost btn-small" onClick={() => select(null)} data-testid="request-detail-close">Clear</button>}
    >
      <div className="detail-head">
        <span className="swatch swatch-lg" style={{ background: requestColor(r.request_id, getPalette().dark) }} />
        <b className="mono" data-testid="request-detail-id">{r.request_id}</b>
        <span className={`state-chip state-${shownState.toLowerCase()}`} data-testid="request-detail-state">{STATE_LABEL[shownState]}</span>
        {r.finish_reason && <span className="muted small">({r.finish_reason})</span>}
      </div>
      <dl className="detail-grid">
        <div><dt>Prompt</dt><dd>{r.prompt_tokens} tokens</dd></div>
        <div><dt>Generated</dt><dd>{r.output_tokens} / {r.max_tokens}{r.n > 1 ? ` × n=${r.n}` : ""}</dd></div>
        <div><dt>Arrived</dt><dd>{fmtSeconds(r.arrival_ts - state.originTs)}</dd></div>
        <div><dt>TTFT</dt><dd>{fmtSeconds(ttft)}</dd></div>
        <div><dt>Preemptions</dt><dd>{r.num_preemptions}</dd></div>
        <div><dt>Sequences</dt><dd>{r.seqs.length}</dd></div>
      </dl>
      {r.prompt_preview && <p className="small"><span className="muted">Prompt: </span>{r.prompt_preview}</p>}
      {sampling && <p className="small mono muted">{sampling}</p>}
      {timeline && (
        <ol className="segments small" aria-label="State history">
          {timeline.segments.map((s, i) => (
            <li key={i}><span className={`state-chip state-${s.state.toLowerCase()}`}>{STATE_LABEL[s.state]}</span> {fmtSeconds(s.start - state.originTs)} <span className="muted">{s.reason}</span></li>
          ))}
        </ol>
      )}
      {bySeq.size > 0 && (
        <div className="detail-text">
          {[...bySeq.entries()].map(([seq, text]) => (
            <div key={seq}>
              {bySeq.size > 1 && <div className="muted small">seq {seq}</div>}
              <div className="message-text small">{text}</div>
            </div>
          ))}
        </div>
      )}
    </Card>
  );
}
