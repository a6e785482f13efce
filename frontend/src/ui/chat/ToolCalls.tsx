// The tool calls of an assistant message: each function's name and its arguments, indented once they
// parse as JSON (as they came while they are still streaming), and the finish reason.
import { prettyArguments, type ToolCallView } from "../../core/toolCalls";

export function ToolCalls(props: { calls: readonly ToolCallView[]; finishReason: string | null; streaming: boolean }) {
  return (
    <div className="tool-calls" data-testid="tool-calls">
      <div className="muted small">
        {props.calls.length === 1 ? "Tool call" : `${props.calls.length} tool calls`}
        {props.finishReason !== null && <> · finish_reason <span className="mono" data-testid="tool-calls-finish">{props.finishReason}</span></>}
      </div>
      <ol className="tool-call-list">
        {props.calls.map((c) => {
          const args = prettyArguments(c.arguments);
          return (
            <li key={c.index} className="tool-call" data-testid="tool-call" data-name={c.name} data-valid={args.valid}>
              <div className="tool-call-head">
                <span className="mono tool-call-name" data-testid="tool-call-name">{c.name || "…"}</span>
                {c.id !== null && <span className="muted small mono" title="tool call id">{c.id}</span>}
              </div>
              <pre className="tool-call-args mono" data-testid="tool-call-arguments">{args.text || (props.streaming ? "…" : "(no arguments)")}</pre>
              {!args.valid && !props.streaming && c.arguments.trim() !== "" && (
                <span className="error-text small" data-testid="tool-call-invalid">The arguments are not valid JSON.</span>
              )}
            </li>
          );
        })}
      </ol>
    </div>
  );
}
