// The conversations, kept in local storage across reloads: read once when the chat mounts, written
// after each change (at most once a second while a reply streams; at once when it ends).
import { useEffect, useReducer, useRef, useState } from "react";
import { loadChats, saveChats } from "./chatFile";
import { chatsReducer, initialChats, uniqueId, type ChatsState } from "./conversations";
import { isStreaming } from "./chatState";

const STREAMING_SAVE_MS = 1000;

function storage(): Storage | null {
  try {
    return typeof localStorage === "undefined" ? null : localStorage;
  } catch {
    return null; // storage blocked (privacy settings)
  }
}

function initial(): ChatsState {
  const now = Date.now();
  return loadChats(storage(), now) ?? initialChats(uniqueId("c"), now);
}

export function useChats() {
  const [state, dispatch] = useReducer(chatsReducer, undefined, initial);
  const [saveProblem, setSaveProblem] = useState<string | null>(null);
  const lastSave = useRef(0);

  useEffect(() => {
    const save = () => {
      lastSave.current = Date.now();
      setSaveProblem(saveChats(storage(), state));
    };
    const streaming = state.conversations.some((c) => isStreaming({ turns: c.turns }));
    if (!streaming) {
      save();
      return undefined;
    }
    const wait = Math.max(0, lastSave.current + STREAMING_SAVE_MS - Date.now());
    const timer = window.setTimeout(save, wait);
    return () => window.clearTimeout(timer);
  }, [state]);

  return { state, dispatch, saveProblem };
}
