// Scheduler panel: one row per engine step (prefill chunks, decode batch with its speculative verify
// chunks, token budget, preemptions, why the queue head waits, step time) and an event log with a
// type filter and pause.
import { useMemo, useState } from "react";
import type { DashboardState } from "../../core/dashboard";
import { verifyTitle } from "../../core/spec";
import { describeChunks, describeEvent, prefillTokens } from "../../core/describe";
import { fmtMs, shortId } from "../../core/format";
import { ringItems, ringTail, type Ring } from "../../core/ring";
import { EVENT_TYPES, type EventType, type StepFinished, type StepScheduled } from "../../core/wire";
import { Card, EmptyState } from "../components/Card";
import { useDashboard } from "../context";
import { useThrottledDashboardState } from "../hooks";
import "./panels.css";

const STEP_ROWS = 60;
const LOG_ROWS = 150;
/** DOM tables refresh at 4 Hz: readable, and cheap next to the canvases. */
const TABLE_INTERVAL_MS = 250;

/** The step's verify chunks (num_draft > 0), each with its outcome from the request's timeline. */
function verifyLines(state: DashboardState, s: StepScheduled): string[] {
  const lines: string[] = [];
  for (const c of [...s.prefill, ...s.decode]) {
    const numDraft = c.num_draft ?? 0;
    if (numDraft === 0) continue;
    const marks = state.timelines.get(c.request_id)?.verifies ?? [];
    let accepted: number | null = null;
    for (let j = marks.length - 1; j >= 0 && marks[j]!.step >= s.step; j--) {
      if (marks[j]!.step === s.step && marks[j]!.seq_id === c.seq_id) accepted = marks[j]!.accepted;
    }
    lines.push(`${c.request_id} seq ${c.seq_id}: ${verifyTitle({ num_draft: numDraft, accepted })}`);
  }
  return lines;
}

function usePausable(state: DashboardState): [DashboardState, boolean, (v: boolean) => void] {
  const [frozen, setFrozen] = useState<DashboardState | null>(null);
  return [frozen ?? state, frozen !== null, (pause) => setFrozen(pause ? state : null)];
}

/** The newest `max` step rows, newest first; with `preemptedOnly`, only the steps that preempted
 * (searched over the whole kept history, not just the rows the table would show). */
export function stepRows(steps: Ring<StepScheduled>, max: number, preemptedOnly: boolean): StepScheduled[] {
  if (!preemptedOnly) return ringTail(steps, max).reverse();
  const out: StepScheduled[] = [];
  for (let j = steps.end - 1; j >= steps.start && out.length < max; j--) {
    const s = steps.buf[j]!;
    if (s.preempted.length > 0) out.push(s);
  }
  return out;
}

/** A request id as an 8-character link; the full id is its tooltip. */
function IdLink(props: { id: string; onSelect: (id: string) => void }) {
  return (
    <button type="button" className="link" title={props.id} data-testid="scheduler-id" onClick={() => props.onSelect(props.id)}>
      {shortId(props.id)}
    </button>
  );
}

