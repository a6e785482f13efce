// KV-cache heatmap: every block of the pool is a cell. Colour = owning request, fill level = tokens
// held, a corner mark for shared blocks, grey for cached-but-free blocks, a flash on eviction.
import { useEffect, useRef, useState, type KeyboardEvent, type MouseEvent } from "react";
import { liveRequestColor } from "../../core/color";
import { fmtInt, fmtPct, fmtSeconds } from "../../core/format";
import { blockModel, blockOwners, gridLayout, heatmapSummaryText, KIND_CACHED, KIND_FREE, KIND_SHARED, KIND_USED, requestBlocks, type BlockModel } from "../../core/heatmap";
import { Card, EmptyState } from "../components/Card";
import { useDashboard } from "../context";
import { useCanvas, useDashboardState, usePublishedState } from "../hooks";
import { getPalette } from "../theme";
import { tooltipPosition } from "./TimelinePanel";

const FLASH_S = 0.6;
const MAX_GRID_H = 360;

interface Cursor {
  block: number;
  /** Viewport position for the tooltip; null when moved by keyboard (placed under the grid). */
  x: number | null;
  y: number | null;
}

export function HeatmapPanel() {
  const { store, selected, select } = useDashboard();
  const state = useDashboardState(store);
  const wrapRef = useRef<HTMLDivElement | null>(null);
  const summaryRef = useRef<HTMLPreElement | null>(null);
  const [width, setWidth] = useState(600);
  const [cursor, setCursor] = useState<Cursor | null>(null);
  const cursorRef = useRef<Cursor | null>(null);
  const selectedRef = useRef(selected);
  useEffect(() => {
    cursorRef.current = cursor;
    selectedRef.current = selected;
  });

  useEffect(() => {
    const el = wrapRef.current;
    if (el === null || typeof ResizeObserver !== "function") return;
    const ro = new ResizeObserver(() => setWidth(Math.max(120, Math.floor(el.clientWidth))));
    ro.observe(el);
    return () => ro.disconnect();
  }, []);

  const n = state.engine.blocks.length;
  const layout = gridLayout(n, width, MAX_GRID_H);
  const layoutRef = useRef(layout);
  useEffect(() => {
    layoutRef.current = layout;
  });

  const canvasRef = useCanvas({
    key: () => [store.state, cursorRef.current?.block, selectedRef.current, layoutRef.current.cell, layoutRef.current.cols],
    draw: (ctx, size) => {
      const p = getPalette();
      const st = store.state;
      const m = blockModel(st.engine);
      const { cell, cols } = layoutRef.current;
      ctx.fillStyle = p.panel; // opaque canvases: cheaper to composite
      ctx.fillRect(0, 0, size.width, size.height);
      if (cell === 0) return false;
      const sel = selectedRef.current;
      const selectedSet = sel !== null ? requestBlocks(st.engine, sel) : null;
      const x = (b: number) => (b % cols) * (cell + 1);
      const y = (b: number) => Math.floor(b / cols) * (cell + 1);
      // Setting fillStyle parses a colour: cells are drawn in batches of one style each.
      const inset = Math.max(1, Math.floor(cell / 4));
      ctx.fillStyle = p.cached;
      for (let b = 0; b < m.numBlocks; b++) if (m.kind[b] === KIND_CACHED) ctx.fillRect(x(b), y(b), cell, cell);
      ctx.fillStyle = p.free;
      for (let b = 0; b < m.numBlocks; b++) {
        const k = m.kind[b];
        if (k === KIND_FREE) ctx.fillRect(x(b), y(b), cell, cell);
        else if (k === KIND_CACHED) ctx.fillRect(x(b) + inset, y(b) + inset, cell - 2 * inset, cell - 2 * inset);
      }
      const byOwner = new Map<string | null, number[]>();
      for (let b = 0; b < m.numBlocks; b++) {
        const k = m.kind[b];
        if (k !== KIND_USED && k !== KIND_SHARED) continue;
        const owner = m.primary[b] ?? null;
        let list = byOwner.get(owner);
        if (list === undefined) byOwner.set(owner, (list = []));
        list.push(b);
      }
      for (const [owner, list] of byOwner) {
        ctx.fillStyle = owner !== null ? liveRequestColor(st.timelines, owner, p.dark) : p.muted;
        ctx.globalAlpha = 0.28;
        for (const b of list) ctx.fillRect(x(b), y(b), cell, cell);
        ctx.globalAlpha = 1;
        for (const b of list) {
          const h = Math.max(1, Math.round(m.fill[b]! * cell));
          ctx.fillRect(x(b), y(b) + cell - h, cell, h);
        }
      }
      if (m.counts.shared > 0) {
        const s = Math.max(3, Math.floor(cell / 2.2));
        ctx.fillStyle = p.text;
        ctx.beginPath();
        for (let b = 0; b < m.numBlocks; b++) {
          if (m.kind[b] !== KIND_SHARED) continue;
          const bx = x(b) + cell;
          const by = y(b);
          ctx.moveTo(bx - s, by);
          ctx.lineTo(bx, by);
          ctx.lineTo(bx, by + s);
          ctx.closePath();
        }
        ctx.fill();
      }
      if (selectedSet !== null) {
        ctx.fillStyle = p.panel;
        ctx.globalAlpha = 0.7;
        for (let b = 0; b < m.numBlocks; b++) if (!selectedSet.has(b)) ctx.fillRect(x(b), y(b), cell, cell);
        ctx.globalAlpha = 1;
        ctx.strokeStyle = p.text;
        ctx.lineWidth = 1;
        for (const b of selectedSet) if (b < m.numBlocks) ctx.strokeRect(x(b) + 0.5, y(b) + 0.5, cell - 1, cell - 1);
      }
      const now = store.now();
      /** Fades `times`' recent blocks in `colour`; true while any is still fading. */
      const flash = (times: Float64Array, colour: string): boolean => {
        let any = false;
        ctx.fillStyle = colour;
        for (let b = 0; b < m.numBlocks; b++) {
          const age = now - times[b]!;
          if (Number.isNaN(age) || age < 0 || age >= FLASH_S) continue;
          any = true;
          ctx.globalAlpha = 0.85 * (1 - age / FLASH_S);
          ctx.fillRect(x(b), y(b), cell, cell);
        }
        ctx.globalAlpha = 1;
        return any;
      };
      const evicting = flash(st.evictedAt, p.flash);
      const restoring = flash(st.restoredAt, p.restore);
      const dropping = flash(st.droppedAt, p.drop);
      const flashing = evicting || restoring || dropping;
      const c = cursorRef.current;
      if (c !== null && c.block < m.numBlocks) {
        ctx.strokeStyle = p.accent;
        ctx.lineWidth = 2;
        ctx.strokeRect(x(c.block) - 1, y(c.block) - 1, cell + 2, cell + 2);
      }
      return flashing;
    },
  });

  // The DOM mirror of what is drawn, written at the UI rate (never more than once per frame).
  usePublishedState(store, (st) => {
    const el = summaryRef.current;
    if (el === null) return;
    const m = blockModel(st.engine);
    el.textContent = heatmapSummaryText(m);
    el.dataset.used = String(m.counts.used);
    el.dataset.shared = String(m.counts.shared);
    el.dataset.cached = String(m.counts.cached);
    el.dataset.free = String(m.counts.free);
    el.dataset.restored = String(st.restoredAt.reduce((n, t) => n + (Number.isNaN(t) ? 0 : 1), 0));
  });

  const blockAt = (e: MouseEvent<HTMLCanvasElement>): number | null => {
    const rect = e.currentTarget.getBoundingClientRect();
    const col = Math.floor((e.clientX - rect.left) / (layout.cell + 1));
    const row = Math.floor((e.clientY - rect.top) / (layout.cell + 1));
    if (col < 0 || col >= layout.cols || row < 0) return null;
    const b = row * layout.cols + col;
    return b < n ? b : null;
  };

  const model = blockModel(state.engine);
  const onKey = (e: KeyboardEvent<HTMLCanvasElement>) => {
    if (n === 0) return;
    const current = cursor?.block ?? 0;
    const moves: Record<string, number> = { ArrowRight: 1, ArrowLeft: -1, ArrowDown: layout.cols, ArrowUp: -layout.cols, Home: -current, End: n - 1 - current };
    if (e.key in moves) {
      e.preventDefault();
      const next = cursor === null ? 0 : Math.max(0, Math.min(n - 1, current + moves[e.key]!));
      setCursor({ block: next, x: null, y: null });
    } else if (e.key === "Enter" || e.key === " ") {
      e.preventDefault();
      const owner = cursor !== null ? model.primary[cursor.block] : null;
      select(owner ?? null);
    } else if (e.key === "Escape") {
      setCursor(null);
      select(null);
    }
  };

  const cfg = state.engine.config;
  const selectedRequest = selected !== null ? state.engine.requests.get(selected) : undefined;

  return (
    <Card
      title="KV cache"
      testId="heatmap-panel"
      subtitle={n > 0 ? `${fmtInt(n)} blocks × ${cfg.block_size} tokens · ${fmtPct(model.counts.used / Math.max(1, n))} in use` : undefined}
    >
      <ul className="legend" aria-label="Heatmap legend">
        <li><span className="legend-cell cell-used" aria-hidden="true" />In use (colour = request, height = tokens)</li>
        <li><span className="legend-cell cell-shared" aria-hidden="true" />Shared (ref &gt; 1)</li>
        <li><span className="legend-cell cell-cached" aria-hidden="true" />Cached, free</li>
        <li><span className="legend-cell cell-free" aria-hidden="true" />Free</li>
        <li><span className="legend-cell cell-flash" aria-hidden="true" />Evicted{cfg.kv_offload_bytes ? " (to the disk tier)" : ""}</li>
        {cfg.kv_offload_bytes ? <li data-testid="legend-restored"><span className="legend-cell cell-restore" aria-hidden="true" />Restored from disk</li> : null}
        {cfg.kv_window || cfg.attention_window ? <li data-testid="legend-dropped"><span className="legend-cell cell-drop" aria-hidden="true" />Left the {cfg.kv_window ? "KV" : "attention"} window</li> : null}
      </ul>
      <div className="heatmap-wrap" ref={wrapRef}>
        {n === 0 ? (
          <EmptyState title="Waiting for the engine" testId="heatmap-empty">The block pool appears once the dashboard receives a snapshot.</EmptyState>
        ) : (
          <canvas
            ref={canvasRef}
            className="heatmap-canvas"
            data-testid="heatmap-canvas"
            style={{ height: layout.height, width: layout.cols * (layout.cell + 1) }}
            tabIndex={0}
            role="img"
            aria-label={`KV cache blocks: ${model.counts.used} in use, ${model.counts.shared} shared, ${model.counts.cached} cached, ${model.counts.free} free. Arrow keys move between blocks, Enter selects the owning request.`}
            onMouseMove={(e) => {
              const b = blockAt(e);
              setCursor(b === null ? null : { block: b, x: e.clientX, y: e.clientY });
            }}
            onMouseLeave={() => setCursor(null)}
            onClick={(e) => {
              const b = blockAt(e);
              const owner = b !== null ? model.primary[b] : null;
              select(owner === null || owner === undefined || owner === selected ? null : owner);
            }}
            onKeyDown={onKey}
            onBlur={() => setCursor((c) => (c?.x === null ? null : c))}
          />
        )}
      </div>
      <div className="heatmap-counts" aria-live="off">
        <span><b>{fmtInt(model.counts.used)}</b> used</span>
        <span><b>{fmtInt(model.counts.shared)}</b> shared</span>
        <span><b>{fmtInt(model.counts.cached)}</b> cached</span>
        <span><b>{fmtInt(model.counts.free)}</b> free</span>
      </div>
      {cursor !== null && cursor.block < n && <BlockTooltip model={model} block={cursor.block} cursor={cursor} />}
      {selectedRequest !== undefined && (
        <div className="block-table" data-testid="block-table" aria-label={`Block table of ${selected}`}>
          <div className="block-table-title">
            <span className="swatch" style={{ background: liveRequestColor(state.timelines, selectedRequest.request_id, getPalette().dark) }} />
            Block table of <b>{selectedRequest.request_id}</b> <span className="muted">(logical → physical)</span>
          </div>
          {selectedRequest.seqs.length === 0 && <div className="muted">No sequences hold blocks (finished or not started).</div>}
          {selectedRequest.seqs.map((s) => (
            <div key={s.seq_id} className="block-table-row" data-testid={`block-table-seq-${s.seq_id}`}>
              <span className="muted">seq {s.seq_id}{s.parent_seq_id !== null ? ` (fork of ${s.parent_seq_id})` : ""} · {s.num_tokens} tok</span>
              <span className="block-chips">
                {s.block_table.length === 0 && <span className="muted">empty</span>}
                {s.block_table.map((b, i) => (
                  <button
                    type="button"
                    key={i}
                    className="block-chip"
                    onMouseEnter={() => setCursor({ block: b, x: null, y: null })}
                    onFocus={() => setCursor({ block: b, x: null, y: null })}
                    onMouseLeave={() => setCursor(null)}
                    title={`logical ${i} → physical ${b}`}
                  >
                    {i}→{b}
                  </button>
                ))}
              </span>
            </div>
          ))}
        </div>
      )}
      <pre className="visually-hidden" data-testid="heatmap-summary" ref={summaryRef} />
    </Card>
  );
}

