// What every panel needs: the store to show (live or replay), and the selected request.
import { createContext, useContext } from "react";
import type { DashboardStore } from "../live/store";

export type ViewMode = "live" | "replay";

export interface DashboardContextValue {
  /** The store the panels show: the live one, or the replay one in replay mode. */
  store: DashboardStore;
  mode: ViewMode;
  selected: string | null;
  select: (requestId: string | null) => void;
  /** Ask the live server for step profiles while the step-profile panel is open (absent: no server). */
  watchStepProfile?: (on: boolean) => void;
}

export const DashboardContext = createContext<DashboardContextValue | null>(null);

export function useDashboard(): DashboardContextValue {
  const value = useContext(DashboardContext);
  if (value === null) throw new Error("useDashboard outside a DashboardContext");
  return value;
}
