// Speculative decoding's drafted / accepted counts for a reply's request, from the live engine's
// events (the API's stream does not carry them).
import { useSyncExternalStore } from "react";
import type { RequestSpec } from "../../core/dashboard";
import type { DashboardStore } from "../../live/store";
import { findRequest, type SpecCounts } from "./chatState";

/** The counts for the request among `candidates` (its ids as the chat knows them), or null. */
export function specCountsFor(spec: ReadonlyMap<string, RequestSpec>, candidates: readonly string[]): SpecCounts | null {
  const id = findRequest(spec.keys(), candidates);
  const s = id === null ? undefined : spec.get(id);
  return s === undefined ? null : { drafted: s.draftTokens, accepted: s.accepted };
}

export function useRequestSpec(store: DashboardStore | undefined, candidates: readonly string[]): SpecCounts | null {
  const key = candidates.join("\n");
  // the snapshot must be stable between calls: a string, turned back into counts below
  const get = () => {
    if (store === undefined || key === "") return "";
    const c = specCountsFor(store.getUiState().spec, key.split("\n"));
    return c === null ? "" : `${c.drafted}/${c.accepted}`;
  };
  const snap = useSyncExternalStore(store?.subscribe ?? noSubscription, get, get);
  if (snap === "") return null;
  const [drafted, accepted] = snap.split("/").map(Number);
  return { drafted: drafted!, accepted: accepted! };
}

const noSubscription = () => () => undefined;
