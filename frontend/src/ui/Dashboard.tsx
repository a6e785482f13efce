// The main panels, shared by the app and the stress page.
import { EventLogPanel, SchedulerPanel } from "./panels/SchedulerPanel";
import { HeatmapPanel } from "./panels/HeatmapPanel";
import { MetricsPanel } from "./panels/MetricsPanel";
import { RequestDetail } from "./panels/RequestDetail";
import { TimelinePanel } from "./panels/TimelinePanel";

export function DashboardPanels() {
  return (
    <div className="panels">
      <TimelinePanel />
      <div className="grid-2 grid-heatmap">
        <HeatmapPanel />
        <RequestDetail />
      </div>
      <MetricsPanel />
      <div className="grid-2">
        <SchedulerPanel />
        <EventLogPanel />
      </div>
    </div>
  );
}
