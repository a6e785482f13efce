// The list of conversations (switch, delete), a new one, and export / import as JSON.
import { useRef, useState } from "react";
import { chatsFile, parseChats } from "./chatFile";
import { conversationTitle, type ChatsState, type Conversation } from "./conversations";

export function Conversations(props: {
  state: ChatsState;
  busy: boolean;
  onSwitch: (id: string) => void;
  onDelete: (id: string) => void;
  onImport: (conversations: Conversation[]) => void;
}) {
  const [importError, setImportError] = useState<string | null>(null);
  const [imported, setImported] = useState<number | null>(null);
  const fileRef = useRef<HTMLInputElement | null>(null);

  const exportAll = () => {
    const blob = new Blob([JSON.stringify(chatsFile(props.state), null, 2)], { type: "application/json" });
    const url = URL.createObjectURL(blob);
    const a = document.createElement("a");
    a.href = url;
    a.download = `minivllm-chats-${new Date().toISOString().slice(0, 19).replace(/[:T]/g, "-")}.json`;
    a.click();
    URL.revokeObjectURL(url);
  };

  const importFile = async (file: File) => {
    let text: string;
    try {
      text = await readText(file);
    } catch {
      setImported(null);
      setImportError(`${file.name}: the file could not be read`);
      return;
    }
    const parsed = parseChats(text, Date.now());
    if (!parsed.ok) {
      setImported(null);
      setImportError(`${file.name}: ${parsed.error}`);
      return;
    }
    setImportError(null);
    setImported(parsed.conversations.length);
    props.onImport(parsed.conversations);
  };

  return (
    <div className="conversations" data-testid="conversations">
      <ul className="conversation-list" aria-label="Conversations">
        {props.state.conversations.map((c) => {
          const current = c.id === props.state.activeId;
          const title = conversationTitle(c);
          return (
            <li key={c.id} className="conversation-item" aria-current={current ? "true" : undefined} data-testid="conversation">
              <button type="button" className="conversation-open" data-testid="conversation-open" onClick={() => props.onSwitch(c.id)} title={title}>
                {title} <span className="muted small">· {c.turns.filter((t) => t.role === "user").length} msg</span>
              </button>
              <button type="button" className="btn btn-ghost btn-small" data-testid="conversation-delete" aria-label={`Delete ${title}`} title="Delete this conversation"
                disabled={props.busy && current} onClick={() => props.onDelete(c.id)}>×</button>
            </li>
          );
        })}
      </ul>
      <div className="conversation-tools">
        <button type="button" className="btn btn-small" data-testid="chats-export" onClick={exportAll}>Export all (JSON)</button>
        <button type="button" className="btn btn-small" data-testid="chats-import" onClick={() => fileRef.current?.click()}>Import…</button>
        <input ref={fileRef} type="file" accept="application/json,.json" hidden data-testid="chats-import-file" onChange={(e) => {
          const file = e.currentTarget.files?.[0];
          e.currentTarget.value = "";
          if (file !== undefined) void importFile(file);
        }} />
      </div>
      {importError !== null && <div className="error-text small" role="alert" data-testid="chats-import-error">{importError}</div>}
      {imported !== null && <div className="muted small" role="status" data-testid="chats-imported">Imported {imported} conversation{imported === 1 ? "" : "s"}.</div>}
    </div>
  );
}

function readText(file: Blob): Promise<string> {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(String(reader.result));
    reader.onerror = () => reject(reader.error ?? new Error("unreadable"));
    reader.readAsText(file);
  });
}

export function SystemPrompt(props: { value: string; onChange: (text: string) => void; disabled: boolean }) {
  return (
    <details className="system-prompt" data-testid="system-prompt">
      <summary>
        System prompt <span className="muted">· {props.value.trim() ? `“${props.value.trim().slice(0, 40)}${props.value.trim().length > 40 ? "…" : ""}”` : "model default"}</span>
      </summary>
      <label className="visually-hidden" htmlFor="chat-system-prompt">System prompt</label>
      <textarea id="chat-system-prompt" data-testid="system-prompt-input" rows={3} value={props.value} disabled={props.disabled}
        placeholder="Sent as the system message of this conversation (empty: the model's template decides)"
        onChange={(e) => props.onChange(e.currentTarget.value)} />
    </details>
  );
}
