// @vitest-environment jsdom
// The media-query hook follows the window across the breakpoint and lets go of its listener.
import { act, cleanup, render, screen } from "@testing-library/react";
import { afterEach, describe, expect, it, vi } from "vitest";
import { fakeMedia } from "../test/matchMedia";
import { NARROW_QUERY, useMediaQuery } from "./useMediaQuery";

function Probe() {
  return <span data-testid="probe">{useMediaQuery(NARROW_QUERY) ? "narrow" : "wide"}</span>;
}

describe("useMediaQuery", () => {
  afterEach(() => {
    cleanup();
    vi.unstubAllGlobals();
  });

  it("matches at a phone's width and follows resizes both ways", () => {
    const media = fakeMedia(390);
    vi.stubGlobal("matchMedia", media.matchMedia);
    const { unmount } = render(<Probe />);
    expect(screen.getByTestId("probe").textContent).toBe("narrow");
    act(() => media.resize(1600));
    expect(screen.getByTestId("probe").textContent).toBe("wide");
    act(() => media.resize(760)); // the breakpoint itself is still the phone layout
    expect(screen.getByTestId("probe").textContent).toBe("narrow");
    act(() => media.resize(761));
    expect(screen.getByTestId("probe").textContent).toBe("wide");
    expect(media.listeners()).toBe(1);
    unmount();
    expect(media.listeners()).toBe(0);
  });

  it("is the wide layout where there is no matchMedia", () => {
    vi.stubGlobal("matchMedia", undefined);
    render(<Probe />);
    expect(screen.getByTestId("probe").textContent).toBe("wide");
  });
});
