// Dev stress page (?stress=1): a synthetic engine (64 concurrent requests, 2,000 blocks by default)
// feeds the real reducer and panels at a realistic event rate; frame times are reported in the DOM
// (data-testid="stress-fps") so a browser test can read them. URL knobs: rate (steps/s),
// concurrency, blocks, budget, seconds (auto-stop after that many seconds).
import { useEffect, useMemo, useRef, useState } from "react";
import { fromSnapshot } from "../../core/dashboard";
import { percentile } from "../../core/stats";
import { EngineSimulator } from "../../core/stress";
import { frameLoop } from "../../live/frameLoop";
import { DashboardStore } from "../../live/store";
import { ThemeToggle } from "../components/ThemeToggle";
import { DashboardContext, type DashboardContextValue } from "../context";
import { DashboardPanels } from "../Dashboard";

function num(params: URLSearchParams, key: string, fallback: number): number {
  const v = Number(params.get(key));
  return Number.isFinite(v) && v > 0 ? v : fallback;
}

export function StressPage() {
  const params = useMemo(() => new URLSearchParams(location.search), []);
  const [sim] = useState(() => new EngineSimulator({
    stepsPerSecond: num(params, "rate", 40),
    concurrency: num(params, "concurrency", 64),
    maxSeqs: num(params, "concurrency", 64),
    numBlocks: num(params, "blocks", 2000),
    budget: num(params, "budget", 2048),
  }));
  const [store] = useState(() => new DashboardStore(fromSnapshot(sim.snapshot())));
  const [selected, setSelected] = useState<string | null>(null);
  const [running, setRunning] = useState(true);
  const runningRef = useRef(true);
  const fpsRef = useRef<HTMLOutputElement | null>(null);

  useEffect(() => {
    runningRef.current = running;
  }, [running]);

  useEffect(() => {
    const limitS = num(params, "seconds", Infinity);
    let simClock = 0;
    let last = 0;
    let events = 0;
    const started = performance.now();
    const eventTimes: { t: number; n: number }[] = [];
    frameLoop.recordStats = true;
    frameLoop.stats.intervals.length = 0;
    frameLoop.stats.work.length = 0;
    const detachStore = frameLoop.addStore(store);
    const detachTask = frameLoop.addTask(() => {
      const now = performance.now();
      const dt = last === 0 ? 0 : Math.min(0.25, (now - last) / 1000);
      last = now;
      if (!runningRef.current || (now - started) / 1000 > limitS) return;
      simClock += dt;
      let produced = 0;
      // catch up with real time, but never more than a few steps in one frame
      for (let k = 0; k < 8 && sim.time < simClock; k++) {
        const batch = sim.step();
        produced += batch.length;
        store.push(batch);
      }
      if (sim.time < simClock - 1) simClock = sim.time; // fell far behind: do not try to catch up
      events += produced;
      eventTimes.push({ t: now, n: produced });
      while (eventTimes.length > 0 && eventTimes[0]!.t < now - 2000) eventTimes.shift();
    });
    const timer = setInterval(() => {
      const el = fpsRef.current;
      if (el === null) return;
      const intervals = frameLoop.stats.intervals.slice(-120);
      const work = frameLoop.stats.work.slice(-120);
      if (intervals.length < 2) return;
      const sorted = [...intervals].sort((a, b) => a - b);
      const mean = intervals.reduce((a, b) => a + b, 0) / intervals.length;
      const fps = 1000 / mean;
      const p50 = percentile(sorted, 0.5)!;
      const p95 = percentile(sorted, 0.95)!;
      const max = sorted[sorted.length - 1]!;
      const workP95 = percentile([...work].sort((a, b) => a - b), 0.95)!;
      const span = eventTimes.length > 1 ? (eventTimes[eventTimes.length - 1]!.t - eventTimes[0]!.t) / 1000 : 1;
      const evps = eventTimes.reduce((n, e) => n + e.n, 0) / Math.max(0.001, span);
      const st = store.state;
      let active = 0;
      for (const r of st.engine.requests.values()) if (r.state !== "FINISHED") active++;
      el.dataset.fps = fps.toFixed(1);
      el.dataset.p50Ms = p50.toFixed(2);
      el.dataset.p95Ms = p95.toFixed(2);
      el.dataset.maxMs = max.toFixed(2);
      el.dataset.workP95Ms = workP95.toFixed(2);
      el.dataset.eventsPerS = evps.toFixed(0);
      el.dataset.active = String(active);
      el.dataset.blocks = String(st.engine.blocks.length);
      el.dataset.totalEvents = String(events);
      el.textContent = `${fps.toFixed(1)} fps · p50 ${p50.toFixed(1)} ms · p95 ${p95.toFixed(1)} ms · work p95 ${workP95.toFixed(1)} ms · ${evps.toFixed(0)} ev/s · ${active} req · ${st.engine.blocks.length} blocks`;
      el.title = `frame interval max ${max.toFixed(0)} ms; work = fold + draw inside the frame loop`;
    }, 500);
    return () => {
      clearInterval(timer);
      detachTask();
      detachStore();
      frameLoop.recordStats = false;
    };
  }, [sim, store, params]);

  const ctx: DashboardContextValue = useMemo(() => ({ store, mode: "live", selected, select: setSelected }), [store, selected]);
  return (
    <DashboardContext.Provider value={ctx}>
      <div className="app stress">
        <header className="topbar">
          <div className="brand">
            <span className="logo" aria-hidden="true">▦</span>
            <span className="brand-name">mini-vllm</span>
            <span className="brand-model muted">stress test · synthetic engine · {sim.opts.concurrency} concurrent requests · {sim.opts.numBlocks} blocks · {sim.opts.stepsPerSecond} steps/s</span>
          </div>
          <span className="grow" />
          <output className="fps" data-testid="stress-fps" aria-live="off" ref={fpsRef}>measuring…</output>
          <button type="button" className="btn btn-small" data-testid="stress-toggle" aria-pressed={!running} onClick={() => setRunning(!running)}>{running ? "Pause" : "Resume"}</button>
          <a className="btn btn-small btn-ghost" href={location.pathname}>Exit</a>
          <ThemeToggle />
        </header>
        <main className="main main-full" aria-label="Engine dashboard (synthetic)">
          <DashboardPanels />
        </main>
      </div>
    </DashboardContext.Provider>
  );
}
