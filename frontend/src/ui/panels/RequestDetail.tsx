// The selected request: its state, timings, decoding settings and the text it generated so far (with
// speculative decoding, its acceptance and the accepted drafts marked in the text).
import { liveRequestColor } from "../../core/color";
import type { TokenEntry } from "../../core/dashboard";
import { fmtPct, fmtSeconds } from "../../core/format";
import { tokenTexts } from "../../core/spec";
import { currentSegmentState } from "../../core/timeline";
import { ringItems } from "../../core/ring";
import { EngineTokenText } from "../chat/TokenText";
import { Card, EmptyState } from "../components/Card";
import { useDashboard } from "../context";
import { useDashboardState } from "../hooks";
import { getPalette } from "../theme";
import { STATE_LABEL } from "./TimelinePanel";
import "./panels.css";

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
  const bySeq = new Map<number, TokenEntry[]>();
  const entries = tokens !== undefined ? ringItems(tokens) : [];
  for (const t of entries) {
    const list = bySeq.get(t.seq_id);
    if (list === undefined) bySeq.set(t.seq_id, [t]);
    else list.push(t);
  }
  const spec = state.spec.get(r.request_id);
  const texts = spec !== undefined ? tokenTexts(entries) : null;
  const shownState = (timeline && currentSegmentState(timeline)) ?? r.state;
  const ttft = r.first_token_ts !== null ? r.first_token_ts - r.arrival_ts : null;
  const sampling = Object.entries(r.sampling).map(([k, v]) => `${k}=${JSON.stringify(v)}`).join(" ");
  const finished = r.state === "FINISHED";
  return (
    <Card
      title="Selected request"
      testId="request-detail"
      actions={<button type="button" className="btn btn-ghost btn-small" onClick={() => select(null)} data-testid="request-detail-close">Clear</button>}
    >
      <div className="detail-head detail-head-wrap">
        <span className="swatch swatch-lg" style={{ background: liveRequestColor(state.timelines, r.request_id, getPalette().dark) }} />
        {/* long ids end in an ellipsis; the full id is the tooltip (and the text, for copying) */}
        <b className="mono detail-id" data-testid="request-detail-id" title={r.request_id}>{r.request_id}</b>
        <span className="detail-state">
          <span className={`state-chip state-${shownState.toLowerCase()}`} data-testid="request-detail-state">{STATE_LABEL[shownState]}</span>
          {r.finish_reason && <span className="muted small" data-testid="request-detail-finish">({r.finish_reason})</span>}
        </span>
      </div>
      <dl className="detail-grid detail-grid-wrap">
        <div><dt>Prompt</dt><dd>{r.prompt_tokens} tokens</dd></div>
        <div><dt>Generated</dt><dd>{r.output_tokens} / {r.max_tokens}{r.n > 1 ? ` × n=${r.n}` : ""}</dd></div>
        <div><dt>Arrived</dt><dd>{fmtSeconds(r.arrival_ts - state.originTs)}</dd></div>
        <div><dt>TTFT</dt><dd>{fmtSeconds(ttft)}</dd></div>
        <div><dt>Preemptions</dt><dd>{r.num_preemptions}</dd></div>
        {/* A finished request has released its sequences (the fold drops them): a count of 0 would
            read as "it never had any", so show its end-to-end time instead. */}
        {finished ? (
          <div><dt>Total</dt><dd data-testid="request-detail-total">{fmtSeconds(r.finish_ts !== null ? r.finish_ts - r.arrival_ts : null)}</dd></div>
        ) : (
          <div><dt>Sequences</dt><dd data-testid="request-detail-seqs">{r.seqs.length}</dd></div>
        )}
        {spec !== undefined && (
          <div title={`${spec.accepted} of ${spec.draftTokens} drafted tokens accepted in ${spec.drafts} verify steps`}>
            <dt>Drafts accepted</dt>
            <dd data-testid="request-detail-spec">{fmtPct(spec.draftTokens > 0 ? spec.accepted / spec.draftTokens : null)} · {(spec.accepted / spec.drafts).toFixed(2)} / verify</dd>
          </div>
        )}
      </dl>
      {r.prompt_preview && <p className="small detail-wrap"><span className="muted">Prompt: </span>{r.prompt_preview}</p>}
      {sampling && <p className="small mono muted detail-wrap">{sampling}</p>}
      {timeline && (
        <ol className="segments small" aria-label="State history">
          {timeline.segments.map((s, i) => (
            <li key={i}><span className={`state-chip state-${s.state.toLowerCase()}`}>{STATE_LABEL[s.state]}</span> {fmtSeconds(s.start - state.originTs)} <span className="muted">{s.reason}</span></li>
          ))}
        </ol>
      )}
      {bySeq.size > 0 && (
        <div className="detail-text">
          {[...bySeq.entries()].map(([seq, list]) => (
            <div key={seq}>
              {bySeq.size > 1 && <div className="muted small">seq {seq}</div>}
              {texts !== null ? (
                <EngineTokenText entries={list} texts={texts} testId="request-detail-text" />
              ) : (
                <div className="message-text small" data-testid="request-detail-text">{list.map((t) => t.text).join("")}</div>
              )}
            </div>
          ))}
        </div>
      )}
    </Card>
  );
}
