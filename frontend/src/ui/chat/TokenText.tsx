// Generated text, plain or as tokens coloured by probability with the top alternatives on hover/focus.
// Tokens that came from an accepted speculative draft are underlined; hovering one shows its step's
// draft (DraftDetail). The engine's token entries (TokenGenerated, aligned to the streamed tokens)
// say which ones those are.
import { useState, type FocusEvent, type MouseEvent } from "react";
import { probabilityColor } from "../../core/color";
import type { TokenEntry } from "../../core/dashboard";
import type { TokenView } from "../../core/openai";
import { getPalette } from "../theme";
import { tooltipPosition } from "../panels/TimelinePanel";
import { DraftDetail } from "./DraftDetail";

function visible(text: string): string {
  return text.replace(/\n/g, "↵\n").replace(/\t/g, "→");
}

interface Hover {
  i: number;
  x: number;
  y: number;
}

/** Hover and keyboard focus on token spans, for a tooltip at the pointer (or below the focused token). */
function useTokenHover() {
  const [hover, setHover] = useState<Hover | null>(null);
  const handlers = (i: number) => ({
    onMouseEnter: (e: MouseEvent<HTMLElement>) => setHover({ i, x: e.clientX, y: e.clientY }),
    onMouseLeave: () => setHover(null),
    onFocus: (e: FocusEvent<HTMLElement>) => {
      const r = e.currentTarget.getBoundingClientRect();
      setHover({ i, x: r.left, y: r.bottom });
    },
    onBlur: () => setHover(null),
  });
  return { hover, handlers };
}

function DraftLegend() {
  return (
    <ul className="legend token-legend" aria-label="Token legend" data-testid="token-legend">
      <li><span className="legend-mark mark-drafted" aria-hidden="true" />Accepted draft (speculative decoding): hover for the step's draft</li>
    </ul>
  );
}

export function TokenText(props: {
  tokens: readonly TokenView[];
  text: string;
  tokenView: boolean;
  streaming: boolean;
  testId?: string;
  /** The engine's entry for each streamed token, where known (see alignEngineTokens). */
  engine?: readonly (TokenEntry | undefined)[];
  /** Token id -> text from the request's output, to show drafted tokens as text. */
  texts?: ReadonlyMap<number, string>;
}) {
  const { hover, handlers } = useTokenHover();
  const dark = getPalette().dark;
  if (!props.tokenView || props.tokens.every((t) => t.logprob === null)) {
    return (
      <div className="message-text" data-testid={props.testId}>
        {props.text}
        {props.streaming && <span className="caret" aria-hidden="true" />}
      </div>
    );
  }
  const engine = props.engine ?? [];
  const texts = props.texts ?? new Map<number, string>();
  const anyDrafted = engine.some((e) => e?.drafted === true);
  const hovered = hover !== null ? props.tokens[hover.i] : undefined;
  const hoveredEntry = hover !== null ? engine[hover.i] : undefined;
  return (
    <>
      <div className="message-text tokens" data-testid={props.testId}>
        {props.tokens.map((t, i) => {
          const p = t.logprob === null ? null : Math.exp(t.logprob);
          const drafted = engine[i]?.drafted === true;
          const label = p === null ? JSON.stringify(t.text) : `${JSON.stringify(t.text)}, probability ${(p * 100).toFixed(1)}%`;
          return (
            <span
              key={i}
              className={drafted ? "token token-drafted" : "token"}
              tabIndex={0}
              data-testid="token"
              data-prob={p === null ? "" : p.toFixed(4)}
              data-drafted={drafted ? "true" : undefined}
              style={p === null ? undefined : { background: probabilityColor(p, dark) }}
              {...handlers(i)}
              aria-label={drafted ? `${label}, accepted draft` : p === null ? t.text : label}
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
            {hoveredEntry?.verify && <DraftDetail verify={hoveredEntry.verify} texts={texts} drafted={hoveredEntry.drafted} />}
          </div>
        )}
      </div>
      {anyDrafted && <DraftLegend />}
    </>
  );
}

/** The engine's generated tokens for one sequence (the request detail), drafted ones marked. */
export function EngineTokenText(props: { entries: readonly TokenEntry[]; texts: ReadonlyMap<number, string>; testId?: string }) {
  const { hover, handlers } = useTokenHover();
  const hovered = hover !== null ? props.entries[hover.i] : undefined;
  return (
    <>
      <div className="message-text tokens small" data-testid={props.testId}>
        {props.entries.map((t, i) => (
          <span
            key={i}
            className={t.drafted ? "token token-drafted" : "token"}
            data-testid="engine-token"
            data-drafted={t.drafted ? "true" : undefined}
            tabIndex={t.verify ? 0 : undefined}
            {...(t.verify ? handlers(i) : {})}
          >
            {t.text}
          </span>
        ))}
        {hovered?.verify && hover !== null && (
          <div className="tooltip" role="tooltip" data-testid="token-tooltip" style={tooltipPosition(hover.x, hover.y)}>
            <div className="tooltip-title mono">{JSON.stringify(hovered.text)}</div>
            <DraftDetail verify={hovered.verify} texts={props.texts} drafted={hovered.drafted} />
          </div>
        )}
      </div>
      {props.entries.some((t) => t.drafted) && <DraftLegend />}
    </>
  );
}