function BlockTooltip(props: { model: BlockModel; block: number; cursor: Cursor }) {
  const { store } = useDashboard();
  const b = props.block;
  const block = store.state.engine.blocks[b];
  if (block === undefined) return null;
  const owners = blockOwners(store.state.engine, b);
  const kind = props.model.kind[b];
  const evicted = store.state.evictedAt[b];
  const restored = store.state.restoredAt[b];
  const kindText = kind === KIND_FREE ? "free" : kind === KIND_CACHED ? "cached, free (reusable by a prefix hit)" : kind === KIND_SHARED ? "in use, shared" : "in use";
  const style = props.cursor.x !== null && props.cursor.y !== null ? tooltipPosition(props.cursor.x, props.cursor.y) : undefined;
  return (
    <div className={`tooltip ${style ? "" : "tooltip-static"}`} data-testid="heatmap-tooltip" role="tooltip" style={style} data-block={b}>
      <div className="tooltip-title">Block {b}</div>
      <div>ref count <b>{block.ref_count}</b> · {kindText}</div>
      {kind !== KIND_FREE && <div>tokens {Math.round(props.model.fill[b]! * props.model.blockSize)}/{props.model.blockSize}</div>}
      <div className="mono">hash {block.block_hash ?? "–"}</div>
      {owners.length > 0 && (
        <div>
          owners:
          <ul className="tooltip-list">
            {owners.slice(0, 8).map((o) => (
              <li key={`${o.request_id}/${o.seq_id}/${o.logical}`}>{o.request_id} · seq {o.seq_id} · logical {o.logical}</li>
            ))}
            {owners.length > 8 && <li>… {owners.length - 8} more</li>}
          </ul>
        </div>
      )}
      {evicted !== undefined && !Number.isNaN(evicted) && <div className="muted">last evicted {fmtSeconds(store.now() - evicted)} ago</div>}
      {restored !== undefined && !Number.isNaN(restored) && <div className="muted">read back from disk {fmtSeconds(store.now() - restored)} ago</div>}
    </div>
  );
}
