// An accessible tab strip (WAI-ARIA tabs pattern): one tab in the Tab order, arrows / Home / End move
// between tabs. The panels are the caller's: each tab's aria-controls names `panelId(tab)`.
import type { KeyboardEvent } from "react";

export type TabDef<T extends string> = { id: T; label: string };

/** The tab that a key moves to from `current`, or null for keys the strip does not handle. */
export function nextTab<T extends string>(tabs: readonly TabDef<T>[], current: T, key: string): T | null {
  const i = tabs.findIndex((t) => t.id === current);
  const n = tabs.length;
  if (n === 0) return null;
  switch (key) {
    case "ArrowRight": return tabs[(i + 1) % n]!.id;
    case "ArrowLeft": return tabs[(i - 1 + n) % n]!.id;
    case "Home": return tabs[0]!.id;
    case "End": return tabs[n - 1]!.id;
    default: return null;
  }
}

export function Tabs<T extends string>(props: {
  label: string;
  tabs: readonly TabDef<T>[];
  value: T;
  onChange: (tab: T) => void;
  /** Element id and test id of each tab: `${prefix}-${tab}`. */
  prefix: string;
  panelId: (tab: T) => string;
  className?: string;
}) {
  const tabId = (t: T) => `${props.prefix}-${t}`;
  const onKeyDown = (e: KeyboardEvent) => {
    const next = nextTab(props.tabs, props.value, e.key);
    if (next === null) return;
    e.preventDefault();
    props.onChange(next);
    document.getElementById(tabId(next))?.focus();
  };
  return (
    <div className={`tabs ${props.className ?? ""}`} role="tablist" aria-label={props.label}>
      {props.tabs.map((t) => (
        <button
          key={t.id}
          type="button"
          role="tab"
          id={tabId(t.id)}
          data-testid={tabId(t.id)}
          aria-controls={props.panelId(t.id)}
          aria-selected={props.value === t.id}
          tabIndex={props.value === t.id ? 0 : -1}
          onClick={() => props.onChange(t.id)}
          onKeyDown={onKeyDown}
        >
          {t.label}
        </button>
      ))}
    </div>
  );
}
