// The main panels, shared by the app and the stress page.
import { EventLogPanel, SchedulerPanel } from "./panels/SchedulerPanel";
import { HeatmapPanel } from "./panels/HeatmapPanel";
import { MetricsPanel } from "./panels/MetricsPanel";
import { RequestDetail } from "./panels/RequestDetail";
import { TimelinePanel } from "./panels/TimelinePanel";
import { StepProfilePanel } from "./panels/StepProfilePanel";
import { AblationPanel } from "./panels/AblationPanel";

export function DashboardPanels() {
  return (
    <div className="panels">
      <TimelinePanel />
      <div className="grid-2 grid-heatmap">
        <HeatmapPanel />
        <RequestDetail />
      </div>
      <MetricsPanel />
      <StepProfilePanel />
      <AblationPanel />
      <div className="grid-2">
        <SchedulerPanel />
        <EventLogPanel />
      </div>
    </div>
  );
}
