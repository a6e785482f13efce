// Request timeline: a Gantt chart on canvas, one row per request, with a DOM list of the rows
// (buttons: keyboard and e2e friendly) drawn beside it at the same row height. Speculative decoding's
// verify steps are marks across the bar: the accepted share of the drafts on top, the rejected below.
import { memo, useCallback, useEffect, useMemo, useRef, useState, type KeyboardEvent, type MouseEvent, type PointerEvent } from "react";
import { liveRequestColor } from "../../core/color";
import type { DashboardState, RequestTimeline, Segment, SegmentState, VerifyMark } from "../../core/dashboard";
import { fmtSeconds, fmtTick, niceTicks, shortId } from "../../core/format";
import { verifyMarkAt, verifySummaryText, verifyTitle } from "../../core/spec";
import { currentSegmentState, segmentAt, timeScale, timelineSummaryText, visibleTimelines } from "../../core/timeline";
import { panView, preemptionArrows, promptWords, searchRows, timeAt, viewBounds, viewWindow, zoomView, type PreemptionArrow, type TimeView } from "../../core/timelineView";
import { replayControllerOf } from "../../live/replayController";
import type { DashboardStore } from "../../live/store";
import { Card, EmptyState } from "../components/Card";
import { Select } from "../components/fields";
import { useDashboard } from "../context";
import { useCanvas, useDashboardState, usePublishedState } from "../hooks";
import { getPalette, type Palette } from "../theme";
import "./panels.css";

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

/** The window before any zoom. In replay, "All" spans the whole recording (not just up to the replay
 * position), so the axis stays put while it plays or seeks and a click lands where it points. */
function timeWindow(state: DashboardState, now: number, choice: WindowChoice, store: DashboardStore): [number, number] {
  if (choice === "all") {
    const replay = replayControllerOf(store)?.getInfo();
    const end = replay?.loaded ? Math.max(replay.endTs, now) : now;
    return [state.originTs, Math.max(end, state.originTs + 1)];
  }
  return [now - Number(choice), now];
}

/** Wheel steps: one notch (deltaY ~100) zooms by ~16%. */
const WHEEL_ZOOM = 0.0015;
/** A press that moves less than this many pixels is a click, not a drag. */
const DRAG_PX = 4;

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

/** A preemption: a curved arrow from the preempted request's row to the row of the request that
 * needed its blocks, at the moment it happened. */
