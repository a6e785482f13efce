// Record a live session on the server (POST /api/recordings/start|stop).
import { useEffect, useState } from "react";
import { recordingStatus, startRecording, stopRecording } from "../../api/client";
import type { RecordingInfo } from "../../core/wire";
import { useBusyAction } from "../hooks";

export function RecordButton(props: { onStopped?: (info: RecordingInfo | null) => void }) {
  const [active, setActive] = useState<RecordingInfo | null>(null);
  const { busy, error, run } = useBusyAction();

  useEffect(() => {
    let cancelled = false;
    recordingStatus()
      .then((status) => {
        if (!cancelled) setActive(status?.recording ?? null);
      })
      .catch(() => undefined);
    return () => {
      cancelled = true;
    };
  }, []);


  return (
    <span className="record">
      {active === null ? (
        <button type="button" className="btn btn-small" data-testid="record-start" disabled={busy} onClick={() => run(async () => {
          setActive(await startRecording());
        })}>
          <span className="rec-dot" aria-hidden="true" /> Record
        </button>
      ) : (
        <button type="button" className="btn btn-small btn-recording" data-testid="record-stop" disabled={busy} onClick={() => run(async () => {
          const info = await stopRecording();
          setActive(null);
          props.onStopped?.(info);
        })} title={`Recording ${active.id}`}>
          <span className="rec-dot live" aria-hidden="true" /> Stop recording
        </button>
      )}
      {error && <span className="error-text small" role="alert" data-testid="record-error">{error}</span>}
    </span>
  );
}
