// Compare mode: one prompt under 2–4 decoding strategies, run concurrently, side by side. The
// requests run at the same time, so they appear together in the timeline and the heatmap. Each
// strategy has its own structured-output setting, so a constrained and a free one can be compared.
import { useCallback, useReducer, useState, type CSSProperties } from "react";
import { describeRequest, matchingPreset, PRESET_NAMES, presetParams, requestProblem, type DecodingParams, type PresetName } from "../../core/openai";
import type { DashboardStore } from "../../live/store";
import { NumberField, Select, Toggle } from "../components/fields";
import { chatReducer, clockMs, initialChat, isStreaming, requestCandidates, type AssistantTurn, type ChatAction, type ChatState } from "./chatState";
import { MessageStats } from "./MessageStats";
import { LiveTokenText } from "./LiveTokenText";
import { StructuredControls } from "./StructuredControls";
import { useStreams } from "./useStream";

const DEFAULT_STRATEGIES: DecodingParams[] = [
  presetParams("greedy"),
  presetParams("balanced", { seed: 1 }),
  presetParams("creative", { seed: 2 }),
  presetParams("greedy", { beam_width: 3 }),
];

type Columns = readonly ChatState[];
type ColumnAction = { kind: "column"; col: number; action: ChatAction } | { kind: "reset"; count: number };

function columnsReducer(state: Columns, a: ColumnAction): Columns {
  if (a.kind === "reset") return Array.from({ length: a.count }, () => initialChat);
  return state.map((c, i) => (i === a.col ? chatReducer(c, a.action) : c));
}

let runCounter = 0;

/** The column count goes to the stylesheet as a variable, so a phone can still stack the columns. */
const columnsStyle = (count: number) => ({ "--compare-columns": count }) as CSSProperties;

export function ComparePanel(props: { model: string | null; onShowRequest: (candidates: string[]) => boolean; engine?: DashboardStore }) {
  const [prompt, setPrompt] = useState("Write a two-sentence story about a lighthouse keeper.");
  const [count, setCount] = useState(3);
  const [maxTokens, setMaxTokens] = useState(96);
  const [tokenView, setTokenView] = useState(false);
  const [strategies, setStrategies] = useState<DecodingParams[]>(DEFAULT_STRATEGIES);
  const [columns, dispatchColumn] = useReducer(columnsReducer, [initialChat, initialChat, initialChat, initialChat]);
  const dispatchers = [0, 1, 2, 3].map((col) => (action: ChatAction) => dispatchColumn({ kind: "column", col, action }));
  const s0 = useStreams(useCallback((a: ChatAction) => dispatchColumn({ kind: "column", col: 0, action: a }), []), props.model);
  const s1 = useStreams(useCallback((a: ChatAction) => dispatchColumn({ kind: "column", col: 1, action: a }), []), props.model);
  const s2 = useStreams(useCallback((a: ChatAction) => dispatchColumn({ kind: "column", col: 2, action: a }), []), props.model);
  const s3 = useStreams(useCallback((a: ChatAction) => dispatchColumn({ kind: "column", col: 3, action: a }), []), props.model);
  const streams = [s0, s1, s2, s3];
  const running = columns.slice(0, count).some(isStreaming);
  const problems = strategies.slice(0, count).map(requestProblem);
  const blocked = problems.some((p) => p !== null);

  const runAll = () => {
    const text = prompt.trim();
    if (!text || running || blocked) return;
    dispatchColumn({ kind: "reset", count: 4 });
    for (let col = 0; col < count; col++) {
      const params = { ...strategies[col]!, max_tokens: maxTokens, logprobs: true, top_logprobs: 5 };
      const id = `cmp${++runCounter}`;
      dispatchers[col]!({ type: "send", userId: `${id}u`, assistantId: id, content: text, params, at: clockMs() });
      void streams[col]!.run(id, [{ role: "user", content: text }], params);
    }
  };

  const setStrategy = (col: number, p: DecodingParams) => setStrategies(strategies.map((s, i) => (i === col ? p : s)));

  return (
    <div className="compare" data-testid="compare-panel">
      <form className="compare-form" onSubmit={(e) => { e.preventDefault(); runAll(); }}>
        <label className="field">
          <span className="field-label">Prompt</span>
          <textarea data-testid="compare-input" rows={3} value={prompt} onChange={(e) => setPrompt(e.currentTarget.value)} />
        </label>
        <div className="form-grid">
          <Select label="Strategies" value={String(count) as "2" | "3" | "4"} onChange={(v) => setCount(Number(v))} testId="compare-count" options={[
            { value: "2", label: "2 side by side" }, { value: "3", label: "3 side by side" }, { value: "4", label: "4 side by side" },
          ]} />
          <NumberField label="Max tokens" value={maxTokens} min={1} max={4096} onChange={(v) => v !== null && setMaxTokens(Math.max(1, Math.round(v)))} testId="compare-max-tokens" />
        </div>
        <div className="strategy-grid" style={columnsStyle(count)}>
          {strategies.slice(0, count).map((s, col) => (
            <StrategyEditor key={col} col={col} value={s} onChange={(p) => setStrategy(col, p)} />
          ))}
        </div>
        <div className="row gap">
          <Toggle label="Token view" checked={tokenView} onChange={setTokenView} testId="compare-token-view" />
          <span className="grow" />
          {running ? (
            <button type="button" className="btn btn-danger" data-testid="compare-stop" onClick={() => streams.forEach((s) => s.stop())}>Stop all</button>
          ) : (
            <button type="submit" className="btn btn-primary" data-testid="compare-run" disabled={!prompt.trim() || blocked}
              title={problems.map((p, col) => (p === null ? "" : `Strategy ${col + 1}: ${p}`)).filter(Boolean).join("\n") || undefined}>Run {count} at once</button>
          )}
        </div>
      </form>
      <div className="compare-columns" data-testid="compare-columns" style={columnsStyle(count)}>
        {columns.slice(0, count).map((c, col) => {
          const turn = c.turns.find((t): t is AssistantTurn => t.role === "assistant");
          const choice = turn?.result.choices[0];
          return (
            <section key={col} className="compare-column" data-testid={`compare-column-${col}`} aria-label={`Strategy ${col + 1}`}>
              <header className="muted small">{describeRequest(strategies[col]!)}</header>
              {turn === undefined ? (
                <div className="muted small">Not run yet.</div>
              ) : (
                <>
                  <LiveTokenText tokens={choice?.tokens ?? []} text={choice?.text ?? ""} tokenView={tokenView} streaming={turn.status === "streaming"} testId={`compare-output-${col}`}
                    engine={props.engine} candidates={requestCandidates(turn)} choiceIndex={0} />
                  {turn.status === "error" && <div className="error-text small" role="alert">{turn.error}</div>}
                  <MessageStats turn={turn} testId={`compare-stats-${col}`} />
                  {(turn.requestId ?? turn.result.id) && (
                    <button type="button" className="btn btn-ghost btn-small" onClick={() => props.onShowRequest(requestCandidates(turn))}>Show in timeline</button>
                  )}
                </>
              )}
            </section>
          );
        })}
      </div>
    </div>
  );
}

