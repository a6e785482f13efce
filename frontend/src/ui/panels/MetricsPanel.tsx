// Metrics: live time series (throughput, running / waiting, KV usage, prefix-cache hit rate,
// preemptions, the server's RSS, speculative decoding's acceptance) and TTFT / TPOT distributions,
// all drawn on plain canvas; the RSS's split by part from the latest sample (MemorySection).
import { useMemo, useState } from "react";
import type { DashboardState } from "../../core/dashboard";
import { fmtInt, fmtPct, fmtRate, fmtSeconds, fmtTick, niceTicks } from "../../core/format";
import { ringItems, ringLast } from "../../core/ring";
import { specInterval, specSummary, speculativeName, type SpecSummary } from "../../core/spec";
import { histogram, summary } from "../../core/stats";
import type { MetricsSample } from "../../core/wire";
import { Card, EmptyState } from "../components/Card";
import { Select } from "../components/fields";
import { useDashboard } from "../context";
import { DiskTierSection } from "./DiskTierSection";
import { MemorySection } from "./MemorySection";
import { useCanvas, useThrottledDashboardState } from "../hooks";
import { getPalette, type Palette } from "../theme";

interface Series {
  name: string;
  color: (p: Palette) => string;
  values: (m: MetricsSample, prev: MetricsSample | undefined) => number;
}

interface ChartSpec {
  id: string;
  title: string;
  series: Series[];
  format: (v: number) => string;
  yMax?: number;
}

const CHARTS: ChartSpec[] = [
  {
    id: "throughput",
    title: "Throughput (tok/s)",
    format: (v) => fmtTick(v),
    series: [
      { name: "generation", color: (p) => p.series[0]!, values: (m) => m.generation_throughput },
      { name: "prompt", color: (p) => p.series[1]!, values: (m) => m.prompt_throughput },
    ],
  },
  {
    id: "queue",
    title: "Running / waiting",
    format: (v) => fmtTick(v),
    series: [
      { name: "running", color: (p) => p.series[0]!, values: (m) => m.num_running },
      { name: "waiting", color: (p) => p.series[2]!, values: (m) => m.num_waiting },
    ],
  },
  {
    id: "kv",
    title: "KV cache usage (%)",
    format: (v) => `${fmtTick(v)}%`,
    yMax: 100,
    series: [{ name: "in use", color: (p) => p.series[1]!, values: (m) => m.kv_usage * 100 }],
  },
  {
    id: "hit-rate",
    title: "Prefix-cache hit rate (%)",
    format: (v) => `${fmtTick(v)}%`,
    yMax: 100,
    series: [
      {
        name: "hits / lookups",
        color: (p) => p.series[0]!,
        values: (m, prev) => {
          const dq = m.prefix_cache_queries - (prev?.prefix_cache_queries ?? 0);
          const dh = m.prefix_cache_hits - (prev?.prefix_cache_hits ?? 0);
          return dq > 0 ? (100 * dh) / dq : NaN;
        },
      },
    ],
  },
  {
    id: "preemptions",
    title: "Preemptions (total)",
    format: (v) => fmtTick(v),
    series: [{ name: "preemptions", color: (p) => p.series[3]!, values: (m) => m.num_preemptions }],
  },
  {
    id: "rss",
    title: "Server memory (RSS, MiB)",
    format: (v) => fmtTick(v),
    // 0 / absent: the server could not read it (or an older recording): no point rather than a dip
    series: [{ name: "resident", color: (p) => p.series[2]!, values: (m) => (m.rss_bytes ? m.rss_bytes / 2 ** 20 : NaN) }],
  },
];

/** Shown while speculative decoding is on (or drafts were ever verified): overall (the cumulative
 * counters) and per sample interval (gaps where nothing was verified). */
const SPEC_CHARTS: ChartSpec[] = [
  {
    id: "spec-acceptance",
    title: "Draft acceptance (%)",
    format: (v) => `${fmtTick(v)}%`,
    yMax: 100,
    series: [
      { name: "overall", color: (p) => p.series[2]!, values: (m) => (specSummary(m)?.acceptanceRate ?? NaN) * 100 },
      { name: "per interval", color: (p) => p.series[0]!, values: (m, prev) => specInterval(m, prev).acceptanceRate * 100 },
    ],
  },
  {
    id: "spec-accepted-length",
    title: "Accepted drafts per verify",
    format: (v) => fmtTick(v),
    series: [
      { name: "overall", color: (p) => p.series[2]!, values: (m) => specSummary(m)?.meanAccepted ?? NaN },
      { name: "per interval", color: (p) => p.series[0]!, values: (m, prev) => specInterval(m, prev).meanAccepted },
    ],
  },
];

