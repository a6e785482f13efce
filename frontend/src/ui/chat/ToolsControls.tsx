// The tools editor: the request's `tools` array as JSON (checked as it is typed) and tool_choice.
// Collapsed by default; its summary says which tools are set.
import { EXAMPLE_TOOLS, parseTools, toolChoiceOptions, toolFields, type ToolChoiceValue, type ToolsSetting } from "../../core/tools";
import { Select, TextAreaField } from "../components/fields";

export function ToolsControls(props: { value: ToolsSetting; onChange: (s: ToolsSetting) => void }) {
  const v = props.value;
  const tools = parseTools(v.text);
  const checked = toolFields(v);
  const options = toolChoiceOptions(tools.ok ? tools.value : []);
  if (!options.some((o) => o.value === v.choice)) options.push({ value: v.choice, label: `${v.choice.replace("function:", "")} (not a tool)` });
  const names = tools.ok ? tools.value.map((t) => t.function.name) : [];
  return (
    <details className="tools-details" data-testid="tools-details" data-valid={checked.ok}>
      <summary>
        Tools{" "}
        <span className={checked.ok ? "muted" : "error-text"}>
          · {!tools.ok ? "invalid" : names.length === 0 ? "none" : `${names.join(", ")} · tool_choice ${v.choice.replace("function:", "")}`}
        </span>
      </summary>
      <div className="tools-body">
        <TextAreaField label="tools (JSON array)" mono rows={8} value={v.text} onChange={(text) => props.onChange({ ...v, text })} testId="tools-editor"
          placeholder='[{"type": "function", "function": {"name": "...", "description": "...", "parameters": {...}}}]'
          error={checked.ok ? null : checked.error} errorTestId="tools-error" />
        <div className="row gap">
          <Select<ToolChoiceValue> label="tool_choice" value={v.choice} options={options} onChange={(choice) => props.onChange({ ...v, choice })} testId="tool-choice" />
          <span className="grow" />
          <button type="button" className="btn btn-small" data-testid="tools-example" onClick={() => props.onChange({ ...v, text: EXAMPLE_TOOLS })}>Insert example</button>
          <button type="button" className="btn btn-small btn-ghost" data-testid="tools-clear" disabled={v.text === ""} onClick={() => props.onChange({ text: "", choice: "auto" })}>Clear</button>
        </div>
      </div>
    </details>
  );
}