export function SchedulerPanel() {
  const { store, select } = useDashboard();
  const live = useThrottledDashboardState(store, TABLE_INTERVAL_MS);
  const [state, paused, setPaused] = usePausable(live);
  const [preemptedOnly, setPreemptedOnly] = useState(false);
  const steps = stepRows(state.steps, STEP_ROWS, preemptedOnly);
  const times = useMemo(() => {
    const m = new Map<number, StepFinished>();
    // the filtered rows can be older than the last STEP_ROWS steps: index every kept time
    for (const t of ringItems(state.stepTimes)) m.set(t.step, t);
    return m;
  }, [state.stepTimes]);
  return (
    <Card
      className="card-lazy"
      title="Scheduler"
      testId="scheduler-panel"
      subtitle={`step ${state.engine.step}`}
      actions={
        <button type="button" className="btn btn-small" aria-pressed={paused} data-testid="scheduler-pause" onClick={() => setPaused(!paused)}>
          {paused ? "Resume" : "Pause"}
        </button>
      }
    >
      <div className="sched-tools">
        <label>
          <input type="checkbox" checked={preemptedOnly} onChange={(e) => setPreemptedOnly(e.currentTarget.checked)} data-testid="scheduler-preempted-only" />
          {" "}Preemptions only
        </label>
      </div>
      {steps.length === 0 ? (
        preemptedOnly ? (
          <EmptyState title="No preemptions" testId="scheduler-empty">No step in the kept history had to preempt a request.</EmptyState>
        ) : (
          <EmptyState title="No steps yet" testId="scheduler-empty">Each engine step appears here: what was prefilled, how many sequences decoded, and why the queue head waits.</EmptyState>
        )
      ) : (
        <div className="table-scroll">
          {/* the columns share the panel's width and their text wraps, so all eight stay visible (panels.css) */}
          <table className="table sched-table" data-testid="scheduler-table">
            <thead>
              <tr>
                {/* one-word headers (the long form in the title): the narrowest columns are as wide as their header */}
                <th scope="col">Queue head waits because</th>
                <th scope="col">Step</th>
                <th scope="col" title="Prefill chunks: request[first token + tokens]">Prefill</th>
                <th scope="col" title="Sequences in the decode batch">Decode</th>
                <th scope="col" title="Token budget used / the step's budget">Budget</th>
                <th scope="col" title="Running / waiting">Run / wait</th>
                <th scope="col" title="Requests preempted in this step">Preempted</th>
                <th scope="col" title="Step time">Time</th>
              </tr>
            </thead>
            <tbody>
              {steps.map((s) => {
                const t = times.get(s.step);
                const used = s.budget > 0 ? s.budget_used / s.budget : 0;
                const verifies = verifyLines(state, s);
                return (
                  <tr key={`${s.seq}`} data-testid="scheduler-step-row" data-step={s.step} className={s.preempted.length ? "row-alert" : ""}>
                    <td className="small" data-testid="scheduler-reason-cell">
                      {s.queue_head ? (
                        <>
                          {s.queue_head_reason ?? "?"}: <IdLink id={s.queue_head} onSelect={select} />
                        </>
                      ) : (
                        <span className="muted">–</span>
                      )}
                    </td>
                    <td className="num">{s.step}</td>
                    <td className="mono small" title={s.prefill.map((c) => `${c.request_id} seq ${c.seq_id}: tokens ${c.start}..${c.start + c.num_tokens}`).join("\n")}>
                      {describeChunks(s.prefill, 4, shortId)}
                      {s.prefill.length > 0 && <span className="muted"> ({prefillTokens(s)} tok)</span>}
                    </td>
                    <td className="num" title={verifies.length > 0 ? verifies.join("\n") : undefined} data-testid="scheduler-decode-cell">
                      {s.decode.length}
                      {verifies.length > 0 && <span className="verify-count" data-testid="scheduler-verify-count"> · {verifies.length} verify</span>}
                    </td>
                    <td className="budget-cell">
                      <div className="budget" title={`${s.budget_used} of ${s.budget} tokens`}>
                        <div className="budget-bar"><div style={{ width: `${Math.min(100, used * 100)}%` }} /></div>
                        <span className="num small">{s.budget_used}/<wbr />{s.budget}</span>
                      </div>
                    </td>
                    <td className="num">{s.num_running} / {s.num_waiting}</td>
                    <td className="small" data-testid="scheduler-preempted-cell">
                      <span className="sched-ids">
                        {s.preempted.map((id) => <IdLink key={id} id={id} onSelect={select} />)}
                      </span>
                    </td>
                    <td className="num small" title={t ? `schedule ${fmtMs(t.schedule_ms)}, forward ${fmtMs(t.forward_ms)}, sample ${fmtMs(t.sample_ms)}, postprocess ${fmtMs(t.postprocess_ms)}` : undefined}>
                      {t ? fmtMs(t.duration_ms) : "…"}
                      {t?.experts_touched != null && (
                        <span className="muted" data-testid="scheduler-experts" title="distinct experts the forward ran, summed over the MoE layers">
                          {" "}· {t.experts_touched} experts
                        </span>
                      )}
                    </td>
                  </tr>
                );
              })}
            </tbody>
          </table>
        </div>
      )}
    </Card>
  );
}

const DEFAULT_HIDDEN: EventType[] = ["token", "metrics"];

export function EventLogPanel() {
  const { store } = useDashboard();
  const live = useThrottledDashboardState(store, TABLE_INTERVAL_MS);
  const [state, paused, setPaused] = usePausable(live);
  const [hidden, setHidden] = useState<ReadonlySet<EventType>>(() => new Set(DEFAULT_HIDDEN));
  const counts = useMemo(() => {
    const c = new Map<EventType, number>();
    for (const e of ringItems(state.log)) c.set(e.type, (c.get(e.type) ?? 0) + 1);
    return c;
  }, [state.log]);
  const rows = useMemo(() => {
    const out = [];
    const log = state.log;
    for (let j = log.end - 1; j >= log.start && out.length < LOG_ROWS; j--) {
      const e = log.buf[j]!;
      if (!hidden.has(e.type)) out.push(e);
    }
    return out;
  }, [state.log, hidden]);
  const toggle = (t: EventType) => {
    const next = new Set(hidden);
    if (next.has(t)) next.delete(t);
    else next.add(t);
    setHidden(next);
  };
  return (
    <Card
      className="card-lazy"
      title="Event log"
      testId="event-log"
      subtitle={`${rows.length} shown`}
      actions={
        <button type="button" className="btn btn-small" aria-pressed={paused} data-testid="event-log-pause" onClick={() => setPaused(!paused)}>
          {paused ? "Resume" : "Pause"}
        </button>
      }
    >
      <fieldset className="chips" aria-label="Event types shown">
        <legend className="visually-hidden">Event types shown</legend>
        {EVENT_TYPES.map((t) => (
          <label key={t} className={`chip ${hidden.has(t) ? "" : "chip-on"}`}>
            <input type="checkbox" checked={!hidden.has(t)} onChange={() => toggle(t)} data-testid={`event-log-filter-${t}`} />
            {t} <span className="muted">{counts.get(t) ?? 0}</span>
          </label>
        ))}
      </fieldset>
      {rows.length === 0 ? (
        <EmptyState title="No events" testId="event-log-empty">Events of the selected types show up here as the engine emits them.</EmptyState>
      ) : (
        <ol className="log" aria-label="Events, newest first">
          {rows.map((e) => (
            <li key={e.seq ?? 0} data-testid="event-log-row" data-type={e.type}>
              <span className="log-seq num">{e.seq}</span>
              <span className="log-ts num">{((e.ts ?? 0) - state.originTs).toFixed(3)}</span>
              <span className={`log-type type-${e.type}`}>{e.type}</span>
              <span className="log-text">{describeEvent(e)}</span>
            </li>
          ))}
        </ol>
      )}
    </Card>
  );
}
