// Chat playground: conversations kept across reloads (with a system prompt each, export / import),
// multi-turn streaming chat with Stop, regenerate (the earlier replies kept as versions), Continue,
// edit & resend, per-message stats, structured output and tool calls, and a token view coloured by
// probability (accepted speculative drafts and grammar-constrained tokens marked, from the live
// engine's events for the message's request) or the reply as Markdown.
import { useCallback, useRef, useState } from "react";
import { describeRequest, requestProblem, type DecodingParams } from "../../core/openai";
import type { DashboardStore } from "../../live/store";
import { EmptyState } from "../components/Card";
import { Toggle } from "../components/fields";
import { AssistantMessage } from "./AssistantMessage";
import { clockMs, isStreaming, type AssistantTurn, type ChatAction, type SpecCounts, type Turn } from "./chatState";
import { activeConversation, conversationTitle, requestMessages, uniqueId } from "./conversations";
import { Conversations, SystemPrompt } from "./Conversations";
import { DecodingControls } from "./DecodingControls";
import { useChats } from "./useChats";
import { useStickToBottom } from "./useStickToBottom";
import { useStreams } from "./useStream";
import { UserMessage } from "./UserMessage";
import "./chat.css";

export function ChatPanel(props: {
  model: string | null;
  params: DecodingParams;
  setParams: (p: DecodingParams) => void;
  onShowRequest: (candidates: string[]) => boolean;
  /** The live engine state: which tokens came from accepted drafts (none shown without it). */
  engine?: DashboardStore;
}) {
  const { state: chats, dispatch: dispatchChats, saveProblem } = useChats();
  const chat = activeConversation(chats);
  const dispatch = useCallback((action: ChatAction) => dispatchChats({ type: "chat", action, now: Date.now() }), [dispatchChats]);
  const [input, setInput] = useState("");
  const [tokenView, setTokenView] = useState(true);
  const [showChats, setShowChats] = useState(false);
  const [editing, setEditing] = useState<{ id: string; text: string } | null>(null);
  const { run, stop } = useStreams(dispatch, props.model);
  const streaming = isStreaming(chat);
  const listRef = useRef<HTMLOListElement | null>(null);
  const { onScroll, pin } = useStickToBottom(listRef, chat.turns);
  const { params } = props;
  const problem = requestProblem(params);
  const system = chat.systemPrompt;

  const send = () => {
    const content = input.trim();
    if (!content || streaming || problem !== null) return;
    const assistantId = uniqueId("a");
    dispatch({ type: "send", userId: uniqueId("u"), assistantId, content, params, at: clockMs() });
    setInput("");
    pin();
    void run(assistantId, [...requestMessages(system, chat.turns, chat.turns.length), { role: "user", content }], params);
  };

  const regenerate = () => {
    if (streaming || problem !== null) return;
    let i = chat.turns.length - 1;
    while (i >= 0 && chat.turns[i]!.role === "assistant") i--;
    if (i < 0) return;
    const assistantId = uniqueId("a");
    dispatch({ type: "regenerate", assistantId, params, at: clockMs() });
    void run(assistantId, requestMessages(system, chat.turns, i + 1), params);
  };

  const continueLast = (t: AssistantTurn) => {
    const i = chat.turns.indexOf(t);
    const text = activeText(t);
    if (streaming || problem !== null || i < 0 || !text) return;
    const key = uniqueId("a");
    dispatch({ type: "continue", key, at: clockMs() });
    // one sequence extends the text shown; the template leaves the last assistant turn open
    const p = { ...t.params, n: 1, beam_width: 1 };
    void run(key, [...requestMessages(system, chat.turns, i), { role: "assistant", content: text }], p, { continue_final_message: true, add_generation_prompt: false });
  };

  const resend = (userId: string, text: string) => {
    const i = chat.turns.findIndex((t) => t.id === userId);
    if (i < 0 || streaming || problem !== null || !text.trim()) return;
    const assistantId = uniqueId("a");
    dispatch({ type: "edit", userId, content: text.trim(), assistantId, params, at: clockMs() });
    setEditing(null);
    void run(assistantId, [...requestMessages(system, chat.turns, i), { role: "user", content: text.trim() }], params);
  };

  const onSpec = useCallback((key: string, spec: SpecCounts) => dispatch({ type: "spec", id: key, spec }), [dispatch]);

  const deleteConversation = (id: string) => {
    const c = chats.conversations.find((x) => x.id === id);
    // its replies still streaming end with it
    for (const t of c?.turns ?? []) if (t.role === "assistant") for (const v of t.versions) if (v.status === "streaming") stop(v.key);
    dispatchChats({ type: "delete", id, freshId: uniqueId("c"), now: Date.now() });
  };

  const lastAssistant = [...chat.turns].reverse().find((t): t is AssistantTurn => t.role === "assistant");

  return (
    <div className="chat" data-testid="chat-panel" data-conversation={chat.id}>
      <div className="chat-bar">
        <button type="button" className="btn btn-ghost btn-small" aria-expanded={showChats} data-testid="chats-toggle" onClick={() => setShowChats(!showChats)}
          title="Conversations: switch, delete, export, import">☰ {chats.conversations.length}</button>
        <span className="chat-title" data-testid="chat-title" title={conversationTitle(chat)}>{conversationTitle(chat)}</span>
        <button type="button" className="btn btn-small" data-testid="chat-new" onClick={() => { setEditing(null); pin(); dispatchChats({ type: "new", id: uniqueId("c"), now: Date.now() }); }}>New chat</button>
      </div>
      {showChats && (
        <Conversations state={chats} busy={streaming}
          onSwitch={(id) => { setEditing(null); pin(); dispatchChats({ type: "switch", id }); }}
          onDelete={deleteConversation}
          onImport={(conversations) => dispatchChats({ type: "import", conversations })} />
      )}
      {saveProblem !== null && <div className="chat-notice error-text small" role="status" data-testid="chat-save-problem">{saveProblem}</div>}
      <SystemPrompt key={chat.id} value={system} disabled={streaming} onChange={(text) => dispatchChats({ type: "system", text, now: Date.now() })} />
      <details className="decoding-details">
        <summary>
          Decoding <span className="muted">· {describeRequest(params)} · max {params.max_tokens}{params.n > 1 && params.beam_width <= 1 ? ` · n=${params.n}` : ""}</span>
        </summary>
        <DecodingControls value={params} onChange={props.setParams} />
      </details>
      <ol className="messages" ref={listRef} onScroll={onScroll} role="log" aria-live="polite" aria-label="Conversation" data-testid="chat-messages">
        {chat.turns.length === 0 && (
          <li className="messages-empty">
            <EmptyState title="Say something" testId="chat-empty">
              Messages stream from <code>/v1/chat/completions</code>. Watch the request appear in the timeline and its blocks fill the KV cache.
            </EmptyState>
          </li>
        )}
        {chat.turns.map((t: Turn) =>
          t.role === "user" ? (
            <UserMessage key={t.id} turn={t} editing={editing?.id === t.id ? editing.text : null} streaming={streaming} blocked={problem !== null}
              onEdit={(text) => setEditing(text === null ? null : { id: t.id, text })} onResend={(text) => resend(t.id, text)} />
          ) : (
            <AssistantMessage key={t.id} turn={t} view={tokenView ? "tokens" : "markdown"} isLast={t === lastAssistant} streaming={streaming} blocked={problem !== null} engine={props.engine}
              onChoose={(index) => dispatch({ type: "choose", id: t.id, index })}
              onVersion={(index) => dispatch({ type: "version", id: t.id, index })}
              onRegenerate={regenerate}
              onContinue={() => continueLast(t)}
              onStop={() => stop(t.key)}
              onSpec={onSpec}
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
          <Toggle label="Token view" checked={tokenView} onChange={setTokenView} testId="chat-token-view" hint="Colour tokens by probability (needs logprobs); off: the reply as Markdown" />
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

function activeText(t: AssistantTurn): string {
  return (t.result.choices.find((c) => c.index === t.activeChoice) ?? t.result.choices[0])?.text ?? "";
}