function StrategyEditor(props: { col: number; value: DecodingParams; onChange: (p: DecodingParams) => void }) {
  const v = props.value;
  const preset = v.beam_width > 1 ? "beam" : matchingPreset(v) ?? "custom";
  const options: { value: string; label: string }[] = [
    ...PRESET_NAMES.map((n) => ({ value: n, label: n })),
    { value: "beam", label: "beam search" },
    ...(preset === "custom" ? [{ value: "custom", label: "custom" }] : []),
  ];
  return (
    <fieldset className="strategy" data-testid={`compare-strategy-${props.col}`}>
      <legend>Strategy {props.col + 1}</legend>
      <Select label="Preset" value={preset} options={options} onChange={(name) => {
        if (name === "beam") props.onChange(presetParams("greedy", { beam_width: 3, seed: v.seed, structured: v.structured }));
        else if (name !== "custom") props.onChange(presetParams(name as PresetName, { seed: v.seed, structured: v.structured }));
      }} testId={`compare-preset-${props.col}`} />
      {v.beam_width > 1 ? (
        <NumberField label="Beam width" value={v.beam_width} min={2} max={8} onChange={(x) => x !== null && props.onChange({ ...v, beam_width: Math.max(2, Math.min(8, Math.round(x))) })} testId={`compare-beam-${props.col}`} />
      ) : (
        <NumberField label="Temperature" value={v.temperature} min={0} max={2} step={0.1} onChange={(x) => x !== null && props.onChange({ ...v, temperature: Math.max(0, x) })} testId={`compare-temperature-${props.col}`} />
      )}
      <NumberField label="Seed" value={v.seed} allowEmpty placeholder="random" onChange={(x) => props.onChange({ ...v, seed: x === null ? null : Math.round(x) })} testId={`compare-seed-${props.col}`} />
      <StructuredControls value={v.structured} onChange={(structured) => props.onChange({ ...v, structured })} testIds={(name) => `compare-${name}-${props.col}`} beam={v.beam_width > 1} rows={4} />
    </fieldset>
  );
}
