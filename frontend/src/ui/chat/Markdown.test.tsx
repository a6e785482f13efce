// @vitest-environment jsdom
import { act, cleanup, fireEvent, render, screen } from "@testing-library/react";
import { afterEach, describe, expect, it, vi } from "vitest";
import { Markdown, RawCode } from "./Markdown";

describe("Markdown replies", () => {
  afterEach(() => {
    cleanup();
    vi.unstubAllGlobals();
  });

  it("renders Markdown and GFM tables, never raw HTML", () => {
    const text = "# Title\n\nSome **bold** and `code`.\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n<img src=x onerror=alert(1)><script>alert(1)</script>";
    render(<Markdown text={text} streaming={false} testId="md" />);
    const md = screen.getByTestId("md");
    expect(md.querySelector("h1")?.textContent).toBe("Title");
    expect(md.querySelector("strong")?.textContent).toBe("bold");
    expect(md.querySelectorAll("td").length).toBe(2);
    expect(md.querySelector("img")).toBeNull();
    expect(md.querySelector("script")).toBeNull();
  });

  it("gives each code block a copy button that copies the code", async () => {
    const writeText = vi.fn(async () => undefined);
    vi.stubGlobal("navigator", { clipboard: { writeText } });
    render(<Markdown text={"Run:\n\n```python\nprint('hi')\n```\n\nand\n\n```\nls\n```"} streaming={false} testId="md" />);
    const buttons = screen.getAllByTestId("copy-code");
    expect(buttons.length).toBe(2);
    await act(async () => {
      fireEvent.click(buttons[0]!);
    });
    expect(writeText).toHaveBeenCalledWith("print('hi')\n");
    expect(buttons[0]!.dataset.state).toBe("copied");
    // the button adds no text of its own to the reply's text
    expect(screen.getByTestId("md").textContent).not.toMatch(/copy/i);
  });

  it("shows a structured reply as it came, in a code block", () => {
    render(<RawCode text={'{"city": "Paris_1", "n": "a\\"b"}'} streaming={false} testId="raw" />);
    expect(screen.getByTestId("raw").textContent).toBe('{"city": "Paris_1", "n": "a\\"b"}');
  });
});
