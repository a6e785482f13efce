// Request timeline: a Gantt chart on canvas, one row per request, with a DOM list of the rows
// (buttons: keyboard and e2e friendly) drawn beside it at the same row height. Speculative decoding's
// verify steps are marks across the bar: the accepted share of the drafts on top, the rejected below.
import { memo, useCallback, useEffect, useMemo, useRef, useState, type MouseEvent } from "react";
import { requestColor } from "../../core/color";
import type { DashboardState, RequestTimeline, Segment, SegmentState, VerifyMark } from "../../core/dashboard";
import { fmtSeconds, fmtTick, niceTicks } from "../../core/format";
import { verifyMarkAt, verifySummaryText, verifyTitle } from "../../core/spec";
import { currentSegmentState, segmentAt, timeScale, timelineSummaryText, visibleTimelines } from "../../core/timeline";
import { Card, EmptyState } from "../components/Card";
import { Select } from "../components/fields";
import { useDashboard } from "../context";
import { useCanvas, useDashboardState, usePublishedState } from "../hooks";
import { getPalette, type Palette } from "../theme";

const AXIS_H = 22;
const ROW_H = 18;
const BAR_H = 12;
const PLOT_H = 318;

type WindowChoice = "10" | "30" | "120" | "600" | "all";
const WINDOWS: { value: WindowChoice; label: string }[] = [
  { value: "10", label: "10 s" },
  { value: "30", label: "30 s" },
  { value: "120", label: "2 min" },
  { value: "600", label: "10 min" },
  { value: "all", label: "All" },
];

export const STATE_LABEL: Record<SegmentState, string> = {
  WAITING: "Waiting",
  PREFILL: "Prefill",
  DECODE: "Decode",
  PREEMPTED: "Preempted",
  FINISHED: "Finished",
  ABORTED: "Aborted",
  UNKNOWN: "Before joining",
};

function timeWindow(state: DashboardState, now: number, choice: WindowChoice): [number, number] {
  if (choice === "all") return [state.originTs, Math.max(now, state.originTs + 1)];
  return [now - Number(choice), now];
}

let hatch: { key: string; pattern: CanvasPattern | null } | null = null;
function hatchPattern(ctx: CanvasRenderingContext2D, p: Palette): CanvasPattern | null {
  const key = p.preempted + p.panel;
  if (hatch?.key === key) return hatch.pattern;
  const tile = document.createElement("canvas");
  tile.width = 6;
  tile.height = 6;
  const t = tile.getContext("2d");
  if (t === null) return null;
  t.strokeStyle = p.preempted;
  t.lineWidth = 1.5;
  t.beginPath();
  t.moveTo(-1, 7);
  t.lineTo(7, -1);
  t.stroke();
  hatch = { key, pattern: ctx.createPattern(tile, "repeat") };
  return hatch.pattern;
}

function drawSegment(ctx: CanvasRenderingContext2D, s: Segment, color: string, x0: number, x1: number, y: number, p: Palette): void {
  const mid = y + ROW_H / 2;
  const top = y + (ROW_H - BAR_H) / 2;
  const w = Math.max(1, x1 - x0);
  switch (s.state) {
    case "WAITING":
      ctx.fillStyle = p.waiting;
      ctx.fillRect(x0, mid - 1, w, 2);
      break;
    case "UNKNOWN":
      ctx.fillStyle = p.unknown;
      for (let x = x0; x < x1; x += 4) ctx.fillRect(x, mid - 1, 2, 2);
      break;
    case "PREFILL":
      ctx.globalAlpha = 0.5;
      ctx.fillStyle = color;
      ctx.fillRect(x0, top, w, BAR_H);
      ctx.globalAlpha = 1;
      ctx.fillStyle = color;
      ctx.fillRect(x0, top, w, 2);
      break;
    case "DECODE":
      ctx.fillStyle = color;
      ctx.fillRect(x0, top, w, BAR_H);
      break;
    case "PREEMPTED": {
      ctx.globalAlpha = 0.18;
      ctx.fillStyle = p.preempted;
      ctx.fillRect(x0, top, w, BAR_H);
      ctx.globalAlpha = 1;
      const pattern = hatchPattern(ctx, p);
      if (pattern !== null) {
        ctx.fillStyle = pattern;
        ctx.fillRect(x0, top, w, BAR_H);
      }
      ctx.fillStyle = p.preempted;
      ctx.fillRect(x0, top, 2, BAR_H);
      break;
    }
    case "FINISHED":
      ctx.fillStyle = p.finished;
      ctx.fillRect(x0 - 1, top - 1, 3, BAR_H + 2);
      break;
    case "ABORTED":
      ctx.strokeStyle = p.aborted;
      ctx.lineWidth = 2;
      ctx.beginPath();
      ctx.moveTo(x0 - 4, mid - 4);
      ctx.lineTo(x0 + 4, mid + 4);
      ctx.moveTo(x0 + 4, mid - 4);
      ctx.lineTo(x0 - 4, mid + 4);
      ctx.stroke();
      break;
  }
}