type Span = "60" | "300" | "900" | "all";
const SPANS: { value: Span; label: string }[] = [
  { value: "60", label: "1 min" },
  { value: "300", label: "5 min" },
  { value: "900", label: "15 min" },
  { value: "all", label: "All" },
];

const PAD = { l: 40, r: 8, t: 8, b: 18 };

function drawAxes(ctx: CanvasRenderingContext2D, w: number, h: number, x0: number, x1: number, ymax: number, origin: number, p: Palette, fmtY: (v: number) => string): { x: (t: number) => number; y: (v: number) => number } {
  const x = (t: number) => PAD.l + ((t - x0) / Math.max(1e-9, x1 - x0)) * (w - PAD.l - PAD.r);
  const y = (v: number) => h - PAD.b - (v / Math.max(1e-9, ymax)) * (h - PAD.t - PAD.b);
  ctx.font = "10px ui-sans-serif, system-ui, sans-serif";
  ctx.fillStyle = p.muted;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (const v of niceTicks(0, ymax, 3)) {
    ctx.fillStyle = p.grid;
    ctx.fillRect(PAD.l, Math.round(y(v)), w - PAD.l - PAD.r, 1);
    ctx.fillStyle = p.muted;
    ctx.fillText(fmtY(v), PAD.l - 4, y(v));
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  for (const t of niceTicks(x0 - origin, x1 - origin, Math.max(2, Math.floor(w / 80)))) {
    ctx.fillText(`${fmtTick(t)}s`, x(t + origin), h - PAD.b + 4);
  }
  return { x, y };
}

function TimeChart(props: { spec: ChartSpec; span: Span }) {
  const { store } = useDashboard();
  const { spec, span } = props;
  const ref = useCanvas({
    key: () => [store.state.metrics, span, store.live ? Math.floor(store.now()) : store.now()],
    draw: (ctx, size) => {
      const p = getPalette();
      const st = store.state;
      const now = store.now();
      const samples = ringItems(st.metrics).filter((m) => (m.ts ?? 0) <= now + 1e-9);
      const x1 = Math.max(now, st.originTs + 1);
      // never wider than the data: a fresh session fills the chart instead of hugging its right edge
      const first = samples.length > 0 ? Math.min(samples[0]!.ts ?? x1, x1 - 10) : x1 - 10;
      const x0 = span === "all" ? Math.min(st.originTs, first) : Math.max(x1 - Number(span), first);
      ctx.fillStyle = p.panel; // opaque canvases: cheaper to composite
      ctx.fillRect(0, 0, size.width, size.height);
      const visible: { t: number; v: number[] }[] = [];
      for (let i = 0; i < samples.length; i++) {
        const m = samples[i]!;
        const t = m.ts ?? 0;
        if (t < x0 && i + 1 < samples.length && (samples[i + 1]!.ts ?? 0) < x0) continue;
        visible.push({ t, v: spec.series.map((s) => s.values(m, samples[i - 1])) });
      }
      let ymax = spec.yMax ?? 0;
      if (spec.yMax === undefined) {
        for (const pt of visible) for (const v of pt.v) if (Number.isFinite(v)) ymax = Math.max(ymax, v);
        ymax = ymax <= 0 ? 1 : ymax * 1.1;
      }
      const { x, y } = drawAxes(ctx, size.width, size.height, x0, x1, ymax, st.originTs, p, spec.format);
      ctx.save();
      ctx.beginPath();
      ctx.rect(PAD.l, 0, size.width - PAD.l - PAD.r, size.height);
      ctx.clip();
      spec.series.forEach((s, k) => {
        ctx.strokeStyle = s.color(p);
        ctx.lineWidth = 1.5;
        ctx.beginPath();
        let pen = false;
        visible.forEach((pt) => {
          const v = pt.v[k]!;
          if (!Number.isFinite(v)) {
            pen = false;
            return;
          }
          if (pen) ctx.lineTo(x(pt.t), y(v));
          else ctx.moveTo(x(pt.t), y(v));
          pen = true;
        });
        ctx.stroke();
        // a value with a gap on both sides draws no line: a dot instead
        ctx.fillStyle = s.color(p);
        visible.forEach((pt, i) => {
          const v = pt.v[k]!;
          if (Number.isFinite(v) && !Number.isFinite(visible[i - 1]?.v[k] ?? NaN) && !Number.isFinite(visible[i + 1]?.v[k] ?? NaN)) {
            ctx.fillRect(x(pt.t) - 1.5, y(v) - 1.5, 3, 3);
          }
        });
      });
      ctx.restore();
      return false;
    },
  });
  return (
    <figure className="chart" data-testid={`chart-${spec.id}`}>
      <figcaption>
        {spec.title}
        {spec.series.length > 1 && (
          <span className="chart-keys">
            {spec.series.map((s) => (
              <span key={s.name}><i style={{ background: s.color(getPalette()) }} />{s.name}</span>
            ))}
          </span>
        )}
      </figcaption>
      <canvas ref={ref} className="chart-canvas" role="img" aria-label={`${spec.title} over time`} />
    </figure>
  );
}

type Summary = ReturnType<typeof summary>;

function HistogramChart(props: { id: string; title: string; values: number[]; stats: Summary; color: (p: Palette) => string }) {
  const { values, stats } = props;
  const ref = useCanvas({
    key: () => [values],
    draw: (ctx, size) => {
      const p = getPalette();
      ctx.fillStyle = p.panel; // opaque canvases: cheaper to composite
      ctx.fillRect(0, 0, size.width, size.height);
      const h = histogram(values, 24);
      if (h.counts.length === 0) return false;
      const top = h.edges[h.edges.length - 1]!;
      const { x, y } = drawAxesHist(ctx, size.width, size.height, top, h.max, p);
      ctx.fillStyle = props.color(p);
      h.counts.forEach((c, i) => {
        if (c === 0) return;
        const xa = x(h.edges[i]!);
        const xb = x(h.edges[i + 1]!);
        ctx.fillRect(xa + 0.5, y(c), Math.max(1, xb - xa - 1), y(0) - y(c));
      });
      for (const [q, v] of [["p50", stats.p50], ["p90", stats.p90]] as const) {
        if (v === null || v > top) continue;
        ctx.fillStyle = p.text;
        ctx.fillRect(Math.round(x(v)), PAD.t, 1, size.height - PAD.t - PAD.b);
        ctx.font = "10px ui-sans-serif, system-ui, sans-serif";
        ctx.textAlign = "left";
        ctx.textBaseline = "top";
        ctx.fillText(q, x(v) + 3, PAD.t);
      }
      return false;
    },
  });
  return (
    <figure className="chart" data-testid={`chart-${props.id}`}>
      <figcaption>
        {props.title}
        <span className="chart-keys muted">
          {stats.n > 0 ? `p50 ${fmtSeconds(stats.p50)} · p90 ${fmtSeconds(stats.p90)} · p99 ${fmtSeconds(stats.p99)} · n=${stats.n}` : "no finished requests"}
        </span>
      </figcaption>
      <canvas ref={ref} className="chart-canvas" role="img" aria-label={`${props.title} histogram`} />
    </figure>
  );
}

function drawAxesHist(ctx: CanvasRenderingContext2D, w: number, h: number, top: number, maxCount: number, p: Palette) {
  const x = (v: number) => PAD.l + (v / Math.max(1e-9, top)) * (w - PAD.l - PAD.r);
  const y = (c: number) => h - PAD.b - (c / Math.max(1, maxCount)) * (h - PAD.t - PAD.b);
  ctx.font = "10px ui-sans-serif, system-ui, sans-serif";
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (const c of niceTicks(0, maxCount, 3)) {
    ctx.fillStyle = p.grid;
    ctx.fillRect(PAD.l, Math.round(y(c)), w - PAD.l - PAD.r, 1);
    ctx.fillStyle = p.muted;
    ctx.fillText(fmtTick(c), PAD.l - 4, y(c));
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  for (const v of niceTicks(0, top, Math.max(2, Math.floor(w / 80)))) ctx.fillText(fmtSeconds(v, 1), x(v), h - PAD.b + 4);
  return { x, y };
}

function kpis(state: DashboardState) {
  const last = ringLast(state.metrics);
  const hitRate = last && last.prefix_cache_queries > 0 ? last.prefix_cache_hits / last.prefix_cache_queries : null;
  return { last, hitRate, spec: specSummary(last) };
}

/** Speculative decoding's totals: acceptance, accepted drafts per verify, tokens per verify step, and
 * acceptance by draft position; or a line saying it is off (or has verified nothing yet). */
export function SpecMetrics(props: { spec: SpecSummary | null; setup: string | null | undefined }) {
  const { spec } = props;
  if (spec === null) {
    const on = (props.setup?.trim() ?? "") !== "";
    return (
      <p className="spec-metrics muted small" data-testid="metrics-spec" data-state={on ? "idle" : "off"}>
        {on ? `Speculative decoding (${speculativeName({ speculative: props.setup })}): no drafts verified yet` : "Speculative decoding off"}
      </p>
    );
  }
  return (
    <div className="spec-metrics" data-testid="metrics-spec" data-state="on">
      <dl className="kpis kpis-spec">
        <div title="Accepted draft tokens / drafted tokens"><dt>Draft acceptance</dt><dd data-testid="metric-spec-acceptance">{fmtPct(spec.acceptanceRate)}</dd></div>
        <div title="Accepted draft tokens / verify steps"><dt>Accepted / verify</dt><dd data-testid="metric-spec-mean-accepted">{spec.meanAccepted.toFixed(2)}</dd></div>
        <div title="Accepted drafts + the target's own token, per verify step"><dt>Tokens / verify</dt><dd data-testid="metric-spec-tokens-per-step">{spec.tokensPerStep.toFixed(2)}</dd></div>
        <div title={`${fmtInt(spec.accepted)} of ${fmtInt(spec.draftTokens)} drafted tokens accepted`}><dt>Verify steps</dt><dd data-testid="metric-spec-drafts">{fmtInt(spec.drafts)}</dd></div>
      </dl>
      {spec.perPosition.length > 0 && (
        <p className="small muted" data-testid="metric-spec-per-position">
          Acceptance by draft position: {spec.perPosition.map((r, i) => `${i + 1}: ${fmtPct(r)}`).join(" · ")}
        </p>
      )}
    </div>
  );
}

export function MetricsPanel() {
  const { store } = useDashboard();
  const state = useThrottledDashboardState(store, 250);
  const [span, setSpan] = useState<Span>("300");
  const { last, hitRate, spec } = kpis(state);
  const setup = state.engine.config.speculative;
  const charts = spec !== null || (setup?.trim() ?? "") !== "" ? [...CHARTS, ...SPEC_CHARTS] : CHARTS;
  const latencies = state.latencies;
  const ttftValues = useMemo(() => ringItems(latencies).map((l) => l.ttft ?? NaN).filter(Number.isFinite), [latencies]);
  const tpotValues = useMemo(() => ringItems(latencies).map((l) => l.tpot ?? NaN).filter(Number.isFinite), [latencies]);
  // once per latency change, shared by the KPIs and the histograms
  const ttft = useMemo(() => summary(ttftValues), [ttftValues]);
  const tpot = useMemo(() => summary(tpotValues), [tpotValues]);
  const empty = last === undefined && ttft.n === 0;
  return (
    <Card
      className="card-lazy"
      title="Metrics"
      testId="metrics-panel"
      actions={<Select label="Chart span" hideLabel value={span} options={SPANS} onChange={setSpan} testId="metrics-span" />}
    >
      <dl className="kpis">
        <div><dt>Generation</dt><dd data-testid="metric-throughput">{fmtRate(last?.generation_throughput)}</dd></div>
        <div><dt>Running</dt><dd data-testid="metric-running">{fmtInt(last?.num_running)}</dd></div>
        <div><dt>Waiting</dt><dd data-testid="metric-waiting">{fmtInt(last?.num_waiting)}</dd></div>
        <div><dt>KV usage</dt><dd data-testid="metric-kv-usage">{fmtPct(last?.kv_usage)}</dd></div>
        <div><dt>Prefix hits</dt><dd data-testid="metric-hit-rate">{fmtPct(hitRate)}</dd></div>
        <div><dt>Preemptions</dt><dd data-testid="metric-preemptions">{fmtInt(last?.num_preemptions)}</dd></div>
        <div><dt>TTFT p50</dt><dd data-testid="metric-ttft-p50">{fmtSeconds(ttft.p50)}</dd></div>
        <div><dt>TPOT p50</dt><dd data-testid="metric-tpot-p50">{fmtSeconds(tpot.p50)}</dd></div>
      </dl>
      <SpecMetrics spec={spec} setup={setup} />
      <MemorySection split={last?.memory} />
      <DiskTierSection stats={last?.disk_tier} />
      {empty ? (
        <EmptyState title="No metrics yet" testId="metrics-empty">The engine samples its metrics while it works; charts fill in as requests run.</EmptyState>
      ) : (
        <div className="charts">
          {charts.map((c) => <TimeChart key={c.id} spec={c} span={span} />)}
          <HistogramChart id="ttft" title="TTFT distribution" values={ttftValues} stats={ttft} color={(p) => p.series[0]!} />
          <HistogramChart id="tpot" title="TPOT distribution" values={tpotValues} stats={tpot} color={(p) => p.series[1]!} />
        </div>
      )}
    </Card>
  );
}