function drawArrow(ctx: CanvasRenderingContext2D, x: number, yFrom: number, yTo: number, p: Palette): void {
  const from = yFrom + ROW_H / 2;
  const to = yTo + ROW_H / 2 + (yTo > yFrom ? -4 : 4);
  const bend = x + Math.min(40, 8 + Math.abs(to - from) / 4);
  ctx.strokeStyle = p.preempted;
  ctx.fillStyle = p.preempted;
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  ctx.moveTo(x, from);
  ctx.quadraticCurveTo(bend, (from + to) / 2, x, to);
  ctx.stroke();
  // the head, along the curve's last direction (from the control point to the end)
  const angle = Math.atan2(to - (from + to) / 2, x - bend);
  ctx.beginPath();
  ctx.moveTo(x, to);
  ctx.lineTo(x - 7 * Math.cos(angle - 0.45), to - 7 * Math.sin(angle - 0.45));
  ctx.lineTo(x - 7 * Math.cos(angle + 0.45), to - 7 * Math.sin(angle + 0.45));
  ctx.closePath();
  ctx.fill();
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

const RowLabel = memo(function RowLabel(props: {
  id: string; state: SegmentState | null; selected: boolean; match: boolean; color: string; prompt: string; onSelect: (id: string) => void;
}) {
  const classes = [props.selected ? "selected" : "", props.match ? "match" : ""].filter(Boolean).join(" ");
  return (
    <li className="timeline-label" style={{ height: ROW_H }}>
      <button
        type="button"
        data-testid={`request-row-${props.id}`}
        data-state={props.state ?? ""}
        data-match={props.match ? "true" : undefined}
        aria-pressed={props.selected}
        className={classes}
        onClick={() => props.onSelect(props.id)}
        title={`${props.id}: ${props.state ?? "?"}${props.prompt ? `\n${props.prompt}` : ""}`}
      >
        <span className="swatch" style={{ background: props.color }} aria-hidden="true" />
        <span className={`timeline-label-id${props.prompt ? " short" : ""}`}>{props.prompt ? shortId(props.id) : props.id}</span>
        {props.prompt && <span className="timeline-label-prompt" data-testid="timeline-row-prompt">{props.prompt}</span>}
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

/** One line per arrow ("victim -> cause @ t"), the DOM mirror of the drawn preemption arrows. */
function arrowsText(arrows: readonly PreemptionArrow[], originTs: number): string {
  return arrows.map((a) => `${a.victim} -> ${a.cause} @ ${(a.ts - originTs).toFixed(3)}`).join("\n");
}

interface Drag {
  x: number;
  view: TimeView | null;
  moved: boolean;
}

type Views = Record<"live" | "replay", TimeView | null>;

export function TimelinePanel() {
  const { store, selected, select, mode } = useDashboard();
  const state = useDashboardState(store);
  // live: a scrolling window; replay: the whole recording by default
  const [choices, setChoices] = useState<Record<"live" | "replay", WindowChoice>>({ live: "30", replay: "all" });
  const choice = choices[mode];
  // the user's zoom / pan of the chosen window, per mode; a new window choice starts unzoomed
  const [views, setViews] = useState<Views>({ live: null, replay: null });
  const zoom = views[mode];
  const setZoom = useCallback((v: TimeView | null) => setViews((all) => ({ ...all, [mode]: v })), [mode]);
  const setChoice = (c: WindowChoice) => {
    setChoices({ ...choices, [mode]: c });
    setZoom(null);
  };
  const [hover, setHover] = useState<Hover | null>(null);
  const [query, setQuery] = useState("");
  const [matchAt, setMatchAt] = useState(0);
  const scrollTopRef = useRef(0);
  const scrollRef = useRef<HTMLDivElement | null>(null);
  const plotRef = useRef<HTMLDivElement | null>(null);
  const summaryRef = useRef<HTMLPreElement | null>(null);
  const verifySummaryRef = useRef<HTMLPreElement | null>(null);
  const arrowsRef = useRef<HTMLPreElement | null>(null);
  const view = useRef({ t0: 0, t1: 1, width: 1 });
  const zoomRef = useRef<TimeView | null>(zoom);
  const dragRef = useRef<Drag | null>(null);
  const suppressClick = useRef(false);
  const hoverRef = useRef<Hover | null>(null);
  const selectedRef = useRef(selected);
  const matchesRef = useRef<ReadonlySet<string>>(new Set());
  const dark = getPalette().dark;

  // Rows at the UI rate; the canvas draws these rows with the latest segments every frame.
  const now = store.now();
  const base = timeWindow(state, now, choice, store);
  const [t0, t1] = viewWindow(base, zoom);
  const rows = visibleTimelines(state, t0, t1);
  const rowKey = rows.map((r) => r.request_id).join("\n");
  const rowIds = useMemo(() => (rowKey === "" ? [] : rowKey.split("\n")), [rowKey]);
  const rowsRef = useRef(rowIds);
  const matches = useMemo(() => searchRows(rowIds, query), [rowIds, query]);
  const matchSet = useMemo(() => new Set(matches.map((i) => rowIds[i]!)), [matches, rowIds]);
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
    zoomRef.current = zoom;
    matchesRef.current = matchSet;
  });
  const contentH = AXIS_H + rowIds.length * ROW_H;
  // stable between renders, so memo(RowLabel) skips rows whose props did not change
  const onSelect = useCallback((id: string) => select(selected === id ? null : id), [select, selected]);

  /** Scrolls row `i` into the middle of the list if it is out of sight. */
  const revealRow = (i: number) => {
    const el = scrollRef.current;
    if (el === null) return;
    const y = AXIS_H + i * ROW_H;
    const height = el.clientHeight || PLOT_H;
    if (y < el.scrollTop + AXIS_H || y + ROW_H > el.scrollTop + height) el.scrollTop = Math.max(0, y - height / 2);
  };

  const onQuery = (q: string) => {
    setQuery(q);
    setMatchAt(0);
    const first = searchRows(rowIds, q)[0];
    if (first !== undefined) revealRow(first);
  };

  // Enter: select the next match (and bring it into view)
  const onQueryKey = (e: KeyboardEvent<HTMLInputElement>) => {
    if (e.key !== "Enter" || matches.length === 0) return;
    e.preventDefault();
    const k = matchAt % matches.length;
    const i = matches[k]!;
    revealRow(i);
    select(rowIds[i]!);
    setMatchAt(k + 1);
  };

  const zoomBy = (factor: number) => {
    const st = store.state;
    const baseNow = timeWindow(st, store.now(), choice, store);
    const [a, b] = viewWindow(baseNow, zoomRef.current);
    setZoom(zoomView(baseNow, zoomRef.current, viewBounds(baseNow, st.originTs), (a + b) / 2, factor));
  };

  // The wheel zooms around the pointer. A native listener: React's wheel handlers are passive, and
  // the page must not scroll while the plot zooms.
  useEffect(() => {
    const el = plotRef.current;
    if (el === null) return;
    const onWheel = (e: WheelEvent) => {
      if (e.deltaY === 0 || e.shiftKey) return; // shift + wheel: leave it to the browser
      e.preventDefault();
      const rect = el.getBoundingClientRect();
      const { t0: a, t1: b, width } = view.current;
      const anchor = timeAt(e.clientX - rect.left, width - 6, [a, b]);
      const st = store.state;
      const baseNow = timeWindow(st, store.now(), choice, store);
      setZoom(zoomView(baseNow, zoomRef.current, viewBounds(baseNow, st.originTs), anchor, Math.exp(e.deltaY * WHEEL_ZOOM)));
    };
    el.addEventListener("wheel", onWheel, { passive: false });
    return () => el.removeEventListener("wheel", onWheel);
  }, [store, choice, setZoom]);

  const canvasRef = useCanvas({
    // scroll position from the scroll event: reading scrollTop here would force a layout every frame
    // While nothing runs, only the axis moves: redraw it at 10 Hz instead of every frame.
    key: () => [store.state, activeRef.current ? store.now() : Math.floor(store.now() * 10), rowsRef.current, scrollTopRef.current, hoverRef.current?.id, selectedRef.current, choice, zoomRef.current, matchesRef.current],
    draw: (ctx, size) => {
      const p = getPalette();
      const st = store.state;
      const nowTs = store.now();
      const [a, b] = viewWindow(timeWindow(st, nowTs, choice, store), zoomRef.current);
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
        if (matchesRef.current.has(id)) {
          ctx.fillStyle = p.accent;
          ctx.globalAlpha = 0.14;
          ctx.fillRect(0, y, size.width, ROW_H);
          ctx.globalAlpha = 1;
        }
        if (id === selectedRef.current || id === hoverRef.current?.id) {
          ctx.fillStyle = p.grid;
          ctx.globalAlpha = id === selectedRef.current ? 1 : 0.5;
          ctx.fillRect(0, y, size.width, ROW_H);
          ctx.globalAlpha = 1;
        }
        const timeline = st.timelines.get(id);
        if (timeline === undefined) continue;
        const color = liveRequestColor(st.timelines, id, p.dark);
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
      const rowOf = new Map(ids.map((id, i) => [id, i]));
      const shown = ids.map((id) => st.timelines.get(id)).filter((t): t is RequestTimeline => t !== undefined);
      for (const arrow of preemptionArrows(shown, st.steps, a, b)) {
        const from = rowOf.get(arrow.victim)!;
        const to = rowOf.get(arrow.cause)!;
        if (Math.max(from, to) < first || Math.min(from, to) >= last) continue;
        drawArrow(ctx, x(arrow.ts), AXIS_H + from * ROW_H - scrollTop, AXIS_H + to * ROW_H - scrollTop, p);
      }
      ctx.restore();
      // the engine's "now": live, the latest time; replay, the replay position
      ctx.fillStyle = p.accent;
      ctx.fillRect(Math.round(x(nowTs)), AXIS_H, store.live ? 1 : 2, size.height - AXIS_H);
      return false;
    },
  });

  // The DOM mirror of what is drawn, written at the UI rate (never more than once per frame).
  usePublishedState(store, (st) => {
    if (summaryRef.current !== null) summaryRef.current.textContent = timelineSummaryText([...st.timelines.values()]);
    if (verifySummaryRef.current !== null) verifySummaryRef.current.textContent = verifySummaryText(st.timelines.values());
    if (arrowsRef.current !== null) {
      const all = [...st.timelines.values()];
      arrowsRef.current.textContent = arrowsText(preemptionArrows(all, st.steps, -Infinity, Infinity), st.originTs);
    }
  });

  const onMove = (e: MouseEvent<HTMLCanvasElement>) => {
    if (dragRef.current?.moved) return;
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
    const ts = timeAt(px, width - 6, [a, b]);
    const timeline = store.state.timelines.get(id);
    const slack = ((b - a) / Math.max(1, width)) * 5;
    const segment = timeline ? segmentAt(timeline, ts, store.now(), slack) : undefined;
    const verify = timeline ? verifyMarkAt(timeline, ts, slack * 0.6) : undefined;
    setHover({ id, segment, verify, ts, x: e.clientX, y: e.clientY });
  };

  // Drag pans the window; a press that hardly moves stays a click.
  const onPointerDown = (e: PointerEvent<HTMLCanvasElement>) => {
    if (e.button !== 0) return;
    dragRef.current = { x: e.clientX, view: zoomRef.current, moved: false };
    e.currentTarget.setPointerCapture?.(e.pointerId);
  };
  const onPointerMove = (e: PointerEvent<HTMLCanvasElement>) => {
    const drag = dragRef.current;
    if (drag === null) return;
    const dx = e.clientX - drag.x;
    if (!drag.moved && Math.abs(dx) < DRAG_PX) return;
    if (!drag.moved) setHover(null);
    drag.moved = true;
    const st = store.state;
    const baseNow = timeWindow(st, store.now(), choice, store);
    const [a, b] = viewWindow(baseNow, drag.view);
    const dt = (-dx / Math.max(1, view.current.width - 6)) * (b - a);
    setZoom(panView(baseNow, drag.view, viewBounds(baseNow, st.originTs), dt));
  };
  const onPointerUp = (e: PointerEvent<HTMLCanvasElement>) => {
    suppressClick.current = dragRef.current?.moved ?? false;
    dragRef.current = null;
    e.currentTarget.releasePointerCapture?.(e.pointerId);
  };

  const onClick = (e: MouseEvent<HTMLCanvasElement>) => {
    if (suppressClick.current) {
      suppressClick.current = false;
      return;
    }
    const replay = mode === "replay" ? replayControllerOf(store) : undefined;
    if (replay?.getInfo().loaded) {
      // replay: jump to the moment clicked (and select the row clicked, if any)
      const rect = e.currentTarget.getBoundingClientRect();
      const { t0: a, t1: b, width } = view.current;
      replay.seekTs(timeAt(e.clientX - rect.left, width - 6, [a, b]));
      if (hover) select(hover.id);
      return;
    }
    if (hover) onSelect(hover.id);
  };

  const hovered: RequestTimeline | undefined = hover ? state.timelines.get(hover.id) : undefined;
  const request = hover ? store.state.engine.requests.get(hover.id) : undefined;
  const replayLoaded = mode === "replay" && (replayControllerOf(store)?.getInfo().loaded ?? false);

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
        <li><span className="legend-arrow" aria-hidden="true">↷</span> Preempted for</li>
        {hasVerifies && <li data-testid="timeline-legend-verify"><span className="legend-mark mark-verify" aria-hidden="true" />Verify step (speculative: accepted / rejected drafts)</li>}
      </ul>
      <div className="timeline-tools">
        <input
          type="search"
          placeholder="Find request id"
          aria-label="Find a request by id"
          value={query}
          onChange={(e) => onQuery(e.currentTarget.value)}
          onKeyDown={onQueryKey}
          data-testid="timeline-search"
        />
        {query.trim() !== "" && (
          <span className="muted" data-testid="timeline-search-count">
            {matches.length === 0 ? "no match in this window" : `${matches.length} match${matches.length > 1 ? "es" : ""}${matches.length > 1 ? " · Enter: next" : " · Enter: select"}`}
          </span>
        )}
        <span className="grow" />
        {/* the wheel's zoom for the keyboard: around the middle of the window */}
        <button type="button" className="btn btn-small btn-ghost" onClick={() => zoomBy(1 / 1.5)} data-testid="timeline-zoom-in" aria-label="Zoom in" title="Zoom in">+</button>
        <button type="button" className="btn btn-small btn-ghost" onClick={() => zoomBy(1.5)} data-testid="timeline-zoom-out" aria-label="Zoom out" title="Zoom out">−</button>
        {zoom !== null && (
          <button type="button" className="btn btn-small btn-ghost" onClick={() => setZoom(null)} data-testid="timeline-zoom-reset" title="Back to the whole time window">
            Reset zoom ({fmtSeconds(zoom.span)})
          </button>
        )}
        <span className="muted small">wheel: zoom · drag: pan{replayLoaded ? " · click: jump there" : ""}</span>
      </div>
      <div className="timeline-scroll" ref={scrollRef} onScroll={(e) => { scrollTopRef.current = e.currentTarget.scrollTop; setHover(null); }}>
        <div className="timeline-inner" style={{ height: Math.max(contentH, PLOT_H) }}>
          <ol className="timeline-labels" aria-label="Requests in the timeline">
            <li className="timeline-labels-head" style={{ height: AXIS_H }} aria-hidden="true">Request</li>
            {rowIds.map((id) => (
              <RowLabel
                key={id}
                id={id}
                state={currentSegmentState(state.timelines.get(id)!)}
                selected={id === selected}
                match={matchSet.has(id)}
                color={liveRequestColor(state.timelines, id, dark)}
                prompt={promptWords(state.engine.requests.get(id)?.prompt_preview ?? "", 5)}
                onSelect={onSelect}
              />
            ))}
          </ol>
          <div className="timeline-plot" ref={plotRef}>
            <canvas
              ref={canvasRef}
              className={`timeline-canvas${replayLoaded ? " replay" : ""}`}
              data-testid="timeline-canvas"
              data-view={zoom === null ? "auto" : `${zoom.span.toFixed(3)}@${zoom.endOffset.toFixed(3)}`}
              aria-label="Gantt chart of request states over time; the list beside it names the rows"
              role="img"
              onMouseMove={onMove}
              onMouseLeave={() => setHover(null)}
              onPointerDown={onPointerDown}
              onPointerMove={onPointerMove}
              onPointerUp={onPointerUp}
              onPointerCancel={onPointerUp}
              onClick={onClick}
            />
            {rowIds.length === 0 && (
              <div className="overlay-empty">
                {mode === "replay" && !replayLoaded ? (
                  <EmptyState title="Load a recording" testId="timeline-empty">
                    Pick a recording above (or open a file) to replay it here.
                  </EmptyState>
                ) : state.engine.config.model === "" ? (
                  <EmptyState title="Waiting for the engine…" testId="timeline-empty">
                    The dashboard shows requests once the server's event stream (<code>/ws/events</code>) sends its first snapshot.
                  </EmptyState>
                ) : (
                  <EmptyState title={state.timelines.size === 0 ? "No requests yet" : "Nothing in this time window"} testId="timeline-empty">
                    {state.timelines.size === 0 ? "Send a chat message or start the load generator to watch requests flow through the engine." : "Widen the time window (or reset the zoom) to see earlier requests."}
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
            <span className="swatch" style={{ background: liveRequestColor(state.timelines, hover.id, dark) }} />
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
      <pre className="visually-hidden" data-testid="timeline-arrows" ref={arrowsRef} />
    </Card>
  );
}
