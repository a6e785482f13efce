// @vitest-environment jsdom
import { cleanup, render, screen } from "@testing-library/react";
import { afterEach, describe, expect, it } from "vitest";
import { DiskTierSection } from "./DiskTierSection";

describe("DiskTierSection", () => {
  afterEach(cleanup);

  it("shows nothing without a disk tier", () => {
    render(<DiskTierSection stats={null} />);
    expect(screen.queryByTestId("metrics-disk-tier")).toBeNull();
  });

  it("shows what the tier holds and read back; problems only when there are some", () => {
    const { rerender } = render(<DiskTierSection stats={{ bytes_on_disk: 3 * 2 ** 20, max_bytes: 2 ** 30, blocks_read: 12, blocks_written: 40 }} />);
    expect(screen.getByTestId("disk-read").textContent).toBe("12");
    expect(screen.getByTestId("disk-written").textContent).toBe("40");
    expect(screen.getByTestId("disk-bytes").textContent).toBe("3.0 MiB / 1.00 GiB");
    expect(screen.queryByTestId("disk-problems")).toBeNull();
    rerender(<DiskTierSection stats={{ write_errors: 2, corrupt_files: 1 }} />);
    expect(screen.getByTestId("disk-problems").textContent).toBe("2 / 1");
  });
});
