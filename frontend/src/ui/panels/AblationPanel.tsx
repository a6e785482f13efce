// Ablation: "Run ablation" starts `minivllm bench ablation --quick` on the server (POST /api/ablation,
// one run at a time, each configuration in a process of its own), polls its progress, and draws
// tokens/s per configuration as horizontal bars relative to "all on". Live mode only.
import { useEffect, useMemo, useState } from "react";
import { authHeaders, errorFrom } from "../../api/client";
import { Card, EmptyState } from "../components/Card";
import { useDashboard } from "../context";
import { useCanvas } from "../hooks";
import { getPalette, type Palette } from "../theme";

// The server's AblationStatus (server/ablation_api.py) and the rows of the benchmark's JSON report
// (bench/ablation.py): only the fields drawn here.
export interface AblationRow {
  config: string;
  tokens_per_s: number;
  ratio_tokens_per_s: number | null;
}
export interface AblationStatus {
  state: "unavailable" | "idle" | "running" | "done" | "failed";
  done: number;
  total: number;
  current: string | null;
  result: { rows: AblationRow[] } | null;
  error: string | null;
}

export interface AblationBar {
  label: string;
  tokensPerS: number;
  ratio: number; // to the first row ("all on")
  fraction: number; // of the longest bar, 0..1
}

const POLL_MS = 1000;
const ROW_H = 22;
const PAD = { l: 150, r: 64, t: 6 };

/** Rows -> bars: each row's tokens/s as a ratio to all on, and its length against the longest. */
export function ablationBars(rows: readonly AblationRow[]): AblationBar[] {
  const base = rows[0]?.tokens_per_s ?? 0;
  const top = Math.max(0, ...rows.map((r) => r.tokens_per_s));
  return rows.map((r) => ({
    label: r.config,
    tokensPerS: r.tokens_per_s,
    ratio: base > 0 ? r.tokens_per_s / base : 0,
    fraction: top > 0 ? r.tokens_per_s / top : 0,
  }));
}

export function progressLine(status: AblationStatus): string {
  if (status.state === "running") {
    return status.total > 0 ? `running ${status.done + 1}/${status.total}: ${status.current ?? ""}` : "starting…";
  }
  if (status.state === "failed") return `failed: ${status.error ?? "unknown error"}`;
  return status.state === "done" ? "done: tokens/s relative to all on" : "";
}

function drawBars(ctx: CanvasRenderingContext2D, w: number, h: number, bars: readonly AblationBar[], p: Palette): void {
  ctx.fillStyle = p.panel;
  ctx.fillRect(0, 0, w, h);
  ctx.font = "11px system-ui, sans-serif";
  ctx.textBaseline = "middle";
  const span = Math.max(1, w - PAD.l - PAD.r);
  bars.forEach((bar, i) => {
    const y = PAD.t + i * ROW_H;
    ctx.fillStyle = p.text;
    ctx.textAlign = "right";
    ctx.fillText(bar.label, PAD.l - 6, y + ROW_H / 2);
    ctx.fillStyle = i === 0 ? p.accent : (p.series[i % p.series.length] ?? p.accent);
    ctx.fillRect(PAD.l, y + 3, Math.max(1, bar.fraction * span), ROW_H - 6);
    ctx.fillStyle = p.muted;
    ctx.textAlign = "left";
    ctx.fillText(`${bar.ratio.toFixed(2)}×`, PAD.l + bar.fraction * span + 4, y + ROW_H / 2);
  });
}

async function call(method: "GET" | "POST"): Promise<AblationStatus> {
  const res = await fetch("/api/ablation", { method, headers: authHeaders() });
  if (!res.ok) throw await errorFrom(res);
  return (await res.json()) as AblationStatus;
}

function useAblation(): [AblationStatus | null, string | null, () => void] {
  const [status, setStatus] = useState<AblationStatus | null>(null);
  const [error, setError] = useState<string | null>(null);
  const running = status?.state === "running";
  useEffect(() => {
    if (!running) return undefined;
    const timer = setInterval(() => {
      call("GET").then(setStatus, (e: Error) => setError(e.message));
    }, POLL_MS);
    return () => clearInterval(timer);
  }, [running]);
  const start = () => {
    setError(null);
    call("POST").then(setStatus, (e: Error) => setError(e.message));
  };
  return [status, error, start];
}

function Bars(props: { bars: readonly AblationBar[] }) {
  const ref = useCanvas({
    key: () => [props.bars],
    draw: (ctx, size) => {
      drawBars(ctx, size.width, size.height, props.bars, getPalette());
      return false;
    },
  });
  return (
    <canvas
      ref={ref}
      className="chart-canvas ablation-canvas"
      role="img"
      aria-label={props.bars.map((b) => `${b.label} ${b.ratio.toFixed(2)}×`).join(", ")}
      data-testid="ablation-canvas"
      data-bars={props.bars.length}
      style={{ height: PAD.t * 2 + props.bars.length * ROW_H }}
    />
  );
}

export function AblationPanel() {
  const { mode } = useDashboard();
  const [status, error, start] = useAblation();
  const bars = useMemo(() => ablationBars(status?.result?.rows ?? []), [status]);
  if (mode !== "live") return null;
  const running = status?.state === "running";
  return (
    <Card
      title="Ablation"
      testId="ablation-panel"
      subtitle="each optimisation off in turn, quick workload, a process per configuration"
      actions={
        <button type="button" className="btn btn-small" data-testid="ablation-run" disabled={running} onClick={start}>
          {running ? "Running…" : "Run ablation"}
        </button>
      }
    >
      {status !== null && (
        <p className="small ablation-progress" data-testid="ablation-progress" data-state={status.state}>
          {progressLine(status)}
        </p>
      )}
      {error !== null && <p className="small ablation-error" role="alert">{error}</p>}
      {bars.length > 0 ? (
        <Bars bars={bars} />
      ) : (
        !running && <EmptyState title="No ablation yet">Runs for a minute or two: one model load per configuration.</EmptyState>
      )}
    </Card>
  );
}
