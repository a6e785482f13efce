import { describe, expect, it } from "vitest";
import { ring, ringItems, ringLast, ringLength, ringPush, ringTail } from "./ring";

describe("ring", () => {
  it("keeps the newest cap items", () => {
    let r = ring<number>(3);
    r = ringPush(r, [1, 2]);
    r = ringPush(r, [3, 4, 5]);
    expect(ringItems(r)).toEqual([3, 4, 5]);
    expect(ringLength(r)).toBe(3);
    expect(ringLast(r)).toBe(5);
    expect(ringTail(r, 2)).toEqual([4, 5]);
  });

  it("older rings read the same after newer ones grow (value semantics)", () => {
    const a = ringPush(ring<number>(4), [1, 2]);
    const b = ringPush(a, [3]);
    const c = ringPush(a, [9]); // branches from a: must not see 3
    expect(ringItems(a)).toEqual([1, 2]);
    expect(ringItems(b)).toEqual([1, 2, 3]);
    expect(ringItems(c)).toEqual([1, 2, 9]);
    const d = ringPush(b, [4, 5, 6, 7, 8, 9, 10, 11, 12]);
    expect(ringItems(d)).toEqual([9, 10, 11, 12]);
    expect(ringItems(b)).toEqual([1, 2, 3]);
  });

  it("compacts its buffer", () => {
    let r = ring<number>(10);
    for (let i = 0; i < 1000; i++) r = ringPush(r, [i]);
    expect(r.buf.length).toBeLessThanOrEqual(21);
    expect(ringItems(r)).toEqual([990, 991, 992, 993, 994, 995, 996, 997, 998, 999]);
  });
});
