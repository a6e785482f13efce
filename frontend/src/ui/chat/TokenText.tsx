// Generated text, plain or as tokens coloured by probability with the top alternatives on hover/focus.
import { useState } from "react";
import { probabilityColor } from "../../core/color";
import type { TokenView } from "../../core/openai";
import { getPalette } from "../theme";
import { tooltipPosition } from "../panels/TimelinePanel";

function visible(text: string): string {
  return text.replace(/\n/g, "↵\n").replace(/\t/g, "→");
}

export function TokenText(props: { tokens: readonly TokenView[]; text: string; tokenView: boolean; streaming: boolean; testId?: string }) {
  const [hover, setHover] = useState<{ i: number; x: number; y: number } | null>(null);
  const dark = getPalette().dark;
  if (!props.tokenView || props.tokens.every((t) => t.logprob === null)) {
    return (
      <div className="message-text" data-testid={props.testId}>
        {props.text}
        {props.streaming && <span className="caret" aria-hidden="true" />}
      </div>
    );
  }
  const hovered = hover !== null ? props.tokens[hover.i] : undefined;
  return (
    <div className="message-text tokens" data-testid={props.testId}>
      {props.tokens.map((t, i) => {
        const p = t.logprob === null ? null : Math.exp(t.logprob);
        return (
          <span
            key={i}
            className="token"
            tabIndex={0}
            data-testid="token"
            data-prob={p === null ? "" : p.toFixed(4)}
            style={p === null ? undefined : { background: probabilityColor(p, dark) }}
            onMouseEnter={(e) => setHover({ i, x: e.clientX, y: e.clientY })}
            onMouseLeave={() => setHover(null)}
            onFocus={(e) => {
              const r = e.currentTarget.getBoundingClientRect();
              setHover({ i, x: r.left, y: r.bottom });
            }}
            onBlur={() => setHover(null)}
            aria-label={p === null ? t.text : `${JSON.stringify(t.text)}, probability ${(p * 100).toFixed(1)}%`}
          >
            {visible(t.text)}
          </span>
        );
      })}
      {props.streaming && <span className="caret" aria-hidden="true" />}
      {hovered !== undefined && hover !== null && (
        <div className="tooltip" role="tooltip" data-testid="token-tooltip" style={tooltipPosition(hover.x, hover.y)}>
          <div className="tooltip-title mono">{JSON.stringify(hovered.text)}</div>
          {hovered.logprob !== null && <div>p = {(Math.exp(hovered.logprob) * 100).toFixed(2)}% · logprob {hovered.logprob.toFixed(3)}</div>}
          {hovered.top.length > 0 && (
            <table className="alt-table">
              <tbody>
                {hovered.top.map((a, k) => (
                  <tr key={k} className={a.token === hovered.text ? "chosen" : ""}>
                    <td className="mono">{JSON.stringify(a.token)}</td>
                    <td className="num">{(Math.exp(a.logprob) * 100).toFixed(1)}%</td>
                    <td><span className="prob-bar" style={{ width: `${Math.max(2, Math.exp(a.logprob) * 80)}px` }} /></td>
                  </tr>
                ))}
              </tbody>
            </table>
          )}
        </div>
      )}
    </div>
  );
}
