// Generated text, plain or as tokens coloured by probability with the top alternatives on hover/focus.
// Tokens that came from an accepted speculative draft are underlined; hovering one shows its step's
// draft (DraftDetail). Tokens chosen under a grammar (structured outputs) are hatched, denser where the
// grammar allowed less of the vocabulary. The engine's token entries (TokenGenerated, aligned to the
// streamed tokens) say which ones those are.
import { useState, type CSSProperties, type FocusEvent, type MouseEvent } from "react";
import { probabilityColor } from "../../core/color";
import type { TokenEntry } from "../../core/dashboard";
import { allowedAttr, maskShade, maskTitle } from "../../core/mask";
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

const LEGEND_SHADES = [0.1, 1e-3, 2e-5];

function TokenLegend(props: { drafted: boolean; masked: boolean; dark: boolean }) {
  if (!props.drafted && !props.masked) return null;
  return (
    <ul className="legend token-legend" aria-label="Token legend" data-testid="token-legend">
      {props.drafted && <li data-testid="legend-drafted"><span className="legend-mark mark-drafted" aria-hidden="true" />Accepted draft (speculative decoding): hover for the step's draft</li>}
      {props.masked && (
        <li data-testid="legend-mask">
          {LEGEND_SHADES.map((f) => <span key={f} className="legend-mark mark-mask" aria-hidden="true" style={{ backgroundImage: maskShade(f, props.dark) ?? undefined }} />)}
          Grammar mask (structured output): denser hatching = the grammar allowed fewer tokens; hover for the share of the vocabulary
        </li>
      )}
    </ul>
  );
}

/** The class, style and data attributes that mark a token's engine entry: drafted, constrained. */
function entryMarks(entry: TokenEntry | undefined, dark: boolean) {
  const drafted = entry?.drafted === true;
  const allowed = entry?.allowed_fraction ?? null;
  const shade = allowed === null ? null : maskShade(allowed, dark);
  return {
    className: ["token", drafted ? "token-drafted" : "", allowed !== null ? "token-masked" : ""].filter(Boolean).join(" "),
    style: (shade === null ? {} : { backgroundImage: shade }) as CSSProperties,
    attrs: { "data-drafted": drafted ? "true" : undefined, "data-allowed": allowed === null ? undefined : allowedAttr(allowed) },
    label: [drafted ? "accepted draft" : "", allowed !== null ? maskTitle(allowed) : ""].filter(Boolean).join(", "),
    drafted,
    allowed,
  };
}

function MaskLine(props: { allowed: number | null }) {
  if (props.allowed === null) return null;
  return <div data-testid="token-mask">{maskTitle(props.allowed)}</div>;
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
  const engine = props.engine ?? [];
  const anyMasked = engine.some((e) => typeof e?.allowed_fraction === "number");
  if (!props.tokenView || (props.tokens.every((t) => t.logprob === null) && !anyMasked)) {
    return (
      <div className="message-text" data-testid={props.testId}>
        {props.text}
        {props.streaming && <span className="caret" aria-hidden="true" />}
      </div>
    );
  }
  const texts = props.texts ?? new Map<number, string>();
  const anyDrafted = engine.some((e) => e?.drafted === true);
  const hovered = hover !== null ? props.tokens[hover.i] : undefined;
  const hoveredEntry = hover !== null ? engine[hover.i] : undefined;
  return (
    <>
      <div className="message-text tokens" data-testid={props.testId}>
        {props.tokens.map((t, i) => {
          const p = t.logprob === null ? null : Math.exp(t.logprob);
          const marks = entryMarks(engine[i], dark);
          const label = p === null ? JSON.stringify(t.text) : `${JSON.stringify(t.text)}, probability ${(p * 100).toFixed(1)}%`;
          return (
            <span
              key={i}
              className={marks.className}
              tabIndex={0}
              data-testid="token"
              data-prob={p === null ? "" : p.toFixed(4)}
              {...marks.attrs}
              style={p === null ? marks.style : { backgroundColor: probabilityColor(p, dark), ...marks.style }}
              {...handlers(i)}
              aria-label={marks.label ? `${label}, ${marks.label}` : p === null ? t.text : label}
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
            <MaskLine allowed={hoveredEntry?.allowed_fraction ?? null} />
            {hoveredEntry?.verify && <DraftDetail verify={hoveredEntry.verify} texts={texts} drafted={hoveredEntry.drafted} />}
          </div>
        )}
      </div>
      <TokenLegend drafted={anyDrafted} masked={anyMasked} dark={dark} />
    </>
  );
}

/** The engine's generated tokens for one sequence (the request detail), drafted ones marked. */
export function EngineTokenText(props: { entries: readonly TokenEntry[]; texts: ReadonlyMap<number, string>; testId?: string }) {
  const { hover, handlers } = useTokenHover();
  const dark = getPalette().dark;
  const hovered = hover !== null ? props.entries[hover.i] : undefined;
  const detailed = (t: TokenEntry) => t.verify !== null || t.allowed_fraction !== null;
  return (
    <>
      <div className="message-text tokens small" data-testid={props.testId}>
        {props.entries.map((t, i) => {
          const marks = entryMarks(t, dark);
          return (
            <span
              key={i}
              className={marks.className}
              data-testid="engine-token"
              {...marks.attrs}
              style={marks.style}
              tabIndex={detailed(t) ? 0 : undefined}
              {...(detailed(t) ? handlers(i) : {})}
            >
              {t.text}
            </span>
          );
        })}
        {hovered !== undefined && detailed(hovered) && hover !== null && (
          <div className="tooltip" role="tooltip" data-testid="token-tooltip" style={tooltipPosition(hover.x, hover.y)}>
            <div className="tooltip-title mono">{JSON.stringify(hovered.text)}</div>
            <MaskLine allowed={hovered.allowed_fraction} />
            {hovered.verify && <DraftDetail verify={hovered.verify} texts={props.texts} drafted={hovered.drafted} />}
          </div>
        )}
      </div>
      <TokenLegend drafted={props.entries.some((t) => t.drafted)} masked={props.entries.some((t) => t.allowed_fraction !== null)} dark={dark} />
    </>
  );
}
