import { useSyncExternalStore } from "react";
import type { LiveConnection } from "../../live/socket";
import type { ViewMode } from "../context";

const LABEL = { connecting: "Connecting…", live: "Live", reconnecting: "Reconnecting…", offline: "Offline" } as const;

export function ConnectionBadge(props: { connection: LiveConnection; mode: ViewMode; lastSeq: number }) {
  const info = useSyncExternalStore(props.connection.subscribe, props.connection.getInfo, props.connection.getInfo);
  const status = info.status;
  const title = [
    `WebSocket /ws/events: ${status}`,
    info.attempts > 0 ? `reconnect attempt ${info.attempts}` : "",
    info.detail,
    props.lastSeq > 0 ? `last event #${props.lastSeq}` : "",
  ].filter(Boolean).join(" · ");
  return (
    <span className={`badge badge-${status}`} data-testid="connection-badge" data-status={status} role="status" aria-live="polite" title={title}>
      <span className="badge-dot" aria-hidden="true" />
      {LABEL[status]}
      {status === "reconnecting" && info.attempts > 1 ? ` (${info.attempts})` : ""}
      {props.mode === "replay" && <span className="badge-note"> · viewing replay</span>}
    </span>
  );
}
