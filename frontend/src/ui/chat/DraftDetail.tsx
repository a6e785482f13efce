// One speculative verification, for a token's tooltip: the drafted tokens (accepted ones marked,
// the first rejected one struck, later ones never checked) and what the target model produced.
import { draftView, tokenLabel, type DraftStatus } from "../../core/spec";
import type { SpecVerified } from "../../core/wire";

const STATUS_TITLE: Record<DraftStatus, string> = {
  accepted: "accepted",
  rejected: "rejected: the target model disagreed here",
  unchecked: "not checked: after the first rejected draft",
};

export function DraftDetail(props: { verify: SpecVerified; texts: ReadonlyMap<number, string>; drafted: boolean }) {
  const v = draftView(props.verify, props.texts);
  return (
    <div className="draft-detail" data-testid="draft-detail">
      <div className="muted">
        {props.drafted ? "Accepted draft" : v.target.kind === "bonus" ? "Bonus token after an accepted draft" : "Correction after a rejected draft"}
        {" · "}{v.method} · step {v.step} · {v.accepted} of {v.proposed.length} accepted
      </div>
      <ol className="draft-tokens" aria-label="Drafted tokens">
        {v.proposed.map((t, i) => (
          <li key={i} className={`draft-token draft-${t.status}`} data-testid="draft-token" data-status={t.status} title={STATUS_TITLE[t.status]}>
            {t.status === "accepted" && <span aria-hidden="true">✓ </span>}
            {t.status === "rejected" ? <s className="mono">{tokenLabel(t)}</s> : <span className="mono">{tokenLabel(t)}</span>}
            <span className="visually-hidden"> ({t.status})</span>
          </li>
        ))}
      </ol>
      <div data-testid="draft-target">
        <span className="muted">{v.target.kind === "bonus" ? "then the target's bonus token " : "target chose "}</span>
        <span className="mono">{tokenLabel(v.target)}</span>
      </div>
    </div>
  );
}