/** A verify step: a 2 px bar a little taller than the request's bar, the accepted share of its drafts
 * in the verify colour from the top and the rejected share in the preemption red below. */
function drawVerify(ctx: CanvasRenderingContext2D, mark: VerifyMark, x: number, y: number, p: Palette): void {
  const top = y + (ROW_H - BAR_H) / 2 - 2;
  const h = BAR_H + 4;
  const px = Math.round(x) - 1;
  ctx.fillStyle = p.panel;
  ctx.fillRect(px - 1, top, 4, h);
  if (mark.accepted === null) {
    ctx.globalAlpha = 0.5;
    ctx.fillStyle = p.series[2]!;
    ctx.fillRect(px, top, 2, h);
    ctx.globalAlpha = 1;
    return;
  }
  const kept = mark.num_draft > 0 ? Math.round((h * mark.accepted) / mark.num_draft) : h;
  ctx.fillStyle = p.series[2]!;
  ctx.fillRect(px, top, 2, kept);
  ctx.fillStyle = p.preempted;
  ctx.fillRect(px, top + kept, 2, h - kept);
}

interface Hover {
  id: string;
  segment: Segment | undefined;
  verify: VerifyMark | undefined;
  ts: number;
  /** Viewport coordinates of the pointer (the tooltip is position: fixed). */
  x: number;
  y: number;
}

const RowLabel = memo(function RowLabel(props: { id: string; state: SegmentState | null; selected: boolean; dark: boolean; onSelect: (id: string) => void }) {
  return (
    <li className="timeline-label" style={{ height: ROW_H }}>
      <button
        type="button"
        data-testid={`request-row-${props.id}`}
        data-state={props.state ?? ""}
        aria-pressed={props.selected}
        className={props.selected ? "selected" : ""}
        onClick={() => props.onSelect(props.id)}
        title={`${props.id}: ${props.state ?? "?"}`}
      >
        <span className="swatch" style={{ background: requestColor(props.id, props.dark) }} aria-hidden="true" />
        <span className="timeline-label-id">{props.id}</span>
        <span className={`state-chip state-${(props.state ?? "").toLowerCase()}`}>{props.state ? STATE_LABEL[props.state] : ""}</span>
      </button>
    </li>
  );
});

export function tooltipPosition(x: number, y: number): { left: number; top: number } {
  const w = typeof window === "undefined" ? 1600 : window.innerWidth;
  const h = typeof window === "undefined" ? 1000 : window.innerHeight;
  return { left: Math.min(x + 14, w - 300), top: Math.min(y + 14, h - 140) };
}

