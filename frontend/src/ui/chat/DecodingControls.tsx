// Decoding settings with presets (greedy / balanced / creative), structured output and tools.
import { matchingPreset, PRESET_NAMES, presetParams, type DecodingParams } from "../../core/openai";
import { NumberField, RangeField, Toggle } from "../components/fields";
import { StructuredControls } from "./StructuredControls";
import { ToolsControls } from "./ToolsControls";

const chatIds = (name: string) => name;

export function PresetButtons(props: { value: DecodingParams; onChange: (p: DecodingParams) => void; testIdPrefix?: string }) {
  const active = matchingPreset(props.value);
  return (
    <div className="segmented" role="group" aria-label="Decoding presets">
      {PRESET_NAMES.map((name) => (
        <button
          key={name}
          type="button"
          aria-pressed={active === name}
          data-testid={`${props.testIdPrefix ?? "preset"}-${name}`}
          onClick={() => props.onChange(presetParams(name, {
            max_tokens: props.value.max_tokens, seed: props.value.seed, n: props.value.n, logprobs: props.value.logprobs, top_logprobs: props.value.top_logprobs,
            structured: props.value.structured, tools: props.value.tools,
          }))}
        >
          {name}
        </button>
      ))}
    </div>
  );
}

export function DecodingControls(props: { value: DecodingParams; onChange: (p: DecodingParams) => void; disabled?: boolean }) {
  const v = props.value;
  const set = <K extends keyof DecodingParams>(k: K, x: DecodingParams[K]) => props.onChange({ ...v, [k]: x });
  const beam = v.beam_width > 1;
  return (
    <div className="decoding" data-testid="decoding-controls">
      <PresetButtons value={v} onChange={props.onChange} />
      <div className="form-grid">
        <RangeField label="Temperature" value={v.temperature} min={0} max={2} step={0.05} onChange={(x) => set("temperature", x)} testId="decoding-temperature" disabled={beam} format={(x) => x.toFixed(2)} />
        <RangeField label="Top-p" value={v.top_p} min={0.05} max={1} step={0.05} onChange={(x) => set("top_p", x)} testId="decoding-top-p" disabled={beam} format={(x) => x.toFixed(2)} />
        <NumberField label="Top-k (0 = off)" value={v.top_k} min={0} max={1000} onChange={(x) => x !== null && set("top_k", Math.max(0, Math.round(x)))} testId="decoding-top-k" disabled={beam} />
        <RangeField label="Min-p" value={v.min_p} min={0} max={0.5} step={0.01} onChange={(x) => set("min_p", x)} testId="decoding-min-p" disabled={beam} format={(x) => x.toFixed(2)} />
        <RangeField label="Repetition penalty" value={v.repetition_penalty} min={0.8} max={2} step={0.05} onChange={(x) => set("repetition_penalty", x)} testId="decoding-repetition-penalty" format={(x) => x.toFixed(2)} />
        <NumberField label="Max tokens" value={v.max_tokens} min={1} max={8192} onChange={(x) => x !== null && set("max_tokens", Math.max(1, Math.round(x)))} testId="decoding-max-tokens" />
        <NumberField label="Seed" value={v.seed} allowEmpty placeholder="random" onChange={(x) => set("seed", x === null ? null : Math.round(x))} testId="decoding-seed" />
        <NumberField label="n (choices)" value={v.n} min={1} max={8} onChange={(x) => x !== null && set("n", Math.max(1, Math.min(8, Math.round(x))))} testId="decoding-n" disabled={beam} />
        <NumberField label="Beam width (1 = off)" value={v.beam_width} min={1} max={8} onChange={(x) => x !== null && set("beam_width", Math.max(1, Math.min(8, Math.round(x))))} testId="decoding-beam-width" />
        <NumberField label="Top alternatives" value={v.top_logprobs} min={0} max={20} onChange={(x) => x !== null && set("top_logprobs", Math.max(0, Math.min(20, Math.round(x))))} testId="decoding-top-logprobs" disabled={!v.logprobs} />
      </div>
      <Toggle label="Token probabilities (logprobs)" checked={v.logprobs} onChange={(x) => set("logprobs", x)} testId="decoding-logprobs" />
      <StructuredControls value={v.structured} onChange={(s) => set("structured", s)} testIds={chatIds} beam={beam} />
      <ToolsControls value={v.tools} onChange={(t) => set("tools", t)} />
    </div>
  );
}
