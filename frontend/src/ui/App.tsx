// The app shell: header (mode, record, connection, theme), the playground sidebar (chat, load
// generator, engine settings) and the main area (the dashboard panels, fed by the live or the replay
// store, or Compare, which needs the width for its columns). On a phone the sidebar and the main area
// are two tabs, one at a time.
import { useCallback, useEffect, useMemo, useState } from "react";
import { listModels } from "../api/client";
import { defaultParams, type DecodingParams } from "../core/openai";
import { speculativeName, speculativeShort } from "../core/spec";
import { weightsSummary } from "../core/weights";
import { frameLoop } from "../live/frameLoop";
import { ReplayController } from "../live/replayController";
import { LiveConnection } from "../live/socket";
import { DashboardStore } from "../live/store";
import { ChatPanel } from "./chat/ChatPanel";
import { findRequest } from "./chat/chatState";
import { ComparePanel } from "./chat/ComparePanel";
import { Card } from "./components/Card";
import { Tabs, type TabDef } from "./components/Tabs";
import { ThemeToggle } from "./components/ThemeToggle";
import { DashboardContext, type DashboardContextValue, type ViewMode } from "./context";
import { DashboardPanels } from "./Dashboard";
import { useStoreSelector } from "./hooks";
import { ConnectionBadge } from "./panels/ConnectionBadge";
import { ReplicasPanel } from "./panels/ReplicasPanel";
import { LoadGenPanel } from "./panels/LoadGenPanel";
import { RecordButton } from "./panels/RecordButton";
import { ReplayBar } from "./panels/ReplayBar";
import { SettingsPanel } from "./panels/SettingsPanel";
import { StressPage } from "./stress/StressPage";
import { NARROW_QUERY, useMediaQuery } from "./useMediaQuery";

type Tab = "chat" | "loadgen" | "settings";
const TABS: TabDef<Tab>[] = [
  { id: "chat", label: "Chat" },
  { id: "loadgen", label: "Load" },
  { id: "settings", label: "Engine" },
];

/** What the main area shows. */
type View = "dashboard" | "compare";
const VIEWS: TabDef<View>[] = [
  { id: "dashboard", label: "Dashboard" },
  { id: "compare", label: "Compare" },
];

/** On a phone, which half of the page is shown: the playground sidebar or the main area. */
type Pane = "chat" | "dashboard";
const PANES: TabDef<Pane>[] = [
  { id: "chat", label: "Chat" },
  { id: "dashboard", label: "Dashboard" },
];
const PANE_ELEMENT: Record<Pane, string> = { chat: "playground", dashboard: "main-area" };

export function App() {
  const stress = new URLSearchParams(location.search).get("stress");
  if (stress !== null && stress !== "0") return <StressPage />;
  return <Main />;
}

export { findRequest };

