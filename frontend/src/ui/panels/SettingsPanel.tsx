// Engine settings: GET / PUT /api/config. The server rebuilds the engine when it is idle (409 while busy).
// Below them, read-only, the weights as loaded (precision, memory, kernels) and the speculative
// decoding setup: PUT cannot change those.
import { useEffect, useState } from "react";
import { ApiError, getConfig, putConfig } from "../../api/client";
import type { ConfigUpdate, EngineInfo } from "../../core/wire";
import { NumberField, Select, Toggle } from "../components/fields";
import { SpeculativeSection } from "./SpeculativeSection";
import { WeightsSection } from "./WeightsSection";

type Form = Required<{ [K in keyof ConfigUpdate]: NonNullable<ConfigUpdate[K]> }>;
type KvCacheDtype = Form["kv_cache_dtype"];

// The pool's element types a user picks between ("auto" is the server's default: the model's dtype, or
// float16 for 4/8-bit weights on a CPU; shown resolved). A narrower type holds twice the tokens in the
// same memory.
const KV_DTYPES: readonly { value: KvCacheDtype; label: string }[] = [
  { value: "float32", label: "float32" },
  { value: "float16", label: "float16 (half the memory a token)" },
  { value: "bfloat16", label: "bfloat16 (half the memory a token)" },
  { value: "int8", label: "int8 (8 bits + a scale per token and head: ~0.52x float16's memory a token)" },
  { value: "fp8_e4m3", label: "fp8_e4m3 (as int8, coarser; read in torch only)" },
];

export function formOf(c: EngineInfo): Form {
  return {
    num_blocks: c.num_blocks,
    block_size: c.block_size,
    max_num_batched_tokens: c.max_num_batched_tokens,
    max_num_seqs: c.max_num_seqs,
    enable_prefix_caching: c.enable_prefix_caching,
    // a server from before the option ran its pool in the model's dtype
    kv_cache_dtype: (KV_DTYPES.find((d) => d.value === c.kv_cache_dtype)?.value ?? c.dtype) as KvCacheDtype,
  };
}

export function changedFields(current: EngineInfo, form: Form): ConfigUpdate {
  const now = formOf(current);
  const out: ConfigUpdate = {};
  for (const k of Object.keys(form) as (keyof Form)[]) {
    if (form[k] !== now[k]) (out as Record<string, unknown>)[k] = form[k];
  }
  return out;
}

export function SettingsPanel(props: { liveConfig: EngineInfo | null }) {
  const [config, setConfig] = useState<EngineInfo | null>(null);
  const [form, setForm] = useState<Form | null>(null);
  const [status, setStatus] = useState<{ kind: "ok" | "error" | "info"; text: string } | null>(null);
  const [busy, setBusy] = useState(false);
  const live = props.liveConfig;

  useEffect(() => {
    let cancelled = false;
    getConfig()
      .then((c) => {
        if (cancelled) return;
        setConfig(c);
        setForm(formOf(c));
      })
      .catch(() => {
        if (cancelled || live === null || live.model === "") return;
        setConfig(live);
        setForm(formOf(live));
      });
    return () => {
      cancelled = true;
    };
    // re-read when the engine is rebuilt (the live snapshot's config changes)
  }, [live?.num_blocks, live?.block_size, live?.max_num_batched_tokens, live?.max_num_seqs, live?.enable_prefix_caching, live?.kv_cache_dtype]); // eslint-disable-line react-hooks/exhaustive-deps

  if (config === null || form === null) {
    return <div className="empty" role="status" data-testid="settings-empty">Engine settings load from <code>/api/config</code> once the server is reachable.</div>;
  }
  const update = changedFields(config, form);
  const dirty = Object.keys(update).length > 0;
  const set = <K extends keyof Form>(k: K, v: Form[K] | null) => {
    if (v !== null) setForm({ ...form, [k]: v });
  };

  const apply = async () => {
    setBusy(true);
    setStatus({ kind: "info", text: "Rebuilding the engine…" });
    try {
      const next = await putConfig(update);
      const c = next && typeof next === "object" && "num_blocks" in next ? next : await getConfig();
      setConfig(c);
      setForm(formOf(c));
      setStatus({ kind: "ok", text: `Applied: ${c.num_blocks} blocks × ${c.block_size} tokens (${c.kv_cache_dtype ?? c.dtype}), budget ${c.max_num_batched_tokens}, max ${c.max_num_seqs} sequences.` });
    } catch (err) {
      const text = err instanceof ApiError && err.status === 409
        ? `The engine is busy (${err.message}). Settings apply when no request is running.`
        : `Not applied: ${(err as Error).message}`;
      setStatus({ kind: "error", text });
    } finally {
      setBusy(false);
    }
  };

  return (
    <div className="settings-tab">
      <form className="settings" data-testid="settings-panel" onSubmit={(e) => { e.preventDefault(); void apply(); }}>
        <p className="muted small">
          {config.model} · {config.dtype} on {config.device} · max model length {config.max_model_len}. Shrink the KV pool and run the load
          generator to watch preemption happen.
        </p>
        <div className="form-grid">
          <NumberField label="KV blocks" value={form.num_blocks} min={1} onChange={(v) => set("num_blocks", v)} testId="settings-num-blocks" hint="Size of the paged KV-cache pool" />
          <NumberField label="Block size (tokens)" value={form.block_size} min={1} onChange={(v) => set("block_size", v)} testId="settings-block-size" />
          <NumberField label="Token budget per step" value={form.max_num_batched_tokens} min={1} onChange={(v) => set("max_num_batched_tokens", v)} testId="settings-max-batched-tokens" hint="max_num_batched_tokens" />
          <NumberField label="Max running sequences" value={form.max_num_seqs} min={1} onChange={(v) => set("max_num_seqs", v)} testId="settings-max-seqs" />
          <Select label="KV cache dtype" value={form.kv_cache_dtype} options={KV_DTYPES} onChange={(v) => set("kv_cache_dtype", v)} testId="settings-kv-dtype" />
        </div>
        <Toggle label="Prefix caching" checked={form.enable_prefix_caching} onChange={(v) => set("enable_prefix_caching", v)} testId="settings-prefix-caching" />
        <div className="row gap">
          <button type="submit" className="btn btn-primary" data-testid="settings-apply" disabled={!dirty || busy}>Apply</button>
          <button type="button" className="btn" data-testid="settings-reset" disabled={!dirty || busy} onClick={() => setForm(formOf(config))}>Reset</button>
        </div>
        {status && <p className={`small ${status.kind === "error" ? "error-text" : status.kind === "ok" ? "ok-text" : "muted"}`} role={status.kind === "error" ? "alert" : "status"} data-testid="settings-status">{status.text}</p>}
      </form>
      <WeightsSection config={config} />
      <SpeculativeSection config={config} />
    </div>
  );
}
