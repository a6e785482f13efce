// One assistant message: its text (tokens coloured by probability, or Markdown), tool-call cards,
// its stats, the versions that Regenerate kept (‹1/2›), and the actions on it.
import { useEffect, useMemo } from "react";
import { describeRequest, type TokenView } from "../../core/openai";
import type { DashboardStore } from "../../live/store";
import { activeChoice, requestCandidates, type AssistantTurn, type SpecCounts } from "./chatState";
import { LiveTokenText } from "./LiveTokenText";
import { Markdown, RawCode } from "./Markdown";
import { MessageStats } from "./MessageStats";
import { tokensOutsideToolCalls } from "./toolCallText";
import { ToolCalls } from "./ToolCalls";
import { useRequestSpec } from "./useRequestSpec";

export type ReplyView = "tokens" | "markdown";

export function AssistantMessage(props: {
  turn: AssistantTurn;
  view: ReplyView;
  isLast: boolean;
  /** A reply is streaming in this conversation (no new request until it ends). */
  streaming: boolean;
  /** The current settings cannot be sent (no regenerate). */
  blocked: boolean;
  onChoose: (index: number) => void;
  onVersion: (index: number) => void;
  onRegenerate: () => void;
  onContinue: () => void;
  onStop: () => void;
  onSpec: (key: string, spec: SpecCounts) => void;
  onShowRequest: (candidates: string[]) => boolean;
  engine?: DashboardStore;
}) {
  const t = props.turn;
  const choice = activeChoice(t);
  const live = t.status === "streaming";
  const candidates = useMemo(() => requestCandidates(t), [t]);
  const tokens = choice?.tokens ?? NO_TOKENS;
  const toolsOffered = t.params.tools.text.trim() !== "" && t.params.tools.choice !== "none";
  const hasCalls = (choice?.tool_calls.length ?? 0) > 0;
  // a tool call's markup became its card: its tokens are left out (held back while it streams)
  const keep = useMemo(() => (hasCalls || (live && toolsOffered) ? tokensOutsideToolCalls(tokens, live) : undefined), [hasCalls, live, toolsOffered, tokens]);
  const spec = useRequestSpec(props.engine, candidates);
  const { onSpec } = props;
  useEffect(() => {
    // kept on the reply, so the counts outlive the engine's memory of the request (and a reload)
    if (spec !== null) onSpec(t.key, spec);
  }, [spec, t.key, onSpec]);
  const structured = t.params.structured.mode !== "none";
  const continuable = !live && props.isLast && !hasCalls && !structured && t.status !== "error" && (choice?.text ?? "") !== "";

  return (
    <li className={`message message-assistant status-${t.status}`} data-testid="message-assistant" data-status={t.status} data-finish={choice?.finish_reason ?? undefined}
      data-version={t.shown + 1} data-versions={t.versions.length}>
      <div className="message-meta muted small">
        {t.versions.length > 1 && <Versions shown={t.shown} count={t.versions.length} disabled={live} onVersion={props.onVersion} />}
        {/* a reply with no request id never came from this server (an imported text): its settings are unknown */}
        <span>{live || t.requestId !== null || t.result.id !== null ? describeRequest(t.params) : "imported"}</span>
        {t.result.choices.length > 1 && (
          <span className="choice-tabs" role="tablist" aria-label="Choices">
            {t.result.choices.map((c) => (
              <button key={c.index} type="button" role="tab" aria-selected={c.index === t.activeChoice} data-testid={`message-choice-${c.index}`} onClick={() => props.onChoose(c.index)}>
                {t.params.beam_width > 1 ? "beam" : "choice"} {c.index + 1}
              </button>
            ))}
          </span>
        )}
      </div>
      {choice === undefined && live ? (
        <div className="message-text muted"><span className="caret" aria-hidden="true" /> waiting for the first token…</div>
      ) : props.view === "markdown" ? (
        structured ? <RawCode text={choice?.text ?? ""} streaming={live} testId="message-content" /> : <Markdown text={choice?.text ?? ""} streaming={live} testId="message-content" />
      ) : (
        <LiveTokenText tokens={tokens} text={choice?.text ?? ""} tokenView streaming={live} testId="message-content"
          engine={props.engine} candidates={candidates} choiceIndex={choice?.index ?? 0} keep={keep} />
      )}
      {choice !== undefined && hasCalls && <ToolCalls calls={choice.tool_calls} finishReason={choice.finish_reason} streaming={live} />}
      {t.status === "error" && <div className="error-text small" role="alert" data-testid="message-error">{t.error}</div>}
      {t.status === "stopped" && <div className="muted small">Stopped — the request was aborted on the server.</div>}
      <div className="message-footer">
        <MessageStats turn={t} />
        <div className="message-actions">
          {live && <button type="button" className="btn btn-ghost btn-small" onClick={props.onStop}>Stop</button>}
          {continuable && (
            <button type="button" className="btn btn-ghost btn-small" data-testid="message-continue" disabled={props.streaming || props.blocked} onClick={props.onContinue}
              title="Extend this reply: the model goes on from where it ended">Continue</button>
          )}
          {!live && props.isLast && (
            <button type="button" className="btn btn-ghost btn-small" data-testid="message-regenerate" disabled={props.streaming || props.blocked} onClick={props.onRegenerate}
              title="Another reply, kept beside this one (‹ › to switch)">Regenerate</button>
          )}
          {candidates.length > 0 && (
            <button type="button" className="btn btn-ghost btn-small" data-testid="message-show-request" onClick={() => props.onShowRequest(candidates)}>Show in timeline</button>
          )}
        </div>
      </div>
    </li>
  );
}

function Versions(props: { shown: number; count: number; disabled: boolean; onVersion: (index: number) => void }) {
  return (
    <span className="versions" role="group" aria-label="Reply versions" data-testid="message-versions">
      <button type="button" className="btn btn-ghost btn-small" aria-label="Previous version" data-testid="message-version-prev"
        disabled={props.disabled || props.shown === 0} onClick={() => props.onVersion(props.shown - 1)}>‹</button>
      <span data-testid="message-version">{props.shown + 1}/{props.count}</span>
      <button type="button" className="btn btn-ghost btn-small" aria-label="Next version" data-testid="message-version-next"
        disabled={props.disabled || props.shown === props.count - 1} onClick={() => props.onVersion(props.shown + 1)}>›</button>
    </span>
  );
}

const NO_TOKENS: readonly TokenView[] = [];