function Main() {
  const [liveStore] = useState(() => new DashboardStore());
  const [replayStore] = useState(() => new DashboardStore());
  const [connection] = useState(() => new LiveConnection(liveStore));
  const [replay] = useState(() => new ReplayController(replayStore));
  const [mode, setMode] = useState<ViewMode>("live");
  const [selected, setSelected] = useState<string | null>(null);
  const [tab, setTab] = useState<Tab>("chat");
  const [view, setView] = useState<View>("dashboard");
  const [pane, setPane] = useState<Pane>("chat");
  const narrow = useMediaQuery(NARROW_QUERY);
  // Bumped to scroll the timeline into view once the dashboard it is in is shown again.
  const [timelineScroll, setTimelineScroll] = useState(0);
  const [params, setParams] = useState<DecodingParams>(defaultParams);
  const [model, setModel] = useState<string | null>(null);
  const [recordingsKey, setRecordingsKey] = useState(0);
  const [notice, setNotice] = useState<string | null>(null);
  const config = useStoreSelector(liveStore, (s) => s.engine.config);
  const lastSeq = useStoreSelector(liveStore, (s) => s.engine.seq);

  useEffect(() => {
    const detach = [frameLoop.addStore(liveStore), frameLoop.addStore(replayStore)];
    connection.start();
    return () => {
      connection.stop();
      detach.forEach((d) => d());
    };
  }, [liveStore, replayStore, connection]);

  useEffect(() => {
    listModels().then((m) => setModel(m[0]?.id ?? null)).catch(() => setModel(null));
  }, [config.model]);

  useEffect(() => {
    if (notice === null) return;
    const t = setTimeout(() => setNotice(null), 4000);
    return () => clearTimeout(t);
  }, [notice]);

  useEffect(() => {
    if (timelineScroll === 0) return;
    document.querySelector(`[data-testid="timeline-panel"]`)?.scrollIntoView?.({ behavior: "smooth", block: "start" });
  }, [timelineScroll]);

  const showRequest = useCallback((candidates: string[]): boolean => {
    const id = findRequest(liveStore.state.engine.requests.keys(), candidates);
    if (id === null) {
      setNotice(`Request ${candidates[0] ?? ""} is not in the live engine state (yet).`);
      return false;
    }
    setMode("live");
    setSelected(id);
    setView("dashboard");
    setPane("dashboard");
    setTimelineScroll((n) => n + 1);
    return true;
  }, [liveStore]);

  const ctx: DashboardContextValue = useMemo(() => ({
    store: mode === "live" ? liveStore : replayStore,
    mode,
    selected,
    select: setSelected,
    watchStepProfile: connection.watchStepProfile,
  }), [mode, selected, liveStore, replayStore, connection]);

  return (
    <DashboardContext.Provider value={ctx}>
      <div className="app">
        <header className="topbar">
          <div className="brand">
            <span className="logo" aria-hidden="true">▦</span>
            <span className="brand-name">mini-vllm</span>
            <span className="brand-model muted" data-testid="engine-model" title={config.model ? `${config.model} · ${config.dtype} on ${config.device}` : undefined}>
              {config.model ? `${config.model} · ${config.num_blocks} blocks × ${config.block_size}` : "no engine yet"}
            </span>
            {config.model && (
              <span className="brand-precision muted" data-testid="engine-precision" title={`Weights: ${weightsSummary(config, false)} (fixed at load)`}>
                {weightsSummary(config)}
              </span>
            )}
            {config.model && (
              <span className="brand-precision muted" data-testid="engine-speculative" title={`Speculative decoding: ${speculativeName(config)} (fixed at start-up)`}>
                spec {speculativeShort(config)}
              </span>
            )}
          </div>
          <div className="segmented" role="group" aria-label="View">
            <button type="button" aria-pressed={mode === "live"} data-testid="mode-live" onClick={() => setMode("live")}>Live</button>
            <button type="button" aria-pressed={mode === "replay"} data-testid="mode-replay" onClick={() => setMode("replay")}>Replay</button>
          </div>
          <span className="grow" />
          <RecordButton onStopped={() => setRecordingsKey((k) => k + 1)} />
          <ConnectionBadge connection={connection} mode={mode} lastSeq={lastSeq} />
          <ThemeToggle />
        </header>
        {notice && <div className="notice" role="status" data-testid="notice">{notice}</div>}
        {narrow && <Tabs label="Page" prefix="pane" tabs={PANES} value={pane} onChange={setPane} panelId={(p) => PANE_ELEMENT[p]} className="pane-tabs" />}
        <div className="layout">
          <aside className="sidebar" id={PANE_ELEMENT.chat} aria-label="Playground" hidden={narrow && pane !== "chat"}>
            <Tabs label="Playground tools" prefix="tab" tabs={TABS} value={tab} onChange={setTab} panelId={(t) => `tabpanel-${t}`} />
            <div className="tabpanel" role="tabpanel" id="tabpanel-chat" aria-labelledby="tab-chat" hidden={tab !== "chat"}>
              <ChatPanel model={model} params={params} setParams={setParams} onShowRequest={showRequest} engine={liveStore} />
            </div>
            <div className="tabpanel scroll" role="tabpanel" id="tabpanel-loadgen" aria-labelledby="tab-loadgen" hidden={tab !== "loadgen"}>
              <LoadGenPanel />
            </div>
            <div className="tabpanel scroll" role="tabpanel" id="tabpanel-settings" aria-labelledby="tab-settings" hidden={tab !== "settings"}>
              <SettingsPanel liveConfig={config.model ? config : null} />
            </div>
          </aside>
          <main className="main" id={PANE_ELEMENT.dashboard} aria-label="Engine dashboard" hidden={narrow && pane !== "dashboard"}>
            <Tabs label="Main view" prefix="tab" tabs={VIEWS} value={view} onChange={setView} panelId={(v) => `tabpanel-${v}`} className="view-tabs" />
            {/* Both views stay mounted: a comparison keeps streaming, and the panels keep their filters. */}
            <div className="view" role="tabpanel" id="tabpanel-dashboard" aria-labelledby="tab-dashboard" hidden={view !== "dashboard"}>
              {mode === "replay" && <ReplayBar controller={replay} refreshKey={recordingsKey} />}
              {mode === "live" && <ReplicasPanel onFollow={(r) => connection.restart(`following replica ${r}`)} />}
              <DashboardPanels />
            </div>
            <div className="view" role="tabpanel" id="tabpanel-compare" aria-labelledby="tab-compare" hidden={view !== "compare"}>
              <Card title="Compare decoding strategies" subtitle="one prompt, 2–4 strategies, run at the same time" className="compare-card">
                <ComparePanel model={model} onShowRequest={showRequest} engine={liveStore} />
              </Card>
            </div>
          </main>
        </div>
      </div>
    </DashboardContext.Provider>
  );
}
