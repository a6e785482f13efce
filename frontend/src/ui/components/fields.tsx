// Small labelled form controls (every control has a visible label and a stable test id).
import { useId, type ReactNode } from "react";

export function NumberField(props: {
  label: string;
  value: number | null;
  onChange: (v: number | null) => void;
  min?: number;
  max?: number;
  step?: number;
  testId?: string;
  placeholder?: string;
  allowEmpty?: boolean;
  hint?: string;
  disabled?: boolean;
}) {
  const id = useId();
  return (
    <label className="field" htmlFor={id} title={props.hint}>
      <span className="field-label">{props.label}</span>
      <input
        id={id}
        type="number"
        inputMode="decimal"
        data-testid={props.testId}
        value={props.value ?? ""}
        min={props.min}
        max={props.max}
        step={props.step ?? 1}
        placeholder={props.placeholder}
        disabled={props.disabled}
        onChange={(e) => {
          const raw = e.currentTarget.value;
          if (raw === "") {
            if (props.allowEmpty) props.onChange(null);
            return;
          }
          const v = Number(raw);
          if (Number.isFinite(v)) props.onChange(v);
        }}
      />
    </label>
  );
}

export function RangeField(props: {
  label: string;
  value: number;
  onChange: (v: number) => void;
  min: number;
  max: number;
  step: number;
  testId?: string;
  format?: (v: number) => string;
  hint?: string;
  disabled?: boolean;
}) {
  const id = useId();
  return (
    <div className="field range-field" title={props.hint}>
      <label className="field-label" htmlFor={id}>
        {props.label}
        <output htmlFor={id} className="field-value">{props.format ? props.format(props.value) : props.value}</output>
      </label>
      <input
        id={id}
        type="range"
        data-testid={props.testId}
        min={props.min}
        max={props.max}
        step={props.step}
        value={props.value}
        disabled={props.disabled}
        onChange={(e) => props.onChange(Number(e.currentTarget.value))}
      />
    </div>
  );
}

export function Toggle(props: { label: ReactNode; checked: boolean; onChange: (v: boolean) => void; testId?: string; disabled?: boolean; hint?: string }) {
  const id = useId();
  return (
    <label className="toggle" htmlFor={id} title={props.hint}>
      <input id={id} type="checkbox" role="switch" data-testid={props.testId} checked={props.checked} disabled={props.disabled} onChange={(e) => props.onChange(e.currentTarget.checked)} />
      <span className="toggle-track" aria-hidden="true" />
      <span>{props.label}</span>
    </label>
  );
}

export function Select<T extends string>(props: {
  label: string;
  value: T;
  options: readonly { value: T; label: string }[];
  onChange: (v: T) => void;
  testId?: string;
  hideLabel?: boolean;
  disabled?: boolean;
}) {
  const id = useId();
  return (
    <label className={`field ${props.hideLabel ? "field-inline" : ""}`} htmlFor={id}>
      <span className={props.hideLabel ? "visually-hidden" : "field-label"}>{props.label}</span>
      <select id={id} data-testid={props.testId} value={props.value} disabled={props.disabled} onChange={(e) => props.onChange(e.currentTarget.value as T)}>
        {props.options.map((o) => (
          <option key={o.value} value={o.value}>{o.label}</option>
        ))}
      </select>
    </label>
  );
}

/** A labelled multi-line text field; `error` is shown under it (and marks it invalid) when set. */
export function TextAreaField(props: {
  label: string;
  value: string;
  onChange: (v: string) => void;
  rows?: number;
  testId?: string;
  error?: string | null;
  errorTestId?: string;
  placeholder?: string;
  hint?: ReactNode;
  mono?: boolean;
}) {
  const id = useId();
  const errorId = `${id}-error`;
  const invalid = props.error !== undefined && props.error !== null;
  return (
    <div className="field textarea-field">
      <label className="field-label" htmlFor={id}>{props.label}</label>
      <textarea
        id={id}
        className={props.mono ? "mono" : undefined}
        data-testid={props.testId}
        value={props.value}
        rows={props.rows ?? 4}
        placeholder={props.placeholder}
        spellCheck={false}
        aria-invalid={invalid}
        aria-describedby={invalid ? errorId : undefined}
        onChange={(e) => props.onChange(e.currentTarget.value)}
      />
      {props.hint !== undefined && <span className="muted small">{props.hint}</span>}
      {invalid && <span id={errorId} className="error-text small" aria-live="polite" data-testid={props.errorTestId}>{props.error}</span>}
    </div>
  );
}
