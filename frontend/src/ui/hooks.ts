// React glue: subscribe to stores at the UI rate, and canvases drawn by the frame loop.
import { useEffect, useRef, useState, useSyncExternalStore } from "react";
import type { DashboardState } from "../core/dashboard";
import { frameLoop } from "../live/frameLoop";
import type { DashboardStore } from "../live/store";
import { paletteVersion } from "./theme";

/** The store's state as published to React (at most every UI_INTERVAL_MS). */
export function useDashboardState(store: DashboardStore): DashboardState {
  return useSyncExternalStore(store.subscribe, store.getUiState, store.getUiState);
}

/** Like useDashboardState, at most every `intervalMs` (for heavy DOM tables), with a trailing update. */
export function useThrottledDashboardState(store: DashboardStore, intervalMs: number): DashboardState {
  const [seen, setSeen] = useState(() => ({ store, state: store.getUiState() }));
  useEffect(() => {
    let last = 0;
    let timer: ReturnType<typeof setTimeout> | null = null;
    const update = () => {
      timer = null;
      last = performance.now();
      setSeen({ store, state: store.getUiState() });
    };
    const unsubscribe = store.subscribe(() => {
      if (timer === null) timer = setTimeout(update, Math.max(0, intervalMs - (performance.now() - last)));
    });
    return () => {
      unsubscribe();
      if (timer !== null) clearTimeout(timer);
    };
  }, [store, intervalMs]);
  // switching stores (live <-> replay) shows the new one at once
  return seen.store === store ? seen.state : store.getUiState();
}

export interface CanvasSize {
  width: number;
  height: number;
  dpr: number;
}

export interface CanvasDrawer {
  /** Draws the whole canvas (it is opaque: paint the background first); return true to be called
   * again next frame even if `key` is unchanged (animation). */
  draw: (ctx: CanvasRenderingContext2D, size: CanvasSize, now: number) => boolean;
  /** Values that, when any changes, require a redraw. */
  key: () => readonly unknown[];
}

/**
 * A canvas sized to its CSS box (device pixels) and drawn by the frame loop when `key()` changes,
 * the size or theme changes, or the last draw asked to animate. The latest drawer is always used.
 */
export function useCanvas(drawer: CanvasDrawer): (el: HTMLCanvasElement | null) => void {
  // A callback ref: the canvas may mount after the component (e.g. once the first snapshot arrives).
  const [canvas, setCanvas] = useState<HTMLCanvasElement | null>(null);
  const latest = useRef(drawer);
  useEffect(() => {
    latest.current = drawer;
  });
  useEffect(() => (canvas === null ? undefined : attachCanvas(canvas, latest)), [canvas]);
  return setCanvas;
}

/** Sizes `canvas` to its box and draws it from the frame loop; returns the cleanup. */
function attachCanvas(canvas: HTMLCanvasElement, latest: { readonly current: CanvasDrawer }): (() => void) | undefined {
  let ctx: CanvasRenderingContext2D | null;
  try {
    ctx = canvas.getContext("2d", { alpha: false });
  } catch {
    ctx = null; // jsdom: "not implemented"
  }
  if (ctx === null) return undefined; // no canvas support (tests): nothing to draw
  const context = ctx;
  const size: CanvasSize = { width: 0, height: 0, dpr: 1 };
  let dirty = true;
  let animating = false;
  let lastKey: readonly unknown[] = [];
  let lastPalette = -1;
  const measure = () => {
    const rect = canvas.getBoundingClientRect();
    const dpr = Math.min(2, window.devicePixelRatio || 1);
    const w = Math.max(1, Math.round(rect.width));
    const h = Math.max(1, Math.round(rect.height));
    if (w !== size.width || h !== size.height || dpr !== size.dpr) {
      size.width = w;
      size.height = h;
      size.dpr = dpr;
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
      dirty = true;
    }
  };
  measure();
  const observer = typeof ResizeObserver === "function" ? new ResizeObserver(measure) : null;
  observer?.observe(canvas);
  // Canvases scrolled out of view are not drawn (and are redrawn when they come back).
  let visible = true;
  const io = typeof IntersectionObserver === "function"
    ? new IntersectionObserver((entries) => {
        for (const e of entries) {
          visible = e.isIntersecting;
          if (visible) dirty = true;
        }
      })
    : null;
  io?.observe(canvas);
  const stop = frameLoop.addDrawer((now) => {
    if (!visible) return;
    const key = latest.current.key();
    const pv = paletteVersion();
    if (!dirty && !animating && pv === lastPalette && sameKey(key, lastKey)) return;
    lastKey = key;
    lastPalette = pv;
    dirty = false;
    context.setTransform(size.dpr, 0, 0, size.dpr, 0, 0);
    animating = latest.current.draw(context, size, now);
  });
  return () => {
    stop();
    observer?.disconnect();
    io?.disconnect();
  };
}

function sameKey(a: readonly unknown[], b: readonly unknown[]): boolean {
  if (a.length !== b.length) return false;
  for (let i = 0; i < a.length; i++) if (!Object.is(a[i], b[i])) return false;
  return true;
}

/**
 * Runs `fn` when the store publishes to React (the UI rate), in the frame loop: for DOM text that
 * mirrors a canvas, written directly instead of through React.
 */
export function usePublishedState(store: DashboardStore, fn: (state: DashboardState) => void): void {
  const latest = useRef(fn);
  useEffect(() => {
    latest.current = fn;
  });
  useEffect(() => {
    let last: DashboardState | null = null;
    return frameLoop.addDrawer(() => {
      const s = store.getUiState();
      if (s === last) return;
      last = s;
      latest.current(s);
    });
  }, [store]);
}

/** A slice of the store's UI state; re-renders only when the slice changes (Object.is). */
export function useStoreSelector<T>(store: DashboardStore, select: (s: DashboardState) => T): T {
  const get = () => select(store.getUiState());
  return useSyncExternalStore(store.subscribe, get, get);
}

/** Runs async actions one at a time with `busy` and `error` state (buttons disable while busy). */
export function useBusyAction(): {
  busy: boolean;
  error: string | null;
  setError: (message: string | null) => void;
  run: (fn: () => Promise<void>) => Promise<void>;
} {
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState<string | null>(null);
  const run = async (fn: () => Promise<void>) => {
    setBusy(true);
    setError(null);
    try {
      await fn();
    } catch (err) {
      setError((err as Error).message);
    } finally {
      setBusy(false);
    }
  };
  return { busy, error, setError, run };
}
