// The "Structured output" setting: a mode, and the editor for that mode's text (checked as it is typed:
// the problem shows under it, and the chat will not send until it is fixed).
import { STRUCTURED_MODES, structuredFields, type StructuredMode, type StructuredSetting } from "../../core/structured";
import { Select, TextAreaField } from "../components/fields";

/** Test ids: the chat's own ("structured-mode"), or a compare column's ("compare-structured-mode-1"). */
export type TestIds = (name: string) => string;

const HINTS: Partial<Record<StructuredMode, string>> = {
  none: "Free text.",
  json_object: "Any JSON object (response_format json_object).",
  choice: "The reply is exactly one of these.",
};

export function StructuredControls(props: { value: StructuredSetting; onChange: (s: StructuredSetting) => void; testIds: TestIds; beam?: boolean; rows?: number }) {
  const v = props.value;
  const id = props.testIds;
  const checked = structuredFields(v);
  const error = checked.ok ? null : checked.error;
  const rows = props.rows ?? 6;
  const set = <K extends keyof StructuredSetting>(k: K, x: StructuredSetting[K]) => props.onChange({ ...v, [k]: x });
  return (
    <div className="structured" data-testid={id("structured-controls")} data-mode={v.mode} data-valid={error === null}>
      <Select label="Structured output" value={v.mode} options={STRUCTURED_MODES} onChange={(m) => set("mode", m)} testId={id("structured-mode")} />
      {HINTS[v.mode] !== undefined && <span className="muted small">{HINTS[v.mode]}</span>}
      {v.mode === "json_schema" && (
        <TextAreaField label="JSON schema" mono rows={rows} value={v.schema} onChange={(x) => set("schema", x)} testId={id("structured-schema")} error={error} errorTestId={id("structured-error")} />
      )}
      {v.mode === "regex" && (
        <TextAreaField label="Regular expression" mono rows={2} value={v.regex} onChange={(x) => set("regex", x)} testId={id("structured-regex")} error={error} errorTestId={id("structured-error")}
          hint="The whole reply matches it." />
      )}
      {v.mode === "choice" && (
        <TextAreaField label="Choices (one per line)" rows={Math.min(rows, 4)} value={v.choices} onChange={(x) => set("choices", x)} testId={id("structured-choices")} error={error} errorTestId={id("structured-error")} />
      )}
      {v.mode === "grammar" && (
        <TextAreaField label="Lark grammar" mono rows={rows} value={v.grammar} onChange={(x) => set("grammar", x)} testId={id("structured-grammar")} error={error} errorTestId={id("structured-error")} />
      )}
      {v.mode !== "none" && props.beam === true && (
        <span className="error-text small" data-testid={id("structured-beam")}>Beam search cannot follow a grammar: set the beam width to 1.</span>
      )}
    </div>
  );
}
