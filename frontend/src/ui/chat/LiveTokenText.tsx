// TokenText for a streamed reply, joined with the live engine's events for its request: the engine's
// TokenGenerated entries (aligned to the streamed tokens) say which tokens were accepted drafts.
import { useMemo, useSyncExternalStore } from "react";
import type { TokenEntry } from "../../core/dashboard";
import type { TokenView } from "../../core/openai";
import { ringItems, type Ring } from "../../core/ring";
import { alignEngineTokens, tokenTexts } from "../../core/spec";
import type { DashboardStore } from "../../live/store";
import { findRequest } from "./chatState";
import { TokenText } from "./TokenText";

export function LiveTokenText(props: {
  tokens: readonly TokenView[];
  text: string;
  tokenView: boolean;
  streaming: boolean;
  testId?: string;
  /** The live engine state; without it nothing is marked. */
  engine?: DashboardStore;
  /** The ids the reply's request may have in the engine (requestCandidates). */
  candidates: readonly string[];
  /** The choice shown (its sequence wins a tie when aligning). */
  choiceIndex: number;
  /** The indices of the tokens to show (all when absent): a tool call's markup is left out. */
  keep?: readonly number[];
}) {
  const engineTokens = useEngineTokens(props.engine, props.candidates);
  const { tokens, choiceIndex } = props;
  const aligned = useMemo(
    () => (engineTokens === undefined ? undefined : alignEngineTokens(tokens, ringItems(engineTokens), choiceIndex)),
    [engineTokens, tokens, choiceIndex],
  );
  const texts = useMemo(() => (engineTokens === undefined ? undefined : tokenTexts(ringItems(engineTokens))), [engineTokens]);
  const { keep } = props;
  // aligned on every token first (positions match the engine's), then filtered
  const shown = useMemo(() => (keep === undefined ? { tokens, aligned } : { tokens: keep.map((i) => tokens[i]!), aligned: aligned === undefined ? undefined : keep.map((i) => aligned[i]) }), [keep, tokens, aligned]);
  return <TokenText tokens={shown.tokens} text={props.text} tokenView={props.tokenView} streaming={props.streaming} testId={props.testId} engine={shown.aligned} texts={texts} />;
}

/** The live engine's generated tokens for the request (undefined until it is known). */
function useEngineTokens(store: DashboardStore | undefined, candidates: readonly string[]): Ring<TokenEntry> | undefined {
  const key = candidates.join("\n");
  const get = () => {
    if (store === undefined || key === "") return undefined;
    const tokens = store.getUiState().tokens;
    const id = findRequest(tokens.keys(), key.split("\n"));
    return id === null ? undefined : tokens.get(id);
  };
  return useSyncExternalStore(store?.subscribe ?? noSubscription, get, get);
}

const noSubscription = () => () => undefined;
