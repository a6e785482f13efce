// @vitest-environment jsdom
// The conversation follows new content while the reader is at its end, decided when they scroll:
// a list that got shorter (the Decoding settings opened above it) still follows.
import { act, cleanup, fireEvent, render, screen } from "@testing-library/react";
import { useRef } from "react";
import { afterEach, describe, expect, it, vi } from "vitest";
import { atEnd, useStickToBottom } from "./useStickToBottom";

/** jsdom has no layout: the list's geometry is set by hand. */
function geometry(el: HTMLElement, g: { scrollHeight: number; clientHeight: number }) {
  Object.defineProperty(el, "scrollHeight", { configurable: true, get: () => g.scrollHeight });
  Object.defineProperty(el, "clientHeight", { configurable: true, get: () => g.clientHeight });
}

function List(props: { items: string[] }) {
  const ref = useRef<HTMLOListElement | null>(null);
  const { onScroll } = useStickToBottom(ref, props.items);
  return <ol ref={ref} onScroll={onScroll} data-testid="list">{props.items.map((x) => <li key={x}>{x}</li>)}</ol>;
}

describe("stick to the bottom", () => {
  afterEach(cleanup);

  it("measures the end with some slack", () => {
    expect(atEnd({ scrollHeight: 1000, scrollTop: 600, clientHeight: 400 })).toBe(true);
    expect(atEnd({ scrollHeight: 1000, scrollTop: 560, clientHeight: 400 })).toBe(true);
    expect(atEnd({ scrollHeight: 1000, scrollTop: 300, clientHeight: 400 })).toBe(false);
  });

  it("keeps following after the list shrinks without a scroll, and stops once the reader scrolls up", () => {
    const g = { scrollHeight: 1000, clientHeight: 400 };
    const { rerender } = render(<List items={["a"]} />);
    const list = screen.getByTestId("list");
    geometry(list, g);
    rerender(<List items={["a", "b"]} />);
    expect(list.scrollTop).toBe(1000);
    // the Decoding settings open: the list is 100 px tall now, its end 300 px further, no scroll event
    g.clientHeight = 100;
    g.scrollHeight = 1400;
    rerender(<List items={["a", "b", "c"]} />);
    expect(list.scrollTop).toBe(1400);
    // the reader scrolls up: new content no longer moves the list
    act(() => {
      list.scrollTop = 200;
      fireEvent.scroll(list);
    });
    g.scrollHeight = 1600;
    rerender(<List items={["a", "b", "c", "d"]} />);
    expect(list.scrollTop).toBe(200);
    // back at the end: it follows again
    act(() => {
      list.scrollTop = 1500;
      fireEvent.scroll(list);
    });
    g.scrollHeight = 1800;
    rerender(<List items={["a", "b", "c", "d", "e"]} />);
    expect(list.scrollTop).toBe(1800);
  });

  it("follows with the page where the list grows inside it (the phone layout), until the reader scrolls up", () => {
    const page = { scrollHeight: 2000, clientHeight: 800 };
    geometry(document.documentElement, page);
    const scrollTo = vi.spyOn(window, "scrollTo").mockImplementation(() => undefined);
    const { rerender } = render(<List items={["a"]} />);
    const list = screen.getByTestId("list");
    geometry(list, { scrollHeight: 900, clientHeight: 900 });  // not a scroll box
    rerender(<List items={["a", "b"]} />);
    expect(scrollTo).toHaveBeenLastCalledWith(0, 2000);
    expect(list.scrollTop).toBe(0);
    act(() => {
      document.documentElement.scrollTop = 300;  // the reader went up the page
      fireEvent.scroll(window);
    });
    scrollTo.mockClear();
    rerender(<List items={["a", "b", "c"]} />);
    expect(scrollTo).not.toHaveBeenCalled();
    scrollTo.mockRestore();
  });
});
