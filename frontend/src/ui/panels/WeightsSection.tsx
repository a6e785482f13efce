// The Engine tab's read-only "Weights" section: precision, weight memory, how decode steps run
// (compiled or eager, and why) and the kernels chosen at load.
// Unlike the settings above it, none of this can change while the server runs.
import { useId } from "react";
import type { EngineInfo } from "../../core/wire";
import { precisionName, weightMemoryDetail } from "../../core/weights";

export function WeightsSection(props: { config: EngineInfo }) {
  const c = props.config;
  const titleId = useId();
  const memory = weightMemoryDetail(c);
  const kernels = c.kernels ?? [];
  return (
    <section className="weights" aria-labelledby={titleId} data-testid="settings-weights">
      <h3 className="section-title" id={titleId}>
        Weights <span className="tag" title="Read-only: fixed when the model loads">fixed at load</span>
      </h3>
      <p className="muted small">
        Set with <code>--quantization</code> (or <code>MINIVLLM_QUANTIZATION</code>) and <code>--enforce-eager</code> when
        the server starts. Apply rebuilds the KV cache and scheduler, never the weights.
      </p>
      <dl className="weights-grid">
        <div><dt>Precision</dt><dd data-testid="settings-precision">{precisionName(c)}</dd></div>
        {memory !== null && <div><dt>Memory</dt><dd data-testid="settings-weight-memory">{memory}</dd></div>}
        {c.compilation !== undefined && (
          <div><dt>Decode step</dt><dd data-testid="settings-compilation">{c.compilation}</dd></div>
        )}
      </dl>
      {kernels.length > 0 && <KernelList lines={kernels} />}
    </section>
  );
}

function KernelList(props: { lines: readonly string[] }) {
  const titleId = useId();
  return (
    <div className="kernels">
      <div className="field-label" id={titleId}>Kernels chosen at load (per layer shape, by measured speed)</div>
      <ul className="kernel-list mono" aria-labelledby={titleId} data-testid="settings-kernels">
        {props.lines.map((line, i) => <li key={i} data-testid="settings-kernel">{line}</li>)}
      </ul>
    </div>
  );
}
