// Step profile: each recent engine step as a stacked bar of its parts against its roofline floors
// (memory: bytes read / bandwidth; compute: FLOPs / peak), and which wall the latest steps are at.
// Opening the panel asks the live server for profiles (the native part clocks run only then); a
// replay shows what the recording holds.
import { useEffect, useMemo, useState } from "react";
import { fmtMs } from "../../core/format";
import { chartTopMs, legendKeys, partColor, partLabel, profileBars, wallLine, wallSummary, type ProfileBar } from "../../core/stepProfile";
import { Card, EmptyState } from "../components/Card";
import { useDashboard } from "../context";
import { useCanvas, useThrottledDashboardState } from "../hooks";
import { getPalette, type Palette } from "../theme";

const MAX_BARS = 80;
const MEMORY_FLOOR_COLOR = "#e5534b";
const COMPUTE_FLOOR_COLOR = "#1f6feb";
const PAD = { l: 44, r: 8, t: 8, b: 18 };

function drawBars(ctx: CanvasRenderingContext2D, w: number, h: number, bars: readonly ProfileBar[], p: Palette): void {
  ctx.fillStyle = p.panel; // opaque canvases: cheaper to composite
  ctx.fillRect(0, 0, w, h);
  if (bars.length === 0) return;
  const top = chartTopMs(bars);
  const y = (ms: number) => h - PAD.b - (ms / top) * (h - PAD.t - PAD.b);
  const slot = (w - PAD.l - PAD.r) / MAX_BARS;
  const x0 = w - PAD.r - bars.length * slot; // newest at the right edge
  ctx.font = "10px system-ui, sans-serif";
  ctx.fillStyle = p.muted;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (const frac of [0, 0.5, 1]) {
    const ms = (top / 1.1) * frac;
    ctx.fillStyle = p.grid;
    ctx.fillRect(PAD.l, Math.round(y(ms)), w - PAD.l - PAD.r, 1);
    ctx.fillStyle = p.muted;
    ctx.fillText(fmtMs(ms), PAD.l - 4, y(ms));
  }
  bars.forEach((bar, i) => {
    const x = x0 + i * slot;
    let acc = 0;
    for (const part of bar.parts) {
      ctx.fillStyle = partColor(part.key);
      ctx.fillRect(x + 1, y(acc + part.ms), Math.max(1, slot - 2), y(acc) - y(acc + part.ms));
      acc += part.ms;
    }
    for (const [floor, color] of [
      [bar.memoryFloorMs, MEMORY_FLOOR_COLOR],
      [bar.computeFloorMs, COMPUTE_FLOOR_COLOR],
    ] as const) {
      if (floor <= 0) continue;
      ctx.fillStyle = color;
      ctx.fillRect(x, Math.round(y(floor)) - 1, slot, 2);
    }
  });
}

function Legend(props: { bars: readonly ProfileBar[] }) {
  const keys = legendKeys(props.bars);
  const floors = props.bars.some((b) => b.memoryFloorMs > 0 || b.computeFloorMs > 0);
  return (
    <ul className="legend" aria-label="Step profile legend" data-testid="step-profile-legend">
      {keys.map((k) => (
        <li key={k}><span className="legend-mark" style={{ background: partColor(k) }} aria-hidden="true" />{partLabel(k)}</li>
      ))}
      {floors && <li><span className="legend-mark" style={{ background: MEMORY_FLOOR_COLOR, height: 2 }} aria-hidden="true" />memory floor (bytes / bandwidth)</li>}
      {floors && <li><span className="legend-mark" style={{ background: COMPUTE_FLOOR_COLOR, height: 2 }} aria-hidden="true" />compute floor (FLOPs / peak)</li>}
    </ul>
  );
}

function ProfileChart() {
  const { store } = useDashboard();
  const state = useThrottledDashboardState(store, 250);
  const bars = useMemo(() => profileBars(state.stepTimes, MAX_BARS), [state.stepTimes]);
  const summary = useMemo(() => wallSummary(bars), [bars]);
  const ref = useCanvas({
    key: () => [bars],
    draw: (ctx, size) => {
      drawBars(ctx, size.width, size.height, bars, getPalette());
      return false;
    },
  });
  if (bars.length === 0) {
    return <EmptyState title="No steps yet" testId="step-profile-empty">Send a request: each engine step shows up as a bar.</EmptyState>;
  }
  const latest = bars[bars.length - 1]!;
  return (
    <>
      <p className="small" data-testid="step-profile-wall" data-wall={summary?.wall ?? ""}>{wallLine(summary)}</p>
      <canvas
        ref={ref}
        className="chart-canvas"
        role="img"
        aria-label="Recent steps by part, against their floors"
        data-testid="step-profile-canvas"
        data-bars={bars.length}
        data-source={latest.source}
        data-memory-floor={latest.memoryFloorMs}
        style={{ height: 160 }}
      />
      <Legend bars={bars} />
    </>
  );
}

export function StepProfilePanel() {
  const { mode, watchStepProfile } = useDashboard();
  const [open, setOpen] = useState(false);
  const live = mode === "live";
  useEffect(() => {
    if (!open || !live || watchStepProfile === undefined) return undefined;
    watchStepProfile(true);
    return () => watchStepProfile(false);
  }, [open, live, watchStepProfile]);
  return (
    <Card
      title="Step profile"
      testId="step-profile-panel"
      subtitle={open ? "each step's parts against its memory and compute floors" : "closed: steps carry no profile"}
      actions={
        <button type="button" className="btn btn-small" data-testid="step-profile-toggle" aria-expanded={open} onClick={() => setOpen(!open)}>
          {open ? "Close" : "Open"}
        </button>
      }
    >
      {open ? <ProfileChart /> : null}
    </Card>
  );
}
