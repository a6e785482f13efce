// The app shell: header (mode, record, connection, theme), the playground sidebar (chat, compare,
// load generator, engine settings) and the dashboard panels, fed by the live or the replay store.
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
import { ThemeToggle } from "./components/ThemeToggle";
import { DashboardContext, type DashboardContextValue, type ViewMode } from "./context";
import { DashboardPanels } from "./Dashboard";
import { useStoreSelector } from "./hooks";
import { ConnectionBadge } from "./panels/ConnectionBadge";
import { LoadGenPanel } from "./panels/LoadGenPanel";
import { RecordButton } from "./panels/RecordButton";
import { ReplayBar } from "./panels/ReplayBar";
import { SettingsPanel } from "./panels/SettingsPanel";
import { StressPage } from "./stress/StressPage";

type Tab = "chat" | "compare" | "loadgen" | "settings";
const TABS: { id: Tab; label: string }[] = [
  { id: "chat", label: "Chat" },
  { id: "compare", label: "Compare" },
  { id: "loadgen", label: "Load" },
  { id: "settings", label: "Engine" },
];

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

  const showRequest = useCallback((candidates: string[]): boolean => {
    const id = findRequest(liveStore.state.engine.requests.keys(), candidates);
    if (id === null) {
      setNotice(`Request ${candidates[0] ?? ""} is not in the live engine state (yet).`);
      return false;
    }
    setMode("live");
    setSelected(id);
    document.querySelector(`[data-testid="timeline-panel"]`)?.scrollIntoView?.({ behavior: "smooth", block: "start" });
    return true;
  }, [liveStore]);

  const ctx: DashboardContextValue = useMemo(() => ({
    store: mode === "live" ? liveStore : replayStore,
    mode,
    selected,
    select: setSelected,
  }), [mode, selected, liveStore, replayStore]);

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
        <div className="layout">
          <aside className="sidebar" aria-label="Playground">
            <div className="tabs" role="tablist" aria-label="Playground tools">
              {TABS.map((t) => (
                <button
                  key={t.id}
                  type="button"
                  role="tab"
                  id={`tab-${t.id}`}
                  aria-controls={`tabpanel-${t.id}`}
                  aria-selected={tab === t.id}
                  tabIndex={tab === t.id ? 0 : -1}
                  data-testid={`tab-${t.id}`}
                  onClick={() => setTab(t.id)}
                  onKeyDown={(e) => {
                    const i = TABS.findIndex((x) => x.id === tab);
                    const d = e.key === "ArrowRight" ? 1 : e.key === "ArrowLeft" ? -1 : 0;
                    if (d !== 0) {
                      const next = TABS[(i + d + TABS.length) % TABS.length]!;
                      setTab(next.id);
                      document.getElementById(`tab-${next.id}`)?.focus();
                    }
                  }}
                >
                  {t.label}
                </button>
              ))}
            </div>
            <div className="tabpanel" role="tabpanel" id="tabpanel-chat" aria-labelledby="tab-chat" hidden={tab !== "chat"}>
              <ChatPanel model={model} params={params} setParams={setParams} onShowRequest={showRequest} engine={liveStore} />
            </div>
            <div className="tabpanel scroll" role="tabpanel" id="tabpanel-compare" aria-labelledby="tab-compare" hidden={tab !== "compare"}>
              <ComparePanel model={model} onShowRequest={showRequest} engine={liveStore} />
            </div>
            <div className="tabpanel scroll" role="tabpanel" id="tabpanel-loadgen" aria-labelledby="tab-loadgen" hidden={tab !== "loadgen"}>
              <LoadGenPanel />
            </div>
            <div className="tabpanel scroll" role="tabpanel" id="tabpanel-settings" aria-labelledby="tab-settings" hidden={tab !== "settings"}>
              <SettingsPanel liveConfig={config.model ? config : null} />
            </div>
          </aside>
          <main className="main" aria-label="Engine dashboard">
            {mode === "replay" && <ReplayBar controller={replay} refreshKey={recordingsKey} />}
            <DashboardPanels />
          </main>
        </div>
      </div>
    </DashboardContext.Provider>
  );
}
