// An assistant reply rendered as Markdown (GitHub's flavour: tables, strike-through, task lists).
// react-markdown builds React elements from the syntax tree and does not render raw HTML, so a
// reply cannot inject markup. Code blocks get a copy button.
import { memo, useRef, useState, type ComponentPropsWithoutRef } from "react";
import ReactMarkdown, { type Components } from "react-markdown";
import remarkGfm from "remark-gfm";
import "./chat.css";

export function CopyButton(props: { text: () => string; label?: string }) {
  const [state, setState] = useState<"idle" | "copied" | "failed">("idle");
  const copy = () => {
    const clip = typeof navigator !== "undefined" ? navigator.clipboard : undefined;
    if (clip === undefined) {
      setState("failed");
      return;
    }
    clip.writeText(props.text()).then(() => setState("copied"), () => setState("failed"));
    window.setTimeout(() => setState("idle"), 1500);
  };
  return (
    <button type="button" className="btn btn-ghost btn-small copy-button" data-testid="copy-code" data-state={state} onClick={copy}
      aria-label={props.label ?? "Copy code"} title={state === "copied" ? "Copied" : state === "failed" ? "Could not copy" : (props.label ?? "Copy code")}>
      {/* an icon, so the button adds no text to the reply's text */}
      <svg width="14" height="14" viewBox="0 0 16 16" aria-hidden="true" focusable="false">
        {state === "copied" ? <path d="M3 8.5l3 3 7-7" stroke="currentColor" strokeWidth="1.8" fill="none" /> : (
          <path d="M5 1.5h7.5a1 1 0 0 1 1 1V11h-1.5V3H5zM2.5 4.5h7.5a1 1 0 0 1 1 1v8a1 1 0 0 1-1 1H2.5a1 1 0 0 1-1-1v-8a1 1 0 0 1 1-1zM3 6v7h6.5V6z" fill="currentColor" />
        )}
      </svg>
    </button>
  );
}

function CodeBlock(props: ComponentPropsWithoutRef<"pre">) {
  const { children, ...rest } = props;
  const ref = useRef<HTMLPreElement | null>(null);
  return (
    <div className="code-block">
      <pre {...rest} ref={ref}>{children}</pre>
      <CopyButton text={() => ref.current?.textContent ?? ""} />
    </div>
  );
}

const COMPONENTS: Components = {
  pre: ({ node: _node, ...props }) => <CodeBlock {...props} />,
  // links leave the dashboard
  a: ({ node: _node, ...props }) => <a {...props} target="_blank" rel="noreferrer noopener" />,
};

const PLUGINS = [remarkGfm];

/** Text shown as it came, in a code block with a copy button (a structured-output reply: JSON, or
 * whatever the grammar allowed, is not Markdown). */
export function RawCode(props: { text: string; streaming: boolean; testId?: string }) {
  return (
    <div className="code-block">
      <pre className="message-text raw-code" data-testid={props.testId} data-view="raw">{props.text}{props.streaming && <span className="caret" aria-hidden="true" />}</pre>
      <CopyButton text={() => props.text} label="Copy reply" />
    </div>
  );
}

export const Markdown = memo(function Markdown(props: { text: string; streaming: boolean; testId?: string }) {
  return (
    <div className="message-text markdown" data-testid={props.testId} data-view="markdown">
      <ReactMarkdown remarkPlugins={PLUGINS} components={COMPONENTS}>{props.text}</ReactMarkdown>
      {props.streaming && <span className="caret" aria-hidden="true" />}
    </div>
  );
});
