// Chat playground: multi-turn streaming chat with Stop, regenerate, edit & resend, per-message stats,
// structured output and tool calls, and a token view coloured by probability (accepted speculative
// drafts and grammar-constrained tokens marked, from the live engine's events for the message's request).
import { useEffect, useReducer, useRef, useState } from "react";
import { describeRequest, requestProblem, type DecodingParams, type TokenView } from "../../core/openai";
import type { DashboardStore } from "../../live/store";
import { EmptyState } from "../components/Card";
import { Toggle } from "../components/fields";
import { activeChoice, chatReducer, clockMs, historyBefore, initialChat, isStreaming, requestCandidates, type AssistantTurn, type Turn } from "./chatState";
import { DecodingControls } from "./DecodingControls";
import { MessageStats } from "./MessageStats";
import { LiveTokenText } from "./LiveTokenText";
import { ToolCalls } from "./ToolCalls";
import { useStreams } from "./useStream";

let counter = 0;
const nextId = (prefix: string) => `${prefix}${++counter}`;

export function ChatPanel(props: {
  model: string | null;
  params: DecodingParams;
  setParams: (p: DecodingParams) => void;
  onShowRequest: (candidates: string[]) => boolean;
  /** The live engine state: which tokens came from accepted drafts (none shown without it). */
  engine?: DashboardStore;
}) {
  const [chat, dispatch] = useReducer(chatReducer, initialChat);
  const [input, setInput] = useState("");
  const [tokenView, setTokenView] = useState(true);
  const [editing, setEditing] = useState<{ id: string; text: string } | null>(null);
  const { run, stop } = useStreams(dispatch, props.model);
  const streaming = isStreaming(chat);
  const listRef = useRef<HTMLOListElement | null>(null);
  const { params } = props;
  const problem = requestProblem(params);

  useEffect(() => {
    const el = listRef.current;
    if (el !== null && el.scrollHeight - el.scrollTop - el.clientHeight < 120) el.scrollTop = el.scrollHeight;
  }, [chat]);

  const send = () => {
    const content = input.trim();
    if (!content || streaming || problem !== null) return;
    const userId = nextId("u");
    const assistantId = nextId("a");
    dispatch({ type: "send", userId, assistantId, content, params, at: clockMs() });
    setInput("");
    void run(assistantId, [...historyBefore(chat.turns, chat.turns.length), { role: "user", content }], params);
  };

  const regenerate = () => {
    if (streaming || problem !== null) return;
    let i = chat.turns.length - 1;
    while (i >= 0 && chat.turns[i]!.role === "assistant") i--;
    if (i < 0) return;
    const assistantId = nextId("a");
    dispatch({ type: "regenerate", assistantId, params, at: clockMs() });
    void run(assistantId, historyBefore(chat.turns, i + 1), params);
  };

  const resend = (userId: string, text: string) => {
    const i = chat.turns.findIndex((t) => t.id === userId);
    if (i < 0 || streaming || problem !== null || !text.trim()) return;
    const assistantId = nextId("a");
    dispatch({ type: "edit", userId, content: text.trim(), assistantId, params, at: clockMs() });
    setEditing(null);
    void run(assistantId, [...historyBefore(chat.turns, i), { role: "user", content: text.trim() }], params);
  };

  const lastAssistant = [...chat.turns].reverse().find((t): t is AssistantTurn => t.role === "assistant");

  return (
    <div className="chat" data-testid="chat-panel">
      <details className="decoding-details">
        <summary>
          Decoding <span className="muted">· {describeRequest(params)} · max {params.max_tokens}{params.n > 1 && params.beam_width <= 1 ? ` · n=${params.n}` : ""}</span>
        </summary>
        <DecodingControls value={params} onChange={props.setParams} />
      </details>
      <ol className="messages" ref={listRef} role="log" aria-live="polite" aria-label="Conversation" data-testid="chat-messages">
        {chat.turns.length === 0 && (
          <li className="messages-empty">
            <EmptyState title="Say something" testId="chat-empty">
              Messages stream from <code>/v1/chat/completions</code>. Watch the request appear in the timeline and its blocks fill the KV cache.
            </EmptyState>
          </li>
        )}
        {chat.turns.map((t: Turn) =>
          t.role === "user" ? (
            <li key={t.id} className="message message-user" data-testid="message-user">
              {editing?.id === t.id ? (
                <form className="edit" onSubmit={(e) => { e.preventDefault(); resend(t.id, editing.text); }}>
                  <label className="visually-hidden" htmlFor={`edit-${t.id}`}>Edit message</label>
                  <textarea id={`edit-${t.id}`} data-testid="message-edit-input" value={editing.text} rows={3} autoFocus onChange={(e) => setEditing({ id: t.id, text: e.currentTarget.value })} onKeyDown={(e) => {
                    if (e.key === "Escape") setEditing(null);
                    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); resend(t.id, editing.text); }
                  }} />
                  <div className="row gap">
                    <button type="submit" className="btn btn-small btn-primary" data-testid="message-resend" disabled={streaming || problem !== null}>Resend</button>
                    <button type="button" className="btn btn-small" onClick={() => setEditing(null)}>Cancel</button>
                  </div>
                </form>
              ) : (
                <>
                  <div className="message-text">{t.content}</div>
                  <div className="message-actions">
                    <button type="button" className="btn btn-ghost btn-small" data-testid="message-edit" disabled={streaming} onClick={() => setEditing({ id: t.id, text: t.content })}>Edit</button>
                  </div>
                </>
              )}
            </li>
          ) : (
            <AssistantMessage key={t.id} turn={t} tokenView={tokenView} isLast={t === lastAssistant} streaming={streaming} blocked={problem !== null} engine={props.engine}
              onChoose={(index) => dispatch({ type: "choose", id: t.id, index })}
              onRegenerate={regenerate}
              onStop={() => stop(t.id)}
              onShowRequest={props.onShowRequest} />
          ),
        )}
      </ol>
      <form className="composer" onSubmit={(e) => { e.preventDefault(); send(); }}>
        <label className="visually-hidden" htmlFor="chat-input">Message</label>
        <textarea
          id="chat-input"
          data-testid="chat-input"
          placeholder="Message the model… (Enter to send, Shift+Enter for a new line)"
          rows={3}
          value={input}
          onChange={(e) => setInput(e.currentTarget.value)}
          onKeyDown={(e) => {
            if (e.key === "Enter" && !e.shiftKey) {
              e.preventDefault();
              send();
            }
          }}
        />
        <div className="composer-bar">
          <Toggle label="Token view" checked={tokenView} onChange={setTokenView} testId="chat-token-view" hint="Colour tokens by probability (needs logprobs)" />
          <span className="grow" />
          {problem !== null && <span className="error-text small composer-problem" data-testid="chat-problem" title={problem}>{problem}</span>}
          <button type="button" className="btn btn-ghost btn-small" data-testid="chat-clear" disabled={streaming || chat.turns.length === 0} onClick={() => dispatch({ type: "clear" })}>Clear</button>
          {streaming ? (
            <button type="button" className="btn btn-danger" data-testid="chat-stop" onClick={() => stop()}>Stop</button>
          ) : (
            <button type="submit" className="btn btn-primary" data-testid="chat-send" disabled={!input.trim() || problem !== null} title={problem ?? undefined}>Send</button>
          )}
        </div>
      </form>
    </div>
  );
}

