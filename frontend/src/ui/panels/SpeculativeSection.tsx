// The Engine tab's read-only "Speculative decoding" section: the setup the server started with
// (--speculative-config). Like the weights, Apply cannot change it.
import { useId } from "react";
import { speculativeName } from "../../core/spec";
import type { EngineInfo } from "../../core/wire";

export function SpeculativeSection(props: { config: EngineInfo }) {
  const titleId = useId();
  const name = speculativeName(props.config);
  return (
    <section className="weights" aria-labelledby={titleId} data-testid="settings-speculative-section">
      <h3 className="section-title" id={titleId}>
        Speculative decoding <span className="tag" title="Read-only: fixed when the server starts">fixed at start-up</span>
      </h3>
      <p className="muted small">
        Set with <code>--speculative-config</code> (vLLM's JSON, e.g. <code>{'{"method":"ngram","num_speculative_tokens":4}'}</code>) when the
        server starts. Drafted tokens are verified by the model in one pass; greedy output is unchanged.
      </p>
      <dl className="weights-grid">
        <div><dt>Setup</dt><dd data-testid="settings-speculative" data-state={name === "off" ? "off" : "on"}>{name}</dd></div>
      </dl>
    </section>
  );
}
