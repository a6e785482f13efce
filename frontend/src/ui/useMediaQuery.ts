// Whether a CSS media query matches, kept current as the window changes (rotation, resizing).
import { useCallback, useSyncExternalStore } from "react";

/** The phone layout's breakpoint: one pane at a time (Chat / Dashboard tabs) and one page scroll.
 *  styles.css repeats the width in its "phone" @media block; change both together. */
export const NARROW_QUERY = "(max-width: 760px)";

const supported = () => typeof window !== "undefined" && typeof window.matchMedia === "function";

export function useMediaQuery(query: string): boolean {
  const subscribe = useCallback((onChange: () => void) => {
    if (!supported()) return () => undefined;
    const mq = window.matchMedia(query);
    mq.addEventListener("change", onChange);
    return () => mq.removeEventListener("change", onChange);
  }, [query]);
  // No matchMedia (jsdom, very old browsers): treat the query as not matching, i.e. the wide layout.
  const snapshot = () => supported() && window.matchMedia(query).matches;
  return useSyncExternalStore(subscribe, snapshot, () => false);
}
