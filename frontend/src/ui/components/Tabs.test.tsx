// @vitest-environment jsdom
// The tab strip: selection, ARIA wiring, and keyboard movement with focus following the selection.
import { cleanup, fireEvent, render, screen } from "@testing-library/react";
import { useState } from "react";
import { afterEach, describe, expect, it } from "vitest";
import { nextTab, Tabs, type TabDef } from "./Tabs";

type Id = "a" | "b" | "c";
const TABS: TabDef<Id>[] = [{ id: "a", label: "Alpha" }, { id: "b", label: "Beta" }, { id: "c", label: "Gamma" }];

function Strip() {
  const [value, setValue] = useState<Id>("a");
  return <Tabs label="Test" prefix="t" tabs={TABS} value={value} onChange={setValue} panelId={(t) => `panel-${t}`} />;
}

describe("Tabs", () => {
  afterEach(cleanup);

  it("moves with the arrows (wrapping), Home and End, and ignores other keys", () => {
    expect(nextTab(TABS, "a", "ArrowRight")).toBe("b");
    expect(nextTab(TABS, "c", "ArrowRight")).toBe("a");
    expect(nextTab(TABS, "a", "ArrowLeft")).toBe("c");
    expect(nextTab(TABS, "b", "Home")).toBe("a");
    expect(nextTab(TABS, "a", "End")).toBe("c");
    expect(nextTab(TABS, "a", "Enter")).toBeNull();
    expect(nextTab([], "a", "ArrowRight")).toBeNull();
  });

  it("selects on click and on keys, keeps one tab in the Tab order, and names its panels", () => {
    render(<Strip />);
    const tab = (id: Id) => screen.getByTestId(`t-${id}`);
    expect(screen.getByRole("tablist").getAttribute("aria-label")).toBe("Test");
    expect(tab("b").getAttribute("aria-controls")).toBe("panel-b");
    expect(tab("a").getAttribute("aria-selected")).toBe("true");
    fireEvent.click(tab("c"));
    expect(tab("c").getAttribute("aria-selected")).toBe("true");
    expect(tab("a").getAttribute("aria-selected")).toBe("false");
    expect(TABS.map((t) => tab(t.id).tabIndex)).toEqual([-1, -1, 0]);
    fireEvent.keyDown(tab("c"), { key: "ArrowRight" });
    expect(tab("a").getAttribute("aria-selected")).toBe("true");
    expect(document.activeElement).toBe(tab("a"));
    fireEvent.keyDown(tab("a"), { key: "End" });
    expect(document.activeElement).toBe(tab("c"));
    fireEvent.keyDown(tab("c"), { key: "x" });
    expect(tab("c").getAttribute("aria-selected")).toBe("true");
  });
});
