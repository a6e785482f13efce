import type { ReactNode } from "react";

export function Card(props: {
  title: ReactNode;
  actions?: ReactNode;
  children: ReactNode;
  className?: string;
  testId?: string;
  subtitle?: ReactNode;
}) {
  return (
    <section className={`card ${props.className ?? ""}`} data-testid={props.testId} aria-label={typeof props.title === "string" ? props.title : undefined}>
      <header className="card-head">
        <h2 className="card-title">{props.title}</h2>
        {props.subtitle !== undefined && <span className="card-subtitle">{props.subtitle}</span>}
        <div className="card-actions">{props.actions}</div>
      </header>
      <div className="card-body">{props.children}</div>
    </section>
  );
}

export function EmptyState(props: { title: string; children?: ReactNode; testId?: string }) {
  return (
    <div className="empty" data-testid={props.testId} role="status">
      <div className="empty-title">{props.title}</div>
      {props.children !== undefined && <div className="empty-text">{props.children}</div>}
    </div>
  );
}
