// Keeps a scrolling list at its end as content arrives, while the reader is there. Whether they are
// is decided when they scroll, not when content arrives: a list that got shorter in the meantime
// (the Decoding settings opened above it) has its end further away without anyone scrolling up,
// and measuring then took that for the reader having left.
// On a phone the list is not a scroll box (the page scrolls as one): then the page follows, while its
// reader is at its end.
import { useCallback, useEffect, useLayoutEffect, useRef, type RefObject, type UIEvent } from "react";

/** Within this many pixels of the end counts as at the end. */
const SLACK_PX = 48;

export function atEnd(el: Pick<HTMLElement, "scrollHeight" | "scrollTop" | "clientHeight">): boolean {
  return el.scrollHeight - el.scrollTop - el.clientHeight <= SLACK_PX;
}

/** Whether the element scrolls its own content (rather than growing with it inside the page). */
export function scrollsItself(el: Pick<HTMLElement, "scrollHeight" | "clientHeight">): boolean {
  return el.scrollHeight > el.clientHeight + 1;
}

export function useStickToBottom<T extends HTMLElement>(ref: RefObject<T | null>, content: unknown) {
  const pinned = useRef(true);
  const pagePinned = useRef(true);
  const onScroll = useCallback((e: UIEvent<T>) => {
    pinned.current = atEnd(e.currentTarget);
  }, []);
  useEffect(() => {
    const onPageScroll = () => {
      pagePinned.current = atEnd(document.documentElement);
    };
    window.addEventListener("scroll", onPageScroll, { passive: true });
    return () => window.removeEventListener("scroll", onPageScroll);
  }, []);
  useLayoutEffect(() => {
    const el = ref.current;
    if (el === null) return;
    if (scrollsItself(el)) {
      if (pinned.current) el.scrollTop = el.scrollHeight;
    } else if (pagePinned.current) {
      const page = document.documentElement;
      if (page.scrollHeight > page.clientHeight) window.scrollTo(0, page.scrollHeight);
    }
  }, [ref, content]);
  /** Back to the end (sending a message: the reader wants to see the reply). */
  const pin = useCallback(() => {
    pinned.current = true;
    pagePinned.current = true;
  }, []);
  return { onScroll, pin };
}