export function TimelinePanel() {
  const { store, selected, select, mode } = useDashboard();
  const state = useDashboardState(store);
  // live: a scrolling window; replay: everything up to the replay position by default
  const [choices, setChoices] = useState<Record<"live" | "replay", WindowChoice>>({ live: "30", replay: "all" });
  const choice = choices[mode];
  const setChoice = (c: WindowChoice) => setChoices({ ...choices, [mode]: c });
  const [hover, setHover] = useState<Hover | null>(null);
  const scrollTopRef = useRef(0);
  const summaryRef = useRef<HTMLPreElement | null>(null);
  const verifySummaryRef = useRef<HTMLPreElement | null>(null);
  const view = useRef({ t0: 0, t1: 1, width: 1 });
  const hoverRef = useRef<Hover | null>(null);
  const selectedRef = useRef(selected);
  const dark = getPalette().dark;

  // Rows at the UI rate; the canvas draws these rows with the latest segments every frame.
  const now = store.now();
  const [t0, t1] = timeWindow(state, now, choice);
  const rows = visibleTimelines(state, t0, t1);
  const rowKey = rows.map((r) => r.request_id).join("\n");
  const rowIds = useMemo(() => (rowKey === "" ? [] : rowKey.split("\n")), [rowKey]);
  const rowsRef = useRef(rowIds);
  const active = [...state.timelines.values()].filter((t) => {
    const s = currentSegmentState(t);
    return s !== null && s !== "FINISHED" && s !== "ABORTED";
  }).length;
  const hasVerifies = state.engine.config.speculative != null || [...state.timelines.values()].some((t) => t.verifies.length > 0);
  const activeRef = useRef(false);
  useEffect(() => {
    activeRef.current = active > 0;
    rowsRef.current = rowIds;
    hoverRef.current = hover;
    selectedRef.current = selected;
  });
  const contentH = AXIS_H + rowIds.length * ROW_H;
  // stable between renders, so memo(RowLabel) skips rows whose props did not change
  const onSelect = useCallback((id: string) => select(selected === id ? null : id), [select, selected]);

  const canvasRef = useCanvas({
    // scroll position from the scroll event: reading scrollTop here would force a layout every frame
    // While nothing runs, only the axis moves: redraw it at 10 Hz instead of every frame.
    key: () => [store.state, activeRef.current ? store.now() : Math.floor(store.now() * 10), rowsRef.current, scrollTopRef.current, hoverRef.current?.id, selectedRef.current, choice],
    draw: (ctx, size) => {
      const p = getPalette();
      const st = store.state;
      const nowTs = store.now();
      const [a, b] = timeWindow(st, nowTs, choice);
      view.current = { t0: a, t1: b, width: size.width };
      const x = timeScale(a, b, 0, size.width - 6);
      const scrollTop = scrollTopRef.current;
      ctx.fillStyle = p.panel; // opaque canvases: cheaper to composite
      ctx.fillRect(0, 0, size.width, size.height);
      // grid and axis
      const ticks = niceTicks(a - st.originTs, b - st.originTs, Math.max(2, Math.floor(size.width / 90)));
      ctx.font = "11px ui-sans-serif, system-ui, sans-serif";
      ctx.textBaseline = "middle";
      ctx.textAlign = "center";
      for (const t of ticks) {
        const tx = x(t + st.originTs);
        ctx.fillStyle = p.grid;
        ctx.fillRect(Math.round(tx), AXIS_H, 1, size.height - AXIS_H);
        ctx.fillStyle = p.muted;
        ctx.fillText(`${fmtTick(t)} s`, Math.max(16, Math.min(size.width - 16, tx)), AXIS_H / 2);
      }
      ctx.fillStyle = p.border;
      ctx.fillRect(0, AXIS_H - 1, size.width, 1);
      // rows
      ctx.save();
      ctx.beginPath();
      ctx.rect(0, AXIS_H, size.width, size.height - AXIS_H);
      ctx.clip();
      const ids = rowsRef.current;
      const first = Math.max(0, Math.floor(scrollTop / ROW_H));
      const last = Math.min(ids.length, Math.ceil((scrollTop + size.height - AXIS_H) / ROW_H) + 1);
      for (let i = first; i < last; i++) {
        const id = ids[i]!;
        const y = AXIS_H + i * ROW_H - scrollTop;
        if (id === selectedRef.current || id === hoverRef.current?.id) {
          ctx.fillStyle = p.grid;
          ctx.globalAlpha = id === selectedRef.current ? 1 : 0.5;
          ctx.fillRect(0, y, size.width, ROW_H);
          ctx.globalAlpha = 1;
        }
        const timeline = st.timelines.get(id);
        if (timeline === undefined) continue;
        const color = requestColor(id, p.dark);
        for (const s of timeline.segments) {
          const end = s.end ?? nowTs;
          if (end < a || s.start > b) continue;
          drawSegment(ctx, s, color, Math.max(-2, x(s.start)), Math.min(size.width, x(end)), y, p);
        }
        if (timeline.ticks.length > 0) {
          ctx.fillStyle = p.panel;
          for (const tick of timeline.ticks) {
            if (tick.ts < a || tick.ts > b) continue;
            ctx.fillRect(Math.round(x(tick.ts)), y + (ROW_H - BAR_H) / 2, 1, BAR_H);
          }
        }
        for (const mark of timeline.verifies) {
          if (mark.ts < a || mark.ts > b) continue;
          drawVerify(ctx, mark, x(mark.ts), y, p);
        }
      }
      ctx.restore();
      if (store.live) {
        ctx.fillStyle = p.accent;
        ctx.fillRect(Math.round(x(nowTs)), AXIS_H, 1, size.height - AXIS_H);
      }
      return false;
    },
  });

  // The DOM mirror of what is drawn, written at the UI rate (never more than once per frame).
  usePublishedState(store, (st) => {
    if (summaryRef.current !== null) summaryRef.current.textContent = timelineSummaryText([...st.timelines.values()]);
    if (verifySummaryRef.current !== null) verifySummaryRef.current.textContent = verifySummaryText(st.timelines.values());
  });

  const onMove = (e: MouseEvent<HTMLCanvasElement>) => {
    const rect = e.currentTarget.getBoundingClientRect();
    const px = e.clientX - rect.left;
    const py = e.clientY - rect.top;
    const scrollTop = scrollTopRef.current;
    const i = Math.floor((py - AXIS_H + scrollTop) / ROW_H);
    const id = py >= AXIS_H ? rowsRef.current[i] : undefined;
    if (id === undefined) {
      setHover(null);
      return;
    }
    const { t0: a, t1: b, width } = view.current;
    const ts = a + (px / Math.max(1, width - 6)) * (b - a);
    const timeline = store.state.timelines.get(id);
    const slack = ((b - a) / Math.max(1, width)) * 5;
    const segment = timeline ? segmentAt(timeline, ts, store.now(), slack) : undefined;
    const verify = timeline ? verifyMarkAt(timeline, ts, slack * 0.6) : undefined;
    setHover({ id, segment, verify, ts, x: e.clientX, y: e.clientY });
  };


  const hovered: RequestTimeline | undefined = hover ? state.timelines.get(hover.id) : undefined;
  const request = hover ? store.state.engine.requests.get(hover.id) : undefined;

  return (
    <Card
      title="Request timeline"
      testId="timeline-panel"
      subtitle={`${active} active · ${rowIds.length} shown${mode === "replay" ? " · replay" : ""}`}
      actions={<Select label="Time window" hideLabel value={choice} options={WINDOWS} onChange={setChoice} testId="timeline-window" />}
    >
      <ul className="legend" aria-label="Timeline legend">
        {(["WAITING", "PREFILL", "DECODE", "PREEMPTED", "FINISHED", "ABORTED"] as const).map((s) => (
          <li key={s}><span className={`legend-mark mark-${s.toLowerCase()}`} aria-hidden="true" />{STATE_LABEL[s]}</li>
        ))}
        <li><span className="legend-mark mark-tick" aria-hidden="true" />Prefill chunk</li>
        {hasVerifies && <li data-testid="timeline-legend-verify"><span className="legend-mark mark-verify" aria-hidden="true" />Verify step (speculative: accepted / rejected drafts)</li>}
      </ul>
      <div className="timeline-scroll" onScroll={(e) => { scrollTopRef.current = e.currentTarget.scrollTop; setHover(null); }}>
        <div className="timeline-inner" style={{ height: Math.max(contentH, PLOT_H) }}>
          <ol className="timeline-labels" aria-label="Requests in the timeline">
            <li className="timeline-labels-head" style={{ height: AXIS_H }} aria-hidden="true">Request</li>
            {rowIds.map((id) => (
              <RowLabel key={id} id={id} state={currentSegmentState(state.timelines.get(id)!)} selected={id === selected} dark={dark} onSelect={onSelect} />
            ))}
          </ol>
          <div className="timeline-plot">
            <canvas
              ref={canvasRef}
              className="timeline-canvas"
              data-testid="timeline-canvas"
              aria-label="Gantt chart of request states over time; the list beside it names the rows"
              role="img"
              onMouseMove={onMove}
              onMouseLeave={() => setHover(null)}
              onClick={() => hover && onSelect(hover.id)}
            />
            {rowIds.length === 0 && (
              <div className="overlay-empty">
                {state.engine.config.model === "" ? (
                  <EmptyState title="Waiting for the engine…" testId="timeline-empty">
                    The dashboard shows requests once the server's event stream (<code>/ws/events</code>) sends its first snapshot.
                  </EmptyState>
                ) : (
                  <EmptyState title={state.timelines.size === 0 ? "No requests yet" : "Nothing in this time window"} testId="timeline-empty">
                    {state.timelines.size === 0 ? "Send a chat message or start the load generator to watch requests flow through the engine." : "Widen the time window to see earlier requests."}
                  </EmptyState>
                )}
              </div>
            )}
          </div>
        </div>
      </div>
      {hover && hovered && (
        <div className="tooltip" data-testid="timeline-tooltip" role="tooltip" style={tooltipPosition(hover.x, hover.y)}>
          <div className="tooltip-title">
            <span className="swatch" style={{ background: requestColor(hover.id, dark) }} />
            {hover.id}
          </div>
          {hover.segment ? (
            <>
              <div><b>{STATE_LABEL[hover.segment.state]}</b> {fmtSeconds(hover.segment.start - state.originTs)} → {hover.segment.end === null ? "now" : fmtSeconds(hover.segment.end - state.originTs)}
                {hover.segment.end !== hover.segment.start && <> ({fmtSeconds((hover.segment.end ?? store.now()) - hover.segment.start)})</>}
              </div>
              <div className="muted">{hover.segment.reason}</div>
            </>
          ) : (
            <div className="muted">at {fmtSeconds(hover.ts - state.originTs)}</div>
          )}
          {hover.verify && (
            <div data-testid="timeline-tooltip-verify">
              <b>{verifyTitle(hover.verify)}</b> <span className="muted">step {hover.verify.step}{hovered.verifies.some((v) => v.seq_id !== hover.verify!.seq_id) ? `, seq ${hover.verify.seq_id}` : ""}</span>
            </div>
          )}
          {request && (
            <div className="muted">
              prompt {request.prompt_tokens} · out {request.output_tokens}/{request.max_tokens * request.n}
              {request.num_preemptions > 0 && ` · preempted ×${request.num_preemptions}`}
              {hovered.ticks.length > 0 && ` · ${hovered.ticks.length} prefill chunk${hovered.ticks.length > 1 ? "s" : ""}`}
              {hovered.verifies.length > 0 && ` · ${hovered.verifies.length} verify step${hovered.verifies.length > 1 ? "s" : ""}`}
            </div>
          )}
        </div>
      )}
      <pre className="visually-hidden" data-testid="timeline-summary" ref={summaryRef} />
      <pre className="visually-hidden" data-testid="timeline-verify-summary" ref={verifySummaryRef} />
    </Card>
  );
}