function AssistantMessage(props: {
  turn: AssistantTurn;
  tokenView: boolean;
  isLast: boolean;
  streaming: boolean;
  /** The current settings cannot be sent (no regenerate). */
  blocked: boolean;
  onChoose: (index: number) => void;
  onRegenerate: () => void;
  onStop: () => void;
  onShowRequest: (candidates: string[]) => boolean;
  engine?: DashboardStore;
}) {
  const t = props.turn;
  const choice = activeChoice(t);
  const live = t.status === "streaming";
  const candidates = requestCandidates(t);
  return (
    <li className={`message message-assistant status-${t.status}`} data-testid="message-assistant" data-status={t.status} data-finish={choice?.finish_reason ?? undefined}>
      <div className="message-meta muted small">
        {describeRequest(t.params)}
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
      ) : (
        <LiveTokenText tokens={choice?.tokens ?? NO_TOKENS} text={choice?.text ?? ""} tokenView={props.tokenView} streaming={live} testId="message-content"
          engine={props.engine} candidates={candidates} choiceIndex={choice?.index ?? 0} />
      )}
      {choice !== undefined && choice.tool_calls.length > 0 && <ToolCalls calls={choice.tool_calls} finishReason={choice.finish_reason} streaming={live} />}
      {t.status === "error" && <div className="error-text small" role="alert" data-testid="message-error">{t.error}</div>}
      {t.status === "stopped" && <div className="muted small">Stopped — the request was aborted on the server.</div>}
      <div className="message-footer">
        <MessageStats turn={t} />
        <div className="message-actions">
          {live && <button type="button" className="btn btn-ghost btn-small" onClick={props.onStop}>Stop</button>}
          {!live && props.isLast && (
            <button type="button" className="btn btn-ghost btn-small" data-testid="message-regenerate" disabled={props.streaming || props.blocked} onClick={props.onRegenerate}>Regenerate</button>
          )}
          {candidates.length > 0 && (
            <button type="button" className="btn btn-ghost btn-small" data-testid="message-show-request" onClick={() => props.onShowRequest(candidates)}>Show in timeline</button>
          )}
        </div>
      </div>
    </li>
  );
}

const NO_TOKENS: readonly TokenView[] = [];
