// A user message, with Edit: the edited text is resent and what followed it is replaced.
import type { UserTurn } from "./chatState";

export function UserMessage(props: {
  turn: UserTurn;
  /** The text being edited, or null when not editing. */
  editing: string | null;
  streaming: boolean;
  blocked: boolean;
  onEdit: (text: string | null) => void;
  onResend: (text: string) => void;
}) {
  const t = props.turn;
  const editing = props.editing;
  return (
    <li className="message message-user" data-testid="message-user">
      {editing !== null ? (
        <form className="edit" onSubmit={(e) => { e.preventDefault(); props.onResend(editing); }}>
          <label className="visually-hidden" htmlFor={`edit-${t.id}`}>Edit message</label>
          <textarea id={`edit-${t.id}`} data-testid="message-edit-input" value={editing} rows={3} autoFocus onChange={(e) => props.onEdit(e.currentTarget.value)} onKeyDown={(e) => {
            if (e.key === "Escape") props.onEdit(null);
            if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); props.onResend(editing); }
          }} />
          <div className="row gap">
            <button type="submit" className="btn btn-small btn-primary" data-testid="message-resend" disabled={props.streaming || props.blocked}>Resend</button>
            <button type="button" className="btn btn-small" onClick={() => props.onEdit(null)}>Cancel</button>
          </div>
        </form>
      ) : (
        <>
          <div className="message-text">{t.content}</div>
          <div className="message-actions">
            <button type="button" className="btn btn-ghost btn-small" data-testid="message-edit" disabled={props.streaming} onClick={() => props.onEdit(t.content)}>Edit</button>
          </div>
        </>
      )}
    </li>
  );
}
