// Keeps a scrolling list at its end as content arrives, while the reader is there. Whether they are
// is decided when they scroll, not when content arrives: a list that got shorter in the meantime
// (the Decoding settings opened above it) has its end further away without anyone scrolling up,
// and measuring then took that for the reader having left.
import { useCallback, useLayoutEffect, useRef, type RefObject, type UIEvent } from "react";

/** Within this many pixels of the end counts as at the end. */
const SLACK_PX = 48;

export function atEnd(el: Pick<HTMLElement, "scrollHeight" | "scrollTop" | "clientHeight">): boolean {
  return el.scrollHeight - el.scrollTop - el.clientHeight <= SLACK_PX;
}

export function useStickToBottom<T extends HTMLElement>(ref: RefObject<T | null>, content: unknown) {
  const pinned = useRef(true);
  const onScroll = useCallback((e: UIEvent<T>) => {
    pinned.current = atEnd(e.currentTarget);
  }, []);
  useLayoutEffect(() => {
    const el = ref.current;
    if (el !== null && pinned.current) el.scrollTop = el.scrollHeight;
  }, [ref, content]);
  /** Back to the end (sending a message: the reader wants to see the reply). */
  const pin = useCallback(() => {
    pinned.current = true;
  }, []);
  return { onScroll, pin };
}
