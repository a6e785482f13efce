// Replay viewer controls: pick a recording (server or file), play / pause / step / speed, scrub,
// export a Chrome trace. Every panel shows the replay store while this is open.
import { useEffect, useMemo, useState, useSyncExternalStore, type ChangeEvent } from "react";
import { downloadRecording, listRecordings, recordingUrl, traceUrl, uploadRecording } from "../../api/client";
import { fmtBytes } from "../../core/format";
import { parseRecording, recordingOwner } from "../../core/recording";
import { verifyRecording } from "../../core/replay";
import type { RecordingInfo } from "../../core/wire";
import { useBusyAction } from "../hooks";
import { SPEEDS, type ReplayController } from "../../live/replayController";
import { Icon } from "../components/Icon";

const SCRUB_STEP = 0.001;

export function ReplayBar(props: { controller: ReplayController; refreshKey: number }) {
  const { controller } = props;
  const info = useSyncExternalStore(controller.subscribe, controller.getInfo, controller.getInfo);
  const [recordings, setRecordings] = useState<RecordingInfo[] | null>(null);
  const [choice, setChoice] = useState("");
  const { busy, error, setError, run: load } = useBusyAction();
  const [uploadedId, setUploadedId] = useState<string | null>(null);
  const [fileText, setFileText] = useState<string | null>(null);

  const refresh = () => {
    listRecordings()
      .then((list) => {
        setRecordings(list);
        setChoice((c) => c || list.find((r) => !r.active)?.id || "");
      })
      .catch((err: Error) => {
        setRecordings([]);
        setError(`Could not list recordings: ${err.message}`);
      });
  };
  useEffect(refresh, [props.refreshKey, setError]); // setError is a stable state setter

  useEffect(() => {
    const onKey = (e: KeyboardEvent) => {
      const t = e.target as HTMLElement | null;
      if (t && (t.closest("input, textarea, select, button, canvas, [contenteditable]") !== null)) return;
      if (!controller.getInfo().loaded) return;
      if (e.key === " ") {
        e.preventDefault();
        controller.toggle();
      } else if (e.key === "ArrowRight") {
        controller.step(1);
      } else if (e.key === "ArrowLeft") {
        controller.step(-1);
      }
    };
    window.addEventListener("keydown", onKey);
    return () => window.removeEventListener("keydown", onKey);
  }, [controller]);


  const loadServer = () => load(async () => {
    if (!choice) return;
    const text = await downloadRecording(choice);
    controller.load(parseRecording(text, choice), { kind: "server", id: choice });
    setUploadedId(null);
    setFileText(null);
  });

  const openFile = (e: ChangeEvent<HTMLInputElement>) => {
    const file = e.currentTarget.files?.[0];
    e.currentTarget.value = "";
    if (!file) return;
    void load(async () => {
      const text = await file.text();
      controller.load(parseRecording(text, file.name), { kind: "file", name: file.name });
      setUploadedId(null);
      setFileText(text);
    });
  };

  const upload = () => load(async () => {
    if (fileText === null) return;
    const saved = await uploadRecording(fileText);
    setUploadedId(saved.id);
    refresh();
  });

  const verified = useMemo(() => {
    const index = controller.replayIndex;
    return info.loaded && index ? verifyRecording(index) : null;
  }, [info.loaded, info.name, controller]); // eslint-disable-line react-hooks/exhaustive-deps

  const traceId = info.source?.kind === "server" ? info.source.id : uploadedId;
  const duration = info.endTs - info.startTs;
  const at = info.clockTs - info.startTs;

  return (
    <section className="replay-bar" aria-label="Replay viewer" data-testid="replay-bar">
      <div className="replay-row">
        <label className="field field-inline">
          <span className="field-label">Recording</span>
          <select data-testid="replay-recording-select" value={choice} onChange={(e) => setChoice(e.currentTarget.value)} disabled={!recordings || recordings.length === 0}>
            {recordings === null && <option value="">Loading…</option>}
            {recordings !== null && recordings.length === 0 && <option value="">No recordings on the server</option>}
            {recordings?.map((r) => (
              <option key={r.id} value={r.id} disabled={r.active}>
                {recordingOwner(r)} · {r.id} · {r.num_events} events · {r.duration_s.toFixed(1)} s · {fmtBytes(r.size_bytes)}{r.active ? " (recording…)" : ""}
              </option>
            ))}
          </select>
        </label>
        <button type="button" className="btn btn-small" data-testid="replay-load" disabled={!choice || busy} onClick={() => void loadServer()}>Load</button>
        <button type="button" className="btn btn-small btn-ghost" onClick={refresh} aria-label="Refresh the recording list" data-testid="replay-refresh">↻</button>
        <span className="sep" aria-hidden="true" />
        <label className="btn btn-small file-btn">
          Open file…
          <input type="file" accept=".jsonl,.ndjson,application/x-ndjson,application/json,text/plain" data-testid="replay-open" onChange={openFile} className="visually-hidden" />
        </label>
        {info.source?.kind === "file" && !uploadedId && (
          <button type="button" className="btn btn-small" data-testid="replay-upload" onClick={() => void upload()} disabled={busy}>Upload to server</button>
        )}
        <span className="grow" />
        {info.loaded && (
          <span className="replay-name" data-testid="replay-name">
            {info.name}
            {verified && (
              <span className={verified.ok ? "ok-text" : "error-text"} data-testid="replay-verified" title={verified.detail}>
                {verified.ok ? " ✓ consistent" : ` ✗ ${verified.detail}`}
              </span>
            )}
          </span>
        )}
        {traceId && (
          <>
            <a className="btn btn-small" data-testid="replay-trace" href={traceUrl(traceId)} download={`${traceId}.trace.json`}>Export Chrome trace</a>
            <a className="btn btn-small btn-ghost" data-testid="replay-download" href={recordingUrl(traceId)} download={`${traceId}.jsonl`}>JSONL</a>
          </>
        )}
      </div>
      {error && <div className="error-text small" role="alert" data-testid="replay-error">{error}</div>}
      <div className="replay-row transport">
        <button type="button" className="btn btn-icon" data-testid="replay-step-back" disabled={!info.loaded} onClick={() => controller.step(-1)} aria-label="Previous engine step" title="Previous engine step (←)"><Icon name="prev" /></button>
        <button type="button" className="btn btn-icon btn-primary" data-testid="replay-play" disabled={!info.loaded} onClick={() => controller.toggle()} aria-label={info.playing ? "Pause" : "Play"} title="Play / pause (space)"><Icon name={info.playing ? "pause" : "play"} /></button>
        <button type="button" className="btn btn-icon" data-testid="replay-step" disabled={!info.loaded} onClick={() => controller.step(1)} aria-label="Next engine step" title="Next engine step (→)"><Icon name="next" /></button>
        <label className="field field-inline">
          <span className="visually-hidden">Speed</span>
          <select data-testid="replay-speed" value={info.speed} disabled={!info.loaded} onChange={(e) => controller.setSpeed(Number(e.currentTarget.value))}>
            {SPEEDS.map((s) => <option key={s} value={s}>{s}×</option>)}
          </select>
        </label>
        <label className="scrub">
          <span className="visually-hidden">Replay position (seconds)</span>
          <input
            type="range"
            data-testid="replay-scrub"
            min={0}
            max={Math.max(0.001, duration)}
            step={SCRUB_STEP}
            value={Math.max(0, at)}
            disabled={!info.loaded}
            onChange={(e) => {
              const v = Number(e.currentTarget.value);
              // the range snaps to its step: treat its last step as "the end" (every event applied)
              if (v >= duration - SCRUB_STEP) controller.seekPosition(info.length);
              else controller.seekTs(info.startTs + v);
            }}
            aria-valuetext={`${at.toFixed(3)} of ${duration.toFixed(3)} seconds`}
          />
        </label>
        <span className="replay-position num" data-testid="replay-position" data-position={info.position} data-length={info.length}>
          {info.loaded ? `${at.toFixed(2)} / ${duration.toFixed(2)} s · event ${info.position}/${info.length} · step ${info.step}` : "Load a recording to replay it"}
        </span>
      </div>
    </section>
  );
}
